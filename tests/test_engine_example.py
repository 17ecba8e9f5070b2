"""Issue 37: examples/engine/engine.py (an engine embedding cpkv through cpkv.embed only) under
torchrun on CPUs: its logits equal PrefillSession's within 1e-5 relative (fp32 pool), with a
chunked prompt and a prefix-cache hit that ends mid-page (its tail page copied on its owner),
its KV tensors never copied, and each rank's manifest pages together rebuilding the request."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_engine_example


@pytest.mark.multiprocess
@pytest.mark.slow  # 11 CPU seconds at 2 ranks
@pytest.mark.parametrize("ranks", [2, 4])
def test_engine_example_equals_prefill_session(ranks: int, tmp_path: Path) -> None:
    out = run_engine_example(ranks, tmp_path)
    assert out["ok"] and out["cp"] == ranks
    assert isinstance(out["max_rel_diff"], float) and out["max_rel_diff"] <= 1e-5
    assert out["hits"] == {"a": 0, "b": 150, "c": 0}  # 150 = 9 pages of 16 + 6: mid-page
    assert out["tail_copies"] == 1 and out["batches"] == 4  # a in 3 chunks, then b with c
    assert out["transfer"] and out["no_copy"]
