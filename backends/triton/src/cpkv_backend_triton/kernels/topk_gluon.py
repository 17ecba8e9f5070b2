"""The long-row top-k's filter in Gluon, its layout chosen (16-byte loads, a scan inside the
thread then across threads): the contract of ``_topk_filter_kernel`` on contiguous fp32 rows of
a CUDA device; blocks start on 16-column boundaries.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _keep(x, cols, take, cnt, crow, CAP: gl.constexpr):
    """One block's candidates (``take``) appended in column order from place ``cnt`` (stored
    while below CAP); the new count."""
    t = take.to(gl.int32)
    nt = gl.sum(t, axis=0)
    if nt > 0:  # a block without candidates: no scan, no store
        pos = cnt + gl.associative_scan(t, 0, _add) - 1
        # radix.ord_key's key in Gluon (a Gluon kernel calls no triton.jit helper)
        b = gl.where(x == 0.0, 0.0, x).to(gl.int32, bitcast=True)  # -0.0 and 0.0 alike
        key = b ^ ((b >> 31) & 0x7FFFFFFF)  # signed order = the float order
        comp = (key.to(gl.int64) << 32) | (2147483647 - cols).to(gl.int64)
        gl.store(crow + pos, comp, mask=take & (pos < CAP))
    return cnt + nt


@gluon.jit
def _topk_filter_gluon_kernel(x_ptr, ks_ptr, ke_ptr, floor_ptr, cand_ptr, count_ptr, T, K, CS,
                              NS, sx0, BLOCK: gl.constexpr, CAP: gl.constexpr,
                              num_warps: gl.constexpr):
    lay: gl.constexpr = gl.BlockedLayout([BLOCK // (32 * num_warps)], [32], [num_warps], [0])
    row = gl.program_id(0).to(gl.int64)
    j = gl.program_id(1)
    # radix.row_range in Gluon
    start = gl.minimum(gl.maximum(gl.load(ks_ptr + row), 0), T).to(gl.int32)
    end = gl.minimum(gl.maximum(gl.load(ke_ptr + row), 0), T).to(gl.int32)
    cnt = j * 0
    if end - start > K:
        xrow = x_ptr + row * sx0
        crow = cand_ptr + (row * NS + j) * CAP
        lo = gl.load(floor_ptr + row)
        c_lo = start + j * CS
        c_hi = gl.minimum(c_lo + CS, end)
        a_lo = (c_lo // 16) * 16
        full = a_lo + ((c_hi - a_lo) // BLOCK) * BLOCK  # blocks wholly below c_hi (<= T)
        idx = gl.arange(0, BLOCK, layout=lay)
        for c0 in range(a_lo, full, BLOCK):
            c0 = gl.multiple_of(c0, 16)
            cols = c0 + idx
            x = gl.load(xrow + cols)
            cnt = _keep(x, cols, (cols >= c_lo) & (x >= lo), cnt, crow, CAP)
        for c0 in range(full, c_hi, BLOCK):  # the last block, masked (at most one)
            cols = c0 + idx
            m = (cols < c_hi) & (cols >= c_lo)
            x = gl.load(xrow + cols, mask=m, other=float("-inf"))
            cnt = _keep(x, cols, m & (x >= lo), cnt, crow, CAP)
    gl.store(count_ptr + row * NS + j, cnt)
