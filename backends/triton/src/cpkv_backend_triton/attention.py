"""Triton kernels for the sparse-attention ops of one layer (rule 19): the lightning indexer's
logits, top-k selection, and sparse MLA prefill (FlashMLA's sparse interface).

Semantics are exactly :class:`cpkv.ops.api.KVOps`'s, checked against the torch reference by
``cpkv.testing.conformance``. Every op is shape-driven: no ``.item()``, no data-dependent shapes,
no host tensors, any number of rows including 0. How each kernel works, the measured choices
behind the defaults and the precision modes of sparse MLA: docs/triton.md.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
import triton
import triton.language as tl

from cpkv.ops.api import (
    FallbackReason,
    KVFormat,
    check_indexer_args,
    check_sparse_mla_args,
    check_sparse_mla_paged_args,
    check_topk_args,
    paged_latent,
    report_fallback,
)

if TYPE_CHECKING:
    from cpkv.ops.api import KVPart

__all__ = ["AttentionKernels", "MLAPrecision", "PageReader"]

#: the precision of sparse MLA on 16-bit inputs (see :class:`AttentionKernels`)
MLAPrecision = Literal["bf16", "exact"]

_LOWP = (torch.bfloat16, torch.float16)

#: default launch configurations (the bench sweeps alternatives)
# num_warps 4 measured best on the H200 (598 vs 497 TFLOP/s at 1024 x 32K x 64 x 128, docs/perf.md)
#: FEW_ROWS: at most this many query rows take the few-rows kernel (heads stacked into one dot;
#: a decode step), with FEW_BLOCK_N keys per program and few_warps warps. On the H200 at 64K fp8
#: keys x 64 heads (bf16 queries, times with launch work): 1-4 rows ~2x faster than the row-tile
#: kernel, 8 rows 1.28x, 16 rows 0.72x (docs/perf.md); in a decode step 80 -> 9 us of GPU time
INDEXER_DEFAULT: dict[str, int] = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3,
                                   "FEW_ROWS": 8, "FEW_BLOCK_N": 128, "few_warps": 4}
MLA_DEFAULT: dict[str, int] = {"BLOCK_H": 64, "BLOCK_K": 32, "num_warps": 8, "num_stages": 2,
                               "P_SPLIT": 2, "P_FP16": 1, "P_CAT": 1}
#: 16-bit q/kv (the production path): one bf16 P, FlashMLA's precision, within bf16 tolerance of
#: the fp32 reference (the conformance suite's 16-bit tolerance); 229 vs 42 TFLOP/s on the H200
MLA_LOWP_DEFAULT: dict[str, int] = {"BLOCK_H": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2,
                                    "P_SPLIT": 1, "P_FP16": 0, "P_CAT": 0}
TOPK_BLOCK = 1024
#: top-k selection: "radix" (the exact radix-select kernel, default) or "torch" (mask, torch.topk,
#: fix-up: ties at the k-th place may differ from the reference); per instance through
#: ``AttentionKernels(topk_method=...)``
TOPK_METHOD = "radix"
#: larger k (the candidates' scratch grows with it), and float64 logits (whose keys have 64
#: bits), take the torch path
TOPK_RADIX_MAX_K = 4096
#: the radix kernels' launch: BLOCK columns per step, CHUNK columns of a row per program (the
#: histogram and compaction kernels), warps of the streaming kernels and of the final kernel,
#: BINS of the value histogram (a power of two). Measured on the H200 (1024 x 64K, docs/perf.md):
#: 64 bins as fast as 32 and 12 % faster than 128; 512-column blocks, 8K-column chunks and 4
#: warps best of a sweep (the compaction 0.42 -> 0.26 ms from 2048-column blocks)
TOPK_CONFIG: dict[str, int] = {"BLOCK": 512, "CHUNK": 8192, "num_warps": 4, "final_warps": 4,
                               "BINS": 64}
#: candidates (keys in the K-th key's bin) a row may hand to the final kernel's refinement (at
#: least the power of two >= k); more take the exact kernel's 4 passes
TOPK_MIN_CAP = 1024
#: candidates per step of the final kernel's refinement
TOPK_REFINE_BLOCK = 256
#: columns, spread evenly over a row's range, whose sorted keys place the bins' bracket
TOPK_SAMPLE = 512
_RADIX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


# ---- kernels ---------------------------------------------------------------------------------
@triton.jit
def _key_span(ks_ptr, ke_ptr, rows, rmask):
    """The rows' key ranges ``[ks, ke)`` and the span ``[lo, hi)`` they cover together (empty
    and masked rows left out): key tiles outside it are skipped."""
    ks = tl.load(ks_ptr + rows, mask=rmask, other=0)
    ke = tl.load(ke_ptr + rows, mask=rmask, other=0)
    nonempty = rmask & (ks < ke)
    lo = tl.min(tl.where(nonempty, ks, 9223372036854775807), axis=0)
    hi = tl.max(tl.where(nonempty, ke, 0), axis=0)
    return ks, ke, lo, hi


@triton.jit
def _key_tile(k_ptr, q_ptr, cols64, cmask, d, dmask, sk0, sk1, UPCAST: tl.constexpr):
    """The key tile ``[BLOCK_N, DP]`` transposed for ``q @ k^T``, in the dot's input type: fp32
    (``UPCAST``), else the query's type (fp8 keys convert exactly to 16 bits; fp8 queries keep
    fp8)."""
    kt = tl.load(k_ptr + cols64[:, None] * sk0 + d[None, :] * sk1,
                 mask=cmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:  # noqa: SIM108 (kept as a constexpr branch)
        kt = kt.to(tl.float32)
    else:
        kt = kt.to(q_ptr.dtype.element_ty)
    return tl.trans(kt)


@triton.jit
def _store_in_range(out_ptr, acc, rows, rmask, cols, cmask, ks, ke, so0):
    """``acc`` inside each row's key range, -inf outside, into the logits tile."""
    inr = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * so0 + cols.to(tl.int64)[None, :],
             tl.where(inr, acc, float("-inf")), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _indexer_kernel(q_ptr, w_ptr, k_ptr, scale_ptr, ks_ptr, ke_ptr, out_ptr,
                    N, T,
                    sq0, sq1, sq2, sw0, sw1, sk0, sk1, so0,
                    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    FP8: tl.constexpr, UPCAST: tl.constexpr):
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
    if (n0 < hi) & (n0 + BLOCK_N > lo):  # the tile meets some row's range: compute it
        d = tl.arange(0, DP)
        dmask = d < D
        ktt = _key_tile(k_ptr, q_ptr, cols64, cmask, d, dmask, sk0, sk1, UPCAST)
        qbase = q_ptr + rows64[:, None] * sq0 + d[None, :] * sq2
        qmask = rmask[:, None] & dmask[None, :]
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
    _store_in_range(out_ptr, acc, rows, rmask, cols, cmask, ks, ke, so0)


