"""The ``rope`` kernel: ``BLOCK`` (row, head) pairs a program, each pair's rope values loaded as
one vector (interleaved pairs split in registers), computed in fp32, rounded once."""

from __future__ import annotations

import triton
import triton.language as tl


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
