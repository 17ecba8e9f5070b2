"""One tile of the lightning indexer's logits, shared by the plain prefill kernel
(``attention._indexer_kernel``) and the fused indexer + top-k filter (:mod:`.indexer_topk`): the
two must compute the same logits, bit for bit, so they compute them here.

A tile is ``sum_h w[i, h] * relu(q[i, h] . k[j])`` over BLOCK_M rows x BLOCK_N keys, one dot a
head in head order.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["head_sum", "key_tile", "qk_dot"]


@triton.jit
def key_tile(k_ptr, q_ptr, cols64, cmask, d, dmask, sk0, sk1, UPCAST: tl.constexpr):
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
def qk_dot(q, kt, UPCAST: tl.constexpr):
    """``q @ kt`` of a query tile and a :func:`key_tile`: fp32 IEEE (``UPCAST``), else on the
    tensor cores in the operands' type."""
    if UPCAST:  # noqa: SIM108 (kept as a constexpr branch)
        s = tl.dot(q.to(tl.float32), kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    return s


@triton.jit
def head_sum(q_ptr, w_ptr, ktt, rows64, rmask, d, dmask, sq0, sq1, sq2, sw0, sw1,
             H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             UPCAST: tl.constexpr):
    """The tile's ``sum_h w[i, h] relu(q[i, h] . k[j])`` (fp32 [BLOCK_M, BLOCK_N], before the
    keys' fp8 scale) against the key tile ``ktt``."""
    qmask = rmask[:, None] & dmask[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    qbase = q_ptr + rows64[:, None] * sq0 + d[None, :] * sq2
    for h in range(H):
        qh = tl.load(qbase + h * sq1, mask=qmask, other=0.0)
        wh = tl.load(w_ptr + rows64 * sw0 + h * sw1, mask=rmask, other=0.0)
        s = qk_dot(qh, ktt, UPCAST)
        acc += wh[:, None] * tl.maximum(s, 0.0)
    return acc