@triton.jit
def _indexer_few_rows_kernel(q_ptr, w_ptr, k_ptr, scale_ptr, ks_ptr, ke_ptr, out_ptr,
                             N, T,
                             sq0, sq1, sq2, sw0, sw1, sk0, sk1, so0,
                             H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                             BQ: tl.constexpr, BLOCK_N: tl.constexpr,
                             FP8: tl.constexpr, UPCAST: tl.constexpr):
    """The indexer for a few query rows (decode steps, MTP checks): the heads of ``BQ`` rows
    stacked into one ``[BQ * HP, D]`` operand, one dot per key tile, the weighted head sum a
    reduction over that axis (instead of a loop of ``H`` dependent dots on a mostly empty
    row tile)."""
    pid_n = tl.program_id(0)
    pid_q = tl.program_id(1)
    qr = pid_q * BQ + tl.arange(0, BQ)
    qmask = qr < N
    ks, ke, lo, hi = _key_span(ks_ptr, ke_ptr, qr, qmask)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < T
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BQ, BLOCK_N], dtype=tl.float32)
    if (n0 < hi) & (n0 + BLOCK_N > lo):
        m = tl.arange(0, BQ * HP)
        head = m % HP
        rows64 = (pid_q * BQ + m // HP).to(tl.int64)
        rmask = (pid_q * BQ + m // HP < N) & (head < H)
        d = tl.arange(0, DP)
        dmask = d < D
        ktt = _key_tile(k_ptr, q_ptr, cols64, cmask, d, dmask, sk0, sk1, UPCAST)
        qt = tl.load(q_ptr + rows64[:, None] * sq0 + head[:, None] * sq1 + d[None, :] * sq2,
                     mask=rmask[:, None] & dmask[None, :], other=0.0)
        if UPCAST:  # noqa: SIM108 (kept as a constexpr branch)
            s = tl.dot(qt.to(tl.float32), ktt, input_precision="ieee")
        else:
            s = tl.dot(qt, ktt)
        wv = tl.load(w_ptr + rows64 * sw0 + head * sw1, mask=rmask, other=0.0)
        acc = tl.sum(tl.reshape(wv[:, None] * tl.maximum(s, 0.0), [BQ, HP, BLOCK_N]), axis=1)
        if FP8:
            c = tl.load(scale_ptr + cols64, mask=cmask, other=0.0)
            acc = acc * c[None, :]
    _store_in_range(out_ptr, acc, qr, qmask, cols, cmask, ks, ke, so0)


@triton.jit
def _mask_kernel(x_ptr, ks_ptr, ke_ptr, out_ptr, T, sx0, sx1, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < T
    ks = tl.load(ks_ptr + row)
    ke = tl.load(ke_ptr + row)
    x = tl.load(x_ptr + row * sx0 + cols.to(tl.int64) * sx1, mask=cmask, other=0.0)
    inr = (cols >= ks) & (cols < ke)
    tl.store(out_ptr + row * T + cols, tl.where(inr, x, float("-inf")), mask=cmask)


@triton.jit
def _topk_fixup_kernel(chosen_ptr, ks_ptr, ke_ptr, out_ptr, T, K, KK,
                       HAS_CHOSEN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    smask = slot < K
    ks = tl.load(ks_ptr + row)
    ke = tl.load(ke_ptr + row)
    start = tl.minimum(tl.maximum(ks, 0), T)
    end = tl.minimum(tl.maximum(ke, 0), T)
    count = tl.maximum(end - start, 0)
    asc = tl.where(slot < count, start + slot, -1)
    if HAS_CHOSEN:
        ch = tl.load(chosen_ptr + row * KK + slot, mask=slot < KK, other=-1)
    else:
        ch = tl.full([BLOCK], -1, tl.int64)
    res = tl.where(count <= K, asc, ch)
    tl.store(out_ptr + row * K + slot, res.to(tl.int32), mask=smask)


@triton.jit
def _ord_key(x):
    """fp32 -> int32 whose signed order is the float order (-0.0 and 0.0 map alike; -inf is the
    smallest key of every non-NaN value)."""
    x = tl.where(x == 0.0, 0.0, x)
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _value_bin(x, lo, inv, NB: tl.constexpr):
    """A monotone bin of the fp32 logit: 0 below the bracket's ``lo``, then ``NB - 2`` equal
    widths of ``1 / inv`` above it, the last bin open upwards (``inv = 0``: every key >= lo in
    bin 1). Monotone in x, so any bracket is exact: a poor one only gives more candidates."""
    below = x < lo
    # lo is finite (the bracket kernel clamps it), so nothing here is NaN: -inf keys sit below
    f = tl.minimum(tl.minimum(tl.maximum(x, lo) - lo, 3.0e38) * inv, NB - 2)
    return tl.where(below, 0, 1 + f.to(tl.int32))


@triton.jit
def _pick_bin(hist, need, NB: tl.constexpr):
    """The bin holding the need-th largest key, and how many keys lie in higher bins."""
    above = tl.sum(hist, axis=0) - tl.cumsum(hist, 0)  # keys in higher bins
    hit = (above < need) & (above + hist >= need)  # exactly one bin
    b = tl.sum(tl.where(hit, tl.arange(0, NB), 0), axis=0)
    return b, tl.sum(tl.where(hit, above, 0), axis=0)


@triton.jit
def _radix_digit(s, m, prefix, p: tl.constexpr):
    """Round p (0-3) of an 8-bit radix select over keys s: the digit, and the mask narrowed to
    the keys whose higher bits match the prefix found so far."""
    if p == 0:  # the sign bit flipped: digits ascend with the key
        d = ((s >> 24) & 255) ^ 128
    else:
        m = m & (((s ^ prefix) & -(1 << (32 - 8 * p))) == 0)
        d = (s >> (24 - 8 * p)) & 255
    return d, m


@triton.jit
def _radix_step(hist, need, prefix, p: tl.constexpr):
    """After round p's histogram: keys still to take among those matching the longer prefix."""
    b, above = _pick_bin(hist, need, 256)
    if p == 0:
        b = b ^ 128
    return need - above, prefix | (b << (24 - 8 * p))


@triton.jit
def _row_range(ks_ptr, ke_ptr, row, T):
    ks = tl.load(ks_ptr + row)
    ke = tl.load(ke_ptr + row)
    start = tl.minimum(tl.maximum(ks, 0), T).to(tl.int32)
    end = tl.minimum(tl.maximum(ke, 0), T).to(tl.int32)
    return start, end


@triton.jit
def _topk_bracket_kernel(x_ptr, ks_ptr, ke_ptr, br_ptr, T, K, sx0, sx1, NB: tl.constexpr,
                         SAMPLE: tl.constexpr):
    """Top-k, kernel 1 of 5 (one program per row holding more than K keys): the bins' bracket
    from SAMPLE columns spread evenly over the range. The k-th largest key's place in the sorted
    sample is estimated (``SAMPLE * K / count``); the bracket runs from the sample key a margin
    below it (4 standard deviations of that estimate, plus 8) to the one a margin above."""
    row = tl.program_id(0).to(tl.int64)
    start, end = _row_range(ks_ptr, ke_ptr, row, T)
    cnt = end - start
    if cnt > K:
        i = tl.arange(0, SAMPLE)
        cols = start + (i.to(tl.int64) * cnt) // SAMPLE
        x = tl.load(x_ptr + row * sx0 + cols * sx1).to(tl.float32)
        x = tl.sort(tl.where(x == 0.0, 0.0, x), descending=True)
        est = (K * SAMPLE) // cnt  # ~ sample keys at or above the k-th largest
        margin = (4.0 * tl.sqrt(est.to(tl.float32) + 1.0)).to(tl.int32) + 8
        ih = tl.maximum(est - 1 - margin, 0)
        il = tl.minimum(est - 1 + margin, SAMPLE - 1)
        x = tl.maximum(x, -3.0e38)  # -inf keys: a finite bracket (they all fall below it)
        hi = tl.sum(tl.where(i == ih, x, 0.0), axis=0)
        lo = tl.sum(tl.where(i == il, x, 0.0), axis=0)
        width = hi - lo
        ok = (width > 1e-30) & (width < 3.0e38)
        inv = tl.where(ok, (NB - 2) / tl.where(ok, width, 1.0), 0.0)
        tl.store(br_ptr + row * 2, lo)
        tl.store(br_ptr + row * 2 + 1, inv)


@triton.jit
def _topk_hist_kernel(x_ptr, ks_ptr, ke_ptr, br_ptr, hist_ptr, T, K, CH, sx0, sx1, NCH,
                      BLOCK: tl.constexpr, NB: tl.constexpr):
    """Top-k, kernel 2 of 5 (program (row, chunk of CH columns of its range)): the chunk's
    histogram of the keys' bins."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    start, end = _row_range(ks_ptr, ke_ptr, row, T)
    hist = tl.zeros([NB], tl.int32)
    if end - start > K:
        xrow = x_ptr + row * sx0
        lo = tl.load(br_ptr + row * 2)
        inv = tl.load(br_ptr + row * 2 + 1)
        c_lo = start + j * CH
        c_hi = tl.minimum(c_lo + CH, end)
        for c0 in range(c_lo, c_hi, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < c_hi
            x = tl.load(xrow + cols.to(tl.int64) * sx1, mask=m, other=0.0).to(tl.float32)
            hist += tl.histogram(_value_bin(x, lo, inv, NB), NB, mask=m)
    tl.store(hist_ptr + (row * NCH + j) * NB + tl.arange(0, NB), hist)


@triton.jit
def _topk_compact_kernel(x_ptr, ks_ptr, ke_ptr, br_ptr, hist_ptr, out_ptr, cand_ptr, meta_ptr, T,
                         K, CH, sx0, sx1, NCH, BLOCK: tl.constexpr, NB: tl.constexpr,
                         NCHP: tl.constexpr, CAP: tl.constexpr):
    """Top-k, kernel 3 of 5 (program (row, chunk)): from the row's histograms, the bin b of its
    K-th largest key; the columns of the chunk's keys in higher bins are chosen (written to the
    output row's first ``above`` slots), the keys of bin b are candidates (int64 composites
    ``key << 32 | (2^31 - 1 - column)`` in a scratch row, in column order: chunk offsets from
    the histograms, one ``tl.cumsum`` of both flags inside a block). More than CAP candidates:
    the row is left to the exact kernel (``meta = -1``)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    start, end = _row_range(ks_ptr, ke_ptr, row, T)
    if end - start > K:
        jj = tl.arange(0, NCHP)
        bins = tl.arange(0, NB)
        h = tl.load(hist_ptr + (row * NCH + jj[:, None]) * NB + bins[None, :],
                    mask=(jj < NCH)[:, None], other=0)
        b, above = _pick_bin(tl.sum(h, axis=0), K, NB)
        eqc = tl.sum(tl.where(bins[None, :] == b, h, 0), axis=1)  # per chunk
        gtc = tl.sum(tl.where(bins[None, :] > b, h, 0), axis=1)
        ncand = tl.sum(eqc, axis=0)
        if ncand <= CAP:
            xrow = x_ptr + row * sx0
            orow = out_ptr + row * K
            crow = cand_ptr + row * CAP
            lo = tl.load(br_ptr + row * 2)
            inv = tl.load(br_ptr + row * 2 + 1)
            gpos = tl.sum(tl.where(jj < j, gtc, 0), axis=0)
            cpos = tl.sum(tl.where(jj < j, eqc, 0), axis=0)
            c_lo = start + j * CH
            c_hi = tl.minimum(c_lo + CH, end)
            for c0 in range(c_lo, c_hi, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                m = cols < c_hi
                x = tl.load(xrow + cols.to(tl.int64) * sx1, mask=m, other=0.0).to(tl.float32)
                vb = _value_bin(x, lo, inv, NB)
                gt = m & (vb > b)
                eq = m & (vb == b)
                # both running counts in one scan (a block holds < 2^16 columns)
                both = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)
                comp = (_ord_key(x).to(tl.int64) << 32) | (2147483647 - cols).to(tl.int64)
                tl.store(orow + gpos + (both & 0xFFFF) - 1, cols, mask=gt)
                tl.store(crow + cpos + (both >> 16) - 1, comp, mask=eq)
                tot = tl.sum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), axis=0)
                gpos += tot & 0xFFFF
                cpos += tot >> 16
            if j == 0:
                tl.store(meta_ptr + row * 2, above)
                tl.store(meta_ptr + row * 2 + 1, ncand)
        elif j == 0:
            tl.store(meta_ptr + row * 2, -1)
            tl.store(meta_ptr + row * 2 + 1, 0)


@triton.jit
def _topk_exact_kernel(x_ptr, ks_ptr, ke_ptr, out_ptr, meta_ptr, T, K, sx0, sx1,
                       BLOCK: tl.constexpr):
    """Top-k, kernel 4 of 5 (one program per row the compact kernel left, ``meta = -1``: more
    than CAP keys in the K-th key's bin, i.e. massive ties or a sample far from the row): exact
    radix select over the row, 4 passes of 8 bits, then the K chosen columns in column order."""
    row = tl.program_id(0).to(tl.int64)
    start, end = _row_range(ks_ptr, ke_ptr, row, T)
    if end - start > K:  # noqa: SIM102 (the meta load only for rows holding more than K keys)
        if tl.load(meta_ptr + row * 2) < 0:
            xrow = x_ptr + row * sx0
            orow = out_ptr + row * K
            need = K + tl.zeros([], tl.int32)  # keys still to take among those matching prefix
            prefix = tl.zeros([], tl.int32)  # the K-th key's bits found so far
            for p in tl.static_range(4):
                hist = tl.zeros([256], tl.int32)
                for c0 in range(start, end, BLOCK):
                    cols = c0 + tl.arange(0, BLOCK)
                    m = cols < end
                    x = tl.load(xrow + cols.to(tl.int64) * sx1, mask=m, other=0.0)
                    d, m = _radix_digit(_ord_key(x.to(tl.float32)), m, prefix, p)
                    hist += tl.histogram(d, 256, mask=m)
                need, prefix = _radix_step(hist, need, prefix, p)
            # every key above the K-th and the first `need` equal to it (ascending columns)
            wpos = tl.zeros([], tl.int32)
            eq_seen = tl.zeros([], tl.int32)
            for c0 in range(start, end, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                m = cols < end
                x = tl.load(xrow + cols.to(tl.int64) * sx1, mask=m, other=0.0)
                s = _ord_key(x.to(tl.float32))
                eq = m & (s == prefix)
                eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), 0)  # 1-based among equal keys
                take = ((m & (s > prefix)) | (eq & (eq_rank <= need))).to(tl.int32)
                tl.store(orow + wpos + tl.cumsum(take, 0) - 1, cols, mask=take != 0)
                wpos += tl.sum(take, axis=0)
                eq_seen += tl.sum(eq.to(tl.int32), axis=0)
            tl.store(meta_ptr + row * 2, K)
            tl.store(meta_ptr + row * 2 + 1, 0)


