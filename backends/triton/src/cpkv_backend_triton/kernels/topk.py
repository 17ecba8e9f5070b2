"""The top-k kernels (:mod:`cpkv_backend_triton.topk` launches them): the two-read path for
shorter rows (bracket, histogram, compaction, final), the one-read path for long rows (floor,
filter, select), the exact kernel both fall back to, and the ``torch.topk`` path's mask and
fix-up. Keys and radix rounds: :mod:`.radix`; docs/triton.md describes each path."""

from __future__ import annotations

import triton
import triton.language as tl

from .radix import (
    bin_count,
    copied_rounds,
    copy_bin,
    long_row,
    ord_key,
    pick_bin,
    radix_digit,
    radix_step,
    row_range,
    sample_floor,
    sample_margin,
    select_row,
    take_ranked,
)


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
def _chunk(start, end, j, CH):
    """Chunk j's columns ``[c_lo, c_hi)``: CH columns of a row's range ``[start, end)``."""
    c_lo = start + j * CH
    return c_lo, tl.minimum(c_lo + CH, end)


@triton.jit
def _block(xrow, c0, c_hi, sx1, other, BLOCK: tl.constexpr):
    """BLOCK columns of a row from ``c0``: the columns, the mask (below ``c_hi``), the logits
    in fp32 (``other`` where masked)."""
    cols = c0 + tl.arange(0, BLOCK)
    m = cols < c_hi
    x = tl.load(xrow + cols.to(tl.int64) * sx1, mask=m, other=other).to(tl.float32)
    return cols, m, x


@triton.jit
def _logit_keys(src, cols, m, UNUSED_A: tl.constexpr, UNUSED_B: tl.constexpr):
    """The order keys of a row's logits at ``cols`` (``src``: the row's pointer and column
    stride), for :func:`.radix.select_row` (no flags)."""
    xrow, sx1 = src
    return ord_key(tl.load(xrow + cols.to(tl.int64) * sx1, mask=m, other=0.0).to(tl.float32))


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
def _sorted_sample(x_ptr, row, start, cnt, K, sx0, sx1, SAMPLE: tl.constexpr):
    """SAMPLE keys spread evenly over a row's ``cnt`` columns from ``start``, sorted descending
    (-0.0 folded into 0.0), their places ``i``; the k-th largest key's estimated place in them
    (``est``: ~ sample keys at or above it) and the margin around it
    (:func:`.radix.sample_margin`)."""
    i = tl.arange(0, SAMPLE)
    cols = start + (i.to(tl.int64) * cnt) // SAMPLE
    x = tl.load(x_ptr + row * sx0 + cols * sx1).to(tl.float32)
    x = tl.sort(tl.where(x == 0.0, 0.0, x), descending=True)
    est = (K * SAMPLE) // cnt
    return i, x, est, sample_margin(est)


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
    CAP``, its count at ``cnt0 + j``), RB a step."""
    hist = tl.zeros([256], tl.int32)
    for j in range(0, NS):
        nc = tl.load(cnt0 + j)
        for c0 in range(0, nc, RB):
            _, s, m = _split_block(crow0, j, c0, nc, CAP, RB)
            d, m = radix_digit(s, m, prefix, p)
            hist += tl.histogram(d, 256, mask=m)
    return hist


@triton.jit
def _last_split_rounds(crow0, cnt0, NS, need, prefix, CAP: tl.constexpr, RB: tl.constexpr):
    """Radix rounds 2 and 3 over every candidate of a row's ``NS`` splits."""
    hist = tl.zeros([256], tl.int32)
    for p in tl.static_range(2, 4):
        hist = _split_round(crow0, cnt0, NS, prefix, p, CAP, RB)
        need, prefix = radix_step(hist, need, prefix, p)
    return need, prefix, hist


