"""ShardedKVPool: KV pages (latent + index-K) stored only on their owner rank (rules 10-18).

Per layer the pool holds one byte buffer in the stored format of :class:`KVFormat`:
``kv[layer]`` [pages, ps, latent bytes + index bytes], each token's latent bytes followed by its
index-K bytes, so a page (latent and its index-K sidecar) is one contiguous block: it is
allocated, written and moved as one. ``latent[layer]`` and ``index_k[layer]`` are the two
column views of it ([pages, ps, latent bytes] and [pages, ps, index bytes]).

Per batch: :meth:`prepare` reserves pages and computes out-cache locations and the
materialization plan (host work, once); per layer: :meth:`write` then :meth:`materialize`;
then :meth:`commit` (or :meth:`abort`). With ``shared=False`` every rank keeps a full replica:
the baseline that sharding is measured against.

How the full view is built (and where the pages are stored for that) is the pool's
:class:`~cpkv.kv.materialize.Materializer`, chosen once at construction from ``materialize``
(:class:`~cpkv.contracts.MaterializeMode`): see :mod:`cpkv.kv.materialize`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from cpkv.comm import CPGroup
from cpkv.contracts import (
    CPPlan,
    FallbackReason,
    KVFormat,
    MaterializeMode,
    PageLayout,
    RequestSpec,
    cdiv,
)
from cpkv.fallback import report_fallback
from cpkv.ops import page_blocks

from .allocator import PageAllocator, PoolExhausted, drop_refs, hold_new
from .batch import BatchKV, RequestPages, build_batch
from .materialize import Materializer, Prefetch, open_materializer
from .stage import PageLoad, PageStage
from .view import FullView, pack_rows

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
            ``"auto"``, see :mod:`cpkv.kv.materialize`); a replica (``shared=False``) always
            reads its own pages.

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
        self.shared, self.debug = shared, debug
        self.capacity = pages_per_rank
        self.allocator = PageAllocator(group.size if shared else 1, pages_per_rank)
        mode = MaterializeMode(materialize) if shared else MaterializeMode.REPLICA
        #: the side stream of work done a layer ahead (prefix pages, host loads); None on CPU
        self.side: torch.cuda.Stream | None = None
        if group.device.type == "cuda":
            self.side = torch.cuda.Stream(device=group.device)  # type: ignore[no-untyped-call]
        #: how a page's bytes are ordered (one block either way; PageLayout)
        self.layout = PageLayout(layout)
        self.views: Materializer = open_materializer(mode, fmt, num_layers, pages_per_rank, group,
                                                     ops, self.side, self.layout)
        #: per layer: uint8 [pages, ps, latent + index bytes] (the strategy's storage)
        self.kv = self.views.kv
        nl, ps = fmt.latent_bytes_per_token, fmt.page_size
        #: per layer, [pages, ps, latent bytes] and [pages, ps, index bytes] views of ``kv``
        if self.layout is PageLayout.TOKEN_MAJOR:
            self.latent = [b[..., :nl] for b in self.kv]
            self.index_k = [b[..., nl:] for b in self.kv]
        else:  # a page's latent rows, then its index-K rows
            flat = [b.view(b.shape[0], -1) for b in self.kv]
            self.latent = [f[:, :ps * nl].view(-1, ps, nl) for f in flat]
            self.index_k = [f[:, ps * nl:].view(-1, ps, fmt.index_bytes_per_token) for f in flat]
        self.table: dict[Hashable, RequestPages] = {}
        #: references to each held page, by (allocation rank, slot): the requests whose page
        #: tables hold it plus the prefix cache's; a page returns to the free list at zero
        self._refs: dict[tuple[int, int], int] = {}
        #: called with each allocation rank's need when a batch does not fit (the prefix cache
        #: evicts); returns whether the pages are free now. Deterministic: same on every rank
        self.reclaim: Callable[[Sequence[int]], bool] | None = None
        #: host pages queued to load back (the cache's host tier), staged by the next batch
        self._loads: list[PageLoad] = []
        #: stages of prepared batches not committed or aborted yet
        self._staging: list[PageStage] = []
        #: part-major writes: the last batch's destination rows as (rows, page, offset)
        self._addr: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def materialize_mode(self) -> MaterializeMode:
        """How this pool builds full views, after any fallback (``replica`` for a replica)."""
        return self.views.mode

    # ---- bookkeeping -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.group.rank

    def alloc_rank(self, owner: int) -> int:
        """Whose free list a page of ``owner`` comes from: the owner's, or the one list of a
        replica."""
        return owner if self.shared else 0

    def request_spec(self, rid: Hashable, extend_len: int) -> RequestSpec:
        """Planner input for extending ``rid`` by ``extend_len`` tokens after what it holds."""
        rp = self.table.get(rid)
        if rp is None:
            return RequestSpec(prefix_len=0, extend_len=extend_len)
        return RequestSpec(prefix_len=rp.valid_len, extend_len=extend_len,
                           prefix_owners=tuple(rp.owners[: cdiv(rp.valid_len, self.fmt.page_size)]))

    def pages_held(self) -> int:
        """Pages stored on this rank (a replica counts every page)."""
        return self.allocator.used_pages(self.alloc_rank(self.rank))

    def bytes_held(self) -> int:
        """Persistent KV bytes on this rank: pages held x page bytes x layers."""
        return self.pages_held() * self.fmt.page_bytes * self.num_layers

    def logical_pages(self) -> int:
        """Distinct pages held in the whole group (shared pages once): the logical footprint."""
        return len(self._refs)

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
        needs = [0] * self.allocator.num_ranks
        new: list[tuple[Hashable, int, list[int]]] = []
        #: shared tail pages this batch writes into: (rid, logical page), copied first
        cows: list[tuple[Hashable, int]] = []
        for rid, req in zip(rids, plan.requests, strict=True):
            rp = self.table.get(rid)
            have = 0 if rp is None else rp.valid_len
            if rp is not None and rp.pending:
                raise ValueError(f"request {rid!r} is already in an uncommitted batch")
            if req.prefix_len != have:
                raise ValueError(f"request {rid!r}: the plan's prefix is {req.prefix_len} tokens, the "
                                 f"pool holds {have}")
            existing = 0 if rp is None else len(rp.slots)
            for k in range(req.prefix_len // ps, existing):  # the tail page keeps its owner
                if rp is not None and req.page_owners[k] != rp.owners[k]:
                    raise ValueError(f"request {rid!r}: plan says page {k} is owned by rank "
                                     f"{req.page_owners[k]}, the pool by {rp.owners[k]}")
            if rp is not None and req.prefix_len % ps:
                k = req.prefix_len // ps  # the head fragment writes into this page (rule 3)
                if self._refs[self._key(rp.owners[k], rp.slots[k])] > 1:
                    cows.append((rid, k))  # others still read it: copy on write, on its owner
                    needs[self.alloc_rank(rp.owners[k])] += 1
            owners: list[int] = []
            for k in range(existing, cdiv(req.end, ps)):
                o = req.page_owners[k]
                if o is None:  # the plan validates this away: pages from the prefix's tail on
                    raise ValueError(f"request {rid!r}: the plan has no owner for page {k}")
                owners.append(o)
                needs[self.alloc_rank(o)] += 1
            new.append((rid, existing, owners))
        if self.shared and not plan.page_aligned:
            bad = [f"{rid!r} (P={r.prefix_len}, E={r.extend_len})"
                   for rid, r in zip(rids, plan.requests, strict=True) if not r.page_aligned]
            report_fallback(op="kv_write", requested="direct write by the compute rank",
                            selected="owner write from the gathered rows",
                            reason=FallbackReason.OWNER_WRITE,
                            detail=f"{len(bad)} requests not page-aligned: {', '.join(bad[:8])}")
        slots = self._allocate(needs, f"a batch of {len(rids)} requests")
        # commit the reservation to the page tables (nothing can fail from here on)
        cursor = [0] * len(slots)

        def take(owner: int) -> int:
            a = self.alloc_rank(owner)
            slot = slots[a][cursor[a]]
            cursor[a] += 1
            self._refs[(a, slot)] = 1
            return slot

        copies: list[tuple[Hashable, int, int, int]] = []
        for rid, k in cows:
            rp = self.table[rid]
            old = rp.slots[k]
            if self._refs[self._key(rp.owners[k], old)] == 1:
                continue  # the reclaimer evicted the other holders: the page is this request's
            fresh = take(rp.owners[k])
            rp.slots[k] = fresh
            self._drop([self._key(rp.owners[k], old)])  # still held by the others
            copies.append((rid, k, old, fresh))
        for rid, _existing, owners in new:
            rp = self.table.setdefault(rid, RequestPages())
            for o in owners:
                rp.owners.append(o)
                rp.slots.append(take(o))
                rp.pending.append(len(rp.slots) - 1)
        for a, got in enumerate(slots):  # copies that turned out unneeded: their pages go back
            if cursor[a] < len(got):
                self.allocator.release(a, got[cursor[a]:])
        # per layer, before the layer is read or written: queued host loads, then this rank's
        # copies on write (a copied tail page may just have been loaded)
        me = self.alloc_rank(self.rank)
        stage = PageStage(self.kv, self._loads,
                          [(old, fresh) for rid, k, old, fresh in copies
                           if self.alloc_rank(self.table[rid].owners[k]) == me],
                          self.alloc_rank, me, self.ops, self.group.device, self.side)
        self._loads = []
        batch = build_batch(plan, rids, self.table, self.rank, self.shared, self.group.device,
                            tuple((rid, e) for rid, e, _ in new), capacity=self.capacity,
                            copies=tuple(copies), stage=stage)
        self._staging.append(stage)
        if self.debug:
            self._verify_out_cache(batch)
        # after this no peer still reads the batch's new slots (p2p), so staged copies may land
        self.views.begin_batch(batch)
        return batch

    def write(self, layer: int, batch: BatchKV, latent: torch.Tensor, index_k: torch.Tensor) -> None:
        """Store this rank's new KV rows of ``layer`` (compute dtype, [local rows, D]).

        Page-aligned requests: each rank writes its own rows into its own pages, no communication.
        Otherwise (or for a replica) one all-gather of the packed rows, then owners write.
        """
        batch.stage.ready(layer)
        lat_b = pack_rows(latent, self.fmt, "latent", self.ops)
        idx_b = pack_rows(index_k, self.fmt, "index_k", self.ops)
        nl = lat_b.shape[1]
        if batch.direct_dst.numel():
            src_l, src_i = lat_b, idx_b
            if batch.direct_src is not None:
                src_l = self.ops.page_gather(lat_b, batch.direct_src)
                src_i = self.ops.page_gather(idx_b, batch.direct_src)
            self._store(layer, batch.direct_dst, src_l, src_i)
        if batch.gather_writes:
            both = torch.cat([lat_b, idx_b], dim=1)
            gathered = self.group.all_gather_rows(both, batch.rows.max_rank_len)
            mine = self.ops.page_gather(gathered, batch.owner_src)
            self._store(layer, batch.owner_dst, mine[:, :nl], mine[:, nl:])

    def relayout(self, slots: Sequence[int], layout: PageLayout) -> None:
        """Pages at ``slots`` (every layer) hold blocks in ``layout`` (written by a one-sided
        transfer from pools of that layout): rewrite them in place in this pool's layout."""
        if layout is self.layout or not slots:
            return
        fmt = self.fmt
        nl = fmt.latent_bytes_per_token
        idx = torch.tensor(list(slots), dtype=torch.int64, device=self.group.device)
        for layer in range(self.num_layers):
            raw = self.kv[layer].index_select(0, idx)  # [n, ps, B]: the blocks as they came
            lat, ixk = page_blocks(raw, layout, nl)
            self.latent[layer].index_copy_(0, idx, lat)
            self.index_k[layer].index_copy_(0, idx, ixk)

    def _store(self, layer: int, rows: torch.Tensor, latent: torch.Tensor,
               index_k: torch.Tensor) -> None:
        """Packed rows into token rows ``rows`` (page slot x ps + offset) of ``layer``."""
        if self.layout is PageLayout.TOKEN_MAJOR:
            tok = self.kv[layer].view(-1, self.fmt.bytes_per_token)
            nl = latent.shape[1]
            self.ops.page_scatter(tok[:, :nl], rows, latent)  # dense rows, row stride B
            self.ops.page_scatter(tok[:, nl:], rows, index_k)
            return
        # part-major token rows are not evenly spaced: address them as (page, offset), computed
        # once per batch (``rows`` is the batch's) and reused by every layer
        if self._addr is None or self._addr[0] is not rows:
            ps = self.fmt.page_size
            self._addr = (rows, rows // ps, rows % ps)
        _, page, off = self._addr
        self.latent[layer].index_put_((page, off), latent)
        self.index_k[layer].index_put_((page, off), index_k)

    def prefetch(self, layer: int, batch: BatchKV) -> Prefetch | None:
        """Start moving ``layer``'s cached prefix pages into the full view ahead of time (on a side
        stream on GPUs) while the current layer computes; None when the strategy has nothing to
        stage. Every rank calls it at the same point (it may be a collective). Host pages and
        copies on write of ``layer`` start here too, on the same side stream."""
        batch.stage.issue(layer)
        return self.views.prefetch(layer, batch)

    def materialize(self, layer: int, batch: BatchKV,
                    prefetched: Prefetch | None = None) -> FullView:
        """The full view of ``layer`` for the batch, in natural order (rule 15), built by the
        pool's strategy; with ``prefetched`` (from :meth:`prefetch`) only the pages this batch
        wrote are still moved."""
        batch.stage.ready(layer)
        return self.views.full_view(layer, batch, prefetched)

    def commit(self, batch: BatchKV) -> None:
        """Mark the batch's tokens valid (call after every layer wrote)."""
        self._end_stage(batch)
        for rid, req in zip(batch.rids, batch.plan.requests, strict=True):
            rp = self.table[rid]
            rp.valid_len = req.end
            rp.pending.clear()

    def abort(self, batch: BatchKV) -> None:
        """Give back the pages the batch reserved (its copies on write too); its requests hold
        what they held before. Host pages the batch was loading land anyway (the cache already
        points at their new slots)."""
        self._end_stage(batch)
        for rid, k, old, fresh in batch.copies:
            rp = self.table[rid]
            self.retain([(rp.owners[k], old)])
            self._drop([self._key(rp.owners[k], fresh)])
            rp.slots[k] = old
        for rid, first_new in batch.new_pages:
            rp = self.table[rid]
            self._drop(self._key(rp.owners[k], rp.slots[k]) for k in range(first_new, len(rp.slots)))
            del rp.owners[first_new:], rp.slots[first_new:]
            rp.pending.clear()
            if not rp.slots:
                del self.table[rid]

    def free(self, rid: Hashable) -> None:
        """Release a finished request's references to its pages (a page no one else holds goes
        back to the free list)."""
        rp = self.table.pop(rid)
        self._drop(self._key(o, s) for o, s in zip(rp.owners, rp.slots, strict=True))

    def truncate(self, rid: Hashable, valid_len: int) -> int:
        """Drop request ``rid``'s tokens from ``valid_len`` on (speculative decoding: the rows of
        rejected draft tokens). Its pages past ``ceil(valid_len / ps)`` lose this request's
        reference; the rows past ``valid_len`` in the tail page are masked until written again
        (rule 28). Returns how many pages went back to the free lists.

        Raises:
            ValueError: ``rid`` is in an uncommitted batch, or ``valid_len`` is not in
                ``[1, valid length]``.
        """
        rp = self.table[rid]
        if rp.pending:
            raise ValueError(f"request {rid!r} is in an uncommitted batch")
        if not 1 <= valid_len <= rp.valid_len:
            raise ValueError(f"request {rid!r} holds {rp.valid_len} tokens, cannot keep {valid_len}")
        keep = cdiv(valid_len, self.fmt.page_size)
        freed = self._drop(self._key(o, s) for o, s in zip(rp.owners[keep:], rp.slots[keep:],
                                                          strict=True))
        del rp.owners[keep:], rp.slots[keep:]
        rp.valid_len = valid_len
        return freed

    def _end_stage(self, batch: BatchKV) -> None:
        batch.stage.finish()
        if batch.stage in self._staging:
            self._staging.remove(batch.stage)

    # ---- host pages (the prefix cache's host tier) --------------------------------------------
    def queue_load(self, load: PageLoad) -> None:
        """Load host pages back into (already reserved) device slots before the next batch reads
        or writes them: one layer ahead of the layer loop, on the side stream on GPUs. The load
        holds its host pages until it is done."""
        self._loads.append(load)

    @property
    def loads_pending(self) -> bool:
        """Queued or in-flight host loads (or copies) whose bytes are not all in place yet."""
        return bool(self._loads) or any(not s.empty for s in self._staging)

    def flush_loads(self) -> None:
        """Finish every queued host load and every in-flight batch's staged page work now (the
        current stream is ordered after it): before a save reads device pages whose load was
        queued, or before a transfer reads them."""
        for stage in self._staging:
            stage.finish()
        if self._loads:
            me = self.alloc_rank(self.rank)
            PageStage(self.kv, self._loads, [], self.alloc_rank, me, self.ops, self.group.device,
                      self.side).finish()
            self._loads = []

    # ---- shared pages (the prefix cache) -------------------------------------------------------
    def _allocate(self, needs: list[int], what: str) -> list[list[int]]:
        """The allocator's pages, asking the reclaimer (the prefix cache) to evict first when
        they do not fit. Raises :class:`PoolExhausted` when they still do not."""
        try:
            return self.allocator.allocate(needs, what=what)
        except PoolExhausted:
            if self.reclaim is None or not self.reclaim(needs):
                raise
            return self.allocator.allocate(needs, what=what)

    def _key(self, owner: int, slot: int) -> tuple[int, int]:
        return self.alloc_rank(owner), slot

    def _drop(self, keys: Iterable[tuple[int, int]]) -> int:
        """One reference less to each page; pages at zero go back to the free lists. Returns
        how many did."""
        return drop_refs(self._refs, keys, self.allocator)

    def refcount(self, owner: int, slot: int) -> int:
        """References to the page at ``slot`` on ``owner`` (0: free)."""
        return self._refs.get(self._key(owner, slot), 0)

    def retain(self, pages: Iterable[tuple[int, int]]) -> None:
        """One more reference to each (owner rank, slot) page.

        Raises:
            ValueError: a page is not held (nothing was changed).
        """
        keys = [self._key(o, s) for o, s in pages]
        missing = [k for k in keys if k not in self._refs]
        if missing:
            raise ValueError(f"cannot share pages that are not held: {missing[:8]}")
        for k in keys:
            self._refs[k] += 1

    def release(self, pages: Iterable[tuple[int, int]]) -> int:
        """One reference less to each (owner rank, slot) page; returns how many went back to the
        free lists."""
        return self._drop(self._key(o, s) for o, s in pages)

    def allocate_pages(self, owner: int, n: int, what: str = "pages") -> list[int]:
        """``n`` new pages on ``owner`` that no request holds yet (one reference each, the
        caller's: give them back with :meth:`release`, or hand them to a request's page table).
        Under pressure the reclaimer (the prefix cache) is asked first.

        Raises:
            PoolExhausted: not enough free pages (nothing taken).
        """
        needs = [0] * self.allocator.num_ranks
        needs[self.alloc_rank(owner)] = n
        return self.take_pages(needs, what)[self.alloc_rank(owner)]

    def take_pages(self, needs: Sequence[int], what: str = "pages") -> list[list[int]]:
        """``needs[a]`` new pages on every allocation rank ``a``, all or nothing, one reference
        each (the caller's), the reclaimer asked first under pressure.

        Raises:
            PoolExhausted: not enough free pages (nothing taken).
        """
        slots = self._allocate(list(needs), what)
        hold_new(self._refs, slots)
        return slots

    def adopt(self, rid: Hashable, pages: Sequence[tuple[int, int]], valid_len: int) -> None:
        """Start request ``rid`` from ``valid_len`` tokens already stored in ``pages`` ((owner,
        slot) of logical pages 0.., shared with whoever holds them): the next batch of ``rid``
        continues after them (a tail page that others hold is copied before it is written).

        Raises:
            ValueError: ``rid`` is in the pool, or ``pages`` does not cover ``valid_len``, or a
                page is not held.
        """
        if rid in self.table:
            raise ValueError(f"request {rid!r} is already in the pool")
        if valid_len < 1 or len(pages) != cdiv(valid_len, self.fmt.page_size):
            raise ValueError(f"{valid_len} valid tokens need {cdiv(valid_len, self.fmt.page_size)} "
                             f"pages of {self.fmt.page_size}, got {len(pages)}")
        self.retain(pages)
        self.table[rid] = RequestPages(owners=[o for o, _ in pages], slots=[s for _, s in pages],
                                       valid_len=valid_len)

    # ---- debug -------------------------------------------------------------------------------
    def _verify_out_cache(self, batch: BatchKV) -> None:
        """Every direct write lands in a page this rank owns, at the row of its position."""
        ps = self.fmt.page_size
        ok, msg = True, ""
        if self.shared and batch.direct_dst.numel():
            reqs, pos = batch.plan.local_rows(self.rank)
            src = (batch.direct_src.tolist() if batch.direct_src is not None
                   else list(range(len(pos))))
            for j, d in zip(src, batch.direct_dst.tolist(), strict=True):
                rp = self.table[batch.rids[reqs[j]]]
                k = pos[j] // ps
                if rp.owners[k] != self.rank or d != rp.slots[k] * ps + pos[j] % ps:
                    ok, msg = False, (f"rank {self.rank}: row {j} (pos {pos[j]}) would write row {d}"
                                      f", page {k} is owned by {rp.owners[k]} at slot {rp.slots[k]}")
                    break
        self.group.check_all(ok, msg)
        if not self.group.all_equal(repr(self.allocator.snapshot())):
            raise RuntimeError("debug: CP ranks' page allocators disagree")
