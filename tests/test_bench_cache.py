"""``cpkv bench cache`` at a tiny size: the report's structure, the exact hit fraction of the
workload, and the cached run's logits equal to the no-cache run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpkv.bench import BenchReport
from cpkv.bench import cache as bench_cache
from cpkv.fallback import recording
from cpkv.models import write_tiny_checkpoint


@pytest.mark.multiprocess
@pytest.mark.slow  # 4-5 CPU seconds
def test_cache_bench_report_hits_and_correctness(tmp_path: Path) -> None:
    requests, prefix, suffix, page = 3, 128, 16, 16
    ckpt = write_tiny_checkpoint(tmp_path / "tiny", seed=0)
    settings = bench_cache.bench_settings(2, requests, prefix, suffix, page)
    with recording():  # the hit batches' 16-token extends are short: token-balanced split
        rows, detail = bench_cache.run(ckpt, settings, requests=requests, prefix=prefix,
                                       suffix=suffix, timeout_s=300)
    out = BenchReport(machine="test", command="cpkv bench cache", results=tuple(rows),
                      detail=detail).write(tmp_path / "cache.json")
    report = json.loads(out.read_text())
    assert set(report) == {"machine", "command", "results", "detail"}
    by_name = {r["name"]: r for r in report["results"]}
    assert set(by_name) == {"prefix_cache_speedup", "prefix_cache_hit_fraction"}
    for r in by_name.values():
        assert set(r) == {"name", "value", "unit", "baseline_name", "baseline_value", "ratio"}
        assert r["value"] > 0 and r["baseline_value"] > 0
    d = report["detail"]
    # the first request misses; each later one hits exactly the shared prefix
    assert d["hits"] == [0, prefix, prefix]
    assert by_name["prefix_cache_hit_fraction"]["value"] == 2 * 128 / (3 * 144)
    assert by_name["prefix_cache_hit_fraction"]["ratio"] == pytest.approx(1.0)
    speed = by_name["prefix_cache_speedup"]
    assert speed["ratio"] == pytest.approx(d["seconds_no_cache"] / d["seconds_cache"])
    assert len(d["per_request_seconds_cache"]) == len(d["per_request_seconds_no_cache"]) == 3
    assert d["correct"] is True and d["max_rel_err"] <= bench_cache.TOLERANCE
    assert d["hits_agree_across_ranks"] is True
    assert d["cache_stats"]["pages_evicted"] == 0 and d["cache_stats"]["lookups"] == requests
