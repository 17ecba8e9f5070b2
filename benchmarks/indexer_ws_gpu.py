"""The warp-specialized ping-pong prefill indexer (``cpkv_backend_triton.indexer_ws``) against the
default Triton kernel and DeepGEMM's ``fp8_fp4_mqa_logits`` on one GPU (issue 38, item 2).

Usage: python benchmarks/indexer_ws_gpu.py OUT.json [ws]

Same inputs as ``cpkv_backend_cuda.bench`` (DeepSeek-V3.2's fp8 numerics: 64 heads x 128,
rotated ue8m0 keys, the last ``n`` rows of a ``t``-token prompt); per shape: the Triton op, the
DeepGEMM op and its kernel alone, every ``VARIANTS`` launch of the warp-specialized kernel (into
a preallocated output, like DeepGEMM's kernel alone: the op's allocation is ~free). Each is
checked against the Triton op's logits first (max difference over the largest logit, -inf at
the same places). CUDA events, median of 10 after a warm call; the fp8 ceiling in the same run.

Prediction (session 16, ``ws``: the warp-specialized launches): the Triton kernel's only
overlap of tensor cores and head sums is between the 2 CTAs an SM holds; here two warpgroups
take turns on the tensor cores and share each head's query tile (half the L2 reads a logit).
Ping-pong 1.10-1.25x the Triton kernel at 4Kx128K / 8Kx64K / 2Kx512K (DeepGEMM ~0.96x the
Triton kernel on the H100), ~1.0 at 1Kx32K (256-key programs: 2048 programs, 15 waves).
Without the turns ~1.0-1.1x.
Measured (results/session16/indexer_ws_h100.json): bit-equal to the Triton kernel; ping-pong
0.93x the Triton kernel (geomean), without the turns 1.00x: neither the L2 reads nor the
overlap of the two CTAs an SM holds is what limits it.

Default variants (session 16, the Triton kernel's ``SPLIT``): the head loop's SASS is 140
instructions a head a warp against 203 (64 FFMA with ``|s|`` folded in, where ``relu`` costs 64
FMNMX + 64 FFMA); predicted 1.10-1.25x the default at the large shapes if the CUDA cores'
issue is what limits the kernel, ~1.0 if it is the tensor cores; the max difference from the
default ~1e-5 of the largest logit (a different summation), -inf at the same places. UNROLL 2
(two heads an iteration): 118 instructions a head with SPLIT (232 registers): another ~1.1x.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from typing import Any

import torch

from cpkv.ops.api import hadamard_rotate, quantize_fp8, quantize_index_q
from cpkv_backend_triton.attention import AttentionKernels
from cpkv_backend_triton.indexer_ws import ws_indexer_declines, ws_indexer_logits

SHAPES = ((1024, 32768), (4096, 131072), (8192, 65536), (2048, 524288))
#: a variant with "triton" is the Triton op at that indexer config (tuning fields), else a launch
#: of the warp-specialized kernel (``ws_indexer_logits``' keywords)
VARIANTS: tuple[dict[str, Any], ...] = (
    {"triton": 1, "SPLIT": 1},
    {"triton": 1, "SPLIT": 1, "UNROLL": 2},
    {"triton": 1, "UNROLL": 2},
    {"triton": 1, "SPLIT": 1, "num_stages": 4},
    {"triton": 1, "SPLIT": 1, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8},
    {"triton": 1, "SPLIT": 1, "BLOCK_M": 64, "BLOCK_N": 256, "num_warps": 8},
    {"pingpong": False, "stages": 4},
)
if sys.argv[2:] == ["ws"]:  # session 16's first sweep: the warp-specialized launches
    VARIANTS = (
        {"pingpong": True, "stages": 4},
        {"pingpong": False, "stages": 4},
        {"pingpong": True, "stages": 2},
        {"pingpong": True, "stages": 6},
        {"pingpong": True, "stages": 4, "block_n": 64},
        {"pingpong": True, "stages": 4, "consumer_regs": 224, "maxnreg": 160},
    )


def median_ms(fn: Any, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def fp8_ceiling(dev: torch.device) -> float:
    n = 8192
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    ms = median_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return 2 * n ** 3 / ms / 1e9


def _deepgemm() -> Any:
    try:
        from cpkv_backend_cuda.plugin import deepgemm_ops

        return deepgemm_ops()
    except Exception as exc:  # absent: the rows say so
        return f"{type(exc).__name__}: {exc}"


def shape_rows(n: int, t: int, dev: torch.device, g: torch.Generator, dg: Any) -> dict[str, Any]:
    heads, dim = 64, 128
    q = hadamard_rotate(torch.randn(n, heads, dim, dtype=torch.bfloat16, device=dev, generator=g))
    w = torch.randn(n, heads, device=dev, generator=g) * (heads ** -0.5 * dim ** -0.5)
    k = hadamard_rotate(torch.randn(t, dim, dtype=torch.bfloat16, device=dev, generator=g))
    k8, scale = quantize_fp8(k, None, "ue8m0")
    q8, w8 = quantize_index_q(q, w)
    del q, k
    ks = torch.zeros(n, dtype=torch.int64, device=dev)
    ke = torch.arange(t - n + 1, t + 1, dtype=torch.int64, device=dev)
    flops = 2 * heads * dim * float((ke - ks).sum())
    ak = AttentionKernels()
    base = ak.indexer_logits(q8, w8, k8, scale, ks, ke)
    fin = base.isfinite()
    big = float(base[fin].abs().max())
    res: dict[str, Any] = {"flops": flops}
    tri_ms = median_ms(lambda: ak.indexer_logits(q8, w8, k8, scale, ks, ke))
    res["triton"] = {"ms": tri_ms, "tflops": flops / tri_ms / 1e9}
    if isinstance(dg, str):
        res["deepgemm"] = {"absent": dg}
    else:
        ks32, ke32 = ks.to(torch.int32), ke.to(torch.int32)
        op = median_ms(lambda: dg.indexer_logits(q8, w8, k8, scale, ks, ke))
        kern = median_ms(lambda: dg.compressed_logits(q8, w8, k8, scale, ks32, ke32))
        res["deepgemm"] = {"ms": op, "kernel_ms": kern, "tflops": flops / op / 1e9}
    why = ws_indexer_declines(q8, k8, scale, 64)
    out = torch.empty(n, t, dtype=torch.float32, device=dev)
    for v in VARIANTS:
        name = ",".join(f"{a}={b}" for a, b in v.items())
        if why is not None and "triton" not in v:
            res[name] = {"declined": why}
            continue
        try:
            tk = (AttentionKernels(indexer_config={a: b for a, b in v.items() if a != "triton"})
                  if "triton" in v else None)

            def call(v: dict[str, Any] = v, tk: AttentionKernels | None = tk) -> torch.Tensor:
                if tk is not None:
                    return tk.indexer_logits(q8, w8, k8, scale, ks, ke)
                ws_indexer_logits(q8, w8, k8, scale, ks, ke, out, **v)
                return out
            out.fill_(float("nan"))
            got = call()
            torch.cuda.synchronize()
            same_mask = bool(torch.equal(got.isneginf(), base.isneginf()))
            diff = float((got[fin] - base[fin]).abs().max()) / big
            nan = bool(got.isnan().any())
            del got
            ms = median_ms(call)
        except Exception as exc:  # a launch that does not compile or run: recorded
            res[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"{n}x{t} {name}: {res[name]['error']}", flush=True)
            continue
        res[name] = {"ms": ms, "tflops": flops / ms / 1e9, "vs_triton": tri_ms / ms,
                     "max_rel_diff": diff, "same_mask": same_mask, "nan": nan}
        if "ms" in res["deepgemm"]:
            res[name]["vs_deepgemm"] = res["deepgemm"]["ms"] / ms
        print(f"{n}x{t} {name}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s x{tri_ms / ms:.3f} "
              f"of triton diff {diff:.1e} mask {same_mask} nan {nan}", flush=True)
    print(f"{n}x{t} triton {tri_ms:.3f} ms {flops / tri_ms / 1e9:.0f} TFLOP/s; deepgemm "
          f"{res['deepgemm']}", flush=True)
    return res


def main() -> None:
    out = sys.argv[1]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    dg = _deepgemm()
    ceiling = fp8_ceiling(dev)
    shapes = {}
    for n, t in SHAPES:
        shapes[f"{n}x{t}"] = shape_rows(n, t, dev, g, dg)
        torch.cuda.empty_cache()
    geo: dict[str, float] = {}
    for v in VARIANTS:
        name = ",".join(f"{a}={b}" for a, b in v.items())
        for key in ("vs_triton", "vs_deepgemm"):
            vals = [s[name][key] for s in shapes.values() if key in s.get(name, {})]
            if len(vals) == len(SHAPES):
                geo[f"{name} {key}"] = math.exp(sum(map(math.log, vals)) / len(vals))
    for key, val in geo.items():
        print(f"geomean {key}: {val:.3f}")
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "fp8_ceiling_tflops": ceiling,
                   "geomean": geo, "shapes": shapes}, f, indent=1)
    print(f"fp8 ceiling {ceiling:.0f} TFLOP/s; wrote {out}")


if __name__ == "__main__":
    main()
