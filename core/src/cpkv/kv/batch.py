"""Per-batch KV metadata: out-cache locations and the materialization plan (rules 13-16).

Everything here is computed once per batch on the host, moved to the device once, and reused by
every layer and by both buffers (latent and index-K). It is a pure function of the plan and the
page table, so it is identical on every rank.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from cpkv.contracts import CPPlan, cdiv

from .rows import RowLayout

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

    Sharded: rank r sends pages ``send_slots`` (its own slots, canonical order); all ranks pad to
    ``max_send`` pages; ``view_index[t]`` is the token row of full-view row t inside the gathered
    [C * max_send * ps] rows. Replicated: nothing is sent, ``view_index`` points into the rank's
    own buffer rows.
    """

    send_slots: torch.Tensor  # int64 [pages this rank sends]
    max_send: int
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
    #: pages this batch reserved, per rank: [(rid, first new page)]; undone by abort
    new_pages: tuple[tuple[Hashable, int], ...]


def _rows_of(pages: Sequence[int], length: int, ps: int) -> torch.Tensor:
    """Token rows of the first ``length`` positions laid out on ``pages`` (page-row ids)."""
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * ps + torch.arange(ps, dtype=torch.int64)).flatten()[:length]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def build_batch(
    plan: CPPlan,
    rids: Sequence[Hashable],
    table: dict[Hashable, RequestPages],
    rank: int,
    shared: bool,
    device: torch.device,
    new_pages: tuple[tuple[Hashable, int], ...],
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
    if shared:
        send: list[list[int]] = [[] for _ in range(c)]
        where: list[list[tuple[int, int]]] = []
        for req, rp in zip(plan.requests, pages, strict=True):
            w = []
            for k in range(cdiv(req.end, ps)):
                o = rp.owners[k]
                w.append((o, len(send[o])))
                send[o].append(rp.slots[k])
            where.append(w)
        max_send = max(len(s) for s in send)
        view = [_rows_of([o * max_send + i for o, i in w], n, ps)
                for w, n in zip(where, seq_lens, strict=True)]
        send_slots = send[rank]
    else:
        max_send = 0
        send_slots = []
        view = slot_rows
    cu = [0]
    for n in seq_lens:
        cu.append(cu[-1] + n)

    def dev(x: list[int] | torch.Tensor) -> torch.Tensor:
        t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.int64)
        return t.to(device)

    return BatchKV(
        plan=plan,
        rids=tuple(rids),
        rows=rows,
        direct_src=None if direct_src is None else dev(direct_src),
        direct_dst=dev(_cat(dst)),
        gather_writes=gather_writes,
        owner_src=dev(_cat(osrc)),
        owner_dst=dev(_cat(odst)),
        materialize=MaterializePlan(
            send_slots=dev(send_slots),
            max_send=max_send,
            view_index=dev(_cat(view)),
            cu_seqlens=dev(cu),
            seq_lens=seq_lens,
            view_owner=dev(_cat([torch.tensor(rp.owners, dtype=torch.int64).repeat_interleave(ps)[:n]
                                 for rp, n in zip(pages, seq_lens, strict=True)])),
            view_physical=dev(_cat(slot_rows)),
        ),
        new_pages=new_pages,
    )
