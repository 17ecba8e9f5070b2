"""The ``rms_norm`` op (:mod:`.kernels.norm`): a row's RMSNorm in one pass, rows any column slice
of a wider tensor; within the op's conformance bound (the kernel's summation order).
"""

from __future__ import annotations

import torch
import triton

from cpkv.ops.api import check_rms_norm_args

from .kernels.norm import _rms_norm_kernel

__all__ = ["NormKernels"]


class NormKernels:
    """The ``rms_norm`` op of the Triton backend (a part of ``TritonOps``)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of ``x``'s rows in one pass; see :class:`cpkv.ops.api.KVOps`.

        Raises:
            ValueError: a shape or dtype does not fit (as every backend).
        """
        check_rms_norm_args(x, weight)
        n, d = x.shape
        out = torch.empty((n, d), dtype=x.dtype, device=x.device)
        if n == 0 or d == 0:
            return out
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(n,)](x, weight, out, d, x.stride(0), out.stride(0), float(eps),
                               BLOCK=block, num_warps=8 if block >= 4096 else 4)
        return out
