"""Issue 33, item 4: quiet as a library. cpkv's events go through the standard ``logging`` while
nobody configured structlog (the embedding application's logging decides), nothing reaches
stdout unless asked, and the rank processes of the benches and of the library API forward their
events to the parent as ``cpkv run``'s do."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from cpkv.logs import get_logger

ROOT = Path(__file__).parents[1]


def test_events_go_to_standard_logging_when_structlog_is_not_configured(
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    structlog.reset_defaults()
    log = get_logger("cpkv.some.module")
    with caplog.at_level(logging.INFO, logger="cpkv"):
        log.debug("cpkv.hidden", value=1)
        log.info("cpkv.shown", value=2, why="a reason")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("cpkv.some.module", logging.INFO, "cpkv.shown value=2 why='a reason'")]
    out = capsys.readouterr()
    assert out.out == ""  # never stdout


def test_a_configured_structlog_takes_the_events() -> None:
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        get_logger("cpkv.x").warning("cpkv.event", n=3)
    assert logs == [{"event": "cpkv.event", "n": 3, "log_level": "warning"}]


@pytest.mark.slow  # 6 s: a whole cpkv bench cache
@pytest.mark.multiprocess
def test_bench_cache_prints_only_its_result_and_the_path(tmp_path: Path) -> None:
    out = tmp_path / "cache.json"
    res = subprocess.run([sys.executable, "-m", "cpkv.cli", "bench", "cache", "--requests", "2",
                          "--prefix", "128", "--suffix", "64", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""  # no rank's events, no progress lines (not a terminal)
    lines = res.stdout.strip().splitlines()
    assert lines[0].strip() == "benchmark" and lines[-1] == f"wrote {out}"
    assert lines[-2].startswith("max relative error of the cached run's last-token logits")
    assert all(ln[0] in "┏┃┡│└" for ln in lines[1:-2])  # the table, nothing between its rows
    quiet = subprocess.run([sys.executable, "-m", "cpkv.cli", "-v", "bench", "cache",
                            "--requests", "2", "--prefix", "128", "--suffix", "64", "--out",
                            str(out)], capture_output=True, text=True, timeout=300)
    assert "cpkv.kv.materialize_auto" in quiet.stderr and "ranks=0,1" in quiet.stderr  # -v works


@pytest.mark.multiprocess
@pytest.mark.slow
def test_library_api_example_prints_only_its_own_lines() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "library_api.py")],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    own = ("first batch", "second batch", "owner of each page", "rank 0:", "rank 1:",
           "last-token logits", "fallbacks on rank 0")
    assert len(lines) == len(own)
    assert all(ln.startswith(o) for ln, o in zip(lines, own, strict=True))
    # the example configures no logging: Python's last resort prints warnings only, on stderr,
    # one line per event (both ranks' identical events merged)
    assert all(ln.startswith("cpkv.fallback ") and "ranks=0,1" in ln
               for ln in res.stderr.strip().splitlines()), res.stderr
