"""One tile of the lightning indexer's logits, shared by the plain prefill kernel
(``attention._indexer_kernel``) and the fused indexer + top-k filter (:mod:`.indexer_topk`): the
two must compute the same logits, bit for bit, so they compute them here.

A tile is ``sum_h w[i, h] * relu(q[i, h] . k[j])`` over BLOCK_M rows x BLOCK_N keys, one dot a
head in head order. Two ways, by the launch's ``PARTS``:

* ``PARTS == 0``: ``acc += w_h * max(s_h, 0)`` a head (an FMNMX and an FFMA a logit).
* ``PARTS > 0`` (fp8 queries and keys, the tuning table's ``ABS_PARTS``): the identity
  ``relu(s) = (s + |s|) / 2``::

      sum_h w_h relu(s_h) = 1/2 (sum_h w_h q_h) . k + sum_h (w_h / 2) |s_h|

  The signed half is ``PARTS`` fp8 dots a tile of ``qw = sum_h w_h q_h`` split into fp8 parts
  under one power-of-two scale a row (:func:`split_queries`: each part the e4m3 rounding of
  what the previous ones left, so ``qw`` is held to ~2^(-4 PARTS) of itself, or a subnormal step
  ``2^-9`` of the scale), issued into the accumulator before the head loop; each head then
  costs one FFMA with an ``|R|`` operand a logit (:func:`fma_abs`). On an H100 at the 700 W
  cap: 1.00-1.16x the plain kernel by shape with three parts (``indexer_fp8_vs_deepgemm`` 1.116
  against 1.033; the fused path 1.017x), measured by ``benchmarks/indexer_parts_gpu.py``.
  Numerics: the logits sit ~1.1e-3 of the largest from the plain kernel's (which sits 3e-7
  from DeepGEMM's): each negative head's ``w s / 2`` and ``w |s| / 2`` come from different
  reduced-precision fp8 accumulations and no longer cancel exactly, whatever the parts' count
  (two and three measure the same). Within the conformance suite's fp8 bound with three parts,
  not with two; off in the tuning table (docs/perf.md, session 20). The same rows give the same
  logits whatever the chunking (the parts are per row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import INV_E4M3_MAX_F32, e4m3_bits, e4m3_value

__all__ = ["fma_abs", "head_sum", "key_tile", "qk_dot", "split_queries"]

#: rows a program of :func:`split_queries`' kernel
_SPLIT_ROWS = 16
#: the smallest ``|qw|`` maximum a row's scale is taken from (an all-zero row: no NaN)
_QW_FLOOR = 1e-30


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
def qk_dot(q, kt, UPCAST: tl.constexpr, PRECISE: tl.constexpr):
    """``q @ kt`` of a query tile and a :func:`key_tile`: fp32 IEEE (``UPCAST``), else on the
    tensor cores in the operands' type; ``PRECISE`` k > 0 (fp8 x fp8 only): the partial sums
    promoted into fp32 every k of the reduction (``max_num_imprecise_acc``)."""
    if UPCAST:
        s = tl.dot(q.to(tl.float32), kt, input_precision="ieee")
    elif PRECISE:
        s = tl.dot(q, kt, max_num_imprecise_acc=PRECISE)
    else:
        s = tl.dot(q, kt)
    return s


@triton.jit
def fma_abs(s, w, acc, ASM: tl.constexpr):
    """``acc + |s| * w`` rounded once: with ``ASM`` one FFMA with a ``|R|`` operand (inline
    ``abs.f32`` + ``fma.rn.f32``, which ptxas folds); Triton's ``fma`` of ``abs`` otherwise (the
    CPU interpreter runs no PTX)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 t; abs.f32 t, $1; fma.rn.f32 $0, t, $2, $3; }", "=r,r,r,r",
            [s, w, acc], dtype=tl.float32, is_pure=True, pack=1)
    return tl.fma(tl.abs(s), w, acc)


