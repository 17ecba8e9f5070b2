"""The fp8 (e4m3) formulas as Triton helpers and the ``index_q_fp8`` kernel.

:func:`bf16_bits`, :func:`e4m3_bits` and :func:`e4m3_value` round in integer ops exactly as c10
does, so a kernel using them gives the torch reference's bits (``fp8_pack`` / ``fp8_unpack`` and
``index_q_fp8`` share them). :func:`hadamard_rows` is DeepSeek's ``rotate_activation``: the
Sylvester matrix built from index bits in registers, one tensor-core dot with fp32 sums.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bf16_bits", "e4m3_bits", "e4m3_value", "hadamard_rows"]


@triton.jit
def bf16_bits(v):
    """fp32 -> bf16 bits (uint32 in [0, 0xFFFF]), round to nearest even; NaN -> 0x7FC0 (c10)."""
    u = v.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, r)


@triton.jit
def e4m3_bits(y):
    """fp32 (already clamped to [-448, 448]) -> float8_e4m3fn code (int32 in [0, 255]), round to
    nearest even with subnormals: c10's ``fp8e4m3fn_from_fp32_value`` in integer ops."""
    u = y.to(tl.int32, bitcast=True)
    a = u & 0x7FFFFFFF
    sign = (u >> 24) & 0x80
    # normal (|y| >= 2^-6): round the 23-bit mantissa to 3 bits, rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # subnormal: round(|y| * 2^9) to an integer, half to even (0 .. 8; 8 is the smallest normal)
    e = a >> 23
    m = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(141 - e, 31)  # >= 21 here
    q = m >> s
    rem = m & ((1 << s) - 1)
    half = 1 << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = tl.where(e == 0, 0, q + up.to(tl.int32))
    code = tl.where(a >= 0x3C800000, normal, sub)
    code = tl.where(a > 0x7F800000, 0x7F, code)  # NaN stays NaN
    return code | sign


@triton.jit
def e4m3_value(c):
    """float8_e4m3fn code (int32 in [0, 255]) -> its exact fp32 value."""
    e = (c >> 3) & 15
    m = c & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125,  # m * 2^-9, exact
                   ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True))
    mag = tl.where((c & 0x7F) == 0x7F, float("nan"), mag)
    # the sign as a bit: Triton lowers ``-x`` as ``0 - x``, which turns -0.0 (code 0x80) into +0.0
    bits = mag.to(tl.uint32, bitcast=True) | ((c & 0x80).to(tl.uint32) << 24)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def hadamard_rows(x, d, F32_DOT: tl.constexpr, NORM: tl.constexpr, OUT: tl.constexpr):
    """DeepSeek's ``rotate_activation`` of rows ``x`` [BLOCK >= 16, D] (``d = arange(D)``, D a
    power of two): the Sylvester matrix built from index bits in registers (``H[i, j] =
    (-1)^popcount(i & j)``, exact in any dtype), one tensor-core dot with fp32 sums (as the
    reference's ``mm(..., out_dtype=float32)``; ``F32_DOT``: an fp32 dot, for fp32 rows and the
    CPU interpreter, whose 16-bit dot is wrong), times ``NORM`` (D^-1/2), rounded to the rows'
    dtype ``OUT`` (0 bf16, 1 fp16, 2 fp32) and returned as fp32."""
    b = d[:, None] & d[None, :]
    b = b ^ (b >> 8)
    b = b ^ (b >> 4)
    b = b ^ (b >> 2)
    b = b ^ (b >> 1)
    sign = 1.0 - 2.0 * (b & 1).to(tl.float32)
    y = (tl.dot(x.to(tl.float32), sign, input_precision="ieee") if F32_DOT
         else tl.dot(x, sign.to(x.dtype)))
    y = y * NORM
    if OUT == 0:  # to nearest even in integer ops (the interpreter's cast truncates)
        y = (bf16_bits(y) << 16).to(tl.float32, bitcast=True)
    elif OUT == 1:
        y = y.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
    return y


@triton.jit
def _index_q_kernel(q_ptr, w_ptr, q8_ptr, wo_ptr, P, H, sq0, sq1, sq2, sw0, sw1,
                    D: tl.constexpr, DP: tl.constexpr, ROTATE: tl.constexpr, OUT: tl.constexpr,
                    F32_DOT: tl.constexpr, NORM: tl.constexpr, FLOOR: tl.constexpr, INV_MAX: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Pairs ``[pid * BLOCK, ...)`` of the [P = N * H] (row, head) pairs. ``OUT``: q's dtype
    (0 bf16, 1 fp16, 2 fp32), the rotation's rounding. ``F32_DOT``: the rotation as an fp32
    dot (fp32 queries; and the CPU interpreter, whose 16-bit dot is wrong). q8 is written as
    uint8 codes, [P, D] contiguous; w' as float32 [P]."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    pm = p < P
    row = p // H
    head = p % H
    d = tl.arange(0, DP)
    m2 = pm[:, None] & (d[None, :] < D)
    x = tl.load(q_ptr + row[:, None] * sq0 + head[:, None] * sq1 + d[None, :] * sq2, mask=m2,
                other=0.0)
    # D == DP with ROTATE (a power of two)
    y = hadamard_rows(x, d, F32_DOT, NORM, OUT) if ROTATE else x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(y), axis=1), FLOOR)
    r = (amax * INV_MAX).to(tl.int32, bitcast=True)
    scale = ((r + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)  # ue8m0, as the reference
    v = tl.math.div_rn(y, scale[:, None])
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    tl.store(q8_ptr + p[:, None] * D + d[None, :], e4m3_bits(v).to(tl.uint8), mask=m2)
    w = tl.load(w_ptr + row * sw0 + head * sw1, mask=pm, other=0.0)
    tl.store(wo_ptr + p, w * scale, mask=pm)
