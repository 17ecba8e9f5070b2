"""Materialization strategies: how a pool stores its pages and builds a layer's full view.

A strategy is chosen once, when the pool is built (:func:`open_materializer`), and owns the
pool's page storage (``spec``: a :class:`~cpkv.kv.buffers.KVBufferSpec`, per layer its tensors
in the pool's layout and that layer's format: a layer without index-K holds its latent bytes
only; a one-tensor layout's ``kv[layer]`` is uint8 ``[pages, ps, latent + index bytes]``), because where
pages live decides how they are read: a replica and the all-gather path keep plain device
buffers, the peer path keeps them in peer-mapped memory. The pool keeps ownership, allocation
and writes; per batch it calls :meth:`Materializer.begin_batch` once (after the pages are
reserved, before the first write), then per layer :meth:`~Materializer.prefetch` (optional) and
:meth:`~Materializer.full_view`.

* :class:`ReplicaViews` (``replica``, ``kv.shared = false``): every page is local; the view
  reads the pool's rows in place (through the view index).
* :class:`AllGatherViews` (``all_gather``): each rank's owned pages of the batch go into one
  send buffer (a slice of the pool when they are consecutive slots) and one all-gather moves
  them; the view reads the receive buffer in place, rank-major, through the view index (rule 15's
  natural order is the index's: the consumers' own passes read through it). Cached prefix
  pages can move a layer ahead on a side stream (:meth:`AllGatherViews.prefetch`).
* :class:`PeerViews` (``p2p``): after a barrier each rank reads every view row from its owner's
  peer-mapped buffer in one pass (``peer_gather``): no send buffer, no collective, no staging.

A :class:`~cpkv.kv.view.FullView` is rows plus an index: the replica and all-gather strategies
hand out the buffer their movement filled (the pool, the receive buffer) with
``MaterializePlan.view_index``; the fp8 dequantization and the index-K split read through it in
their one pass (docs/kv-pool.md, "Reading the view in place").
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from cpkv.comm import CPGroup, PeerAccessUnavailable, PeerBuffers, open_peer_buffers
from cpkv.contracts import (
    BufferLayout,
    FallbackReason,
    KVFormat,
    LayerFormats,
    MaterializeMode,
    PageLayout,
    layer_formats,
)
from cpkv.fallback import report_fallback
from cpkv.logs import get_logger
from cpkv.ops import part_index

from .batch import BatchKV, MaterializePlan
from .buffers import KVBufferSpec, read_pages, read_rows
from .view import FullView

if TYPE_CHECKING:
    from cpkv.contracts import KVPart
    from cpkv.ops import OpTable

__all__ = ["AllGatherViews", "Materializer", "PeerViews", "Prefetch", "ReplicaViews",
           "open_materializer"]

log = get_logger(__name__)


@dataclass
class Prefetch:
    """A layer's prefix pages in flight: the gathered buffer (its first part filled) and the event
    that marks the side stream's collective done (None on CPU, where it ran inline)."""

    buf: torch.Tensor
    event: torch.cuda.Event | None


class Materializer(Protocol):
    """One pool's way of storing pages and building full views (see the module docstring).

    Every method is called at the same point on every rank; any collective inside has the same
    order and shapes everywhere (rule 16).
    """

    #: which strategy this is (reported as the run's ``materialize``)
    mode: MaterializeMode
    #: this rank's page storage, per layer its tensors in the pool's layout
    spec: KVBufferSpec

    def begin_batch(self, batch: BatchKV) -> None:
        """Once per batch, after its pages are reserved and before any layer writes."""

    def prefetch(self, layer: int, batch: BatchKV) -> Prefetch | None:
        """Start moving ``layer``'s cached prefix pages ahead of time, or None (nothing to do)."""

    def full_view(self, layer: int, batch: BatchKV, prefetched: Prefetch | None = None) -> FullView:
        """The full view of ``layer`` for the batch (after every rank wrote that layer)."""


def _view(pages: torch.Tensor, index: torch.Tensor | None, fmt: KVFormat, m: MaterializePlan,
          ops: OpTable, layout: PageLayout = PageLayout.TOKEN_MAJOR,
          rows_of: Mapping[str, torch.Tensor] | None = None) -> FullView:
    return FullView(pages=pages, index=index, fmt=fmt, layout=layout, cu_seqlens=m.cu_seqlens,
                    seq_lens=m.seq_lens, ops=ops, rows_of=rows_of)


