"""The ``rms_norm`` kernel: one row a program, the squares summed in fp32, rounded once."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, sx, so, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    m = d < D
    x = tl.load(x_ptr + row * sx + d, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * r * w
    ty = out_ptr.dtype.element_ty
    if ty != tl.float32:  # to nearest even on GPUs (the CPU interpreter truncates: in bound)
        y = y.to(ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + row * so + d, y, mask=m)
