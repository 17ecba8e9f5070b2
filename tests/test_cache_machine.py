"""A hypothesis state machine over the prefix cache on CP ranks.

Every rank runs the same machine (derandomized, so every rank draws the same steps; the ranks
check after every step that their trees agree). Rules: serve a request whose tokens share a
random prefix of a few roots (ending anywhere in a page), continue a running request, finish
one (cached or not), evict, and (rank 1 only: a rank-local fault) lose a host page. After every
step: the reference counts equal their holders', every hit is token-valid and, unless a fallback
said why, exactly the longest cached prefix; every logit equals a single-rank run without a
cache. At the end every request is released, the cache cleared, and every device and host page
is free again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from cpkv.comm import CPGroup
from cpkv.fallback import recording
from cpkv.kv import PoolExhausted
from cpkv.models import write_tiny_checkpoint
from cpkv.runtime import run_ranks
from cpkv.settings import load_settings
from cpkv.testing.cache_check import (
    all_free,
    common_prefix_len,
    no_cache_settings,
    reference_problems,
)

PAGE = 8
TOL = {"fp32": 1e-4, "bf16": 1e-3, "fp8": 2e-2}


# C901: the count is the nested Hypothesis state machine's rules (each a few branches), which
# close over this rank's sessions
def _machine(group: CPGroup, model_dir: str, cfg: Any, dtype: str, steps: int,  # noqa: C901
             examples: int) -> dict[str, Any]:
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    model = load_model(model_dir)
    session = PrefillSession(model, cfg, group)
    reference = PrefillSession(model, no_cache_settings(cfg, 512), CPGroup.single())
    cache = session.cache
    assert cache is not None and cache.host is not None
    counts = {"examples": 0, "steps": 0, "hits": 0, "loaded": 0, "lost": 0, "exhausted": 0}
    roots_st = st.lists(st.lists(st.integers(0, 5), min_size=8, max_size=40), min_size=2,
                        max_size=3)

    class CacheMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.roots: list[list[int]] | None = None
            self.live: dict[str, list[int]] = {}  # running requests: all their tokens so far
            self.cached: list[list[int]] = []  # every sequence ever inserted
            self.lost = False  # a host page was lost (or a fallback shortened a hit)
            self.n = 0
            counts["examples"] += 1

        def _check(self, rid: str, toks: list[int], last_logits: Any) -> None:
            ref = reference.prefill([(rid, toks)]).last_logits[0].float()
            reference.release(rid)
            got = last_logits.float().cpu()
            rel = ((got - ref).abs().amax() / ref.abs().amax()).item()
            assert rel <= TOL[dtype], f"{rid}: logits differ from the no-cache run by {rel:.2e}"

        @rule(data=st.data())
        def serve(self, data: st.DataObject) -> None:
            if self.roots is None:
                self.roots = data.draw(roots_st)
            if len(self.live) >= 3:
                return
            root = data.draw(st.sampled_from(self.roots))
            cut = data.draw(st.integers(0, len(root)))
            toks = root[:cut] + data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=12))
            rid = f"r{self.n}"
            self.n += 1
            with recording() as rec:
                hit = session.admit(rid, toks)
            best = min(max((common_prefix_len(toks, c) for c in self.cached), default=0), len(toks) - 1)
            assert 0 <= hit <= best
            if rec.events:
                self.lost = True  # a shortened hit leaves shorter nodes behind; exactness is off
            if not self.lost and cache.stats.nodes_dropped == 0:  # everything is still cached
                assert hit == best, f"hit {hit}, the longest cached prefix is {best}"
            counts["hits"] += hit > 0
            try:
                res = session.prefill([(rid, toks[hit:])])
            except PoolExhausted:  # running requests hold the pool (every rank alike)
                session.release(rid)
                counts["exhausted"] += 1
                return
            self._check(rid, toks, res.last_logits[0])
            self.live[rid] = toks

        @precondition(lambda self: bool(self.live))
        @rule(data=st.data())
        def extend(self, data: st.DataObject) -> None:
            rid = data.draw(st.sampled_from(sorted(self.live)))
            more = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=10))
            try:
                res = session.prefill([(rid, more)])
            except PoolExhausted:
                counts["exhausted"] += 1
                return
            self.live[rid] = self.live[rid] + more
            self._check(rid, self.live[rid], res.last_logits[0])

        @precondition(lambda self: bool(self.live))
        @rule(data=st.data(), keep=st.booleans())
        def finish(self, data: st.DataObject, keep: bool) -> None:
            rid = data.draw(st.sampled_from(sorted(self.live)))
            toks = self.live.pop(rid)
            session.finish(rid, toks if keep else None)
            if keep:
                self.cached.append(toks)

        @rule(nodes=st.integers(1, 3))
        def evict(self, nodes: int) -> None:
            cache.evict(nodes)

        @precondition(lambda self: any(n.on_host for n in cache.tree.nodes()))
        @rule(data=st.data())
        def lose_host_page(self, data: st.DataObject) -> None:
            held = sorted({r for n in cache.tree.nodes() if n.on_host for r in n.pages.values()})
            owner, slot = data.draw(st.sampled_from(held))
            if group.rank == 1 and session.pool.pages.alloc_rank(owner) == session.pool.pages.alloc_rank(1):
                cache.host.lost.add(slot)  # type: ignore[union-attr]
            self.lost = True
            counts["lost"] += 1

        @invariant()
        def references_balance(self) -> None:
            counts["steps"] += 1
            assert reference_problems(cache) == []
            cache.check_agreement()  # a collective: every rank's tree is the same

        def teardown(self) -> None:
            for rid in list(self.live):
                session.finish(rid)
            counts["loaded"] += cache.stats.pages_loaded_from_host
            cache.clear()
            session.pool.store.flush_loads()
            cache.host.lost.clear()  # type: ignore[union-attr]
            assert all_free(cache) and session.pool.pages.logical_pages() == 0
            assert reference_problems(cache) == []

    run_state_machine_as_test(CacheMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
        phases=[Phase.generate], database=None))
    return counts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=5)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("cp", "mode", "dtype", "examples"), [
    pytest.param(2, "zigzag", "bf16", 12, marks=pytest.mark.slow),  # 10 CPU seconds
    pytest.param(2, "interleave", "fp8", 12, marks=pytest.mark.slow),  # 3.6 s: CI runs it
    pytest.param(4, "interleave", "bf16", 6, marks=pytest.mark.slow),
    pytest.param(4, "zigzag", "fp8", 6, marks=pytest.mark.slow),
])
def test_the_cache_state_machine_on_cp_ranks(tiny: Path, cp: int, mode: str, dtype: str,
                                             examples: int) -> None:
    # a small pool (evictions happen) and a smaller host tier (host drops happen too)
    cfg = load_settings(cp={"size": cp, "mode": mode},
                        kv={"page_size": PAGE, "dtype": dtype, "pages_per_rank": 24 // cp + 4},
                        cache={"host_pages": 8}, backend={"preference": ["torch"]}, debug=True)
    results = run_ranks(_machine, cp, args=(str(tiny), cfg, dtype, 20, examples), timeout_s=600)
    counts = [r.value for r in results]
    assert all(c == counts[0] for c in counts), counts  # every rank ran the same steps
    c = counts[0]
    assert c["examples"] >= examples and c["steps"] > 0 and c["hits"] > 0
    assert c["loaded"] > 0, c  # hits came back from the host tier
