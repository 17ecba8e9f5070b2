"""The prefill indexer warp-specialized (Hopper, fp8 x fp8), in Gluon: one TMA warp feeds two
consumer warpgroups that take turns on the tensor cores (FA3's "ping-pong"), so one warpgroup's
``relu x weight`` head sum runs on the CUDA cores while the other's product runs on the tensor
cores.

Why (docs/lessons.md, sessions 11-15): per logit the indexer does 64 x 128 x 2 FLOPs on the
tensor cores and 64 ``max`` + 64 ``fma`` on the CUDA cores; the Triton kernel waits for each
head's wgmma before its sum, so its only overlap is between the two CTAs an SM holds, uncoordinated;
in-warpgroup overlap (:mod:`.indexer_async`) needs two products in registers and lost. Here:

* a program owns ``BLOCK_M`` rows x ``2 * BLOCK_N`` keys; warpgroup ``g`` (the default partition
  is 0, a 4-warp worker 1) computes the rows x its ``BLOCK_N`` keys;
* the loader (a 1-warp worker) loads both key tiles once, then the heads' ``[BLOCK_M, D]`` query
  tiles through a ring of ``QSTAGES`` slots (TMA, ``q_full`` / ``q_empty`` barriers); both
  warpgroups read the same query tile, so the L2 reads per logit are half the Triton kernel's;
* per head: wait for the slot, (``PINGPONG``) wait for this warpgroup's turn, issue
  ``s = q_h @ k_g^T`` (``use_acc=False``), hand the turn to the other warpgroup, wait for the
  product, release the slot, ``acc += w_h * relu(s)`` in head order (the Triton kernel's order);
* then the keys' fp8 scales and -inf outside each row's ``[ks, ke)``, stored by each warpgroup.

Takes what :mod:`.indexer_async` takes (fp8 queries whose heads are contiguous ``D``-rows, fp8
keys, 16-byte aligned rows): :func:`ws_indexer_declines` says why not otherwise.
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

__all__ = ["ws_indexer_declines", "ws_indexer_logits"]

# the TMA load's name: ``async_load`` from Triton 3.7, ``async_copy_global_to_shared`` before
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _loader(q_desc, k_desc, q_smem, k_smem, q_full, q_empty, k_bar, m0, n0,
            H: gl.constexpr, QSTAGES: gl.constexpr):
    """The TMA warp: both key tiles, then every head's query tile into the ring."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    mbarrier.expect(k_bar, 2 * k_desc.block_type.nbytes)
    _tma_load(k_desc, [n0, 0], k_bar, k_smem.index(0))
    _tma_load(k_desc, [n0 + BLOCK_N, 0], k_bar, k_smem.index(1))
    for h in range(H):
        slot = h % QSTAGES
        # a fresh barrier counts as having completed the phase before 0: the first round passes
        mbarrier.wait(q_empty.index(slot), ((h // QSTAGES) & 1) ^ 1)
        mbarrier.expect(q_full.index(slot), q_desc.block_type.nbytes)
        _tma_load(q_desc, [m0, h * D], q_full.index(slot), q_smem.index(slot))


@gluon.jit
def _consumer(g: gl.constexpr, q_smem, k_smem, q_full, q_empty, k_bar, turn, w_ptr, scale_ptr,
              ks_ptr, ke_ptr, out_ptr, m0, n0, N, T, sw0, sw1, so0, H: gl.constexpr,
              QSTAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              PINGPONG: gl.constexpr):
    """Warpgroup ``g``: the rows x keys ``[n0 + g BLOCK_N, n0 + (g + 1) BLOCK_N)``."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    rows = m0 + gl.arange(0, BLOCK_M, layout=row_l)
    rmask = rows < N
    rows64 = rows.to(gl.int64)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma)
    mbarrier.wait(k_bar, 0)
    kt = k_smem.index(g).permute((1, 0))
    for h in range(H):
        slot = h % QSTAGES
        mbarrier.wait(q_full.index(slot), (h // QSTAGES) & 1)
        if PINGPONG:
            # warpgroup 0 goes first (its first wait passes on the fresh barrier); each turn
            # barrier completes a phase when the other warpgroup has issued its product
            mbarrier.wait(turn.index(g), (h & 1) ^ (1 - g))
        s = warpgroup_mma(q_smem.index(slot), kt, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma),
                          use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - g), count=1)
        wv = gl.load(w_ptr + rows64 * sw0 + h * sw1, mask=rmask, other=0.0)  # under the product
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(q_empty.index(slot), count=1)
        acc = acc + wv[:, None] * gl.maximum(s, 0.0)
    cols = n0 + g * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
    cmask = cols < T
    c = gl.load(scale_ptr + cols, mask=cmask, other=0.0)
    acc = acc * c[None, :]
    ks = gl.load(ks_ptr + rows64, mask=rmask, other=0)
    ke = gl.load(ke_ptr + rows64, mask=rmask, other=0)
    inr = (cols[None, :] >= ks[:, None]) & (cols[None, :] < ke[:, None])
    gl.store(out_ptr + rows64[:, None] * so0 + cols.to(gl.int64)[None, :],
             gl.where(inr, acc, float("-inf")), mask=rmask[:, None] & cmask[None, :])


@gluon.jit
def _skipped(ks_ptr, ke_ptr, out_ptr, m0, c0, N, T, so0, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """A tile outside every row's range: -inf, nothing computed."""
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lay))
    cols = c0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, lay))
    val = gl.full([BLOCK_M, BLOCK_N], float("-inf"), gl.float32, lay)
    gl.store(out_ptr + rows.to(gl.int64)[:, None] * so0 + cols.to(gl.int64)[None, :], val,
             mask=(rows < N)[:, None] & (cols < T)[None, :])


