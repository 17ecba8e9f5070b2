"""Sparse MLA prefill on FlashMLA (``sgl-flash-mla``: DeepSeek's FlashMLA with the SM90 kernels).

``flash_mla_sparse_fwd(q [N, H, 576] bf16, kv [T, 1, 576] bf16, indices [N, 1, k] int32, scale,
512, use_legacy=True)`` is the kernel SGLang and vLLM run for DeepSeek-V3.2's prefill on Hopper
(601 TFLOP/s on the H200 at 1024 x 64K, top-2048; docs/perf.md). It takes 64 or 128 heads,
576-wide keys with 512-wide values, bf16, and a top-k that is a multiple of 64: any other call is
declined (:class:`~cpkv.contracts.OpDeclined`) and runs on the next backend of the preference.

The kernel accumulates in float32 and writes bf16 [N, H, 512], which the op returns as it is (the
contract allows q's dtype for low-precision q; widening cost 0.4 ms of the kernel's 1.0 at 1024
x 64K). A row with no valid index comes out as zeros from the kernel itself (its lse is +inf), as
the contract says: measured on the H200 and checked by tests/test_cuda_backend.py; masking such
rows again would cost 0.18 ms per call at that size.
"""

from __future__ import annotations

from types import ModuleType

import torch

from cpkv.contracts import OpDeclined
from cpkv.ops import check_sparse_mla_args

__all__ = ["FlashMLAOps", "decline_reason"]

HEADS = (64, 128)
DK, DV = 576, 512
TOPK_MULTIPLE = 64


def decline_reason(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, dv: int) -> str | None:
    """Why FlashMLA's sparse prefill cannot take this call, or None (metadata only)."""
    _, h, dk = q.shape
    if h not in HEADS:
        return f"{h} heads (FlashMLA's sparse prefill takes {' or '.join(map(str, HEADS))})"
    if dk != DK or dv != DV:
        return f"head dims {dk}/{dv} (FlashMLA takes {DK}/{DV})"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"q {q.dtype} / kv {kv.dtype} (FlashMLA takes bf16)"
    if indices.shape[1] % TOPK_MULTIPLE:
        return f"top-k {indices.shape[1]} (FlashMLA takes a multiple of {TOPK_MULTIPLE})"
    if q.device.type != "cuda" or kv.device != q.device or indices.device != q.device:
        return f"needs CUDA tensors on one device, got q on {q.device}, kv on {kv.device}"
    return None


class FlashMLAOps:
    """The ops the cuda backend provides, on FlashMLA's kernels (imported by the backend's
    ``load``)."""

    def __init__(self, flash_mla: ModuleType) -> None:
        self._fm = flash_mla

    def sparse_mla(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                   dv: int) -> torch.Tensor:
        """Sparse MLA over the selected keys (see :class:`cpkv.ops.KVOps`), on FlashMLA.

        Raises:
            ValueError: arguments that break the op's contract.
            OpDeclined: a shape or dtype FlashMLA's kernel does not take.
        """
        check_sparse_mla_args(q, kv, indices, dv)
        why = decline_reason(q, kv, indices, dv)
        if why is not None:
            raise OpDeclined(why)
        n, h, _ = q.shape
        if n == 0:
            return torch.zeros(0, h, dv, dtype=q.dtype, device=q.device)
        out, _max_logits, _lse = self._fm.flash_mla_sparse_fwd(
            q.contiguous(), kv.contiguous().unsqueeze(1), indices.contiguous().unsqueeze(1),
            scale, dv, use_legacy=True)
        return out
