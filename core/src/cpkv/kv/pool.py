"""ShardedKVPool: KV pages (latent + index-K) stored only on their owner rank (rules 10-18).

The per-batch lifecycle over two units: the host-side :class:`~cpkv.kv.table.PageTable`
(:attr:`ShardedKVPool.pages`: request page tables, reference counts, copy-on-write reservations,
the reclaim hook; pure Python) and the device-side :class:`~cpkv.kv.store.KVStore`
(:attr:`ShardedKVPool.store`: the byte buffers in their layout, writes, the materializer, staged
page work, host loads). Per batch: :meth:`ShardedKVPool.prepare` is a reservation from the table
plus a batch from the store (host work, once); per layer: :meth:`~ShardedKVPool.write` then
:meth:`~ShardedKVPool.materialize`; then :meth:`~ShardedKVPool.commit` (or
:meth:`~ShardedKVPool.abort`). Everything else is the table's or the store's: callers use
``pool.pages`` / ``pool.store``, or better receive only the unit they need (the prefix cache a
page table and the store's host loads, the decode receiver a page table and a store). With
``shared=False`` every rank keeps a full replica: the baseline that sharding is measured against.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cpkv.comm import CPGroup
from cpkv.contracts import (
    BufferLayout,
    CPPlan,
    FallbackReason,
    KVFormat,
    MaterializeMode,
    PageLayout,
    layer_formats,
)
from cpkv.fallback import report_fallback

from .allocator import PoolExhausted
from .batch import BatchKV
from .buffers import KVBufferSpec
from .materialize import Prefetch
from .store import KVStore
from .table import PageTable
from .view import FullView

if TYPE_CHECKING:
    from cpkv.ops import OpTable

__all__ = ["KVFootprint", "PoolExhausted", "Prefetch", "ShardedKVPool"]


@dataclass(frozen=True)
class KVFootprint:
    """One rank's KV footprint (:meth:`ShardedKVPool.footprint`).

    Attributes:
        pages_held: pages stored on this rank (a replica counts every page).
        logical_pages: distinct pages held in the whole group (shared pages once).
        bytes_held: persistent KV bytes on this rank: pages held x the page bytes of every layer
            (each layer's own format: no index-K bytes for a layer without index-K).
        replicated_bytes: what one rank of a replicated pool would hold for the same requests.
    """

    pages_held: int
    logical_pages: int
    bytes_held: int
    replicated_bytes: int


class ShardedKVPool:
    """The KV pool of one rank of a CP group.

    Args:
        fmt: stored format (bf16 or fp8 layout, page size): one for every layer, or one per
            layer (a sequence: a GLM-5 shared-indexer layer's format has no index-K).
        num_layers: layers with KV.
        group: the CP group (``rank``, ``size``, ``device``, ``all_gather_rows``).
        ops: the op table (page gather/scatter, fp8 pack).
        shared: one owner per page (True) or a full replica on every rank (False).
        pages_per_rank: capacity of this rank's buffers, in pages.
        debug: cross-rank checks that sync (plan hash, allocator state, out-cache ownership).
        materialize: how a sharded pool builds full views (``"all_gather"``, ``"p2p"`` or
            ``"auto"``, see :mod:`cpkv.kv.materialize`); a replica always reads its own pages.
        layout: how a page's bytes lie in the pool's tensors (:class:`BufferLayout`:
            ``token_major``, ``part_major``, or the engines' ``two_part``).
        storage: the caller's page tensors (:class:`~cpkv.kv.buffers.KVBufferSpec` in any
            layout), wrapped in place, never copied; its capacity and layout are the pool's.

    Raises:
        ValueError: ``num_layers < 1``, an unknown ``materialize`` mode, or per-layer formats
            that are not one per layer (:func:`~cpkv.contracts.layer_formats`), or
            ``storage`` that does not fit (its formats, its device).
    """

    def __init__(self, fmt: KVFormat | Sequence[KVFormat], num_layers: int, group: CPGroup,
                 ops: OpTable, *,
                 shared: bool = True, pages_per_rank: int = 4096, debug: bool = False,
                 materialize: MaterializeMode | str = MaterializeMode.ALL_GATHER,
                 layout: BufferLayout | PageLayout | str = BufferLayout.TOKEN_MAJOR,
                 storage: KVBufferSpec | None = None) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        modes = (MaterializeMode.ALL_GATHER.value, MaterializeMode.P2P.value,
                 MaterializeMode.AUTO.value)
        if materialize not in modes:
            raise ValueError(f"materialize must be one of {modes}, got {materialize!r}")
        fmts = layer_formats(fmt, num_layers)  # per layer (``store.fmts``)
        lay = BufferLayout(layout)
        if storage is not None:
            if storage.fmts != fmts or storage.device != group.device:
                raise ValueError(f"storage holds {storage.num_layers} layers on {storage.device}, "
                                 f"formats {storage.fmts[:2]}...; the pool needs {num_layers} on "
                                 f"{group.device}, formats {fmts[:2]}...")
            lay, pages_per_rank = storage.layout, storage.capacity
        self.num_layers, self.group = num_layers, group
        self._debug = debug
        #: the host-side page table (every rank's alike)
        self.pages = PageTable(fmts[0].page_size, group.size, pages_per_rank, shared=shared)
        mode = MaterializeMode(materialize) if shared else MaterializeMode.REPLICA
        #: this rank's bytes (``store.fmts``: each layer's format)
        self.store = KVStore(fmts, num_layers, group, ops, mode, pages_per_rank, lay,
                             self.pages.alloc_rank, storage)
        #: the pool's format (page size, dtype, dims): its first layer with index-K
        self.fmt = self.store.fmt

    def footprint(self) -> KVFootprint:
        """What this rank stores and what a replica would (reports, benchmarks)."""
        per_page = self.store.page_bytes
        held = self.pages.allocator.used_pages(self.pages.alloc_rank(self.group.rank))
        logical = self.pages.logical_pages()
        return KVFootprint(pages_held=held, logical_pages=logical, bytes_held=held * per_page,
                           replicated_bytes=logical * per_page)

    # ---- per batch -----------------------------------------------------------------------------
    def prepare(self, plan: CPPlan, rids: Sequence[Hashable], *,
                given: Mapping[Hashable, Sequence[tuple[int, int]]] | None = None) -> BatchKV:
        """Reserve the batch's new pages and compute its out-cache locations (once per batch).
        The one per-batch lifecycle over the page table (``prepare`` -> per layer -> ``commit``
        or ``abort``), also :class:`cpkv.embed.EngineKV`'s.

        ``given``: the caller's own slots for the pages (an engine's allocator; see
        :meth:`PageTable.reserve`), or None for the table's free lists.

        Raises:
            ValueError: plan and pool disagree (page size, CP size, a request's prefix or
                owners), or a given page is wrong; nothing changed.
            PoolExhausted: not enough pages; raised alike on every rank, nothing changed.
        """
        ps, c = self.fmt.page_size, self.group.size
        if plan.page_size != ps or plan.cp_size != c:
            raise ValueError(f"plan is for CP{plan.cp_size} with {plan.page_size}-token pages, the "
                             f"pool for CP{c} with {ps}-token pages")
        if len(rids) != len(plan.requests) or len(set(rids)) != len(rids):
            raise ValueError(f"need one distinct request id per planned request, got {list(rids)} "
                             f"for {len(plan.requests)} requests")
        if self._debug and not self.group.all_equal(plan.fingerprint()):
            raise RuntimeError("debug: CP ranks planned different batches (plan hashes differ)")
        if self.store.shared and not plan.page_aligned:  # may raise (policy error): nothing taken yet
            bad = [f"{rid!r} (P={r.prefix_len}, E={r.extend_len})"
                   for rid, r in zip(rids, plan.requests, strict=True) if not r.page_aligned]
            report_fallback(op="kv_write", requested="direct write by the compute rank",
                            selected="owner write from the gathered rows",
                            reason=FallbackReason.OWNER_WRITE,
                            detail=f"{len(bad)} requests not page-aligned: {', '.join(bad[:8])}")
        res = self.pages.reserve(plan, rids, given=given)
        try:
            batch = self.store.batch(plan, res, self.pages.requests)
        except BaseException:
            self.pages.abort(res)
            raise
        if self._debug:
            self.store.verify_out_cache(batch, self.pages.requests)
            if not self.group.all_equal(repr(self.pages.allocator.snapshot())):
                raise RuntimeError("debug: CP ranks' page allocators disagree")
        self.store.begin(batch)
        return batch

    def write(self, layer: int, batch: BatchKV, latent: torch.Tensor,
              index_k: torch.Tensor | None) -> None:
        """Store this rank's new KV rows of ``layer`` (compute dtype, [local rows, D]; no
        ``index_k``, None, for a layer without index-K).

        Page-aligned requests: each rank writes its own rows into its own pages, no communication.
        Otherwise (or for a replica) one all-gather of the packed rows, then owners write.
        """
        self.store.write(layer, batch, latent, index_k)

    def prefetch(self, layer: int, batch: BatchKV) -> Prefetch | None:
        """Start moving ``layer``'s cached prefix pages into the full view ahead of time (on a side
        stream on GPUs) while the current layer computes; None when the strategy has nothing to
        stage. Every rank calls it at the same point (it may be a collective). Host pages and
        copies on write of ``layer`` start here too, on the same side stream."""
        return self.store.prefetch(layer, batch)

    def materialize(self, layer: int, batch: BatchKV,
                    prefetched: Prefetch | None = None) -> FullView:
        """The full view of ``layer`` for the batch, in natural order (rule 15), built by the
        pool's strategy; with ``prefetched`` only the pages this batch wrote are still moved."""
        return self.store.materialize(layer, batch, prefetched)

    def commit(self, batch: BatchKV) -> None:
        """Mark the batch's tokens valid (call after every layer wrote)."""
        self.store.end(batch)
        self.pages.commit(batch.reservation)

    def abort(self, batch: BatchKV) -> list[tuple[int, int]]:
        """Give back the pages the batch reserved (its copies on write too); its requests hold
        what they held before. Host pages the batch was loading land anyway (the cache already
        points at their new slots). Returns the pages back on the free lists ((allocation rank,
        slot))."""
        self.store.end(batch)
        return self.pages.abort(batch.reservation)
