"""The long-row top-k's filter (kernel 2 of 4 of :mod:`cpkv_backend_triton.topk`'s one-read path)
in Gluon, with the layout chosen instead of inferred: each thread holds ``BLOCK / (32 x warps)``
consecutive columns of a block, so the logits come in 16-byte loads, the candidates' positions
are a scan inside the thread plus one across threads, and the candidates are stored from the
same layout.

Why: the Triton kernel (``_topk_filter_kernel``) is bound by its instructions, not by memory
(1.5-1.7 TB/s on an H100 against a 3.0 TB/s copy, docs/perf.md). Its coalesced layout puts one
column of each 128-column row of a block in a thread, so the block's scan is 8 warp scans (48
shuffles and ~170 adds and selects a thread); with 16-byte loads Triton converts the block
through shared memory before the scatter store instead (measured 1.34x slower). Here neither.

Same contract as the Triton kernel: program (row, split of CS columns); the keys at or above the
row's floor are candidates, ``key << 32 | (2^31 - 1 - column)`` int64 in column order from the
split's scratch row (at most CAP stored, the count goes on). Blocks start on 16-column
boundaries (the split's first block reaches back to one; those columns are not taken), every
block but the last is read unmasked. Takes contiguous fp32 rows (column stride 1) on a CUDA
device: :func:`gluon_filter_declines` says why not otherwise. Chosen by the tuning field
``GLUON`` of ``TOPK_LONG`` (1 in the table: measured 1.47-1.56x the Triton filter, docs/perf.md).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .tuning import device_of

__all__ = ["gluon_filter", "gluon_filter_declines"]


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
        # topk.ord_key's key, written here: importing topk would be a cycle (topk dispatches here)
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
    # topk.row_range, written here (no import of topk: a cycle)
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


def gluon_filter_declines(logits: torch.Tensor, block: int, warps: int) -> str | None:
    """Why :func:`gluon_filter` cannot take these logits on a CUDA device and launch (metadata
    only), or None. Logits off a GPU never get here: ``topk`` declines them before importing
    this module."""
    if logits.dtype != torch.float32:
        return f"the Gluon filter reads fp32 logits, got {logits.dtype}"
    if (device_of(logits.device)[1] or (0, 0)) < (8, 0):
        return "the Gluon filter needs an sm80+ GPU"
    if logits.stride(1) != 1:
        return "the Gluon filter reads rows of column stride 1"
    if block % (32 * warps):
        return f"BLOCK {block} is not a multiple of 32 x {warps} warps"
    return None


def gluon_filter(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, floor: torch.Tensor,
                 cand: torch.Tensor, count: torch.Tensor, k: int, cs: int, ns: int, block: int,
                 cap: int, warps: int) -> None:
    """:func:`_topk_filter_gluon_kernel` over ``logits`` [N, T] fp32 (the caller checked
    :func:`gluon_filter_declines`): the same arguments and results as the Triton filter."""
    n, t = logits.shape
    _topk_filter_gluon_kernel[(n, ns)](logits, ks, ke, floor, cand, count, t, k, cs, ns,
                                       logits.stride(0), BLOCK=block, CAP=cap,
                                       num_warps=warps)
