"""Sparse MLA prefill on FlashMLA (``sgl-flash-mla``: DeepSeek's FlashMLA with the SM90 kernels),
and DeepSeek-V4's sparse attention with the sink on its V4 kernel (:meth:`FlashMLAOps.v4_attention`:
d_qk = d_v = 512, 64 or 128 heads, bf16; other calls declined).

``flash_mla_sparse_fwd(q [N, H, 576] bf16, kv [T, 1, 576] bf16, indices [N, 1, k] int32, scale,
512, use_legacy=True)`` is the kernel SGLang and vLLM run for DeepSeek-V3.2's prefill on Hopper
(601 TFLOP/s on a Hopper GPU at 1024 x 64K, top-2048; docs/perf.md). It takes 64 or 128 heads,
576-wide keys with 512-wide values, bf16, and a top-k that is a multiple of 64: any other call is
declined (:class:`~cpkv.contracts.OpDeclined`) and runs on the next backend of the preference.

The kernel accumulates in float32 and writes bf16 [N, H, 512], which the op returns as it is (the
contract allows q's dtype for low-precision q; widening cost 0.4 ms of the kernel's 1.0 at 1024
x 64K). A row with no valid index comes out as zeros from the kernel itself (its lse is +inf), as
the contract says: measured on a GPU and checked by tests/test_cuda_backend.py; masking such
rows again would cost 0.18 ms per call at that size.
"""

from __future__ import annotations

from types import ModuleType

import torch

from cpkv.ops.api import (
    KVDtype,
    KVFormat,
    OpDeclined,
    check_sparse_mla_args,
    check_sparse_mla_paged_args,
    check_v4_attention_args,
)

__all__ = ["FlashMLAOps", "decline_reason", "decode_decline_reason", "v4_decline_reason"]

HEADS = (64, 128)
DK, DV = 576, 512
TOPK_MULTIPLE = 64


def _kernel_reason(kernel: str, q: torch.Tensor, dv: int, dtype_reason: str | None, k: int,
                   src: tuple[str, torch.Tensor], indices: torch.Tensor) -> str | None:
    """The checks FlashMLA's sparse kernels share: heads, head dims, dtypes (``dtype_reason``:
    the kernel's own verdict), top-k, one CUDA device for q, ``src`` (name, tensor) and indices."""
    _, h, dk = q.shape
    if h not in HEADS:
        return f"{h} heads (FlashMLA's {kernel} takes {' or '.join(map(str, HEADS))})"
    if dk != DK or dv != DV:
        return f"head dims {dk}/{dv} (FlashMLA takes {DK}/{DV})"
    if dtype_reason is not None:
        return dtype_reason
    if k % TOPK_MULTIPLE:
        return f"top-k {k} (FlashMLA takes a multiple of {TOPK_MULTIPLE})"
    name, t = src
    if q.device.type != "cuda" or t.device != q.device or indices.device != q.device:
        return f"needs CUDA tensors on one device, got q on {q.device}, {name} on {t.device}"
    return None


def decline_reason(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, dv: int) -> str | None:
    """Why FlashMLA's sparse prefill cannot take this call, or None (metadata only)."""
    dtypes = None if q.dtype == kv.dtype == torch.bfloat16 else \
        f"q {q.dtype} / kv {kv.dtype} (FlashMLA takes bf16)"
    return _kernel_reason("sparse prefill", q, dv, dtypes, indices.shape[1], ("kv", kv), indices)


#: DeepSeek-V4's head dim (K = V): FlashMLA's V4 sparse prefill takes d_qk = d_v = 512
V4_D = 512


