"""The lightning indexer's kernels: ``sum_h w[i, h] * relu(q[i, h] . k[j])`` inside each row's
key range, -inf outside. The prefill row-tile kernel (its tile :func:`indexer_tile`, shared with
the fused indexer + top-k filter), the few-rows kernel (a decode step's heads stacked in one
dot), and the two paged kernels reading index-K in place from pool pages (a key tile a program,
or whole pages a program). docs/triton.md describes each."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["head_logits", "indexer_tile", "key_tile", "qk_dot", "query_heads"]


@triton.jit
def key_tile(k_ptr, q_ptr, cols64, cmask, d, dmask, sk0, sk1, UPCAST: tl.constexpr):
    """The key tile ``[BLOCK_N, DP]`` transposed for ``q @ k^T``, in the dot's input type: fp32
    (``UPCAST``), else the query's type (fp8 keys convert exactly to 16 bits; fp8 queries keep
    fp8)."""
    kt = tl.load(k_ptr + cols64[:, None] * sk0 + d[None, :] * sk1,
                 mask=cmask[:, None] & dmask[None, :], other=0.0)
    return tl.trans(kt.to(tl.float32) if UPCAST else kt.to(q_ptr.dtype.element_ty))


@triton.jit
def qk_dot(q, kt, UPCAST: tl.constexpr):
    """``q @ kt`` of a query tile and a :func:`key_tile`: fp32 IEEE (``UPCAST``), else on the
    tensor cores in the operands' type."""
    return tl.dot(q.to(tl.float32), kt, input_precision="ieee") if UPCAST else tl.dot(q, kt)


