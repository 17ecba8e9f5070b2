"""The fused indexer + top-k's kernels (:mod:`cpkv_backend_triton.indexer_topk` launches them,
its docstring gives the five steps): the sample's floor, the filter (the plain indexer's tiles,
:func:`.indexer.indexer_tile`, whose epilogue appends the candidates at or above the floor),
the select over the unordered candidates, and the exact pass over flagged rows."""

from __future__ import annotations

import triton
import triton.language as tl

from .indexer import head_logits, indexer_tile, key_tile, query_heads
from .radix import (
    bin_count,
    copied_rounds,
    copy_bin,
    key_round,
    long_row,
    ord_key,
    radix_digit,
    radix_step,
    row_range,
    sample_floor,
    select_row,
)


@triton.jit
def _sample_floor_kernel(xs_ptr, ks_ptr, ke_ptr, floor_ptr, T, K, NSC, STRIDE, sx0,
                         SP: tl.constexpr, ROUNDS: tl.constexpr):
    """Step 2 (a program a row holding more than K keys): the floor from the row's sampled
    logits (``xs`` [N, NSC]) by a radix select, -inf when the sample has no key at its place."""
    row = tl.program_id(0).to(tl.int64)
    start, end = row_range(ks_ptr, ke_ptr, row, T)
    cnt = end - start
    if cnt > K:
        i = tl.arange(0, SP)
        valid = i < NSC
        s = ord_key(tl.load(xs_ptr + row * sx0 + i, mask=valid, other=float("-inf")))
        # the sample's columns inside [start, end): i * STRIDE in it
        m = (end + STRIDE - 1) // STRIDE - (start + STRIDE - 1) // STRIDE
        lo = sample_floor(s, valid, (K * m) // cnt, m, ROUNDS)
        tl.store(floor_ptr + row, lo)


#: one logit's candidate test and append, as PTX (``ASM``): ``$1`` the logit (-inf outside its
#: row's range), ``$2`` the row's floor, ``$3`` the column, ``$4`` the row's count, ``$5`` /
#: ``$6`` its value / column slots, ``$7`` CAP - 1. The append is a branch most lanes skip
#: (~1 % of the logits are candidates), one logit at a time, so the tile's registers stay the
#: plain kernel's (164 against 168; the same append in Triton's tensor ops holds every
#: element's slot and addresses at once: 228-255 registers, 2 CTAs an SM instead of 3)
_APPEND_PTX = tl.constexpr("""{
.reg .pred p;
.reg .u32 s;
.reg .u64 a;
mov.u32 $0, 0;
setp.ge.f32 p, $1, $2;
@!p bra SKIP;
atom.global.relaxed.gpu.add.u32 s, [$4], 1;
min.u32 s, s, $7;
mad.wide.u32 a, s, 4, $5;
st.global.f32 [a], $1;
mad.wide.u32 a, s, 4, $6;
st.global.u32 [a], $3;
SKIP:
}""")


@triton.jit
def _fused_filter_kernel(q_ptr, w_ptr, k_ptr, scale_ptr, ks_ptr, ke_ptr, floor_ptr, val_ptr,
                         col_ptr, count_ptr, N, T, K, CAP,
                         sq0, sq1, sq2, sw0, sw1, sk0, sk1,
                         H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         FP8: tl.constexpr, UPCAST: tl.constexpr, ASM: tl.constexpr):
    """Step 3 (program (key tile, row block), as the plain kernel's): the logits at or above
    the row's floor appended at slots from a relaxed atomic add on its count (past CAP the last
    slot is rewritten). ``ASM``: the append as :data:`_APPEND_PTX`, else Triton's tensor ops."""
    pid_n = tl.program_id(0)
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
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < T
    # the plain kernel's shape (the tile zeroed, computed under the branch, the epilogue after
    # it): computing and using the tile inside the branch took 223 registers instead of 166
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if (n0 < hi) & (n0 + BLOCK_N > lo):
        acc = indexer_tile(q_ptr, w_ptr, k_ptr, scale_ptr, rows64, rmask, cols.to(tl.int64),
                           cmask, sq0, sq1, sq2, sw0, sw1, sk0, sk1, H, D, DP,
                           BLOCK_M, BLOCK_N, FP8, UPCAST)
    # +inf: a row holding at most K keys (or none) takes no candidate
    fl = tl.load(floor_ptr + rows64, mask=long, other=float("inf"))
    inr = (cols[None, :] >= start[:, None]) & (cols[None, :] < end[:, None])
    x = tl.where(inr, acc, float("-inf"))
    if ASM:
        z = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
        tl.inline_asm_elementwise(
            _APPEND_PTX, "=r,f,f,r,l,l,l,r",
            [x, fl[:, None], cols[None, :], (count_ptr + rows64).to(tl.int64, bitcast=True)[:, None],
             (val_ptr + rows64 * CAP).to(tl.int64, bitcast=True)[:, None],
             (col_ptr + rows64 * CAP).to(tl.int64, bitcast=True)[:, None], CAP - 1 + z],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        take = x >= fl[:, None]
        slot = tl.atomic_add(count_ptr + rows64[:, None] + tl.zeros_like(cols)[None, :].to(
            tl.int64), 1, mask=take, sem="relaxed")
        slot = tl.minimum(slot, CAP - 1)
        tl.store((val_ptr + rows64 * CAP)[:, None] + slot, x, mask=take)
        tl.store((col_ptr + rows64 * CAP)[:, None] + slot, cols[None, :] + tl.zeros_like(slot),
                 mask=take)


@triton.jit
def _column_cut(vrow, crow, nc, need, key, RB: tl.constexpr):
    """The need-th largest ``2^31 - 1 - column`` (columns at ``crow``) among a row's ``nc``
    candidates (values at ``vrow``) whose order key is ``key``: 4 radix rounds of 8 bits in
    steps of RB candidates."""
    prefix = tl.zeros([], tl.int32)  # the bits found so far
    for p in tl.static_range(4):
        hist = tl.zeros([256], tl.int32)
        for c0 in range(0, nc, RB):
            i = c0 + tl.arange(0, RB)
            m = i < nc
            s = ord_key(tl.load(vrow + i, mask=m, other=0.0))
            inv = 2147483647 - tl.load(crow + i, mask=m, other=0)
            d, mm = radix_digit(inv, m & (s == key), prefix, p)
            hist += tl.histogram(d, 256, mask=mm)
        need, prefix = radix_step(hist, need, prefix, p)
    return prefix


@triton.jit
def _kth_key(vrow, nc, need, orow, RB: tl.constexpr, COMPACT: tl.constexpr):
    """The need-th largest order key of a row's ``nc`` candidates (values at ``vrow``) by 4
    radix rounds of 8 bits: how many of the candidates equal to it are still needed, its bits,
    and the last round's histogram. ``COMPACT``: the last two rounds over the keys matching the
    first two rounds' 16 bits only, copied into the row's ``need`` output slots at ``orow``
    first (the output is written after); a bin larger than the slots keeps the rounds over
    every candidate."""
    room = need
    prefix = tl.zeros([], tl.int32)
    for p in tl.static_range(2):
        hist = key_round(vrow, nc, prefix, p, RB, True)
        need, prefix = radix_step(hist, need, prefix, p)
    if COMPACT:  # the constexpr alone: Triton does not compile `COMPACT and <tensor>`
        nk = bin_count(hist, prefix, 1)
        if nk <= room:
            nput = tl.zeros([], tl.int32)
            for c0 in range(0, nc, RB):
                i = c0 + tl.arange(0, RB)
                m = i < nc
                nput = copy_bin(orow, nput, ord_key(tl.load(vrow + i, mask=m, other=0.0)), m,
                                prefix)
            need, prefix, hist = copied_rounds(orow, nk, need, prefix, RB)
        else:
            need, prefix, hist = _last_key_rounds(vrow, nc, need, prefix, RB)
    else:
        need, prefix, hist = _last_key_rounds(vrow, nc, need, prefix, RB)
    return need, prefix, hist


@triton.jit
def _last_key_rounds(vrow, nc, need, prefix, RB: tl.constexpr):
    """Radix rounds 2 and 3 over every one of a row's ``nc`` candidates."""
    hist = tl.zeros([256], tl.int32)
    for p in tl.static_range(2, 4):
        hist = key_round(vrow, nc, prefix, p, RB, True)
        need, prefix = radix_step(hist, need, prefix, p)
    return need, prefix, hist


@triton.jit
def _fused_select_kernel(val_ptr, col_ptr, count_ptr, ks_ptr, ke_ptr, out_ptr, meta_ptr, T, K,
                         CAP, KP: tl.constexpr, RB: tl.constexpr, COMPACT: tl.constexpr):
    """Step 4 (a program a row): short rows listed ascending; the others' exact K of their
    candidates, written ascending; fewer than K or more than CAP: ``meta = -1`` (the exact pass)."""
    row = tl.program_id(0).to(tl.int64)
    if long_row(ks_ptr, ke_ptr, out_ptr, row, T, K, KP):
        nc = tl.load(count_ptr + row)
        if (nc < K) | (nc > CAP):
            tl.store(meta_ptr + row * 2, -1)
        else:
            vrow = val_ptr + row * CAP
            crow = col_ptr + row * CAP
            orow = out_ptr + row * K
            # the K-th key, and how many candidates equal to it to take
            need, prefix, hist = _kth_key(vrow, nc, K + tl.zeros([], tl.int32), orow, RB,
                                          COMPACT)
            # candidates equal to the K-th key: the last round's bin of its low 8 bits
            tied = tl.sum(tl.where(tl.arange(0, 256) == (prefix & 255), hist, 0), axis=0)
            # the tied candidates kept: those whose 2^31 - 1 - column is at least cut (all of
            # them unless fewer are needed: then the need-th largest, i.e. the lowest columns)
            cut = tl.full([], -2147483648, tl.int32)
            if need < tied:
                cut = _column_cut(vrow, crow, nc, need, prefix, RB)
            wpos = tl.zeros([], tl.int32)
            for c0 in range(0, nc, RB):
                i = c0 + tl.arange(0, RB)
                m = i < nc
                s = ord_key(tl.load(vrow + i, mask=m, other=0.0))
                col = tl.load(crow + i, mask=m, other=0)
                take = m & ((s > prefix) | ((s == prefix) & (2147483647 - col >= cut)))
                t32 = take.to(tl.int32)
                tl.store(orow + wpos + tl.cumsum(t32, 0) - 1, col, mask=take)
                wpos += tl.sum(t32, axis=0)
            tl.debug_barrier()  # the row's K columns written by every thread: sort them
            slot = tl.arange(0, KP)
            chosen = tl.load(orow + slot, mask=slot < K, other=2147483647)
            tl.store(orow + slot, tl.sort(chosen), mask=slot < K)
            tl.store(meta_ptr + row * 2, K)


@triton.jit
def _indexer_keys(src, cols, m, FP8: tl.constexpr, UPCAST: tl.constexpr):
    """The order keys of one row's logits at ``cols`` (``src``: the row's query heads and
    weights, the keys' operands), for :func:`.radix.select_row`."""
    q_ptr, qt, wv, k_ptr, scale_ptr, d, dmask, sk0, sk1 = src
    cols64 = cols.to(tl.int64)
    x = head_logits(qt, wv, key_tile(k_ptr, q_ptr, cols64, m, d, dmask, sk0, sk1, UPCAST), UPCAST)
    if FP8:
        x = x * tl.load(scale_ptr + cols64, mask=m, other=0.0)
    return ord_key(x)


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
            qt, wv, d, dmask = query_heads(q_ptr, w_ptr, row, sq0, sq1, sq2, sw0, sw1, H, HP, D,
                                           DP, UPCAST)
            select_row(_indexer_keys, (q_ptr, qt, wv, k_ptr, scale_ptr, d, dmask, sk0, sk1),
                       start, end, out_ptr + row * K, K + tl.zeros([], tl.int32), BLOCK_N, FP8,
                       UPCAST)
            tl.store(meta_ptr + row * 2, K)
