"""Benchmark of the Triton sparse-attention kernels against the torch reference (issue #5).

``bench_attention(device, small=False) -> list[dict]``, one dict per measurement:

(a) indexer logits, 1024 query rows x 32K keys x 64 heads x 128 (bf16 and fp8 keys): causal
    ranges of a CP rank holding the LAST 1024 rows of a 32K prompt (long ranges), and the full
    rectangle; ms (CUDA events, warm-up, median of >= 10), TFLOP/s over the FLOPs inside the
    ranges (``2*H*D + 3*H`` per (row, key in range)), speedup over the reference;
(b) sparse MLA, 1024 queries x 128 heads x 576/512, top-2048 random valid indices over a 64K-key
    view: ms, TFLOP/s (``2*N*H*k*(576+512)``), vs the reference; one row per P mode (the default
    fp16 x 2 concatenated, bf16 x 3 chained: both within the contract; bf16 x 1 as FlashMLA: not);
(c) top-k 2048 over 1024 x 32K fp32 logits: ms of the exact radix kernel, of the old
    torch.topk path (``torch_path_ms``) and of torch.topk alone, exactness against the reference;
(d) the bf16 dense matmul 8192^3 ceiling (TFLOP/s), measured in the same run;
(e) ``rope``: the MLA query's rotation (64K rows x 128 heads x 64 rope dims, a strided slice of
    the q projection, written into the rope columns of the absorbed query) and the indexer's
    (in place, 64 heads): ms of the kernel and of the torch reference, GB/s of the bytes moved;
(f) the indexer at a decode step's few rows (1-64 rows x 64K fp8 keys x 64 heads x 128, bf16
    queries, causal ranges ending at the last key): GPU ms of the row-tile kernel and of the
    few-rows kernel, which the default picks at most ``FEW_ROWS`` rows.

``small=True`` runs everything tiny (CPU under ``TRITON_INTERPRET=1``: a smoke test; timings there
are meaningless). ``sweep=True`` adds rows for alternative launch configurations.
Each row carries ``max_abs_diff`` against the reference where one was run.

Run: ``python -m cpkv_backend_triton.bench_attention [--small] [--sweep] [--device cuda]``
(prints one JSON object per line).
"""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any

import torch

from cpkv.bench.timing import device_ms, median_ms
from cpkv.ops.api import RopeStyle, quantize_fp8
from cpkv_backend_triton import rope as rope_mod
from cpkv_backend_triton.attention import AttentionKernels

__all__ = ["bench_attention"]


def _ref() -> Any:
    from cpkv.testing.conformance import reference_backend
    return reference_backend()


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    fin = b.isfinite()
    if not bool(fin.any()):
        return 0.0
    if not torch.equal(a.isneginf(), b.isneginf()):
        return float("inf")
    return float((a[fin].double() - b[fin].double()).abs().max())


