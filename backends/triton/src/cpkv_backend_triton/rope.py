"""The ``rope`` op: a layer's rotary embedding in one pass (:mod:`.kernels.rope`), where torch ops
take six strided passes. Rounded once where the reference rounds each product (within the op's
conformance bound). In place (``out`` is ``x``) is safe: a program reads its (row, head) pairs
before writing them, and pairs are disjoint between programs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton

from cpkv.ops.api import check_rope_args

from .kernels.rope import _rope_kernel

if TYPE_CHECKING:
    from cpkv.ops.api import RopeStyle


__all__ = ["ROPE_BLOCK", "RopeKernels"]

#: (row, head) pairs per program
ROPE_BLOCK = 16


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
