"""Segment builders for one request's extend after its head fragment. Pure integer code.

Each builder takes the half-open token range [start, end) (``start`` page-aligned) and returns
segments as (start, end, rank) triples in position order, never empty ones.
"""

from __future__ import annotations

from cpkv.contracts import cdiv

Triple = tuple[int, int, int]


def zigzag_rank(i: int, cp_size: int) -> int:
    """Rank of zigzag segment i of 2C: i for the "prev" half, 2C-1-i for the "next" half."""
    return i if i < cp_size else 2 * cp_size - 1 - i


def zigzag_pages(start: int, end: int, page_size: int, cp_size: int) -> list[Triple] | None:
    """2C segments of whole pages balanced by tokens (rule 4); None when fewer than 2C pages.

    Boundary i sits at the page nearest to i/(2C) of the tokens, clamped so that every segment
    keeps at least one page; only ``end`` may fall inside a page.
    """
    tokens = end - start
    n, nseg = cdiv(tokens, page_size), 2 * cp_size
    if n < nseg:
        return None
    bounds = [0]
    denom = nseg * page_size
    for i in range(1, nseg):
        k = (2 * i * tokens + denom) // (2 * denom)  # round(i * tokens / (2C * ps))
        bounds.append(min(max(k, bounds[-1] + 1), n - (nseg - i)))
    bounds.append(n)
    return [
        (start + bounds[i] * page_size, min(end, start + bounds[i + 1] * page_size),
         zigzag_rank(i, cp_size))
        for i in range(nseg)
    ]


def token_balanced(start: int, end: int, cp_size: int) -> list[Triple]:
    """Zigzag 2C segments balanced to within one token, ignoring pages (rule 5 fallback)."""
    tokens, nseg = end - start, 2 * cp_size
    base, extra = divmod(tokens, nseg)
    out: list[Triple] = []
    pos = start
    for i in range(nseg):
        size = base + (1 if i < extra else 0)
        if size:
            out.append((pos, pos + size, zigzag_rank(i, cp_size)))
            pos += size
    return out


def interleave_pages(start: int, end: int, page_size: int, cp_size: int) -> list[Triple]:
    """Logical page k on rank k mod C (rule 6); with C = 1 the pages form one segment."""
    if cp_size == 1:
        return [(start, end, 0)]
    first, last = start // page_size, cdiv(end, page_size)
    out = [(k * page_size, (k + 1) * page_size, k % cp_size) for k in range(first, last)]
    out[0] = (start, out[0][1], out[0][2])
    out[-1] = (out[-1][0], end, out[-1][2])
    return out
