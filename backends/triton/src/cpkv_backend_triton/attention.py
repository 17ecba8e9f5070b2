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
    KVDtype,
    KVFormat,
    OpDeclined,
    check_indexer_args,
    check_indexer_index_pages_args,
    check_indexer_paged_args,
    check_indexer_topk_args,
    check_sparse_mla_args,
    check_sparse_mla_paged_args,
    paged_latent,
    report_fallback,
)

from .indexer_tile import head_sum, key_tile, qk_dot
from .indexer_topk import INDEXER_TOPK
from .indexer_topk import indexer_topk as fused_indexer_topk
from .topk import TOPK_METHOD, TOPK_RADIX_MAX_K
from .topk import topk as select_topk
from .tuning import DeviceTuned, Op

if TYPE_CHECKING:
    from cpkv.ops.api import KVPart

__all__ = ["AttentionKernels", "MLAPrecision", "PageReader"]

#: the precision of sparse MLA on 16-bit inputs (see :class:`AttentionKernels`)
MLAPrecision = Literal["bf16", "exact"]

_LOWP = (torch.bfloat16, torch.float16)

#: the launch constants on this process's device: the tables of :mod:`.tuning` (each value's
#: measurement named there); :class:`AttentionKernels` takes overrides on top of them
INDEXER_DEFAULT = DeviceTuned(Op.INDEXER)
MLA_DEFAULT = DeviceTuned(Op.SPARSE_MLA)
#: 16-bit q/kv (the production path): one bf16 P, FlashMLA's precision, within bf16 tolerance of
#: the fp32 reference (the conformance suite's 16-bit tolerance)
MLA_LOWP_DEFAULT = DeviceTuned(Op.SPARSE_MLA_LOWP)


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(x, 1)))))


def _dot_width(d: int, fp8: bool, upcast: bool) -> int:
    """The padded head dim (``DP``) of an indexer dot: a tensor-core dot of fp8 operands needs
    K >= 32 (16-bit ones K >= 16), so a small head dim is padded (the pad lanes load as zero);
    the fp32 (``UPCAST``) dot takes the power of two at or above 16."""
    return _pow2(d, 32 if fp8 and not upcast else 16)


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
    """Program (key tile, row block): the tile's logits (:func:`.indexer_tile.head_sum`), the
    keys' fp8 scale, -inf outside each row's range."""
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
        ktt = key_tile(k_ptr, q_ptr, cols64, cmask, d, dmask, sk0, sk1, UPCAST)
        acc = head_sum(q_ptr, w_ptr, ktt, rows64, rmask, d, dmask,
                       sq0, sq1, sq2, sw0, sw1, H, BLOCK_M, BLOCK_N, UPCAST)
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
        ktt = key_tile(k_ptr, q_ptr, cols64, cmask, d, dmask, sk0, sk1, UPCAST)
        qt = tl.load(q_ptr + rows64[:, None] * sq0 + head[:, None] * sq1 + d[None, :] * sq2,
                     mask=rmask[:, None] & dmask[None, :], other=0.0)
        s = qk_dot(qt, ktt, UPCAST)
        wv = tl.load(w_ptr + rows64 * sw0 + head * sw1, mask=rmask, other=0.0)
        acc = tl.sum(tl.reshape(wv[:, None] * tl.maximum(s, 0.0), [BQ, HP, BLOCK_N]), axis=1)
        if FP8:
            c = tl.load(scale_ptr + cols64, mask=cmask, other=0.0)
            acc = acc * c[None, :]
    _store_in_range(out_ptr, acc, qr, qmask, cols, cmask, ks, ke, so0)


