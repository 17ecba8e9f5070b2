"""The ``nccl`` transport: all C + 1 endpoints are processes of one ``torch.distributed`` world.

``connect`` (collective over the whole world) creates a Gloo group of the endpoints with the
transfer timeout, for the side channel (object point-to-point) and, on CPU, the data; on GPUs
the data goes over an NCCL group of the same ranks. A prefill rank packs its pages of one request
into one contiguous buffer (``cpkv.disagg.pack_part``: per layer its latent pages, then their
index-K pages) and sends it with one ``dist.send``; the decode rank receives it with one
``dist.recv`` into a staging buffer and places the pages at their reserved slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from cpkv.disagg import DecodeReceiver, DistSideChannel, LinkSpec, RankTransfer, pack_part, part_nbytes

__all__ = ["NcclLink", "NcclTransport"]


class NcclLink:
    """One endpoint's link (see ``cpkv.disagg.transport.Link``)."""

    def __init__(self, spec: LinkSpec) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("the nccl transfer needs an initialized torch.distributed world "
                               "holding the C prefill ranks and the decode rank")
        self.spec = spec
        ranks = [spec.world_rank(e) for e in range(spec.cp_size + 1)]
        timeout = timedelta(seconds=spec.timeout_s)
        # new_group is collective over the whole world: every process calls it, in this order
        self.meta_group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        self.device = spec.pool.group.device
        if self.device.type == "cuda":
            self.data_group = dist.new_group(ranks=ranks, backend="nccl", timeout=timeout)
        else:
            self.data_group = self.meta_group
        self.channel = DistSideChannel(spec, self.meta_group)

    def send_part(self, part: RankTransfer, dst_slots: Sequence[int]) -> int:
        """One buffer per (rank, request): the destination slots are the receiver's business."""
        if len(dst_slots) != part.num_pages:
            raise ValueError(f"{len(dst_slots)} destination slots for {part.num_pages} pages")
        buf = pack_part(self.spec.pool, part)
        dist.send(buf, dst=self.spec.world_rank(self.spec.decode_endpoint), group=self.data_group)
        return buf.numel()

    def recv_part(self, part: RankTransfer, receiver: DecodeReceiver) -> int:
        n = part_nbytes(receiver.pool, part.num_pages)
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        dist.recv(buf, src=self.spec.world_rank(part.rank), group=self.data_group)
        receiver.place_packed(part, buf)
        return n

    def close(self) -> None:
        """Groups are torn down with the world (``destroy_process_group``)."""


class NcclTransport:
    """What ``load()`` returns."""

    name = "nccl"

    def connect(self, spec: LinkSpec) -> NcclLink:
        return NcclLink(spec)