@gluon.jit
def _indexer_ws_kernel(q_desc, k_desc, w_ptr, scale_ptr, ks_ptr, ke_ptr, out_ptr, N, T,
                       sw0, sw1, so0, H: gl.constexpr, QSTAGES: gl.constexpr,
                       PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       num_warps: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    D: gl.constexpr = q_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * (2 * BLOCK_N)
    rows = m0 + gl.arange(0, BLOCK_M, layout=lay)
    rmask = rows < N
    ks = gl.load(ks_ptr + rows.to(gl.int64), mask=rmask, other=0)
    ke = gl.load(ke_ptr + rows.to(gl.int64), mask=rmask, other=0)
    nonempty = rmask & (ks < ke)
    lo = gl.min(gl.where(nonempty, ks, 9223372036854775807), axis=0)
    hi = gl.max(gl.where(nonempty, ke, 0), axis=0)
    if (n0 < hi) & (n0 + 2 * BLOCK_N > lo):  # the tile meets some row's range: compute it
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK_N, D], k_desc.layout)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [QSTAGES, BLOCK_M, D], q_desc.layout)
        q_full = gl.allocate_shared_memory(gl.int64, [QSTAGES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [QSTAGES, 1], mbarrier.MBarrierLayout())
        k_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(QSTAGES):
            mbarrier.init(q_full.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # both warpgroups release a slot
        mbarrier.init(k_bar.index(0), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        kb = k_bar.index(0)
        gl.warp_specialize([
            (_consumer, (0, q_smem, k_smem, q_full, q_empty, kb, turn, w_ptr, scale_ptr, ks_ptr,
                         ke_ptr, out_ptr, m0, n0, N, T, sw0, sw1, so0, H, QSTAGES, BLOCK_M,
                         BLOCK_N, PINGPONG)),
            (_consumer, (1, q_smem, k_smem, q_full, q_empty, kb, turn, w_ptr, scale_ptr, ks_ptr,
                         ke_ptr, out_ptr, m0, n0, N, T, sw0, sw1, so0, H, QSTAGES, BLOCK_M,
                         BLOCK_N, PINGPONG)),
            (_loader, (q_desc, k_desc, q_smem, k_smem, q_full, q_empty, kb, m0, n0, H, QSTAGES)),
        ], [4, 1], [CONSUMER_REGS, 24])
    else:
        _skipped(ks_ptr, ke_ptr, out_ptr, m0, n0, N, T, so0, BLOCK_M, 2 * BLOCK_N, num_warps)


def ws_indexer_declines(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None,
                        block_m: int) -> str | None:
    """Why :func:`ws_indexer_logits` cannot take these inputs (metadata only), or None."""
    if q.dtype != torch.float8_e4m3fn or k.dtype != torch.float8_e4m3fn or k_scale is None:
        return "the warp-specialized indexer takes fp8 queries and fp8 keys"
    if not (q.is_cuda and k.is_cuda) or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the warp-specialized indexer runs on Hopper (sm90) GPUs"
    heads, d = q.shape[1], q.shape[2]
    if d % 32 or d > 256 or heads < 1:
        return f"the warp-specialized indexer needs D a multiple of 32 (<= 256), got {d}"
    if block_m != 64:
        return f"the warp-specialized indexer's warpgroups take 64 rows, got {block_m}"
    if q.stride(2) != 1 or q.stride(1) != d or q.stride(0) % 16 or k.stride(1) != 1 \
            or k.stride(0) % 16 or q.data_ptr() % 16 or k.data_ptr() % 16:
        return "the warp-specialized indexer reads by TMA: contiguous 16-byte aligned rows"
    return None


def ws_indexer_logits(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor,
                      key_start: torch.Tensor, key_end: torch.Tensor, out: torch.Tensor,
                      block_n: int = 128, stages: int = 4, pingpong: bool = True,
                      consumer_regs: int = 240, maxnreg: int = 168) -> None:
    """:func:`_indexer_ws_kernel` into ``out`` (float32 [N, T], row stride ``out.stride(0)``);
    the caller checked :func:`ws_indexer_declines`. ``block_n`` keys a warpgroup, ``stages``
    query slots; 12 warps (the default partition, the consumer worker, the loader's
    warpgroup) at ``maxnreg`` registers, the consumer worker raised to ``consumer_regs``."""
    n, heads, d = q.shape
    t = k.shape[0]
    bm = 64
    qv = q.as_strided((n, heads * d), (q.stride(0), 1))
    q_layout = gl.NVMMASharedLayout.get_default_for([bm, d], gl.float8e4nv)
    k_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.float8e4nv)
    q_desc = TensorDescriptor(qv, [n, heads * d], [q.stride(0), 1], [bm, d], q_layout)
    k_desc = TensorDescriptor(k, [t, d], [k.stride(0), 1], [block_n, d], k_layout)
    grid = ((t + 2 * block_n - 1) // (2 * block_n), (n + bm - 1) // bm)
    kw: dict[str, Any] = {"num_warps": 4}
    if maxnreg:
        kw["maxnreg"] = maxnreg
    _indexer_ws_kernel[grid](q_desc, k_desc, w, k_scale, key_start, key_end, out, n, t,
                             w.stride(0), w.stride(1), out.stride(0), H=heads,
                             QSTAGES=max(2, min(stages, heads)), PINGPONG=bool(pingpong),
                             CONSUMER_REGS=consumer_regs, **kw)
