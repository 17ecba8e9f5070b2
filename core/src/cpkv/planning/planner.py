"""Build the CP split plan of a batch (contract rules 1-9). Pure host code: integers in, plan out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cpkv.contracts import (
    CPPlan,
    FallbackReason,
    RequestPlan,
    RequestSpec,
    SplitMode,
    cdiv,
)
from cpkv.fallback import report_fallback

from ._split import Triple, interleave_pages, token_balanced, zigzag_pages

__all__ = ["PlanError", "plan_batch", "plan_request"]


class PlanError(ValueError):
    """The planner's inputs are inconsistent (names the request and the values)."""


def plan_request(
    spec: RequestSpec, cp_size: int, page_size: int, mode: SplitMode | str, index: int = 0,
    unit: int | None = None,
) -> RequestPlan:
    """Plan one request: segments, owners of every page it spans, page alignment.

    ``unit``: the model's ownership unit in tokens (a multiple of ``page_size``; None: the
    page), see :func:`plan_batch`.

    Raises:
        PlanError: prefix owners missing or of the wrong length, or naming a rank >= cp_size;
            a unit that is not a multiple of the page size.
    """
    u = _check_unit(unit, page_size)
    return RequestPlan.model_validate(_plan_request(spec, cp_size, page_size, mode, index, u))


def _check_unit(unit: int | None, page_size: int) -> int:
    if unit is None:
        return page_size
    if unit < 1 or unit % page_size:
        raise PlanError(f"ownership unit {unit} is not a positive multiple of the page size "
                        f"{page_size}")
    return unit


