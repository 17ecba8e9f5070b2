"""The lightning indexer and the top-k in one pass over the keys, for long rows (issue 38): the
[N, T] logits are never stored.

At 512K keys a 64K-row chunk's logits are 128 GB written by the indexer and read back by the
top-k (:mod:`cpkv_backend_triton.topk`'s long-row path: a sampled floor, a filter, a select). Here
the indexer's epilogue does the filter:

1. **Sample** (:func:`indexer_topk`'s ``sample_logits``, the plain indexer op): the logits of
   every row at ``SAMPLE`` columns spread evenly over the T keys (the columns ``i * stride``, one
   grid for all rows, so the indexer's row tiles share their key tiles): N x SAMPLE floats.
2. **Floor** (``_sample_floor_kernel``, one program per row holding more than k keys): the rule
   of ``topk._topk_floor_kernel``: with ``m`` of the row's range among the sample, the k-th
   largest key is expected near sample place ``est = k * m / count``; the floor is the sample
   key ``4 sqrt(est + 1) + 8`` places further down (every key when the sample has no such
   place), found by a radix select over the sample (4 histograms of 8 bits) instead of a sort.
3. **Filter** (``_fused_filter_kernel``, program (split of CS columns, block of BLOCK_M rows)):
   the indexer's tiles of the split in column order, each computed as ``attention._indexer_kernel``
   computes it (the same per-head dots, relu, weight and scale, in the same order: the same
   logits); the keys at or above their row's floor are written as candidates (int64 ``key << 32
   | (2^31 - 1 - column)``, in column order: a ``cumsum`` over the tile's mask, a running count
   per row) into the (row, split)'s CAP slots.
4. **Select** (``topk.select_candidates``): the exact k of the candidates (radix select, ties by
   the lower column); a row with fewer than k candidates (its floor was above its k-th key) or
   a split over CAP is flagged.
5. **Exact** (``_fused_exact_kernel``, one program per row, only flagged rows work): the row's
   logits recomputed tile by tile (all heads in one dot) in each of a radix select's 4 rounds
   and the final pass: exact, never stored. It costs ~5 indexer passes over one row on one SM,
   so a misleading sample costs time (rare: the floor sits 4 standard deviations low), never
   the result.

Rows holding at most k keys list their range ascending. The result is the set ``topk(
indexer_logits(...))`` chooses from this backend's logits; only a flagged row's logits may
differ in the last bits (its dot has another shape), so its ties at the k-th place may resolve
like the reference's rather than like the plain path's.

The split count and CAP come from the shapes only (:func:`layout`): enough (split, row block)
programs to fill the GPU, CAP a few times the candidates a split expects, the scratch within a
fraction of the logits' bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .topk import ord_key, radix_digit, radix_step, row_range, select_candidates

__all__ = ["INDEXER_TOPK", "FusedLayout", "indexer_topk", "layout"]

#: the fused path: rows of at least MIN_T keys (the view's T; shorter calls take the indexer and
#: the top-k as two ops); SAMPLE columns place the floor; a split's CAP a power of two at least
#: SAFETY x the candidates it expects and ROW_SHARE_PCT % of the whole row's (candidates that
#: crowd one split, as a recency bias would, overflow it less often), within [CAP_MIN,
#: CAP_MAX]; PROGRAMS (split, row block)
#: programs wanted, splits of at least SPLIT_MIN columns; the candidates' scratch at most
#: 1 / SCRATCH_DIV of the logits' bytes (or SCRATCH_MB); the filter's tiles (BLOCK_M x BLOCK_N,
#: as the indexer's), warps and stages; the exact pass's key tile and warps.
#: MIN_T is off (2^40 keys): measured on the H200 (benchmarks/session11_topk_gpu.sh,
#: benchmarks/results/indexer_topk_h200.json, docs/perf.md) the fused path picks the plain path's
#: sets exactly but takes 1.03-1.08x its time at 1024x512K, 4096x256K and 8192x512K (its filter
#: epilogue costs more than the logits' store and read it saves), so no view takes it by default;
#: set MIN_T (e.g. 196608, the long-row top-k's) to opt in. SAMPLE is the long-row top-k's
#: (``topk.TOPK_LONG``), the tiles the indexer's (``attention.INDEXER_DEFAULT``)
INDEXER_TOPK: dict[str, int] = {"MIN_T": 1 << 40, "SAMPLE": 4096, "SAFETY": 4,
                                "ROW_SHARE_PCT": 50, "CAP_MIN": 1024, "CAP_MAX": 16384,
                                "PROGRAMS": 1024, "SPLIT_MIN": 16384, "SCRATCH_DIV": 4,
                                "SCRATCH_MB": 512, "BLOCK_M": 64,
                                "BLOCK_N": 128, "num_warps": 4, "num_stages": 3,
                                "EXACT_BLOCK_N": 128, "exact_warps": 4}

_INT32_MIN = -(2 ** 31)


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


# ---- kernels ---------------------------------------------------------------------------------
@triton.jit
def _sample_floor_kernel(xs_ptr, ks_ptr, ke_ptr, floor_ptr, T, K, NSC, STRIDE, sx0,
                         SP: tl.constexpr):
    """Step 2 (one program per row): the floor's order key from the row's sampled logits
    (``xs`` [N, NSC], -inf outside the range); INT32_MIN (every key) when the sample has no key
    at the floor's place, or the row holds at most K keys (no filter needed)."""
    row = tl.program_id(0).to(tl.int64)
    start, end = row_range(ks_ptr, ke_ptr, row, T)
    cnt = end - start
    fl = tl.full([], -2147483648, tl.int32)
    if cnt > K:
        i = tl.arange(0, SP)
        valid = i < NSC
        x = tl.load(xs_ptr + row * sx0 + i, mask=valid, other=float("-inf"))
        s = ord_key(x)
        # the sample's columns inside [start, end): i * STRIDE in it
        m = (end + STRIDE - 1) // STRIDE - (start + STRIDE - 1) // STRIDE
        est = (K * m) // cnt
        margin = (4.0 * tl.sqrt(est.to(tl.float32) + 1.0)).to(tl.int32) + 8
        place = est + margin  # 0-based, descending
        need = place + 1
        prefix = tl.zeros([], tl.int32)
        for p in tl.static_range(4):
            d, mm = radix_digit(s, valid, prefix, p)
            need, prefix = radix_step(tl.histogram(d, 256, mask=mm), need, prefix, p)
        fl = tl.where(place < m, prefix, fl)
    tl.store(floor_ptr + row, fl)