class _PartRows:
    """Part-major views' row indices (:func:`~cpkv.ops.part_index` of the plan's view index),
    translated once per materialization plan, not per layer; None for token-major pages."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        #: per format of the pool's layers (with and without index-K): the last plan's rows
        self._last: dict[KVFormat, tuple[MaterializePlan, dict[str, torch.Tensor]]] = {}

    def of(self, m: MaterializePlan, index: torch.Tensor,
           fmt: KVFormat) -> dict[str, torch.Tensor] | None:
        """The part rows of ``index`` (``m``'s view index, or its physical rows for a view that
        reads the pool in place: one or the other per strategy) in pages of ``fmt``, cached for
        the last plan."""
        if self.layout is PageLayout.TOKEN_MAJOR:
            return None
        last = self._last.get(fmt)
        if last is None or last[0] is not m:
            parts: tuple[KVPart, ...] = ("latent", "index_k") if fmt.index_k else ("latent",)
            last = self._last[fmt] = (m, {p: part_index(index, fmt, self.layout, p)
                                          for p in parts})
        return last[1]


def _one_tensor(spec: KVBufferSpec) -> list[torch.Tensor]:
    """Per layer its one ``[pages, ps, B]`` tensor (one-tensor layouts; empty for two_part)."""
    return [lb.kv for lb in spec.layers if lb.kv is not None]


def _rows_view(spec: KVBufferSpec, layer: int, rows: torch.Tensor, m: MaterializePlan,
               ops: OpTable) -> FullView:
    """The view of two-part pages read at token rows ``rows`` of this rank's pool (one gather of
    each part into natural-order token-major rows: a view cannot read DeepGEMM's index-K page
    order in place)."""
    lat, idx = read_rows(spec, layer, rows)
    both = lat if idx is None else torch.cat([lat, idx], dim=1)
    return _view(both.unsqueeze(1), None, spec.fmts[layer], m, ops)


class ReplicaViews:
    """Every rank holds every page: the view reads the rank's own pool in place (two-part
    pages: one gather of the view's rows, :func:`_rows_view`)."""

    mode = MaterializeMode.REPLICA

    def __init__(self, spec: KVBufferSpec, ops: OpTable) -> None:
        self.spec, self.fmts, self.ops = spec, spec.fmts, ops
        self.kv = _one_tensor(spec)
        self.layout = spec.layout.page_layout
        self._rows = _PartRows(self.layout or PageLayout.TOKEN_MAJOR)

    def begin_batch(self, batch: BatchKV) -> None:
        return None

    def prefetch(self, layer: int, batch: BatchKV) -> Prefetch | None:
        return None

    def full_view(self, layer: int, batch: BatchKV, prefetched: Prefetch | None = None) -> FullView:
        m, fmt = batch.materialize, self.fmts[layer]
        if self.layout is None:
            return _rows_view(self.spec, layer, m.view_index, m, self.ops)
        return _view(self.kv[layer], m.view_index, fmt, m, self.ops, self.layout,
                     self._rows.of(m, m.view_index, fmt))


