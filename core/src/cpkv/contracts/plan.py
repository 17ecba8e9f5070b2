"""Split-plan contracts (contract rules 1-9): who computes which extend token, who owns which page.

A plan is a value: frozen, JSON-serialisable, identical on every rank for the same inputs. Per-row
arrays (positions, permutation) are derived from the compact segment description on demand, so a
plan for a 128K-token prompt stays a few hundred integers.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from functools import cached_property
from typing import NamedTuple, Self

from pydantic import Field, field_serializer, model_validator

from ._base import Contract, Count, CPSize, PageIndex, PageSize, Position, Rank
from .fallback import FallbackReason

__all__ = [
    "CPPlan",
    "OwnerMap",
    "PageExtent",
    "RequestPlan",
    "RequestSpec",
    "RowBlock",
    "Segment",
    "SplitMode",
    "cdiv",
]


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative integers."""
    return -(-a // b)


class SplitMode(StrEnum):
    #: 2C page-aligned segments per request, segment i on rank i and 2C-1-i (prev/next halves)
    ZIGZAG = "zigzag"
    #: round-robin pages: logical page k on rank k mod C
    INTERLEAVE = "interleave"


class PageExtent(Contract):
    """Whole pages [start_page, start_page + num_pages) holding ``valid_tokens`` valid tokens.

    Physical coverage is page-aligned; the valid length may end inside the last page (rule 28).
    """

    page_size: PageSize
    start_page: PageIndex = 0
    num_pages: Count
    valid_tokens: Count

    @model_validator(mode="after")
    def _check_valid(self) -> Self:
        lo, hi = max(0, (self.num_pages - 1) * self.page_size), self.num_pages * self.page_size
        if self.num_pages == 0 and self.valid_tokens != 0:
            raise ValueError(f"an empty extent holds no tokens, got valid_tokens={self.valid_tokens}")
        if self.num_pages and not lo < self.valid_tokens <= hi:
            raise ValueError(
                f"valid_tokens={self.valid_tokens} must end inside the last of num_pages="
                f"{self.num_pages} pages of {self.page_size}: need {lo} < valid_tokens <= {hi}"
            )
        return self

    @classmethod
    def covering(cls, valid_tokens: int, page_size: int) -> PageExtent:
        """The extent from page 0 that holds ``valid_tokens`` tokens."""
        return cls(page_size=page_size, num_pages=cdiv(valid_tokens, page_size),
                   valid_tokens=valid_tokens)

    @property
    def tail_valid(self) -> int:
        """Valid tokens in the last page (0 for an empty extent)."""
        return self.valid_tokens - max(0, self.num_pages - 1) * self.page_size


class OwnerMap(Contract):
    """Owner rank of every logical page of one request, page 0 first."""

    cp_size: CPSize
    owners: tuple[Rank, ...]

    @model_validator(mode="after")
    def _check_ranks(self) -> Self:
        bad = [(k, r) for k, r in enumerate(self.owners) if r >= self.cp_size]
        if bad:
            raise ValueError(f"owner ranks must be < cp_size={self.cp_size}; (page, rank): {bad[:8]}")
        return self

    @classmethod
    def interleaved(cls, num_pages: int, cp_size: int) -> OwnerMap:
        """Page k on rank k mod C."""
        return cls(cp_size=cp_size, owners=tuple(k % cp_size for k in range(num_pages)))

    @classmethod
    def on_rank(cls, num_pages: int, cp_size: int, rank: int = 0) -> OwnerMap:
        """Every page on one rank (what a replicated cache looks like from rank 0)."""
        return cls(cp_size=cp_size, owners=(rank,) * num_pages)

    def pages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(k for k, r in enumerate(self.owners) if r == rank)


class RequestSpec(Contract):
    """Planner input for one request: P cached prefix tokens, E tokens to compute.

    ``prefix_owners`` gives the owner rank of each of the ceil(P / ps) pages the prefix touches.
    It may be empty when P is a multiple of ps (the owners of whole prefix pages do not change the
    plan); it is required when P ends inside a page, because that page's owner computes the head
    fragment (rule 3).
    """

    prefix_len: Count = 0
    extend_len: int = Field(ge=1)
    prefix_owners: tuple[Rank, ...] = ()


class Segment(NamedTuple):
    """Extend tokens [start, end) of one request, in absolute positions, computed by ``rank``.

    A named tuple rather than a model: long interleaved requests have one segment per page, and
    tuples validate several times faster. It serialises as ``{"start", "end", "rank"}``.
    """

    start: Position
    end: Position
    rank: Rank


class RequestPlan(Contract):
    """The plan of one request."""

    prefix_len: Count
    extend_len: int = Field(ge=1)
    segments: tuple[Segment, ...]
    page_aligned: bool
    fallback: FallbackReason | None = None
    #: owner rank of logical page k; None only for pages entirely before the prefix end
    page_owners: tuple[Rank | None, ...]

    @model_validator(mode="after")
    def _check_cover(self) -> Self:
        pos = self.prefix_len
        for s in self.segments:
            if s.start != pos or s.end <= s.start:
                raise ValueError(
                    f"segments must cover [{self.prefix_len}, {self.end}) exactly once in order; "
                    f"expected a non-empty segment starting at {pos}, got [{s.start}, {s.end})"
                )
            pos = s.end
        if pos != self.end:
            raise ValueError(f"segments end at {pos}, the extend ends at {self.end}")
        if self.page_aligned != (self.fallback is None):
            raise ValueError(
                f"page_aligned={self.page_aligned} needs fallback "
                f"{'None' if self.page_aligned else 'set'}, got fallback={self.fallback}"
            )
        return self

    @field_serializer("segments")
    def _segments_as_objects(self, segments: tuple[Segment, ...]) -> list[dict[str, int]]:
        return [s._asdict() for s in segments]

    @property
    def end(self) -> int:
        """One past the last absolute position: P + E."""
        return self.prefix_len + self.extend_len

    def num_pages(self, page_size: int) -> int:
        """Physical span of the request: ceil((P + E) / ps) pages, never more (rule 5)."""
        return cdiv(self.end, page_size)

    def rank_tokens(self, cp_size: int) -> tuple[int, ...]:
        """Extend tokens each rank computes for this request."""
        out = [0] * cp_size
        for s in self.segments:
            out[s.rank] += s.end - s.start
        return tuple(out)


class RowBlock(Contract):
    """A run of one rank's local rows: request ``request``, absolute positions [start, end)."""

    request: Count
    start: Position
    end: Position


class CPPlan(Contract):
    """The split plan of one batch on a CP group of ``cp_size`` ranks.

    Stores only the per-request segments and owners; everything per rank (local rows, counts,
    ``max_rank_len``, the gather permutation) is derived from them, so it cannot disagree.
    """

    cp_size: CPSize
    page_size: PageSize
    mode: SplitMode
    requests: tuple[RequestPlan, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_plan(self) -> Self:
        for i, req in enumerate(self.requests):
            _check_request_owners(i, req, self.cp_size, self.page_size)
        return self

    # ---- derived views -------------------------------------------------------------------
    @cached_property
    def rank_counts(self) -> tuple[int, ...]:
        """Local rows per rank."""
        out = [0] * self.cp_size
        for req in self.requests:
            for s in req.segments:
                out[s.rank] += s.end - s.start
        return tuple(out)

    @property
    def max_rank_len(self) -> int:
        """Rows of the longest rank: the uniform padded shape of every CP collective (rule 8)."""
        return max(self.rank_counts)

    def rank_blocks(self, rank: int) -> list[RowBlock]:
        """Runs of ``rank``'s local rows, ordered by (request, absolute position) (rule 7)."""
        return [RowBlock(request=i, start=s.start, end=s.end)
                for i, req in enumerate(self.requests) for s in req.segments if s.rank == rank]

    @property
    def num_tokens(self) -> int:
        """Extend tokens of the whole batch (rows of the natural-order hidden states)."""
        return sum(r.extend_len for r in self.requests)

    @property
    def page_aligned(self) -> bool:
        """True when every request may use compute-owner direct writes (rule 13)."""
        return all(r.page_aligned for r in self.requests)

    def natural_offsets(self) -> tuple[int, ...]:
        """Row of each request's first extend token in natural order (requests concatenated)."""
        out, acc = [], 0
        for r in self.requests:
            out.append(acc)
            acc += r.extend_len
        return tuple(out)

    def local_rows(self, rank: int) -> tuple[list[int], list[int]]:
        """(request index, absolute position) of each local row of ``rank``, in local order.

        Row i may attend keys [0, positions[i] + 1) of its request (rule 7).
        """
        reqs: list[int] = []
        pos: list[int] = []
        for b in self.rank_blocks(rank):
            reqs.extend([b.request] * (b.end - b.start))
            pos.extend(range(b.start, b.end))
        return reqs, pos

    def causal_key_ends(self, rank: int) -> list[int]:
        """Exclusive end of each local row's causal key range [0, pos + 1)."""
        return [p + 1 for p in self.local_rows(rank)[1]]

    def local_row_indices(self, rank: int) -> list[int]:
        """Natural-order row index of each local row of ``rank`` (the split gather index)."""
        offs = self.natural_offsets()
        out: list[int] = []
        for b in self.rank_blocks(rank):
            base = offs[b.request] - self.requests[b.request].prefix_len
            out.extend(range(base + b.start, base + b.end))
        return out

    def gather_permutation(self) -> list[int]:
        """perm[n] = row of natural-order token n inside the rank-major padded gather.

        All ranks pad to ``max_rank_len`` rows; rank r's row i sits at r * max_rank_len + i.
        ``natural = gathered[perm]`` restores natural order and never reads a padded row.
        """
        perm = [0] * self.num_tokens
        width = self.max_rank_len
        for r in range(self.cp_size):
            base = r * width
            for i, n in enumerate(self.local_row_indices(r)):
                perm[n] = base + i
        return perm

    def fingerprint(self) -> str:
        """Stable hash of the plan, for cross-rank agreement checks (debug switch)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


def _check_request_owners(i: int, req: RequestPlan, c: int, ps: int) -> None:
    owners = req.page_owners
    npages = req.num_pages(ps)
    if len(owners) != npages:
        raise ValueError(f"request {i}: page_owners has {len(owners)} entries, the request "
                         f"spans ceil(({req.prefix_len}+{req.extend_len})/{ps})={npages} pages")
    touched = owners[req.prefix_len // ps:]
    if any(o is None or o >= c for o in touched):
        raise ValueError(f"request {i}: every page touched by the extend needs an owner rank < {c}, "
                         f"got {touched[:16]}")
    for s in req.segments:
        if s.rank >= c:
            raise ValueError(f"request {i}: segment [{s.start}, {s.end}) on rank {s.rank} "
                             f">= cp_size={c}")
    # rule 9: page_aligned only if every touched page's extend part is computed by its owner
    if req.page_aligned:
        for s in req.segments:
            pages = owners[s.start // ps: cdiv(s.end, ps)]
            if pages.count(s.rank) != len(pages):
                raise ValueError(
                    f"request {i} claims page_aligned but pages {s.start // ps}..{cdiv(s.end, ps) - 1}"
                    f" (owners {pages[:8]}) are computed by rank {s.rank} in segment "
                    f"[{s.start}, {s.end})")
    # rule 3: the head fragment of a prefix ending mid-page runs on that page's owner
    if req.prefix_len % ps:
        tail = req.prefix_len // ps
        head_end = min(req.end, (tail + 1) * ps)
        first = req.segments[0]
        if first.end < head_end or first.rank != owners[tail]:
            raise ValueError(f"request {i}: head fragment [{req.prefix_len}, {head_end}) must be "
                             f"computed by page {tail}'s owner {owners[tail]}, got "
                             f"segment [{first.start}, {first.end}) on rank {first.rank}")