def _plan_request(
    spec: RequestSpec, cp_size: int, page_size: int, mode: SplitMode | str, index: int,
    unit: int,
) -> dict[str, Any]:
    """The plan of one request as plain data (validated once, with the whole batch)."""
    mode = SplitMode(mode)
    p, e, ps, c, u = spec.prefix_len, spec.extend_len, page_size, cp_size, unit
    end = p + e
    npages, nprefix = cdiv(end, ps), cdiv(p, ps)
    owners: list[int | None] = [None] * npages
    if spec.prefix_owners:
        if len(spec.prefix_owners) != nprefix:
            raise PlanError(f"request {index}: prefix_owners has {len(spec.prefix_owners)} entries, "
                            f"the prefix P={p} spans ceil({p}/{ps})={nprefix} pages")
        if max(spec.prefix_owners) >= c:
            raise PlanError(f"request {index}: prefix_owners {spec.prefix_owners[:8]} name a rank "
                            f">= cp_size={c}")
        owners[:nprefix] = spec.prefix_owners
    elif p % ps:
        raise PlanError(f"request {index}: prefix P={p} ends inside page {p // ps} (page size {ps}); "
                        f"that page's owner computes the head fragment, so prefix_owners is needed")

    triples: list[Triple] = []
    body = p
    if p % u:  # rule 3 (34): the head fragment finishes the tail page (unit) on its owner
        body = min(end, cdiv(p, u) * u)
        head_owner = owners[p // ps] if p % ps else owners[p // ps - 1]
        if head_owner is None:
            raise PlanError(f"request {index}: prefix P={p} ends inside ownership unit {p // u} "
                            f"(unit {u}); that unit's owner computes the head fragment, so "
                            "prefix_owners is needed")
        triples.append((p, body, head_owner))
        a, b = cdiv(p, ps), cdiv(body, ps)  # the unit's new pages belong to its owner too
        owners[a:b] = [head_owner] * (b - a)
    fallback: FallbackReason | None = None
    if body < end:
        if mode is SplitMode.INTERLEAVE:
            rest = interleave_pages(body, end, u, c)
        else:
            pages = zigzag_pages(body, end, u, c)
            if pages is None:
                rest, fallback = token_balanced(body, end, c), FallbackReason.SHORT_EXTEND
            else:
                rest = pages
        triples.extend(rest)
        # owner of each new page: the rank that computes its first extend token (rules 4-6)
        for s, t, r in rest:
            a, b = cdiv(s, ps), cdiv(t, ps)
            owners[a:b] = [r] * (b - a)
    aligned = _aligned(triples, owners, ps, u, p // u * (u // ps))
    if not aligned and fallback is None:  # cannot happen with the builders above; be honest
        fallback = FallbackReason.SHORT_EXTEND
    if aligned:
        fallback = None
    return {
        "prefix_len": p,
        "extend_len": e,
        "segments": triples,
        "page_aligned": aligned,
        "fallback": fallback,
        "page_owners": owners,
    }


def _aligned(triples: list[Triple], owners: list[int | None], ps: int, u: int,
             first_page: int) -> bool:
    """Rule 9: every page touched by the extend is computed by its owner; with a unit of
    several pages, all pages of each unit from ``first_page`` on have one owner (rule 34)."""
    for s, t, r in triples:
        a, b = s // ps, cdiv(t, ps)
        if owners[a:b].count(r) != b - a:
            return False
    per_unit = u // ps
    return per_unit == 1 or all(len(set(owners[k:k + per_unit])) == 1
                                for k in range(first_page, len(owners), per_unit))


def plan_batch(
    requests: Sequence[RequestSpec | tuple[int, int]],
    cp_size: int,
    page_size: int = 64,
    mode: SplitMode | str = SplitMode.ZIGZAG,
    unit: int | None = None,
    *,
    report_short: bool = True,
) -> CPPlan:
    """Plan a batch of requests on a CP group of ``cp_size`` ranks.

    ``unit``: the model's ownership unit in tokens (contract rule 34; a multiple of
    ``page_size``, e.g. DeepSeek-V4's ``config.ownership_unit(page_size)``; None: the page).
    Segments are cut on unit boundaries wherever they would be cut on page boundaries, so every
    page of a unit has one owner and a compressed entry, which lies inside one unit, has
    exactly one owner: the unit's. A request of fewer than 2C units (zigzag) falls back to the
    token-balanced split, visibly, as a short one does.

    ``requests`` are :class:`RequestSpec` or ``(prefix_len, extend_len)`` pairs (prefixes that end
    on a page boundary need no owners). Requests that cannot be page-aligned are reported once per
    batch through the fallback choke point (reason ``short_extend``); ``report_short=False``
    leaves that to a caller that re-plans them itself (and reports what it selects).

    Raises:
        PlanError: bad sizes or prefix owners (the message names the request).
        FallbackError: a request needs the token-balanced fallback and the policy is ``error``.
    """
    if cp_size < 1 or page_size < 1:
        raise PlanError(f"cp_size and page_size must be >= 1, got {cp_size} and {page_size}")
    u = _check_unit(unit, page_size)
    if not requests:
        raise PlanError("a batch needs at least one request")
    specs = [r if isinstance(r, RequestSpec) else RequestSpec(prefix_len=r[0], extend_len=r[1])
             for r in requests]
    plan = CPPlan.model_validate({
        "cp_size": cp_size,
        "page_size": page_size,
        "mode": mode,
        "requests": [_plan_request(s, cp_size, page_size, mode, i, u)
                     for i, s in enumerate(specs)],
    })
    plans = plan.requests
    short = [(i, rp) for i, rp in enumerate(plans) if not rp.page_aligned]
    if short and report_short:
        shown = ", ".join(f"#{i} (P={rp.prefix_len}, E={rp.extend_len})" for i, rp in short[:8])
        more = f" and {len(short) - 8} more" if len(short) > 8 else ""
        report_fallback(
            op="split_plan",
            requested=f"{plan.mode.value} page-aligned",
            selected="token-balanced (owner write)",
            reason=FallbackReason.SHORT_EXTEND,
            detail=f"{len(short)} of {len(plans)} requests span fewer than 2C={2 * cp_size} "
                   f"{'pages' if u == page_size else 'ownership units'} of {u}: {shown}{more}",
        )
    return plan
