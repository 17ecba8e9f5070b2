"""The ``nccl`` transport: all C + 1 endpoints are processes of one ``torch.distributed`` world.

``connect`` (collective over the whole world) creates the data group of the endpoints: Gloo on
CPU, NCCL on GPUs; its timeout is long (the link bounds its own waits: a Gloo wait that times
out closes the pair for good). The side channel is the core's store side channel (a
``TCPStore`` the decode endpoint hosts): a timed-out wait leaves it usable for the next request.

Settings: ``[transfer.nccl]`` (:class:`~cpkv_transfer_nccl.settings.NcclSettings`: the side
channel's ``hostname``). A prefill rank packs its pages of one request (or of one layer of it,
with the layer pipeline) into one contiguous buffer (``PoolBuffers.pack``: per layer its latent
pages, then their index-K pages) and sends it with one ``dist.send`` tagged with the grant's
epoch; the decode rank receives it with one ``irecv`` into a staging buffer, waits for it at
most ``transfer.timeout_s`` and places the pages at their reserved slots. Two-sided, so a late
send can never reach the pool: a receive the decode gave up stays posted with its staging
buffer, and the decode posts receives for every message the senders of a given-up request still
send (:meth:`NcclLink.abandon`): a late message is drained, never taken for a later request's
(Gloo matches by tag; NCCL in order).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cpkv.disagg import DecodeReceiver, LinkSpec, RankTransfer, TransferError, store_side_channel

from .settings import NcclSettings

__all__ = ["NcclLink", "NcclTransport"]

#: the data group's own timeout: the link bounds every wait itself (transfer.timeout_s)
DATA_TIMEOUT = timedelta(hours=1)


class NcclLink:
    """One endpoint's link (see ``cpkv.disagg.transport.Link``)."""

    one_sided = False
    writes_receiver_layout = False

    def __init__(self, spec: LinkSpec) -> None:
        """Raises: SettingsError (a bad ``[transfer.nccl]``, before any collective),
        RuntimeError (no torch.distributed world)."""
        self.opts = spec.options.parse(NcclSettings)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("the nccl transfer needs an initialized torch.distributed world "
                               "holding the C prefill ranks and the decode rank")
        self.spec = spec
        ranks = [spec.world_rank(e) for e in range(spec.cp_size + 1)]
        self.device = spec.buffers.device
        # new_group is collective over the whole world: every process calls it, in this order
        self.channel, self._store = store_side_channel(spec, self.opts.hostname, "cpkv-nccl")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.data_group = dist.new_group(ranks=ranks, backend=backend, timeout=DATA_TIMEOUT)
        #: receives the decode gave up (still posted: late bytes land in their buffers)
        self.abandoned: list[tuple[Any, torch.Tensor]] = []
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @staticmethod
    def _tag(epoch: int) -> int:
        return epoch % (1 << 30)

    def send_part(self, part: RankTransfer, dst_slots: Sequence[int], *,
                  layers: range | None = None, epoch: int = 0, fenced: Any = None) -> int:
        """One buffer per (rank, request[, layer]): the destination slots are the receiver's
        business. On GPUs the pack and the send run on a side stream, which waits for nothing:
        the caller (the core's sender worker) has waited for the CUDA event of the pages'
        writes; it returns once the send completed."""
        if len(dst_slots) != part.num_pages:
            raise ValueError(f"{len(dst_slots)} destination slots for {part.num_pages} pages")
        dst = self.spec.world_rank(self.spec.decode_endpoint)
        if self._side is not None:
            with torch.cuda.stream(self._side):
                buf = self.spec.buffers.pack(part, layers)
                dist.send(buf, dst=dst, group=self.data_group, tag=self._tag(epoch))
            self._side.synchronize()
        else:
            buf = self.spec.buffers.pack(part, layers)
            dist.send(buf, dst=dst, group=self.data_group, tag=self._tag(epoch))
        return buf.numel()

    def _post(self, part: RankTransfer, layers: range | None,
              epoch: int) -> tuple[Any, torch.Tensor]:
        """Post the receive of ``part``'s ``layers`` into a staging buffer of their size."""
        n_layers = None if layers is None else len(layers)
        buf = torch.empty(self.spec.buffers.nbytes(part.num_pages, n_layers), dtype=torch.uint8,
                          device=self.device)
        work = dist.irecv(buf, src=self.spec.world_rank(part.rank), group=self.data_group,
                          tag=self._tag(epoch))
        return work, buf

    def _wait(self, work: Any) -> bool:
        """Wait at most ``timeout_s`` for ``work`` without ever timing the group out."""
        limit = self.spec.timeout_s
        if self.device.type == "cuda":  # NCCL: completion can be polled
            import time

            end = time.monotonic() + limit
            while not work.is_completed():
                if time.monotonic() > end:
                    return False
                time.sleep(0.001)
            return True
        box: list[BaseException | None] = [None]
        ended = threading.Event()

        def wait() -> None:  # Gloo: is_completed() does not tell; wait() on a thread
            try:
                work.wait()
            except BaseException as exc:  # a peer gone: "Connection closed by peer"
                box[0] = exc
            ended.set()

        threading.Thread(target=wait, daemon=True, name="cpkv-nccl-recv").start()
        if not ended.wait(limit):
            return False
        if box[0] is not None:
            raise box[0]
        return True

    def recv_part(self, part: RankTransfer, receiver: DecodeReceiver, *,
                  layers: range | None = None, epoch: int = 0) -> int:
        work, buf = self._post(part, layers, epoch)
        if not self._wait(work):
            self.abandoned.append((work, buf))
            raise TransferError(f"rank {part.rank}'s part did not arrive within "
                                f"{self.spec.timeout_s:g} s (transfer.timeout_s)")
        receiver.place_packed(part, buf, layers=layers)
        return buf.numel()

    def abandon(self, rest: Sequence[tuple[range, RankTransfer]], epoch: int) -> None:
        """The decode gave grant ``epoch`` up before receiving ``rest`` ((layers, part) in the
        order the senders send them): post their receives into staging buffers, so the late
        messages are drained there (never placed, never matched with a later request's)."""
        for layers, part in rest:
            self.abandoned.append(self._post(part, layers, epoch))

    def close(self) -> None:
        """Groups are torn down with the world (``destroy_process_group``)."""
        self._store = None


class NcclTransport:
    """What ``load()`` returns."""

    name = "nccl"

    def connect(self, spec: LinkSpec) -> NcclLink:
        return NcclLink(spec)
