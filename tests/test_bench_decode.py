"""cpkv bench decode on a CPU (its GPU numbers are in docs/perf.md): every run measured, the rows
built from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpkv.bench.decode import DecodeBenchSpec, decode_bench_rank, decode_rows
from cpkv.comm import CPGroup
from cpkv.models import write_tiny_checkpoint


@pytest.mark.slow
def test_decode_bench_runs_and_rows(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "m", seed=1, num_nextn_predict_layers=0)
    agree = write_tiny_checkpoint(tmp_path / "a", seed=3, draft="agree")
    spec = DecodeBenchSpec(str(ckpt), batches=(1, 3), contexts=(40,), steps=3, page_size=8,
                           mtp_model_dir=str(agree), mtp_shapes=((2, 40),), mtp_tokens=6)
    res = decode_bench_rank(CPGroup.single(), spec)
    assert set(res["runs"]) == {"1x40/graphs", "1x40/eager", "3x40/graphs", "3x40/eager"}
    for run in res["runs"].values():
        assert run["wall_ms"] > 0 and run["gpu_ms"] > 0
        assert run["graph"] is False  # a CPU steps eagerly
    assert res["runs"]["3x40/eager"]["shape"] == [4, 16]  # 3 requests -> a bucket of 4
    spec_runs = res["speculative"]
    assert set(spec_runs) == {f"2x40/k{k}/{m}" for k in (1, 2) for m in ("graphs", "eager")}
    assert all(r["equal_plain"] for r in spec_runs.values())  # speculation = plain greedy
    names = [r.name for r in decode_rows(res)]
    assert names == ["decode_1x40_wall_over_gpu", "decode_1x40_graph_speedup",
                     "decode_3x40_wall_over_gpu", "decode_3x40_graph_speedup",
                     "decode_mtp_k1_2x40_graph_speedup", "decode_mtp_k2_2x40_graph_speedup"]


def test_the_bytes_row_reads_weights_once_and_each_requests_keys() -> None:
    """decode_{b}x{ctx}_gpu_vs_bytes: GPU time over (weights + per request and layer 132 B a
    key and 656 B a selected latent) at the copy bandwidth."""
    from cpkv.bench.decode import step_bytes

    res = {"layers": 2, "index_topk": 2048, "weight_bytes": 1e9, "copy_gbps": 4000.0,
           "runs": {"64x131072/graphs": {"wall_ms": 3.5, "gpu_ms": 3.35},
                    "64x131072/eager": {"wall_ms": 9.0, "gpu_ms": 3.4, "tokens_per_s": 1.0}}}
    res["runs"]["64x131072/graphs"]["tokens_per_s"] = 2.0
    want = 1e9 + 64 * 2 * (131072 * 132 + 2048 * 656)
    assert step_bytes(res, 64, 131072) == want
    assert step_bytes(res, 1, 1000) == 1e9 + 2 * (1000 * 132 + 1000 * 656)
    row = {r.name: r for r in decode_rows(res)}["decode_64x128k_gpu_vs_bytes"]
    assert row.value == 3.35 and abs(row.baseline_value - want / 4000.0 / 1e6) < 1e-12
