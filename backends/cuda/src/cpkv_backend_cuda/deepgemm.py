"""The lightning indexer on DeepGEMM (``deep_gemm``: the kernels SGLang and vLLM serve
DeepSeek-V3.2's indexer with), for fp8 queries and keys on Hopper.

Prefill, :meth:`DeepGEMMOps.indexer_logits` (the :class:`~cpkv.contracts.KVOps` op):
``deep_gemm.fp8_fp4_mqa_logits((q8, None), (k8, k_scale), w, ks, ke, max_seqlen_k=T)`` on the
materialized view's index-K (e4m3 [T, 128] and its fp32 scale per key) with the fp8 queries of
:func:`cpkv.ops.api.quantize_index_q` (scales folded into the fp32 head weights): DeepSeek's
own numerics, the same definition as the op's. DeepGEMM writes row i's keys ``[ks[i], ke[i])``
from column 0 and leaves the rest of the row unwritten; one in-place pass
(:func:`cpkv_backend_cuda._place.place_rows`) moves a row whose range does not start at 0 to its
columns and writes -inf outside the range (for a prompt's own chunk, whose ranges all start at
0, only the triangle past each row's end), so the result is the op's: float32 [N, T] (its rows
strided as DeepGEMM aligns them), -inf outside the range.

Decode, :meth:`DeepGEMMOps.indexer_logits_index_pages`: ``fp8_fp4_paged_mqa_logits`` over
index-K pages in DeepGEMM's page-major layout (:func:`index_page_view`: per 64-token page its
64 x 128 e4m3 values, then its 64 fp32 scales, 8,448 B; the engines' index-K cache). cpkv's own
part-major pages interleave each token's 128 values and its scale (132 B rows), which DeepGEMM's
kernel cannot address (it takes a fixed 128-byte key stride), so ``indexer_logits_paged`` is not
provided here; ``indexer_logits_index_pages`` is the op of pools in DeepGEMM's layout (the
``two_part`` layout; :func:`pack_index_pages` writes it), listed in the plugin's ``MEASURED``
(the Triton page-tile kernel was faster on the same tensors).

Calls DeepGEMM's kernels cannot take (not fp8 x fp8, heads other than 32 / 64, head dims other
than 32 / 64 / 128, tensors off one CUDA device) are declined
(:class:`~cpkv.contracts.OpDeclined`) before any work. DeepGEMM compiles each kernel variant at
its first call (nvcc, seconds; cached on disk under ``DG_JIT_CACHE_DIR``, default
``~/.dj``).
"""

from __future__ import annotations

from types import ModuleType

import torch

from cpkv.ops.api import (
    KVDtype,
    KVFormat,
    OpDeclined,
    check_indexer_args,
    check_indexer_index_pages_args,
)

__all__ = ["DeepGEMMOps", "decline_reason", "index_page_view", "pack_index_pages",
           "part_major_index_pages"]

#: query heads DeepGEMM's SM90 indexer kernels take
HEADS = (32, 64)
#: index head dims they take
HEAD_DIMS = (32, 64, 128)
#: tokens per index-K page of the paged kernel on SM90
PAGE_TOKENS = 64
#: bytes of one key's scale (fp32)
SCALE_BYTES = 4


def decline_reason(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                   k_scale: torch.Tensor | None) -> str | None:
    """Why DeepGEMM's fp8 indexer cannot take this call, or None (metadata only)."""
    if k.dtype != torch.float8_e4m3fn or k_scale is None:
        return (f"keys {k.dtype} (DeepGEMM's SM90 indexer takes fp8 keys with a per-key fp32 "
                "scale)")
    return _reason(q, w, k.device, k_scale.device)


def _reason(q: torch.Tensor, w: torch.Tensor, *devices: torch.device) -> str | None:
    """The checks of the prefill and paged kernels on the queries: fp8, heads, head dim, one
    CUDA device for q, w and ``devices``."""
    _, h, d = q.shape
    if q.dtype != torch.float8_e4m3fn:
        return (f"q {q.dtype} (DeepGEMM's SM90 indexer takes fp8 queries, their scales folded "
                "into the head weights)")
    if h not in HEADS:
        return f"{h} index heads (DeepGEMM's SM90 indexer takes {' or '.join(map(str, HEADS))})"
    if d not in HEAD_DIMS:
        return f"index head dim {d} (DeepGEMM takes {', '.join(map(str, HEAD_DIMS))})"
    dev = q.device
    if dev.type != "cuda" or any(x != dev for x in (w.device, *devices)):
        return (f"needs CUDA tensors on one device, got q on {dev}, the rest on "
                f"{', '.join(sorted({str(x) for x in (w.device, *devices)}))}")
    return None