@triton.jit
def _indexer_paged_kernel(q_ptr, w_ptr, k_ptr, scale_ptr, bt_ptr, req_ptr, ke_ptr, out_ptr,
                          N, MS,
                          sq0, sq1, sq2, sw0, sw1, sbt0, sbt1, so0,
                          k_page, k_first, k_row, s_page, s_first, s_row,
                          H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                          S: tl.constexpr, BQ: tl.constexpr, BLOCK_N: tl.constexpr,
                          FP8: tl.constexpr, UPCAST: tl.constexpr, KALIGN: tl.constexpr):
    """The indexer of ``BQ`` query rows against ``BLOCK_N`` keys of each row's own request,
    read in place from part-major pages: key column j of request r is slot ``j % S`` of page
    ``bt[r, j // S]``, its index-K values at element ``page * k_page + k_first + slot * k_row``
    of ``k_ptr`` (a typed view of the pool; the fp8 scale likewise in the float32 view
    ``scale_ptr``). A row's heads are one ``[HP, D]`` operand, one dot per key tile; a tile at or
    past the row's ``key_end`` loads nothing and stores -inf. ``KALIGN``: every key row's first
    element is a multiple of it (the host's gcd of the steps): without the hint the gathered
    rows' fp8 bytes compile to one-byte loads (``ld.global.b8``), with it to 4-byte ones."""
    n0 = tl.program_id(0) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < MS
    head = tl.arange(0, HP)
    hmask = head < H
    d = tl.arange(0, DP)
    dmask = d < D
    for r in tl.static_range(BQ):
        row = tl.program_id(1) * BQ + r
        if row < N:
            row64 = row.to(tl.int64)
            ke = tl.load(ke_ptr + row64)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            if n0 < ke:
                inr = cmask & (cols < ke)
                req = tl.load(req_ptr + row64).to(tl.int64)
                page = tl.load(bt_ptr + req * sbt0 + (cols // S).to(tl.int64) * sbt1, mask=inr,
                               other=0).to(tl.int64)
                slot = (cols % S).to(tl.int64)
                base = tl.multiple_of(page * k_page + k_first + slot * k_row, KALIGN)
                ktt = key_tile(k_ptr, q_ptr, base, inr, d, dmask, 1, 1, UPCAST)
                qt = tl.load(q_ptr + row64 * sq0 + head[:, None] * sq1 + d[None, :] * sq2,
                             mask=hmask[:, None] & dmask[None, :], other=0.0)
                s = qk_dot(qt, ktt, UPCAST)
                wv = tl.load(w_ptr + row64 * sw0 + head * sw1, mask=hmask, other=0.0)
                acc = tl.sum(wv[:, None] * tl.maximum(s, 0.0), axis=0)
                if FP8:
                    c = tl.load(scale_ptr + page * s_page + s_first + slot * s_row, mask=inr,
                                other=0.0)
                    acc = acc * c
            tl.store(out_ptr + row64 * so0 + cols, tl.where(cols < ke, acc, float("-inf")),
                     mask=cmask)


@triton.jit
def _indexer_pages_kernel(q_ptr, w_ptr, k_ptr, scale_ptr, bt_ptr, req_ptr, ke_ptr, out_ptr,
                          M, MS,
                          sq0, sq1, sq2, sw0, sw1, sbt0, sbt1, so0,
                          k_page, k_first, s_page, s_first,
                          H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                          S: tl.constexpr, KROW: tl.constexpr, SROW: tl.constexpr,
                          PAGES: tl.constexpr, STAGES: tl.constexpr, KEYS_M: tl.constexpr,
                          FP8: tl.constexpr, UPCAST: tl.constexpr,
                          KALIGN: tl.constexpr):
    """The indexer of one query row against ``PAGES`` whole pages of its request's keys, a page
    a step: the page's ``S`` keys are one run in the pool (slot ``s``'s values at element
    ``page * k_page + k_first + s * KROW`` of ``k_ptr``, its fp8 scale at ``page * s_page +
    s_first + s * SROW`` of the float32 view ``scale_ptr``), so the block table is read once a
    page and the row strides are constants: ``KROW`` = 132 for the pool's part-major rows
    (values and scale interleaved: 4-byte loads), ``KROW`` = D, ``SROW`` = 1 for DeepGEMM's
    page-major order (the page's values, then its scales: 16-byte loads). The row's queries and
    head weights are loaded once a program; the loop over its pages before ``key_end`` is
    software-pipelined ``STAGES`` deep (1: loads into registers); pages at or past ``key_end``
    store -inf and load nothing. ``KEYS_M``: the dot is ``keys @ q^T`` (the key tile its
    register-fed left operand, the head sum a reduction within warps) instead of ``q @ keys^T``
    (the key tile through shared memory, the head sum across warps)."""
    row = tl.program_id(1).to(tl.int64)
    p0 = tl.program_id(0) * PAGES
    ke = tl.load(ke_ptr + row)
    slot = tl.arange(0, S)
    head = tl.arange(0, HP)
    hmask = head < H
    d = tl.arange(0, DP)
    dmask = d < D
    # pages of this program holding keys before key_end (the rest store -inf)
    live = tl.minimum(tl.maximum((ke - p0 * S + S - 1) // S, 0), PAGES).to(tl.int32)
    live = tl.minimum(live, M - p0)
    if live > 0:
        req = tl.load(req_ptr + row).to(tl.int64)
        qt = tl.load(q_ptr + row * sq0 + head[:, None] * sq1 + d[None, :] * sq2,
                     mask=hmask[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            qt = qt.to(tl.float32)
        wv = tl.load(w_ptr + row * sw0 + head * sw1, mask=hmask, other=0.0)
        for i in tl.range(0, live, num_stages=STAGES):
            pg = p0 + i
            page = tl.load(bt_ptr + req * sbt0 + pg.to(tl.int64) * sbt1).to(tl.int64)
            cols = pg * S + slot
            inr = cols < ke
            base = tl.multiple_of(page * k_page + k_first, KALIGN)
            # the keys are read once: evict them first (the queries and tables stay in L2)
            kt = tl.load(k_ptr + base + slot[:, None] * KROW + d[None, :],
                         mask=inr[:, None] & dmask[None, :], other=0.0,
                         eviction_policy="evict_first")
            if UPCAST:  # noqa: SIM108 (kept as a constexpr branch)
                kt = kt.to(tl.float32)
            else:
                kt = kt.to(q_ptr.dtype.element_ty)
            if KEYS_M:  # [S, HP]: the keys the dot's rows, the head sum within a warp
                sc = qk_dot(kt, tl.trans(qt), UPCAST)
                acc = tl.sum(wv[None, :] * tl.maximum(sc, 0.0), axis=1)
            else:  # [HP, S]: the heads the rows (as the key-tile kernel)
                sc = qk_dot(qt, tl.trans(kt), UPCAST)
                acc = tl.sum(wv[:, None] * tl.maximum(sc, 0.0), axis=0)
            if FP8:
                c = tl.load(scale_ptr + page * s_page + s_first + slot * SROW, mask=inr,
                            other=0.0, eviction_policy="evict_first")
                acc = acc * c
            tl.store(out_ptr + row * so0 + cols, tl.where(inr, acc, float("-inf")))
    for i in range(tl.maximum(live, 0), PAGES):
        cols = (p0 + i) * S + slot
        tl.store(out_ptr + row * so0 + cols, tl.full([S], float("-inf"), tl.float32),
                 mask=cols < MS)


# C901: the branches are tl.constexpr variants (HAS_B, UPCAST, P_SPLIT, ...), resolved at
# compile time; each compiled kernel is straight-line, and a Triton helper per variant would
# only move the switch
@triton.jit
def _sparse_mla_kernel(q_ptr, kv_ptr, idx_ptr, out_ptr,  # noqa: C901
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


def _paged_index_views(pages: torch.Tensor, fmt: KVFormat
                       ) -> tuple[torch.Tensor, tuple[int, int, int], tuple[int, int, int]]:
    """The pool layer ``pages`` as its index-K value type (float8_e4m3fn, bfloat16 or float32),
    with ``(page, first, row)`` element steps: token row ``p * S + s``'s index-K values start at
    element ``p * page + first + s * row``; and the fp8 scale's steps in a float32 view (zeros
    for float pools). Views of the same storage, so the kernel reads the pool in place (and runs
    in the Triton interpreter, which has no pointer casts).

    Raises:
        OpDeclined: a byte offset is not a multiple of its element size (an fp8 index_head_dim
            not divisible by 4, or a pool view at an odd storage offset).
    """
    s, nl, ib, b = (fmt.page_size, fmt.latent_bytes_per_token, fmt.index_bytes_per_token,
                    fmt.bytes_per_token)
    fp8 = fmt.dtype is KVDtype.FP8
    kdt = torch.float8_e4m3fn if fp8 else (torch.float32 if fmt.dtype is KVDtype.FP32
                                           else torch.bfloat16)
    esz = 4 if fp8 else kdt.itemsize  # the widest view taken of the storage
    steps = (s * b, s * nl, ib) + ((s * nl + fmt.index_head_dim,) if fp8 else ())
    if any(x % esz for x in steps) or pages.storage_offset() % esz:
        raise OpDeclined(f"indexer_logits_paged reads {fmt.dtype.value} index-K in place through "
                         f"{esz}-byte views: the byte offsets (page {s * b}, index part {s * nl}, "
                         f"row {ib}, storage offset {pages.storage_offset()}) must be multiples "
                         f"of {esz}")
    flat = pages.view(-1)
    k = flat.view(kdt)
    ksz = kdt.itemsize
    kst = (s * b // ksz, s * nl // ksz, ib // ksz)
    sst = (s * b // 4, (s * nl + fmt.index_head_dim) // 4, ib // 4) if fp8 else (0, 0, 0)
    return k, kst, sst


def _row_alignment(steps: tuple[int, ...], itemsize: int) -> int:
    """The largest power of two (elements, at most 16 bytes' worth) dividing every step of a key
    row's first element: what each row's start is a multiple of."""
    g = math.gcd(*steps)
    a = 1
    while a * 2 * itemsize <= 16 and g % (a * 2) == 0:
        a *= 2
    return a


def _pages_tileable(page_size: int) -> bool:
    """Whether :func:`_indexer_pages_kernel` tiles pages of this size (a dot's key operand of
    ``page_size`` rows: a power of two, at least 16)."""
    return page_size >= 16 and page_size & (page_size - 1) == 0


def _index_page_views(index_pages: torch.Tensor, fmt: KVFormat
                      ) -> tuple[torch.Tensor, tuple[int, int, int], tuple[int, int, int]]:
    """Page-major index-K pages (uint8 [P, >= S x index bytes], unit column stride) as a flat
    view of the index-K value type with ``(page, first, row)`` element steps (page p, slot s:
    element ``p * page + s * row``), and the fp8 scales' steps in a float32 view of the same
    storage (``p * page + S * D / 4 + s``); zeros for float formats.

    Raises:
        OpDeclined: the row stride, the storage offset or (fp8) the values' bytes are not
            multiples of the widest view's element size.
    """
    s, dim = fmt.page_size, fmt.index_head_dim
    fp8 = fmt.dtype is KVDtype.FP8
    kdt = torch.float8_e4m3fn if fp8 else (torch.float32 if fmt.dtype is KVDtype.FP32
                                           else torch.bfloat16)
    esz = 4 if fp8 else kdt.itemsize
    ps0 = index_pages.stride(0)
    if ps0 % esz or index_pages.storage_offset() % esz or (s * dim) % esz:
        raise OpDeclined(f"indexer_logits_index_pages reads {fmt.dtype.value} index-K through "
                         f"{esz}-byte views: the page stride {ps0}, the storage offset "
                         f"{index_pages.storage_offset()} and the page's value bytes must be "
                         f"multiples of {esz}")
    span = (index_pages.shape[0] - 1) * ps0 + s * fmt.index_bytes_per_token
    span += (-span) % esz
    flat = index_pages.as_strided((span,), (1,))
    ksz = kdt.itemsize
    k = flat.view(kdt)
    kst = (ps0 // ksz, 0, dim)
    sst = (ps0 // 4, s * dim // 4, 1) if fp8 else (0, 0, 0)
    return k, kst, sst


# ---- the ops ---------------------------------------------------------------------------------
class PageReader(Protocol):
    """The two KV ops ``sparse_mla_paged`` reads the pool's pages with (a :class:`KVKernels`)."""

    def page_gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor: ...

    def fp8_unpack(self, packed: torch.Tensor, fmt: KVFormat, part: KVPart,
                   dtype: torch.dtype, index: torch.Tensor | None = None) -> torch.Tensor: ...


class AttentionKernels:
    """The sparse-attention ops (indexer_logits, indexer_logits_paged, topk, indexer_topk,
    sparse_mla, sparse_mla_paged), on CUDA
    tensors (or CPU tensors under ``TRITON_INTERPRET=1``); docs/triton.md describes the kernels.

    Args:
        indexer_config: overrides of :data:`INDEXER_DEFAULT`, the tuning table's row for the
            current device when the object is made (:mod:`.tuning`: BLOCK_M, BLOCK_N, num_warps,
            num_stages, FEW_ROWS, FEW_BLOCK_N, few_warps, PAGED_BLOCK_N, PAGED_ROWS,
            paged_warps).
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
        # unused pointer for float keys (the check gives fp8 keys, and only them, a scale)
        scale = k_scale.contiguous() if k_scale is not None else out
        dp = _dot_width(d, both_fp8, upcast)
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

    def indexer_logits_paged(self, q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor,
                             fmt: KVFormat, block_table: torch.Tensor, row_request: torch.Tensor,
                             key_end: torch.Tensor) -> torch.Tensor:
        """The lightning indexer over each row's request keys ``[0, key_end[i])`` read in place
        from part-major pages through the block table; float32 [N, M * S], -inf past key_end.
        See :class:`cpkv.ops.api.KVOps`. One launch, no host sync; the output is its only
        allocation (capturable in a CUDA graph).

        Raises:
            ValueError: a shape or dtype does not match (as the reference).
            OpDeclined: the index-K byte offsets do not fit typed views (see
                :func:`_paged_index_views`).
        """
        fp8 = check_indexer_paged_args(q, w, pages, fmt, block_table, row_request, key_end)
        n, heads, d = q.shape
        ms = block_table.shape[1] * fmt.page_size
        keys, kst, sst = _paged_index_views(pages, fmt)
        out = torch.empty(n, ms, dtype=torch.float32, device=q.device)
        if n == 0 or ms == 0:
            return out
        scales = pages.view(-1).view(torch.float32) if fp8 else out
        if self._page_tiles(fmt):
            self._indexer_pages(q, w, keys, scales, kst, sst, fmt, block_table, row_request,
                                key_end, out, fp8)
            return out
        cfg = self.indexer_config
        both_fp8 = fp8 and q.dtype == torch.float8_e4m3fn
        upcast = _interpreted(_indexer_paged_kernel) or not (
            both_fp8 or (q.dtype in _LOWP and (fp8 or keys.dtype == q.dtype)))
        bn = min(cfg["PAGED_BLOCK_N"], _pow2(ms))
        bq = max(1, min(cfg["PAGED_ROWS"], n))
        hp = _pow2(heads)  # a dot takes at least 16 rows
        self._launch(("indexer_paged", q.dtype, keys.dtype, heads, d, fmt.page_size, bq, bn,
                      upcast),
                     _indexer_paged_kernel, (triton.cdiv(ms, bn), triton.cdiv(n, bq)),
                     (q, w, keys, scales, block_table, row_request, key_end, out, n, ms,
                      q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                      block_table.stride(0), block_table.stride(1), out.stride(0), *kst, *sst),
                     {"H": heads, "HP": hp, "D": d, "DP": _dot_width(d, both_fp8, upcast),
                      "S": fmt.page_size,
                      "BQ": bq, "BLOCK_N": bn, "FP8": fp8, "UPCAST": upcast,
                      "KALIGN": _row_alignment(kst, keys.element_size())},
                     cfg["paged_warps"], cfg["num_stages"])
        return out

    def indexer_logits_index_pages(self, q: torch.Tensor, w: torch.Tensor,
                                   index_pages: torch.Tensor, fmt: KVFormat,
                                   block_table: torch.Tensor, row_request: torch.Tensor,
                                   key_end: torch.Tensor) -> torch.Tensor:
        """``indexer_logits_paged`` (the same block table, row requests and key ends, the same
        result) over index-K pages in DeepGEMM's page-major order, the engines' ``two_part``
        index-K tensor (:mod:`cpkv.kv.buffers`): uint8 ``[P, >= S x index bytes]``, page p's
        ``S x D`` values, then (fp8) its ``S`` fp32 scales; float32 [N, M * S], -inf past
        key_end. The page-tile kernel (:func:`_indexer_pages_kernel`) always: ``S`` a power of
        two >= 16.

        Raises:
            ValueError: a shape or dtype does not match.
            OpDeclined: a page size the kernel cannot tile, or offsets the typed views cannot
                address.
        """
        fp8 = check_indexer_index_pages_args(q, w, index_pages, fmt, block_table, row_request,
                                             key_end)
        if not _pages_tileable(fmt.page_size):
            raise OpDeclined(f"indexer_logits_index_pages tiles whole pages: page size "
                             f"{fmt.page_size} is not a power of two >= 16")
        n = q.shape[0]
        ms = block_table.shape[1] * fmt.page_size
        out = torch.empty(n, ms, dtype=torch.float32, device=q.device)
        if n == 0 or ms == 0:
            return out
        keys, kst, sst = _index_page_views(index_pages, fmt)
        scales = keys.view(torch.uint8).view(torch.float32) if fp8 else out
        self._indexer_pages(q, w, keys, scales, kst, sst, fmt, block_table, row_request,
                            key_end, out, fp8)
        return out

    def _page_tiles(self, fmt: KVFormat) -> bool:
        """Whether ``indexer_logits_paged`` takes the page-tile kernel (``PAGED_KERNEL`` 1 and
        a page size it tiles) rather than the key-tile kernel."""
        return bool(self.indexer_config["PAGED_KERNEL"]) and _pages_tileable(fmt.page_size)

    def _indexer_pages(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                       scales: torch.Tensor, kst: tuple[int, int, int],
                       sst: tuple[int, int, int], fmt: KVFormat, block_table: torch.Tensor,
                       row_request: torch.Tensor, key_end: torch.Tensor, out: torch.Tensor,
                       fp8: bool) -> None:
        """:func:`_indexer_pages_kernel` into ``out`` over typed views of the keys (element
        steps ``kst`` / ``sst`` = page, first, row: as :func:`_paged_index_views` gives)."""
        cfg = self.indexer_config
        n, heads, d = q.shape
        m = block_table.shape[1]
        both_fp8 = fp8 and q.dtype == torch.float8_e4m3fn
        upcast = _interpreted(_indexer_pages_kernel) or not (
            both_fp8 or (q.dtype in _LOWP and (fp8 or keys.dtype == q.dtype)))
        # DeepGEMM's page-major order (rows of the values alone: 16-byte pieces, cp.async when
        # pipelined) has its own launch; the pool's part-major rows (4-byte pieces) theirs
        major = kst[2] == d
        pp = max(1, min(cfg["PAGED_MAJOR_PAGES" if major else "PAGED_PAGES"], m))
        stages = cfg["PAGED_MAJOR_STAGES" if major else "PAGED_STAGES"]
        self._launch(("indexer_pages", q.dtype, keys.dtype, heads, d, fmt.page_size, kst[2],
                      sst[2], pp, stages, cfg["PAGED_KEYS_M"], upcast),
                     _indexer_pages_kernel, (triton.cdiv(m, pp), n),
                     (q, w, keys, scales, block_table, row_request, key_end, out, m,
                      m * fmt.page_size, q.stride(0), q.stride(1), q.stride(2), w.stride(0),
                      w.stride(1), block_table.stride(0), block_table.stride(1), out.stride(0),
                      kst[0], kst[1], sst[0], sst[1]),
                     {"H": heads, "HP": _pow2(heads), "D": d,
                      "DP": _dot_width(d, both_fp8, upcast), "S": fmt.page_size,
                      "KROW": kst[2], "SROW": sst[2], "PAGES": pp, "STAGES": stages,
                      "KEYS_M": cfg["PAGED_KEYS_M"], "FP8": fp8,
                      "UPCAST": upcast,
                      "KALIGN": _row_alignment((kst[0], kst[1]), keys.element_size())},
                     cfg["paged_warps"], 1)

    # -- top-k ----------------------------------------------------------------------------------
    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        """Columns of the k largest logits in each row's range; int32 [N, k], -1 padded; rows
        holding at most k keys list them all ascending. See :class:`cpkv.ops.api.KVOps`.

        Default (``topk_method="radix"``): the exact select of :mod:`cpkv_backend_triton.topk`, the
        reference's set (ties by ascending column) in the kernels' order. ``"torch"``: a Triton
        kernel masks the logits, ``torch.topk`` (sorted) selects, a Triton kernel fixes up short
        rows and padding; ties at the k-th place may then resolve differently from the
        reference.

        Raises:
            ValueError: ``logits`` is not 2-D float, ``k`` is negative or a range is mis-shaped.
        """
        return select_topk(logits, k, key_start, key_end, self.topk_method)

    def indexer_topk(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                     k_scale: torch.Tensor | None, key_start: torch.Tensor,
                     key_end: torch.Tensor, topk: int) -> torch.Tensor:
        """``topk(indexer_logits(...))`` as one op: int32 [N, topk]. See
        :class:`cpkv.ops.api.KVOps`. Views of at least ``INDEXER_TOPK["MIN_T"]`` keys, more
        than ``FEW_ROWS`` rows, the exact top-k (``topk_method="radix"``, ``topk`` <=
        ``TOPK_RADIX_MAX_K``) take the fused path of :mod:`cpkv_backend_triton.indexer_topk`
        (the logits never stored); other calls :meth:`indexer_logits` then :meth:`topk`. The
        choice depends on shapes and settings only.

        Raises:
            ValueError: an argument does not fit (as the reference).
        """
        fp8 = check_indexer_topk_args(q, w, k, k_scale, key_start, key_end, topk)
        n, _, d = q.shape
        t = k.shape[0]
        if (t >= INDEXER_TOPK["MIN_T"] and n > self.indexer_config["FEW_ROWS"]
                and 0 < topk < t and topk <= TOPK_RADIX_MAX_K and self.topk_method == "radix"):
            both_fp8 = fp8 and q.dtype == torch.float8_e4m3fn
            interp = _interpreted(_indexer_kernel)
            upcast = interp or not (
                both_fp8 or (q.dtype in _LOWP and (fp8 or k.dtype == q.dtype)))
            return fused_indexer_topk(q, w, k, k_scale, key_start, key_end, topk, fp8=fp8,
                                      dot_width=_dot_width(d, both_fp8, upcast), upcast=upcast,
                                      interpreted=interp, sample_logits=self.indexer_logits,
                                      launch=self._launch)
        logits = self.indexer_logits(q, w, k, k_scale, key_start, key_end)
        return self.topk(logits, topk, key_start, key_end)

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
