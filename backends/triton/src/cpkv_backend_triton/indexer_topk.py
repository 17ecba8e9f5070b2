"""The lightning indexer and the top-k in one pass over the keys, for long rows (issue 38): the
[N, T] logits are never stored.

At 512K keys a 64K-row chunk's logits are 128 GB written by the indexer and read back by the
top-k (:mod:`cpkv_backend_triton.topk`'s long-row path: a sampled floor, a filter, a select). Here
the indexer's epilogue does the filter:

1. **Sample** (:func:`indexer_topk`'s ``sample_logits``, the plain indexer op): the logits of
   every row at ``SAMPLE`` columns spread evenly over the T keys (the columns ``i * stride``, one
   grid for all rows, so the indexer's row tiles share their key tiles): N x SAMPLE floats.
2. **Floor** (``_sample_floor_kernel``, one program per row holding more than k keys): the rule
   of the long-row top-k's floor (:func:`.topk.topk`): with ``m`` of the row's range among the
   sample, the k-th largest key is expected near sample place ``est = k * m / count``; the floor
   is the sample key ``4 sqrt(est + 1) + 8`` places further down (-inf, every key, when the
   sample has no such place), found by a radix select over the sample (4 histograms of 8 bits),
   as a float.
3. **Filter** (``_fused_filter_kernel``): the plain indexer kernel's grid and tiles (program
   (key tile, row block), the key tiles of a row block side by side), each tile computed as the
   plain indexer op (:mod:`.attention`) computes it (the same per-head dots, relu, weight and
   scale, in the same order: the same logits); instead of the tile, the logits at or above their
   row's floor are appended to the row's CAP slots (value and column, a slot from one relaxed
   atomic add per candidate on the row's count: ~1 % of the logits, in no particular order).
   Everything else of the tile stays in registers.
4. **Select** (``_fused_select_kernel``, one program per row): the exact k of the row's
   candidates, order-free: a radix select over the keys (4 histograms of 8 bits) finds the
   k-th key; when it ties, a second radix select over the tied candidates' columns keeps the
   lowest ones (the contract's tie rule); the chosen columns sorted ascending (the plain path's
   order, so the output does not depend on the atomics' order). A row with fewer than k
   candidates (its floor was above its k-th key) or more than CAP is flagged.
5. **Exact** (``_fused_exact_kernel``, one program per row, only flagged rows work): the row's
   logits recomputed tile by tile (all heads in one dot) in each of a radix select's 4 rounds
   and the final pass: exact, never stored. It costs ~5 indexer passes over one row on one SM,
   so a misleading sample costs time (rare: the floor sits 4 standard deviations low), never
   the result.

Rows holding at most k keys list their range ascending. The result is the set ``topk(
indexer_logits(...))`` chooses from this backend's logits, in the same (ascending) order; only a
flagged row's logits may differ in the last bits (its dot has another shape), so its ties at the
k-th place may resolve like the reference's rather than like the plain path's.

CAP comes from the shapes only (:func:`layout`): SAFETY times the candidates the floor keeps on
average, a power of two within [CAP_MIN, CAP_MAX]: the scratch is N x CAP x 8 bytes (at 512K
keys and CAP 16384, 1/16 of the logits' bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .indexer_tile import head_sum, key_tile
from .topk import (
    bin_count,
    copied_rounds,
    copy_bin,
    key_round,
    key_value,
    list_short_row,
    ord_key,
    radix_digit,
    radix_step,
    row_range,
)
from .tuning import DeviceTuned, Op
from .variants import report_variant_declined

__all__ = ["INDEXER_TOPK", "FusedLayout", "indexer_topk", "layout", "ptx_append", "select_fused"]

#: the fused path's launch constants on this process's device (MIN_T, SAMPLE, SAFETY, CAP_MIN,
#: CAP_MAX, the filter's tiles, warps, stages and MAXNREG, the select's and the exact pass's
#: steps and warps): the tuning table's row (:class:`.tuning.IndexerTopkParams`, each value's
#: measurement named there): views of at least MIN_T keys (the long-row top-k's) take it
INDEXER_TOPK: Mapping[str, int] = DeviceTuned(Op.INDEXER_TOPK)


#: the reasons the inline-PTX append was not taken on a GPU, each reported once a process
_PTX_DECLINED: set[str] = set()


def ptx_append(is_cuda: bool, interpreted: bool) -> bool:
    """Whether the filter appends with inline PTX: compiled kernels on NVIDIA devices. Off a
    GPU (the interpreter) the Triton-op append runs, as designed; a "cuda" device that runs no
    PTX (ROCm) takes it too, reported once as fallback ``kernel_variant``."""
    if not is_cuda or interpreted:
        return False
    if torch.version.hip is None:
        return True
    report_variant_declined(_PTX_DECLINED, "triton:indexer_topk",
                            "the inline-PTX candidate append", "the Triton-op append",
                            f"a ROCm device (HIP {torch.version.hip}) runs no inline PTX")
    return False


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


# ---- kernels ---------------------------------------------------------------------------------
@triton.jit
def _sample_floor_kernel(xs_ptr, ks_ptr, ke_ptr, floor_ptr, T, K, NSC, STRIDE, sx0,
                         SP: tl.constexpr, ROUNDS: tl.constexpr):
    """Step 2 (one program per row): the floor from the row's sampled logits (``xs`` [N, NSC],
    -inf outside the range), a float; -inf (every key) when the sample has no key at the
    floor's place; not written for rows holding at most K keys (no filter needed). ROUNDS < 4
    radix rounds give the place's key with its low ``32 - 8 ROUNDS`` bits cleared: a floor at
    or below it (a lower floor only adds candidates; a finite key stays finite)."""
    row = tl.program_id(0).to(tl.int64)
    start, end = row_range(ks_ptr, ke_ptr, row, T)
    cnt = end - start
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
        for p in tl.static_range(ROUNDS):
            d, mm = radix_digit(s, valid, prefix, p)
            need, prefix = radix_step(tl.histogram(d, 256, mask=mm), need, prefix, p)
        tl.store(floor_ptr + row, tl.where(place < m, key_value(prefix), float("-inf")))


@triton.jit
def _tile_logits(q_ptr, w_ptr, k_ptr, scale_ptr, rows64, rmask, cols64, cmask,
                 sq0, sq1, sq2, sw0, sw1, sk0, sk1,
                 H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr):
    """A [BLOCK_M, BLOCK_N] tile of logits as the plain indexer op computes it: the
    same helpers (:func:`.indexer_tile.key_tile`, :func:`.indexer_tile.head_sum`), then the
    keys' fp8 scale, so the fused path chooses from the plain path's logits bit for bit."""
    d = tl.arange(0, DP)
    dmask = d < D
    ktt = key_tile(k_ptr, q_ptr, cols64, cmask, d, dmask, sk0, sk1, UPCAST)
    acc = head_sum(q_ptr, w_ptr, ktt, rows64, rmask, d, dmask,
                   sq0, sq1, sq2, sw0, sw1, H, BLOCK_M, BLOCK_N, UPCAST)
    if FP8:
        c = tl.load(scale_ptr + cols64, mask=cmask, other=0.0)
        acc = acc * c[None, :]
    return acc


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
    """Step 3 (program (key tile, row block), as the plain indexer op's): the tile's
    logits for the block's rows holding more than K keys; those at or above the row's floor
    appended to the row's candidates (value, column) at a slot from a relaxed atomic add on
    the row's count (at most CAP kept: a slot past it writes the last one, and the count goes
    on: the select flags the row). A tile outside every such row's range is skipped. ``ASM``:
    the append as :data:`_APPEND_PTX` (compiled kernels); else Triton's tensor ops (the
    interpreter). CAP is a runtime value: it changes with the call's shape, and each new value
    would compile the kernel again mid-prompt."""
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
        acc = _tile_logits(q_ptr, w_ptr, k_ptr, scale_ptr, rows64, rmask,
                           cols.to(tl.int64), cmask, sq0, sq1, sq2, sw0, sw1, sk0, sk1, H, D, DP,
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
def _radix_candidates(vrow, crow, nc, need, key, COLS: tl.constexpr, RB: tl.constexpr):
    """The need-th largest order key of a row's ``nc`` candidates (values at ``vrow``), or with
    ``COLS`` the need-th largest ``2^31 - 1 - column`` (columns at ``crow``) among those whose
    key is ``key``: 4 radix rounds of 8 bits in steps of RB candidates. Returns how many of the
    candidates equal to it are still needed, its bits, and the last round's histogram."""
    prefix = tl.zeros([], tl.int32)  # the bits found so far
    hist = tl.zeros([256], tl.int32)
    for p in tl.static_range(4):
        hist = tl.zeros([256], tl.int32)
        for c0 in range(0, nc, RB):
            i = c0 + tl.arange(0, RB)
            m = i < nc
            s = ord_key(tl.load(vrow + i, mask=m, other=0.0))
            if COLS:
                inv = 2147483647 - tl.load(crow + i, mask=m, other=0)
                d, mm = radix_digit(inv, m & (s == key), prefix, p)
            else:
                d, mm = radix_digit(s, m, prefix, p)
            hist += tl.histogram(d, 256, mask=mm)
        need, prefix = radix_step(hist, need, prefix, p)
    return need, prefix, hist


