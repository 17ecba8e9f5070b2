"""Hypothesis strategies for plans, extents and owner maps (one module, reused by every test)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from cpkv.contracts import OwnerMap, PageExtent, RequestSpec, SplitMode, cdiv

__all__ = ["BatchCase", "batches", "owner_maps", "page_extents", "request_specs"]

page_sizes = st.sampled_from([1, 2, 3, 4, 16, 64])
cp_sizes = st.integers(min_value=1, max_value=8)
modes = st.sampled_from(list(SplitMode))


@dataclass(frozen=True)
class BatchCase:
    """Inputs of one planner call."""

    cp_size: int
    page_size: int
    mode: SplitMode
    requests: tuple[RequestSpec, ...]


@st.composite
def request_specs(draw: st.DrawFn, cp_size: int, page_size: int,
                  max_pages: int = 40) -> RequestSpec:
    """A request with a random prefix (often ending mid-page) and a random extend length.

    Extends range from a single token to ``max_pages`` pages, so both the page-aligned path and
    the short-extend fallback are drawn.
    """
    prefix = draw(st.one_of(st.just(0), st.integers(0, max_pages * page_size)))
    extend = draw(st.integers(1, max_pages * page_size))
    n = cdiv(prefix, page_size)
    owners = tuple(draw(st.lists(st.integers(0, cp_size - 1), min_size=n, max_size=n)))
    return RequestSpec(prefix_len=prefix, extend_len=extend, prefix_owners=owners)


@st.composite
def batches(draw: st.DrawFn, max_requests: int = 6, max_pages: int = 40) -> BatchCase:
    """A batch of 1..max_requests requests for a random C, page size and split mode."""
    c, ps, mode = draw(cp_sizes), draw(page_sizes), draw(modes)
    reqs = draw(st.lists(request_specs(c, ps, max_pages), min_size=1, max_size=max_requests))
    return BatchCase(cp_size=c, page_size=ps, mode=mode, requests=tuple(reqs))


@st.composite
def page_extents(draw: st.DrawFn) -> PageExtent:
    """A valid extent: whole pages whose valid length may end inside the last page."""
    ps = draw(page_sizes)
    valid = draw(st.integers(0, 50 * ps))
    return PageExtent(page_size=ps, start_page=draw(st.integers(0, 100)),
                      num_pages=cdiv(valid, ps), valid_tokens=valid)


@st.composite
def owner_maps(draw: st.DrawFn) -> OwnerMap:
    c = draw(cp_sizes)
    owners = draw(st.lists(st.integers(0, c - 1), max_size=64))
    return OwnerMap(cp_size=c, owners=tuple(owners))
