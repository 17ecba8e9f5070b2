"""Issue 37: examples/engine/engine.py (an engine embedding cpkv through cpkv.embed only) under
torchrun on CPUs: its logits equal PrefillSession's within 1e-5 relative (fp32 pool), with a
chunked prompt and a prefix-cache hit that ends mid-page (its tail page copied on its owner),
its KV tensors never copied, and each rank's manifest pages together rebuilding the request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "engine" / "engine.py"


def run_example(ranks: int, tmp: Path, *extra: str) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        str(p) for p in [ROOT / "core" / "src", *sorted((ROOT / "backends").glob("*/src")),
                         *sorted((ROOT / "plugins").glob("*/src"))])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={ranks}", str(EXAMPLE), *extra],
                          capture_output=True, text=True, timeout=300, cwd=tmp, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out: dict[str, object] = json.loads(lines[-1])
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("ranks", [2, 4])
def test_engine_example_equals_prefill_session(ranks: int, tmp_path: Path) -> None:
    out = run_example(ranks, tmp_path)
    assert out["ok"] and out["cp"] == ranks
    assert isinstance(out["max_rel_diff"], float) and out["max_rel_diff"] <= 1e-5
    assert out["hits"] == {"a": 0, "b": 150, "c": 0}  # 150 = 9 pages of 16 + 6: mid-page
    assert out["tail_copies"] == 1 and out["batches"] == 4  # a in 3 chunks, then b with c
    assert out["transfer"] and out["no_copy"]
