"""Issue 33, item 7: the smaller items (bench --help defaults, init-model temporaries and file
modes, a short oversubscription error with the fix first, the report's sharding line)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cpkv.models import write_tiny_checkpoint
from cpkv.runtime import RankTimeout


@pytest.mark.parametrize("name", ["plan", "cache", "long", "transfer"])
def test_bench_help_states_where_the_report_really_goes(name: str) -> None:
    res = subprocess.run([sys.executable, "-m", "cpkv.cli", "bench", name, "--help"],
                         capture_output=True, text=True, timeout=60)
    text = " ".join(res.stdout.split())
    assert "[default: ~/.cache/cpkv/bench/" in text.replace("~/.cach e", "~/.cache")
    assert "[default: benchmarks/results" not in text


def test_init_model_files_get_the_umask_mode_and_stale_temporaries_go(tmp_path: Path) -> None:
    dead = tmp_path / ".tiny.tmp-999999999-abc"  # a writer killed by SIGKILL left it
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"x" * 10)
    live = tmp_path / f".tiny.tmp-{os.getpid()}-abc"  # a writer still running
    live.mkdir()
    umask = os.umask(0o022)
    try:
        path = write_tiny_checkpoint(tmp_path / "tiny", num_nextn_predict_layers=0)
    finally:
        os.umask(umask)
    assert (path / "model.safetensors").stat().st_mode & 0o777 == 0o644
    assert (path / "config.json").stat().st_mode & 0o777 == 0o644
    assert path.stat().st_mode & 0o777 == 0o755
    assert not dead.exists() and live.exists()


def test_startup_timeout_of_many_ranks_is_short_with_the_fix_first() -> None:
    err = RankTimeout(list(range(3, 65)), 65, "startup", 60.0,
                      names=[f"rank {r}" for r in range(64)] + ["the decode rank"],
                      hint="use fewer ranks or raise runtime.startup_timeout_s: 65 rank "
                           "processes on 2 CPU core(s) start slowly")
    msg = str(err)
    assert msg.startswith("use fewer ranks or raise runtime.startup_timeout_s")
    assert "62 of 65 ranks did not join" in msg and "(ranks 3-64)" in msg
    assert len(msg) < 250


def test_the_report_says_what_sharding_saved_in_one_line() -> None:
    from types import SimpleNamespace

    from cpkv.cli.run import sharding_line

    rep = SimpleNamespace(cp=2, kv_bytes_per_rank=[600, 400], kv_bytes_replicated=1000)
    line = sharding_line(rep, 4096)  # type: ignore[arg-type]
    assert line == ("sharding saved: the largest rank holds 60.0% of a replica's KV (400 bytes "
                    "less), the group 50.0% of 2 replicas'; the pool holds 4,096 tokens per rank")
