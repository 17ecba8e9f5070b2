"""EngineKV: cpkv's plan, ownership, views and transfer manifest over an engine's own KV tensors
and slots. The engine keeps its scheduler, its slot allocator and its kernels.

Who frees what: the engine's allocator hands out every slot (``prepare``'s ``given``); cpkv
counts the references to each page (the requests that hold it, and outside holders such as the
engine's prefix cache: :meth:`EngineKV.retain`) and checks each given slot against the plan (its
owner, given once, not held). A slot goes back to the engine's allocator when, and only when,
:meth:`EngineKV.free`, :meth:`EngineKV.release` or :meth:`EngineKV.abort` returns it.

Per batch (host work, once): :meth:`EngineKV.adopt` (a prefix hit, before the plan) ->
:meth:`EngineKV.plan` -> :meth:`EngineKV.owners_to_give` (the owner of each page the engine
gives) -> :meth:`EngineKV.prepare` (the given slots checked and taken, copies on write of shared
tail pages made, the out-cache rows, the materialization plan, the row maps). Per layer (device
work, through the custom ops of :mod:`cpkv.embed.library`): :meth:`EngineKV.put_bytes` ->
:meth:`EngineKV.view`. Then :meth:`EngineKV.commit` (or :meth:`EngineKV.abort`). The per-batch
lifecycle is :class:`~cpkv.kv.ShardedKVPool`'s over the engine's tensors (``storage=``): one
implementation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from cpkv.comm import CPGroup
from cpkv.contracts import (
    CPPlan,
    FallbackEvent,
    FallbackPolicy,
    KVFormat,
    PageLayout,
    SplitMode,
)
from cpkv.disagg import TransferManifest, manifest_for
from cpkv.fallback import recording
from cpkv.kv import BatchKV, FullView, ShardedKVPool, ragged_to_paged
from cpkv.kv.buffers import KVBufferSpec, read_pages
from cpkv.ops import KV_OPS, OpTable
from cpkv.planning import plan_batch

from . import library
from .rules import KeyRanges, LogitsRows, key_ranges, logits_rows
from .write import quantize

__all__ = ["EngineBatch", "EngineKV", "LayerKV", "kv_ops"]


def kv_ops(device: torch.device | str = "cpu") -> OpTable:
    """cpkv's torch page and row ops (no collective, nothing agreed across ranks): what
    :class:`EngineKV` moves pages and rows with when the engine brings its own kernels."""
    from cpkv.plugin import PluginHost

    host = PluginHost()
    try:
        return OpTable.resolve(host.backends(), ["torch"], KV_OPS,
                               device_type=torch.device(device).type, quiet=True)
    finally:
        host.close()


@dataclass(frozen=True)
class LayerKV:
    """One layer's tensors as the per-layer calls take them (:meth:`EngineKV.layer`): pass it
    instead of the layer's index inside a compiled forward, so that one graph serves every
    layer (an int argument is a constant a compiler specializes on; tensors are not).

    Attributes:
        latent: the layer's latent (two-part) or whole-page (one-tensor layouts) tensor.
        index_k: its index-K tensor; an empty uint8 tensor for a one-tensor layout or a layer
            without index-K.
        fmt: the layer's stored format.
    """

    latent: torch.Tensor
    index_k: torch.Tensor
    fmt: KVFormat


@dataclass(frozen=True)
class EngineBatch:
    """One batch on one rank, built by :meth:`EngineKV.prepare` (every field the same on every
    rank except the local rows').

    Attributes:
        rids: the requests, in batch order.
        ranges: this rank's local rows, host tuples: per row its ``request`` (index in
            ``rids``), ``position``, ``token`` (index in its request's new tokens),
            ``key_start`` / ``key_end`` (its causal key range in the full view).
        logits: per request, the ``rank`` and local ``row`` of its last new token (the logits
            row), the same on every rank.
        positions: int64 [local rows], device: ``ranges.position``.
        key_start: int64 [local rows], device: ``ranges.key_start``.
        key_end: int64 [local rows], device: ``ranges.key_end``.
        token_index: int64 [local rows], device: each row's index in the batch's new tokens
            concatenated in batch order (``new_ids[batch.token_index]``: the local token ids).
        last_index: int64 [requests], device: each request's last new token in that order.
        kv: cpkv's per-batch KV metadata (out-cache rows, materialization plan; read by the
            per-layer calls, not by the engine).
    """

    rids: tuple[Hashable, ...]
    ranges: KeyRanges
    logits: LogitsRows
    positions: torch.Tensor
    key_start: torch.Tensor
    key_end: torch.Tensor
    token_index: torch.Tensor
    last_index: torch.Tensor
    kv: BatchKV

    @property
    def plan(self) -> CPPlan:
        """The batch's split plan."""
        return self.kv.plan

    @property
    def copies(self) -> tuple[tuple[Hashable, int, int, int], ...]:
        """The copies on write :meth:`EngineKV.prepare` made: (rid, logical page, old slot, new
        slot)."""
        return self.kv.copies

    def paged(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(owner rank, physical token row) of each full-view index of ``indices`` (int [N, k],
        -1 padded: -1 stays -1), for kernels that read the owners' pages in place (PAGED)."""
        return ragged_to_paged(indices, self.kv)

    def gather_last(self, local: torch.Tensor) -> torch.Tensor:
        """Each request's last-token row of ``local`` ([local rows, ...], every rank's own) on
        every rank: [requests, ...], batch order. A collective (only those rows move)."""
        return self.kv.gather_rows(local, self.last_index)


class EngineKV:
    """One rank's view of an engine's KV under CP (see the module docstring).

    Args:
        spec: the engine's tensors (:class:`~cpkv.kv.buffers.KVBufferSpec`); never copied.
        group: the CP group.
        ops: the op table cpkv moves pages and rows with; None: :func:`kv_ops` (torch, no
            collective). :func:`cpkv.embed.backend_ops` only when the engine also wants cpkv's
            kernels (or cpkv's GPU page movers).
        mode: the split mode of the plans.
        fallback: the fallback policy of :meth:`plan` and :meth:`prepare` (``"warn"``: an
            extend too short for the page-aligned split is split by tokens and its rows written
            by their owners after one row all-gather, reported through ``cpkv.fallback``;
            ``"error"``: raises :class:`cpkv.FallbackError` instead); None: the active policy
            (:func:`cpkv.fallback.recording`). Events are kept in :attr:`fallbacks`.

    Raises:
        ValueError: the tensors and the group are on different devices.
    """

    def __init__(self, spec: KVBufferSpec, group: CPGroup, ops: OpTable | None = None, *,
                 mode: SplitMode | str = SplitMode.ZIGZAG,
                 fallback: FallbackPolicy | str | None = None) -> None:
        if spec.device != group.device:
            raise ValueError(f"the KV tensors are on {spec.device}, the CP group on {group.device}")
        self.ops = ops if ops is not None else kv_ops(group.device)
        self.spec, self.group, self.mode = spec, group, SplitMode(mode)
        self.fmt = spec.fmt
        self.fallback = None if fallback is None else FallbackPolicy(fallback)
        #: fallbacks reported by :meth:`prepare` under :attr:`fallback` (a policy was given)
        self.fallbacks: list[FallbackEvent] = []
        # the one per-batch lifecycle over the page table, on the engine's tensors
        self._pool = ShardedKVPool(spec.fmts, spec.num_layers, group, self.ops, storage=spec)
        #: the handle the custom ops read the format, layout and group by
        self.handle = library.register(spec, group)
        empty = torch.empty(0, dtype=torch.uint8, device=group.device)
        self._layers = tuple(
            LayerKV(latent=lb.kv if lb.kv is not None else lb.latent,  # type: ignore[arg-type]
                    index_k=lb.index_k if lb.index_k is not None else empty, fmt=f)
            for lb, f in zip(spec.layers, spec.fmts, strict=True))

    def close(self) -> None:
        """Forget the ops' handle (before the process group is destroyed)."""
        library.unregister(self.handle)

    # ---- requests' pages (cpkv's record, the same on every rank) -------------------------------
    def valid_len(self, rid: Hashable) -> int:
        """Tokens of ``rid`` stored and committed (0: not held)."""
        rp = self._pool.pages.requests.get(rid)
        return 0 if rp is None else rp.valid_len

    def request_pages(self, rid: Hashable) -> tuple[tuple[int, int], ...]:
        """``rid``'s pages in logical order: (owner rank, slot) each (empty: not held); what
        :func:`cpkv.embed.hit_pages` takes for a prefix hit on it."""
        rp = self._pool.pages.requests.get(rid)
        return () if rp is None else tuple(zip(rp.owners, rp.slots, strict=True))

    def adopt(self, rid: Hashable, pages: Sequence[tuple[int, int]], hit_len: int) -> None:
        """Start request ``rid`` from a prefix hit: ``hit_len`` tokens stored in ``pages``
        ((owner, slot) of logical pages 0..: :func:`cpkv.embed.hit_pages`), one more reference
        each. Call before :meth:`plan`; the plan continues after the hit, and a hit ending
        inside a page others still hold gets that page copied on write by :meth:`prepare` (on
        its owner, into the first slot :meth:`owners_to_give` asks for).

        Raises:
            ValueError: ``rid`` is held already, ``pages`` does not cover ``hit_len``, or a
                page is not held (nothing changed).
        """
        self._pool.pages.adopt(rid, pages, hit_len)

    def retain(self, pages: Iterable[tuple[int, int]]) -> None:
        """One more reference to each (owner, slot) page: an outside holder (the engine's
        prefix cache keeping a finished request's pages).

        Raises:
            ValueError: a page is not held (nothing changed).
        """
        self._pool.pages.retain(pages)

    def release(self, pages: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """One reference less to each (owner, slot) page (an outside holder lets go). Returns
        the (owner, slot) pages nothing holds any more: the engine's allocator takes them
        back."""
        return self._pool.pages.release_pages(pages)

    def free(self, rid: Hashable) -> list[tuple[int, int]]:
        """Drop request ``rid``'s references to its pages. Returns the (owner, slot) pages
        nothing holds any more: the engine's allocator takes them back.

        Raises:
            KeyError: ``rid`` is not held.
        """
        return self._pool.pages.free(rid)

    # ---- per batch -----------------------------------------------------------------------------
    def plan(self, batch: Sequence[tuple[Hashable, int]]) -> CPPlan:
        """The split plan of ``batch`` ((request id, new tokens)), continuing what each request
        holds (its committed tokens, an adopted hit). Pure host work, the same on every rank.

        Raises:
            cpkv.FallbackError: an extend too short for the page-aligned split under the
                policy ``error``.
        """
        specs = [self._pool.pages.request_spec(rid, n) for rid, n in batch]
        with self._policy():
            return plan_batch(specs, self.group.size, self.fmt.page_size, self.mode)

    @contextlib.contextmanager
    def _policy(self) -> Iterator[None]:
        """Run under :attr:`fallback` (keeping its events), or the active policy when None."""
        if self.fallback is None:
            yield
            return
        with recording(self.fallback) as rec:
            try:
                yield
            finally:
                self.fallbacks.extend(rec.events)

    def owners_to_give(self, plan: CPPlan, rids: Sequence[Hashable]
                       ) -> dict[Hashable, tuple[int, ...]]:
        """Per request, the owner rank of each page :meth:`prepare`'s ``given`` must hold, in
        order: first the copy of a shared tail page the extend writes into (after a hit ending
        mid-page), then its new logical pages. The engine's allocator gives one slot on that
        rank for each: ``given = {rid: [(o, alloc(o)) for o in owners]}``.

        Raises:
            ValueError: the plan disagrees with what the requests hold.
        """
        return self._pool.pages.owners_to_give(plan, rids)

    def prepare(self, plan: CPPlan, rids: Sequence[Hashable],
                given: Mapping[Hashable, Sequence[tuple[int, int]]]) -> EngineBatch:
        """Take the engine's pages for the batch, make its copies on write (every layer, on
        the page's owner) and build its metadata (once per batch, every rank alike).

        ``given``: per request, an (owner rank, slot) per owner of :meth:`owners_to_give`, in
        that order. Each is checked: the owner is the plan's, the slot is in range, not held,
        and given once.

        Raises:
            ValueError: the plan disagrees with what the requests hold, or a given page is
                wrong (naming it); nothing changed.
            cpkv.FallbackError: a request is not page-aligned under the policy ``error``.
        """
        with self._policy():
            kv = self._pool.prepare(plan, rids, given=given)
        for layer in range(self.spec.num_layers):  # copies on write, before any layer writes
            kv.stage.ready(layer)
        dev = self.group.device
        kr = key_ranges(plan, self.group.rank)
        offs = plan.natural_offsets()
        tok = [offs[r] + t for r, t in zip(kr.request, kr.token, strict=True)]
        last = [o + r.extend_len - 1 for o, r in zip(offs, plan.requests, strict=True)]
        pos, ks, ke, ti, li = (torch.tensor(v, dtype=torch.int64).to(dev)
                               for v in (kr.position, kr.key_start, kr.key_end, tok, last))
        return EngineBatch(rids=tuple(rids), ranges=kr, logits=logits_rows(plan), positions=pos,
                           key_start=ks, key_end=ke, token_index=ti, last_index=li, kv=kv)

    def commit(self, batch: EngineBatch) -> None:
        """The batch's tokens are valid (after every layer wrote)."""
        self._pool.commit(batch.kv)

    def abort(self, batch: EngineBatch) -> list[tuple[int, int]]:
        """Undo :meth:`prepare`: the requests hold what they held before. Returns the (owner,
        slot) pages given for the batch: the engine's allocator takes them back."""
        return self._pool.abort(batch.kv)

    # ---- per layer -----------------------------------------------------------------------------
    def quantize(self, latent: torch.Tensor, index_k: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """New rows -> the stored bytes :meth:`put_bytes` takes, in this KV's format
        (:func:`cpkv.embed.quantize`: fp8 index-K rotated; pass None for a layer without
        index-K)."""
        return quantize(self.fmt, latent, index_k)

    def layer(self, layer: int) -> LayerKV:
        """Layer ``layer``'s tensors (and format) as the per-layer calls take them: bind them
        once, outside a compiled forward, and pass them instead of the index."""
        return self._layers[layer]

    def _bufs(self, layer: int | LayerKV) -> LayerKV:
        return layer if isinstance(layer, LayerKV) else self._layers[layer]

    def put_bytes(self, layer: int | LayerKV, batch: EngineBatch, latent: torch.Tensor,
                  index_k: torch.Tensor | None) -> None:
        """Store this rank's new rows of ``layer`` (its index, or :meth:`layer`), already packed
        in the stored format (uint8 [local rows, latent bytes], [local rows, index bytes] or
        None for a layer without index-K: :func:`cpkv.embed.quantize` for fp8): direct writes
        into own pages (rule 13); for requests that are not page-aligned one all-gather of the
        rows, then each owner writes its pages (rule 14; a collective every rank makes)."""
        kv, lk = batch.kv, self._bufs(layer)
        a, b = lk.latent, lk.index_k
        if kv.direct_dst.numel():
            lat, idx = latent, index_k
            if kv.direct_src is not None:
                lat = latent.index_select(0, kv.direct_src)
                idx = None if index_k is None else index_k.index_select(0, kv.direct_src)
            torch.ops.cpkv.put_bytes(a, b, kv.direct_dst, lat, idx, self.handle)
        if kv.gather_writes:
            both = latent if index_k is None else torch.cat([latent, index_k], dim=1)
            torch.ops.cpkv.owner_put_bytes(a, b, both, kv.owner_src, kv.owner_dst, self.handle,
                                           kv.rows.max_rank_len)

    def take_bytes(self, layer: int | LayerKV, rows: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed rows at this rank's token rows ``rows`` (int64 [N]: slot x ps + offset) of
        ``layer``: (uint8 [N, latent bytes], uint8 [N, index bytes], [N, 0] without index-K)."""
        lk = self._bufs(layer)
        out: tuple[torch.Tensor, torch.Tensor] = torch.ops.cpkv.take_bytes(
            lk.latent, lk.index_k, rows, self.handle)
        return out

    def view_rows(self, layer: int | LayerKV, batch: EngineBatch) -> torch.Tensor:
        """``layer``'s full view as rows: uint8 [keys, latent + index bytes], natural order
        (one all-gather of the owned pages, ``cpkv::all_gather_pages``: every rank calls it)."""
        m, lk = batch.kv.materialize, self._bufs(layer)
        out: torch.Tensor = torch.ops.cpkv.all_gather_pages(lk.latent, lk.index_k,
                                                             m.send_slots[0], m.view_index,
                                                             self.handle)
        return out

    def view(self, layer: int | LayerKV, batch: EngineBatch) -> FullView:
        """``layer``'s full view (:meth:`view_rows`) as a :class:`~cpkv.kv.FullView`: its
        ``keys(dtype)`` gives (latent, index-K, index scales) for an indexer and sparse MLA."""
        m, lk = batch.kv.materialize, self._bufs(layer)
        return FullView(pages=self.view_rows(lk, batch).unsqueeze(1), index=None, fmt=lk.fmt,
                        layout=PageLayout.TOKEN_MAJOR, cu_seqlens=m.cu_seqlens,
                        seq_lens=m.seq_lens, ops=self.ops)

    # ---- transfer ------------------------------------------------------------------------------
    def manifest(self, rid: Hashable, *, final: bool = True,
                 already_sent: int = 0) -> TransferManifest:
        """Each rank's pages of ``rid`` (logical positions and slots): the engine's PD
        framework sends ``read_pages`` of this rank's runs (:meth:`send_pages`)."""
        return manifest_for(rid, self._pool.pages.requests[rid], self.fmt.page_size, self.group.size,
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