@triton.jit
def _refine(crow0, cnt0, NS, orow, need, wpos, CAP: tl.constexpr, RB: tl.constexpr,
            COMPACT: tl.constexpr):
    """Take ``need`` of a row's candidates (int64 ``key << 32 | (2^31 - 1 - column)`` in
    column order over ``NS`` splits at ``crow0 + j * CAP``, counts at ``cnt0 + j``) by an exact
    radix select, written from ``orow + wpos``. ``COMPACT``: rounds 2 and 3 over round 1's
    16-bit bin only, copied into the output slots first (over every candidate when it does not
    fit)."""
    room = need
    prefix = tl.zeros([], tl.int32)  # the need-th key's bits found so far
    for p in tl.static_range(2):
        hist = _split_round(crow0, cnt0, NS, prefix, p, CAP, RB)
        need, prefix = radix_step(hist, need, prefix, p)
    if COMPACT:  # the constexpr alone: Triton does not compile `COMPACT and <tensor>`
        nk = bin_count(hist, prefix, 1)
        if nk <= room:
            kptr = orow + wpos
            nput = tl.zeros([], tl.int32)
            for j in range(0, NS):
                nc = tl.load(cnt0 + j)
                for c0 in range(0, nc, RB):
                    _, s, m = _split_block(crow0, j, c0, nc, CAP, RB)
                    nput = copy_bin(kptr, nput, s, m, prefix)
            need, prefix, hist = copied_rounds(kptr, nk, need, prefix, RB)
        else:
            need, prefix, hist = _last_split_rounds(crow0, cnt0, NS, need, prefix, CAP, RB)
    else:
        need, prefix, hist = _last_split_rounds(crow0, cnt0, NS, need, prefix, CAP, RB)
    eq_seen = tl.zeros([], tl.int32)
    for j in range(0, NS):
        nc = tl.load(cnt0 + j)
        for c0 in range(0, nc, RB):
            comp, s, m = _split_block(crow0, j, c0, nc, CAP, RB)
            wpos, eq_seen = take_ranked(orow, wpos, eq_seen, s, m,
                                        2147483647 - comp.to(tl.int32), prefix, need)


@triton.jit
def _topk_bracket_kernel(x_ptr, ks_ptr, ke_ptr, br_ptr, T, K, sx0, sx1, NB: tl.constexpr,
                         SAMPLE: tl.constexpr):
    """Top-k, kernel 1 of 5 (a program a row holding more than K keys): the bins' bracket,
    the sample keys a margin either side of the k-th key's estimated place (docs/triton.md)."""
    row = tl.program_id(0).to(tl.int64)
    start, end = row_range(ks_ptr, ke_ptr, row, T)
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
    start, end = row_range(ks_ptr, ke_ptr, row, T)
    hist = tl.zeros([NB], tl.int32)
    if end - start > K:
        xrow = x_ptr + row * sx0
        lo = tl.load(br_ptr + row * 2)
        inv = tl.load(br_ptr + row * 2 + 1)
        c_lo, c_hi = _chunk(start, end, j, CH)
        for c0 in range(c_lo, c_hi, BLOCK):
            _, m, x = _block(xrow, c0, c_hi, sx1, 0.0, BLOCK)
            hist += tl.histogram(_value_bin(x, lo, inv, NB), NB, mask=m)
    tl.store(hist_ptr + (row * NCH + j) * NB + tl.arange(0, NB), hist)


