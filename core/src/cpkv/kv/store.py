"""The device side of a pool: KV bytes per layer, their writes, the full views and staged page
work (rules 13-18).

The bytes are a :class:`~cpkv.kv.buffers.KVBufferSpec` (``spec``: the pool's own tensors or the
caller's), per layer in that layer's stored format (:class:`KVFormat`, one per layer: a layer
without index-K, a GLM-5 shared-indexer layer, stores its latent only) and the pool's
:class:`~cpkv.contracts.BufferLayout`. In cpkv's one-tensor layouts ``kv[layer]`` is [pages, ps,
latent bytes + index bytes], so a page (latent and its index-K sidecar) is one contiguous block,
allocated, written and moved as one; ``latent[layer]`` and ``index_k[layer]`` are its two column
views ([pages, ps, latent bytes] and [pages, ps, index bytes]); how a block's bytes are ordered is
the :class:`PageLayout`. In the engines' ``two_part`` layout a layer's page is two blocks (its
latent tensor's, its index-K tensor's in DeepGEMM's order). Whatever the layout, whole pages move
region by region (``regions[layer]``: uint8 [pages, bytes] views, :meth:`KVBufferSpec.regions`):
copies on write, the host tier, the transfers; a part's token rows are read and written with
:func:`~cpkv.kv.buffers.read_part` / :func:`~cpkv.kv.buffers.write_part`.
How the full view is built is the :class:`~cpkv.kv.materialize.Materializer`
chosen at construction. Which slot holds which page is the :class:`~cpkv.kv.table.PageTable`'s;
the store only reads it, once per batch (:meth:`KVStore.batch`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from cpkv.comm import CPGroup
from cpkv.contracts import (
    BufferLayout,
    CPPlan,
    KVDtype,
    KVFormat,
    MaterializeMode,
    PageLayout,
    layer_formats,
    pages_nbytes,
)
from cpkv.ops import hadamard_rotate, page_blocks

from .batch import BatchKV, build_batch
from .buffers import KVBufferSpec, quantize_rows
from .buffers import write_rows as put_rows
from .materialize import Materializer, Prefetch, open_materializer
from .pages import RequestPages, Reservation
from .stage import PageLoad, PageStage
from .view import FullView, pack_rows

if TYPE_CHECKING:
    from collections.abc import Callable

    from cpkv.ops import OpTable

    from .host import HostPages

__all__ = ["KVStore"]


class KVStore:
    """One rank's KV bytes (see the module docstring).

    Args:
        fmt: stored format, one for every layer or one per layer (a sequence).
        num_layers: layers with KV.
        group: the CP group.
        ops: the op table (page gather/scatter/copy, fp8 pack).
        mode: how full views are built (``replica`` for a replicated pool).
        capacity: pages per buffer.
        layout: how a page's bytes lie in the tensors (a ``storage``'s own when given).
        alloc_rank: the page table's owner -> allocation rank map.
        storage: the caller's page tensors (used in place), or None.
    """

    def __init__(self, fmt: KVFormat | Sequence[KVFormat], num_layers: int, group: CPGroup,
                 ops: OpTable, mode: MaterializeMode, capacity: int,
                 layout: BufferLayout | PageLayout, alloc_rank: Callable[[int], int],
                 storage: KVBufferSpec | None = None) -> None:
        #: per layer, its stored format
        self.fmts = layer_formats(fmt, num_layers)
        #: the pool's format (page size, dtype, dims): its first layer with index-K
        self.fmt = next((f for f in self.fmts if f.index_k), self.fmts[0])
        self.num_layers, self.group, self.ops = num_layers, group, ops
        self.capacity, self.alloc_rank = capacity, alloc_rank
        #: the side stream of work done a layer ahead (prefix pages, host loads); None on CPU
        self.side: torch.cuda.Stream | None = None
        if group.device.type == "cuda":
            self.side = torch.cuda.Stream(device=group.device)  # type: ignore[no-untyped-call]
        self.views: Materializer = open_materializer(mode, self.fmts, num_layers, capacity, group,
                                                     ops, self.side, layout, storage)
        #: the pool's tensors (the strategy's), per layer in its layout
        self.spec: KVBufferSpec = self.views.spec
        #: per layer, its page regions (uint8 [pages, bytes] views): what page movers copy
        self.regions = [self.spec.regions(i) for i in range(num_layers)]
        #: the byte order of the page blocks this pool's pages are read and written as by other
        #: pools (two_part: canonical token-major blocks, :func:`~cpkv.kv.buffers.read_pages`)
        self.layout = self.spec.layout.page_layout or PageLayout.TOKEN_MAJOR
        #: per layer: uint8 [pages, ps, latent + index bytes of that layer] (one-tensor layouts;
        #: empty for two_part, whose parts are ``spec``'s tensors)
        self.kv = [lb.kv for lb in self.spec.layers if lb.kv is not None]
        nl, ps = self.fmt.latent_bytes_per_token, self.fmt.page_size
        if self.spec.layout is BufferLayout.TWO_PART:
            self.latent: list[torch.Tensor] = []
            self.index_k: list[torch.Tensor] = []
        elif self.layout is PageLayout.TOKEN_MAJOR:
            self.latent = [b[..., :nl] for b in self.kv]
            self.index_k = [b[..., nl:] for b in self.kv]
        else:  # a page's latent rows, then its index-K rows
            flat = [b.view(b.shape[0], -1) for b in self.kv]
            self.latent = [f[:, :ps * nl].view(-1, ps, nl) for f in flat]
            self.index_k = [f[:, ps * nl:].view(f.shape[0], ps, m.index_bytes_per_token)
                            for f, m in zip(flat, self.fmts, strict=True)]
        #: host pages queued to load back (the cache's host tier), staged by the next batch
        self._loads: list[PageLoad] = []
        #: stages of batches not ended yet
        self._staging: list[PageStage] = []
        #: part-major writes: the last batch's destination rows as (rows, page, offset)
        self._addr: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every layer (each in its own format)."""
        return pages_nbytes(self.fmts, 1)

    @property
    def shared(self) -> bool:
        return self.views.mode is not MaterializeMode.REPLICA

    # ---- per batch -----------------------------------------------------------------------------
    def batch(self, plan: CPPlan, res: Reservation,
              requests: Mapping[Hashable, RequestPages]) -> BatchKV:
        """The batch's out-cache locations, materialization plan and staged page work (queued
        host loads, this rank's copies on write), from the page tables that hold ``res``."""
        me = self.alloc_rank(self.group.rank)
        cows = [(old, fresh) for rid, k, old, fresh in res.copies
                if self.alloc_rank(requests[rid].owners[k]) == me]
        stage = PageStage(self.regions, self._loads, cows, self.alloc_rank, me, self.ops,
                          self.group.device, self.side)
        self._loads = []
        batch = build_batch(plan, res, requests, self.group.rank, self.shared, self.group.device,
                            capacity=self.capacity, stage=stage, group=self.group, ops=self.ops)
        self._staging.append(stage)
        return batch

    def begin(self, batch: BatchKV) -> None:
        """The batch's reads may start (after this no peer still reads its new slots, so
        staged copies may land)."""
        self.views.begin_batch(batch)

    def end(self, batch: BatchKV) -> None:
        """The batch's staged work is done (commit or abort)."""
        batch.stage.finish()
        if batch.stage in self._staging:
            self._staging.remove(batch.stage)

    def _pack(self, layer: int, latent: torch.Tensor,
              index_k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute rows -> stored bytes of ``layer``'s two parts (no index-K bytes, [N, 0], for a
        layer without index-K: ``index_k`` is ignored there and may be None)."""
        fmt = self.fmts[layer]
        lat_b = pack_rows(latent, fmt, "latent", self.ops)
        if not fmt.index_k:
            return lat_b, lat_b.new_empty((lat_b.shape[0], 0))
        if index_k is None:
            raise ValueError(f"layer {layer} caches index-K: its index_k rows are needed")
        return lat_b, pack_rows(index_k, fmt, "index_k", self.ops)

    def write(self, layer: int, batch: BatchKV, latent: torch.Tensor,
              index_k: torch.Tensor | None) -> None:
        """Store this rank's new KV rows of ``layer`` (compute dtype, [local rows, D]): direct
        writes into own pages, then (non-aligned requests, a replica) one all-gather of the
        packed rows and owner writes. ``index_k`` is None for a layer without index-K."""
        batch.stage.ready(layer)
        lat_b, idx_b = self._pack(layer, latent, index_k)
        nl = lat_b.shape[1]
        if batch.direct_dst.numel():
            src_l, src_i = lat_b, idx_b
            if batch.direct_src is not None:
                src_l = self.ops.page_gather(lat_b, batch.direct_src)
                src_i = self.ops.page_gather(idx_b, batch.direct_src)
            self._store(layer, batch.direct_dst, src_l, src_i)
        if batch.gather_writes:
            both = torch.cat([lat_b, idx_b], dim=1) if idx_b.shape[1] else lat_b
            gathered = self.group.all_gather_rows(both, batch.rows.max_rank_len)
            mine = self.ops.page_gather(gathered, batch.owner_src)
            self._store(layer, batch.owner_dst, mine[:, :nl], mine[:, nl:])

    def _store(self, layer: int, rows: torch.Tensor, latent: torch.Tensor,
               index_k: torch.Tensor) -> None:
        """Packed rows into token rows ``rows`` (page slot x ps + offset) of ``layer``."""
        if self.spec.layout is BufferLayout.TWO_PART:
            put_rows(self.spec, layer, rows, latent,
                     index_k if self.fmts[layer].index_k else None)
            return
        if self.layout is PageLayout.TOKEN_MAJOR:
            tok = self.kv[layer].view(-1, self.fmts[layer].bytes_per_token)
            nl = latent.shape[1]
            self.ops.page_scatter(tok[:, :nl], rows, latent)  # dense rows, row stride B
            if index_k.shape[1]:
                self.ops.page_scatter(tok[:, nl:], rows, index_k)
            return
        # part-major token rows are not evenly spaced: address them as (page, offset), computed
        # once per batch (``rows`` is the batch's) and reused by every layer
        if self._addr is None or self._addr[0] is not rows:
            ps = self.fmt.page_size
            self._addr = (rows, rows // ps, rows % ps)
        _, page, off = self._addr
        self._put(layer, page, off, latent, index_k)

    def _put(self, layer: int, page: torch.Tensor, off: torch.Tensor, latent: torch.Tensor,
             index_k: torch.Tensor) -> None:
        """Part-major writes: packed rows at (page slot, offset) of ``layer``'s two parts."""
        self.latent[layer].index_put_((page, off), latent)
        if index_k.shape[1]:
            self.index_k[layer].index_put_((page, off), index_k)

    def write_rows(self, layer: int, rows: torch.Tensor, latent: torch.Tensor,
                   index_k: torch.Tensor | None, rotate: bool = False) -> None:
        """Store KV rows (compute dtype, [N, D]) at token rows ``rows`` (int64 [N], page slot x
        ps + offset) of ``layer``, read from the device each call: the decode step's write
        (device work only; ``rows`` is a persistent buffer whose values change between calls).
        ``index_k`` is None for a layer without index-K; ``rotate``: store it Hadamard-rotated
        (an fp8 pool's index-K, DeepSeek's ``rotate_activation``). An fp8 pool quantizes them
        into place (:func:`~cpkv.kv.buffers.quantize_rows`: the ``fp8_store`` op, a part a
        call); a bf16 pool packs, then writes."""
        if self.fmts[layer].dtype is KVDtype.FP8:
            quantize_rows(self.spec, layer, rows, latent, index_k, rotate, self.ops)
            return
        lat_b, idx_b = self._pack(layer, latent,
                                  hadamard_rotate(index_k) if rotate and index_k is not None
                                  else index_k)
        if self.layout is PageLayout.TOKEN_MAJOR:  # two_part too (its own writes)
            self._store(layer, rows, lat_b, idx_b)
            return
        ps = self.fmt.page_size
        self._put(layer, rows // ps, rows % ps, lat_b, idx_b)

    def relayout(self, slots: Sequence[int], layout: PageLayout) -> None:
        """Pages at ``slots`` (every layer) hold blocks in ``layout``: rewrite them in place in
        this store's layout."""
        if layout is self.layout or not slots:
            return
        if self.spec.layout is BufferLayout.TWO_PART:
            raise ValueError(f"{layout.value} page blocks cannot land in a two_part pool's "
                             f"tensors: a transfer writes it in its own layout")
        nl = self.fmt.latent_bytes_per_token
        idx = torch.tensor(list(slots), dtype=torch.int64, device=self.group.device)
        for layer in range(self.num_layers):
            raw = self.kv[layer].index_select(0, idx)  # [n, ps, B]: the blocks as they came
            lat, ixk = page_blocks(raw, layout, nl)
            self.latent[layer].index_copy_(0, idx, lat)
            if ixk.shape[2]:
                self.index_k[layer].index_copy_(0, idx, ixk)

    def prefetch(self, layer: int, batch: BatchKV) -> Prefetch | None:
        """Start ``layer``'s staged page work and the strategy's prefetch (see
        :meth:`~cpkv.kv.ShardedKVPool.prefetch`)."""
        batch.stage.issue(layer)
        return self.views.prefetch(layer, batch)

    def materialize(self, layer: int, batch: BatchKV,
                    prefetched: Prefetch | None = None) -> FullView:
        """The full view of ``layer`` for the batch, in natural order (rule 15)."""
        batch.stage.ready(layer)
        return self.views.full_view(layer, batch, prefetched)

    # ---- host pages (the prefix cache's host tier) --------------------------------------------
    def queue_load(self, load: PageLoad) -> None:
        """Load host pages into reserved device slots with the next batch's staged work."""
        self._loads.append(load)

    def queued_loads(self) -> tuple[PageLoad, ...]:
        """Host loads queued and not yet handed to a batch."""
        return tuple(self._loads)

    @property
    def loads_pending(self) -> bool:
        """Queued or in-flight host loads (or copies) whose bytes are not all in place yet."""
        return bool(self._loads) or any(not s.empty for s in self._staging)

    def save_to_host(self, host: HostPages, dev_slots: Sequence[int],
                     host_slots: Sequence[int]) -> None:
        """Copy this rank's device pages ``dev_slots`` (every layer) into ``host``'s pages
        ``host_slots`` (same order), queued on the current stream (see :meth:`HostPages.save`)."""
        host.save(self.regions, host.index(dev_slots), host.index(host_slots), self.ops)

    def flush_loads(self) -> None:
        """Finish every queued host load and every in-flight batch's staged work now."""
        for stage in self._staging:
            stage.finish()
        if self._loads:
            me = self.alloc_rank(self.group.rank)
            PageStage(self.regions, self._loads, [], self.alloc_rank, me, self.ops,
                      self.group.device, self.side).finish()
            self._loads = []

    # ---- debug -------------------------------------------------------------------------------
    def verify_out_cache(self, batch: BatchKV, requests: Mapping[Hashable, RequestPages]) -> None:
        """Every direct write lands in a page this rank owns, at the row of its position; all
        ranks agree (a collective that syncs).

        Raises:
            RuntimeError: on every rank, when one rank's check failed.
        """
        ps, rank = self.fmt.page_size, self.group.rank
        ok, msg = True, ""
        if self.shared and batch.direct_dst.numel():
            reqs, pos = batch.plan.local_rows(rank)
            src = (batch.direct_src.tolist() if batch.direct_src is not None
                   else list(range(len(pos))))
            for j, d in zip(src, batch.direct_dst.tolist(), strict=True):
                rp = requests[batch.rids[reqs[j]]]
                k = pos[j] // ps
                if rp.owners[k] != rank or d != rp.slots[k] * ps + pos[j] % ps:
                    ok, msg = False, (f"rank {rank}: row {j} (pos {pos[j]}) would write row {d}"
                                      f", page {k} is owned by {rp.owners[k]} at slot {rp.slots[k]}")
                    break
        self.group.check_all(ok, msg)
