"""Top-k: the columns of each row's k largest indexer logits inside its key range, the torch
reference's set exactly (equal logits by ascending column), no host sync; wrappers over
:mod:`.kernels.topk`. Long rows (``T >= TOPK_LONG["MIN_T"]``) read each logit once, shorter
rows twice; ``method="torch"`` (and float64 logits, k > :data:`TOPK_RADIX_MAX_K`) takes
``torch.topk`` over masked logits, ties may differ. Design: docs/triton.md, "Top-k".
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton

from cpkv.ops.api import check_topk_args

from .kernels.topk import (
    _mask_kernel,
    _topk_bracket_kernel,
    _topk_compact_kernel,
    _topk_exact_kernel,
    _topk_filter_kernel,
    _topk_final_kernel,
    _topk_fixup_kernel,
    _topk_floor_kernel,
    _topk_hist_kernel,
    _topk_select_kernel,
)
from .launch import pow2, report_variant_declined
from .tuning import DeviceTuned, Launch, device_of

__all__ = ["TOPK_CONFIG", "TOPK_LONG", "TOPK_METHOD", "TOPK_RADIX_MAX_K", "gluon_filter_declines",
           "select_candidates", "topk"]


TOPK_BLOCK = 1024
#: "radix" (the exact kernels, default) or "torch" (mask, torch.topk, fix-up)
TOPK_METHOD = "radix"
#: larger k (the candidates' scratch grows with it), and float64 logits (whose keys have 64
#: bits), take the torch path
TOPK_RADIX_MAX_K = 4096
#: the two-read path's launch (BLOCK, CHUNK, num_warps, final_warps, BINS) on this process's
#: device: the tuning table's row (:mod:`.tuning`, each value's measurement named there)
TOPK_CONFIG: Mapping[str, int] = DeviceTuned(Launch.TOPK)
#: candidates (keys in the K-th key's bin) a row may hand to the final kernel's refinement (at
#: least the power of two >= k); more take the exact kernel's 4 passes
TOPK_MIN_CAP = 1024
#: candidates per step of the final kernel's refinement
TOPK_REFINE_BLOCK = 256
#: columns, spread evenly over a row's range, whose sorted keys place the bins' bracket
TOPK_SAMPLE = 512
#: the one-read path for long rows (MIN_T, SAMPLE, CAP, BLOCK, PROGRAMS, SPLIT_MIN, SCRATCH_MB,
#: REFINE, num_warps, select_warps, a decode step's FEW_ROWS launches;
#: :class:`.tuning.TopkLongParams`) on this process's device
TOPK_LONG: Mapping[str, int] = DeviceTuned(Launch.TOPK_LONG)
_RADIX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def select_candidates(cand: torch.Tensor, count: torch.Tensor, key_start: torch.Tensor,
                      key_end: torch.Tensor, out: torch.Tensor, meta: torch.Tensor, t: int,
                      k: int, cap: int, warps: int) -> None:
    """The long rows' select (``_topk_select_kernel``) over a filter's candidates (``cand``
    int64, split j of row i at ``(i * NS + j) * cap``; ``count`` int32 [N, NS]): ``out`` and
    ``meta[i, 0] = k``, or ``meta[i, 0] = -1`` for a row left to an exact pass."""
    cfg = TOPK_LONG
    n, ns = count.shape
    nsp = pow2(ns, 1)
    _topk_select_kernel[(n,)](key_start, key_end, out, cand, count, meta, t, k, ns,
                              KP=pow2(k), CAP=cap, NSP=nsp, RB=min(cfg["REFINE"], cap),
                              COMPACT=bool(cfg["COMPACT"]), num_warps=warps)


def _splits(n: int, t: int, cap: int) -> int:
    """(row, split) programs for the filter: enough to fill the GPU when a call has few rows,
    splits of at least ``SPLIT_MIN`` columns, the candidates' scratch within an eighth of the
    logits' bytes or ``SCRATCH_MB``, whichever is larger (a decode step's one row)."""
    cfg = TOPK_LONG
    want = triton.cdiv(cfg["PROGRAMS"], max(n, 1))
    by_memory = max((4 * t) // (8 * 8 * cap), (cfg["SCRATCH_MB"] << 20) // (8 * cap * max(n, 1)))
    return max(1, min(want, triton.cdiv(t, cfg["SPLIT_MIN"]), by_memory))


def _radix(logits: torch.Tensor, k: int, ks: torch.Tensor, ke: torch.Tensor,
           out: torch.Tensor) -> None:
    """The two-read path (bracket, histogram, compaction, exact, final)."""
    n, t = logits.shape
    kp = pow2(k)
    cap = max(kp, TOPK_MIN_CAP)
    cfg = TOPK_CONFIG
    blk = min(cfg["BLOCK"], pow2(t))
    nb = cfg["BINS"]
    ch = triton.cdiv(cfg["CHUNK"], blk) * blk  # columns of a row per program
    nch = triton.cdiv(t, ch)
    dev = logits.device
    bracket = torch.empty(n, 2, dtype=torch.float32, device=dev)
    hist = torch.empty(n, nch, nb, dtype=torch.int32, device=dev)
    cand = torch.empty(n, cap, dtype=torch.int64, device=dev)
    meta = torch.empty(n, 2, dtype=torch.int32, device=dev)
    sx0, sx1 = logits.stride(0), logits.stride(1)
    warps = cfg["num_warps"]
    _topk_bracket_kernel[(n,)](logits, ks, ke, bracket, t, k, sx0, sx1, NB=nb,
                               SAMPLE=TOPK_SAMPLE, num_warps=warps)
    _topk_hist_kernel[(n, nch)](logits, ks, ke, bracket, hist, t, k, ch, sx0, sx1, nch,
                                BLOCK=blk, NB=nb, num_warps=warps)
    _topk_compact_kernel[(n, nch)](logits, ks, ke, bracket, hist, out, cand, meta, t, k,
                                   ch, sx0, sx1, nch, BLOCK=blk, NB=nb,
                                   NCHP=pow2(nch, 1), CAP=cap, num_warps=warps)
    _topk_exact_kernel[(n,)](logits, ks, ke, out, meta, t, k, sx0, sx1, BLOCK=blk,
                             num_warps=warps)
    _topk_final_kernel[(n,)](ks, ke, out, cand, meta, t, k, KP=kp, CAP=cap,
                             RB=min(TOPK_REFINE_BLOCK, cap), num_warps=cfg["final_warps"])


def _long(logits: torch.Tensor, k: int, ks: torch.Tensor, ke: torch.Tensor,
          out: torch.Tensor) -> None:
    """The one-read path for long rows (floor, filter, select, exact)."""
    n, t = logits.shape
    cfg = TOPK_LONG
    # a decode step's few rows (each kernel's time one program's latency): the few_ launches
    few = n <= cfg["FEW_ROWS"]

    def pick(field: str, many: int) -> int:
        return cfg[field] if few and cfg[field] else many

    cap = max(cfg["CAP"], pow2(k))
    blk = min(pick("few_BLOCK", cfg["BLOCK"]), pow2(t))
    ns = _splits(n, t, cap)
    cs = triton.cdiv(triton.cdiv(t, ns), blk) * blk  # columns per split
    ns = triton.cdiv(t, cs)
    dev = logits.device
    floor = torch.empty(n, dtype=torch.float32, device=dev)
    cand = torch.empty(n * ns * cap, dtype=torch.int64, device=dev)
    count = torch.empty(n, ns, dtype=torch.int32, device=dev)
    meta = torch.empty(n, 2, dtype=torch.int32, device=dev)
    sx0, sx1 = logits.stride(0), logits.stride(1)
    warps = cfg["num_warps"]
    _topk_floor_kernel[(n,)](logits, ks, ke, floor, t, k, sx0, sx1, SAMPLE=cfg["SAMPLE"],
                             ROUNDS=cfg["FLOOR_ROUNDS"], num_warps=pick("few_floor_warps", warps))
    if not (cfg["GLUON"] and _gluon_filter(logits, ks, ke, floor, cand, count, k, cs, ns, blk,
                                           cap, warps)):
        _topk_filter_kernel[(n, ns)](logits, ks, ke, floor, cand, count, t, k, cs, ns, sx0, sx1,
                                     BLOCK=blk, CAP=cap, num_warps=warps)
    select_candidates(cand, count, ks, ke, out, meta, t, k, cap,
                      pick("few_select_warps", cfg["select_warps"]))
    _topk_exact_kernel[(n,)](logits, ks, ke, out, meta, t, k, sx0, sx1,
                             BLOCK=min(TOPK_CONFIG["BLOCK"], pow2(t)), num_warps=warps)


#: the reasons the Gluon filter declined, each reported once a process
_GLUON_DECLINED: set[str] = set()


def gluon_filter_declines(logits: torch.Tensor, block: int, warps: int) -> str | None:
    """Why the Gluon filter cannot take these logits on a CUDA device and launch (metadata
    only), or None."""
    if logits.dtype != torch.float32:
        return f"the Gluon filter reads fp32 logits, got {logits.dtype}"
    if (device_of(logits.device)[1] or (0, 0)) < (8, 0):
        return "the Gluon filter needs an sm80+ GPU"
    if logits.stride(1) != 1:
        return "the Gluon filter reads rows of column stride 1"
    if block % (32 * warps):
        return f"BLOCK {block} is not a multiple of 32 x {warps} warps"
    return None


def _gluon_filter(logits: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, floor: torch.Tensor,
                  cand: torch.Tensor, count: torch.Tensor, k: int, cs: int, ns: int, blk: int,
                  cap: int, warps: int) -> bool:
    """``GLUON = 1``: the filter of :mod:`.kernels.topk_gluon`; False (reported once per reason,
    the Triton filter runs) when it cannot take the call. Logits off a GPU decline before
    Gluon is imported: in a process whose triton was imported under the CPU interpreter (the
    test suite's), importing Gluon raises (its standard library expects compiled functions)."""
    why: str | None
    if not logits.is_cuda:
        why = "the Gluon filter runs on CUDA devices (not under the interpreter)"
    else:
        try:
            from .kernels.topk_gluon import _topk_filter_gluon_kernel
        except ImportError as exc:  # a Triton without Gluon
            why = f"Gluon cannot be imported ({exc})"
        else:
            why = gluon_filter_declines(logits, blk, warps)
    if why is None:
        _topk_filter_gluon_kernel[(logits.shape[0], ns)](
            logits, ks, ke, floor, cand, count, logits.shape[1], k, cs, ns, logits.stride(0),
            BLOCK=blk, CAP=cap, num_warps=warps)
        return True
    report_variant_declined(_GLUON_DECLINED, "triton:topk",
                            "the Gluon filter (TOPK_LONG GLUON=1)", "the Triton filter", why)
    return False


def topk(logits: torch.Tensor, k: int, key_start: torch.Tensor, key_end: torch.Tensor,
         method: str = TOPK_METHOD) -> torch.Tensor:
    """Columns of the k largest logits in each row's range; int32 [N, k], -1 padded; rows
    holding at most k keys list them all ascending. ``method``: ``"radix"`` (default) the exact
    select, the reference's set in the kernels' order; ``"torch"`` ``torch.topk`` over masked
    logits (ties at the k-th place may differ). See :class:`cpkv.ops.KVOps`.

    Raises:
        ValueError: ``logits`` is not 2-D float, ``k`` is negative, a range is mis-shaped, or
            ``method`` is unknown."""
    if method not in ("radix", "torch"):
        raise ValueError(f"topk method must be 'radix' or 'torch', got {method!r}")
    check_topk_args(logits, k, key_start, key_end)
    n, t = logits.shape
    out = torch.empty(n, k, dtype=torch.int32, device=logits.device)
    if n == 0 or k == 0:
        return out
    ks, ke = key_start.contiguous(), key_end.contiguous()
    select = k < t  # else no row holds more than k keys: each lists its range ascending
    if select and method == "radix" and k <= TOPK_RADIX_MAX_K and logits.dtype in _RADIX_DTYPES:
        if t >= TOPK_LONG["MIN_T"]:
            _long(logits, k, ks, ke, out)
        else:
            _radix(logits, k, ks, ke, out)
        return out
    if select:
        masked = torch.empty(n, t, dtype=logits.dtype, device=logits.device)
        blk = min(TOPK_BLOCK, pow2(t))
        _mask_kernel[(n, triton.cdiv(t, blk))](logits, ks, ke, masked, t, logits.stride(0),
                                               logits.stride(1), BLOCK=blk, num_warps=4)
        chosen = torch.topk(masked, k, dim=1, largest=True, sorted=True).indices.contiguous()
    else:
        chosen = out  # unused
    blk = min(TOPK_BLOCK, pow2(k))
    _topk_fixup_kernel[(n, triton.cdiv(k, blk))](chosen, ks, ke, out, t, k, k,
                                                 HAS_CHOSEN=select, BLOCK=blk, num_warps=4)
    return out