@triton.jit
def query_heads(q_ptr, w_ptr, row, sq0, sq1, sq2, sw0, sw1, H: tl.constexpr, HP: tl.constexpr,
                D: tl.constexpr, DP: tl.constexpr, UPCAST: tl.constexpr):
    """One query row's heads ``[HP, DP]`` (fp32 with ``UPCAST``) and head weights ``[HP]``,
    zero past H and D, with the head dim's lanes ``d`` and their mask."""
    head = tl.arange(0, HP)
    hmask = head < H
    d = tl.arange(0, DP)
    dmask = d < D
    qt = tl.load(q_ptr + row * sq0 + head[:, None] * sq1 + d[None, :] * sq2,
                 mask=hmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        qt = qt.to(tl.float32)
    wv = tl.load(w_ptr + row * sw0 + head * sw1, mask=hmask, other=0.0)
    return qt, wv, d, dmask


@triton.jit
def head_logits(qt, wv, ktt, UPCAST: tl.constexpr):
    """One row's ``sum_h wv[h] relu(qt[h] . k[j])`` (its heads ``qt`` [HP, DP] stacked in one
    dot against the key tile ``ktt`` [DP, N]), before the keys' fp8 scale."""
    return tl.sum(wv[:, None] * tl.maximum(qk_dot(qt, ktt, UPCAST), 0.0), axis=0)


@triton.jit
def indexer_tile(q_ptr, w_ptr, k_ptr, scale_ptr, rows64, rmask, cols64, cmask,
                 sq0, sq1, sq2, sw0, sw1, sk0, sk1,
                 H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr):
    """A [BLOCK_M, BLOCK_N] tile of logits: ``sum_h w[i, h] relu(q[i, h] . k[j])`` (a dot a
    head against :func:`key_tile`), then the keys' fp8 scale. The plain prefill kernel and the
    fused indexer + top-k filter both compute their tiles here, so the fused path chooses from
    the plain path's logits bit for bit."""
    d = tl.arange(0, DP)
    dmask = d < D
    ktt = key_tile(k_ptr, q_ptr, cols64, cmask, d, dmask, sk0, sk1, UPCAST)
    qmask = rmask[:, None] & dmask[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    qbase = q_ptr + rows64[:, None] * sq0 + d[None, :] * sq2
    for h in range(H):
        qh = tl.load(qbase + h * sq1, mask=qmask, other=0.0)
        wh = tl.load(w_ptr + rows64 * sw0 + h * sw1, mask=rmask, other=0.0)
        acc += wh[:, None] * tl.maximum(qk_dot(qh, ktt, UPCAST), 0.0)
    if FP8:
        c = tl.load(scale_ptr + cols64, mask=cmask, other=0.0)
        acc = acc * c[None, :]
    return acc


@triton.jit
def _tile(ks_ptr, ke_ptr, N, T, BR: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (key tile, block of BR rows): its rows (and as int64) and columns with their
    masks, the rows' key ranges ``[ks, ke)``, and whether the tile meets the span the rows'
    ranges cover together (empty and masked rows left out; a tile outside it is not computed)."""
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BR + tl.arange(0, BR)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    ks = tl.load(ks_ptr + rows, mask=rmask, other=0)
    ke = tl.load(ke_ptr + rows, mask=rmask, other=0)
    nonempty = rmask & (ks < ke)
    lo = tl.min(tl.where(nonempty, ks, 9223372036854775807), axis=0)
    hi = tl.max(tl.where(nonempty, ke, 0), axis=0)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < T
    return rows, rows64, rmask, cols, cmask, ks, ke, (n0 < hi) & (n0 + BLOCK_N > lo)


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
    """Program (key tile, row block): the tile's logits (:func:`indexer_tile`), the
    keys' fp8 scale, -inf outside each row's range."""
    rows, rows64, rmask, cols, cmask, ks, ke, meets = _tile(ks_ptr, ke_ptr, N, T, BLOCK_M,
                                                            BLOCK_N)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if meets:
        acc = indexer_tile(q_ptr, w_ptr, k_ptr, scale_ptr, rows64, rmask, cols64, cmask,
                           sq0, sq1, sq2, sw0, sw1, sk0, sk1, H, D, DP, BLOCK_M, BLOCK_N, FP8,
                           UPCAST)
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
    qr, _, qmask, cols, cmask, ks, ke, meets = _tile(ks_ptr, ke_ptr, N, T, BQ, BLOCK_N)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BQ, BLOCK_N], dtype=tl.float32)
    if meets:
        m = tl.arange(0, BQ * HP)
        head = m % HP
        rows64 = (tl.program_id(1) * BQ + m // HP).to(tl.int64)
        rmask = (tl.program_id(1) * BQ + m // HP < N) & (head < H)
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
    """The indexer of ``BQ`` query rows against ``BLOCK_N`` keys of each row's request,
    read in place from part-major pages (key j at slot ``j % S`` of page ``bt[r, j // S]``, at
    element ``page * k_page + k_first + slot * k_row`` of the typed view ``k_ptr``); a row's
    heads one ``[HP, D]`` operand; -inf past ``key_end``. ``KALIGN``: every key row's first
    element is a multiple of it (without the hint fp8 rows compile to one-byte loads)."""
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
    """The indexer of one query row against ``PAGES`` whole pages of its request, a page a
    step: the block table read once a page, the key rows ``KROW`` elements apart (132 on the
    pool's part-major pages, ``D`` on page-major ones), the scales ``SROW`` apart; the page loop
    pipelined ``STAGES`` deep; pages past ``key_end`` store -inf. ``KEYS_M``: ``keys @ q^T``
    (the head sum within warps) instead of ``q @ keys^T``."""
    row = tl.program_id(1).to(tl.int64)
    p0 = tl.program_id(0) * PAGES
    ke = tl.load(ke_ptr + row)
    slot = tl.arange(0, S)
    # pages of this program holding keys before key_end (the rest store -inf)
    live = tl.minimum(tl.maximum((ke - p0 * S + S - 1) // S, 0), PAGES).to(tl.int32)
    live = tl.minimum(live, M - p0)
    if live > 0:
        req = tl.load(req_ptr + row).to(tl.int64)
        qt, wv, d, dmask = query_heads(q_ptr, w_ptr, row, sq0, sq1, sq2, sw0, sw1, H, HP, D, DP,
                                       UPCAST)
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
            kt = kt.to(tl.float32) if UPCAST else kt.to(q_ptr.dtype.element_ty)
            if KEYS_M:  # [S, HP]: the keys the dot's rows, the head sum within a warp
                sc = qk_dot(kt, tl.trans(qt), UPCAST)
                acc = tl.sum(wv[None, :] * tl.maximum(sc, 0.0), axis=1)
            else:  # [HP, S]: the heads the rows (as the key-tile kernel)
                acc = head_logits(qt, wv, tl.trans(kt), UPCAST)
            if FP8:
                c = tl.load(scale_ptr + page * s_page + s_first + slot * SROW, mask=inr,
                            other=0.0, eviction_policy="evict_first")
                acc = acc * c
            tl.store(out_ptr + row * so0 + cols, tl.where(inr, acc, float("-inf")))
    for i in range(tl.maximum(live, 0), PAGES):
        cols = (p0 + i) * S + slot
        tl.store(out_ptr + row * so0 + cols, tl.full([S], float("-inf"), tl.float32),
                 mask=cols < MS)
