"""The lightning indexer and the top-k in one pass over the keys, for long rows: the [N, T]
logits are never stored. Sample, floor, filter (the plain indexer's tile, bit for bit), select,
and an exact pass for flagged rows: a misleading sample costs time, never the result. CAP comes
from the shapes only (:func:`layout`). Design: docs/triton.md, "The fused indexer top-k".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import triton

from .kernels.indexer_topk import (
    _fused_exact_kernel,
    _fused_filter_kernel,
    _fused_select_kernel,
    _sample_floor_kernel,
)
from .launch import Launcher, pow2, report_variant_declined
from .tuning import DeviceTuned, Launch

__all__ = ["INDEXER_TOPK", "FusedLayout", "indexer_topk", "layout", "ptx_append", "select_fused"]


#: the fused path's launch constants on this process's device (MIN_T, SAMPLE, SAFETY, CAP_MIN,
#: CAP_MAX, the filter's tiles, warps, stages and MAXNREG, the select's and the exact pass's
#: steps and warps): the tuning table's row (:class:`.tuning.IndexerTopkParams`, each value's
#: measurement named there): views of at least MIN_T keys (the long-row top-k's) take it
INDEXER_TOPK: Mapping[str, int] = DeviceTuned(Launch.INDEXER_TOPK)
#: the reasons the inline-PTX append was not taken on a GPU, each reported once a process
_PTX_DECLINED: set[str] = set()


def ptx_append(is_cuda: bool, interpreted: bool) -> bool:
    """Whether the filter appends with inline PTX: compiled kernels on NVIDIA devices. Off a
    GPU (the interpreter) the Triton-op append runs, as designed; a "cuda" device that runs no
    PTX (ROCm) takes it too, reported once as fallback ``kernel_variant``."""
    if not is_cuda or interpreted:
        return False
    if torch.version.hip is None:
        return True
    report_variant_declined(_PTX_DECLINED, "triton:indexer_topk",
                            "the inline-PTX candidate append", "the Triton-op append",
                            f"a ROCm device (HIP {torch.version.hip}) runs no inline PTX")
    return False


@dataclass(frozen=True)
class FusedLayout:
    """One call's scratch: ``cap`` candidate slots a row, the sample's column ``stride`` and its
    ``sample_cols``."""

    cap: int
    stride: int
    sample_cols: int


def layout(n: int, t: int, k: int, cfg: Mapping[str, int] | None = None) -> FusedLayout:
    """CAP of an [n, t] call with top-k ``k`` (shapes only: the same on every rank). The floor
    keeps ~``(est + margin + 1) / sample`` of a row (est = k x sample / t, margin as the floor
    kernel's); CAP is SAFETY times that many keys, a power of two in [CAP_MIN, CAP_MAX], at
    most the row's (power of two) length."""
    c = cfg or INDEXER_TOPK
    stride = max(1, triton.cdiv(t, c["SAMPLE"]))
    sample = triton.cdiv(t, stride)
    est = (k * sample) // max(t, 1)
    frac = min(1.0, (est + int(4.0 * math.sqrt(est + 1.0)) + 9) / sample)
    cap = min(pow2(math.ceil(c["SAFETY"] * frac * t)), c["CAP_MAX"])
    cap = min(max(cap, c["CAP_MIN"]), pow2(t))
    return FusedLayout(cap=cap, stride=stride, sample_cols=sample)


#: ``indexer_logits(q, w, k, k_scale, key_start, key_end)``: the plain indexer op (the sample)
SampleLogits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                         torch.Tensor, torch.Tensor], torch.Tensor]


def select_fused(val: torch.Tensor, col: torch.Tensor, count: torch.Tensor,
                 key_start: torch.Tensor, key_end: torch.Tensor, out: torch.Tensor,
                 meta: torch.Tensor, t: int, k: int, cap: int) -> None:
    """Step 4 over the filter's candidates (``val`` float32 / ``col`` int32 [N * cap], row i's
    at ``i * cap``, ``count`` int32 [N], past ``cap``: overflowed): rows holding at most k keys
    listed ascending, the others' k columns ascending with ``meta[i, 0] = k``, or ``meta[i, 0] =
    -1`` (fewer than k candidates, or more than cap) and the row left for the exact pass."""
    cfg = INDEXER_TOPK
    _fused_select_kernel[(count.shape[0],)](val, col, count, key_start, key_end, out, meta, t, k,
                                            cap, KP=pow2(k), RB=min(cfg["SELECT_BLOCK"],
                                                                     pow2(cap)),
                                            COMPACT=bool(cfg["COMPACT"]),
                                            num_warps=cfg["select_warps"])


