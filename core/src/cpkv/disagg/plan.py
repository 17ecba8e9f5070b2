"""Transfer plans (contract rules 25-27): which pages each prefill CP rank sends, to which
logical positions, coalesced into runs. Pure host code over the pool's page table.

A prefill rank sends only the pages it owns, latent and index-K of every layer together. On the
decode side (not CP) the pages land at their logical positions in a full-layout pool. A run is a
stretch of logical pages that are also consecutive physical slots on the sender, so a transport
moves it as one entry per (layer, buffer) (rule 27).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Self

from pydantic import Field, model_validator

from cpkv.contracts import Contract, Count, PageIndex, PageLayout, Rank, cdiv
from cpkv.kv import RequestPages

__all__ = ["PageRun", "RankTransfer", "TransferManifest", "coalesce", "manifest_for",
           "rank_transfer"]


class PageRun(Contract):
    """Logical pages [first_page, first_page + num_pages) stored in the sender's consecutive
    physical slots [src_slot, src_slot + num_pages)."""

    first_page: PageIndex
    num_pages: int = Field(ge=1)
    src_slot: Count


class RankTransfer(Contract):
    """What one prefill rank sends for one request: its owned pages, as runs."""

    request: str
    rank: Rank
    runs: tuple[PageRun, ...]

    @property
    def num_pages(self) -> int:
        return sum(r.num_pages for r in self.runs)

    def logical_pages(self) -> list[int]:
        return [r.first_page + i for r in self.runs for i in range(r.num_pages)]


class TransferManifest(Contract):
    """Everything the decode side must receive before it may publish a request (rule 25).

    ``num_pages`` = ceil(valid_len / page_size) (a chunk that is not final covers whole pages only,
    rule 26); every logical page in [first_page, num_pages) comes from exactly one rank (pages
    before ``first_page`` were sent by earlier chunks of a chunked prefill).
    """

    request: str
    page_size: int = Field(ge=1)
    valid_len: Count
    num_pages: Count
    first_page: Count = 0
    parts: tuple[RankTransfer, ...]
    #: the byte order of the senders' page blocks (their pool's :class:`PageLayout`): a one-sided
    #: transport copies blocks as they are, and the decode side re-lays them out for its pool
    layout: PageLayout = PageLayout.TOKEN_MAJOR

    @model_validator(mode="after")
    def _exactly_once(self) -> Self:
        if self.num_pages != cdiv(self.valid_len, self.page_size):
            raise ValueError(f"request {self.request!r}: num_pages={self.num_pages} but "
                             f"valid_len={self.valid_len} needs {cdiv(self.valid_len, self.page_size)}"
                             f" pages of {self.page_size}")
        want = range(self.first_page, self.num_pages)
        seen = sorted(p for part in self.parts for p in part.logical_pages())
        if seen != list(want):
            missing = sorted(set(want) - set(seen))
            dup = sorted({p for p in seen if seen.count(p) > 1})
            raise ValueError(f"request {self.request!r}: parts must cover pages {self.first_page}.."
                             f"{self.num_pages - 1} exactly once; missing {missing[:8]}, "
                             f"duplicated {dup[:8]}")
        return self


def coalesce(pages: Sequence[tuple[int, int]]) -> list[PageRun]:
    """Runs from (logical page, physical slot) pairs sorted by logical page (rule 27)."""
    runs: list[PageRun] = []
    for page, slot in pages:
        last = runs[-1] if runs else None
        if (last is not None and page == last.first_page + last.num_pages
                and slot == last.src_slot + last.num_pages):
            runs[-1] = last.model_copy(update={"num_pages": last.num_pages + 1})
        else:
            runs.append(PageRun(first_page=page, num_pages=1, src_slot=slot))
    return runs


def rank_transfer(request: Hashable, owners: Sequence[int], slots: Sequence[int], rank: int,
                  pages: range | None = None) -> RankTransfer:
    """The part of ``rank``: the pages it owns among ``pages`` (default: all), coalesced."""
    span = range(len(owners)) if pages is None else pages
    mine = [(k, slots[k]) for k in span if owners[k] == rank]
    return RankTransfer(request=str(request), rank=rank, runs=tuple(coalesce(mine)))


def manifest_for(request: Hashable, pages: RequestPages, page_size: int, cp_size: int, *,
                 final: bool = True, already_sent: int = 0,
                 layout: PageLayout = PageLayout.TOKEN_MAJOR) -> TransferManifest:
    """The manifest of a request's pages [already_sent, n) from its page table ``pages`` (a
    prefill pool's :class:`~cpkv.kv.RequestPages`): n covers ``pages.valid_len`` tokens when
    ``final``, else only the whole pages (a non-final chunk never sends the tail page, which the
    next chunk still writes: rule 26).

    Raises:
        ValueError: the page table is shorter than its valid length needs, or ``already_sent``
            is past the pages this call would send (the manifest does not validate).
    """
    valid_len, ps = pages.valid_len, page_size
    n = cdiv(valid_len, ps) if final else valid_len // ps
    if len(pages.owners) < n or len(pages.slots) < n:
        raise ValueError(f"request {request!r}: {valid_len} valid tokens need {n} pages of {ps}, "
                         f"the page table has {len(pages.owners)} owners and {len(pages.slots)} "
                         f"slots")
    span = range(already_sent, n)
    parts = tuple(rank_transfer(request, pages.owners, pages.slots, r, span) for r in range(cp_size))
    parts = tuple(p for p in parts if p.runs)
    covered = valid_len if final else n * ps
    return TransferManifest(request=str(request), page_size=ps, valid_len=covered,
                            num_pages=n, first_page=already_sent, parts=parts, layout=layout)