def bench_attention(device: str, small: bool = False, sweep: bool = False,
                    reps: int = 10, warmup: int = 3) -> list[dict[str, Any]]:
    """Measure (a)-(d) of the module docstring on ``device``; see there."""
    dev = torch.device(device)
    ref = _ref()
    ker = AttentionKernels()
    rows: list[dict[str, Any]] = []
    g = torch.Generator(device="cpu").manual_seed(0)
    if small:
        reps, warmup = min(reps, 2), 1
        n, t, heads, d = 8, 96, 4, 32
        mla_n, mla_h, mla_t, topk_k = 4, 16, 300, 64
        mm = 256
    else:
        n, t, heads, d = 1024, 32768, 64, 128
        mla_n, mla_h, mla_t, topk_k = 1024, 128, 65536, 2048
        mm = 8192
    tm = lambda fn: median_ms(fn, device, warmup, reps)  # noqa: E731

    # (d) matmul ceiling
    a = torch.randn(mm, mm, generator=g).to(dev, torch.bfloat16)
    b = torch.randn(mm, mm, generator=g).to(dev, torch.bfloat16)
    ms = tm(lambda: a @ b)
    rows.append({"bench": "matmul_bf16", "shape": f"{mm}^3", "ms": ms,
                 "tflops": 2 * mm ** 3 / ms / 1e9})

    # (a) indexer logits
    q = (torch.randn(n, heads, d, generator=g)).to(dev, torch.bfloat16)
    w = (torch.randn(n, heads, generator=g) * (heads * d) ** -0.5).to(dev)
    kf = torch.randn(t, d, generator=g).to(dev)
    k8, sc = quantize_fp8(kf)
    pos = torch.arange(t - n, t, device=dev, dtype=torch.int64)  # the prompt's last n rows
    ranges = {"causal": (torch.zeros_like(pos), pos + 1),
              "full": (torch.zeros_like(pos), torch.full_like(pos, t))}
    icfgs: list[dict[str, int]] = [{}]
    if sweep:
        icfgs += [{"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4},
                  {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8},
                  {"BLOCK_M": 64, "BLOCK_N": 256, "num_warps": 8},
                  {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4}]
    for kind, keys, scale in (("bf16", kf.to(torch.bfloat16), None), ("fp8", k8, sc)):
        for rname, (ks, ke) in ranges.items():
            pairs = float((ke - ks).sum())
            flops = pairs * (2 * heads * d + 3 * heads)
            want = ref.indexer_logits(q, w, keys, scale, ks, ke)
            ref_ms = tm(lambda keys=keys, scale=scale, ks=ks, ke=ke: ref.indexer_logits(
                q, w, keys, scale, ks, ke))
            for cfg in icfgs:
                kk = AttentionKernels(indexer_config=cfg) if cfg else ker
                try:
                    got = kk.indexer_logits(q, w, keys, scale, ks, ke)
                    ms = tm(lambda kk=kk, keys=keys, scale=scale, ks=ks, ke=ke: kk.indexer_logits(
                        q, w, keys, scale, ks, ke))
                except Exception as exc:  # a config that does not compile is a row, not a crash
                    rows.append({"bench": "indexer_logits", "keys": kind, "ranges": rname,
                                 "config": kk.indexer_config, "error": repr(exc)[:300]})
                    continue
                rows.append({"bench": "indexer_logits", "keys": kind, "ranges": rname,
                             "shape": f"{n}x{t}x{heads}x{d}", "config": kk.indexer_config,
                             "ms": ms, "tflops": flops / ms / 1e9, "ref_ms": ref_ms,
                             "ref_tflops": flops / ref_ms / 1e9, "speedup": ref_ms / ms,
                             "max_abs_diff": _diff(got, want)})

    # (c) top-k: the radix kernel (default), the old torch.topk path, torch.topk alone
    ks, ke = ranges["causal"]
    logits = ker.indexer_logits(q, w, kf.to(torch.bfloat16), None, ks, ke)
    want = ref.topk(logits, topk_k, ks, ke)
    got = ker.topk(logits, topk_k, ks, ke)
    old = AttentionKernels(topk_method="torch")
    got_old = old.topk(logits, topk_k, ks, ke)
    ms = tm(lambda: ker.topk(logits, topk_k, ks, ke))
    old_ms = tm(lambda: old.topk(logits, topk_k, ks, ke))
    ref_ms = tm(lambda: ref.topk(logits, topk_k, ks, ke))
    tk_ms = tm(lambda: torch.topk(logits, topk_k, dim=1))
    rows.append({"bench": "topk", "shape": f"{n}x{t} k={topk_k}", "ms": ms, "ref_ms": ref_ms,
                 "torch_path_ms": old_ms, "torch_topk_ms": tk_ms, "speedup": ref_ms / ms,
                 # the reference's set (the kernels list it in their own order)
                 "exact": bool(torch.equal(got.sort(1).values, want.sort(1).values)),
                 "exact_rows": int((got.sort(1).values == want.sort(1).values).all(1).sum()),
                 "rows": int(got.shape[0]),
                 "torch_path_same_set_fraction": float(
                     (got_old.sort(1).values == want.sort(1).values).float().mean())})

    # (f) the indexer at a few rows: both kernels
    ft = 700 if small else 65536
    kf2 = torch.randn(ft, d, generator=g).to(dev)
    k82, sc2 = quantize_fp8(kf2)
    tile = AttentionKernels(indexer_config={"FEW_ROWS": 0})
    few = AttentionKernels(indexer_config={"FEW_ROWS": 1 << 30})
    for fn in (1, 2, 8) if small else (1, 2, 4, 8, 16, 32, 64):
        qf = torch.randn(fn, heads, d, generator=g).to(dev, torch.bfloat16)
        wf = (torch.randn(fn, heads, generator=g) * (heads * d) ** -0.5).to(dev)
        fpos = torch.arange(ft - fn, ft, device=dev, dtype=torch.int64)
        fks, fke = torch.zeros_like(fpos), fpos + 1
        want = ref.indexer_logits(qf, wf, k82, sc2, fks, fke)
        row: dict[str, Any] = {"bench": "indexer_few_rows", "rows": fn, "keys": ft}
        for name, kk in (("row_tile", tile), ("few_rows", few)):
            got = kk.indexer_logits(qf, wf, k82, sc2, fks, fke)
            # GPU time (the host's launch work hidden: at a few rows it exceeds the kernel's)
            row[f"{name}_ms"] = (tm if small else device_ms)(
                functools.partial(kk.indexer_logits, qf, wf, k82, sc2, fks, fke))
            row[f"{name}_max_abs_diff"] = _diff(got, want)
        row["speedup"] = row["row_tile_ms"] / row["few_rows_ms"]
        rows.append(row)

    # (e) rope: MLA query into the absorbed query's rope columns; indexer query in place
    rn = 64 if small else 65536
    rk = rope_mod.RopeKernels()
    qp = torch.randn(rn, 128 if not small else 4, 192, generator=g).to(dev, torch.bfloat16)
    ang = torch.rand(rn, 32, generator=g) * 100
    cs = torch.cat([ang.cos(), ang.cos()], 1).to(dev, torch.bfloat16)
    sn = torch.cat([ang.sin(), ang.sin()], 1).to(dev, torch.bfloat16)
    qo = torch.empty(qp.shape[0], qp.shape[1], 576, device=dev, dtype=torch.bfloat16)
    iq = torch.randn(rn, 64 if not small else 4, 128, generator=g).to(dev, torch.bfloat16)
    blocks = [rk.block] + ([b for b in (4, 8, 32, 64) if b != rk.block] if sweep else [])
    rope_cases: tuple[tuple[str, torch.Tensor, torch.Tensor, RopeStyle], ...] = (
        ("mla_q", qp[..., 128:], qo[..., 512:], "interleave"),
        ("indexer_q", iq[..., :64], iq[..., :64], "half"))
    for what, x, out, style in rope_cases:
        # values first: the timed in-place calls rotate x again and again
        want = ref.rope(x.clone(), cs, sn, style)
        by_block: dict[int, torch.Tensor] = {}
        for blk in blocks:
            rk.block = blk
            by_block[blk] = rk.rope(x.clone(), cs, sn, style)
        ref_ms = tm(lambda x=x, out=out, style=style: ref.rope(x, cs, sn, style, out))
        nbytes = 2 * x.numel() * x.element_size()
        for blk in blocks:
            rk.block = blk
            ms = tm(lambda x=x, out=out, style=style: rk.rope(x, cs, sn, style, out))
            rows.append({"bench": "rope", "what": what, "shape": list(x.shape), "block": blk,
                         "ms": ms, "ref_ms": ref_ms, "speedup": ref_ms / ms,
                         "gbps": nbytes / ms / 1e6, "max_abs_diff": _diff(by_block[blk], want)})

    # (b) sparse MLA
    qm = torch.randn(mla_n, mla_h, 576, generator=g).to(dev, torch.bfloat16)
    kv = torch.randn(mla_t, 576, generator=g).to(dev, torch.bfloat16)
    idx = torch.randint(0, mla_t, (mla_n, topk_k), generator=g, dtype=torch.int32).to(dev)
    smscale = 576 ** -0.5
    flops = 2.0 * mla_n * mla_h * topk_k * (576 + 512)
    want = ref.sparse_mla(qm, kv, idx, smscale, 512)
    ref_ms = tm(lambda: ref.sparse_mla(qm, kv, idx, smscale, 512))
    exact = {"P_SPLIT": 3, "P_FP16": 0, "P_CAT": 0}
    mcfgs: list[dict[str, int]] = [{}, {**exact, "BLOCK_K": 64},
                                   {"P_SPLIT": 1, "P_CAT": 0, "P_FP16": 0, "BLOCK_K": 64}]
    if sweep:
        mcfgs += [{"BLOCK_K": 64}, {"BLOCK_K": 64, "num_stages": 1}, {"num_stages": 3},
                  {"BLOCK_K": 16}, {"num_warps": 4}, {**exact, "BLOCK_H": 32, "num_warps": 4},
                  {"P_SPLIT": 1, "P_CAT": 0, "P_FP16": 0, "BLOCK_K": 64, "num_stages": 1}]
    for cfg in mcfgs:
        kk = AttentionKernels(mla_config=cfg, mla_precision="exact") if cfg else ker
        try:
            got = kk.sparse_mla(qm, kv, idx, smscale, 512)
            ms = tm(lambda kk=kk: kk.sparse_mla(qm, kv, idx, smscale, 512))
        except Exception as exc:
            rows.append({"bench": "sparse_mla", "config": kk.mla_config, "error": repr(exc)[:300]})
            continue
        rows.append({"bench": "sparse_mla", "shape": f"{mla_n}x{mla_h}x576/512 k={topk_k} "
                     f"T={mla_t}", "config": kk.mla_config, "ms": ms, "tflops": flops / ms / 1e9,
                     "ref_ms": ref_ms, "ref_tflops": flops / ref_ms / 1e9,
                     "speedup": ref_ms / ms, "max_abs_diff": _diff(got, want)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    for row in bench_attention(args.device, small=args.small, sweep=args.sweep, reps=args.reps):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