def indexer_topk(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor | None,
                 key_start: torch.Tensor, key_end: torch.Tensor, topk: int, *, fp8: bool,
                 dot_width: int, upcast: bool, interpreted: bool, sample_logits: SampleLogits,
                 launch: Launcher) -> torch.Tensor:
    """The fused path (module docstring) for checked arguments, ``0 < topk < T``, N > 0:
    int32 [N, topk]. ``dot_width``: the padded head dim of the dots; ``upcast``: fp32 dots
    (the interpreter, or operands without a tensor-core type); ``interpreted``: the kernels run
    on Triton's CPU interpreter (no inline PTX there)."""
    n, heads, d = q.shape
    t = k.shape[0]
    cfg = INDEXER_TOPK
    lay = layout(n, t, topk, cfg)
    dev = q.device
    ks, ke = key_start.contiguous(), key_end.contiguous()
    st = lay.stride
    # 1. the sample: the indexer at columns i * stride, rows' ranges in sample columns
    kss = (ks.clamp(0, t) + (st - 1)) // st
    kes = (ke.clamp(0, t) + (st - 1)) // st
    scale_s = k_scale[::st].contiguous() if k_scale is not None else None
    xs = sample_logits(q, w, k[::st], scale_s, kss, kes)
    # 2. the floor
    floor = torch.empty(n, dtype=torch.float32, device=dev)
    _sample_floor_kernel[(n,)](xs, ks, ke, floor, t, topk, lay.sample_cols, st, xs.stride(0),
                               SP=pow2(lay.sample_cols, 1), ROUNDS=cfg["FLOOR_ROUNDS"],
                               num_warps=cfg["floor_warps"])
    del xs
    # 3. the filter in the indexer's epilogue
    ptx = ptx_append(q.is_cuda, interpreted)
    val = torch.empty(n * lay.cap, dtype=torch.float32, device=dev)
    col = torch.empty(n * lay.cap, dtype=torch.int32, device=dev)
    count = torch.zeros(n, dtype=torch.int32, device=dev)
    scale = k_scale.contiguous() if k_scale is not None else floor  # unused for float keys
    bm = min(cfg["BLOCK_M"], pow2(n))
    bn = cfg["BLOCK_N"]
    launch(("indexer_topk", q.dtype, k.dtype, heads, d, bm, bn, upcast),
           _fused_filter_kernel, (triton.cdiv(t, bn), triton.cdiv(n, bm)),
           (q, w, k, scale, ks, ke, floor, val, col, count, n, t, topk, lay.cap,
            q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1), k.stride(0),
            k.stride(1)),
           {"H": heads, "D": d, "DP": dot_width, "BLOCK_M": bm, "BLOCK_N": bn, "FP8": fp8,
            "UPCAST": upcast, "ASM": ptx,
            **({"maxnreg": cfg["MAXNREG"]} if ptx else {})},
           cfg["num_warps"], cfg["num_stages"])
    # 4. the select; 5. the flagged rows, exactly
    out = torch.empty(n, topk, dtype=torch.int32, device=dev)
    meta = torch.empty(n, 2, dtype=torch.int32, device=dev)
    select_fused(val, col, count, ks, ke, out, meta, t, topk, lay.cap)
    _fused_exact_kernel[(n,)](q, w, k, scale, ks, ke, out, meta, t, topk,
                              q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                              k.stride(0), k.stride(1), H=heads, HP=pow2(heads), D=d,
                              DP=dot_width, BLOCK_N=cfg["EXACT_BLOCK_N"], FP8=fp8, UPCAST=upcast,
                              num_warps=cfg["exact_warps"])
    return out
