"""The prefill indexer's launch sweep: decides the ``INDEXER`` tuning row's tile (BLOCK_M x
BLOCK_N, warps, stages) of the Triton fp8 indexer (DeepSeek-V3.2's numerics: 64 heads x 128,
rotated ue8m0 keys, fp8 queries, causal tail rows) at 4096 x 128K, 2048 x 512K and 1024 x 32K.
Every configuration is timed (CUDA events, median of 10 after a warm call) on the same inputs
and checked against the default's logits; the fp8 matmul ceiling is measured in the same run.
``small``: 64 x 64 tiles (fewer registers, more CTAs an SM) against the default.

Command: bash benchmarks/gpu.sh OUT indexer_sweep
         (python benchmarks/indexer_sweep_gpu.py OUT.json [small])
Card: one GPU with fp8 tensor cores (the table's row: docs/perf.md "Tuning sweeps").
Writes: OUT.json {gpu, fp8_ceiling_tflops, shapes: {NxT: [{config, ms, tflops,
        max_rel_diff_vs_default, same_masking}]}}.
"""

from __future__ import annotations

import json
import sys

import torch

from cpkv.bench.timing import median_ms
from cpkv.fallback import recording
from cpkv.ops.api import hadamard_rotate, quantize_fp8, quantize_index_q
from cpkv_backend_triton.attention import AttentionKernels

SHAPES = ((4096, 131072), (2048, 524288), (1024, 32768))
CONFIGS: tuple[dict[str, int], ...] = (
    {},  # the default
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 256, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 2},
)
#: 64-key tiles at 128 registers (4 CTAs an SM against the default's 3 at 168), twice the L2
#: reads of the query tiles a logit
SMALL_CONFIGS: tuple[dict[str, int], ...] = (
    {},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
)


def fp8_ceiling(dev: torch.device) -> float:
    n = 8192
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    ms = median_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16),
                   warmup=1, iters=10)
    return 2 * n ** 3 / ms / 1e9


def fp8_inputs(n: int, t: int, dev: torch.device, g: torch.Generator,
               heads: int = 64, dim: int = 128) -> tuple[torch.Tensor, ...]:
    """DeepSeek-V3.2's fp8 indexer inputs for the last ``n`` rows of a ``t``-token prompt:
    (q8, w8, k8, scale, key_start, key_end) (rotated ue8m0 keys, fp8 queries with their
    scales in the head weights, causal ranges from key 0)."""
    q = hadamard_rotate(torch.randn(n, heads, dim, dtype=torch.bfloat16, device=dev, generator=g))
    w = torch.randn(n, heads, device=dev, generator=g) * (heads ** -0.5 * dim ** -0.5)
    k = hadamard_rotate(torch.randn(t, dim, dtype=torch.bfloat16, device=dev, generator=g))
    k8, scale = quantize_fp8(k, None, "ue8m0")
    q8, w8 = quantize_index_q(q, w)
    ks = torch.zeros(n, dtype=torch.int64, device=dev)
    ke = torch.arange(t - n + 1, t + 1, dtype=torch.int64, device=dev)
    return q8, w8, k8, scale, ks, ke


def sweep_shape(n: int, t: int, dev: torch.device, g: torch.Generator,
                configs: tuple[dict[str, int], ...] = CONFIGS) -> list[dict[str, object]]:
    """Every configuration on one shape's inputs."""
    heads, dim = 64, 128
    q8, w8, k8, scale, ks, ke = fp8_inputs(n, t, dev, g, heads, dim)
    flops = 2 * heads * dim * float((ke - ks).sum())
    base = None
    rows: list[dict[str, object]] = []
    for cfg in configs:
        ak = AttentionKernels(indexer_config=cfg)

        def call(ak: AttentionKernels = ak) -> torch.Tensor:
            return ak.indexer_logits(q8, w8, k8, scale, ks, ke)

        try:
            with recording() as rec:
                got = call()
            ms = median_ms(call, warmup=1, iters=10)
        except Exception as e:  # a tile that does not compile: recorded, next one
            rows.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        if base is None:
            base = got
        fin = base.isfinite()
        diff = float((got[fin] - base[fin]).abs().max() / base[fin].abs().max())
        rows.append({"config": cfg, "ms": ms, "tflops": flops / ms / 1e9,
                     "max_rel_diff_vs_default": diff,
                     "fallbacks": [e.detail for e in rec.events],
                     "same_masking": bool(torch.equal(got.isneginf(), base.isneginf()))})
        print(f"{n}x{t} {cfg or 'default'}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s "
              f"diff {diff:.2e}", flush=True)
        del got
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    out = sys.argv[1]
    configs = {"small": SMALL_CONFIGS}.get(
        sys.argv[2] if len(sys.argv) > 2 else "", CONFIGS)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    shapes: dict[str, list[dict[str, object]]] = {}
    ceiling = fp8_ceiling(dev)
    for n, t in SHAPES:
        shapes[f"{n}x{t}"] = sweep_shape(n, t, dev, g, configs)
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "fp8_ceiling_tflops": ceiling,
                   "shapes": shapes}, f, indent=1)
    print(f"fp8 ceiling {ceiling:.0f} TFLOP/s; wrote {out}")


if __name__ == "__main__":
    main()