@triton.jit
def _topk_final_kernel(ks_ptr, ke_ptr, out_ptr, cand_ptr, meta_ptr, T, K, KP: tl.constexpr,
                       CAP: tl.constexpr, RB: tl.constexpr):
    """Top-k, kernel 5 of 5 (one program per row): rows holding at most K keys list them
    ascending (-1 padded); longer rows refine their ``ncand`` candidates (exact radix select, 4
    histograms of 8 bits, in blocks of RB) and append the ``K - above`` they take, the keys above
    the K-th and the first ones equal to it by column, after the chosen columns."""
    row = tl.program_id(0).to(tl.int64)
    start, end = _row_range(ks_ptr, ke_ptr, row, T)
    count = tl.maximum(end - start, 0)
    if count <= K:
        for s0 in range(0, K, KP):
            slot = s0 + tl.arange(0, KP)
            tl.store(out_ptr + row * K + slot, tl.where(slot < count, start + slot, -1),
                     mask=slot < K)
    else:
        crow = cand_ptr + row * CAP
        above = tl.load(meta_ptr + row * 2)
        ncand = tl.load(meta_ptr + row * 2 + 1)  # 0 for the rows the exact kernel took
        need = K - above  # candidates to take
        prefix = tl.zeros([], tl.int32)  # the K-th key's bits found so far
        for p in tl.static_range(4):
            hist = tl.zeros([256], tl.int32)
            for c0 in range(0, ncand, RB):
                j = c0 + tl.arange(0, RB)
                m = j < ncand
                s = (tl.load(crow + j, mask=m, other=0) >> 32).to(tl.int32)
                d, m = _radix_digit(s, m, prefix, p)
                hist += tl.histogram(d, 256, mask=m)
            need, prefix = _radix_step(hist, need, prefix, p)
        wpos = above
        eq_seen = tl.zeros([], tl.int32)
        for c0 in range(0, ncand, RB):
            j = c0 + tl.arange(0, RB)
            m = j < ncand
            comp = tl.load(crow + j, mask=m, other=0)
            s = (comp >> 32).to(tl.int32)
            eq = m & (s == prefix)
            eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), 0)  # 1-based among equal keys
            take = ((m & (s > prefix)) | (eq & (eq_rank <= need))).to(tl.int32)
            tl.store(out_ptr + row * K + wpos + tl.cumsum(take, 0) - 1,
                     2147483647 - comp.to(tl.int32), mask=take != 0)
            wpos += tl.sum(take, axis=0)
            eq_seen += tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def _sparse_mla_kernel(q_ptr, kv_ptr, idx_ptr, out_ptr,
                       H, K, qk_scale,
                       sq0, sq1, sq2, skv0, skv1, si0, si1, so0, so1,
                       DV: tl.constexpr, DK: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                       HAS_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                       UPCAST: tl.constexpr, LOWP: tl.constexpr, P_SPLIT: tl.constexpr,
                       P_FP16: tl.constexpr, P_CAT: tl.constexpr, HEADS_FAST: tl.constexpr,
                       NHB: tl.constexpr):
    if HEADS_FAST:  # 1-D grid, the head blocks of a row adjacent: they share its kv rows in L2
        pid = tl.program_id(0)
        row = (pid // NHB).to(tl.int64)
        hb = pid % NHB
    else:
        row = tl.program_id(0).to(tl.int64)
        hb = tl.program_id(1)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    h64 = h.to(tl.int64)
    da = tl.arange(0, DA)
    damask = da < DV
    qa = tl.load(q_ptr + row * sq0 + h64[:, None] * sq1 + da[None, :] * sq2,
                 mask=hmask[:, None] & damask[None, :], other=0.0)
    if UPCAST:  # noqa: SIM108 (kept as a constexpr branch)
        qa = qa.to(tl.float32)
    else:
        qa = qa.to(kv_ptr.dtype.element_ty)
    db = DV + tl.arange(0, DB)
    dbmask = db < DK
    if HAS_B:
        qb = tl.load(q_ptr + row * sq0 + h64[:, None] * sq1 + db[None, :] * sq2,
                     mask=hmask[:, None] & dbmask[None, :], other=0.0)
        if UPCAST:  # noqa: SIM108 (kept as a constexpr branch)
            qb = qb.to(tl.float32)
        else:
            qb = qb.to(kv_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DA], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(idx_ptr + row * si0 + kk * si1, mask=kk < K, other=-1)
        valid = idx >= 0
        base = kv_ptr + tl.where(valid, idx, 0).to(tl.int64)[:, None] * skv0
        kva = tl.load(base + da[None, :] * skv1, mask=valid[:, None] & damask[None, :], other=0.0)
        if UPCAST:
            kva = kva.to(tl.float32)
            s = tl.dot(qa, tl.trans(kva), input_precision="ieee")
        else:
            s = tl.dot(qa, tl.trans(kva))
        if HAS_B:
            kvb = tl.load(base + db[None, :] * skv1, mask=valid[:, None] & dbmask[None, :],
                          other=0.0)
            if UPCAST:
                s = tl.dot(qb, tl.trans(kvb.to(tl.float32)), s, input_precision="ieee")
            else:
                s = tl.dot(qb, tl.trans(kvb), s)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if LOWP:
            # p as a sum of P_SPLIT 16-bit pieces (of P_DTYPE), each through the 16-bit matmul
            if P_FP16:
                kvp = kva.to(tl.float16)  # exact for bf16 values of magnitude in [2^-17, 65504]
                if UPCAST:
                    kvp = kvp.to(tl.float32)
            else:
                kvp = kva
            r = p
            if P_CAT:
                # two pieces as ONE matmul over 2 * BLOCK_K: [p1 | p2] @ [kv; kv] (interleaved)
                if P_FP16:  # noqa: SIM108 (kept as a constexpr branch)
                    p1 = r.to(tl.float16)
                else:
                    p1 = r.to(kv_ptr.dtype.element_ty)
                p2 = (r - p1.to(tl.float32)).to(p1.dtype)
                pc = tl.reshape(tl.join(p1, p2), (BLOCK_H, 2 * BLOCK_K))
                kvc = tl.reshape(tl.permute(tl.join(kvp, kvp), (0, 2, 1)), (2 * BLOCK_K, DA))
                if UPCAST:
                    acc = tl.dot(pc.to(tl.float32), kvc, acc, input_precision="ieee")
                else:
                    acc = tl.dot(pc, kvc, acc)
            for _ in tl.static_range(0 if P_CAT else P_SPLIT):
                if P_FP16:  # noqa: SIM108 (kept as a constexpr branch)
                    piece = r.to(tl.float16)
                else:
                    piece = r.to(kv_ptr.dtype.element_ty)
                r = r - piece.to(tl.float32)
                if UPCAST:
                    acc = tl.dot(piece.to(tl.float32), kvp, acc, input_precision="ieee")
                else:
                    acc = tl.dot(piece, kvp, acc)
        else:
            acc = tl.dot(p, kva, acc, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + row * so0 + h64[:, None] * so1 + da[None, :], out,
             mask=hmask[:, None] & damask[None, :])


def _interpreted(kernel: Any) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


# ---- the ops ---------------------------------------------------------------------------------
class PageReader(Protocol):
    """The two KV ops ``sparse_mla_paged`` reads the pool's pages with (a :class:`KVKernels`)."""

    def page_gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor: ...

    def fp8_unpack(self, packed: torch.Tensor, fmt: KVFormat, part: KVPart,
                   dtype: torch.dtype, index: torch.Tensor | None = None) -> torch.Tensor: ...


class AttentionKernels:
    """The sparse-attention ops (indexer_logits, topk, sparse_mla, sparse_mla_paged), on CUDA
    tensors (or CPU tensors under ``TRITON_INTERPRET=1``); docs/triton.md describes the kernels.

    Args:
        indexer_config: overrides of :data:`INDEXER_DEFAULT` (BLOCK_M, BLOCK_N, num_warps,
            num_stages, FEW_ROWS, FEW_BLOCK_N, few_warps).
        mla_config: overrides of the sparse-MLA launch and probability split (BLOCK_H,
            BLOCK_K, num_warps, num_stages, P_SPLIT, P_FP16, P_CAT, HEADS_FAST), applied on top
            of the configuration ``mla_precision`` picks.
        mla_precision: the precision of ``sparse_mla`` on 16-bit (bf16 / fp16) q and kv.
            ``"bf16"`` (default): one bf16 probability matrix, FlashMLA's precision
            (:data:`MLA_LOWP_DEFAULT`), within bf16 tolerance of the fp32 reference and ~5x
            faster. ``"exact"``: the probabilities as a sum of 16-bit pieces
            (:data:`MLA_DEFAULT`), within 1e-5 of the fp32 reference. fp32 inputs always take
            :data:`MLA_DEFAULT`.
        topk_method: ``"radix"`` (default, exact) or ``"torch"`` (torch.topk; ties may differ),
            see :data:`TOPK_METHOD`.
        kv: the KV ops ``sparse_mla_paged`` reads pages with; None: a new :class:`KVKernels`.

    Raises:
        ValueError: an unknown ``topk_method`` or ``mla_precision``.
    """

    def __init__(self, indexer_config: dict[str, int] | None = None,
                 mla_config: dict[str, int] | None = None, topk_method: str = TOPK_METHOD,
                 mla_precision: MLAPrecision = "bf16", kv: PageReader | None = None) -> None:
        if topk_method not in ("radix", "torch"):
            raise ValueError(f"topk_method must be 'radix' or 'torch', got {topk_method!r}")
        if mla_precision not in ("bf16", "exact"):
            raise ValueError(f"mla_precision must be 'bf16' or 'exact', got {mla_precision!r}")
        self.topk_method = topk_method
        self.mla_precision = mla_precision
        self.indexer_config = {**INDEXER_DEFAULT, **(indexer_config or {})}
        base = MLA_LOWP_DEFAULT if mla_precision == "bf16" else MLA_DEFAULT
        #: the sparse-MLA configuration of 16-bit inputs, and of fp32 inputs
        self.mla_config = {**base, **(mla_config or {})}
        self.mla_fp32_config = {**MLA_DEFAULT, **(mla_config or {})}
        if kv is None:
            from .kv import KVKernels

            kv = KVKernels()
        self.kv = kv
        # num_stages that compiled, per kernel specialisation (an out-of-resource compile retries
        # with fewer stages once, on the host, without touching device data)
        self._stages: dict[tuple[Any, ...], int] = {}

    def _launch(self, key: tuple[Any, ...], kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...],
                consts: dict[str, Any], num_warps: int, num_stages: int) -> None:
        cache = self._stages
        stages = cache.get(key, num_stages)
        while True:
            try:
                kernel[grid](*args, **consts, num_warps=num_warps, num_stages=stages)
            except triton.runtime.errors.OutOfResources:
                if stages <= 1:
                    raise
                stages -= 1
                continue
            if key not in cache and stages != num_stages:  # once per specialisation
                report_fallback(op=f"triton:{getattr(kernel, '__name__', 'kernel')}",
                                requested=f"num_stages={num_stages}",
                                selected=f"num_stages={stages}",
                                reason=FallbackReason.KERNEL_VARIANT,
                                detail=f"out of shared memory for {key}")
            cache[key] = stages
            return

    # -- indexer --------------------------------------------------------------------------------
    def indexer_logits(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                       k_scale: torch.Tensor | None, key_start: torch.Tensor,
                       key_end: torch.Tensor) -> torch.Tensor:
        """``logit[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j])`` inside ``[key_start[i],
        key_end[i])``, -inf elsewhere; float32 [N, T]. See :class:`cpkv.ops.api.KVOps`.

        fp8 keys: the scale multiplies the head sum (``k_scale`` must be >= 0, as the pool's are).

        Raises:
            ValueError: a shape or dtype does not match (as the reference).
        """
        fp8 = check_indexer_args(q, w, k, k_scale, key_start, key_end)
        n, heads, d = q.shape
        t = k.shape[0]
        out = torch.empty(n, t, dtype=torch.float32, device=q.device)
        if n == 0 or t == 0:
            return out
        cfg = self.indexer_config
        bm = min(cfg["BLOCK_M"], _pow2(n))
        bn = min(cfg["BLOCK_N"], _pow2(t))
        interp = _interpreted(_indexer_kernel)
        # 16-bit tensor-core dot when q and (converted) k share a 16-bit type; fp32 otherwise
        # (fp8 q and keys: an fp8 x fp8 dot with fp32 accumulation)
        both_fp8 = fp8 and q.dtype == torch.float8_e4m3fn
        upcast = interp or not (both_fp8 or (q.dtype in _LOWP and (fp8 or k.dtype == q.dtype)))
        ks, ke = key_start.contiguous(), key_end.contiguous()
        scale = k_scale.contiguous() if fp8 else out  # unused pointer for float keys
        dp = _pow2(d)
        if n <= cfg["FEW_ROWS"]:  # a decode step's rows: every head in one dot per key tile
            hp = _pow2(heads, 1)
            bq = min(_pow2(n, 1), max(1, 128 // hp))  # at most 128 stacked (row, head) pairs
            bq = max(bq, 16 // hp)  # a dot takes at least 16 rows (hp is a power of two)
            bnf = min(cfg["FEW_BLOCK_N"], _pow2(t))
            self._launch(("indexer_few", q.dtype, k.dtype, heads, d, bq, bnf, upcast),
                         _indexer_few_rows_kernel, (triton.cdiv(t, bnf), triton.cdiv(n, bq)),
                         (q, w, k, scale, ks, ke, out, n, t,
                          q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                          k.stride(0), k.stride(1), out.stride(0)),
                         {"H": heads, "HP": hp, "D": d, "DP": dp, "BQ": bq, "BLOCK_N": bnf,
                          "FP8": fp8, "UPCAST": upcast},
                         cfg["few_warps"], cfg["num_stages"])
            return out
        grid = (triton.cdiv(t, bn), triton.cdiv(n, bm))
        key = ("indexer", q.dtype, k.dtype, heads, d, bm, bn, upcast)
        self._launch(key, _indexer_kernel, grid,
                     (q, w, k, scale, ks, ke, out, n, t,
                      q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                      k.stride(0), k.stride(1), out.stride(0)),
                     {"H": heads, "D": d, "DP": dp, "BLOCK_M": bm, "BLOCK_N": bn, "FP8": fp8,
                      "UPCAST": upcast},
                     cfg["num_warps"], cfg["num_stages"])
        return out

    # -- top-k ----------------------------------------------------------------------------------
    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        """Columns of the k largest logits in each row's range; int32 [N, k], -1 padded; rows
        holding at most k keys list them all ascending. See :class:`cpkv.ops.api.KVOps`.

        Default (``topk_method="radix"``): the exact select of the module docstring, the
        reference's set (ties by ascending column) in the kernels' order. ``"torch"``: a Triton
        kernel masks the logits, ``torch.topk`` (sorted) selects, a Triton kernel fixes up short
        rows and padding; ties at the k-th place may then resolve differently from the
        reference.

        Raises:
            ValueError: ``logits`` is not 2-D float, ``k`` is negative or a range is mis-shaped.
        """
        check_topk_args(logits, k, key_start, key_end)
        n, t = logits.shape
        out = torch.empty(n, k, dtype=torch.int32, device=logits.device)
        if n == 0 or k == 0:
            return out
        ks, ke = key_start.contiguous(), key_end.contiguous()
        select = k < t  # else no row holds more than k keys: each lists its range ascending
        method = getattr(self, "topk_method", TOPK_METHOD)
        if select and method == "radix" and k <= TOPK_RADIX_MAX_K \
                and logits.dtype in _RADIX_DTYPES:
            kp = _pow2(k)
            cap = max(kp, TOPK_MIN_CAP)
            cfg = TOPK_CONFIG
            blk = min(cfg["BLOCK"], _pow2(t))
            nb = cfg["BINS"]
            ch = triton.cdiv(cfg["CHUNK"], blk) * blk  # columns of a row per program
            nch = triton.cdiv(t, ch)
            dev = logits.device
            bracket = torch.empty(n, 2, dtype=torch.float32, device=dev)
            hist = torch.empty(n, nch, nb, dtype=torch.int32, device=dev)
            cand = torch.empty(n, cap, dtype=torch.int64, device=dev)
            meta = torch.empty(n, 2, dtype=torch.int32, device=dev)
            sx0, sx1 = logits.stride(0), logits.stride(1)
            warps = cfg["num_warps"]
            _topk_bracket_kernel[(n,)](logits, ks, ke, bracket, t, k, sx0, sx1, NB=nb,
                                       SAMPLE=TOPK_SAMPLE, num_warps=warps)
            _topk_hist_kernel[(n, nch)](logits, ks, ke, bracket, hist, t, k, ch, sx0, sx1, nch,
                                        BLOCK=blk, NB=nb, num_warps=warps)
            _topk_compact_kernel[(n, nch)](logits, ks, ke, bracket, hist, out, cand, meta, t, k,
                                           ch, sx0, sx1, nch, BLOCK=blk, NB=nb,
                                           NCHP=_pow2(nch, 1), CAP=cap, num_warps=warps)
            _topk_exact_kernel[(n,)](logits, ks, ke, out, meta, t, k, sx0, sx1, BLOCK=blk,
                                     num_warps=warps)
            _topk_final_kernel[(n,)](ks, ke, out, cand, meta, t, k, KP=kp, CAP=cap,
                                     RB=min(TOPK_REFINE_BLOCK, cap), num_warps=cfg["final_warps"])
            return out
        if select:
            masked = torch.empty(n, t, dtype=logits.dtype, device=logits.device)
            blk = min(TOPK_BLOCK, _pow2(t))
            _mask_kernel[(n, triton.cdiv(t, blk))](logits, ks, ke, masked, t, logits.stride(0),
                                                   logits.stride(1), BLOCK=blk, num_warps=4)
            chosen = torch.topk(masked, k, dim=1, largest=True, sorted=True).indices.contiguous()
        else:
            chosen = out  # unused
        blk = min(TOPK_BLOCK, _pow2(k))
        _topk_fixup_kernel[(n, triton.cdiv(k, blk))](chosen, ks, ke, out, t, k, k,
                                                     HAS_CHOSEN=select, BLOCK=blk, num_warps=4)
        return out

    # -- sparse MLA -----------------------------------------------------------------------------
    def sparse_mla(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                   dv: int) -> torch.Tensor:
        """Sparse MLA prefill (absorbed form) over the selected latent rows; float32 [N, H, dv].
        See :class:`cpkv.ops.api.KVOps`.

        Raises:
            ValueError: a shape or dtype does not match, or ``dv`` is out of range.
        """
        check_sparse_mla_args(q, kv, indices, dv)
        n, heads, dk = q.shape
        nk = indices.shape[1]
        if n == 0 or heads == 0 or kv.shape[0] == 0 or nk == 0:
            return torch.zeros(n, heads, dv, dtype=torch.float32, device=q.device)
        out = torch.empty(n, heads, dv, dtype=torch.float32, device=q.device)
        lowp = kv.dtype in _LOWP and q.dtype == kv.dtype  # 16-bit path
        cfg = self.mla_config if lowp else self.mla_fp32_config
        bh = min(cfg["BLOCK_H"], _pow2(heads))
        bk = min(cfg["BLOCK_K"], _pow2(nk))
        interp = _interpreted(_sparse_mla_kernel)
        upcast = interp or not lowp
        da, db = _pow2(dv), _pow2(dk - dv)
        nhb = triton.cdiv(heads, bh)
        heads_fast = bool(cfg.get("HEADS_FAST", 0))
        grid = (n * nhb,) if heads_fast else (n, nhb)
        key = ("mla", q.dtype, kv.dtype, dk, dv, bh, bk, upcast, heads_fast)
        self._launch(key, _sparse_mla_kernel, grid,
                     (q, kv, indices, out, heads, nk, float(scale) * math.log2(math.e),
                      q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
                      indices.stride(0), indices.stride(1), out.stride(0), out.stride(1)),
                     {"DV": dv, "DK": dk, "DA": da, "DB": db, "HAS_B": dk > dv, "BLOCK_H": bh,
                      "BLOCK_K": bk, "UPCAST": upcast, "LOWP": lowp,
                      "P_SPLIT": cfg["P_SPLIT"], "P_FP16": cfg["P_FP16"] == 1,
                      "P_CAT": cfg["P_CAT"] == 1 and cfg["P_SPLIT"] == 2,
                      "HEADS_FAST": heads_fast, "NHB": nhb},
                     cfg["num_warps"], cfg["num_stages"])
        return out

    def sparse_mla_paged(self, q: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor,
                         fmt: KVFormat, scale: float, dv: int) -> torch.Tensor:
        """Sparse MLA over latent rows read from part-major pages: the selected rows gathered
        and dequantized in one pass (``fp8_unpack`` through an index) into q's dtype, then
        :meth:`sparse_mla`. See :class:`cpkv.ops.api.KVOps`."""
        check_sparse_mla_paged_args(q, pages, rows, fmt, dv)
        dtype = q.dtype if q.dtype in _LOWP else torch.float32
        lat, idx = paged_latent(pages, rows, fmt, dtype, self.kv.fp8_unpack, self.kv.page_gather)
        return self.sparse_mla(q, lat, idx, scale, dv)
