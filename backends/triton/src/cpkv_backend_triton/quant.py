"""The ``index_q_fp8`` op over :mod:`.kernels.fp8` (the indexer's queries rotated and quantized per
(row, head) with ue8m0 scales folded into the head weights: one kernel where torch ops take 13),
and the fp32 constants of the fp8 formulas (the floors and ``1 / 448`` as an fp32 op uses them).
Semantics are :class:`cpkv.ops.api.KVOps`'s, checked by ``cpkv.testing.conformance``.
"""

from __future__ import annotations

import struct

import torch
import triton

from cpkv.ops.api import (
    FP8_AMAX_FLOOR,
    FP8_E4M3_MAX,
    UE8M0_AMAX_FLOOR,
    OpDeclined,
    check_index_q_args,
)

from .kernels.fp8 import _index_q_kernel

__all__ = ["AMAX_FLOOR_F32", "INDEX_Q_BLOCK", "INV_E4M3_MAX_F32", "OUT_DTYPES", "UE8M0_FLOOR_F32",
           "QuantKernels", "f32"]


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (what an fp32 tensor op does with a Python scalar)."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


#: the reference's clamp_min(FP8_AMAX_FLOOR) on an fp32 tensor clamps at its float32 value
AMAX_FLOOR_F32 = f32(FP8_AMAX_FLOOR)
UE8M0_FLOOR_F32 = f32(UE8M0_AMAX_FLOOR)
#: the reference's ``amax * (1/448)`` multiplies by this fp32 value
INV_E4M3_MAX_F32 = f32(1.0 / FP8_E4M3_MAX)
#: (row, head) pairs per ``index_q_fp8`` program (a tensor-core dot needs >= 16)
INDEX_Q_BLOCK = 32
#: a kernel's code of a 16/32-bit float dtype (the rotation's rounding)
OUT_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


class QuantKernels:
    """The ``index_q_fp8`` op of the Triton backend (a part of ``TritonOps``).

    Args:
        block: (row, head) pairs per program (>= 16: the rotation is a tensor-core dot).
    """

    def __init__(self, block: int = INDEX_Q_BLOCK) -> None:
        if block < 16 or block & (block - 1):
            raise ValueError(f"QuantKernels: block must be a power of two >= 16, got {block}")
        self.block = block

    def index_q_fp8(self, q: torch.Tensor, w: torch.Tensor,
                    rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's fp8 queries and folded weights in one pass; see
        :class:`cpkv.ops.api.KVOps`.

        Raises:
            ValueError: a shape or dtype does not fit (as every backend).
            OpDeclined: the rotation of a head dim under 16 (a tensor-core dot's least), or a
                query dtype other than bf16 / fp16 / fp32.
        """
        check_index_q_args(q, w, rotate)
        n, h, d = q.shape
        out = OUT_DTYPES.get(q.dtype)
        if out is None:
            raise OpDeclined(f"index_q_fp8: a {q.dtype} query (the kernel takes bf16, fp16, fp32)")
        if rotate and d < 16:
            raise OpDeclined(f"index_q_fp8: the rotation of head dim {d} (the dot needs >= 16)")
        q8 = torch.empty((n, h, d), dtype=torch.float8_e4m3fn, device=q.device)
        wo = torch.empty((n, h), dtype=torch.float32, device=q.device)
        pairs = n * h
        if pairs == 0:
            return q8, wo
        grid = (triton.cdiv(pairs, self.block),)
        _index_q_kernel[grid](q, w, q8.view(torch.uint8), wo, pairs, h,
                              q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                              D=d, DP=triton.next_power_of_2(d), ROTATE=rotate, OUT=out,
                              F32_DOT=out == 2 or q.device.type == "cpu",
                              NORM=f32(d ** -0.5), FLOOR=UE8M0_FLOOR_F32, INV_MAX=INV_E4M3_MAX_F32,
                              BLOCK=self.block, num_warps=4)
        return q8, wo
