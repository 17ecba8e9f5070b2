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

Point-to-point ops: exactly one per (peer, request[, layer]) whatever the part's page runs (a
request of many non-contiguous runs is still one gather and one send per layer); the link
counts them (:attr:`NcclLink.stats`). Where the link posts several at once (the drain receives
of a given-up request: layers x parts) they go in groups of at most :data:`MAX_OPS_PER_GROUP`
(``batch_isend_irecv``): many small NCCL ops in one group can diverge or hang (PyTorch #174942).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from cpkv.disagg.api import (
    WAIT_SLICE_S,
    LinkSpec,
    PartSink,
    RankTransfer,
    SilenceClock,
    TransferTimeout,
    store_side_channel,
)

from .settings import NcclSettings

__all__ = ["MAX_OPS_PER_GROUP", "LinkStats", "NcclLink", "NcclTransport", "P2POp", "op_groups"]

#: the data group's own timeout: the link bounds every wait itself (transfer.timeout_s)
DATA_TIMEOUT = timedelta(hours=1)
#: the most point-to-point ops the link puts in one NCCL group (PyTorch #174942: larger groups
#: of small ops can diverge or hang; NCCL #725: ~980 grouped ops took 116 s, one call 1.6 s)
MAX_OPS_PER_GROUP = 256


def op_groups(n_ops: int, limit: int = MAX_OPS_PER_GROUP) -> list[range]:
    """``range(n_ops)`` cut into consecutive groups of at most ``limit`` ops."""
    if limit < 1:
        raise ValueError(f"limit = {limit}: a group holds at least one op")
    return [range(i, min(i + limit, n_ops)) for i in range(0, n_ops, limit)]


@dataclass(frozen=True)
class P2POp:
    """One point-to-point op the link issued: ``kind`` ``send`` (prefill), ``recv`` or
    ``drain`` (decode: a receive posted for a given-up request), with ``peer`` (endpoint),
    the grant's ``epoch``, the ``layers`` its buffer holds and its bytes."""

    kind: Literal["send", "recv", "drain"]
    peer: int
    epoch: int
    layers: range
    nbytes: int