def v4_decline_reason(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> str | None:
    """Why FlashMLA's V4 sparse prefill (``flash_mla_sparse_fwd`` with ``attn_sink``, not the
    legacy kernel) cannot take this ``v4_attention`` call, or None (metadata only)."""
    _, h, d = q.shape
    if h not in HEADS:
        return f"{h} heads (FlashMLA's V4 sparse prefill takes {' or '.join(map(str, HEADS))})"
    if d != V4_D:
        return f"head dim {d} (FlashMLA's V4 sparse prefill takes {V4_D})"
    if not q.dtype == kv.dtype == torch.bfloat16:
        return f"q {q.dtype} / kv {kv.dtype} (FlashMLA takes bf16)"
    if q.device.type != "cuda" or kv.device != q.device or indices.device != q.device:
        return f"needs CUDA tensors on one device, got q on {q.device}, kv on {kv.device}"
    return None


#: FlashMLA's fp8 token (DeepSeek-V3.2): 512 e4m3 + 4 fp32 scales + 64 bf16 rope bytes, the same
#: bytes as cpkv's fp8 latent format with quant_block 128
FP8_TOKEN_BYTES = 656
#: the dtype FlashMLA's fp8 k_cache is passed in (the bytes viewed as e4m3)
KCACHE_DTYPE = torch.float8_e4m3fn


def decode_decline_reason(q: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor, fmt: KVFormat,
                          dv: int) -> str | None:
    """Why FlashMLA's fp8 sparse decode cannot take this call, or None (metadata only)."""
    if fmt.dtype is not KVDtype.FP8 or fmt.latent_bytes_per_token != FP8_TOKEN_BYTES \
            or fmt.quant_block != 128:
        return (f"a {fmt.dtype.value} pool with {fmt.latent_bytes_per_token}-byte latent rows "
                f"(FlashMLA's sparse decode reads DeepSeek-V3.2's fp8 rows of {FP8_TOKEN_BYTES})")
    dtypes = None if q.dtype == torch.bfloat16 else \
        f"q {q.dtype} (FlashMLA's decode takes bf16 queries)"
    return _kernel_reason("sparse decode", q, dv, dtypes, rows.shape[1], ("pages", pages), rows)


class FlashMLAOps:
    """The ops the cuda backend provides, on FlashMLA's kernels (imported by the backend's
    ``load``)."""

    def __init__(self, flash_mla: ModuleType) -> None:
        self._fm = flash_mla
        #: the decode kernel's tile-scheduler metadata per call shape (rows, heads, picks, page
        #: size): FlashMLA fixes a metadata object to the shape of its first call (it asserts
        #: the same shape afterwards), and a CUDA graph replays the buffers it was captured with
        self._metas: dict[tuple[int, int, int, int], object] = {}

    def sparse_mla(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                   dv: int) -> torch.Tensor:
        """Sparse MLA over the selected keys (see :class:`cpkv.ops.api.KVOps`), on FlashMLA.

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

    def v4_attention(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                     sink: torch.Tensor, scale: float) -> torch.Tensor:
        """DeepSeek-V4's sparse attention with the sink (see :class:`cpkv.ops.api.KVOps`) on
        FlashMLA's V4 sparse prefill: ``flash_mla_sparse_fwd(q, kv [S, 1, 512], indices
        [N, 1, K'] int32, scale, 512, attn_sink=sink, use_legacy=True)`` (the SM90 kernels),
        the indices padded with -1 to a multiple of 64 slots (what the kernel reads a block at
        a time). bf16 [N, H, 512].

        Raises:
            ValueError: arguments that break the op's contract.
            OpDeclined: heads, head dim, dtype or device FlashMLA's V4 kernel does not take.
        """
        check_v4_attention_args(q, kv, indices, sink)
        why = v4_decline_reason(q, kv, indices)
        if why is not None:
            raise OpDeclined(why)
        n, h, d = q.shape
        if n == 0:
            return torch.zeros(0, h, d, dtype=q.dtype, device=q.device)
        k = indices.shape[1]
        idx = indices.to(torch.int32)
        pad = -k % TOPK_MULTIPLE if k else TOPK_MULTIPLE
        if pad:
            idx = torch.cat([idx, idx.new_full((n, pad), -1)], dim=1)
        # the legacy kernels: sgl-flash-mla's current ones run on SM100 only (its sparse
        # prefill says so); its legacy build keeps SM90's, which take d_qk 512 with the sink
        got = self._fm.flash_mla_sparse_fwd(
            q.contiguous(), kv.contiguous().unsqueeze(1), idx.contiguous().unsqueeze(1), scale,
            d, attn_sink=sink.to(device=q.device, dtype=torch.float32).contiguous(),
            use_legacy=True)
        return got[0]

    def sparse_mla_paged(self, q: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor,
                         fmt: KVFormat, scale: float, dv: int) -> torch.Tensor:
        """Sparse MLA reading fp8 latent rows in place from part-major pages, on FlashMLA's fp8
        sparse decode kernel (``flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...)``):
        each page's latent block [page_size, 656] is a k_cache block (block stride = the page's
        bytes), ``rows`` are its token indices (block x page_size + slot). One query token per
        request (q [N, H, 576] -> [N, 1, H, 576]); bf16 [N, H, 512].

        Raises:
            ValueError: arguments that break the op's contract.
            OpDeclined: a format, shape or dtype FlashMLA's decode does not take.
        """
        check_sparse_mla_paged_args(q, pages, rows, fmt, dv)
        why = decode_decline_reason(q, pages, rows, fmt, dv)
        if why is not None:
            raise OpDeclined(why)
        n, h, _ = q.shape
        if n == 0:
            return torch.zeros(0, h, dv, dtype=q.dtype, device=q.device)
        p, ps, b = pages.shape
        # the latent block of every page, as FlashMLA's k_cache [blocks, block_size, 1, 656]
        k_cache = pages.view(p, ps * b)[:, :ps * FP8_TOKEN_BYTES].view(p, ps, 1, FP8_TOKEN_BYTES)
        key = (n, h, rows.shape[1], ps)
        meta = self._metas.get(key)
        if meta is None:
            meta = self._metas[key] = self._fm.get_mla_metadata()[0]
        out, _lse = self._fm.flash_mla_with_kvcache(
            q.contiguous().view(n, 1, h, -1), k_cache.view(KCACHE_DTYPE), None, None, dv,
            meta, None, scale, False, True, rows.contiguous().view(n, 1, -1),
            use_legacy=True)
        return out.view(n, h, dv)