@triton.jit
def _kth_key_compact(vrow, nc, need, orow, RB: tl.constexpr):
    """:func:`_radix_candidates` of the keys (``COLS`` off) with its last two rounds over the
    keys matching the first two rounds' 16 bits only: those (round 1's bin) are copied into the
    row's ``need`` output slots at ``orow`` first (the output is written after); a bin larger
    than the slots keeps the rounds over every candidate."""
    room = need
    prefix = tl.zeros([], tl.int32)
    for p in tl.static_range(2):
        hist = key_round(vrow, nc, prefix, p, RB, True)
        need, prefix = radix_step(hist, need, prefix, p)
    nk = bin_count(hist, prefix, 1)
    if nk <= room:
        nput = tl.zeros([], tl.int32)
        for c0 in range(0, nc, RB):
            i = c0 + tl.arange(0, RB)
            m = i < nc
            nput = copy_bin(orow, nput, ord_key(tl.load(vrow + i, mask=m, other=0.0)), m, prefix)
        need, prefix, hist = copied_rounds(orow, nk, need, prefix, RB)
    else:
        for p in tl.static_range(2, 4):
            hist = key_round(vrow, nc, prefix, p, RB, True)
            need, prefix = radix_step(hist, need, prefix, p)
    return need, prefix, hist