@triton.jit
def _tile_logits(q_ptr, w_ptr, k_ptr, scale_ptr, rows64, rmask, cols64, cmask,
                 sq0, sq1, sq2, sw0, sw1, sk0, sk1,
                 H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr):
    """A [BLOCK_M, BLOCK_N] tile of logits as ``attention._indexer_kernel`` computes it (the
    key tile in the dot's type, one dot per head in head order, ``acc += w * relu(s)``, then the
    keys' fp8 scale): keep the two in step, or the fused path's choice drifts from the plain
    path's in the last bits."""
    d = tl.arange(0, DP)
    dmask = d < D
    kt = tl.load(k_ptr + cols64[:, None] * sk0 + d[None, :] * sk1,
                 mask=cmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:  # noqa: SIM108 (kept as a constexpr branch)
        kt = kt.to(tl.float32)
    else:
        kt = kt.to(q_ptr.dtype.element_ty)
    ktt = tl.trans(kt)
    qbase = q_ptr + rows64[:, None] * sq0 + d[None, :] * sq2
    qmask = rmask[:, None] & dmask[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for h in range(H):
        qh = tl.load(qbase + h * sq1, mask=qmask, other=0.0)
        wh = tl.load(w_ptr + rows64 * sw0 + h * sw1, mask=rmask, other=0.0)
        if UPCAST:  # noqa: SIM108 (kept as a constexpr branch)
            s = tl.dot(qh.to(tl.float32), ktt, input_precision="ieee")
        else:
            s = tl.dot(qh, ktt)
        acc += wh[:, None] * tl.maximum(s, 0.0)
    if FP8:
        c = tl.load(scale_ptr + cols64, mask=cmask, other=0.0)
        acc = acc * c[None, :]
    return acc


@triton.jit
def _fused_filter_kernel(q_ptr, w_ptr, k_ptr, scale_ptr, ks_ptr, ke_ptr, floor_ptr, cand_ptr,
                         count_ptr, N, T, K, CS, NS, CAP,
                         sq0, sq1, sq2, sw0, sw1, sk0, sk1,
                         H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         FP8: tl.constexpr, UPCAST: tl.constexpr):
    """Step 3 (program (split j, row block)): the split's logit tiles, in column order, for the
    block's rows holding more than K keys; the keys at or above the row's floor appended to the
    (row, split)'s candidates (at most CAP; the count goes on past it: the select flags the
    row). Tiles outside every such row's range are skipped. CAP is a runtime value: the
    layout's CAP changes with the call's shape, and each new value would compile the kernel
    again mid-prompt."""
    j = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    ks = tl.load(ks_ptr + rows64, mask=rmask, other=0)
    ke = tl.load(ke_ptr + rows64, mask=rmask, other=0)
    start = tl.minimum(tl.maximum(ks, 0), T).to(tl.int32)
    end = tl.minimum(tl.maximum(ke, 0), T).to(tl.int32)
    long = rmask & (end - start > K)
    lo = tl.min(tl.where(long, start, T), axis=0)
    hi = tl.max(tl.where(long, end, 0), axis=0)
    fl = tl.load(floor_ptr + rows64, mask=rmask, other=0)
    c_lo = tl.maximum(j * CS, (lo // BLOCK_N) * BLOCK_N)
    c_hi = tl.minimum(j * CS + CS, hi)
    crow = cand_ptr + (rows64 * NS + j) * CAP
    cnt = tl.zeros([BLOCK_M], tl.int32)
    for n0 in range(c_lo, c_hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cmask = cols < T
        acc = _tile_logits(q_ptr, w_ptr, k_ptr, scale_ptr, rows64, rmask, cols.to(tl.int64),
                           cmask, sq0, sq1, sq2, sw0, sw1, sk0, sk1, H, D, DP, BLOCK_M, BLOCK_N,
                           FP8, UPCAST)
        s = ord_key(acc)
        inr = long[:, None] & (cols[None, :] >= start[:, None]) & (cols[None, :] < end[:, None])
        take = inr & (s >= fl[:, None])
        pos = cnt[:, None] + tl.cumsum(take.to(tl.int32), axis=1) - 1
        comp = (s.to(tl.int64) << 32) | (2147483647 - cols).to(tl.int64)[None, :]
        tl.store(crow[:, None] + pos, comp, mask=take & (pos < CAP))
        cnt += tl.sum(take.to(tl.int32), axis=1)
    tl.store(count_ptr + rows64 * NS + j, cnt, mask=rmask)


@triton.jit
def _row_logits(qt, wv, k_ptr, scale_ptr, cols, m, d, dmask, sk0, sk1, FP8: tl.constexpr,
                UPCAST: tl.constexpr):
    """One row's logits at BLOCK_N columns: its heads stacked in one ``[HP, DP]`` dot."""
    cols64 = cols.to(tl.int64)
    kt = tl.load(k_ptr + cols64[:, None] * sk0 + d[None, :] * sk1,
                 mask=m[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        s = tl.dot(qt, tl.trans(kt.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(qt, tl.trans(kt.to(qt.dtype)))
    x = tl.sum(wv[:, None] * tl.maximum(s, 0.0), axis=0)
    if FP8:
        x = x * tl.load(scale_ptr + cols64, mask=m, other=0.0)
    return x


@triton.jit
def _fused_exact_kernel(q_ptr, w_ptr, k_ptr, scale_ptr, ks_ptr, ke_ptr, out_ptr, meta_ptr, T, K,
                        sq0, sq1, sq2, sw0, sw1, sk0, sk1,
                        H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                        BLOCK_N: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr):
    """Step 5 (one program per row; rows the select flagged, ``meta = -1``, work): an exact
    radix select over the row's logits, recomputed in every round, then the K chosen columns
    (the keys above the K-th, the first ones equal to it by column) in column order."""
    row = tl.program_id(0).to(tl.int64)
    start, end = row_range(ks_ptr, ke_ptr, row, T)
    if end - start > K:  # noqa: SIM102 (the meta load only for rows holding more than K keys)
        if tl.load(meta_ptr + row * 2) < 0:
            head = tl.arange(0, HP)
            hmask = head < H
            d = tl.arange(0, DP)
            dmask = d < D
            qt = tl.load(q_ptr + row * sq0 + head[:, None] * sq1 + d[None, :] * sq2,
                         mask=hmask[:, None] & dmask[None, :], other=0.0)
            if UPCAST:
                qt = qt.to(tl.float32)
            wv = tl.load(w_ptr + row * sw0 + head * sw1, mask=hmask, other=0.0)
            orow = out_ptr + row * K
            need = K + tl.zeros([], tl.int32)
            prefix = tl.zeros([], tl.int32)
            for p in tl.static_range(4):
                hist = tl.zeros([256], tl.int32)
                for c0 in range(start, end, BLOCK_N):
                    cols = c0 + tl.arange(0, BLOCK_N)
                    m = cols < end
                    x = _row_logits(qt, wv, k_ptr, scale_ptr, cols, m, d, dmask, sk0, sk1, FP8,
                                    UPCAST)
                    dg, mm = radix_digit(ord_key(x), m, prefix, p)
                    hist += tl.histogram(dg, 256, mask=mm)
                need, prefix = radix_step(hist, need, prefix, p)
            wpos = tl.zeros([], tl.int32)
            eq_seen = tl.zeros([], tl.int32)
            for c0 in range(start, end, BLOCK_N):
                cols = c0 + tl.arange(0, BLOCK_N)
                m = cols < end
                s = ord_key(_row_logits(qt, wv, k_ptr, scale_ptr, cols, m, d, dmask, sk0, sk1,
                                        FP8, UPCAST))
                eq = m & (s == prefix)
                eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), 0)
                take = ((m & (s > prefix)) | (eq & (eq_rank <= need))).to(tl.int32)
                tl.store(orow + wpos + tl.cumsum(take, 0) - 1, cols, mask=take != 0)
                wpos += tl.sum(take, axis=0)
                eq_seen += tl.sum(eq.to(tl.int32), axis=0)
            tl.store(meta_ptr + row * 2, K)


# ---- the op ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FusedLayout:
    """The filter's splits for one call: ``splits`` of ``split_cols`` columns (a multiple of
    BLOCK_N), ``cap`` candidate slots per (row, split), the sample's column ``stride`` and its
    ``sample_cols``."""

    splits: int
    split_cols: int
    cap: int
    stride: int
    sample_cols: int


def layout(n: int, t: int, k: int, cfg: dict[str, int] | None = None) -> FusedLayout:
    """The split count and CAP of an [n, t] call with top-k ``k`` (shapes only: the same on
    every rank). The floor keeps ~``(est + margin + 1) / sample`` of a row (est = k x sample /
    t, margin as the floor kernel's); a split's CAP is SAFETY times its share of that or
    ROW_SHARE_PCT % of the row's, a power of two in [CAP_MIN, CAP_MAX] (never more than the
    split's columns); splits as many as give PROGRAMS programs (at least SPLIT_MIN columns
    each), halved while the scratch exceeds its bound."""
    c = cfg or INDEXER_TOPK
    bn = c["BLOCK_N"]
    stride = max(1, triton.cdiv(t, c["SAMPLE"]))
    sample = triton.cdiv(t, stride)
    est = (k * sample) // max(t, 1)
    frac = min(1.0, (est + int(4.0 * math.sqrt(est + 1.0)) + 9) / sample)
    blocks = triton.cdiv(max(n, 1), c["BLOCK_M"])
    ns = max(1, min(triton.cdiv(c["PROGRAMS"], blocks), triton.cdiv(t, c["SPLIT_MIN"])))
    bound = max(n * t * 4 // c["SCRATCH_DIV"], c["SCRATCH_MB"] << 20)
    while True:
        cs = triton.cdiv(triton.cdiv(t, ns), bn) * bn
        want = max(c["SAFETY"] * frac * cs, c["ROW_SHARE_PCT"] / 100 * frac * t)
        cap = min(_pow2(math.ceil(want)), c["CAP_MAX"])
        cap = min(max(cap, c["CAP_MIN"]), _pow2(cs))
        if ns == 1 or n * ns * cap * 8 <= bound:
            break
        ns = max(1, ns // 2)
    return FusedLayout(splits=triton.cdiv(t, cs), split_cols=cs, cap=cap, stride=stride,
                       sample_cols=sample)


#: ``launch(key, kernel, grid, args, constexprs, num_warps, num_stages)``: the caller's launcher
#: (``AttentionKernels``: fewer stages when a specialisation runs out of shared memory)
Launch = Callable[[tuple[Any, ...], Any, tuple[int, ...], tuple[Any, ...], dict[str, Any], int,
                   int], None]
#: ``indexer_logits(q, w, k, k_scale, key_start, key_end)``: the plain indexer op (the sample)
SampleLogits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                         torch.Tensor, torch.Tensor], torch.Tensor]


def indexer_topk(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None,
                 key_start: torch.Tensor, key_end: torch.Tensor, topk: int, *, fp8: bool,
                 dot_width: int, upcast: bool, sample_logits: SampleLogits,
                 launch: Launch) -> torch.Tensor:
    """The fused path (module docstring) for checked arguments, ``0 < topk < T``, N > 0:
    int32 [N, topk]. ``dot_width``: the padded head dim of the dots; ``upcast``: fp32 dots
    (the interpreter, or operands without a tensor-core type)."""
    n, heads, d = q.shape
    t = k.shape[0]
    cfg = INDEXER_TOPK
    lay = layout(n, t, topk, cfg)
    dev = q.device
    ks, ke = key_start.contiguous(), key_end.contiguous()
    st = lay.stride
    # 1. the sample: the indexer at columns i * stride, rows' ranges in sample columns
    kss = (ks.clamp(0, t) + (st - 1)) // st
    kes = (ke.clamp(0, t) + (st - 1)) // st
    scale_s = k_scale[::st].contiguous() if k_scale is not None else None
    xs = sample_logits(q, w, k[::st], scale_s, kss, kes)
    # 2. the floor
    floor = torch.empty(n, dtype=torch.int32, device=dev)
    _sample_floor_kernel[(n,)](xs, ks, ke, floor, t, topk, lay.sample_cols, st, xs.stride(0),
                               SP=_pow2(lay.sample_cols, 1), num_warps=4)
    # 3. the filter in the indexer's epilogue
    cand = torch.empty(n * lay.splits * lay.cap, dtype=torch.int64, device=dev)
    count = torch.empty(n, lay.splits, dtype=torch.int32, device=dev)
    scale = k_scale.contiguous() if k_scale is not None else floor  # unused for float keys
    bm = min(cfg["BLOCK_M"], _pow2(n))
    bn = cfg["BLOCK_N"]
    launch(("indexer_topk", q.dtype, k.dtype, heads, d, bm, bn, upcast),
           _fused_filter_kernel, (lay.splits, triton.cdiv(n, bm)),
           (q, w, k, scale, ks, ke, floor, cand, count, n, t, topk, lay.split_cols, lay.splits,
            lay.cap, q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1), k.stride(0),
            k.stride(1)),
           {"H": heads, "D": d, "DP": dot_width, "BLOCK_M": bm, "BLOCK_N": bn, "FP8": fp8,
            "UPCAST": upcast},
           cfg["num_warps"], cfg["num_stages"])
    # 4. the select; 5. the flagged rows, exactly
    out = torch.empty(n, topk, dtype=torch.int32, device=dev)
    meta = torch.empty(n, 2, dtype=torch.int32, device=dev)
    select_candidates(cand, count, ks, ke, out, meta, t, topk, lay.cap)
    _fused_exact_kernel[(n,)](q, w, k, scale, ks, ke, out, meta, t, topk,
                              q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                              k.stride(0), k.stride(1), H=heads, HP=_pow2(heads), D=d,
                              DP=dot_width, BLOCK_N=cfg["EXACT_BLOCK_N"], FP8=fp8, UPCAST=upcast,
                              num_warps=cfg["exact_warps"])
    return out
