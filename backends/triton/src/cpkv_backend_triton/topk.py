"""Triton top-k (rule 19): the columns of each row's k largest indexer logits inside its key range,
the torch reference's set exactly (equal logits by ascending column), no host sync.

Logits (fp32, or bf16/fp16 converted exactly) map to order-preserving int32 keys (``_ord_key``:
-0.0 folded into 0.0, -inf the smallest key). Two exact paths share the final refinement
(``_radix_digit`` / ``_radix_step``: 4 histograms of 8 bits find the k-th key) and the exact
fallback (``_topk_exact_kernel``: a radix select over a whole row):

* **Long rows** (``T >= TOPK_LONG["MIN_T"]``, a long prompt's chunk against ~100K-1M keys): one read
  of each logit. ``_topk_floor_kernel`` takes ``SAMPLE`` columns spread evenly over the row and
  a floor a few standard deviations below the k-th key's estimated place in them (a radix
  select over the sample's keys: the same key a sort would give);
  ``_topk_filter_kernel`` (program (row, split)) streams the row once and keeps the keys at or
  above the floor as candidates, in column order (int64 ``key << 32 | (2^31 - 1 - column)``;
  ``TOPK_LONG["GLUON"]``: :mod:`.topk_filter_gluon`'s kernel instead, same contract);
  ``_topk_select_kernel`` refines them to the exact k. A row whose floor turned out too high
  (fewer than k candidates) or too low (a split over ``CAP`` candidates) is flagged and taken by
  the exact kernel: the result never depends on the sample, only the time does.
* **Shorter rows**: a 64-bin value histogram between two sample keys (``_topk_hist_kernel``), the
  compaction of the k-th key's bin (``_topk_compact_kernel``) and the refinement
  (``_topk_final_kernel``); two reads of each logit, few candidates.

Why one read matters: at 512K keys the two-read path with a 512-column sample cost 1.9x the
indexer kernel it follows (docs/perf.md): the sample's largest key sat below the k-th key in ~1
row of 9, its open top bin then held more than ``CAP`` keys and the row took the exact kernel's
five passes, serially in one program. The floor sample grows with the row instead.

``method="torch"`` (and float64 logits, k > :data:`TOPK_RADIX_MAX_K`) masks the logits and calls
``torch.topk``: ties at the k-th place may then differ from the reference.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from cpkv.ops.api import check_topk_args

from .tuning import DeviceTuned, Op
from .variants import report_variant_declined

__all__ = ["TOPK_CONFIG", "TOPK_LONG", "TOPK_METHOD", "bin_count", "copied_rounds", "copy_bin",
           "key_round", "key_value",
           "list_short_row", "ord_key", "radix_digit", "radix_step", "row_range",
           "select_candidates", "topk"]

TOPK_BLOCK = 1024
#: "radix" (the exact kernels, default) or "torch" (mask, torch.topk, fix-up)
TOPK_METHOD = "radix"
#: larger k (the candidates' scratch grows with it), and float64 logits (whose keys have 64
#: bits), take the torch path
TOPK_RADIX_MAX_K = 4096
#: the two-read path's launch (BLOCK, CHUNK, num_warps, final_warps, BINS) on this process's
#: device: the tuning table's row (:mod:`.tuning`, each value's measurement named there)
TOPK_CONFIG: Mapping[str, int] = DeviceTuned(Op.TOPK)
#: candidates (keys in the K-th key's bin) a row may hand to the final kernel's refinement (at
#: least the power of two >= k); more take the exact kernel's 4 passes
TOPK_MIN_CAP = 1024
#: candidates per step of the final kernel's refinement
TOPK_REFINE_BLOCK = 256
#: columns, spread evenly over a row's range, whose sorted keys place the bins' bracket
TOPK_SAMPLE = 512
#: the one-read path for long rows (MIN_T, SAMPLE, CAP, BLOCK, PROGRAMS, SPLIT_MIN, SCRATCH_MB,
#: REFINE, num_warps, select_warps, a decode step's FEW_ROWS launches;
#: :class:`.tuning.TopkLongParams`) on this process's device
TOPK_LONG: Mapping[str, int] = DeviceTuned(Op.TOPK_LONG)
_RADIX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


# ---- kernels ---------------------------------------------------------------------------------
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
def _sorted_sample(x_ptr, row, start, cnt, K, sx0, sx1, SAMPLE: tl.constexpr):
    """SAMPLE keys spread evenly over a row's ``cnt`` columns from ``start``, sorted descending
    (-0.0 folded into 0.0), their places ``i``; the k-th largest key's estimated place in them
    (``est``: ~ sample keys at or above it) and the margin around it (4 standard deviations of
    that estimate, plus 8)."""
    i = tl.arange(0, SAMPLE)
    cols = start + (i.to(tl.int64) * cnt) // SAMPLE
    x = tl.load(x_ptr + row * sx0 + cols * sx1).to(tl.float32)
    x = tl.sort(tl.where(x == 0.0, 0.0, x), descending=True)
    est = (K * SAMPLE) // cnt
    margin = (4.0 * tl.sqrt(est.to(tl.float32) + 1.0)).to(tl.int32) + 8
    return i, x, est, margin


@triton.jit
def _list_short_row(out_ptr, row, start, count, K, KP: tl.constexpr):
    """A row holding at most K keys: its columns ascending, -1 padded."""
    for s0 in range(0, K, KP):
        slot = s0 + tl.arange(0, KP)
        tl.store(out_ptr + row * K + slot, tl.where(slot < count, start + slot, -1),
                 mask=slot < K)


@triton.jit
def _split_block(crow0, j, c0, nc, CAP: tl.constexpr, RB: tl.constexpr):
    """Split j's candidates [c0, c0 + RB) of its ``nc`` (at ``crow0 + j * CAP``): the int64
    composites (0 past nc), their keys and the mask."""
    i = c0 + tl.arange(0, RB)
    m = i < nc
    comp = tl.load(crow0 + j * CAP + i, mask=m, other=0)
    return comp, (comp >> 32).to(tl.int32), m


@triton.jit
def _split_round(crow0, cnt0, NS, prefix, p: tl.constexpr, CAP: tl.constexpr,
                 RB: tl.constexpr):
    """Round p's histogram over a row's candidates, split by split (split j's at ``crow0 + j *
    CAP``, its count at ``cnt0 + j``), RB a step. (One flat run over the splits, each element's
    split found by comparing it with the splits' ends, made the decode select 1.7x slower on
    an H100: 62 against 36 us, docs/perf.md session 21.)"""
    hist = tl.zeros([256], tl.int32)
    for j in range(0, NS):
        nc = tl.load(cnt0 + j)
        for c0 in range(0, nc, RB):
            _, s, m = _split_block(crow0, j, c0, nc, CAP, RB)
            d, m = _radix_digit(s, m, prefix, p)
            hist += tl.histogram(d, 256, mask=m)
    return hist


@triton.jit
def _key_round(kptr, nk, prefix, p: tl.constexpr, RB: tl.constexpr, FLOATS: tl.constexpr):
    """Round p's histogram over ``nk`` order keys at ``kptr`` (int32; ``FLOATS``: fp32 values,
    keyed here)."""
    hist = tl.zeros([256], tl.int32)
    for c0 in range(0, nk, RB):
        i = c0 + tl.arange(0, RB)
        m = i < nk
        x = tl.load(kptr + i, mask=m, other=0)
        s = _ord_key(x) if FLOATS else x
        d, m = _radix_digit(s, m, prefix, p)
        hist += tl.histogram(d, 256, mask=m)
    return hist


@triton.jit
def _copied_rounds(kptr, nk, need, prefix, RB: tl.constexpr):
    """Radix rounds 2 and 3 over the ``nk`` keys a select copied to ``kptr`` (:func:`_copy_bin`),
    between the barriers that make the copy visible to every thread and keep the output from
    overwriting it before every thread has read it: need, prefix and round 3's histogram."""
    tl.debug_barrier()
    for p in tl.static_range(2, 4):
        hist = _key_round(kptr, nk, prefix, p, RB, False)
        need, prefix = _radix_step(hist, need, prefix, p)
    tl.debug_barrier()
    return need, prefix, hist