@triton.jit
def _fused_select_kernel(val_ptr, col_ptr, count_ptr, ks_ptr, ke_ptr, out_ptr, meta_ptr, T, K,
                         CAP, KP: tl.constexpr, RB: tl.constexpr, COMPACT: tl.constexpr):
    """Step 4 (one program per row): rows holding at most K keys list them ascending; the
    others take the exact K of their candidates (in no order: a radix select over the keys,
    then, when the K-th key ties, one over the tied candidates' columns keeps the lowest),
    written ascending. Fewer than K candidates or more than CAP: ``meta = -1`` (the exact
    pass's row)."""
    row = tl.program_id(0).to(tl.int64)
    start, end = row_range(ks_ptr, ke_ptr, row, T)
    count = tl.maximum(end - start, 0)
    if count <= K:
        list_short_row(out_ptr, row, start, count, K, KP)
    else:
        nc = tl.load(count_ptr + row)
        if (nc < K) | (nc > CAP):
            tl.store(meta_ptr + row * 2, -1)
        else:
            vrow = val_ptr + row * CAP
            crow = col_ptr + row * CAP
            orow = out_ptr + row * K
            # the K-th key, and how many candidates equal to it to take
            if COMPACT:
                need, prefix, hist = _kth_key_compact(vrow, nc, K + tl.zeros([], tl.int32),
                                                      orow, RB)
            else:
                need, prefix, hist = _radix_candidates(vrow, crow, nc,
                                                       K + tl.zeros([], tl.int32), 0, False, RB)
            # candidates equal to the K-th key: the last round's bin of its low 8 bits
            tied = tl.sum(tl.where(tl.arange(0, 256) == (prefix & 255), hist, 0), axis=0)
            # the tied candidates kept: those whose 2^31 - 1 - column is at least cut (all of
            # them unless fewer are needed: then the need-th largest, i.e. the lowest columns)
            cut = tl.full([], -2147483648, tl.int32)
            if need < tied:
                _, cut, _ = _radix_candidates(vrow, crow, nc, need, prefix, True, RB)
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
    """One call's scratch: ``cap`` candidate slots a row, the sample's column ``stride`` and its
    ``sample_cols``."""

    cap: int
    stride: int
    sample_cols: int


def layout(n: int, t: int, k: int, cfg: Mapping[str, int] | None = None) -> FusedLayout:
    """CAP of an [n, t] call with top-k ``k`` (shapes only: the same on every rank). The floor
    keeps ~``(est + margin + 1) / sample`` of a row (est = k x sample / t, margin as the floor
    kernel's); CAP is SAFETY times that many keys, a power of two in [CAP_MIN, CAP_MAX], at
    most the row's (power of two) length."""
    c = cfg or INDEXER_TOPK
    stride = max(1, triton.cdiv(t, c["SAMPLE"]))
    sample = triton.cdiv(t, stride)
    est = (k * sample) // max(t, 1)
    frac = min(1.0, (est + int(4.0 * math.sqrt(est + 1.0)) + 9) / sample)
    cap = min(_pow2(math.ceil(c["SAFETY"] * frac * t)), c["CAP_MAX"])
    cap = min(max(cap, c["CAP_MIN"]), _pow2(t))
    return FusedLayout(cap=cap, stride=stride, sample_cols=sample)


