"""Sparse MLA prefill (absorbed form, FlashMLA's sparse interface): one program per (query row,
block of heads), online softmax over the gathered latent rows; with 16-bit inputs the
probabilities enter the second matmul as ``P_SPLIT`` 16-bit pieces (docs/triton.md)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _query_part(q_ptr, row, h64, hmask, d, dmask, sq0, sq1, sq2, kv_ptr, UPCAST: tl.constexpr):
    """A query row's heads ``h64`` at the dims ``d`` in the first dot's input type: fp32
    (``UPCAST``), else the latent rows' type."""
    q = tl.load(q_ptr + row * sq0 + h64[:, None] * sq1 + d[None, :] * sq2,
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    return q.to(tl.float32) if UPCAST else q.to(kv_ptr.dtype.element_ty)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """``a @ b + acc``: fp32 IEEE with ``UPCAST`` (``a`` converted, ``b`` fp32 already), else on
    the tensor cores in the operands' type."""
    return tl.dot(a.to(tl.float32), b, acc, input_precision="ieee") if UPCAST else tl.dot(a, b, acc)


@triton.jit
def _sparse_mla_kernel(q_ptr, kv_ptr, idx_ptr, out_ptr,
                       H, K, qk_scale,
                       sq0, sq1, sq2, skv0, skv1, si0, si1, so0, so1,
                       DV: tl.constexpr, DK: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                       HAS_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                       UPCAST: tl.constexpr, LOWP: tl.constexpr, P_SPLIT: tl.constexpr,
                       P_FP16: tl.constexpr, P_CAT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    h64 = h.to(tl.int64)
    da = tl.arange(0, DA)
    damask = da < DV
    qa = _query_part(q_ptr, row, h64, hmask, da, damask, sq0, sq1, sq2, kv_ptr, UPCAST)
    db = DV + tl.arange(0, DB)
    dbmask = db < DK
    if HAS_B:
        qb = _query_part(q_ptr, row, h64, hmask, db, dbmask, sq0, sq1, sq2, kv_ptr, UPCAST)
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
            s = _dot(qb, tl.trans(kvb.to(tl.float32) if UPCAST else kvb), s, UPCAST)
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
                p1 = r.to(tl.float16) if P_FP16 else r.to(kv_ptr.dtype.element_ty)
                p2 = (r - p1.to(tl.float32)).to(p1.dtype)
                pc = tl.reshape(tl.join(p1, p2), (BLOCK_H, 2 * BLOCK_K))
                kvc = tl.reshape(tl.permute(tl.join(kvp, kvp), (0, 2, 1)), (2 * BLOCK_K, DA))
                acc = _dot(pc, kvc, acc, UPCAST)
            for _ in tl.static_range(0 if P_CAT else P_SPLIT):
                piece = r.to(tl.float16) if P_FP16 else r.to(kv_ptr.dtype.element_ty)
                r = r - piece.to(tl.float32)
                acc = _dot(piece, kvp, acc, UPCAST)
        else:
            acc = tl.dot(p, kva, acc, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + row * so0 + h64[:, None] * so1 + da[None, :], out,
             mask=hmask[:, None] & damask[None, :])
