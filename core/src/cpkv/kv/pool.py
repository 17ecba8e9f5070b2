"""ShardedKVPool: KV pages (latent + index-K) stored only on their owner rank (rules 10-18).

A thin facade over two units: the host-side :class:`~cpkv.kv.table.PageTable` (request page
tables, reference counts, copy-on-write reservations, the reclaim hook; pure Python) and the
device-side :class:`~cpkv.kv.store.KVStore` (the byte buffers in their layout, writes, the
materializer, staged page work). Per batch: :meth:`ShardedKVPool.prepare` is a reservation from
the table plus a batch from the store (host work, once); per layer: :meth:`~ShardedKVPool.write`
then :meth:`~ShardedKVPool.materialize`; then :meth:`~ShardedKVPool.commit` (or
:meth:`~ShardedKVPool.abort`). With ``shared=False`` every rank keeps a full replica: the
baseline that sharding is measured against.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from cpkv.comm import CPGroup
from cpkv.contracts import CPPlan, FallbackReason, KVFormat, MaterializeMode, PageLayout, RequestSpec
from cpkv.fallback import report_fallback

from .allocator import PageAllocator, PoolExhausted
from .batch import BatchKV
from .materialize import Materializer, Prefetch
from .pages import RequestPages
from .stage import PageLoad
from .store import KVStore
from .table import PageTable
from .view import FullView

if TYPE_CHECKING:
    from cpkv.ops import OpTable

__all__ = ["PoolExhausted", "Prefetch", "ShardedKVPool"]


class ShardedKVPool:
    """The KV pool of one rank of a CP group.

    Args:
        fmt: stored format (bf16 or fp8 layout, page size).
        num_layers: layers with KV.
        group: the CP group (``rank``, ``size``, ``device``, ``all_gather_rows``).
        ops: the op table (page gather/scatter, fp8 pack).
        shared: one owner per page (True) or a full replica on every rank (False).
        pages_per_rank: capacity of this rank's buffers, in pages.
        debug: cross-rank checks that sync (plan hash, allocator state, out-cache ownership).
        materialize: how a sharded pool builds full views (``"all_gather"``, ``"p2p"`` or
            ``"auto"``, see :mod:`cpkv.kv.materialize`); a replica always reads its own pages.
        layout: how a page's bytes are ordered (:class:`PageLayout`).

    Raises:
        ValueError: ``num_layers < 1``, or an unknown ``materialize`` mode.
    """

    def __init__(self, fmt: KVFormat, num_layers: int, group: CPGroup, ops: OpTable, *,
                 shared: bool = True, pages_per_rank: int = 4096, debug: bool = False,
                 materialize: MaterializeMode | str = MaterializeMode.ALL_GATHER,
                 layout: PageLayout | str = PageLayout.TOKEN_MAJOR) -> None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        modes = (MaterializeMode.ALL_GATHER.value, MaterializeMode.P2P.value,
                 MaterializeMode.AUTO.value)
        if materialize not in modes:
            raise ValueError(f"materialize must be one of {modes}, got {materialize!r}")
        self.fmt, self.num_layers, self.group, self.ops = fmt, num_layers, group, ops
        self.shared, self.debug, self.capacity = shared, debug, pages_per_rank
        #: the host-side page table (every rank's alike)
        self.pages = PageTable(fmt.page_size, group.size, pages_per_rank, shared=shared)
        mode = MaterializeMode(materialize) if shared else MaterializeMode.REPLICA
        #: this rank's bytes
        self.store = KVStore(fmt, num_layers, group, ops, mode, pages_per_rank,
                             PageLayout(layout), self.pages.alloc_rank)
        st = self.store
        #: the store's buffers (per layer: uint8 [pages, ps, latent + index bytes], and its
        #: [pages, ps, latent bytes] and [pages, ps, index bytes] views), layout and strategy
        self.kv, self.latent, self.index_k = st.kv, st.latent, st.index_k
        self.layout: PageLayout = st.layout
        self.views: Materializer = st.views

    @property
    def table(self) -> Mapping[Hashable, RequestPages]:
        """Every request's page table (read-only; see :attr:`PageTable.requests`)."""
        return self.pages.requests

    @property
    def allocator(self) -> PageAllocator:
        """The free lists (read them; pages are taken and given back through the pool)."""
        return self.pages.allocator

    @property
    def materialize_mode(self) -> MaterializeMode:
        """How this pool builds full views, after any fallback (``replica`` for a replica)."""
        return self.store.views.mode

    # ---- bookkeeping -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.group.rank

    def alloc_rank(self, owner: int) -> int:
        """Whose free list a page of ``owner`` comes from (the one list of a replica)."""
        return self.pages.alloc_rank(owner)

    def request_spec(self, rid: Hashable, extend_len: int) -> RequestSpec:
        """Planner input for extending ``rid`` by ``extend_len`` tokens after what it holds."""
        return self.pages.request_spec(rid, extend_len)

    def pages_held(self) -> int:
        """Pages stored on this rank (a replica counts every page)."""
        return self.pages.allocator.used_pages(self.alloc_rank(self.rank))

    def bytes_held(self) -> int:
        """Persistent KV bytes on this rank: pages held x page bytes x layers."""
        return self.pages_held() * self.fmt.page_bytes * self.num_layers

    def logical_pages(self) -> int:
        """Distinct pages held in the whole group (shared pages once): the logical footprint."""
        return self.pages.logical_pages()

    def replicated_bytes(self) -> int:
        """What one rank of a replicated pool would hold for the same requests."""
        return self.logical_pages() * self.fmt.page_bytes * self.num_layers

    # ---- per batch -----------------------------------------------------------------------------
    def prepare(self, plan: CPPlan, rids: Sequence[Hashable]) -> BatchKV:
        """Reserve the batch's new pages and compute its out-cache locations (once per batch).

        Raises:
            ValueError: plan and pool disagree (page size, CP size, a request's prefix or owners).
            PoolExhausted: not enough pages; raised alike on every rank, nothing changed.
        """
        ps, c = self.fmt.page_size, self.group.size
        if plan.page_size != ps or plan.cp_size != c:
            raise ValueError(f"plan is for CP{plan.cp_size} with {plan.page_size}-token pages, the "
                             f"pool for CP{c} with {ps}-token pages")
        if len(rids) != len(plan.requests) or len(set(rids)) != len(rids):
            raise ValueError(f"need one distinct request id per planned request, got {list(rids)} "
                             f"for {len(plan.requests)} requests")
        if self.debug and not self.group.all_equal(plan.fingerprint()):
            raise RuntimeError("debug: CP ranks planned different batches (plan hashes differ)")
        if self.shared and not plan.page_aligned:  # may raise (policy error): nothing taken yet
            bad = [f"{rid!r} (P={r.prefix_len}, E={r.extend_len})"
                   for rid, r in zip(rids, plan.requests, strict=True) if not r.page_aligned]
            report_fallback(op="kv_write", requested="direct write by the compute rank",
                            selected="owner write from the gathered rows",
                            reason=FallbackReason.OWNER_WRITE,
                            detail=f"{len(bad)} requests not page-aligned: {', '.join(bad[:8])}")
        res = self.pages.reserve(plan, rids)
        batch = self.store.batch(plan, res, self.pages.requests)
        if self.debug:
            self.store.verify_out_cache(batch, self.pages.requests)
            if not self.group.all_equal(repr(self.pages.allocator.snapshot())):
                raise RuntimeError("debug: CP ranks' page allocators disagree")
        self.store.begin(batch)
        return batch

    def write(self, layer: int, batch: BatchKV, latent: torch.Tensor, index_k: torch.Tensor) -> None:
        """Store this rank's new KV rows of ``layer`` (compute dtype, [local rows, D]).

        Page-aligned requests: each rank writes its own rows into its own pages, no communication.
        Otherwise (or for a replica) one all-gather of the packed rows, then owners write.
        """
        self.store.write(layer, batch, latent, index_k)

    def write_rows(self, layer: int, rows: torch.Tensor, latent: torch.Tensor,
                   index_k: torch.Tensor) -> None:
        """Store KV rows at token rows ``rows`` of ``layer`` outside a batch (the decode step;
        see :meth:`KVStore.write_rows`): the caller holds the pages."""
        self.store.write_rows(layer, rows, latent, index_k)

    def relayout(self, slots: Sequence[int], layout: PageLayout) -> None:
        """Pages at ``slots`` (every layer) hold blocks in ``layout`` (written by a one-sided
        transfer from pools of that layout): rewrite them in place in this pool's layout."""
        self.store.relayout(slots, layout)

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

    def abort(self, batch: BatchKV) -> None:
        """Give back the pages the batch reserved (its copies on write too); its requests hold
        what they held before. Host pages the batch was loading land anyway (the cache already
        points at their new slots)."""
        self.store.end(batch)
        self.pages.abort(batch.reservation)

    # ---- requests and shared pages (see PageTable) -------------------------------------------
    def free(self, rid: Hashable) -> None:
        """Release a finished request's references to its pages."""
        self.pages.free(rid)

    def truncate(self, rid: Hashable, valid_len: int) -> int:
        """Drop ``rid``'s tokens from ``valid_len`` on (see :meth:`PageTable.truncate`); the rows
        past ``valid_len`` in the tail page are masked until written again (rule 28)."""
        return self.pages.truncate(rid, valid_len)

    def adopt(self, rid: Hashable, pages: Sequence[tuple[int, int]], valid_len: int) -> None:
        """Start ``rid`` from ``valid_len`` tokens already stored in shared ``pages`` (see
        :meth:`PageTable.adopt`; a shared tail page is copied before it is written)."""
        self.pages.adopt(rid, pages, valid_len)

    def extend(self, rid: Hashable, pages: Sequence[tuple[int, int]], valid_len: int) -> None:
        """Hand the caller's ``pages`` to ``rid``'s table (see :meth:`PageTable.extend`)."""
        self.pages.extend(rid, pages, valid_len)

    def refcount(self, owner: int, slot: int) -> int:
        """References to the page at ``slot`` on ``owner`` (0: free)."""
        return self.pages.refcount(owner, slot)

    def retain(self, pages: Iterable[tuple[int, int]]) -> None:
        """One more reference to each (owner rank, slot) page (see :meth:`PageTable.retain`)."""
        self.pages.retain(pages)

    def release(self, pages: Iterable[tuple[int, int]]) -> int:
        """One reference less to each (owner rank, slot) page; returns how many were freed."""
        return self.pages.release(pages)

    def allocate_pages(self, owner: int, n: int, what: str = "pages") -> list[int]:
        """``n`` new pages on ``owner``, one reference each (the caller's), the reclaimer asked
        first under pressure. Raises :class:`PoolExhausted` (nothing taken)."""
        needs = [0] * self.pages.allocator.num_ranks
        needs[self.alloc_rank(owner)] = n
        return self.pages.take_pages(needs, what)[self.alloc_rank(owner)]

    def take_pages(self, needs: Sequence[int], what: str = "pages") -> list[list[int]]:
        """``needs[a]`` new pages on every allocation rank ``a`` (see
        :meth:`PageTable.take_pages`)."""
        return self.pages.take_pages(needs, what)

    # ---- host pages (the prefix cache's host tier; see KVStore) -------------------------------
    def queue_load(self, load: PageLoad) -> None:
        """Load host pages back into (already reserved) device slots before the next batch reads
        or writes them; the load holds its host pages until it is done."""
        self.store.queue_load(load)

    def queued_loads(self) -> tuple[PageLoad, ...]:
        """Host loads queued and not yet handed to a batch."""
        return self.store.queued_loads()

    @property
    def loads_pending(self) -> bool:
        """Queued or in-flight host loads (or copies) whose bytes are not all in place yet."""
        return self.store.loads_pending

    def flush_loads(self) -> None:
        """Finish every queued host load and every in-flight batch's staged page work now."""
        self.store.flush_loads()