@triton.jit
def head_sum(q_ptr, w_ptr, qw_ptr, sh_ptr, ktt, rows64, rmask, d, dmask,
             sq0, sq1, sq2, sw0, sw1,
             H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             UPCAST: tl.constexpr, PARTS: tl.constexpr, ASM: tl.constexpr):
    """The tile's ``sum_h w[i, h] relu(q[i, h] . k[j])`` (fp32 [BLOCK_M, BLOCK_N], before the
    keys' fp8 scale) against the key tile ``ktt``. ``PARTS > 0``: ``w_ptr`` holds ``w / 2`` and
    ``qw_ptr`` / ``sh_ptr`` the rows' parts and halved scales (:func:`split_queries`)."""
    qmask = rmask[:, None] & dmask[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PARTS:  # the signed half first: its dots accumulate in place, then the row's scale
        qwb = qw_ptr + rows64[:, None] * (PARTS * D) + d[None, :]
        for p in tl.static_range(PARTS):
            qp = tl.load(qwb + p * D, mask=qmask, other=0.0)
            if UPCAST:
                acc += tl.dot(qp.to(tl.float32), ktt, input_precision="ieee")
            else:
                acc = tl.dot(qp, ktt, acc)
        sh = tl.load(sh_ptr + rows64, mask=rmask, other=0.0)
        acc = acc * sh[:, None]
    qbase = q_ptr + rows64[:, None] * sq0 + d[None, :] * sq2
    for h in range(H):
        qh = tl.load(qbase + h * sq1, mask=qmask, other=0.0)
        wh = tl.load(w_ptr + rows64 * sw0 + h * sw1, mask=rmask, other=0.0)
        s = qk_dot(qh, ktt, UPCAST, 0)
        if PARTS:
            acc = fma_abs(s, tl.broadcast_to(wh[:, None], [BLOCK_M, BLOCK_N]), acc, ASM)
        else:
            acc += wh[:, None] * tl.maximum(s, 0.0)
    return acc


@triton.jit
def _split_kernel(q_ptr, w_ptr, qw_ptr, sh_ptr, w2_ptr, N, sq0, sq1, sq2, sw0, sw1,
                  H: tl.constexpr, D: tl.constexpr, PARTS: tl.constexpr, FLOOR: tl.constexpr,
                  INV_MAX: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows ``[pid * BLOCK_R, ...)``: ``qw = sum_h w_h float(q_h)`` in head order (fp32), the
    power-of-two scale ``s >= max|qw| / 448`` (from the bits, as the "ue8m0" scales), then
    ``PARTS`` e4m3 codes of ``qw / s``, each of what the previous left (exact in fp32: a value
    minus its own rounding), ``s / 2`` and ``w / 2``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_R, D], dtype=tl.float32)
    for h in range(H):
        qh = tl.load(q_ptr + rows[:, None] * sq0 + h * sq1 + d[None, :] * sq2,
                     mask=rmask[:, None], other=0.0).to(tl.float32)
        wh = tl.load(w_ptr + rows * sw0 + h * sw1, mask=rmask, other=0.0)
        acc += wh[:, None] * qh
        tl.store(w2_ptr + rows * H + h, wh * 0.5, mask=rmask)
    amax = tl.maximum(tl.max(tl.abs(acc), axis=1), FLOOR)
    r = (amax * INV_MAX).to(tl.int32, bitcast=True)
    s = ((r + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    v = tl.math.div_rn(acc, s[:, None])
    for p in tl.static_range(PARTS):
        c = e4m3_bits(tl.minimum(tl.maximum(v, -448.0), 448.0))
        tl.store(qw_ptr + rows[:, None] * (PARTS * D) + p * D + d[None, :], c.to(tl.uint8),
                 mask=rmask[:, None])
        v = v - e4m3_value(c)
    tl.store(sh_ptr + rows, s * 0.5, mask=rmask)


def split_queries(q: torch.Tensor, w: torch.Tensor, parts: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The signed half's inputs of fp8 queries ``q`` [N, H, D] (D a power of two) and weights
    ``w`` float32 [N, H]: ``(qw, sh, w2)`` = float8_e4m3fn [N, parts, D], float32 [N] (the
    rows' scales halved) and float32 [N, H] (``w / 2``, exact), with ``sh * 2 * sum_p
    float(qw[:, p])`` ~ ``sum_h w_h q_h``. One kernel, no host sync."""
    n, heads, d = q.shape
    qw = torch.empty((n, parts, d), dtype=torch.uint8, device=q.device)
    sh = torch.empty((n,), dtype=torch.float32, device=q.device)
    w2 = torch.empty((n, heads), dtype=torch.float32, device=q.device)
    if n:
        _split_kernel[(triton.cdiv(n, _SPLIT_ROWS),)](
            q, w, qw, sh, w2, n, q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
            H=heads, D=d, PARTS=parts, FLOOR=_QW_FLOOR, INV_MAX=INV_E4M3_MAX_F32,
            BLOCK_R=_SPLIT_ROWS, num_warps=4)
    return qw.view(torch.float8_e4m3fn), sh, w2
