"""The prefill indexer with the tensor cores and the epilogue overlapped (Hopper, fp8 x fp8), in
Gluon: the head loop issues head h+1's product asynchronously (``warpgroup_mma(is_async=True)``)
before it runs head h's ``relu x weight`` sum, so the wgmma of one head runs under the CUDA-core
work of the previous one. The Triton kernel (:func:`cpkv_backend_triton.attention._indexer_kernel`)
cannot express that: Triton waits for every wgmma right after it is issued
(``wgmma.wait_group 0``), even when the result is only read an iteration later (docs/lessons.md).

Per program a ``[BLOCK_M, BLOCK_N]`` logits tile (rows x keys), one warpgroup per 64 rows: the
key tile is loaded once by TMA into shared memory; the heads' ``[BLOCK_M, D]`` query tiles stream
through a ring of ``QSTAGES`` TMA buffers (head h+QSTAGES refills head h's slot once head h's
product completed); ``s_h = q_h @ k^T`` is a fresh accumulator each head (``use_acc=False``);
``acc += w_h * relu(s_h)``, in head order (the Triton kernel's summation order); then the keys'
fp8 scales, and -inf outside each row's ``[ks, ke)``. Key tiles outside every row's range are
not computed.

Takes: fp8 queries ``[N, H, D]`` whose heads are contiguous rows of ``D`` (a ``[N, H * D]``
view), fp8 keys ``[T, D]`` contiguous, ``D`` a multiple of 32 (one fp8 wgmma's k), 16-byte
aligned storage: :func:`async_indexer_declines` says why not otherwise. It is an opt-in launch of
``indexer_logits`` (tuning field ``ASYNC``), chosen by measurement on the device.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

__all__ = ["async_indexer_declines", "async_indexer_logits"]

# the TMA load's name: ``async_load`` from Triton 3.7, ``async_copy_global_to_shared`` before (the
# GPU image's Triton 3.6); the same builtin and arguments
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _issue(q_smem, kt, bars, h, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, mma: gl.constexpr,
           QSTAGES: gl.constexpr):
    """Head h's product ``q_h @ k^T``, issued asynchronously once its query tile landed (its
    accumulator a fresh tile, ignored: ``use_acc=False``; a tile kept for every head would
    hold registers the whole loop)."""
    slot = h % QSTAGES
    mbarrier.wait(bars.index(slot), (h // QSTAGES) & 1)
    return warpgroup_mma(q_smem.index(slot), kt, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma),
                         use_acc=False, is_async=True)


@gluon.jit
def _sum_head(acc, s, q_desc, q_smem, bars, w_ptr, rows64, rmask, sw0, sw1, m0, h,
              H: gl.constexpr, QSTAGES: gl.constexpr):
    """Head h's product ``s`` is complete: its query slot takes head h + QSTAGES (TMA), and
    ``acc + w_h * relu(s)``."""
    nxt = h + QSTAGES
    slot = h % QSTAGES
    mbarrier.expect(bars.index(slot), q_desc.block_type.nbytes, pred=nxt < H)
    _tma_load(q_desc, [m0, nxt * q_desc.block_type.shape[1]], bars.index(slot),
                   q_smem.index(slot), pred=nxt < H)
    wv = gl.load(w_ptr + rows64 * sw0 + h * sw1, mask=rmask, other=0.0)
    return acc + wv[:, None] * gl.maximum(s, 0.0)


@gluon.jit
def _indexer_async_kernel(q_desc, k_desc, w_ptr, scale_ptr, ks_ptr, ke_ptr, out_ptr, N, T,
                          sw0, sw1, so0, H: gl.constexpr, QSTAGES: gl.constexpr,
                          GROUP: gl.constexpr, num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    rows = m0 + gl.arange(0, BLOCK_M, layout=row_l)
    rmask = rows < N
    rows64 = rows.to(gl.int64)
    ks = gl.load(ks_ptr + rows64, mask=rmask, other=0)
    ke = gl.load(ke_ptr + rows64, mask=rmask, other=0)
    nonempty = rmask & (ks < ke)
    lo = gl.min(gl.where(nonempty, ks, 9223372036854775807), axis=0)
    hi = gl.max(gl.where(nonempty, ke, 0), axis=0)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    if (n0 < hi) & (n0 + BLOCK_N > lo):  # the tile meets some row's range: compute it
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [BLOCK_N, D], k_desc.layout)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [QSTAGES, BLOCK_M, D], q_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [QSTAGES + 1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(QSTAGES + 1):
            mbarrier.init(bars.index(i), count=1)
        kbar = bars.index(QSTAGES)
        mbarrier.expect(kbar, k_desc.block_type.nbytes)
        _tma_load(k_desc, [n0, 0], kbar, k_smem)
        for i in gl.static_range(QSTAGES):
            mbarrier.expect(bars.index(i), q_desc.block_type.nbytes, pred=i < H)
            _tma_load(q_desc, [m0, i * D], bars.index(i), q_smem.index(i), pred=i < H)
        mbarrier.wait(kbar, 0)
        kt = k_smem.permute((1, 0))
        # heads in groups of GROUP: in a group, head j+1's product is issued before head j is
        # summed (overlapping GROUP-1 of GROUP sums); no product in flight crosses the loop's
        # back edge (a register move out of an in-flight wgmma serializes the pipeline: ptxas
        # C7514/C7515), and the group's unrolled code keeps two products alive at most
        for h0 in range(0, H, GROUP):
            s = _issue(q_smem, kt, bars, h0, BLOCK_M, BLOCK_N, mma, QSTAGES)
            for j in gl.static_range(1, GROUP):
                s_next = _issue(q_smem, kt, bars, h0 + j, BLOCK_M, BLOCK_N, mma,
                                QSTAGES)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                acc = _sum_head(acc, s, q_desc, q_smem, bars, w_ptr, rows64, rmask, sw0, sw1, m0,
                                h0 + j - 1, H, QSTAGES)
                s = s_next
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            acc = _sum_head(acc, s, q_desc, q_smem, bars, w_ptr, rows64, rmask, sw0, sw1, m0,
                            h0 + GROUP - 1, H, QSTAGES)
        for i in gl.static_range(QSTAGES + 1):
            mbarrier.invalidate(bars.index(i))
        cols = n0 + gl.arange(0, BLOCK_N, layout=col_l)
        c = gl.load(scale_ptr + cols, mask=cols < T, other=0.0)
        acc = acc * c[None, :]
    # the columns and ranges again here: kept over the head loop they cost ~40 registers
    cols = n0 + gl.arange(0, BLOCK_N, layout=col_l)
    cmask = cols < T
    ks = gl.load(ks_ptr + rows64, mask=rmask, other=0)
    ke = gl.load(ke_ptr + rows64, mask=rmask, other=0)
    inr = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
    gl.store(out_ptr + rows64[:, None] * so0 + cols.to(gl.int64)[None, :],
             gl.where(inr, acc, float("-inf")), mask=rmask[:, None] & cmask[None, :])


def async_indexer_declines(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None,
                           block_m: int) -> str | None:
    """Why :func:`async_indexer_logits` cannot take these inputs (metadata only; ``block_m`` the
    launch's rows), or None."""
    if q.dtype != torch.float8_e4m3fn or k.dtype != torch.float8_e4m3fn or k_scale is None:
        return "the async indexer takes fp8 queries and fp8 keys"
    if not (q.is_cuda and k.is_cuda) or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the async indexer runs on Hopper (sm90) GPUs"
    heads, d = q.shape[1], q.shape[2]
    if d % 32 or d > 256 or heads < 2:
        return f"the async indexer needs D a multiple of 32 (<= 256) and 2 heads, got {d}, {heads}"
    if block_m % 64 or block_m > 256:
        return f"ASYNC_BLOCK_M must be a multiple of 64 (a warpgroup's rows), got {block_m}"
    if q.stride(2) != 1 or q.stride(1) != d or q.stride(0) % 16 or k.stride(1) != 1 \
            or k.stride(0) % 16 or q.data_ptr() % 16 or k.data_ptr() % 16:
        return "the async indexer reads queries and keys by TMA: contiguous 16-byte aligned rows"
    return None


def async_indexer_logits(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                         k_scale: torch.Tensor, key_start: torch.Tensor, key_end: torch.Tensor,
                         out: torch.Tensor, cfg: Any) -> None:
    """:func:`_indexer_async_kernel` into ``out`` (float32 [N, T], row stride ``out.stride(0)``):
    ``cfg`` the indexer's tuning row (``ASYNC_BLOCK_M``, ``ASYNC_BLOCK_N``, ``ASYNC_STAGES``,
    ``ASYNC_GROUP``). The caller checked :func:`async_indexer_declines`."""
    n, heads, d = q.shape
    t = k.shape[0]
    bm, bn = int(cfg["ASYNC_BLOCK_M"]), int(cfg["ASYNC_BLOCK_N"])
    qv = q.as_strided((n, heads * d), (q.stride(0), 1))
    q_layout = gl.NVMMASharedLayout.get_default_for([bm, d], gl.float8e4nv)
    k_layout = gl.NVMMASharedLayout.get_default_for([bn, d], gl.float8e4nv)
    q_desc = TensorDescriptor(qv, [n, heads * d], [q.stride(0), 1], [bm, d], q_layout)
    k_desc = TensorDescriptor(k, [t, d], [k.stride(0), 1], [bn, d], k_layout)
    grid = ((t + bn - 1) // bn, (n + bm - 1) // bm)
    _indexer_async_kernel[grid](q_desc, k_desc, w, k_scale, key_start, key_end, out, n, t,
                                w.stride(0), w.stride(1), out.stride(0), H=heads,
                                QSTAGES=max(2, min(int(cfg["ASYNC_STAGES"]), heads)),
                                GROUP=_group(heads, int(cfg["ASYNC_GROUP"])), num_warps=bm // 16)


def _group(heads: int, want: int) -> int:
    """The largest divisor of ``heads`` at most ``want`` (a group never straddles the end)."""
    g = max(1, min(want, heads))
    while heads % g:
        g -= 1
    return g