@dataclass
class LinkStats:
    """What an :class:`NcclLink` issued: the last :attr:`KEEP` ops (:class:`P2POp`), totals per
    kind, and the size of every group it posted (``groups``: ops per ``batch_isend_irecv``)."""

    KEEP = 4096
    ops: deque[P2POp] = field(default_factory=lambda: deque(maxlen=LinkStats.KEEP))
    totals: Counter[str] = field(default_factory=Counter)
    groups: list[int] = field(default_factory=list)

    def add(self, op: P2POp) -> None:
        self.ops.append(op)
        self.totals[op.kind] += 1

    def per_layer_and_peer(self, kind: str, epoch: int) -> Counter[tuple[int, int]]:
        """Ops of ``kind`` under grant ``epoch`` per (layer, peer) (an op holding several
        layers counts once for each)."""
        return Counter((layer, op.peer) for op in self.ops
                       if op.kind == kind and op.epoch == epoch for layer in op.layers)


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
        #: the point-to-point ops this endpoint issued (the sender thread and the decode's
        #: protocol thread append; deque appends are atomic)
        self.stats = LinkStats()

    def _layers(self, layers: range | None) -> range:
        return range(self.spec.buffers.num_layers) if layers is None else layers

    @staticmethod
    def _tag(epoch: int) -> int:
        return epoch % (1 << 30)

    def send_part(self, part: RankTransfer, dst_slots: Sequence[int], *,
                  layers: range | None = None, epoch: int = 0, fenced: Any = None) -> int:
        """One buffer per (rank, request[, layer]): the destination slots are the receiver's
        business. On GPUs the pack and the send run on a side stream, which waits for nothing:
        the caller (the core's sender worker) has waited for the CUDA event of the pages'
        writes; it returns once the send completed. One gather (``PoolBuffers.pack``: every
        run of the part, each byte copied once) and one send, however many runs the part has."""
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
        self.stats.add(P2POp("send", self.spec.decode_endpoint, epoch, self._layers(layers),
                             buf.numel()))
        return buf.numel()

    def _staging(self, part: RankTransfer, layers: range | None) -> torch.Tensor:
        """A staging buffer for ``part``'s ``layers`` (the packed part layout's size)."""
        return torch.empty(self.spec.buffers.nbytes(part.num_pages, layers), dtype=torch.uint8,
                           device=self.device)

    def _post(self, part: RankTransfer, layers: range | None,
              epoch: int) -> tuple[Any, torch.Tensor]:
        """Post the receive of ``part``'s ``layers`` into a staging buffer of their size."""
        buf = self._staging(part, layers)
        work = dist.irecv(buf, src=self.spec.world_rank(part.rank), group=self.data_group,
                          tag=self._tag(epoch))
        self.stats.add(P2POp("recv", part.rank, epoch, self._layers(layers), buf.numel()))
        return work, buf

    def _wait(self, work: Any) -> bool:
        """Wait for ``work`` without ever timing the group out, until no other endpoint made
        progress for ``timeout_s`` (the channel's beacons: a part may take a layer's compute to
        come, however long that is)."""
        limit = self.spec.timeout_s
        clock = SilenceClock(self.channel)
        if self.device.type == "cuda":  # NCCL: completion can be polled
            checked = time.monotonic()
            while not work.is_completed():
                if time.monotonic() - checked > WAIT_SLICE_S:
                    checked = time.monotonic()
                    if clock.quiet_s() > limit:
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
        while not ended.wait(min(WAIT_SLICE_S, max(0.0, limit - clock.quiet_s()))):
            if clock.quiet_s() > limit:
                return False
        if box[0] is not None:
            raise box[0]
        return True

    def recv_part(self, part: RankTransfer, sink: PartSink, *,
                  layers: range | None = None, epoch: int = 0) -> int:
        work, buf = self._post(part, layers, epoch)
        if not self._wait(work):
            self.abandoned.append((work, buf))
            raise TransferTimeout(f"rank {part.rank}'s part did not arrive, and no endpoint made "
                                  f"progress, for {self.spec.timeout_s:g} s (transfer.timeout_s "
                                  f"bounds this silence: raise it if one prefill step takes "
                                  f"longer)")
        sink.place_packed(part, buf, layers=layers)
        return buf.numel()

    def abandon(self, rest: Sequence[tuple[range, RankTransfer]], epoch: int) -> None:
        """The decode gave grant ``epoch`` up before receiving ``rest`` ((layers, part) in the
        order the senders send them): post their receives into staging buffers, so the late
        messages are drained there (never placed, never matched with a later request's). The
        receives are posted in groups of at most :data:`MAX_OPS_PER_GROUP`, in order."""
        items = list(rest)
        for group in op_groups(len(items)):
            bufs = [self._staging(items[i][1], items[i][0]) for i in group]
            ops = [dist.P2POp(dist.irecv, buf, self.spec.world_rank(items[i][1].rank),
                              group=self.data_group, tag=self._tag(epoch))
                   for i, buf in zip(group, bufs, strict=True)]
            works = list(dist.batch_isend_irecv(ops))
            if len(works) != len(ops):  # NCCL coalesces a group into one work: it holds each
                works = works[-1:] * len(ops)
            self.stats.groups.append(len(ops))
            for i, work, buf in zip(group, works, bufs, strict=True):
                self.abandoned.append((work, buf))
                layers, part = items[i]
                self.stats.add(P2POp("drain", part.rank, epoch, self._layers(layers),
                                     buf.numel()))

    def close(self) -> None:
        """Groups are torn down with the world (``destroy_process_group``)."""
        self.channel.close()
        self._store = None


class NcclTransport:
    """What ``load()`` returns."""

    name = "nccl"

    def connect(self, spec: LinkSpec) -> NcclLink:
        return NcclLink(spec)