class AllGatherViews:
    """Owned pages -> one all-gather -> one gather into natural order; prefix pages optionally a
    layer ahead on a side stream (CUDA) or inline (CPU).

    A one-rank group (the decode rank) owns every page and its all-gather would be a copy of
    them: its views read the pool in place through the physical rows (``view_physical``), like
    a replica's, and nothing is prefetched.

    Two-part pages are sent as canonical token-major blocks (:func:`~cpkv.kv.buffers.read_pages`:
    the send buffer is a gather of each part, never a slice), so the receive buffer and the view
    are token-major."""

    mode = MaterializeMode.ALL_GATHER

    def __init__(self, spec: KVBufferSpec, group: CPGroup, ops: OpTable,
                 side: torch.cuda.Stream | None = None) -> None:
        self.spec, self.fmts, self.group, self.ops = spec, spec.fmts, group, ops
        self.kv = _one_tensor(spec)
        #: the pool's page layout (None: two_part); its views' is token-major then
        self.layout = spec.layout.page_layout
        self._stream = side
        self._view_layout = self.layout or PageLayout.TOKEN_MAJOR
        self._rows = _PartRows(self._view_layout)

    def begin_batch(self, batch: BatchKV) -> None:
        return None

    def send_buffer(self, layer: int, m: MaterializePlan, part: int) -> torch.Tensor:
        """This rank's pages of ``part`` of ``layer``: a slice of the pool when they are
        consecutive slots (no copy), else one page gather."""
        if self.layout is None:  # two_part: each part's pages gathered into canonical blocks
            return read_pages(self.spec, layer, m.send_slots[part])
        start = m.send_start[part]
        if start is not None:
            return self.kv[layer][start:start + m.max_send[part]]
        return self.ops.page_gather(self.kv[layer], m.send_slots[part])

    def _side_stream(self) -> torch.cuda.Stream | None:
        if self.group.device.type != "cuda":
            return None  # CPU: the same collectives, inline
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.group.device)  # type: ignore[no-untyped-call]
        return self._stream

    def prefetch(self, layer: int, batch: BatchKV) -> Prefetch | None:
        """Move ``layer``'s cached prefix pages (those this batch does not write) into the first
        part of the gathered buffer. None when the batch has no whole prefix page. A collective."""
        m = batch.materialize_split
        if m is None or self.group.size == 1:
            return None
        fmt = self.fmts[layer]
        c, b = self.group.size, fmt.bytes_per_token
        stream = self._side_stream()
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            if stream is not None:  # the pages were written on the main stream
                stream.wait_stream(torch.cuda.current_stream(self.group.device))
            buf = torch.empty((c * sum(m.max_send), fmt.page_size, b), dtype=torch.uint8,
                              device=self.group.device)
            self.group.all_gather_rows(self.send_buffer(layer, m, 0), m.max_send[0],
                                       out=buf[: c * m.max_send[0]])
            event = None
            if stream is not None:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
        return Prefetch(buf=buf, event=event)

    def full_view(self, layer: int, batch: BatchKV, prefetched: Prefetch | None = None) -> FullView:
        """One collective of the owned pages (only the pages this batch wrote when
        ``prefetched`` holds the rest); the view reads the receive buffer in place."""
        c, fmt = self.group.size, self.fmts[layer]
        if c == 1:  # every page is this rank's: read the pool in place (no copy of the view)
            m = batch.materialize
            if self.layout is None:
                return _rows_view(self.spec, layer, m.view_physical, m, self.ops)
            return _view(self.kv[layer], m.view_physical, fmt, m, self.ops, self.layout,
                         self._rows.of(m, m.view_physical, fmt))
        if prefetched is None:
            m = batch.materialize
            buf = self.group.all_gather_rows(self.send_buffer(layer, m, 0), m.max_send[0])
        else:
            split = batch.materialize_split
            if split is None:
                raise ValueError("a prefetch exists only for batches with a split plan")
            m, buf = split, prefetched.buf
            if prefetched.event is not None:
                cur = torch.cuda.current_stream(self.group.device)
                cur.wait_event(prefetched.event)
                buf.record_stream(cur)
            self.group.all_gather_rows(self.send_buffer(layer, m, 1), m.max_send[1],
                                       out=buf[c * m.max_send[0]:])
        return _view(buf, m.view_index, fmt, m, self.ops, self._view_layout,
                     self._rows.of(m, m.view_index, fmt))


class PeerViews:
    """Pages in peer-mapped memory; each view row read from its owner in one pass."""

    mode = MaterializeMode.P2P

    def __init__(self, peers: PeerBuffers, fmts: LayerFormats, capacity: int,
                 ops: OpTable) -> None:
        self.peers, self.fmts, self.ops = peers, fmts, ops
        #: per layer, its byte span of the mapped buffers (layers of their own widths, in order)
        spans = _layer_spans(fmts, capacity)
        self.kv = [peers.local[lo:hi].view(capacity, f.page_size, f.bytes_per_token)
                   for (lo, hi), f in zip(spans, fmts, strict=True)]
        self.spec = KVBufferSpec.wrap(fmts, BufferLayout.TOKEN_MAJOR, self.kv)
        #: per layer, every rank's buffer as token rows [pages * ps, B]
        self.rows = [[buf[lo:hi].view(capacity * f.page_size, f.bytes_per_token)
                      for buf in peers.buffers] for (lo, hi), f in zip(spans, fmts, strict=True)]

    def begin_batch(self, batch: BatchKV) -> None:
        # peers may still be reading pages of the previous batch that this one reuses (freed and
        # reallocated): every rank's earlier reads finish before any of this batch's writes
        self.peers.barrier()

    def prefetch(self, layer: int, batch: BatchKV) -> Prefetch | None:
        return None  # the view is one pass: nothing to stage

    def full_view(self, layer: int, batch: BatchKV, prefetched: Prefetch | None = None) -> FullView:
        m = batch.materialize
        self.peers.barrier()  # every owner's writes of this layer are done and visible
        rows = self.ops.peer_gather(self.rows[layer], m.view_owner, m.view_physical)
        return _view(rows.unsqueeze(1), None, self.fmts[layer], m, self.ops)


