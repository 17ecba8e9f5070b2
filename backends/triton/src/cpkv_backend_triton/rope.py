"""Triton kernel of the ``rope`` op: a layer's rotary embedding in one pass.

The model's rotations, as torch ops, are six strided elementwise passes each (products, then
their sum and difference, each rounded to bf16); over the query of the DeepSeek-V3.2 stack
(64K rows x 128 heads x 64 rope dims, a strided slice of the q projection) they took 4.7 ms per
layer on the H200, the indexer's two more. One program here takes ``BLOCK`` (row, head) pairs:
it loads each pair's ``R`` values as one contiguous vector (the interleaved pairs split in
registers), the row's cos / sin halves, computes in fp32 and stores both halves once (rounded
once, where the reference rounds each product: within the op's conformance bound). In place
(``out`` is ``x``) is safe: a program reads its pairs before writing them, and pairs are
disjoint between programs.

Semantics are :class:`cpkv.ops.api.KVOps`'s ``rope``, checked by ``cpkv.testing.conformance``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from cpkv.ops.api import check_rope_args

if TYPE_CHECKING:
    from cpkv.ops.api import RopeStyle

__all__ = ["ROPE_BLOCK", "RopeKernels"]

#: (row, head) pairs per program
ROPE_BLOCK = 16


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, P, H,
                 sx0, sx1, sx2, so0, so1, so2, sc0, sc1, ss0, ss1,
                 HALF, HP: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    pm = p < P
    row = p // H
    head = p % H
    j = tl.arange(0, HP)  # HP: HALF rounded up to a power of two
    m2 = pm[:, None] & (j[None, :] < HALF)
    c = tl.load(cos_ptr + row[:, None] * sc0 + j[None, :] * sc1, mask=m2, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + row[:, None] * ss0 + j[None, :] * ss1, mask=m2, other=0.0).to(tl.float32)
    xb = x_ptr + row[:, None] * sx0 + head[:, None] * sx1
    if INTERLEAVE:  # pairs (x[2j], x[2j+1]): one contiguous load, split in registers
        r = tl.arange(0, 2 * HP)
        xx = tl.load(xb + r[None, :] * sx2, mask=pm[:, None] & (r[None, :] < 2 * HALF),
                     other=0.0).to(tl.float32)
        a, b = tl.split(tl.reshape(xx, [BLOCK, HP, 2]))
    else:  # halves (x[j], x[h + j])
        a = tl.load(xb + j[None, :] * sx2, mask=m2, other=0.0).to(tl.float32)
        b = tl.load(xb + (j[None, :] + HALF) * sx2, mask=m2, other=0.0).to(tl.float32)
    ob = out_ptr + row[:, None] * so0 + head[:, None] * so1
    lo = a * c - b * s
    hi = b * c + a * s
    ty = out_ptr.dtype.element_ty
    if ty != tl.float32:  # to nearest even on GPUs (the CPU interpreter truncates: still in bound)
        lo = lo.to(ty, fp_downcast_rounding="rtne")
        hi = hi.to(ty, fp_downcast_rounding="rtne")
    tl.store(ob + j[None, :] * so2, lo, mask=m2)
    tl.store(ob + (j[None, :] + HALF) * so2, hi, mask=m2)


class RopeKernels:
    """The ``rope`` op of the Triton backend (a part of ``TritonOps``).

    Args:
        block: (row, head) pairs per program (the bench sweeps it).
    """

    def __init__(self, block: int = ROPE_BLOCK) -> None:
        self.block = block

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """The rotary embedding of ``x`` rows in one pass; see :class:`cpkv.ops.api.KVOps`.

        Raises:
            ValueError: a shape, dtype or style does not fit (as the reference).
        """
        check_rope_args(x, cos, sin, style, out)
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        x3 = x if x.dim() == 3 else x[:, None]
        o3 = out if out.dim() == 3 else out[:, None]
        n, h, r = x3.shape
        pairs = n * h
        if pairs == 0:
            return out
        half = r // 2
        grid = (triton.cdiv(pairs, self.block),)
        _rope_kernel[grid](x3, cos, sin, o3, pairs, h,
                           x3.stride(0), x3.stride(1), x3.stride(2),
                           o3.stride(0), o3.stride(1), o3.stride(2),
                           cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
                           HALF=half, HP=triton.next_power_of_2(half),
                           INTERLEAVE=style == "interleave", BLOCK=self.block, num_warps=4)
        return out