def _weights(w: torch.Tensor) -> torch.Tensor:
    """Head weights as DeepGEMM loads them (TMA rows: unit column stride, 16-byte row stride)."""
    if w.stride(1) == 1 and (w.stride(0) * w.element_size()) % 16 == 0:
        return w
    pad = -(-w.shape[1] * 4 // 16) * 16 // 4
    out = torch.empty(w.shape[0], pad, dtype=torch.float32, device=w.device)[:, :w.shape[1]]
    return out.copy_(w)


def index_page_view(index_pages: torch.Tensor) -> torch.Tensor:
    """``index_pages`` (uint8 [P, >= 64 x 132], one row per page: its 64 x 128 e4m3 values, then
    its 64 fp32 scales; the row stride a multiple of 4) as DeepGEMM's paged kernel takes it:
    uint8 [P, 64, 1, 132] with the page stride of ``index_pages``.

    Raises:
        ValueError: not uint8 2-D with room for a page, or a row stride DeepGEMM cannot take.
    """
    per = PAGE_TOKENS * (128 + SCALE_BYTES)
    if index_pages.dtype != torch.uint8 or index_pages.dim() != 2 \
            or index_pages.shape[1] < per or index_pages.stride(1) != 1 \
            or index_pages.stride(0) % SCALE_BYTES:
        raise ValueError(f"index pages: expected uint8 [P, >= {per}] with unit column stride and "
                         f"a row stride that is a multiple of {SCALE_BYTES}, got "
                         f"{index_pages.dtype} {tuple(index_pages.shape)} strides "
                         f"{index_pages.stride()}")
    return index_pages.as_strided((index_pages.shape[0], PAGE_TOKENS, 1, 128 + SCALE_BYTES),
                                  (index_pages.stride(0), 128 + SCALE_BYTES,
                                   128 + SCALE_BYTES, 1))


def pack_index_pages(k8: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """fp8 keys (e4m3 [P x 64, 128]) and their fp32 scales ([P x 64]) in DeepGEMM's page-major
    layout: uint8 [P, 8448], page p = keys ``64p .. 64p + 63``'s values, then their scales."""
    t, d = k8.shape
    p = t // PAGE_TOKENS
    if d != 128 or t != p * PAGE_TOKENS or k_scale.shape != (t,):
        raise ValueError(f"pack_index_pages: expected e4m3 [P x {PAGE_TOKENS}, 128] and [P x "
                         f"{PAGE_TOKENS}] scales, got {tuple(k8.shape)}, {tuple(k_scale.shape)}")
    vals = k8.contiguous().view(torch.uint8).reshape(p, PAGE_TOKENS * d)
    scales = k_scale.contiguous().to(torch.float32).view(torch.uint8).reshape(p, -1)
    return torch.cat([vals, scales], 1)


def part_major_index_pages(pages: torch.Tensor, latent_bytes: int, index_dim: int = 128
                           ) -> torch.Tensor:
    """A part-major fp8 pool layer's index-K (uint8 [P, 64, latent + index bytes]: 64 latent
    rows, then 64 rows of ``index_dim`` e4m3 values and an fp32 scale) copied into DeepGEMM's
    page-major layout (:func:`pack_index_pages`): the same keys, for comparisons."""
    p, s, _ = pages.shape
    flat = pages.reshape(p, -1)[:, s * latent_bytes:].reshape(p, s, index_dim + SCALE_BYTES)
    vals = flat[..., :index_dim].reshape(p, s * index_dim)
    scales = flat[..., index_dim:].reshape(p, s * SCALE_BYTES)
    return torch.cat([vals, scales], 1)


class DeepGEMMOps:
    """The indexer ops on DeepGEMM's kernels (the cuda backend's ``load`` builds it)."""

    def __init__(self, deep_gemm: ModuleType) -> None:
        self._dg = deep_gemm
        self._sms: int | None = None

    def indexer_logits(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                       k_scale: torch.Tensor | None, key_start: torch.Tensor,
                       key_end: torch.Tensor) -> torch.Tensor:
        """The lightning indexer (see :class:`cpkv.ops.api.KVOps`) on DeepGEMM's
        ``fp8_fp4_mqa_logits``: float32 [N, T] (rows strided), -inf outside each row's range.

        Raises:
            ValueError: arguments that break the op's contract.
            OpDeclined: not fp8 x fp8, heads / head dims DeepGEMM does not take, not CUDA.
        """
        check_indexer_args(q, w, k, k_scale, key_start, key_end)
        why = decline_reason(q, w, k, k_scale)
        if why is not None:
            raise OpDeclined(why)
        assert k_scale is not None  # decline_reason refused None
        n, t = q.shape[0], k.shape[0]
        if n == 0 or t == 0:
            return torch.full((n, t), float("-inf"), dtype=torch.float32, device=q.device)
        ks, ke = key_start.to(torch.int32), key_end.to(torch.int32)
        out = self.compressed_logits(q, w, k, k_scale, ks, ke)
        from ._place import place_rows

        place_rows(out, ks, ke)
        return out

    def compressed_logits(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                          k_scale: torch.Tensor, key_start: torch.Tensor,
                          key_end: torch.Tensor) -> torch.Tensor:
        """DeepGEMM's kernel alone (arguments checked by the caller, :meth:`indexer_logits`):
        float32 [N, T], row i's keys ``[ks[i], ke[i])`` from column 0, the rest unwritten."""
        return self._dg.fp8_fp4_mqa_logits(  # type: ignore[no-any-return]
            (q.contiguous(), None), (k.contiguous(), k_scale.contiguous()), _weights(w),
            key_start.to(torch.int32), key_end.to(torch.int32), k.shape[0])

    def indexer_logits_index_pages(self, q: torch.Tensor, w: torch.Tensor,
                                   index_pages: torch.Tensor, fmt: KVFormat,
                                   block_table: torch.Tensor, row_request: torch.Tensor,
                                   key_end: torch.Tensor) -> torch.Tensor:
        """The :class:`~cpkv.contracts.KVOps` op ``indexer_logits_index_pages`` (the same
        block table, row requests and key ends as ``indexer_logits_paged``, the same result)
        over index-K pages in DeepGEMM's layout (:func:`index_page_view`), on
        ``fp8_fp4_paged_mqa_logits``: float32 [N, M x 64], -inf past each row's key_end. One
        query row per DeepGEMM sequence (its block-table row is the request's); no host sync.

        Raises:
            ValueError: shapes or dtypes other than these.
            OpDeclined: not an fp8 format of 64-token pages and 128-dim keys, not fp8 queries,
                heads DeepGEMM does not take, not CUDA.
        """
        check_indexer_index_pages_args(q, w, index_pages, fmt, block_table, row_request, key_end)
        if fmt.dtype is not KVDtype.FP8 or fmt.page_size != PAGE_TOKENS \
                or fmt.index_head_dim != 128:
            raise OpDeclined(f"DeepGEMM's paged indexer reads fp8 pages of {PAGE_TOKENS} tokens "
                             f"and 128-dim keys, got {fmt.dtype.value} pages of "
                             f"{fmt.page_size} tokens, {fmt.index_head_dim}-dim keys")
        fused = index_page_view(index_pages)
        n = q.shape[0]
        why = _reason(q, w, index_pages.device, block_table.device, key_end.device)
        if why is not None:
            raise OpDeclined(why)
        ms = block_table.shape[1] * PAGE_TOKENS
        if n == 0 or ms == 0:
            return torch.full((n, ms), float("-inf"), dtype=torch.float32, device=q.device)
        if self._sms is None:
            self._sms = int(self._dg.get_num_sms())
        lens = key_end.to(torch.int32).view(n, 1)
        table = block_table.index_select(0, row_request.to(torch.int64))
        meta = self._dg.get_paged_mqa_logits_metadata(lens, PAGE_TOKENS, self._sms, None)
        out = self._dg.fp8_fp4_paged_mqa_logits((q.contiguous().view(n, 1, *q.shape[1:]), None),
                                                fused, _weights(w), lens, table, meta, ms, None)
        cols = torch.arange(ms, device=q.device)
        return out.masked_fill_(cols[None, :] >= key_end[:, None], float("-inf"))