@triton.jit
def _copy_bin(kptr, nput, s, m, prefix):
    """Append the keys ``s`` (masked by m) whose top 16 bits are the prefix's to ``kptr`` from
    place ``nput``, in order; the new count."""
    put = m & (((s ^ prefix) & -65536) == 0)
    tl.store(kptr + nput + tl.cumsum(put.to(tl.int32), 0) - 1, s, mask=put)
    return nput + tl.sum(put.to(tl.int32), axis=0)


@triton.jit
def _bin_count(hist, prefix, p: tl.constexpr):
    """How many keys round p's histogram put in the bin the prefix chose (the keys matching
    the prefix's top ``8 (p + 1)`` bits)."""
    b = (prefix >> (24 - 8 * p)) & 255
    return tl.sum(tl.where(tl.arange(0, 256) == b, hist, 0), axis=0)


@triton.jit
def _refine(crow0, cnt0, NS, orow, need, wpos, CAP: tl.constexpr, RB: tl.constexpr,
            COMPACT: tl.constexpr):
    """Take ``need`` of a row's candidates (int64 ``key << 32 | (2^31 - 1 - column)``, in column
    order across ``NS`` splits: split j's at ``crow0 + j * CAP``, its count at ``cnt0 + j``):
    an exact radix select (4 histograms of 8 bits) finds the need-th largest key, then the keys
    above it and the first ones equal to it by column are written from ``orow + wpos``.
    ``COMPACT``: after two rounds the keys matching the 16 bits found (round 1's bin, typically
    a few percent of the candidates) are copied into the ``need`` output slots the row is about
    to fill, and rounds 2 and 3 histogram only them (the output is written after; when the bin
    holds more keys than slots, the rounds run over every candidate)."""
    room = need
    prefix = tl.zeros([], tl.int32)  # the need-th key's bits found so far
    if COMPACT:
        for p in tl.static_range(2):
            hist = _split_round(crow0, cnt0, NS, prefix, p, CAP, RB)
            need, prefix = _radix_step(hist, need, prefix, p)
        nk = _bin_count(hist, prefix, 1)
        if nk <= room:
            kptr = orow + wpos
            nput = tl.zeros([], tl.int32)
            for j in range(0, NS):
                nc = tl.load(cnt0 + j)
                for c0 in range(0, nc, RB):
                    _, s, m = _split_block(crow0, j, c0, nc, CAP, RB)
                    nput = _copy_bin(kptr, nput, s, m, prefix)
            need, prefix, hist = _copied_rounds(kptr, nk, need, prefix, RB)
        else:
            for p in tl.static_range(2, 4):
                hist = _split_round(crow0, cnt0, NS, prefix, p, CAP, RB)
                need, prefix = _radix_step(hist, need, prefix, p)
    else:
        for p in tl.static_range(4):
            hist = _split_round(crow0, cnt0, NS, prefix, p, CAP, RB)
            need, prefix = _radix_step(hist, need, prefix, p)
    eq_seen = tl.zeros([], tl.int32)
    for j in range(0, NS):
        nc = tl.load(cnt0 + j)
        for c0 in range(0, nc, RB):
            comp, s, m = _split_block(crow0, j, c0, nc, CAP, RB)
            eq = m & (s == prefix)
            eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), 0)  # 1-based among equal keys
            take = ((m & (s > prefix)) | (eq & (eq_rank <= need))).to(tl.int32)
            tl.store(orow + wpos + tl.cumsum(take, 0) - 1, 2147483647 - comp.to(tl.int32),
                     mask=take != 0)
            wpos += tl.sum(take, axis=0)
            eq_seen += tl.sum(eq.to(tl.int32), axis=0)


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
        i, x, est, margin = _sorted_sample(x_ptr, row, start, cnt, K, sx0, sx1, SAMPLE)
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
        _list_short_row(out_ptr, row, start, count, K, KP)
    else:
        above = tl.load(meta_ptr + row * 2)  # ncand (next): 0 for the rows the exact kernel took
        _refine(cand_ptr + row * CAP, meta_ptr + row * 2 + 1, 1, out_ptr + row * K, K - above,
                above, CAP, RB, False)


