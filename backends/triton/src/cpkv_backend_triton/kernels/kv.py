"""The KV ops' kernels (:mod:`cpkv_backend_triton.kv` launches them): row movement as one copy
kernel (gather, scatter or both; and the peers' variant reading up to ``MAX_PEERS`` sources),
a decode step's picks to pool rows, and the fp8 pack / unpack of the pool's layout, bit-exact
with the reference (:mod:`.fp8`'s integer roundings)."""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8 import bf16_bits, e4m3_bits, e4m3_value, hadamard_rows

#: sources one ``peer_gather`` launch reads from (CP sizes up to this; more ranks: several passes)
MAX_PEERS = 8


@triton.jit
def _copy_rows(src_ptr, dst_ptr, sidx_ptr, didx_ptr, n_rows, row_v, src_stride_v, dst_stride_v,
               SRC_IDX: tl.constexpr, DST_IDX: tl.constexpr, VEC: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``dst[d(i)] = src[s(i)]`` for i < n_rows, where ``s(i)`` is ``sidx[i]`` (SRC_IDX) or i
    and ``d(i)`` is ``didx[i]`` (DST_IDX) or i: a gather, a scatter, or both in one pass.

    A row is ``row_v * VEC`` units; strides are in VEC-unit groups, so every row start is a
    multiple of VEC units (the alignment the wrapper checked), which lets the compiler vectorise.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    s_row = tl.load(sidx_ptr + rows, mask=rmask, other=0).to(tl.int64) if SRC_IDX else rows
    d_row = tl.load(didx_ptr + rows, mask=rmask, other=0).to(tl.int64) if DST_IDX else rows
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < row_v * VEC
    s_off = (s_row * src_stride_v) * VEC
    d_off = (d_row * dst_stride_v) * VEC
    mask = rmask[:, None] & cmask[None, :]
    vals = tl.load(src_ptr + s_off[:, None] + cols[None, :], mask=mask)
    tl.store(dst_ptr + d_off[:, None] + cols[None, :], vals, mask=mask)


@triton.jit
def _peer_copy_rows(srcs, dst_ptr, own_ptr, idx_ptr, n_rows, row_v, src_stride_v, dst_stride_v,
                    base, NSRC: tl.constexpr, VEC: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_C: tl.constexpr):
    """``dst[i] = srcs[owner[i] - base][idx[i]]`` for the rows whose owner is in [base,
    base + NSRC) (``srcs``: a tuple of NSRC pointers); other rows are left alone. Units and
    strides as in ``_copy_rows``."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n_rows
    own = tl.load(own_ptr + rows, mask=rmask, other=-1) - base
    rmask = rmask & (own >= 0) & (own < NSRC)
    idx = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < row_v * VEC
    s_off = ((idx * src_stride_v) * VEC)[:, None] + cols[None, :]
    own2 = own[:, None]
    p = srcs[0] + s_off
    for r in tl.static_range(1, NSRC):
        p = tl.where(own2 == r, srcs[r] + s_off, p)
    mask = rmask[:, None] & cmask[None, :]
    vals = tl.load(p, mask=mask)
    d_off = (rows * dst_stride_v) * VEC
    tl.store(dst_ptr + d_off[:, None] + cols[None, :], vals, mask=mask)


@triton.jit
def _page_rows_kernel(keys_ptr, table_ptr, req_ptr, out_ptr, K, sk0, sk1, st0, st1, so0, S,
                      BLOCK: tl.constexpr):
    """Program (row, block of k): each key's page slot from the row's request's block-table
    row, ``slot * S + key % S``; -1 kept."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    jm = j < K
    key = tl.load(keys_ptr + row * sk0 + j * sk1, mask=jm, other=-1)
    valid = key >= 0
    kk = tl.where(valid, key, 0)
    req = tl.load(req_ptr + row).to(tl.int64)
    slot = tl.load(table_ptr + req * st0 + (kk // S).to(tl.int64) * st1, mask=jm & valid,
                   other=0).to(tl.int64)
    rows = tl.where(valid, slot * S + kk % S, -1)
    tl.store(out_ptr + row * so0 + j, rows.to(tl.int32), mask=jm)


@triton.jit
def _fp8_pack_kernel(x_ptr, out_ptr, rows_ptr, scale_ptr, n_rows, sx_n, sx_d, so_n, so_t,
                     ss_n, ss_t, PS,
                     DIMS: tl.constexpr, QB: tl.constexpr, NBLK: tl.constexpr,
                     ROPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                     BLOCK_RB: tl.constexpr, FLOOR: tl.constexpr, POW2: tl.constexpr,
                     INV_MAX: tl.constexpr, SCATTER: tl.constexpr, ROTATE: tl.constexpr,
                     OUT: tl.constexpr, F32_DOT: tl.constexpr, NORM: tl.constexpr,
                     SPLIT: tl.constexpr):
    """Program (i, b): rows [i * BLOCK_N, ...) x quant block b, or the rope when b == NBLK.
    ``POW2``: ue8m0 scales. ``SCATTER``: row i to page ``rows[i] // PS``, token ``rows[i] % PS``
    (``fp8_store``). ``ROTATE``: the Hadamard rotation first. ``SPLIT``: the scales to
    ``scale_ptr`` at (page, token) strides ``ss_n`` / ``ss_t``."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    x_row = x_ptr + rows[:, None] * sx_n
    if SCATTER:
        dst = tl.load(rows_ptr + rows, mask=rmask, other=0)
        page, tok = dst // PS, dst % PS
        o_row = out_ptr + (page * so_n + tok * so_t)[:, None]
        s_row = scale_ptr + (page * ss_n + tok * ss_t)[:, None] if SPLIT else o_row + DIMS
    else:
        o_row = out_ptr + rows[:, None] * so_n
        s_row = o_row + DIMS
    if b < NBLK:
        cols = tl.arange(0, BLOCK_Q)
        cmask = cols < QB
        mask = rmask[:, None] & cmask[None, :]
        d = b * QB + cols
        v = tl.load(x_row + d[None, :] * sx_d, mask=mask, other=0.0)
        v = hadamard_rows(v, cols, F32_DOT, NORM, OUT) if ROTATE else v.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(v), axis=1), FLOOR)
        if POW2:  # the exponent + 1 when any mantissa bit is set, as the reference
            r = (amax * INV_MAX).to(tl.int32, bitcast=True)
            scale = ((r + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
        else:
            scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))  # IEEE, as torch
        y = tl.math.div_rn(v, scale[:, None])
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(o_row + d[None, :], e4m3_bits(y).to(tl.uint8), mask=mask)
        sb = tl.arange(0, 4)
        sbits = scale.to(tl.int32, bitcast=True)
        sbytes = (sbits[:, None] >> (sb[None, :] * 8)) & 0xFF  # little-endian
        tl.store(s_row + b * 4 + sb[None, :], sbytes.to(tl.uint8), mask=rmask[:, None])
    else:
        # names differ from the other branch: Triton wants a name to keep one type across branches
        rc = tl.arange(0, BLOCK_RB)  # output byte of the rope: value rc // 2, byte rc % 2
        rmask2 = rmask[:, None] & (rc < 2 * ROPE)[None, :]
        rv = tl.load(x_row + (DIMS + rc // 2)[None, :] * sx_d, mask=rmask2, other=0.0).to(tl.float32)
        rbits = bf16_bits(rv)
        rbyte = (rbits >> ((rc % 2) * 8).to(tl.uint32)[None, :]) & 0xFF
        tl.store(o_row + DIMS + (0 if SPLIT else 4 * NBLK) + rc[None, :], rbyte.to(tl.uint8),
                 mask=rmask2)


@triton.jit
def _fp8_unpack_kernel(p_ptr, out_ptr, idx_ptr, n_rows, sp_n, sp_b, so_n,
                       DIMS: tl.constexpr, QB: tl.constexpr, NBLK: tl.constexpr,
                       ROPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_R: tl.constexpr, OUT: tl.constexpr, HAS_INDEX: tl.constexpr):
    """OUT: 0 float32, 1 bfloat16 (bits, written through an int16 view), 2 float16.
    HAS_INDEX: output row i reads packed row ``idx[i]`` (the gather fused into the pass)."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    src = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64) if HAS_INDEX else rows
    p_row = p_ptr + src[:, None] * sp_n
    o_row = out_ptr + rows[:, None] * so_n
    if b < NBLK:
        cols = tl.arange(0, BLOCK_Q)
        mask = rmask[:, None] & (cols < QB)[None, :]
        d = b * QB + cols
        code = tl.load(p_row + d[None, :] * sp_b, mask=mask, other=0).to(tl.int32)
        s_ptr = p_ptr + src * sp_n + (DIMS + b * 4) * sp_b
        sbits = tl.load(s_ptr, mask=rmask, other=0).to(tl.int32)
        for k in tl.static_range(1, 4):  # little-endian fp32 scale, at any byte alignment
            sbits |= tl.load(s_ptr + k * sp_b, mask=rmask, other=0).to(tl.int32) << (8 * k)
        scale = sbits.to(tl.float32, bitcast=True)
        v = e4m3_value(code) * scale[:, None]
        if OUT == 0:
            tl.store(o_row + d[None, :], v, mask=mask)
        elif OUT == 1:
            tl.store(o_row + d[None, :], bf16_bits(v).to(tl.int16), mask=mask)
        else:
            tl.store(o_row + d[None, :], v.to(tl.float16), mask=mask)
    else:
        # names differ from the other branch: Triton wants a name to keep one type across branches
        rj = tl.arange(0, BLOCK_R)
        rmask2 = rmask[:, None] & (rj < ROPE)[None, :]
        rbase = DIMS + 4 * NBLK + 2 * rj
        lo = tl.load(p_row + rbase[None, :] * sp_b, mask=rmask2, other=0).to(tl.int32)
        hi = tl.load(p_row + (rbase + 1)[None, :] * sp_b, mask=rmask2, other=0).to(tl.int32)
        rbits = lo | (hi << 8)
        rd = DIMS + rj
        if OUT == 1:
            tl.store(o_row + rd[None, :], rbits.to(tl.int16), mask=rmask2)
        else:
            rv = (rbits << 16).to(tl.float32, bitcast=True)
            if OUT == 0:
                tl.store(o_row + rd[None, :], rv, mask=rmask2)
            else:
                tl.store(o_row + rd[None, :], rv.to(tl.float16), mask=rmask2)
