"""The page table's records (pure Python, no tensors): a request's logical page table and a
batch's reservation."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

__all__ = ["PageKey", "RequestPages", "Reservation"]

#: (allocation rank, slot): a page's key in the reference counts and the free lists
PageKey = tuple[int, int]


@dataclass
class RequestPages:
    """Logical page table of one request: page k -> (owner rank, physical slot on the owner)."""

    owners: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    valid_len: int = 0
    #: pages reserved by a batch that is not committed yet
    pending: list[int] = field(default_factory=list)
    #: bumped by the page table whenever ``slots`` change (a copy of the table is current while
    #: the request object and this number are the same)
    version: int = field(default=0, compare=False)


@dataclass(frozen=True)
class Reservation:
    """What :meth:`PageTable.reserve` changed, to undo it (:meth:`PageTable.abort`).

    ``new_pages``: per request (rid, its first new logical page); ``copies``: copies on write of
    shared tail pages as (rid, logical page, old slot, new slot)."""

    rids: tuple[Hashable, ...]
    ends: tuple[int, ...]
    new_pages: tuple[tuple[Hashable, int], ...]
    copies: tuple[tuple[Hashable, int, int, int], ...]
