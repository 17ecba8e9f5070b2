"""Per-batch KV metadata: out-cache locations and the materialization plan (rules 13-16).

Everything here is computed once per batch on the host, moved to the device once, and reused by
every layer and by both column views (latent and index-K). It is a pure function of the plan and
the page table, so it is identical on every rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cpkv.contracts import CPPlan, cdiv

from .pages import RequestPages, Reservation
from .rows import RowLayout, expand_ranges, to_device_at_once
from .stage import PageStage

if TYPE_CHECKING:
    from cpkv.comm import CPGroup
    from cpkv.ops import OpTable

__all__ = ["BatchKV", "MaterializePlan", "RequestPages", "to_device_at_once"]


@dataclass(frozen=True)
class MaterializePlan:
    """Which pages each rank contributes and where each key row of the full view comes from.

    Sharded: the pages are moved in one or more parts (one collective each); in part p rank r
    sends ``send_slots[p]`` (its own slots in canonical order, padded to ``max_send[p]`` with
    valid slots whose rows are never read), and the gathered parts lie one after another:
    [C * max_send[0] pages][C * max_send[1] pages]. ``view_index[t]`` is the token row of
    full-view row t in those gathered pages. Replicated: no part; ``view_index`` points into the
    rank's own buffer rows.
    """

    send_slots: tuple[torch.Tensor, ...]  # per part: int64 [max_send[p]]
    max_send: tuple[int, ...]
    #: per part: s when ``send_slots[p]`` is s, s+1, ..., s+max_send[p]-1 (the send buffer is
    #: then a slice of the pool, no gather), else None; this rank's own (shapes do not change)
    send_start: tuple[int | None, ...]
    view_index: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int64 [B + 1]
    seq_lens: tuple[int, ...]
    #: int64 [T]: owner rank and physical token row (slot * ps + offset) of each full-view row,
    #: for the PAGED index translation (rule 20)
    view_owner: torch.Tensor
    view_physical: torch.Tensor


@dataclass(frozen=True)
class BatchKV:
    """What every layer needs to write and read KV for one batch on one rank."""

    plan: CPPlan
    rids: tuple[Hashable, ...]
    rows: RowLayout
    #: local rows written straight into own pages, and their buffer token rows (rule 13);
    #: ``direct_src`` is None when every local row is written in order
    direct_src: torch.Tensor | None
    direct_dst: torch.Tensor
    #: rows written by their owner from the all-gathered new rows (rule 14, or replicated pool)
    gather_writes: bool
    owner_src: torch.Tensor  # rows of the rank-major gather
    owner_dst: torch.Tensor  # buffer token rows
    materialize: MaterializePlan
    #: the same view in two parts, cached prefix pages first (gathered ahead of time, on a side
    #: stream, while the previous layer computes) then the pages this batch writes; None when
    #: the batch has no whole prefix page, the pool is a replica or the group has one rank
    materialize_split: MaterializePlan | None
    #: what the page table reserved for the batch (new pages, copies on write); undone by abort
    reservation: Reservation
    #: per-layer page work before the layer's first read or write (host loads, copies on write)
    stage: PageStage
    #: the pool's group and op table (the row splits and gathers below run through them)
    group: CPGroup
    ops: OpTable

    @property
    def copies(self) -> tuple[tuple[Hashable, int, int, int], ...]:
        """Copies on write of shared tail pages: (rid, logical page, old slot, new slot)."""
        return self.reservation.copies

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a natural-order tensor ``x`` [num_tokens, ...]."""
        return self.rows.split(x, self.ops)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``local`` [local rows, ...] in natural order (a collective)."""
        return self.rows.gather(local, self.group, self.ops)

    def gather_rows(self, local: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Natural-order rows ``rows`` (int64 [m], device) of every rank's ``local`` rows, only
        those moved (a collective; see :meth:`RowLayout.gather_rows`)."""
        return self.rows.gather_rows(local, rows, self.group)


def _token_rows(pages: torch.Tensor, ps: int) -> torch.Tensor:
    """Token rows (page x ps + offset) of every position of ``pages`` (int64 [n]): [n * ps]."""
    return (pages[:, None] * ps + torch.arange(ps, dtype=torch.int64, device=pages.device)).flatten()


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:  # one request (a decode step): no copy
        return parts[0]
    return torch.cat(list(parts)) if parts else torch.zeros(0, dtype=torch.int64)


def _pad(s: torch.Tensor, n: int, capacity: int) -> tuple[torch.Tensor, int | None]:
    """Slots ``s`` (int64, host) padded to ``n`` (padding rows are never read), and the first
    slot when the result is consecutive slots inside the pool (then the send buffer is a slice)."""
    if not s.numel():
        return torch.zeros(n, dtype=torch.int64), 0 if n <= capacity else None
    first = int(s[0])
    run = bool((s == torch.arange(first, first + s.numel())).all())
    if run and first + n <= capacity:
        return torch.arange(first, first + n, dtype=torch.int64), first
    return torch.cat([s, s[:1].expand(n - s.numel())]), None


