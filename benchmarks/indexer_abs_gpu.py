"""A candidate for the next GPU session (issue 38, not measured yet): the fp8 prefill indexer with
``relu(s) = (s + |s|) / 2`` at the plain kernel's registers.

    sum_h w_h relu(s_h) = 1/2 sum_h w_h |s_h| + 1/2 (sum_h w_h q_h) . k

The head loop's epilogue becomes one ``FFMA`` with a ``|R|`` operand a logit (inline ``abs.f32``
+ ``fma.rn.f32``: ptxas folds them) instead of ``FMNMX`` + ``FFMA``; the signed half is two fp8
dots a tile of ``qw = sum_h w_h q_h`` (per row: hi and lo fp8 parts under one power-of-two
scale, ~2^-8 of ``qw`` apart from it), issued into the accumulator **before** the head loop.
Session 16's split kept the signed half in a second accumulator across the loop: 201 registers,
2 CTAs an SM, 0.86x. This order compiles to 168 registers with no spill on the GPU's Triton 3.6
(the plain kernel's; after the loop: 228, accumulating after it: 174), 3 CTAs an SM, and drops
the 64 ``FMNMX`` of every head (SASS: FMNMX 64 -> 0, FFMA 64).

Why it may pay now: on an H100 the indexer runs at the 700 W cap (clock_probe_gpu.py: 1545-1605
MHz, tensor cores busy 56 % of clocks): fewer FP32 instructions a FLOP is less energy a FLOP.
Predicted 1.03-1.10x the plain kernel (the epilogue is ~1/3 of the loop's issue slots; the
power cap gives some of it back as clock). Numerics: ``qw``'s two fp8 parts are ~2^-8 of it
apart, so the logits move by ~4e-4 of the largest (a CPU check, 64 x 2048, DeepSeek's fp8
inputs): more than accumulation order does (~1e-6); near-ties in the top-k may swap, which is a
change to "the model as its authors define it": measure the top-k recall (``topk_set_recall``)
beside the speed before making it a default (a third fp8 part would cost 1/64 more tensor work
for ~2^-12).

Usage (one GPU, .whl carried): python benchmarks/indexer_abs_gpu.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
import triton
import triton.language as tl

from cpkv_backend_triton.attention import AttentionKernels, _key_span, _store_in_range
from cpkv_backend_triton.indexer_tile import key_tile as _key_tile
from cpkv_backend_triton.indexer_tile import qk_dot as _qk_dot

sys.path.insert(0, "benchmarks")
from clock_probe_gpu import Sampler, sustained
from indexer_prefill_sweep_gpu import fp8_inputs, median_ms

SHAPES = ((4096, 131072), (2048, 524288), (1024, 32768), (8192, 65536))


@triton.jit
def _fma_abs(s, w, acc):
    """``acc + |s| * w`` as one FFMA with a ``|R|`` operand."""
    return tl.inline_asm_elementwise(
        "{ .reg .f32 t; abs.f32 t, $1; fma.rn.f32 $0, t, $2, $3; }", "=r,r,r,r",
        [s, w, acc], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _indexer_abs_kernel(q_ptr, w_ptr, k_ptr, scale_ptr, qh_ptr, ql_ptr, sh_ptr,
                        ks_ptr, ke_ptr, out_ptr, N, T,
                        sq0, sq1, sq2, sw0, sw1, sk0, sk1, so0,
                        H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    ks, ke, lo, hi = _key_span(ks_ptr, ke_ptr, rows, rmask)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < T
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if (n0 < hi) & (n0 + BLOCK_N > lo):
        d = tl.arange(0, DP)
        dmask = d < D
        ktt = _key_tile(k_ptr, q_ptr, cols64, cmask, d, dmask, sk0, sk1, False)
        qmask = rmask[:, None] & dmask[None, :]
        # the signed half first: (hi + lo) . k, times the row's scale (w's 1/2 folded in)
        qwh = tl.load(qh_ptr + rows64[:, None] * D + d[None, :], mask=qmask, other=0.0)
        acc = tl.dot(qwh, ktt, acc)
        qwl = tl.load(ql_ptr + rows64[:, None] * D + d[None, :], mask=qmask, other=0.0)
        acc = tl.dot(qwl, ktt, acc)
        sh = tl.load(sh_ptr + rows64, mask=rmask, other=0.0)
        acc = acc * sh[:, None]
        qbase = q_ptr + rows64[:, None] * sq0 + d[None, :] * sq2
        for h in range(H):
            qh = tl.load(qbase + h * sq1, mask=qmask, other=0.0)
            wh = tl.load(w_ptr + rows64 * sw0 + h * sw1, mask=rmask, other=0.0)
            s = _qk_dot(qh, ktt, False, 0)
            acc = _fma_abs(s, tl.broadcast_to(wh[:, None], [BLOCK_M, BLOCK_N]), acc)
        c = tl.load(scale_ptr + cols64, mask=cmask, other=0.0)
        acc = acc * c[None, :]
    _store_in_range(out_ptr, acc, rows, rmask, cols, cmask, ks, ke, so0)


def split_inputs(q8: torch.Tensor, w: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hi, lo, scale / 2, w / 2): ``qw = sum_h w_h q_h ~ scale * (hi + lo)``, fp8 hi and lo
    under one power-of-two scale per row (exact halvings: the 1/2 of the identity)."""
    qw = torch.einsum("nh,nhd->nd", w.float(), q8.float())
    amax = qw.abs().amax(1).clamp_min(1e-30)
    sh = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    hi = (qw / sh[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    lo = ((qw - hi.float() * sh[:, None]) / sh[:, None]).to(torch.float8_e4m3fn)
    return hi.contiguous(), lo.contiguous(), (sh * 0.5).contiguous(), (w * 0.5).contiguous()


def abs_logits(q8: torch.Tensor, w: torch.Tensor, k8: torch.Tensor, scale: torch.Tensor,
               ks: torch.Tensor, ke: torch.Tensor, parts: tuple[torch.Tensor, ...]
               ) -> torch.Tensor:
    n, heads, d = q8.shape
    t = k8.shape[0]
    hi, lo, sh, w2 = parts
    out = torch.empty(n, t, dtype=torch.float32, device=q8.device)
    grid = (triton.cdiv(t, 128), triton.cdiv(n, 64))
    _indexer_abs_kernel[grid](q8, w2, k8, scale, hi, lo, sh, ks, ke, out, n, t,
                              q8.stride(0), q8.stride(1), q8.stride(2), w2.stride(0),
                              w2.stride(1), k8.stride(0), k8.stride(1), out.stride(0),
                              H=heads, D=d, DP=d, BLOCK_M=64, BLOCK_N=128,
                              num_warps=4, num_stages=3)
    return out


def _shape(ak: AttentionKernels, n: int, t: int, dev: torch.device, g: torch.Generator,
           sampler: Sampler) -> dict[str, object]:
    q8, w8, k8, sc, ks, ke = fp8_inputs(n, t, dev, g)
    flops = 2 * 64 * 128 * float((ke - ks).sum())
    parts = split_inputs(q8, w8)
    want = ak.indexer_logits(q8, w8, k8, sc, ks, ke)
    got = abs_logits(q8, w8, k8, sc, ks, ke, parts)
    fin = want.isfinite()
    diff = float((got[fin] - want[fin]).abs().max() / want[fin].abs().max())
    k = min(2048, t)
    a = torch.topk(got.nan_to_num(neginf=-3e38), k, 1).indices
    b = torch.topk(want.nan_to_num(neginf=-3e38), k, 1).indices
    inter = (torch.zeros_like(got, dtype=torch.int8).scatter_(1, a, 1)
             * torch.zeros_like(got, dtype=torch.int8).scatter_(1, b, 1)).sum(1)
    recall = float(inter.float().mean() / k)
    del want, got, a, b
    torch.cuda.empty_cache()

    def plain() -> torch.Tensor:
        return ak.indexer_logits(q8, w8, k8, sc, ks, ke)

    def split() -> torch.Tensor:
        return abs_logits(q8, w8, k8, sc, ks, ke, parts)

    plain_ms, abs_ms = median_ms(plain), median_ms(split)
    row: dict[str, object] = {
        "shape": f"{n}x{t}", "plain_ms": plain_ms, "abs_ms": abs_ms,
        "prep_ms": median_ms(lambda: split_inputs(q8, w8)), "plain_over_abs": plain_ms / abs_ms,
        "abs_tflops": flops / abs_ms / 1e9, "max_rel_diff": diff, "topk_set_recall": recall}
    if (n, t) == (4096, 131072):
        row["plain_sustained"] = sustained(plain, 4.0, sampler)
        row["abs_sustained"] = sustained(split, 4.0, sampler)
    return row


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    ak = AttentionKernels()
    sampler = Sampler()
    rows = []
    for n, t in SHAPES:
        row = _shape(ak, n, t, dev, g, sampler)
        print(json.dumps(row), flush=True)
        rows.append(row)
    sampler.stop()
    with open(sys.argv[1], "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("median over shapes of plain / abs:",
          statistics.median(float(r["plain_over_abs"]) for r in rows))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
