"""``cpkv bench gpu``'s orchestration (:func:`cpkv.bench.gpu.run`) on a CPU: the rank
functions, the ceilings, the kernels and the checkpoint faked, what it runs in which order and
the rows it makes of their values checked (the measurements themselves need GPUs: test_gpu.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import cpkv.models
import cpkv.runtime
from cpkv.bench import gpu

N = 65536


def _prefill(spec: gpu.PrefillSpec, rank: int, size: int) -> dict[str, Any]:
    default = spec.indexer_dtype == "auto"
    sizes = {n: {"seconds": (1.0 if default else 2.0) if size == 1 else 1.5,
                 "all": [1.0 + rank, 1.25 + rank, 1.0], "kv_bytes": 1000 // size}
             for n in spec.tokens}
    return {"sizes": sizes, "layers": 2, "layer_flops": {N: {"mla": 3e12, "mlp": 1e12}},
            "kv_dtype": "fp8", "indexer_dtype": "fp8" if default else "bf16"}


def _value(fn: Any, spec: Any, rank: int, size: int) -> dict[str, Any]:
    if fn is gpu.materialize_rank:
        return {"raw_all_gather_ms": 2.0, "mode_p2p": "p2p", "mode_all_gather": "all_gather",
                "materialize_p2p_ms": 1.0, "materialize_all_gather_ms": 4.0,
                "gathered_bytes": 1e9}
    if fn is gpu.prefill_rank:
        return _prefill(spec, rank, size)
    assert fn is gpu.prefetch_rank
    return {"extend_s_no_prefetch": 2.0 + rank, "extend_s_prefetch": 1.0}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[str, int]]:
    seen: list[tuple[str, int]] = []

    def run_ranks(fn: Any, size: int, *, args: tuple[Any, ...] = (), **_: Any) -> list[Any]:
        seen.append((fn.__name__, size))
        return [SimpleNamespace(value=_value(fn, args[0], r, size)) for r in range(size)]

    monkeypatch.setattr(cpkv.runtime, "run_ranks", run_ranks)
    monkeypatch.setattr(cpkv.models, "write_tiny_checkpoint", lambda path, **_: path)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(gpu, "ceilings", lambda dev, **_: {"copy_gbps": 1.0, "matmul_tflops": 4.0,
                                                      "fp8_matmul_tflops": 8.0})
    monkeypatch.setattr(gpu, "kernel_rows", lambda dev, ceil, detail: [])
    monkeypatch.setattr(gpu, "decode_steps", lambda *a, **k: {"kernels": [
        {"total_ms": 1.0 if k.get("backends", ("cuda",))[0] == "cuda" else 2.0}]})
    return seen


def test_gpu_run_makes_every_row_from_its_runs(calls: list[tuple[str, int]]) -> None:
    said: list[str] = []
    rows, detail = gpu.run(gpu.GpuBenchOptions(sizes=(N,)), progress=said.append)
    assert calls == [("materialize_rank", 2), ("materialize_rank", 2), ("prefill_rank", 1),
                     ("prefill_rank", 2), ("prefill_rank", 1), ("prefetch_rank", 2)]
    got = {r.name: (r.value, r.baseline_value) for r in rows}
    assert got == {
        "materialize_64k_bw": (1000.0, 500.0),
        "materialize_64k_bw_all_gather": (250.0, 500.0),
        "cp1_layer_64k_mfu": (4.0, 4.0),  # 2 layers x 4e12 FLOPs in 2 s
        # CP2: per repeat the slower rank (2, 2.25, 1), the first dropped: median 1.625
        "cp2_vs_cp1_64k_speedup": (N / 1.625, N / 2.0),
        "cp2_kv_bytes_per_rank_64k": (500, 1000),
        "cp1_layer_64k_fp8_mfu": (8.0, 8.0),
        "cp1_64k_default_vs_bf16_speedup": (N / 1.0, N / 2.0),
        "decode_step_64k_speedup": (1000.0, 500.0),
        "prefetch_64k_prefix_extend_speedup": (1.0, 1 / 3.0),
    }
    assert {"ceilings", "materialize_64k_fp8", "materialize_64k_bf16", "prefill",
            "prefill_cp1_64k_default", "decode_64k", "prefetch"} <= set(detail)
    assert "ceilings" in said and any(s.startswith("CP2 prefill") for s in said)


def test_gpu_run_skip_prefill_measures_kernels_and_materialization_only(
        calls: list[tuple[str, int]]) -> None:
    rows, _ = gpu.run(gpu.GpuBenchOptions(sizes=(N,), skip_prefill=True))
    assert calls == [("materialize_rank", 2)] * 2
    assert [r.name for r in rows] == ["materialize_64k_bw", "materialize_64k_bw_all_gather"]


def test_long_run_runs_each_part_and_summarises(monkeypatch: pytest.MonkeyPatch,
                                                calls: list[tuple[str, int]]) -> None:
    """``cpkv bench long``'s orchestration (:func:`cpkv.bench.long.run`): the default run, the
    bf16 indexer's where the defaults took fp8, the fixed budget, the recall on both
    checkpoints, the logits against transformers; the summary from the default run."""
    from cpkv.bench import long

    runs = {"a": {"tokens": 1024, "chunk": 256, "seconds": 8.0},
            "b": {"tokens": 1024, "chunk": 512, "seconds": 6.0}}
    values = {"long_rank": {"kv_dtype": "fp8", "indexer_dtype": "fp8", "budget_mb": 512,
                            "budget_auto": True, "logits_equal": True, "runs": runs},
              "fp8_recall_rank": {"recall": 1}, "hf_logits_rank": {"max_rel_err": 0.0}}
    seen: list[tuple[str, Any]] = []

    def run_ranks(fn: Any, size: int, *, args: tuple[Any, ...] = (), **_: Any) -> list[Any]:
        seen.append((fn.__name__, args[0]))
        return [SimpleNamespace(value=values[fn.__name__])]

    monkeypatch.setattr(cpkv.runtime, "run_ranks", run_ranks)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: SimpleNamespace(total_memory=int(1e11)))
    monkeypatch.setattr(long, "write_hf_checkpoint", lambda path, **_: path)
    monkeypatch.setattr(long, "long_rows", lambda res, ceil, gb, fixed, bf16, prefix: [
        ("long", fixed is not None, bf16 is not None)])
    monkeypatch.setattr(long, "recall_rows", lambda res: [("recall",)])
    opts = long.LongBenchOptions(tokens=(1024,), chunks=(256, 512), recall_tokens=(512,),
                                 hf_tokens=128, budget_mb=64)
    rows, detail, summary = long.run(opts)
    assert [name for name, _ in seen] == ["long_rank", "long_rank", "long_rank",
                                          "fp8_recall_rank", "fp8_recall_rank", "hf_logits_rank"]
    bf16, fixed = seen[1][1], seen[2][1]
    assert (bf16.indexer_dtype, bf16.chunks, bf16.kv_dtype) == ("bf16", (256,), "fp8")
    assert (fixed.tokens, fixed.chunks, fixed.budget_mb) == ((1024,), (256,), 512)
    assert [s.label for _, s in seen[3:5]] == ["v32-attention", "hf"]
    assert rows == [("long", True, True), ("recall",), ("recall",)]
    assert {"long", "long_bf16_indexer", "fixed_budget", "fp8_overlap_hf",
            "vs_transformers"} <= set(detail)
    # the longest prompt in the smallest chunks: 8 s over 8 ranks
    assert "projected 1.00 s (128 rows a rank)" in summary and "(auto:" in summary


def test_long_run_glm5_preset_writes_glm5s_stack_and_names_its_rows(
        monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, int]]) -> None:
    """``--preset glm5-attention``: the stack written is GLM-5's attention over the layers asked
    for (full, shared), its rows get the ``glm5_`` prefix, the recall is labelled by the preset
    (and ``glm5_hf`` for transformers' checkpoint of the same config), the detail and the
    summary say which stack ran."""
    from cpkv.bench import long

    written: dict[str, Any] = {}

    def write(path: Any, seed: int = 0, **cfg: Any) -> Any:
        written.update(cfg)
        return path

    monkeypatch.setattr(cpkv.models, "write_tiny_checkpoint", write)
    runs = {"a": {"tokens": 1024, "chunk": 256, "seconds": 8.0}}
    value = {"kv_dtype": "bf16", "indexer_dtype": "bf16", "budget_mb": 512, "budget_auto": False,
             "logits_equal": None, "runs": runs}
    seen: list[Any] = []

    def run_ranks(fn: Any, size: int, *, args: tuple[Any, ...] = (), **_: Any) -> list[Any]:
        seen.append(args[0])
        return [SimpleNamespace(value=value if fn is long.long_rank else {"checkpoint": "x"})]

    monkeypatch.setattr(cpkv.runtime, "run_ranks", run_ranks)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda dev: SimpleNamespace(total_memory=int(1e11)))
    monkeypatch.setattr(long, "write_hf_checkpoint", lambda path, **_: path)
    prefixes: list[str] = []
    monkeypatch.setattr(long, "long_rows", lambda res, ceil, gb, fixed, bf16, prefix: (
        prefixes.append(prefix) or []))
    monkeypatch.setattr(long, "recall_rows", lambda res: [])
    opts = long.LongBenchOptions(tokens=(1024,), chunks=(256,), recall_tokens=(512,),
                                 hf_tokens=0, fixed_budget_mb=0, preset="glm5-attention")
    _, detail, summary = long.run(opts)
    from cpkv.models.tiny import tiny_config

    cfg = tiny_config(**written)
    assert (cfg.model_type, cfg.num_attention_heads, cfg.layer_indexers) == (
        "glm_moe_dsa", 64, ("full", "shared"))
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.index_n_heads) == (192, 256, 32)
    assert prefixes == ["glm5_"]
    assert [s.label for s in seen[1:]] == ["glm5-attention", "glm5_hf"]
    assert detail["preset"] == "glm5-attention" and summary.startswith("glm5-attention: ")
    with pytest.raises(ValueError, match="v32-attention, glm5-attention"):
        long.LongBenchOptions(preset="glm5")
