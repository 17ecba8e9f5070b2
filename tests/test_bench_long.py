"""``cpkv bench long``'s parts on the CPU: the chunked prefills of one rank (logits equal across
chunkings, one timing per chunk), the rows built from them, and the top-k recall measure; the
glm5-attention preset's schedule (full, shared, full) at tiny dimensions: its FLOPs, its rows'
names, its recall over the full layers only."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from cpkv.bench.gpu import attention_stack, layer_flops, stack_flops
from cpkv.bench.long import (
    LongSpec,
    RecallSpec,
    _layer_choices,
    _recall,
    fp8_recall_rank,
    long_rank,
    long_rows,
    row_prefix,
    topk_share,
)
from cpkv.models import write_tiny_checkpoint
from cpkv.runtime import run_ranks


def test_recall_counts_shared_columns_of_full_rows() -> None:
    a = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, -1, -1]], dtype=torch.int32)
    b = torch.tensor([[3, 2, 1, 0], [4, 5, 8, 9], [5, 6, -1, -1]], dtype=torch.int32)
    mean, low, rows = _recall(a, b, 4)
    assert (mean, low, rows) == (0.75, 0.5, 2)  # the short third row is left out
    assert _recall(a[2:], b[2:], 4) == (1.0, 1.0, 0)


def test_topk_share_sums_the_kernels_by_name() -> None:
    kern = [{"kernel": "_topk_filter_kernel", "ms": 2.0}, {"kernel": "_topk_select_kernel", "ms": 1.0},
            {"kernel": "_indexer_kernel", "ms": 10.0}, {"kernel": "gemm", "ms": 50.0}]
    assert topk_share(kern) == {"topk_ms": 3.0, "indexer_ms": 10.0}
    # the fused path: the filter is the indexer, the sample's indexer calls are top-k work
    fused = [{"kernel": "_fused_filter_kernel", "ms": 12.0}, {"kernel": "_indexer_kernel", "ms": 0.5},
             {"kernel": "_sample_floor_kernel", "ms": 0.25}, {"kernel": "_topk_select_kernel", "ms": 1.0},
             {"kernel": "_fused_exact_kernel", "ms": 0.125}, {"kernel": "gemm", "ms": 50.0}]
    assert topk_share(fused) == {"topk_ms": 1.875, "indexer_ms": 12.0}


@pytest.mark.parametrize("module", ["cpkv_backend_triton.kernels.topk",
                                    "cpkv_backend_triton.kernels.topk_gluon"])
def test_topk_share_counts_every_top_k_kernel(module: str) -> None:
    """Every kernel the top-k modules launch is top-k time in ``long_512k_topk_share``: the
    Gluon filter, first named ``_filter_kernel``, was left out of it (the row read 0.047 for
    ~0.15). The names are read from the source, not imported (the interpreter's reload rules)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        pytest.skip(f"{module} is not installed")
    tree = ast.parse(Path(spec.origin).read_text())
    kernels = [f.name for f in tree.body
               if isinstance(f, ast.FunctionDef) and f.name.endswith("_kernel")]
    assert kernels
    for name in kernels:
        assert topk_share([{"kernel": name, "ms": 1.0}])["topk_ms"] == 1.0, name


def test_fused_topk_share_counts_every_kernel_but_the_filter() -> None:
    """In a profile holding the fused indexer top-k's filter, every other kernel of the fused
    module is top-k time (its select, first left out of the names), the filter the indexer's
    (names read from the source, as above)."""
    spec = importlib.util.find_spec("cpkv_backend_triton.kernels.indexer_topk")
    if spec is None or spec.origin is None:
        pytest.skip("cpkv_backend_triton is not installed")
    tree = ast.parse(Path(spec.origin).read_text())
    kernels = [f.name for f in tree.body
               if isinstance(f, ast.FunctionDef) and f.name.endswith("_kernel")]
    assert "_fused_filter_kernel" in kernels and len(kernels) > 1
    filt = {"kernel": "_fused_filter_kernel", "ms": 10.0}
    for name in kernels:
        if name != "_fused_filter_kernel":
            assert topk_share([filt, {"kernel": name, "ms": 1.0}]) == {
                "topk_ms": 1.0, "indexer_ms": 10.0}, name


@pytest.mark.multiprocess
@pytest.mark.slow
def test_long_rank_chunkings_give_equal_logits(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(tmp_path / "tiny", seed=5)
    spec = LongSpec(str(ckpt), tokens=(200, 320), chunks=(64, 128, 320), profile=(320, 64))
    res = run_ranks(long_rank, 1, args=(spec,), timeout_s=300)[0].value
    assert res["logits_equal"] == {200: True, 320: True}
    assert [len(r["chunk_seconds"]) for r in res["runs"].values()] == [4, 2, 1, 5, 3, 1]
    assert (res["kv_dtype"], res["indexer_dtype"]) == ("bf16", "bf16")  # "auto" on a CPU
    rows = {r.name: r for r in long_rows(res, {"matmul_tflops": 100.0}, 80.0)}
    assert set(rows) == {"long_200_mfu", "long_200_c128_mfu", "long_200_c320_mfu", "long_320_mfu",
                         "long_320_c128_mfu", "long_320_c320_mfu", "long_320_peak_gb"}
    assert rows["long_320_mfu"].ratio == pytest.approx(res["runs"]["320/64"]["layer_tflops"] / 100)
    r = res["runs"]["320/64"]
    assert r["layer_tflops"] * r["seconds"] > 0


def _run(tokens: int, chunk: int, seconds: float) -> dict[str, object]:
    return {"tokens": tokens, "chunk": chunk, "seconds": seconds,
            "layer_tflops": 1e3 / seconds, "peak_gb": 1.0}


def test_default_fp8_rows_against_the_fp8_ceiling_and_the_bf16_run() -> None:
    """Defaults that took the fp8 indexer: their MFU against the fp8 ceiling, the bf16 run's
    against the bf16 ceiling, and the speedup = bf16 seconds / default seconds."""
    ceil = {"matmul_tflops": 800.0, "fp8_matmul_tflops": 1500.0}
    res = {"indexer_dtype": "fp8", "runs": {"1048576/65536": _run(1 << 20, 65536, 28.0)}}
    bf16 = {"indexer_dtype": "bf16", "runs": {"1048576/65536": _run(1 << 20, 65536, 42.0)}}
    rows = {r.name: r for r in long_rows(res, ceil, 150.0, None, bf16)}
    assert set(rows) == {"long_1m_fp8_mfu", "long_1m_mfu", "long_1m_default_vs_bf16_speedup",
                         "long_1m_peak_gb"}
    assert rows["long_1m_default_vs_bf16_speedup"].ratio == pytest.approx(42.0 / 28.0)
    assert rows["long_1m_fp8_mfu"].ratio == pytest.approx(1e3 / 28.0 / 1500.0)
    assert rows["long_1m_mfu"].ratio == pytest.approx(1e3 / 42.0 / 800.0)


def test_a_sustained_fp8_ceiling_adds_a_twin_row() -> None:
    """With the matmul's rate at the power limit measured (``fp8_matmul_sustained_tflops``),
    each fp8 MFU row gets a ``_sustained`` twin over it; the burst row is unchanged."""
    ceil = {"matmul_tflops": 800.0, "fp8_matmul_tflops": 1500.0,
            "fp8_matmul_sustained_tflops": 1200.0}
    res = {"indexer_dtype": "fp8", "runs": {"1048576/65536": _run(1 << 20, 65536, 28.0),
                                            "524288/65536": _run(1 << 19, 65536, 8.0)}}
    rows = {r.name: r for r in long_rows(res, ceil, 150.0)}
    assert rows["long_1m_fp8_mfu"].ratio == pytest.approx(1e3 / 28.0 / 1500.0)
    assert rows["long_1m_fp8_mfu_sustained"].ratio == pytest.approx(1e3 / 28.0 / 1200.0)
    assert rows["long_512k_fp8_mfu_sustained"].ratio == pytest.approx(1e3 / 8.0 / 1200.0)
    assert "long_1m_mfu_sustained" not in rows


def test_layer_choices_compare_both_indexers_on_the_same_inputs() -> None:
    """bf16 vs DeepSeek's fp8 indexer on one layer's inputs: most of the top-k shared, every
    swapped-in key at or below the bf16 k-th logit (gap >= 0)."""
    from cpkv.testing.conformance import reference_backend

    g = torch.Generator().manual_seed(0)
    n, heads, d, k = 300, 8, 128, 32
    q = torch.randn(n, heads, d, generator=g).bfloat16()
    w = torch.randn(n, heads, generator=g) * (heads ** -0.5 * d ** -0.5)
    kk = torch.randn(n, d, generator=g).bfloat16()
    res = _layer_choices(reference_backend(), q, w, kk, k, step=128)
    assert res["rows"] == n - k + 1  # the rows holding at least k keys
    assert 0.8 < res["recall_mean"] <= 1.0 and res["recall_min"] <= res["recall_mean"]
    if res["swapped_keys"]:
        assert res["swap_gap_rel_median"] >= 0
    assert res["fp8_err_rel_at_kth_median"] is not None


def _tiny_glm5_stack(layers: int) -> dict[str, object]:
    """The glm5-attention preset's stack (its model type and indexer schedule over ``layers``
    dense layers) at the tiny model's dimensions."""
    from cpkv.models.tiny import PRESETS, TINY_DEFAULTS

    keep = ("num_hidden_layers", "first_k_dense_replace", "max_position_embeddings")
    tiny = {k: TINY_DEFAULTS[k] for k in PRESETS["glm5-attention"]
            if k in TINY_DEFAULTS and k not in keep}
    return attention_stack("glm5-attention", layers, **tiny)


def test_glm5_rows_are_named_by_the_preset() -> None:
    assert (row_prefix("v32-attention"), row_prefix("glm5-attention")) == ("", "glm5_")
    res = {"indexer_dtype": "bf16", "runs": {"1048576/65536": _run(1 << 20, 65536, 10.0)}}
    rows = long_rows(res, {"matmul_tflops": 800.0}, 150.0, prefix="glm5_")
    assert [r.name for r in rows] == ["glm5_long_1m_mfu", "glm5_long_1m_peak_gb"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_long_rank_on_the_glm5_schedule_counts_no_indexer_on_shared_layers(tmp_path: Path) -> None:
    """The preset's schedule over 3 layers (full, shared, full) at tiny dimensions: chunkings
    agree, each run's FLOPs are 2 full layers + 1 shared one (whose indexer counts zero), the
    rate is those FLOPs over the run's seconds; the fp8-vs-bf16 overlap is measured on the 2
    layers that run an indexer."""
    from cpkv.models.tiny import tiny_config

    stack = _tiny_glm5_stack(3)
    cfg = tiny_config(**stack)
    assert cfg.layer_indexers == ("full", "shared", "full")
    ckpt = str(write_tiny_checkpoint(tmp_path / "glm5", seed=3, **stack))
    n = 128
    res = run_ranks(long_rank, 1, args=(LongSpec(ckpt, tokens=(n,), chunks=(64, 128)),),
                    timeout_s=300)[0].value
    assert res["logits_equal"] == {n: True} and res["layers"] == 3
    full, shared = layer_flops(cfg, n), layer_flops(cfg, n, indexer=False)
    assert shared["indexer"] == 0 < full["indexer"]
    for r in res["runs"].values():
        assert r["flops"] == stack_flops(cfg, n)
        assert r["flops"] == {p: 2 * full[p] + shared[p] for p in full}
        assert r["layer_tflops"] * r["seconds"] * 1e12 == pytest.approx(sum(r["flops"].values()))
    names = {x.name for x in long_rows(res, {"matmul_tflops": 1.0}, 1.0,
                                       prefix=row_prefix("glm5-attention"))}
    assert names == {"glm5_long_128_mfu", "glm5_long_128_c128_mfu", "glm5_long_128_peak_gb"}
    rec = run_ranks(fp8_recall_rank, 1, args=(RecallSpec(ckpt, (40,), "glm5-attention"),),
                    timeout_s=300)[0].value
    assert len(rec["tokens"][40]["layers"]) == 2  # the full layers only
