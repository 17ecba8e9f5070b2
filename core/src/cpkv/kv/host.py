"""Host copies of KV pages (the prefix cache's host tier storage, rule 28).

A :class:`HostPages` holds, per layer, ``[capacity, ps, latent + index bytes]`` uint8 (that
layer's format: no index-K bytes for a layer without index-K) in host memory (pinned when the
pool is on a GPU): the stored format, latent and index-K together, one block per page, exactly
as the device pool holds it. Like the device pool, the bookkeeping (free lists, reference counts)
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

from cpkv.contracts import KVFormat, layer_formats

from .allocator import PageAllocator, drop_refs, hold_new

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
    """

    def __init__(self, fmt: KVFormat | Sequence[KVFormat], num_layers: int, capacity: int,
                 num_ranks: int, device: torch.device) -> None:
        if capacity < 1:
            raise ValueError(f"host capacity must be >= 1 page, got {capacity}")
        self.fmts = layer_formats(fmt, num_layers)
        self.fmt = next((f for f in self.fmts if f.index_k), self.fmts[0])
        self.num_layers, self.device = num_layers, device
        self.allocator = PageAllocator(num_ranks, capacity)
        pin = device.type == "cuda"
        self.kv = [torch.zeros(capacity, f.page_size, f.bytes_per_token, dtype=torch.uint8,
                               pin_memory=pin) for f in self.fmts]
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

    def save(self, dev_kv: Sequence[torch.Tensor], dev_slots: torch.Tensor,
             host_slots: torch.Tensor, ops: OpTable) -> None:
        """Copy device pages ``dev_slots`` (every layer) into host pages ``host_slots`` (index
        tensors from :meth:`index`, same order), queued on the current stream: work queued after
        it may overwrite the device slots."""
        for layer, buf in enumerate(dev_kv):
            ops.page_copy(self.kv[layer], host_slots, buf, dev_slots)

    def load(self, layer: int, dev_buf: torch.Tensor, host_slots: torch.Tensor,
             dev_slots: torch.Tensor, ops: OpTable) -> None:
        """Copy host pages ``host_slots`` of ``layer`` into ``dev_buf``'s pages ``dev_slots``
        (index tensors from :meth:`index`, same order), on the current stream."""
        ops.page_copy(dev_buf, dev_slots, self.kv[layer], host_slots)