#: ``launch(key, kernel, grid, args, constexprs, num_warps, num_stages)``: the caller's launcher
#: (``AttentionKernels``: fewer stages when a specialisation runs out of shared memory)
Launch = Callable[[tuple[Any, ...], Any, tuple[int, ...], tuple[Any, ...], dict[str, Any], int,
                   int], None]
#: ``indexer_logits(q, w, k, k_scale, key_start, key_end)``: the plain indexer op (the sample)
SampleLogits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                         torch.Tensor, torch.Tensor], torch.Tensor]


def select_fused(val: torch.Tensor, col: torch.Tensor, count: torch.Tensor,
                 key_start: torch.Tensor, key_end: torch.Tensor, out: torch.Tensor,
                 meta: torch.Tensor, t: int, k: int, cap: int) -> None:
    """Step 4 over the filter's candidates (``val`` float32 / ``col`` int32 [N * cap], row i's
    at ``i * cap``, ``count`` int32 [N], past ``cap``: overflowed): rows holding at most k keys
    listed ascending, the others' k columns ascending with ``meta[i, 0] = k``, or ``meta[i, 0] =
    -1`` (fewer than k candidates, or more than cap) and the row left for the exact pass."""
    cfg = INDEXER_TOPK
    _fused_select_kernel[(count.shape[0],)](val, col, count, key_start, key_end, out, meta, t, k,
                                            cap, KP=_pow2(k), RB=min(cfg["SELECT_BLOCK"],
                                                                     _pow2(cap)),
                                            COMPACT=bool(cfg["COMPACT"]),
                                            num_warps=cfg["select_warps"])


def indexer_topk(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None,
                 key_start: torch.Tensor, key_end: torch.Tensor, topk: int, *, fp8: bool,
                 dot_width: int, upcast: bool, interpreted: bool, sample_logits: SampleLogits,
                 launch: Launch) -> torch.Tensor:
    """The fused path (module docstring) for checked arguments, ``0 < topk < T``, N > 0:
    int32 [N, topk]. ``dot_width``: the padded head dim of the dots; ``upcast``: fp32 dots
    (the interpreter, or operands without a tensor-core type); ``interpreted``: the kernels run
    on Triton's CPU interpreter (no inline PTX there)."""
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
    floor = torch.empty(n, dtype=torch.float32, device=dev)
    _sample_floor_kernel[(n,)](xs, ks, ke, floor, t, topk, lay.sample_cols, st, xs.stride(0),
                               SP=_pow2(lay.sample_cols, 1), ROUNDS=cfg["FLOOR_ROUNDS"],
                               num_warps=cfg["floor_warps"])
    del xs
    # 3. the filter in the indexer's epilogue
    ptx = ptx_append(q.is_cuda, interpreted)
    val = torch.empty(n * lay.cap, dtype=torch.float32, device=dev)
    col = torch.empty(n * lay.cap, dtype=torch.int32, device=dev)
    count = torch.zeros(n, dtype=torch.int32, device=dev)
    scale = k_scale.contiguous() if k_scale is not None else floor  # unused for float keys
    bm = min(cfg["BLOCK_M"], _pow2(n))
    bn = cfg["BLOCK_N"]
    launch(("indexer_topk", q.dtype, k.dtype, heads, d, bm, bn, upcast),
           _fused_filter_kernel, (triton.cdiv(t, bn), triton.cdiv(n, bm)),
           (q, w, k, scale, ks, ke, floor, val, col, count, n, t, topk, lay.cap,
            q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1), k.stride(0),
            k.stride(1)),
           {"H": heads, "D": d, "DP": dot_width, "BLOCK_M": bm, "BLOCK_N": bn, "FP8": fp8,
            "UPCAST": upcast, "ASM": ptx,
            **({"maxnreg": cfg["MAXNREG"]} if ptx else {})},
           cfg["num_warps"], cfg["num_stages"])
    # 4. the select; 5. the flagged rows, exactly
    out = torch.empty(n, topk, dtype=torch.int32, device=dev)
    meta = torch.empty(n, 2, dtype=torch.int32, device=dev)
    select_fused(val, col, count, ks, ke, out, meta, t, topk, lay.cap)
    _fused_exact_kernel[(n,)](q, w, k, scale, ks, ke, out, meta, t, topk,
                              q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                              k.stride(0), k.stride(1), H=heads, HP=_pow2(heads), D=d,
                              DP=dot_width, BLOCK_N=cfg["EXACT_BLOCK_N"], FP8=fp8, UPCAST=upcast,
                              num_warps=cfg["exact_warps"])
    return out
