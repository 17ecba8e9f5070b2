"""Ownership with compressed objects (contract rule 34-35): plans with an ownership unit cut
segments on unit boundaries, so every compressed entry of every rate lies in pages of one owner,
and that owner computes the window's last token (it computes and writes the entry); a batch
that cannot meet the unit falls back visibly; the default unit (the page) plans as before."""

from __future__ import annotations

from itertools import pairwise
from math import lcm

from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from cpkv.contracts import RequestSpec, SplitMode, cdiv
from cpkv.planning import plan_batch

RATES = (4, 16)


def _compute_rank(segments: tuple, pos: int) -> int:
    return next(r for s, t, r in segments if s <= pos < t)


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[RequestSpec], int, int, int, SplitMode]:
    cp = draw(st.integers(1, 4))
    ps = draw(st.sampled_from([4, 8]))
    unit = lcm(ps, *RATES)
    mode = draw(st.sampled_from(list(SplitMode)))
    specs = []
    for _ in range(draw(st.integers(1, 3))):
        p_units = draw(st.integers(0, 3))
        p = p_units * unit + draw(st.sampled_from([0, 0, ps, 2 * ps + 1]))
        p = min(p, p_units * unit + unit - 1) if p_units or p else 0
        owners: tuple[int, ...] = ()
        if p:
            # a prefix from a unit plan: every page of a unit on the unit's owner
            units = [draw(st.integers(0, cp - 1)) for _ in range(cdiv(p, unit))]
            owners = tuple(units[k * ps // unit] for k in range(cdiv(p, ps)))
        specs.append(RequestSpec(prefix_len=p, extend_len=draw(st.integers(1, 9 * unit)),
                                 prefix_owners=owners))
    return specs, cp, ps, unit, mode


@settings(max_examples=150, deadline=None)
@given(batches())
def test_every_compressed_entry_has_one_owner(case: tuple) -> None:
    specs, cp, ps, unit, mode = case
    with capture_logs() as logs:
        plan = plan_batch(specs, cp, ps, mode, unit=unit)
    fell_back = [e for e in logs if e.get("event") == "cpkv.fallback"]
    for spec, rp in zip(specs, plan.requests, strict=True):
        end = spec.prefix_len + spec.extend_len
        if not rp.page_aligned:
            assert fell_back, "a request off the unit must be a visible fallback"
            continue
        for m in RATES:
            for w in range(end // m):  # complete entries
                lo, hi = w * m, (w + 1) * m
                pages = range(lo // ps, cdiv(hi, ps))
                owners = {rp.page_owners[k] for k in pages}
                assert len(owners) == 1, (m, w, owners)
                if hi - 1 >= spec.prefix_len:  # the extend computes its last token
                    assert _compute_rank(rp.segments, hi - 1) == owners.pop()
        segs = rp.segments  # cuts between ranks on unit boundaries (the head fragment aside)
        for (_, t, r), (_, _, r2) in pairwise(segs):
            assert r == r2 or t % unit == 0, segs


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 700)), min_size=1, max_size=3),
       st.integers(1, 4), st.sampled_from(list(SplitMode)))
def test_unit_of_one_page_plans_as_before(reqs: list, cp: int, mode: SplitMode) -> None:
    specs = [(p * 64, e) for p, e in reqs]
    with capture_logs():
        assert plan_batch(specs, cp, 64, mode, unit=64) == plan_batch(specs, cp, 64, mode)


def test_short_request_for_the_unit_falls_back_visibly() -> None:
    with capture_logs() as logs:
        plan = plan_batch([(0, 100)], 2, 8, SplitMode.ZIGZAG, unit=32)  # 4 units < 2C? no: 4
    assert plan.requests[0].page_aligned
    with capture_logs() as logs:
        plan = plan_batch([(0, 90)], 2, 8, SplitMode.ZIGZAG, unit=32)  # 3 units < 2C = 4
    assert not plan.requests[0].page_aligned
    events = [e for e in logs if e.get("event") == "cpkv.fallback"]
    assert events and "ownership units of 32" in events[0]["detail"]
