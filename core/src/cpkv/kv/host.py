"""Host copies of KV pages (the prefix cache's host tier storage, rule 28).

A :class:`HostPages` holds, per layer, the device pool's page regions in host memory (pinned
when the pool is on a GPU): uint8 ``[capacity, bytes]`` each (:func:`~cpkv.kv.buffers.
region_bytes`: one region of ``page_bytes`` in a one-tensor layout, latent and index-K
together; ``two_part``: the latent's and the index-K's), in that layer's format (no index-K
bytes for a layer without index-K): one block per page and region, exactly as the device pool
holds it. Like the device pool, the bookkeeping (free lists, reference counts)
is replicated on every rank and fed the same calls, while the bytes of a page live only on its
**owner**: rank r's host buffers hold the pages rank r owns (every page on a replica pool).

* :meth:`save` copies device pages into host slots (the owner's eviction backup; stream ordered
  on the device's current stream, so the slots can be reused by the next writes at once).
* :meth:`load` copies host slots of one layer into device slots (the pool calls it per layer, one
  layer ahead on a side stream: :class:`~cpkv.kv.stage.PageStage`).

Both are one ``page_copy`` per layer: on a GPU the kernel reads (or writes) the pinned host pages
directly over the bus, so scattered slots cost no more than one contiguous copy (measured in
``cpkv bench host``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from cpkv.contracts import BufferLayout, KVFormat, layer_formats

from .allocator import PageAllocator, drop_refs, hold_new
from .buffers import region_bytes

if TYPE_CHECKING:
    from cpkv.ops import OpTable

__all__ = ["HostPages"]


class HostPages:
    """Host page storage of one rank, with replicated slot bookkeeping (see module docstring).

    Args:
        fmt: the device pool's stored format (one for all layers, or one per layer).
        num_layers: layers with KV.
        capacity: host pages per owner rank.
        num_ranks: allocation ranks (the device pool's: the CP size, or 1 for a replica).
        device: the device pool's device; host memory is pinned when it is a GPU.
        layout: the device pool's layout (its regions per layer: ``store.spec.layout``).
    """

    def __init__(self, fmt: KVFormat | Sequence[KVFormat], num_layers: int, capacity: int,
                 num_ranks: int, device: torch.device,
                 layout: BufferLayout | str = BufferLayout.TOKEN_MAJOR) -> None:
        if capacity < 1:
            raise ValueError(f"host capacity must be >= 1 page, got {capacity}")
        self.fmts = layer_formats(fmt, num_layers)
        self.fmt = next((f for f in self.fmts if f.index_k), self.fmts[0])
        self.num_layers, self.device = num_layers, device
        self.allocator = PageAllocator(num_ranks, capacity)
        pin = device.type == "cuda"
        self.layout = BufferLayout(layout)
        #: per layer, its host regions: uint8 [capacity, bytes] (the device pool's regions)
        self.regions = [tuple(torch.zeros(capacity, b, dtype=torch.uint8, pin_memory=pin)
                              for b in region_bytes(f, self.layout)) for f in self.fmts]
        #: per layer [capacity, ps, B] views of the one region (one-tensor layouts; else empty)
        self.kv = [] if self.layout is BufferLayout.TWO_PART else [
            r[0].view(capacity, f.page_size, f.bytes_per_token)
            for r, f in zip(self.regions, self.fmts, strict=True)]
        #: references to each held host page, by (allocation rank, slot)
        self._refs: dict[tuple[int, int], int] = {}
        #: this rank's host slots whose bytes are gone (a failed read of a lower tier, or a
        #: fault injected by a test): a hit stops before them (rule 29)
        self.lost: set[int] = set()

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    def free_pages(self, alloc_rank: int) -> int:
        return self.allocator.free_pages(alloc_rank)

    def used_pages(self) -> int:
        """Host pages held, over all allocation ranks."""
        return sum(self.allocator.used_pages(a) for a in range(self.allocator.num_ranks))

    # ---- bookkeeping (replicated) --------------------------------------------------------------
    def take(self, needs: Sequence[int]) -> list[list[int]]:
        """``needs[a]`` free host slots on each allocation rank, all or nothing, one reference
        each.

        Raises:
            PoolExhausted: not enough free host slots (nothing taken).
        """
        slots = self.allocator.allocate(needs, what="host pages")
        hold_new(self._refs, slots)
        for got in slots:  # a fresh save overwrites whatever was lost there
            self.lost.difference_update(got)
        return slots

    def retain(self, keys: Iterable[tuple[int, int]]) -> None:
        for k in keys:
            self._refs[k] += 1

    def release(self, keys: Iterable[tuple[int, int]]) -> int:
        """One reference less to each (allocation rank, slot); returns how many were freed."""
        return drop_refs(self._refs, keys, self.allocator)

    def refcount(self, key: tuple[int, int]) -> int:
        return self._refs.get(key, 0)

    def references(self) -> dict[tuple[int, int], int]:
        """A copy of every held host page's reference count, by (allocation rank, slot)."""
        return dict(self._refs)

    # ---- bytes (this rank's pages only) --------------------------------------------------------
    def index(self, slots: Sequence[int]) -> torch.Tensor:
        """Slots as the int64 index tensor the copies take (on the device that runs them)."""
        return torch.tensor(list(slots), dtype=torch.int64).to(self.device)

    def _regions(self, layer: int, dev: torch.Tensor | Sequence[torch.Tensor]
                 ) -> Sequence[torch.Tensor]:
        """The device side of ``layer`` as regions (a one-tensor layer's [pages, ps, B] tensor
        is its one region), checked against the host's."""
        regs = [dev.view(dev.shape[0], -1)] if isinstance(dev, torch.Tensor) else list(dev)
        want = [int(r.shape[1]) for r in self.regions[layer]]
        if [int(r[0].numel()) for r in regs] != want:
            raise ValueError(f"layer {layer}: device pages of {[int(r[0].numel()) for r in regs]} "
                             f"bytes per region, the host tier's {want} ({self.layout.value})")
        return [r.view(r.shape[0], -1) for r in regs]

    def save(self, dev: Sequence[torch.Tensor | Sequence[torch.Tensor]], dev_slots: torch.Tensor,
             host_slots: torch.Tensor, ops: OpTable) -> None:
        """Copy device pages ``dev_slots`` (every layer: per layer its regions, or its one
        [pages, ps, B] tensor) into host pages ``host_slots`` (index tensors from :meth:`index`,
        same order), queued on the current stream: work queued after it may overwrite the
        device slots."""
        for layer, d in enumerate(dev):
            for h, r in zip(self.regions[layer], self._regions(layer, d), strict=True):
                ops.page_copy(h, host_slots, r, dev_slots)

    def load(self, layer: int, dev: torch.Tensor | Sequence[torch.Tensor],
             host_slots: torch.Tensor, dev_slots: torch.Tensor, ops: OpTable) -> None:
        """Copy host pages ``host_slots`` of ``layer`` into the device regions ``dev`` (or its
        one [pages, ps, B] tensor) at pages ``dev_slots`` (index tensors from :meth:`index`,
        same order), on the current stream."""
        for h, r in zip(self.regions[layer], self._regions(layer, dev), strict=True):
            ops.page_copy(r, dev_slots, h, host_slots)