def _layer_spans(fmts: LayerFormats, capacity: int) -> list[tuple[int, int]]:
    """Each layer's [start, end) bytes in one buffer holding every layer's pages in order."""
    spans, lo = [], 0
    for f in fmts:
        spans.append((lo, lo + capacity * f.page_bytes))
        lo += capacity * f.page_bytes
    return spans


def open_materializer(mode: MaterializeMode, fmt: KVFormat | LayerFormats, num_layers: int,
                      capacity: int, group: CPGroup, ops: OpTable,
                      side: torch.cuda.Stream | None = None,
                      layout: BufferLayout | PageLayout = BufferLayout.TOKEN_MAJOR,
                      storage: KVBufferSpec | None = None) -> Materializer:
    """Build the strategy for ``mode`` and its page storage (``capacity`` pages per layer, each
    layer in its own format: ``fmt`` is one for all or one per layer, in ``layout``);
    ``side`` is the pool's side stream (work a layer ahead: the prefetch runs on it). A
    part-major or two-part ``layout`` is read by the replica and all-gather strategies;
    ``P2P`` (and ``AUTO``'s p2p) keep token-major pages.

    ``storage``: the caller's page tensors (:class:`~cpkv.kv.buffers.KVBufferSpec`, used in
    place, never copied; its layout is the pool's) instead of new ones; ``P2P`` cannot take them
    (its pages live in peer-mapped memory it allocates).

    ``P2P`` maps every rank's storage into every rank (a collective); when any rank cannot, every
    rank reports fallback ``peer_memory_unavailable`` and gets :class:`AllGatherViews`.
    ``AUTO`` tries ``P2P`` on a multi-rank NCCL group on GPUs and takes ``ALL_GATHER`` quietly
    (info log ``cpkv.kv.materialize_auto``) when it cannot map; on CPU, and for Gloo ranks on
    GPUs (which may share one GPU), it is ``ALL_GATHER`` (shared files stand in for peer memory
    in tests on CPUs; nothing says they beat a CPU all-gather).
    """
    fmts = layer_formats(fmt, num_layers)
    lay = storage.layout if storage is not None else BufferLayout(layout)

    def plain() -> KVBufferSpec:
        if storage is not None:
            return storage
        return KVBufferSpec.allocate(fmts, num_layers, capacity, lay, group.device)

    if mode is MaterializeMode.REPLICA:
        return ReplicaViews(plain(), ops)
    if storage is not None and mode is MaterializeMode.P2P:
        raise ValueError("p2p pages live in peer-mapped memory it allocates: caller-given "
                         "storage is read by the replica and all_gather strategies")
    if lay is not BufferLayout.TOKEN_MAJOR and mode is MaterializeMode.P2P:
        raise ValueError(f"{lay.value} pages are read by the replica and all_gather strategies; "
                         f"p2p reads token rows from its peers")
    auto = (mode is MaterializeMode.AUTO and lay is BufferLayout.TOKEN_MAJOR
            and storage is None)
    # one rank has no peers to map (its pool stays plain memory, which a transfer may export);
    # Gloo ranks on GPUs may share one (cpkv.comm.rank_gpu): their pages move through Gloo
    if auto and (group.device.type != "cuda" or group.size == 1 or group.backend == "gloo"):
        why = ("one rank" if group.size == 1 else f"{group.device.type} ranks"
               if group.device.type != "cuda" else "Gloo ranks on GPUs (they may share one)")
        log.info("cpkv.kv.materialize_auto", selected="all_gather", why=why)
    elif mode is MaterializeMode.P2P or auto:
        total = _layer_spans(fmts, capacity)[-1][1]
        try:
            peers = open_peer_buffers(group, total)
        except PeerAccessUnavailable as exc:  # raised on every rank alike
            if auto:
                log.info("cpkv.kv.materialize_auto", selected="all_gather", why=str(exc))
            else:
                report_fallback(op="kv_materialize", requested="p2p (peer-mapped pool buffers)",
                                selected="all_gather",
                                reason=FallbackReason.PEER_MEMORY_UNAVAILABLE, detail=str(exc))
        else:
            log.info("cpkv.kv.peer_buffers", kind=peers.kind, bytes=total, ranks=group.size)
            return PeerViews(peers, fmts, capacity, ops)
    return AllGatherViews(plain(), group, ops, side)
