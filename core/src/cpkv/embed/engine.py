"""EngineKV: cpkv's plan, ownership, views and transfer manifest over an engine's own KV tensors
and slots. The engine keeps its scheduler, its slot allocator and its kernels.

Per batch (host work, once): :meth:`EngineKV.plan` (the split plan, continuing what the table
holds) -> :meth:`EngineKV.prepare` (the engine's (owner, slot) per new page checked and taken,
the out-cache rows and the materialization plan) -> :meth:`EngineKV.copy_tail_pages` when a
hit's tail page is copied on write. Per layer (device work, through the custom ops of
:mod:`cpkv.embed.library`): :meth:`EngineKV.put_bytes` (already-packed rows into own pages; for
a request that is not page-aligned, one all-gather of the rows and owner writes) ->
:meth:`EngineKV.view` (one all-gather of owned pages -> the full view). Then
:meth:`EngineKV.commit` (or :meth:`EngineKV.abort`); :meth:`EngineKV.manifest` names each
rank's pages of a request for the engine's own PD transfer.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from cpkv.comm import CPGroup
from cpkv.contracts import CPPlan, PageLayout, SplitMode
from cpkv.disagg import TransferManifest, manifest_for
from cpkv.kv import BatchKV, FullView, PageTable
from cpkv.kv.batch import build_batch
from cpkv.kv.buffers import KVBufferSpec, read_pages, write_pages
from cpkv.kv.stage import PageStage
from cpkv.ops import OpTable
from cpkv.planning import plan_batch

from . import library
from .rules import KeyRanges, key_ranges

__all__ = ["EngineBatch", "EngineKV"]


@dataclass(frozen=True)
class EngineBatch:
    """One batch on one rank: cpkv's per-batch KV metadata (``kv``: out-cache rows, the
    materialization plan, the row split and gather) and the local rows' key ranges, host
    (``ranges``) and on the device (``positions``, ``key_start``, ``key_end``: int64 [rows])."""

    kv: BatchKV
    ranges: KeyRanges
    positions: torch.Tensor
    key_start: torch.Tensor
    key_end: torch.Tensor

    @property
    def plan(self) -> CPPlan:
        return self.kv.plan


class EngineKV:
    """One rank's view of an engine's KV under CP.

    Args:
        spec: the engine's tensors (:class:`~cpkv.kv.buffers.KVBufferSpec`); never copied.
        group: the CP group.
        ops: the op table (row splits and gathers; :func:`cpkv.embed.backend_ops`).
        mode: the split mode of the plans.
    """

    def __init__(self, spec: KVBufferSpec, group: CPGroup, ops: OpTable, *,
                 mode: SplitMode | str = SplitMode.ZIGZAG) -> None:
        if spec.device != group.device:
            raise ValueError(f"the KV tensors are on {spec.device}, the CP group on {group.device}")
        self.spec, self.group, self.ops, self.mode = spec, group, ops, SplitMode(mode)
        self.fmt = spec.fmt
        #: request page tables and reference counts (the same on every rank); slots are the
        #: engine's (``prepare``'s ``given``)
        self.pages = PageTable(spec.fmt.page_size, group.size, spec.capacity)
        #: the handle the custom ops read the format, layout and group by
        self.handle = library.register(spec, group)
        self._empty = torch.empty(0, dtype=torch.uint8, device=group.device)

    def close(self) -> None:
        """Forget the ops' handle."""
        library.unregister(self.handle)

    # ---- per batch -----------------------------------------------------------------------------
    def plan(self, batch: Sequence[tuple[Hashable, int]]) -> CPPlan:
        """The split plan of ``batch`` ((request id, new tokens)), continuing what it holds."""
        specs = [self.pages.request_spec(rid, n) for rid, n in batch]
        return plan_batch(specs, self.group.size, self.fmt.page_size, self.mode)

    def prepare(self, plan: CPPlan, rids: Sequence[Hashable],
                given: Mapping[Hashable, Sequence[tuple[int, int]]]) -> EngineBatch:
        """Take the engine's pages for the batch (``given``: see :meth:`PageTable.reserve`)
        and build its metadata (once per batch, every rank alike).

        Raises:
            ValueError: the plan disagrees with the table, or a given page is wrong.
        """
        res = self.pages.reserve(plan, rids, given=given)
        try:
            dev = self.group.device
            stage = PageStage([], [], [], self.pages.alloc_rank, self.group.rank, self.ops, dev,
                              None)
            kv = build_batch(plan, res, self.pages.requests, self.group.rank, True, dev,
                             capacity=self.spec.capacity, stage=stage, group=self.group,
                             ops=self.ops)
        except BaseException:
            self.pages.abort(res)
            raise
        kr = key_ranges(plan, self.group.rank)
        pos, ks, ke = (torch.tensor(v, dtype=torch.int64).to(dev)
                       for v in (kr.position, kr.key_start, kr.key_end))
        return EngineBatch(kv=kv, ranges=kr, positions=pos, key_start=ks, key_end=ke)

    def copy_tail_pages(self, batch: EngineBatch) -> None:
        """Copies on write of shared tail pages owned by this rank (every layer), before the
        batch's first write (rule 3: the copy stays on the page's owner)."""
        me = self.group.rank
        mine = [(old, fresh) for rid, k, old, fresh in batch.kv.copies
                if self.pages.requests[rid].owners[k] == me]
        if not mine:
            return
        dev = self.group.device
        src = torch.tensor([o for o, _ in mine], dtype=torch.int64, device=dev)
        dst = torch.tensor([f for _, f in mine], dtype=torch.int64, device=dev)
        for layer in range(self.spec.num_layers):
            write_pages(self.spec, layer, dst, read_pages(self.spec, layer, src))

    def commit(self, batch: EngineBatch) -> None:
        """The batch's tokens are valid (after every layer wrote)."""
        self.pages.commit(batch.kv.reservation)

    def abort(self, batch: EngineBatch) -> None:
        """Give the batch's pages back to the table (the engine frees its slots)."""
        self.pages.abort(batch.kv.reservation)

    # ---- per layer -----------------------------------------------------------------------------
    def _bufs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's tensors as the ops take them (an empty index tensor when it has none)."""
        lb = self.spec.layers[layer]
        main = lb.kv if lb.kv is not None else lb.latent
        assert main is not None
        idx = lb.index_k if lb.index_k is not None else self._empty
        return main, idx

    def put_bytes(self, layer: int, batch: EngineBatch, latent: torch.Tensor,
                  index_k: torch.Tensor | None) -> None:
        """Store this rank's new rows of ``layer``, already packed in the stored format
        (uint8 [local rows, latent bytes], [local rows, index bytes] or None for a layer
        without index-K): direct writes into own pages (rule 13); for requests that are not
        page-aligned one all-gather of the rows, then each owner writes its pages (rule 14)."""
        kv, (a, b) = batch.kv, self._bufs(layer)
        if kv.direct_dst.numel():
            lat, idx = latent, index_k
            if kv.direct_src is not None:
                lat = latent.index_select(0, kv.direct_src)
                idx = None if index_k is None else index_k.index_select(0, kv.direct_src)
            torch.ops.cpkv.put_bytes(a, b, kv.direct_dst, lat, idx, self.handle, layer)
        if kv.gather_writes:
            both = latent if index_k is None else torch.cat([latent, index_k], dim=1)
            torch.ops.cpkv.owner_put_bytes(a, b, both, kv.owner_src, kv.owner_dst, self.handle,
                                           layer, kv.rows.max_rank_len)

    def take_bytes(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed rows at this rank's token rows ``rows`` (int64 [N]) of ``layer``."""
        a, b = self._bufs(layer)
        out: tuple[torch.Tensor, torch.Tensor] = torch.ops.cpkv.take_bytes(a, b, rows, self.handle,
                                                                             layer)
        return out

    def view_rows(self, layer: int, batch: EngineBatch) -> torch.Tensor:
        """``layer``'s full view as rows: uint8 [keys, latent + index bytes], natural order
        (one all-gather of the owned pages, ``cpkv::all_gather_pages``)."""
        m = batch.kv.materialize
        a, b = self._bufs(layer)
        out: torch.Tensor = torch.ops.cpkv.all_gather_pages(a, b, m.send_slots[0], m.view_index,
                                                             self.handle, layer)
        return out

    def view(self, layer: int, batch: EngineBatch) -> FullView:
        """``layer``'s full view (:meth:`view_rows`) as a :class:`~cpkv.kv.FullView`: its
        ``keys`` / ``attention_keys`` give what the indexer and sparse MLA ops take."""
        m = batch.kv.materialize
        return FullView(pages=self.view_rows(layer, batch).unsqueeze(1), index=None,
                        fmt=self.spec.fmts[layer], layout=PageLayout.TOKEN_MAJOR, cu_seqlens=m.cu_seqlens,
                        seq_lens=m.seq_lens, ops=self.ops)

    # ---- transfer ------------------------------------------------------------------------------
    def manifest(self, rid: Hashable, *, final: bool = True,
                 already_sent: int = 0) -> TransferManifest:
        """Each rank's pages of ``rid`` (logical positions and slots): the engine's PD
        framework sends ``read_pages`` of this rank's runs (:meth:`send_pages`)."""
        return manifest_for(rid, self.pages.requests[rid], self.fmt.page_size, self.group.size,
                            final=final, already_sent=already_sent)

    def send_pages(self, manifest: TransferManifest) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """This rank's part of ``manifest`` as canonical page blocks, per layer: (logical pages,
        uint8 [layers, n, ps, B]) per run, what a receiver writes with ``write_pages``."""
        out: list[tuple[tuple[int, ...], torch.Tensor]] = []
        dev = self.group.device
        for part in manifest.parts:
            if part.rank != self.group.rank:
                continue
            for run in part.runs:
                slots = torch.arange(run.src_slot, run.src_slot + run.num_pages, device=dev)
                blocks = torch.stack([read_pages(self.spec, layer, slots)
                                      for layer in range(self.spec.num_layers)])
                out.append((tuple(range(run.first_page, run.first_page + run.num_pages)), blocks))
        return out