@triton.jit
def _topk_compact_kernel(x_ptr, ks_ptr, ke_ptr, br_ptr, hist_ptr, out_ptr, cand_ptr, meta_ptr, T,
                         K, CH, sx0, sx1, NCH, BLOCK: tl.constexpr, NB: tl.constexpr,
                         NCHP: tl.constexpr, CAP: tl.constexpr):
    """Top-k, kernel 3 of 5 (program (row, chunk)): keys in bins above the K-th key's go to
    the output row's first slots, its bin's keys to the scratch row as int64 ``key << 32 |
    (2^31 - 1 - column)`` in column order; more than CAP: ``meta = -1`` (the exact kernel)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    start, end = row_range(ks_ptr, ke_ptr, row, T)
    if end - start > K:
        jj = tl.arange(0, NCHP)
        bins = tl.arange(0, NB)
        h = tl.load(hist_ptr + (row * NCH + jj[:, None]) * NB + bins[None, :],
                    mask=(jj < NCH)[:, None], other=0)
        b, above = pick_bin(tl.sum(h, axis=0), K, NB)
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
            c_lo, c_hi = _chunk(start, end, j, CH)
            for c0 in range(c_lo, c_hi, BLOCK):
                cols, m, x = _block(xrow, c0, c_hi, sx1, 0.0, BLOCK)
                vb = _value_bin(x, lo, inv, NB)
                gt = m & (vb > b)
                eq = m & (vb == b)
                # both running counts in one scan (a block holds < 2^16 columns)
                both = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)
                comp = (ord_key(x).to(tl.int64) << 32) | (2147483647 - cols).to(tl.int64)
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
    start, end = row_range(ks_ptr, ke_ptr, row, T)
    if end - start > K:  # noqa: SIM102 (the meta load only for rows holding more than K keys)
        if tl.load(meta_ptr + row * 2) < 0:
            select_row(_logit_keys, (x_ptr + row * sx0, sx1), start, end, out_ptr + row * K,
                       K + tl.zeros([], tl.int32), BLOCK, False, False)
            tl.store(meta_ptr + row * 2, K)
            tl.store(meta_ptr + row * 2 + 1, 0)


@triton.jit
def _topk_final_kernel(ks_ptr, ke_ptr, out_ptr, cand_ptr, meta_ptr, T, K, KP: tl.constexpr,
                       CAP: tl.constexpr, RB: tl.constexpr):
    """Top-k, kernel 5 of 5 (a program a row): short rows listed ascending (-1 padded);
    longer rows refine their candidates and append the ``K - above`` they take."""
    row = tl.program_id(0).to(tl.int64)
    if long_row(ks_ptr, ke_ptr, out_ptr, row, T, K, KP):
        above = tl.load(meta_ptr + row * 2)  # ncand (next): 0 for the rows the exact kernel took
        _refine(cand_ptr + row * CAP, meta_ptr + row * 2 + 1, 1, out_ptr + row * K, K - above,
                above, CAP, RB, False)


@triton.jit
def _topk_floor_kernel(x_ptr, ks_ptr, ke_ptr, floor_ptr, T, K, sx0, sx1, SAMPLE: tl.constexpr,
                       ROUNDS: tl.constexpr):
    """Long rows, kernel 1 of 4 (a program a row holding more than K keys): the candidates'
    floor from SAMPLE columns by a radix select (-inf: every key); ROUNDS < 4 lower it a little."""
    row = tl.program_id(0).to(tl.int64)
    start, end = row_range(ks_ptr, ke_ptr, row, T)
    cnt = end - start
    if cnt > K:
        i = tl.arange(0, SAMPLE)
        cols = start + (i.to(tl.int64) * cnt) // SAMPLE
        s = ord_key(tl.load(x_ptr + row * sx0 + cols * sx1).to(tl.float32))
        lo = sample_floor(s, i >= 0, (K * SAMPLE) // cnt, SAMPLE, ROUNDS)
        tl.store(floor_ptr + row, lo)


@triton.jit
def _topk_filter_kernel(x_ptr, ks_ptr, ke_ptr, floor_ptr, cand_ptr, count_ptr, T, K, CS, NS,
                        sx0, sx1, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """Long rows, kernel 2 of 4 (program (row, split of CS columns)): the keys at or above the
    floor written in column order to the split's scratch (at most CAP; the count goes on)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    start, end = row_range(ks_ptr, ke_ptr, row, T)
    cnt = tl.zeros([], tl.int32)
    if end - start > K:
        xrow = x_ptr + row * sx0
        crow = cand_ptr + (row * NS + j) * CAP
        lo = tl.load(floor_ptr + row)
        c_lo, c_hi = _chunk(start, end, j, CS)
        for c0 in range(c_lo, c_hi, BLOCK):
            cols, m, x = _block(xrow, c0, c_hi, sx1, float("-inf"), BLOCK)
            take = m & (x >= lo)
            nt = tl.sum(take.to(tl.int32), axis=0)
            if nt > 0:  # most blocks of a long row hold no candidate: no scan, no store
                pos = cnt + tl.cumsum(take.to(tl.int32), 0) - 1
                comp = (ord_key(x).to(tl.int64) << 32) | (2147483647 - cols).to(tl.int64)
                tl.store(crow + pos, comp, mask=take & (pos < CAP))
            cnt += nt
    tl.store(count_ptr + row * NS + j, cnt)


@triton.jit
def _topk_select_kernel(ks_ptr, ke_ptr, out_ptr, cand_ptr, count_ptr, meta_ptr, T, K, NS,
                        KP: tl.constexpr, CAP: tl.constexpr, NSP: tl.constexpr,
                        RB: tl.constexpr, COMPACT: tl.constexpr):
    """Long rows, kernel 3 of 4 (a program a row): short rows listed ascending (-1 padded),
    the others refine their candidates; fewer than K or a split over CAP: ``meta = -1``."""
    row = tl.program_id(0).to(tl.int64)
    if long_row(ks_ptr, ke_ptr, out_ptr, row, T, K, KP):
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