@triton.jit
def _key_value(s):
    """The fp32 whose order key (:func:`_ord_key`) is ``s`` (the map is its own inverse on the
    bits; -0.0 comes back as 0.0)."""
    return (s ^ ((s >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _topk_floor_kernel(x_ptr, ks_ptr, ke_ptr, floor_ptr, T, K, sx0, sx1, SAMPLE: tl.constexpr,
                       ROUNDS: tl.constexpr):
    """Long rows, kernel 1 of 4 (one program per row holding more than K keys): the candidates'
    floor. SAMPLE columns spread evenly over the range; the k-th largest key is expected near
    sample place ``est = SAMPLE * K / count`` (descending); the floor is the sample key 4
    standard deviations of that estimate plus 8 places further down (-inf when the sample has
    no such place: every key is a candidate), found by a radix select over the sample's keys
    (histograms of 8 bits: a sort of a 4096-key sample was 0.1 ms of a decode layer, a
    latency of one program). ROUNDS < 4 of them give that key with its low ``32 - 8 ROUNDS``
    bits cleared: a floor at most ``2^(9 - 8 ROUNDS)`` relatively lower (a few more
    candidates), the same result."""
    row = tl.program_id(0).to(tl.int64)
    start, end = _row_range(ks_ptr, ke_ptr, row, T)
    cnt = end - start
    if cnt > K:
        i = tl.arange(0, SAMPLE)
        cols = start + (i.to(tl.int64) * cnt) // SAMPLE
        s = _ord_key(tl.load(x_ptr + row * sx0 + cols * sx1).to(tl.float32))
        est = (K * SAMPLE) // cnt
        place = est + (4.0 * tl.sqrt(est.to(tl.float32) + 1.0)).to(tl.int32) + 8
        need = place + 1  # the floor is the need-th largest sample key
        prefix = tl.zeros([], tl.int32)
        every = i >= 0
        for p in tl.static_range(ROUNDS):
            d, m = _radix_digit(s, every, prefix, p)
            need, prefix = _radix_step(tl.histogram(d, 256, mask=m), need, prefix, p)
        lo = tl.where(place < SAMPLE, _key_value(prefix), float("-inf"))
        tl.store(floor_ptr + row, lo)


@triton.jit
def _topk_filter_kernel(x_ptr, ks_ptr, ke_ptr, floor_ptr, cand_ptr, count_ptr, T, K, CS, NS,
                        sx0, sx1, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """Long rows, kernel 2 of 4 (program (row, split of CS columns)): one read of the split's
    logits; the keys at or above the row's floor are candidates, written in column order to the
    split's scratch row (at most CAP; the count goes on past it: the select kernel then flags the
    row)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    start, end = _row_range(ks_ptr, ke_ptr, row, T)
    cnt = tl.zeros([], tl.int32)
    if end - start > K:
        xrow = x_ptr + row * sx0
        crow = cand_ptr + (row * NS + j) * CAP
        lo = tl.load(floor_ptr + row)
        c_lo = start + j * CS
        c_hi = tl.minimum(c_lo + CS, end)
        for c0 in range(c_lo, c_hi, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            m = cols < c_hi
            x = tl.load(xrow + cols.to(tl.int64) * sx1, mask=m, other=float("-inf"))
            x = x.to(tl.float32)
            take = m & (x >= lo)
            nt = tl.sum(take.to(tl.int32), axis=0)
            if nt > 0:  # most blocks of a long row hold no candidate: no scan, no store
                pos = cnt + tl.cumsum(take.to(tl.int32), 0) - 1
                comp = (_ord_key(x).to(tl.int64) << 32) | (2147483647 - cols).to(tl.int64)
                tl.store(crow + pos, comp, mask=take & (pos < CAP))
            cnt += nt
    tl.store(count_ptr + row * NS + j, cnt)


@triton.jit
def _topk_select_kernel(ks_ptr, ke_ptr, out_ptr, cand_ptr, count_ptr, meta_ptr, T, K, NS,
                        KP: tl.constexpr, CAP: tl.constexpr, NSP: tl.constexpr,
                        RB: tl.constexpr, COMPACT: tl.constexpr):
    """Long rows, kernel 3 of 4 (one program per row): rows holding at most K keys list them
    ascending (-1 padded); the others refine their candidates, splits in column order (exact
    radix select, 4 histograms of 8 bits, then the keys above the K-th and the first ones equal
    to it by column). A row with fewer than K candidates (its floor was above its K-th key) or
    a split over CAP is left to the exact kernel (``meta = -1``)."""
    row = tl.program_id(0).to(tl.int64)
    start, end = _row_range(ks_ptr, ke_ptr, row, T)
    count = tl.maximum(end - start, 0)
    if count <= K:
        _list_short_row(out_ptr, row, start, count, K, KP)
    else:
        js = tl.arange(0, NSP)
        cnts = tl.load(count_ptr + row * NS + js, mask=js < NS, other=0)
        most = tl.max(cnts, axis=0)
        bad = (tl.sum(cnts, axis=0) < K) | (most > CAP)
        if bad:
            tl.store(meta_ptr + row * 2, -1)
        else:
            _refine(cand_ptr + row * NS * CAP, count_ptr + row * NS, NS, out_ptr + row * K,
                    K + tl.zeros([], tl.int32), tl.zeros([], tl.int32), CAP, RB, COMPACT)
            tl.store(meta_ptr + row * 2, K)


#: the pieces the fused indexer top-k (:mod:`cpkv_backend_triton.indexer_topk`) builds on: the
#: order-preserving key and its inverse, the radix rounds (a round over keys or values, a bin's
#: count and its copy), a row's clipped range and the listing of a row holding at most k keys (Triton helpers)
ord_key = _ord_key
key_value = _key_value
key_round = _key_round
bin_count = _bin_count
copy_bin = _copy_bin
copied_rounds = _copied_rounds
list_short_row = _list_short_row
radix_digit = _radix_digit
radix_step = _radix_step
row_range = _row_range


# ---- the op ----------------------------------------------------------------------------------
def select_candidates(cand: torch.Tensor, count: torch.Tensor, key_start: torch.Tensor,
                      key_end: torch.Tensor, out: torch.Tensor, meta: torch.Tensor, t: int,
                      k: int, cap: int, warps: int) -> None:
    """The long rows' select (``_topk_select_kernel``) over candidates a filter left: ``cand``
    int64 ``key << 32 | (2^31 - 1 - column)``, split j of row i at ``(i * NS + j) * cap``, in
    column order within a split and splits in column order, ``count`` int32 [N, NS] (past
    ``cap``: the split overflowed). Rows holding at most k keys are listed ascending; a row with
    fewer than k candidates or an overflowed split gets ``meta[i, 0] = -1`` (its ``out`` row
    left for an exact pass), the others their k columns in ``out`` and ``meta[i, 0] = k``.
    ``warps``: the select kernel's."""
    cfg = TOPK_LONG
    n, ns = count.shape
    nsp = _pow2(ns, 1)
    _topk_select_kernel[(n,)](key_start, key_end, out, cand, count, meta, t, k, ns,
                              KP=_pow2(k), CAP=cap, NSP=nsp, RB=min(cfg["REFINE"], cap),
                              COMPACT=bool(cfg["COMPACT"]), num_warps=warps)


def _splits(n: int, t: int, cap: int, split_min: int = 0) -> int:
    """(row, split) programs for the filter: enough to fill the GPU when a call has few rows,
    splits of at least SPLIT_MIN columns, and the candidates' scratch (``cap`` int64 a split) at
    most an eighth of the logits' bytes (the caller's memory budget is sized by the logits: at
    1M keys and a 512 MiB budget, 16 splits of 128 rows took 268 MB more than the budget) or
    SCRATCH_MB, whichever is larger (a decode step's few rows: one row of 256K logits alone
    would allow one split, and one program streamed the row). ``split_min``: the table's
    SPLIT_MIN when 0."""
    cfg = TOPK_LONG
    want = triton.cdiv(cfg["PROGRAMS"], max(n, 1))
    by_memory = max((4 * t) // (8 * 8 * cap), (cfg["SCRATCH_MB"] << 20) // (8 * cap * max(n, 1)))
    return max(1, min(want, triton.cdiv(t, split_min or cfg["SPLIT_MIN"]), by_memory))


def _radix(logits: torch.Tensor, k: int, ks: torch.Tensor, ke: torch.Tensor,
           out: torch.Tensor) -> None:
    """The two-read path (bracket, histogram, compaction, exact, final)."""
    n, t = logits.shape
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


def _long(logits: torch.Tensor, k: int, ks: torch.Tensor, ke: torch.Tensor,
          out: torch.Tensor) -> None:
    """The one-read path for long rows (floor, filter, select, exact)."""
    n, t = logits.shape
    cfg = TOPK_LONG
    # a decode step's few rows (each kernel's time one program's latency): the few_ launches
    few = n <= cfg["FEW_ROWS"]

    def pick(field: str, many: int) -> int:
        return cfg[field] if few and cfg[field] else many

    cap = max(pick("few_CAP", cfg["CAP"]), _pow2(k))
    blk = min(pick("few_BLOCK", cfg["BLOCK"]), _pow2(t))
    ns = _splits(n, t, cap, pick("few_SPLIT_MIN", cfg["SPLIT_MIN"]))
    cs = triton.cdiv(triton.cdiv(t, ns), blk) * blk  # columns per split
    ns = triton.cdiv(t, cs)
    dev = logits.device
    floor = torch.empty(n, dtype=torch.float32, device=dev)
    cand = torch.empty(n * ns * cap, dtype=torch.int64, device=dev)
    count = torch.empty(n, ns, dtype=torch.int32, device=dev)
    meta = torch.empty(n, 2, dtype=torch.int32, device=dev)
    sx0, sx1 = logits.stride(0), logits.stride(1)
    warps = cfg["num_warps"]
    _topk_floor_kernel[(n,)](logits, ks, ke, floor, t, k, sx0, sx1, SAMPLE=cfg["SAMPLE"],
                             ROUNDS=cfg["FLOOR_ROUNDS"], num_warps=pick("few_floor_warps", warps))
    if not (cfg["GLUON"] and _gluon_filter(logits, ks, ke, floor, cand, count, k, cs, ns, blk,
                                           cap, warps)):
        _topk_filter_kernel[(n, ns)](logits, ks, ke, floor, cand, count, t, k, cs, ns, sx0, sx1,
                                     BLOCK=blk, CAP=cap, num_warps=warps)
    select_candidates(cand, count, ks, ke, out, meta, t, k, cap,
                      pick("few_select_warps", cfg["select_warps"]))
    _topk_exact_kernel[(n,)](logits, ks, ke, out, meta, t, k, sx0, sx1,
                             BLOCK=min(TOPK_CONFIG["BLOCK"], _pow2(t)), num_warps=warps)


#: the reasons the Gluon filter declined, each reported once a process
_GLUON_DECLINED: set[str] = set()


def _gluon_filter(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, floor: torch.Tensor,
                  cand: torch.Tensor, count: torch.Tensor, k: int, cs: int, ns: int, blk: int,
                  cap: int, warps: int) -> bool:
    """``GLUON = 1``: the filter of :mod:`.topk_filter_gluon`; False (reported once per reason,
    the Triton filter runs) when it cannot take the call. Logits off a GPU decline before
    Gluon is imported: in a process whose triton was imported under the CPU interpreter (the
    test suite's), importing Gluon raises (its standard library expects compiled functions)."""
    why: str | None
    if not logits.is_cuda:
        why = "the Gluon filter runs on CUDA devices (not under the interpreter)"
    else:
        try:
            from .topk_filter_gluon import gluon_filter, gluon_filter_declines
        except ImportError as exc:  # a Triton without Gluon
            why = f"Gluon cannot be imported ({exc})"
        else:
            why = gluon_filter_declines(logits, blk, warps)
    if why is None:
        gluon_filter(logits, ks, ke, floor, cand, count, k, cs, ns, blk, cap, warps)
        return True
    report_variant_declined(_GLUON_DECLINED, "triton:topk",
                            "the Gluon filter (TOPK_LONG GLUON=1)", "the Triton filter", why)
    return False


def topk(logits: torch.Tensor, k: int, key_start: torch.Tensor, key_end: torch.Tensor,
         method: str = TOPK_METHOD) -> torch.Tensor:
    """Columns of the k largest logits in each row's range; int32 [N, k], -1 padded; rows holding
    at most k keys list them all ascending. See :class:`cpkv.ops.KVOps`.

    ``method="radix"`` (default): the exact select of the module docstring, the reference's set
    (ties by ascending column) in the kernels' order (chosen columns ascending within each
    stage). ``"torch"``: a Triton kernel masks the logits, ``torch.topk`` (sorted) selects, a
    Triton kernel fixes up short rows and padding; ties at the k-th place may then resolve
    differently from the reference.

    Raises:
        ValueError: ``logits`` is not 2-D float, ``k`` is negative, a range is mis-shaped, or
            ``method`` is unknown.
    """
    if method not in ("radix", "torch"):
        raise ValueError(f"topk method must be 'radix' or 'torch', got {method!r}")
    check_topk_args(logits, k, key_start, key_end)
    n, t = logits.shape
    out = torch.empty(n, k, dtype=torch.int32, device=logits.device)
    if n == 0 or k == 0:
        return out
    ks, ke = key_start.contiguous(), key_end.contiguous()
    select = k < t  # else no row holds more than k keys: each lists its range ascending
    if select and method == "radix" and k <= TOPK_RADIX_MAX_K and logits.dtype in _RADIX_DTYPES:
        if t >= TOPK_LONG["MIN_T"]:
            _long(logits, k, ks, ke, out)
        else:
            _radix(logits, k, ks, ke, out)
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