@dataclass(frozen=True)
class _BatchPages:
    """Every page of the batch's requests, request by request in page order, as host tensors
    (converted from the page tables once per batch: a long context has a thousand pages)."""

    owners: torch.Tensor  # int64 [pages]
    slots: torch.Tensor  # int64 [pages]
    logical: torch.Tensor  # int64 [pages]: the page's index k in its request
    #: per request: its pages' offset into the tensors above, its page count, its tokens
    first: tuple[int, ...]
    count: tuple[int, ...]
    ends: tuple[int, ...]

    @classmethod
    def of(cls, plan: CPPlan, pages: Sequence[RequestPages]) -> _BatchPages:
        ps = plan.page_size
        ends = tuple(req.end for req in plan.requests)
        count = tuple(cdiv(e, ps) for e in ends)
        first = tuple(itertools.accumulate(count, initial=0))[:-1]
        return cls(owners=torch.tensor([o for rp, n in zip(pages, count, strict=True)
                                        for o in rp.owners[:n]], dtype=torch.int64),
                   slots=torch.tensor([s for rp, n in zip(pages, count, strict=True)
                                       for s in rp.slots[:n]], dtype=torch.int64),
                   logical=torch.cat([torch.arange(n, dtype=torch.int64) for n in count]),
                   first=first, count=count, ends=ends)

    def rows_at(self, i: int, positions: torch.Tensor, ps: int) -> torch.Tensor:
        """Token rows (slot x ps + offset) of ``positions`` (int64) of request ``i``."""
        return self.slots[self.first[i] + positions // ps] * ps + positions % ps

    def per_request(self, rows: torch.Tensor, ps: int) -> torch.Tensor:
        """Each request's first ``end`` positions of ``rows`` (``ps`` per page of the batch, in
        the order of the tensors above), requests concatenated (a view for one request)."""
        return _cat([rows[f * ps: f * ps + e] for f, e in zip(self.first, self.ends, strict=True)])


def _layout(bp: _BatchPages, part: torch.Tensor, c: int, rank: int, parts: int, capacity: int,
            ) -> tuple[list[torch.Tensor], tuple[int, ...], torch.Tensor, list[int | None]]:
    """Send lists of ``rank`` per part (padded), their common lengths, where each page of the
    batch lies in the gathered pages, and where each send list starts when it is consecutive
    slots. ``part``: int64 [pages], the part each page moves in.

    Every page, request by request in page order, goes to the send list of its (part, owner);
    its place in the gathered pages is then its part's base, plus its owner's block, plus its
    index in that list. Host tensor ops over all pages at once, no Python loop over them."""
    if c == 1 and parts == 1:  # one send list (a decode rank's): every page in batch order
        padded, start = _pad(bp.slots, bp.slots.numel(), capacity)
        return [padded], (bp.slots.numel(),), torch.arange(bp.slots.numel()), [start]
    group = part * c + bp.owners  # which send list each page goes to
    member = torch.nn.functional.one_hot(group, parts * c)
    index = member.cumsum(0).gather(1, group[:, None]).squeeze(1) - 1  # its place in that list
    maxes = tuple(int(m) for m in member.sum(0).view(parts, c).amax(1).tolist())
    base = [0]
    for p in range(parts - 1):
        base.append(base[-1] + c * maxes[p])
    width = torch.tensor(maxes, dtype=torch.int64)
    where = torch.tensor(base, dtype=torch.int64)[part] + bp.owners * width[part] + index
    mine, starts = [], []
    for p in range(parts):
        padded, start = _pad(bp.slots[group == p * c + rank], maxes[p], capacity)
        mine.append(padded)
        starts.append(start)
    return mine, maxes, where, starts


def build_batch(
    plan: CPPlan,
    reservation: Reservation,
    table: Mapping[Hashable, RequestPages],
    rank: int,
    shared: bool,
    device: torch.device,
    capacity: int,
    stage: PageStage,
    group: CPGroup,
    ops: OpTable,
) -> BatchKV:
    """Out-cache locations and materialization plan of ``rank`` (tables already hold the pages).

    Host work once per batch, in a number of tensor ops that does not grow with the pages and
    on host tensors of one entry per page (or per extend row); they reach the device in one copy
    and the views' token rows are expanded there."""
    ps, c = plan.page_size, plan.cp_size
    rows = RowLayout.build(plan, rank, device)
    rids = reservation.rids
    pages = [table[rid] for rid in rids]
    bp = _BatchPages.of(plan, pages)

    # direct writes: local rows of page-aligned requests into the rank's own pages (rule 13);
    # per block on the host (its first local row, its request's first page in the batch's page
    # tensors), the rows expanded on the device below
    direct = [b for b in rows.blocks if shared and plan.requests[b.request].page_aligned]
    n_direct = sum(b.end - b.start for b in direct)
    direct_meta = torch.tensor([[b.row for b in direct], [b.end - b.start for b in direct],
                                [bp.first[b.request] for b in direct]], dtype=torch.int64)

    # writes from the gathered rows: non-aligned requests' pages on their owner (rule 14), or
    # every row on every rank for a replicated pool
    gather_writes = not shared or not plan.page_aligned
    osrc: list[torch.Tensor] = []
    odst: list[torch.Tensor] = []
    if gather_writes:
        perm = rows.perm.cpu()
        for i, (off, req) in enumerate(zip(plan.natural_offsets(), plan.requests, strict=True)):
            if shared and req.page_aligned:
                continue
            pos = torch.arange(req.prefix_len, req.end, dtype=torch.int64)
            s_rows = perm[off: off + req.extend_len]
            d_rows = bp.rows_at(i, pos, ps)
            if shared:
                mine = bp.owners[bp.first[i] + pos // ps] == rank
                s_rows, d_rows = s_rows[mine], d_rows[mine]
            osrc.append(s_rows)
            odst.append(d_rows)

    # materialization: every page of every request in the batch, prefix pages included (rule 15);
    # per page on the host, where each page lies in the gathered pages (none for a replica: its
    # view reads the pool)
    seq_lens = bp.ends
    cu = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int64)
    plans: list[tuple[list[torch.Tensor], tuple[int, ...], torch.Tensor | None,
                      tuple[int | None, ...]]] = []
    if not shared:
        plans.append(([], (), None, ()))
    else:  # the part each page moves in: one part, or the cached prefix's whole pages first
        slots, maxes, where, starts = _layout(bp, torch.zeros_like(bp.logical), c, rank, 1,
                                              capacity)
        plans.append((slots, maxes, where, tuple(starts)))
        # (a one-rank group's views read its pool in place: nothing moves ahead, no split)
        if c > 1 and any(req.prefix_len >= ps for req in plan.requests):
            prefix_pages = torch.tensor([req.prefix_len // ps for req in plan.requests],
                                        dtype=torch.int64).repeat_interleave(torch.tensor(bp.count))
            slots, maxes, where, starts = _layout(bp, (bp.logical >= prefix_pages).long(), c,
                                                  rank, 2, capacity)
            plans.append((slots, maxes, where, tuple(starts)))

    # what the layers read goes to the device in one copy, per page, not per token: the token
    # rows of a view (64K of them in a decode step over a 64K context) are expanded there
    host = [cu, bp.owners, bp.slots, direct_meta.flatten(), _cat(osrc), _cat(odst)]
    for send, _, where_p, _ in plans:
        host += [*send] + ([] if where_p is None else [where_p])
    moved = iter(to_device_at_once(host, device))
    cu_d, owners_d, slots_d, meta_d, osrc_d, odst_d = (next(moved) for _ in range(6))
    row_d, len_d, page0_d = meta_d.view(3, len(direct))
    # the direct writes' rows (all local rows in order, the usual case: no source index) and
    # their token rows: slot of (the request's first page + position // ps) x ps + position % ps
    src_d = None if n_direct == rows.num_local else expand_ranges(row_d, len_d, n_direct)
    pos_d = rows.positions if src_d is None else rows.positions[src_d]
    page0 = torch.repeat_interleave(page0_d, len_d, output_size=n_direct)
    dst_d = slots_d[page0 + pos_d // ps] * ps + pos_d % ps
    view_owner = bp.per_request(owners_d.repeat_interleave(ps), ps)
    view_physical = bp.per_request(_token_rows(slots_d, ps), ps)
    mplans = []
    for send, lens, where_p, first in plans:
        send_d = tuple(next(moved) for _ in send)
        view = view_physical if where_p is None else bp.per_request(_token_rows(next(moved), ps),
                                                                     ps)
        mplans.append(MaterializePlan(send_slots=send_d, max_send=lens, send_start=first,
                                      view_index=view, cu_seqlens=cu_d, seq_lens=seq_lens,
                                      view_owner=view_owner, view_physical=view_physical))

    return BatchKV(
        plan=plan,
        rids=tuple(rids),
        rows=rows,
        direct_src=src_d,
        direct_dst=dst_d,
        gather_writes=gather_writes,
        owner_src=osrc_d,
        owner_dst=odst_d,
        materialize=mplans[0],
        materialize_split=mplans[1] if len(mplans) > 1 else None,
        reservation=reservation,
        stage=stage,
        group=group,
        ops=ops,
    )
