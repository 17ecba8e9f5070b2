"""Long prompts of DeepSeek-V4's attention on one GPU (``cpkv bench long --preset
v4-flash-attention`` / ``v4-pro-attention``): the 2-layer stack (one CSA, one HCA layer at the
model's attention sizes, a small MoE), bf16, a prompt prefilled in chunks as an engine does
(CP1: :func:`~cpkv.runtime.v4_prefill.v4_prefill_logits` with the entries and the carry state
crossing chunks), the ``v4_*`` ops from the default preference (FlashMLA's V4 attention,
Triton's indexer top-k, torch's compressor).

Per prompt length: wall seconds (synchronised per chunk only), the share of each op group's
device time (CUDA events around every ``v4_*`` call: the indexer with its top-k, the
compressor's pool, the attention; the rest is projections, norms, rope, mHC and the MoE), the
stack's FLOPs over the time against the sustained fp8 matmul of the same run (MFU; predicted:
at 1M tokens the CSA indexer dominates, ~2.2 GFLOP a query), the peak device memory, and the
FP8 KV bytes per token of context of the full model against DeepSeek-V3.2's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from cpkv.comm import note_progress

if TYPE_CHECKING:
    from cpkv.contracts import KVOps
    from cpkv.models.deepseek_v4 import DeepseekV4

    from .report import BenchRow

__all__ = ["V4_PRESETS", "V4LongSpec", "op_groups", "run_v4_long", "stack_flops_v4",
           "v4_long_rank", "v4_long_rows"]

#: the stacks this bench runs, and their rows' prefix
V4_PRESETS = {"v4-flash-attention": "v4flash_", "v4-pro-attention": "v4pro_"}
#: op -> the group its device time is counted in
_GROUPS = {"v4_index_topk": "indexer", "v4_index_scores": "indexer", "v4_topk": "indexer",
           "v4_compress": "compressor", "v4_attention": "attention"}


@dataclass(frozen=True)
class V4LongSpec:
    """One :func:`v4_long_rank` call: prompts of each of ``tokens`` in chunks of ``chunk``."""

    ckpt: str
    tokens: tuple[int, ...]
    chunk: int
    preference: tuple[str, ...] = ("cuda", "triton", "torch")
    page_size: int = 64


class _Timed:
    """An op table whose ``v4_*`` calls are timed per group: on a GPU bracketed by CUDA events
    (no sync: the times are read once, after the run), on the CPU by the clock."""

    def __init__(self, table: Any, cuda: bool) -> None:
        self.table, self.cuda = table, cuda
        self.marks: list[tuple[str, Any, Any]] = []

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.table, name)
        group = _GROUPS.get(name)
        if group is None:
            return fn

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.cuda:
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                self.marks.append((group, t0, time.perf_counter()))
                return out
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn(*args, **kwargs)
            b.record()
            self.marks.append((group, a, b))
            return out
        return timed

    def seconds(self) -> dict[str, float]:
        """Seconds per group (on a GPU: after a synchronize)."""
        out: dict[str, float] = {}
        for group, a, b in self.marks:
            sec = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[group] = out.get(group, 0.0) + sec
        self.marks.clear()
        return out


def op_groups() -> tuple[str, ...]:
    return tuple(sorted(set(_GROUPS.values())))


def stack_flops_v4(model: DeepseekV4, length: int) -> float:
    """FLOPs of the stack's attention part over a prompt of ``length`` tokens: per layer the
    query and window projections, and per query the attention over its window and compressed
    keys (QK and PV), CSA's indexer over its complete index keys; HCA attends every complete
    entry. The MoE and the compressors' projections are left out (small here)."""
    c = model.config
    t = float(length)
    h, d, w = c.num_attention_heads, c.head_dim, c.sliding_window
    proj = 2 * t * (c.hidden_size * c.q_lora_rank + c.q_lora_rank * h * d + c.hidden_size * d
                    + h * d * c.o_lora_rank + c.o_groups * c.o_lora_rank * c.hidden_size)
    total = 0.0
    for i in range(model.num_layers):
        kind = model.layer_kind(i)
        keys = t * w
        if kind == "compressed_sparse_attention":
            m = c.compress_rate_csa
            # sum over queries of min(topk, complete entries) ~ t * topk at long prompts
            keys += sum(min(c.index_topk, (q + 1) // m) for q in range(0, length, 1024)) * 1024
            total += 2 * c.index_n_heads * c.index_head_dim * t * t / (2 * m)
        elif kind == "heavily_compressed_attention":
            keys += t * t / (2 * c.compress_rate_hca)
        total += proj + 4 * h * d * keys
    return total


def v4_long_rank(group: Any, spec: V4LongSpec) -> dict[str, Any]:
    """One GPU: load the stack in bf16 with the ops of ``spec.preference``, prefill each length
    in chunks; per length the seconds, per-group device seconds, peak memory, the chosen
    backends."""
    from cpkv.comm import CPGroup
    from cpkv.models.deepseek_v4 import DeepseekV4
    from cpkv.ops import v4_op_table
    from cpkv.runtime.v4_job import chunk_sizes
    from cpkv.runtime.v4_prefill import v4_prefill_logits

    dev = group.device
    cuda = dev.type == "cuda"
    table = v4_op_table(spec.preference, device_type=dev.type)
    timed = _Timed(table, cuda)
    model = DeepseekV4.load(spec.ckpt, dtype=torch.bfloat16 if cuda else torch.float32,
                            device=dev, ops=cast("KVOps", timed))
    one = CPGroup.single(dev)
    sync = torch.cuda.synchronize if cuda else (lambda d: None)
    out: dict[str, Any] = {"chosen": dict(table.chosen), "runs": {}}
    for n in spec.tokens:
        ids = torch.randint(0, model.config.vocab_size, (n,),
                            generator=torch.Generator().manual_seed(n))
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        sync(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = v4_prefill_logits(model, ids, one, page_size=spec.page_size,
                                       chunks=chunk_sizes(n, spec.chunk))
        sync(dev)
        seconds = time.perf_counter() - t0
        note_progress()
        out["runs"][str(n)] = {
            "tokens": n, "chunk": spec.chunk, "seconds": seconds, "groups": timed.seconds(),
            "peak_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if cuda else 0.0,
            "flops": stack_flops_v4(model, n), "last_argmax": int(logits[-1].argmax())}
        del logits
    return out


def run_v4_long(preset: str, tokens: tuple[int, ...], chunk: int,
                progress: Callable[[str], None] = lambda s: None
                ) -> tuple[list[BenchRow], dict[str, Any], str]:
    """``cpkv bench long --preset v4-*`` on GPU 0: rows, detail, a summary line."""
    import tempfile
    from pathlib import Path

    from cpkv.models import write_tiny_checkpoint
    from cpkv.models.tiny import PRESETS
    from cpkv.runtime import run_ranks

    from .gpu import ceilings
    from .long import SUSTAINED_S

    if preset not in V4_PRESETS:
        raise ValueError(f"preset {preset!r}: the V4 long bench runs {', '.join(V4_PRESETS)}")
    dev = torch.device("cuda", 0)
    ceil = ceilings(dev, sustained_s=SUSTAINED_S)
    device_gb = torch.cuda.get_device_properties(dev).total_memory / 1e9
    stack = dict(PRESETS[preset], max_position_embeddings=max(1048576, *tokens))
    ckpt = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "v4", seed=0, **stack))
    progress(f"{preset}: {list(tokens)} tokens in chunks of {chunk}, bf16")
    res = run_ranks(v4_long_rank, 1, args=(V4LongSpec(ckpt, tokens, chunk),), backend="nccl",
                    timeout_s=3600)[0].value
    rows = v4_long_rows(res, ceil, device_gb, preset)
    longest = max(res["runs"].values(), key=lambda r: r["tokens"]) if res["runs"] else None
    summary = "" if longest is None else (
        f"{preset}: {longest['tokens']} tokens in chunks of {chunk}: {longest['seconds']:.1f} s, "
        f"ops {res['chosen']}")
    return rows, {"ceilings": ceil, "device_gb": device_gb, "preset": preset, **res}, summary


def v4_long_rows(res: dict[str, Any], ceil: dict[str, float], device_gb: float,
                 preset: str) -> list[BenchRow]:
    """The rows of a run (:func:`v4_long_rank`'s result): per length the MFU against the
    sustained fp8 matmul, each op group's seconds against the run's, the peak memory against
    the device's; the model's FP8 KV bytes per token against DeepSeek-V3.2's."""
    from cpkv.models.v4_objects import (
        V3_2_FP8_BYTES_PER_TOKEN,
        V4_FLASH,
        V4_PRO,
        fp8_bytes_per_token,
    )

    from .report import BenchRow

    prefix, rows = V4_PRESETS[preset], []
    sustained = ceil.get("fp8_matmul_sustained_tflops", ceil.get("fp8_matmul_tflops", 0.0))
    for r in res["runs"].values():
        n, s = r["tokens"], r["seconds"]
        if sustained:
            rows.append(BenchRow.of(f"{prefix}long_{n}_mfu", r["flops"] / s / 1e12, "TFLOP/s",
                                    "fp8_matmul_sustained_tflops", sustained))
        for group, g in sorted(r["groups"].items()):
            rows.append(BenchRow.of(f"{prefix}long_{n}_{group}_seconds", g, "s",
                                    f"long_{n}_seconds", s))
        if device_gb:
            rows.append(BenchRow.of(f"{prefix}long_{n}_peak_gb", r["peak_gb"], "GB",
                                    "device_gb", device_gb))
    per_token = fp8_bytes_per_token(V4_FLASH if preset == "v4-flash-attention" else V4_PRO)
    rows.append(BenchRow.of(f"{prefix}kv_bytes_per_token", per_token, "B",
                            "v32_kv_bytes_per_token", V3_2_FP8_BYTES_PER_TOKEN))
    return rows
