"""Pure host-side rules an engine's own scheduler and prefix cache call (no tensors, no device).

* :func:`key_ranges`: each local row's request, absolute position, index in its request's new
  tokens and causal key range in the full view (rule 7: ``[0, pos + 1)`` of its request, offset
  by the request's first key).
* :func:`logits_rows`: per request, the rank and local row holding its last new token (the row
  whose logits are asked for).
* :func:`token_valid_hit`: how many tokens of a prefix-cache match may be used (rule 28: the
  valid token length, which may end inside the tail page; at least one token left to compute;
  the minimum over ranks when they disagree, rule 29).
* :func:`hit_pages`: the (owner, slot) of each page a hit covers, in logical order (what the
  engine adopts; the owners are the plan's input for the extend).
* :func:`tail_copy`: whether the extend after a hit writes into a shared tail page, and so
  which page is copied on write, from which slot, on which owner (rule 3: the tail page keeps
  its owner; the copy is made there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cpkv.contracts import CPPlan, cdiv

__all__ = ["KeyRanges", "LogitsRows", "TailCopy", "hit_pages", "key_ranges", "logits_rows",
           "tail_copy", "token_valid_hit"]


@dataclass(frozen=True)
class KeyRanges:
    """One rank's local rows of a plan, in local order (host tuples, one entry per row).

    Attributes:
        request: the row's request, as its index in the batch (``plan.requests``).
        position: the row's absolute position in its request (prefix included).
        token: the row's index in its request's new tokens (``position - prefix_len``): the
            engine's token id of the row is ``new_tokens[request][token]``.
        key_start: first key of the row's causal range in the full view (requests' keys
            concatenated in batch order).
        key_end: one past its last key (``key_start + position + 1``).
        num_keys: keys in the full view.
    """

    request: tuple[int, ...]
    position: tuple[int, ...]
    token: tuple[int, ...]
    key_start: tuple[int, ...]
    key_end: tuple[int, ...]
    num_keys: int


def key_ranges(plan: CPPlan, rank: int) -> KeyRanges:
    """The local rows of ``rank`` in ``plan`` and their causal key ranges (rule 7)."""
    first, acc = [], 0
    for r in plan.requests:
        first.append(acc)
        acc += r.end
    req: list[int] = []
    pos: list[int] = []
    for b in plan.rank_blocks(rank):
        req.extend([b.request] * (b.end - b.start))
        pos.extend(range(b.start, b.end))
    ks = tuple(first[i] for i in req)
    tok = tuple(p - plan.requests[i].prefix_len for i, p in zip(req, pos, strict=True))
    return KeyRanges(request=tuple(req), position=tuple(pos), token=tok, key_start=ks,
                     key_end=tuple(s + p + 1 for s, p in zip(ks, pos, strict=True)), num_keys=acc)


@dataclass(frozen=True)
class LogitsRows:
    """Where each request's last new token lies (its logits row), one entry per request of the
    plan, in batch order.

    Attributes:
        rank: the rank whose local rows hold it.
        row: its index among that rank's local rows (:func:`key_ranges` order).
    """

    rank: tuple[int, ...]
    row: tuple[int, ...]


def logits_rows(plan: CPPlan) -> LogitsRows:
    """The rank and local row of each request's last new token in ``plan`` (pure: every rank
    computes the same, no collective)."""
    n = len(plan.requests)
    rank, row = [-1] * n, [-1] * n
    for r in range(plan.cp_size):
        i = 0
        for b in plan.rank_blocks(r):
            last = plan.requests[b.request].end - 1
            if b.start <= last < b.end:
                rank[b.request], row[b.request] = r, i + last - b.start
            i += b.end - b.start
    return LogitsRows(rank=tuple(rank), row=tuple(row))


def token_valid_hit(match_tokens: int, cached_valid_len: int, prompt_len: int,
                    other_ranks: Sequence[int] = ()) -> int:
    """Usable hit length of a prefix-cache match: the matched tokens that are really written
    (``cached_valid_len``, possibly inside the tail page), leaving the prompt's last token to
    compute (its logits are asked for); the minimum with ``other_ranks``' hits (every rank
    uses the same hit, rule 29). 0: no hit."""
    hit = max(0, min(match_tokens, cached_valid_len, prompt_len - 1))
    return min([hit, *other_ranks])


def hit_pages(hit_len: int, owners: Sequence[int], slots: Sequence[int], page_size: int
              ) -> tuple[tuple[int, int], ...]:
    """(owner rank, slot) of the pages covering the first ``hit_len`` tokens of a cached
    request whose page table is ``owners`` / ``slots`` (its tail page included when the hit ends
    inside it).

    Raises:
        ValueError: the table holds fewer pages than the hit covers.
    """
    n = cdiv(hit_len, page_size)
    if len(owners) < n or len(slots) < n:
        raise ValueError(f"a hit of {hit_len} tokens covers {n} pages of {page_size}, the table "
                         f"has {min(len(owners), len(slots))}")
    return tuple(zip(owners[:n], slots[:n], strict=True))


@dataclass(frozen=True)
class TailCopy:
    """The tail page an extend writes into while others still read it: logical page ``page``
    is copied from ``src_slot`` into a new slot on ``owner`` (the page keeps its owner)."""

    page: int
    owner: int
    src_slot: int


def tail_copy(hit_len: int, pages: Sequence[tuple[int, int]], page_size: int, *,
              shared: bool = True) -> TailCopy | None:
    """The copy on write the extend after a hit of ``hit_len`` tokens needs, or None: only a
    hit ending inside a page writes into it (the head fragment, rule 3), and only a page others
    still hold (``shared``: the cache's entry does) is copied. ``pages``: :func:`hit_pages`."""
    if hit_len % page_size == 0 or not shared:
        return None
    k = hit_len // page_size
    owner, slot = pages[k]
    return TailCopy(page=k, owner=owner, src_slot=slot)
