"""Properties of the split planner: contract rules 1-9, for any batch, C and page size."""

from __future__ import annotations

import pytest
import structlog
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cpkv.contracts import CPPlan, FallbackReason, RequestSpec, SplitMode, cdiv
from cpkv.fallback import FallbackError, recording
from cpkv.planning import PlanError, plan_batch
from cpkv.testing.strategies import BatchCase, batches


def _plan(case: BatchCase) -> CPPlan:
    return plan_batch(case.requests, case.cp_size, case.page_size, case.mode)


def _body_start(p: int, e: int, ps: int) -> int:
    """First token after the head fragment (P rounded up to a page, capped at the end)."""
    return min(p + e, cdiv(p, ps) * ps)


@given(batches())
def test_plan_is_a_pure_function_of_its_inputs(case: BatchCase) -> None:  # rule 1
    a, b = _plan(case), _plan(case)
    assert a == b
    assert a.fingerprint() == b.fingerprint()
    assert CPPlan.model_validate_json(a.model_dump_json()) == a


@given(batches())
def test_segments_cover_the_extend_exactly_once(case: BatchCase) -> None:  # rule 2
    plan = _plan(case)
    for spec, req in zip(case.requests, plan.requests, strict=True):
        covered = [pos for s in req.segments for pos in range(s.start, s.end)]
        assert covered == list(range(spec.prefix_len, spec.prefix_len + spec.extend_len))
        assert all(0 <= s.rank < case.cp_size for s in req.segments)


