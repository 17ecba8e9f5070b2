"""Per-batch KV metadata: out-cache locations and the materialization plan (rules 13-16).

Everything here is computed once per batch on the host, moved to the device once, and reused by
every layer and by both column views (latent and index-K). It is a pure function of the plan and
the page table, so it is identical on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from cpkv.contracts import CPPlan, cdiv

from .rows import RowLayout
from .stage import PageStage

__all__ = ["BatchKV", "MaterializePlan", "RequestPages"]


@dataclass
class RequestPages:
    """Logical page table of one request: page k -> (owner rank, physical slot on the owner)."""

    owners: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    valid_len: int = 0
    #: pages reserved by a batch that is not committed yet
    pending: list[int] = field(default_factory=list)


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
    #: the batch has no whole prefix page or the pool is a replica
    materialize_split: MaterializePlan | None
    #: pages this batch reserved, per rank: [(rid, first new page)]; undone by abort
    new_pages: tuple[tuple[Hashable, int], ...]
    #: per-layer page work before the layer's first read or write (host loads, copies on write)
    stage: PageStage
    #: copies on write of shared tail pages: (rid, logical page, old slot, new slot)
    copies: tuple[tuple[Hashable, int, int, int], ...] = ()


def _rows_of(pages: Sequence[int], length: int, ps: int) -> torch.Tensor:
    """Token rows of the first ``length`` positions laid out on ``pages`` (page-row ids)."""
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * ps + torch.arange(ps, dtype=torch.int64)).flatten()[:length]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _pad(s: list[int], n: int, capacity: int) -> tuple[list[int], int | None]:
    """``s`` padded to ``n`` slots (padding rows are never read), and its first slot when the
    result is consecutive slots inside the pool (then the send buffer is a slice)."""
    if not s:
        return [0] * n, 0 if n <= capacity else None
    run = s == list(range(s[0], s[0] + len(s)))
    if run and s[0] + n <= capacity:
        return list(range(s[0], s[0] + n)), s[0]
    return s + [s[0]] * (n - len(s)), None


def _layout(plan: CPPlan, pages: Sequence[RequestPages], c: int, rank: int, parts: int,
            part_of: Callable[[int, int], int], capacity: int,
            ) -> tuple[list[list[int]], tuple[int, ...], list[torch.Tensor], list[int | None]]:
    """Send lists of ``rank`` per part (padded), their common lengths, the view's source rows and
    where each send list starts when it is consecutive slots."""
    ps = plan.page_size
    send: list[list[list[int]]] = [[[] for _ in range(c)] for _ in range(parts)]  # part, rank
    where: list[list[tuple[int, int, int]]] = []
    for i, (req, rp) in enumerate(zip(plan.requests, pages, strict=True)):
        w = []
        for k in range(cdiv(req.end, ps)):
            p, o = part_of(i, k), rp.owners[k]
            w.append((p, o, len(send[p][o])))
            send[p][o].append(rp.slots[k])
        where.append(w)
    maxes = tuple(max(len(s) for s in send[p]) for p in range(parts))
    base = [0]
    for p in range(parts - 1):
        base.append(base[-1] + c * maxes[p])
    view = [_rows_of([base[p] + o * maxes[p] + j for p, o, j in w], req.end, ps)
            for w, req in zip(where, plan.requests, strict=True)]
    mine, starts = [], []
    for p in range(parts):
        slots, start = _pad(send[p][rank], maxes[p], capacity)
        mine.append(slots)
        starts.append(start)
    return mine, maxes, view, starts


def build_batch(
    plan: CPPlan,
    rids: Sequence[Hashable],
    table: dict[Hashable, RequestPages],
    rank: int,
    shared: bool,
    device: torch.device,
    new_pages: tuple[tuple[Hashable, int], ...],
    capacity: int,
    stage: PageStage,
    copies: tuple[tuple[Hashable, int, int, int], ...] = (),
) -> BatchKV:
    """Out-cache locations and materialization plan of ``rank`` (tables already hold the pages)."""
    ps, c = plan.page_size, plan.cp_size
    rows = RowLayout.build(plan, rank, device)
    pages = [table[rid] for rid in rids]

    slot_rows = [_rows_of(rp.slots[: cdiv(req.end, ps)], req.end, ps)
                 for req, rp in zip(plan.requests, pages, strict=True)]

    # direct writes: local rows of page-aligned requests into the rank's own pages (rule 13)
    src: list[torch.Tensor] = []
    dst: list[torch.Tensor] = []
    if shared:
        j = 0
        for b in plan.rank_blocks(rank):
            n = b.end - b.start
            if plan.requests[b.request].page_aligned:
                src.append(torch.arange(j, j + n, dtype=torch.int64))
                dst.append(slot_rows[b.request][b.start:b.end])
            j += n
    n_direct = sum(len(t) for t in src)
    direct_src = None if n_direct == rows.num_local else _cat(src)

    # writes from the gathered rows: non-aligned requests' pages on their owner (rule 14), or
    # every row on every rank for a replicated pool
    gather_writes = not shared or not plan.page_aligned
    osrc: list[torch.Tensor] = []
    odst: list[torch.Tensor] = []
    if gather_writes:
        perm = rows.perm.cpu()
        for off, req, rp, rws in zip(plan.natural_offsets(), plan.requests, pages, slot_rows,
                                     strict=True):
            if shared and req.page_aligned:
                continue
            pos = torch.arange(req.prefix_len, req.end, dtype=torch.int64)
            s_rows = perm[off: off + req.extend_len]
            d_rows = rws[req.prefix_len: req.end]
            if shared:
                mine = torch.tensor(rp.owners, dtype=torch.int64)[pos // ps] == rank
                s_rows, d_rows = s_rows[mine], d_rows[mine]
            osrc.append(s_rows)
            odst.append(d_rows)

    # materialization: every page of every request in the batch, prefix pages included (rule 15)
    seq_lens = tuple(req.end for req in plan.requests)
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)
    def dev(x: list[int] | torch.Tensor) -> torch.Tensor:
        t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.int64)
        return t.to(device)

    view_owner = dev(_cat([torch.tensor(rp.owners, dtype=torch.int64).repeat_interleave(ps)[:n]
                           for rp, n in zip(pages, seq_lens, strict=True)]))
    view_physical = dev(_cat(slot_rows))

    def mplan(parts: int, part_of: Callable[[int, int], int]) -> MaterializePlan:
        slots: list[list[int]] = []
        maxes: tuple[int, ...] = ()
        view, starts = slot_rows, list[int | None]()
        if shared:
            slots, maxes, view, starts = _layout(plan, pages, c, rank, parts, part_of, capacity)
        return MaterializePlan(send_slots=tuple(dev(x) for x in slots), max_send=maxes,
                               send_start=tuple(starts),
                               view_index=dev(_cat(view)), cu_seqlens=dev(cu), seq_lens=seq_lens,
                               view_owner=view_owner, view_physical=view_physical)

    whole = mplan(1, lambda i, k: 0)
    has_prefix = any(req.prefix_len >= ps for req in plan.requests)
    split = mplan(2, lambda i, k: 0 if k < plan.requests[i].prefix_len // ps else 1) \
        if shared and has_prefix else None

    return BatchKV(
        plan=plan,
        rids=tuple(rids),
        rows=rows,
        direct_src=None if direct_src is None else dev(direct_src),
        direct_dst=dev(_cat(dst)),
        gather_writes=gather_writes,
        owner_src=dev(_cat(osrc)),
        owner_dst=dev(_cat(odst)),
        materialize=whole,
        materialize_split=split,
        new_pages=new_pages,
        stage=stage,
        copies=copies,
    )
