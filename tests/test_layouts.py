"""Issue 37 item 1: every KV layout (cpkv's token_major and part_major, the engines' two_part)
through the pool's writes, materialization (all-gather, prefetched, one-rank in place, replica),
the host tier and the transfers, bit-exact: the same views as a replica and the truth, the same
canonical page bytes whatever the layout, every page back from the host tier unchanged; and
``cpkv run`` with ``kv.layout = "two_part"`` equal to the reference."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from cpkv.contracts import KVDtype, KVFormat, SplitMode
from cpkv.runtime import run_ranks
from cpkv.testing.pool_check import PoolScenario, random_batches, run_pool_scenarios

LAYOUTS = ("token_major", "part_major", "two_part")
SMALL = {"kv_lora_rank": 64, "rope_dim": 16, "index_head_dim": 32, "quant_block": 32}


def _scenarios(cp: int) -> list[PoolScenario]:
    """Per layout the same batches and truth: fp8 (index-K values then scales in a two-part
    page) and bf16, a V3.2 schedule (every layer full) and a GLM-5 one (layer 1 latent-only),
    prefixes ending mid-page (owner writes) and whole prefix pages (the prefetched path)."""
    rng = random.Random(11)
    base = []
    for dtype, shared, mode in ((KVDtype.FP8, (), SplitMode.ZIGZAG),
                                (KVDtype.FP8, (1,), SplitMode.INTERLEAVE),
                                (KVDtype.BF16, (1,), SplitMode.ZIGZAG)):
        base.append(dict(batches=random_batches(rng, max_extend=24 * cp),
                         fmt=KVFormat(dtype=dtype, page_size=4, **SMALL), mode=mode,
                         num_layers=3, shared_layers=shared, seed=rng.randrange(1 << 30)))
    base.append(dict(batches=((("x", 70), ("y", 8 * cp + 3)), (("x", 30), ("y", 5))),
                     fmt=KVFormat(dtype=KVDtype.FP8, page_size=8, **SMALL), num_layers=2))
    return [PoolScenario(layout=lay, **kw) for kw in base for lay in LAYOUTS]  # type: ignore[arg-type]


@pytest.mark.multiprocess
@pytest.mark.parametrize("cp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_every_layout_round_trips_bit_exact(cp: int) -> None:
    scenarios = _scenarios(cp)
    results = run_ranks(run_pool_scenarios, cp, args=(scenarios,), timeout_s=240)
    for i, sc in enumerate(scenarios):
        for r in results:
            o = r.value[i]
            assert o.mismatches == [], (sc.layout, sc.fmt.dtype, o.mismatches)
            assert o.views_checked == len(sc.batches) * sc.num_layers
            assert o.host_round_trip, (sc.layout, r.rank)
            assert o.page_crcs
    if cp > 1:  # the prefetched (split) views ran on every layout
        assert all(sum(r.value[i].prefetched_views for r in results)
                   for i, sc in enumerate(scenarios) if sc.fmt.page_size == 8)
    # the same canonical page bytes, page by page and rank by rank, in every layout
    for j in range(0, len(scenarios), len(LAYOUTS)):
        for r in results:
            crcs = [r.value[j + k].page_crcs for k in range(len(LAYOUTS))]
            assert crcs[1] == crcs[0] and crcs[2] == crcs[0], scenarios[j].fmt


@pytest.mark.slow  # 4.5 s a layout: a whole cpkv run
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["part_major", "two_part"])
def test_cpkv_run_in_each_layout_equals_the_reference(tmp_path: Path, layout: str) -> None:
    """``cpkv run`` with ``kv.layout``: CP2 prefill pools in that layout (7 pages per rank, so
    the first prompt is evicted to the host tier and loaded back for its follow-up), pages
    moved to the part-major decode pool by the nccl transfer (the packed part layout, read from
    every layout alike), the prefix cache's hits: every result equals the one-process
    reference."""
    report = tmp_path / "report.json"
    env = {**os.environ, "CPKV_KV__LAYOUT": layout, "CPKV_KV__PAGES_PER_RANK": "7",
           "CPKV_CACHE__HOST_PAGES": "32"}
    out = subprocess.run([sys.executable, "-m", "cpkv.cli", "run", "--report", str(report)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(report.read_text())
    assert data["settings"]["kv"]["layout"] == layout
    assert data["correct"] is True and data["decode"]["tokens_match_reference"] is True
    c = data["cache"]
    assert c["hit_tokens"] == [0, 100, 0, 600]
    assert c["pages_saved_to_host"] > 0 and c["pages_loaded_from_host"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("preference", [("triton", "torch"), ("torch",)])
def test_every_layout_round_trips_bit_exact_on_cuda(preference: tuple[str, ...]) -> None:
    """One CUDA rank, the default KV ops (triton's page copies over the regions, pinned host
    pages read and written over the bus) and torch's: every layout's views equal the replica's
    and the truth, the host tier gives every page back, the canonical bytes agree."""
    from dataclasses import replace

    import torch

    from cpkv.comm import CPGroup

    g = CPGroup.single(torch.device("cuda", 0))
    scenarios = [replace(sc, preference=preference) for sc in _scenarios(1)]
    outs = run_pool_scenarios(g, scenarios)
    for sc, o in zip(scenarios, outs, strict=True):
        assert o.mismatches == [] and o.host_round_trip, (sc.layout, sc.fmt.dtype, o.mismatches)
    for j in range(0, len(outs), len(LAYOUTS)):
        assert outs[j + 1].page_crcs == outs[j].page_crcs == outs[j + 2].page_crcs