@given(batches())
def test_one_owner_per_page_and_no_padding(case: BatchCase) -> None:  # rules 5, 10, 11
    plan = _plan(case)
    ps = case.page_size
    for spec, req in zip(case.requests, plan.requests, strict=True):
        end = spec.prefix_len + spec.extend_len
        assert len(req.page_owners) == cdiv(end, ps)  # physical span, never padded
        # prefix pages keep the owners they had
        assert req.page_owners[: len(spec.prefix_owners)] == spec.prefix_owners
        for k in range(spec.prefix_len // ps, cdiv(end, ps)):
            assert req.page_owners[k] is not None and 0 <= req.page_owners[k] < case.cp_size


@given(batches())
def test_head_fragment_runs_on_the_tail_page_owner(case: BatchCase) -> None:  # rule 3
    plan = _plan(case)
    ps = case.page_size
    for spec, req in zip(case.requests, plan.requests, strict=True):
        if spec.prefix_len % ps == 0:
            continue
        tail = spec.prefix_len // ps
        owner = spec.prefix_owners[tail]
        head_end = _body_start(spec.prefix_len, spec.extend_len, ps)
        for s in req.segments:
            if s.start < head_end:
                assert s.rank == owner and s.end <= head_end
        assert req.page_owners[tail] == owner  # never re-owned


@given(batches())
def test_zigzag_segments_are_whole_pages_and_balanced(case: BatchCase) -> None:  # rule 4
    if case.mode is not SplitMode.ZIGZAG:
        return
    plan = _plan(case)
    c, ps = case.cp_size, case.page_size
    for spec, req in zip(case.requests, plan.requests, strict=True):
        end = spec.prefix_len + spec.extend_len
        body = _body_start(spec.prefix_len, spec.extend_len, ps)
        tokens = end - body
        if cdiv(tokens, ps) < 2 * c:
            continue
        segs = [s for s in req.segments if s.start >= body]
        assert len(segs) == 2 * c
        assert req.page_aligned and req.fallback is None
        for i, s in enumerate(segs):
            assert s.rank == (i if i < c else 2 * c - 1 - i)
            assert s.start % ps == 0
            assert s.end % ps == 0 or s.end == end
            assert abs((s.end - s.start) - tokens / (2 * c)) <= ps
        per_rank = [0] * c
        for s in segs:
            per_rank[s.rank] += s.end - s.start
        assert max(abs(n - tokens / c) for n in per_rank) <= 2 * ps


@given(batches())
def test_short_extend_is_token_balanced(case: BatchCase) -> None:  # rule 5
    if case.mode is not SplitMode.ZIGZAG:
        return
    plan = _plan(case)
    c, ps = case.cp_size, case.page_size
    for spec, req in zip(case.requests, plan.requests, strict=True):
        body = _body_start(spec.prefix_len, spec.extend_len, ps)
        tokens = spec.prefix_len + spec.extend_len - body
        if tokens == 0 or cdiv(tokens, ps) >= 2 * c:
            continue
        sizes = [s.end - s.start for s in req.segments if s.start >= body]
        assert sum(sizes) == tokens
        assert max(sizes) - min(sizes) <= 1 and len(sizes) == min(tokens, 2 * c)


@given(batches())
def test_interleave_pages_round_robin(case: BatchCase) -> None:  # rule 6
    if case.mode is not SplitMode.INTERLEAVE:
        return
    plan = _plan(case)
    c, ps = case.cp_size, case.page_size
    for spec, req in zip(case.requests, plan.requests, strict=True):
        end = spec.prefix_len + spec.extend_len
        first_new = cdiv(spec.prefix_len, ps)
        assert req.page_aligned
        for k in range(first_new, cdiv(end, ps)):
            assert req.page_owners[k] == k % c
        pages = [0] * c
        for k in range(first_new, cdiv(end, ps)):
            pages[req.page_owners[k]] += 1
        assert max(pages) - min(pages) <= 1


@given(batches())
def test_local_rows_and_causal_ranges(case: BatchCase) -> None:  # rules 7, 8
    plan = _plan(case)
    for r in range(case.cp_size):
        reqs, pos = plan.local_rows(r)
        assert len(pos) == plan.rank_counts[r]
        assert list(zip(reqs, pos, strict=True)) == sorted(zip(reqs, pos, strict=True))
        for i, p in zip(reqs, pos, strict=True):
            spec = case.requests[i]
            assert spec.prefix_len <= p < spec.prefix_len + spec.extend_len
        assert plan.causal_key_ends(r) == [p + 1 for p in pos]
    assert sum(plan.rank_counts) == plan.num_tokens
    assert plan.max_rank_len == max(plan.rank_counts)


@given(batches(), st.integers(1, 3))
@settings(max_examples=60)
def test_gather_after_split_is_identity_bitwise(case: BatchCase, hidden: int) -> None:  # rule 8
    plan = _plan(case)
    x = torch.randn(plan.num_tokens, hidden, dtype=torch.float32)
    padded = torch.full((case.cp_size, plan.max_rank_len, hidden), float("nan"))
    for r in range(case.cp_size):
        idx = torch.tensor(plan.local_row_indices(r), dtype=torch.long)
        padded[r, : len(idx)] = x[idx]
    gathered = padded.reshape(-1, hidden)
    natural = gathered[torch.tensor(plan.gather_permutation(), dtype=torch.long)]
    assert torch.equal(natural, x)  # a padded (NaN) row leaking in would fail here


@given(batches())
def test_page_aligned_means_owners_compute_their_pages(case: BatchCase) -> None:  # rule 9
    plan = _plan(case)
    ps = case.page_size
    for req in plan.requests:
        owners_compute = all(req.page_owners[k] == s.rank for s in req.segments
                             for k in range(s.start // ps, cdiv(s.end, ps)))
        assert req.page_aligned == owners_compute
        assert (req.fallback is None) == req.page_aligned


def test_issue_example_plan() -> None:
    owners = (0, 1)  # prefix of 70 tokens on 64-token pages, interleaved over 4 ranks
    plan = plan_batch([RequestSpec(extend_len=1010),
                       RequestSpec(prefix_len=70, extend_len=600, prefix_owners=owners),
                       RequestSpec(extend_len=7)], cp_size=4, page_size=64)
    r0, r1, r2 = plan.requests
    assert r0.page_aligned and len(r0.segments) == 8
    assert all(s.start % 64 == 0 for s in r0.segments)
    assert [s.end % 64 == 0 for s in r0.segments] == [True] * 7 + [False]
    assert (r1.segments[0].start, r1.segments[0].end, r1.segments[0].rank) == (70, 128, 1)
    assert r1.page_aligned and all(s.start % 64 == 0 for s in r1.segments[1:])
    assert not r2.page_aligned and r2.fallback is FallbackReason.SHORT_EXTEND


def test_short_extend_fallback_is_reported_once_per_batch() -> None:  # rule 30
    with recording() as rec, structlog.testing.capture_logs() as logs:
        plan_batch([(0, 7), (0, 5), (0, 4096)], cp_size=4, page_size=64)
    events = [e for e in logs if e["event"] == "cpkv.fallback"]
    assert len(events) == 1
    ev = events[0]
    assert ev["log_level"] == "warning" and ev["reason"] == "short_extend"
    assert ev["op"] == "split_plan" and "#0" in ev["detail"] and "#1" in ev["detail"]
    assert "#2" not in ev["detail"]
    assert rec.counts[FallbackReason.SHORT_EXTEND] == 1


def test_aligned_batch_reports_nothing() -> None:
    with recording() as rec, structlog.testing.capture_logs() as logs:
        plan_batch([(0, 4096), (128, 2048)], cp_size=2, page_size=64, mode="interleave")
    assert not [e for e in logs if e["event"] == "cpkv.fallback"] and not rec.events


def test_error_policy_refuses_the_fallback() -> None:
    with recording("error"), pytest.raises(FallbackError, match="short_extend"):
        plan_batch([(0, 7)], cp_size=4, page_size=64)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (RequestSpec(prefix_len=70, extend_len=10), r"request 0: prefix P=70 ends inside page 1"),
        (RequestSpec(prefix_len=70, extend_len=10, prefix_owners=(0,)), r"has 1 entries.*2 pages"),
        (RequestSpec(prefix_len=64, extend_len=10, prefix_owners=(5,)), r"rank >= cp_size=4"),
    ],
)
def test_bad_prefix_owners_name_the_request(spec: RequestSpec, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        plan_batch([spec], cp_size=4, page_size=64)


def test_tampered_plan_is_rejected_with_the_values() -> None:
    plan = plan_batch([(0, 1024)], cp_size=2, page_size=64)
    data = plan.model_dump()
    data["requests"][0]["segments"][1]["start"] += 1
    with pytest.raises(ValidationError, match="expected a non-empty segment starting at"):
        CPPlan.model_validate(data)
    data = plan.model_dump()
    data["requests"][0]["page_owners"] = [1 - o for o in data["requests"][0]["page_owners"]]
    with pytest.raises(ValidationError, match="claims page_aligned"):
        CPPlan.model_validate(data)
    data = plan.model_dump()
    data["requests"][0]["segments"][0]["rank"] = 7
    with pytest.raises(ValidationError, match="on rank 7 >= cp_size=2"):
        CPPlan.model_validate(data)


@given(batches())
def test_each_rank_gets_at_most_its_page_share_plus_one(case: BatchCase) -> None:  # rule 11
    """Of the pages an extend creates, no rank owns more than ceil(new pages / C) + 1."""
    plan = _plan(case)
    c, ps = case.cp_size, case.page_size
    for req in plan.requests:
        new = req.page_owners[cdiv(req.prefix_len, ps):]
        held = [new.count(r) for r in range(c)]
        assert max(held) <= cdiv(len(new), c) + 1, (held, req)


@given(batches())
@settings(max_examples=60)
def test_row_layout_matches_the_plan(case: BatchCase) -> None:  # rules 7, 8
    from cpkv.kv import RowLayout

    plan = _plan(case)
    for r in range(case.cp_size):
        lay = RowLayout.build(plan, r)
        assert lay.local_index.tolist() == plan.local_row_indices(r)
        assert lay.perm.tolist() == plan.gather_permutation()
        reqs, pos = plan.local_rows(r)
        assert lay.positions.tolist() == pos
        assert lay.per_row(torch.tensor([b.request for b in lay.blocks])).tolist() == reqs


@given(batches(), st.data())
@settings(max_examples=60)
def test_gather_rows_is_the_gather_of_the_selected_rows(case: BatchCase, data: st.DataObject) -> None:
    """``RowLayout.gather_rows`` (the prefill's last-row logits path): equal to the whole gather
    indexed by the rows, bit for bit, for any rows (repeats and any order), with every rank's
    all-gather simulated from what each rank contributes."""
    from cpkv.kv import RowLayout

    plan = _plan(case)
    x = torch.randn(plan.num_tokens, 2, dtype=torch.float32)
    rows = torch.tensor(data.draw(st.lists(st.integers(0, plan.num_tokens - 1), max_size=6)),
                        dtype=torch.long)
    lays = [RowLayout.build(plan, r) for r in range(case.cp_size)]
    sent: dict[int, torch.Tensor] = {}

    class Group:  # all_gather_rows over what every rank put in (recorded in a first pass)
        rank = 0

        def all_gather_rows(self, local: torch.Tensor, max_rows: int) -> torch.Tensor:
            sent[self.rank] = local.clone()
            out = torch.full((case.cp_size * max_rows, *local.shape[1:]), float("nan"))
            for r, t in sent.items():
                out[r * max_rows: r * max_rows + t.shape[0]] = t
            return out

    g = Group()
    for _ in range(2):  # the second pass sees every rank's contribution
        got = []
        for r, lay in enumerate(lays):
            g.rank = r
            got.append(lay.gather_rows(x[lay.local_index], rows, g))  # type: ignore[arg-type]
    for t in got:
        assert torch.equal(t, x[rows])
