"""The DeepSeek-V4 prefix cache (:mod:`cpkv.cache.v4_prefix`, :mod:`cpkv.runtime.v4_cache`):
a hit is the longest cached prefix in tokens and is served from the last snapshot at or before
it; the rows after the boundary equal a prefill without the cache, cut at the same points or in
one piece, bit for bit, for any prefix lengths and snapshot
intervals (hypothesis; and the hit and boundary rule on the tree alone, with evictions); a hit
that ends mid-window; compressed entries stored once per prefix;
snapshots evicted with their node; CP2 through the cache equals one rank bit for bit and every rank holds the
same tree; ``cpkv run`` with ``cache.v4_prefix`` decodes the tokens of a run without it; with
the MTP layer the snapshots keep its ring and ``cpkv run --mtp`` through the cache decodes the
tokens of a run without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpkv.cache.v4_prefix import V4PrefixCache, V4Snapshot
from cpkv.cli import main
from cpkv.comm import CPGroup
from cpkv.kv.v4_state import assemble_v4_state
from cpkv.models.deepseek_v4 import DeepseekV4
from cpkv.models.v4_reference import reference_forward
from cpkv.ops import v4_op_table
from cpkv.runtime.launch import run_ranks
from cpkv.runtime.v4_cache import V4Served, v4_prefill_cached, v4_serve
from cpkv.runtime.v4_decode import v4_empty_state, v4_extend, v4_extend_all, v4_greedy
from cpkv.runtime.v4_speculative import v4_speculative
from cpkv.runtime.v4_state import owned_entries, tail_bundle

PAGE = 4  # the tiny model's unit: lcm(4, 4, 16) = 16 tokens; window 8


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("v4prefix") / "ckpt"
    res = CliRunner().invoke(main, ["init-model", str(root), "--arch", "v4", "--seed", "5"])
    assert res.exit_code == 0, res.output
    return root


@pytest.fixture(scope="module")
def model(tiny_v4: Path) -> DeepseekV4:
    return DeepseekV4.load(tiny_v4, ops=v4_op_table())


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("v4prefix_mtp") / "ckpt"
    res = CliRunner().invoke(main, ["init-model", str(root), "--arch", "v4", "--seed", "5",
                                    "--mtp"])
    assert res.exit_code == 0, res.output
    return root


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prompts() -> list[list[int]]:
    """A base prompt; a continuation diverging at 45 (mid-window: no multiple of 4, 16 or 8);
    the base grown; a short one diverging at 37."""
    base = _ids(70, 1)
    return [base[:53], base[:45] + _ids(30, 2), base, base[:37] + _ids(20, 3)]


def _no_cache(model: DeepseekV4, ids: torch.Tensor, cuts: tuple[int, ...]
              ) -> tuple[torch.Tensor, object]:
    """A prefill without the cache, cut at ``cuts``."""
    state, prev, out = v4_empty_state(model), 0, []
    for c in (*cuts, ids.shape[0]):
        out.append(v4_extend(model, state, ids[prev:c]))
        prev = c
    return torch.cat(out), state


def _check_exact(model: DeepseekV4, ids: torch.Tensor, served: V4Served) -> None:
    b = served.hit.boundary
    logits, state = _no_cache(model, ids, served.cuts)
    assert torch.equal(served.logits, logits[b:]), "not the no-cache prefill's bits"
    assert served.state is not None and served.state.equal(state)  # type: ignore[arg-type]
    ref = reference_forward(model, ids)[b:]
    assert torch.equal(served.logits, ref), float((served.logits - ref).abs().max())


def test_hits_resume_from_the_last_snapshot(model: DeepseekV4) -> None:
    unit = model.config.ownership_unit(PAGE)
    cache = V4PrefixCache(unit, interval=32)
    got = []
    with torch.no_grad():
        for p in _prompts():
            ids = torch.tensor(p)
            served = v4_serve(model, cache, ids)
            _check_exact(model, ids, served)
            got.append((served.hit.hit_tokens, served.hit.boundary))
    # 45: mid-window, served from 32 (the interval); 53: the first prompt's end, from its last
    # unit boundary 48 (a turn-end snapshot); 37: from 32
    assert got == [(0, 0), (45, 32), (53, 48), (37, 32)]
    assert cache.stats.recomputed_tokens == 13 + 5 + 5


def test_entries_stored_once_per_prefix_and_snapshots_evicted_with_their_node(
        model: DeepseekV4) -> None:
    unit = model.config.ownership_unit(PAGE)
    cache = V4PrefixCache(unit, interval=0)
    a, b = _ids(64, 4), _ids(64, 4)[:48] + _ids(20, 5)
    with torch.no_grad():
        v4_serve(model, cache, torch.tensor(a))
        held = cache.units_held()
        v4_serve(model, cache, torch.tensor(b))
    assert held == 4
    assert cache.units_held() == 4 + 2  # b's first three units are a's: only 48..68 are new
    assert cache.snapshot_boundaries() == [64, 64]  # each prompt's end
    stored = cache.nbytes()
    # the least recently used leaf: a's rest after b split it, [48, 64): its unit and snapshot
    assert cache.evict(1) == 1
    assert cache.snapshot_boundaries() == [64] and cache.nbytes() < stored
    assert (cache.match(a).hit_tokens, cache.match(a).boundary) == (48, 0)
    assert (cache.match([*b, 1]).hit_tokens, cache.match([*b, 1]).boundary) == (68, 64)
    cache.evict(10)
    assert cache.units_held() == 0 and cache.snapshot_boundaries() == [] and cache.nbytes() == 0


def test_snapshot_points(model: DeepseekV4) -> None:
    cache = V4PrefixCache(16, interval=20)  # rounded up to 32
    assert cache.interval == 32
    assert cache.snapshot_points(0, 70) == [32, 64]
    assert cache.snapshot_points(32, 90) == [64, 80]
    assert cache.snapshot_points(0, 15) == []
    assert V4PrefixCache(16).snapshot_points(16, 53) == [48]


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(interval=st.sampled_from([0, 16, 32, 48]),
       shared=st.lists(st.integers(1, 60), min_size=2, max_size=4),
       tails=st.lists(st.integers(1, 20), min_size=4, max_size=4),
       seed=st.integers(0, 1000))
def test_any_prefix_and_interval_is_exact(model: DeepseekV4, interval: int, shared: list[int],
                                          tails: list[int], seed: int) -> None:
    """Requests sharing prefixes of any length with a base prompt: each hit is the longest
    prefix any earlier request had (capped at its length - 1), served from the last snapshot an
    earlier request kept at or before it, and exact."""
    unit = model.config.ownership_unit(PAGE)
    cache = V4PrefixCache(unit, interval=interval)
    base = _ids(64, seed)
    reqs = [base[:n] + _ids(t, seed + 1 + i) for i, (n, t) in enumerate(zip(shared, tails,
                                                                             strict=False))]
    seen: list[list[int]] = []
    snaps: set[tuple[int, ...]] = set()
    with torch.no_grad():
        for r in reqs:
            ids = torch.tensor(r)
            served = v4_serve(model, cache, ids)
            lcp = max((next((i for i, (x, y) in enumerate(zip(r, s, strict=False)) if x != y),
                            min(len(r), len(s))) for s in seen), default=0)
            hit = min(lcp, len(r) - 1)
            want = max((b for b in range(unit, hit + 1, unit) if tuple(r[:b]) in snaps),
                       default=0)
            assert (served.hit.hit_tokens, served.hit.boundary) == (hit, want)
            _check_exact(model, ids, served)
            seen.append(r)
            snaps.update(tuple(r[:b]) for b in cache.snapshot_points(want, len(r)))


def _cp_rank(group: CPGroup, ckpt: str, prompts: list[list[int]]
             ) -> tuple[list[object], str, int]:
    model = DeepseekV4.load(ckpt, ops=v4_op_table())
    cache = V4PrefixCache(model.config.ownership_unit(PAGE), rank=group.rank, interval=32)
    out: list[object] = []
    with torch.no_grad():
        for p in prompts:
            logits, plan, carry = v4_prefill_cached(model, torch.tensor(p), group, cache,
                                                    page_size=PAGE, mode="zigzag")
            out.append((logits, plan.hit.hit_tokens, plan.hit.boundary,
                        owned_entries(model, carry, group.rank), tail_bundle(model, carry)))
    return out, cache.signature(), cache.nbytes()


@pytest.mark.slow
def test_mtp_rows_through_the_cache_equal_a_prefill_without_it(tiny_mtp: Path) -> None:
    """With the MTP layer the snapshots keep its window ring: for hits that end mid-window,
    served from the snapshot before them, the state (the MTP ring included) is the no-cache
    prefill's cut at the same points, bit for bit, and speculative decoding from it gives the
    greedy tokens."""
    model = DeepseekV4.load(tiny_mtp, ops=v4_op_table(), mtp=True)
    cache = V4PrefixCache(model.config.ownership_unit(PAGE), interval=16)
    with torch.no_grad():
        for p in _prompts():
            ids = torch.tensor(p)
            served = v4_serve(model, cache, ids)
            state, prev, out = v4_empty_state(model), 0, []
            for c in (*served.cuts, ids.shape[0]):
                out.append(v4_extend_all(model, state, ids[prev:c],
                                         int(ids[c]) if c < ids.shape[0] else None))
                prev = c
            assert served.state is not None and served.state.equal(state)
            assert torch.equal(served.logits, torch.cat(out)[served.hit.boundary:])
            first = int(served.logits[-1].argmax())
            greedy = v4_greedy(model, state.fork(), first, 8)
            x = served.state.layers[model.num_layers].window
            assert x.abs().sum() > 0  # the MTP ring is there
    hit = served.hit  # the last prompt's hit ends mid-window, served from the snapshot before
    assert hit.hit_tokens % 8 and 0 < hit.boundary < hit.hit_tokens
    drafts = reference_draft_last(model, ids, first)
    toks, _ = v4_speculative(model, served.state, first, drafts, 8, 2)
    assert toks == greedy


def reference_draft_last(model: DeepseekV4, ids: torch.Tensor, first: int) -> int:
    from cpkv.models.v4_reference import reference_draft

    nxt = torch.cat([ids[1:], torch.tensor([first])])
    return int(reference_draft(model, ids, nxt)[-1].argmax())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cp2_through_the_cache_equals_one_rank(tiny_v4: Path, model: DeepseekV4) -> None:
    prompts = _prompts()
    results = run_ranks(_cp_rank, 2, args=(str(tiny_v4), prompts), timeout_s=300.0)
    assert results[0].value[1] == results[1].value[1]  # the same tree and snapshots
    one = V4PrefixCache(model.config.ownership_unit(PAGE), interval=32)
    with torch.no_grad():
        for j, p in enumerate(prompts):
            served = v4_serve(model, one, torch.tensor(p))
            logits, hit, boundary, _, _ = results[0].value[0][j]
            assert (hit, boundary) == (served.hit.hit_tokens, served.hit.boundary)
            assert torch.equal(logits, served.logits)
            tail = next(r.value[0][j][4] for r in results if r.value[0][j][4] is not None)
            state = assemble_v4_state([r.value[0][j][3] for r in results], tail)
            assert served.state is not None
            for a, b in zip(state.layers, served.state.layers, strict=True):
                assert torch.equal(a.window, b.window)
                for name, c in a.compressors.items():
                    assert torch.equal(c.entries, b.compressors[name].entries)
    # each unit and each snapshot on one rank only: the ranks' bytes add up to one rank's
    assert sum(r.value[2] for r in results) == one.nbytes()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_run_through_the_cache_decodes_the_no_cache_tokens(tiny_v4: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(_prompts()))
    bodies, logits = [], []
    for cached in (False, True):
        rep, out = tmp_path / f"r{cached}.json", tmp_path / f"l{cached}.pt"
        env = {"CPKV_KV__PAGE_SIZE": str(PAGE), "CPKV_CACHE__V4_PREFIX": str(cached).lower(),
               "CPKV_CACHE__V4_SNAPSHOT_TOKENS": "32"}
        res = CliRunner().invoke(main, ["run", "--model", str(tiny_v4), "--cp", "2", "--prompts",
                                        str(prompts), "--decode-tokens", "6", "--report",
                                        str(rep), "--save-logits", str(out)], env=env)
        assert res.exit_code == 0, res.output
        bodies.append(json.loads(rep.read_text()))
        logits.append(torch.load(out))
        assert ("snapshot boundary" in res.output) == cached
    off, on = bodies
    assert on["correct"] and on["decode_tokens"] == off["decode_tokens"]
    assert torch.equal(logits[1], logits[0])
    assert on["prefix_cache"]["hit_tokens"] == [0, 45, 53, 37]
    assert on["prefix_cache"]["snapshot_boundary"] == [0, 32, 48, 32]
    assert "prefix_cache" not in off


@pytest.mark.slow
@pytest.mark.multiprocess
def test_run_with_mtp_through_the_cache_decodes_the_no_cache_tokens(tiny_mtp: Path,
                                                                    tmp_path: Path) -> None:
    """``cpkv run --mtp`` through the cache: CP2 prefill with the MTP layer (its logits equal
    the one-rank MTP forward), speculative decode from the sent state and first draft: the
    tokens of the run without the cache."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(_prompts()))
    bodies = []
    for cached in (False, True):
        rep = tmp_path / f"r{cached}.json"
        env = {"CPKV_KV__PAGE_SIZE": str(PAGE), "CPKV_CACHE__V4_PREFIX": str(cached).lower(),
               "CPKV_CACHE__V4_SNAPSHOT_TOKENS": "16"}
        res = CliRunner().invoke(main, ["run", "--model", str(tiny_mtp), "--cp", "2",
                                        "--prompts", str(prompts), "--decode-tokens", "6",
                                        "--mtp", "--draft-tokens", "2", "--report", str(rep)],
                                 env=env)
        assert res.exit_code == 0, res.output
        bodies.append(json.loads(rep.read_text()))
    off, on = bodies
    assert on["correct"] and on["decode_tokens"] == off["decode_tokens"]
    assert on["speculation"]["steps"] > 0 and all(d <= 2e-3 for d in on["draft_rel_diff"])
    assert on["prefix_cache"]["hit_tokens"] == [0, 45, 53, 37]


@settings(max_examples=60, deadline=None)
@given(unit=st.sampled_from([4, 16]), interval=st.sampled_from([0, 16, 24, 64]),
       seqs=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=70), min_size=1,
                     max_size=6),
       query=st.lists(st.integers(0, 2), min_size=1, max_size=80), evict=st.integers(0, 3))
def test_the_boundary_is_the_last_kept_snapshot_at_or_before_the_hit(
        unit: int, interval: int, seqs: list[list[int]], query: list[int], evict: int) -> None:
    """Metadata only (no tensors): the hit is the longest common prefix with a cached sequence
    (capped at len - 1), the boundary the last snapshot point of a cached sequence sharing the
    tokens up to it; evicting drops snapshots with their nodes, and evicting all leaves nothing."""
    cache = V4PrefixCache(unit, rank=-1, interval=interval)
    for s in seqs:
        points = cache.snapshot_points(0, len(s))
        cache.insert(s, [0] * -(-len(s) // unit), {},
                     [V4Snapshot(boundary=b, holder=0, cuts=()) for b in points])
    cache.evict(evict)
    live = [s for s in seqs if cache.tree.match(s).hit_tokens == len(s)]
    hit = cache.match(query)
    lcp = max((next((i for i, (x, y) in enumerate(zip(query, s, strict=False)) if x != y),
                    min(len(query), len(s))) for s in live), default=0)
    assert hit.hit_tokens >= min(lcp, len(query) - 1)
    snaps = {tuple(s[:b]) for s in live for b in cache.snapshot_points(0, len(s))}
    if not evict:
        assert hit.hit_tokens == min(lcp, len(query) - 1)
        want = max((b for b in range(unit, hit.hit_tokens + 1, unit)
                    if tuple(query[:b]) in snaps), default=0)
        assert hit.boundary == want
    assert hit.boundary == 0 or tuple(query[:hit.boundary]) in {
        tuple(s[:b]) for s in seqs for b in cache.snapshot_points(0, len(s))}
    assert len(hit.units) == hit.boundary // unit
    cache.evict(100)
    assert cache.units_held() == 0 and cache.snapshot_boundaries() == []
