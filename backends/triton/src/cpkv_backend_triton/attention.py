"""The sparse-attention ops of one layer as thin wrappers over :mod:`.kernels`: the indexer's
logits (dense and paged), top-k, the fused indexer + top-k, sparse MLA prefill. Each checks its
arguments, picks a kernel and a launch from :mod:`.tuning` and launches; shape-driven: no
``.item()``, no host tensors, any number of rows. Semantics: :class:`cpkv.ops.api.KVOps`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import torch
import triton

from cpkv.ops.api import (
    KVFormat,
    OpDeclined,
    check_indexer_args,
    check_indexer_index_pages_args,
    check_indexer_paged_args,
    check_indexer_topk_args,
    check_sparse_mla_args,
    check_sparse_mla_paged_args,
    check_v4_index_scores_args,
    check_v4_topk_args,
    paged_latent,
)

from .index_views import (
    dot_types,
    dot_width,
    index_page_views,
    paged_index_views,
    pages_tileable,
    row_alignment,
)
from .indexer_topk import INDEXER_TOPK
from .indexer_topk import indexer_topk as fused_indexer_topk
from .kernels.indexer import (
    _indexer_few_rows_kernel,
    _indexer_kernel,
    _indexer_paged_kernel,
    _indexer_pages_kernel,
)
from .kernels.mla import _sparse_mla_kernel
from .launch import Launcher, interpreted, pow2
from .topk import TOPK_METHOD, TOPK_RADIX_MAX_K
from .topk import topk as select_topk
from .tuning import DeviceTuned, Launch

if TYPE_CHECKING:
    from .kv import KVKernels


__all__ = ["AttentionKernels", "MLAPrecision"]

#: the precision of sparse MLA on 16-bit inputs (see :class:`AttentionKernels`)
MLAPrecision = Literal["bf16", "exact"]
_LOWP = (torch.bfloat16, torch.float16)
#: the launch constants on this process's device (the tuning table's rows);
#: :class:`AttentionKernels` takes overrides on top of them
INDEXER_DEFAULT = DeviceTuned(Launch.INDEXER)
MLA_DEFAULT = DeviceTuned(Launch.SPARSE_MLA)
#: 16-bit q/kv (the production path): one bf16 P, FlashMLA's precision, within bf16 tolerance of
#: the fp32 reference (the conformance suite's 16-bit tolerance)
MLA_LOWP_DEFAULT = DeviceTuned(Launch.SPARSE_MLA_LOWP)


class AttentionKernels:
    """The sparse-attention ops (indexer_logits, the paged indexers, topk, indexer_topk,
    sparse_mla, sparse_mla_paged) on CUDA tensors (CPU tensors under ``TRITON_INTERPRET=1``).

    Args:
        indexer_config: overrides of :data:`INDEXER_DEFAULT` (:class:`.tuning.IndexerParams`).
        mla_config: overrides of sparse MLA's launch and probability split
            (:class:`.tuning.MLAParams`), on top of the row ``mla_precision`` picks.
        mla_precision: sparse MLA on 16-bit q and kv: ``"bf16"`` (default) one bf16 probability
            matrix, FlashMLA's precision (:data:`MLA_LOWP_DEFAULT`); ``"exact"`` 16-bit pieces,
            within 1e-5 of the fp32 reference (:data:`MLA_DEFAULT`, also every fp32 input's).
        topk_method: ``"radix"`` (default, exact) or ``"torch"`` (torch.topk; ties may differ).
        kv: the KV ops ``sparse_mla_paged`` reads pages with; None: a new :class:`KVKernels`.

    Raises:
        ValueError: an unknown ``topk_method`` or ``mla_precision``."""

    def __init__(self, indexer_config: dict[str, int] | None = None,
                 mla_config: dict[str, int] | None = None, topk_method: str = TOPK_METHOD,
                 mla_precision: MLAPrecision = "bf16", kv: KVKernels | None = None) -> None:
        if topk_method not in ("radix", "torch"):
            raise ValueError(f"topk_method must be 'radix' or 'torch', got {topk_method!r}")
        if mla_precision not in ("bf16", "exact"):
            raise ValueError(f"mla_precision must be 'bf16' or 'exact', got {mla_precision!r}")
        self.topk_method = topk_method
        self.mla_precision = mla_precision
        self.indexer_config = {**INDEXER_DEFAULT, **(indexer_config or {})}
        base = MLA_LOWP_DEFAULT if mla_precision == "bf16" else MLA_DEFAULT
        #: the sparse-MLA configuration of 16-bit inputs, and of fp32 inputs
        self.mla_config = {**base, **(mla_config or {})}
        self.mla_fp32_config = {**MLA_DEFAULT, **(mla_config or {})}
        if kv is None:
            from .kv import KVKernels

            kv = KVKernels()
        self.kv = kv
        self._launch = Launcher()

    # -- indexer --------------------------------------------------------------------------------
    def indexer_logits(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                       k_scale: torch.Tensor | None, key_start: torch.Tensor,
                       key_end: torch.Tensor) -> torch.Tensor:
        """``logit[i, j] = sum_h w[i, h] * relu(q[i, h] . k[j])`` inside ``[key_start[i],
        key_end[i])``, -inf elsewhere; float32 [N, T]. See :class:`cpkv.ops.api.KVOps`.

        fp8 keys: the scale multiplies the head sum (``k_scale`` must be >= 0, as the pool's are).

        Raises:
            ValueError: a shape or dtype does not match (as the reference).
        """
        fp8 = check_indexer_args(q, w, k, k_scale, key_start, key_end)
        n, heads, d = q.shape
        t = k.shape[0]
        out = torch.empty(n, t, dtype=torch.float32, device=q.device)
        if n == 0 or t == 0:
            return out
        cfg = self.indexer_config
        bm = min(cfg["BLOCK_M"], pow2(n))
        bn = min(cfg["BLOCK_N"], pow2(t))
        both_fp8, upcast = dot_types(_indexer_kernel, q, k.dtype, fp8)
        ks, ke = key_start.contiguous(), key_end.contiguous()
        # unused pointer for float keys (the check gives fp8 keys, and only them, a scale)
        scale = k_scale.contiguous() if k_scale is not None else out
        dp = dot_width(d, both_fp8, upcast)
        args = (q, w, k, scale, ks, ke, out, n, t, q.stride(0), q.stride(1), q.stride(2),
                w.stride(0), w.stride(1), k.stride(0), k.stride(1), out.stride(0))
        if n <= cfg["FEW_ROWS"]:  # a decode step's rows: every head in one dot per key tile
            hp = pow2(heads, 1)
            bq = min(pow2(n, 1), max(1, 128 // hp))  # at most 128 stacked (row, head) pairs
            bq = max(bq, 16 // hp)  # a dot takes at least 16 rows (hp is a power of two)
            bnf = min(cfg["FEW_BLOCK_N"], pow2(t))
            self._launch(("indexer_few", q.dtype, k.dtype, heads, d, bq, bnf, upcast),
                         _indexer_few_rows_kernel, (triton.cdiv(t, bnf), triton.cdiv(n, bq)), args,
                         {"H": heads, "HP": hp, "D": d, "DP": dp, "BQ": bq, "BLOCK_N": bnf,
                          "FP8": fp8, "UPCAST": upcast},
                         cfg["few_warps"], cfg["num_stages"])
            return out
        grid = (triton.cdiv(t, bn), triton.cdiv(n, bm))
        key = ("indexer", q.dtype, k.dtype, heads, d, bm, bn, upcast)
        self._launch(key, _indexer_kernel, grid, args,
                     {"H": heads, "D": d, "DP": dp, "BLOCK_M": bm, "BLOCK_N": bn, "FP8": fp8,
                      "UPCAST": upcast},
                     cfg["num_warps"], cfg["num_stages"])
        return out

    def indexer_logits_paged(self, q: torch.Tensor, w: torch.Tensor, pages: torch.Tensor,
                             fmt: KVFormat, block_table: torch.Tensor, row_request: torch.Tensor,
                             key_end: torch.Tensor) -> torch.Tensor:
        """The lightning indexer over each row's request keys ``[0, key_end[i])`` read in place
        from part-major pages through the block table; float32 [N, M * S], -inf past key_end. One
        launch, no host sync, the output its only allocation. See :class:`cpkv.ops.api.KVOps`.

        Raises:
            ValueError: a shape or dtype does not match (as the reference).
            OpDeclined: the index-K byte offsets do not fit typed views."""
        fp8 = check_indexer_paged_args(q, w, pages, fmt, block_table, row_request, key_end)
        n, heads, d = q.shape
        ms = block_table.shape[1] * fmt.page_size
        keys, kst, sst = paged_index_views(pages, fmt)
        out = torch.empty(n, ms, dtype=torch.float32, device=q.device)
        if n == 0 or ms == 0:
            return out
        scales = pages.view(-1).view(torch.float32) if fp8 else out
        if self._page_tiles(fmt):
            self._indexer_pages(q, w, keys, scales, kst, sst, fmt, block_table, row_request,
                                key_end, out, fp8)
            return out
        cfg = self.indexer_config
        both_fp8, upcast = dot_types(_indexer_paged_kernel, q, keys.dtype, fp8)
        bn = min(cfg["PAGED_BLOCK_N"], pow2(ms))
        bq = max(1, min(cfg["PAGED_ROWS"], n))
        hp = pow2(heads)  # a dot takes at least 16 rows
        self._launch(("indexer_paged", q.dtype, keys.dtype, heads, d, fmt.page_size, bq, bn,
                      upcast),
                     _indexer_paged_kernel, (triton.cdiv(ms, bn), triton.cdiv(n, bq)),
                     (q, w, keys, scales, block_table, row_request, key_end, out, n, ms,
                      q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                      block_table.stride(0), block_table.stride(1), out.stride(0), *kst, *sst),
                     {"H": heads, "HP": hp, "D": d, "DP": dot_width(d, both_fp8, upcast),
                      "S": fmt.page_size,
                      "BQ": bq, "BLOCK_N": bn, "FP8": fp8, "UPCAST": upcast,
                      "KALIGN": row_alignment(kst, keys.element_size())},
                     cfg["paged_warps"], cfg["num_stages"])
        return out

    def indexer_logits_index_pages(self, q: torch.Tensor, w: torch.Tensor,
                                   index_pages: torch.Tensor, fmt: KVFormat,
                                   block_table: torch.Tensor, row_request: torch.Tensor,
                                   key_end: torch.Tensor) -> torch.Tensor:
        """``indexer_logits_paged`` over index-K in DeepGEMM's page-major order (the engines'
        ``two_part`` tensor, uint8 ``[P, >= S x index bytes]``): the same result, always the
        page-tile kernel.

        Raises:
            ValueError: a shape or dtype does not match.
            OpDeclined: a page size not a power of two >= 16, or offsets the views cannot address."""
        fp8 = check_indexer_index_pages_args(q, w, index_pages, fmt, block_table, row_request,
                                             key_end)
        if not pages_tileable(fmt.page_size):
            raise OpDeclined(f"indexer_logits_index_pages tiles whole pages: page size "
                             f"{fmt.page_size} is not a power of two >= 16")
        n = q.shape[0]
        ms = block_table.shape[1] * fmt.page_size
        out = torch.empty(n, ms, dtype=torch.float32, device=q.device)
        if n == 0 or ms == 0:
            return out
        keys, kst, sst = index_page_views(index_pages, fmt)
        scales = keys.view(torch.uint8).view(torch.float32) if fp8 else out
        self._indexer_pages(q, w, keys, scales, kst, sst, fmt, block_table, row_request,
                            key_end, out, fp8)
        return out

    def _page_tiles(self, fmt: KVFormat) -> bool:
        """Whether ``indexer_logits_paged`` takes the page-tile kernel (``PAGED_KERNEL`` 1 and
        a page size it tiles) rather than the key-tile kernel."""
        return bool(self.indexer_config["PAGED_KERNEL"]) and pages_tileable(fmt.page_size)

    def _indexer_pages(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                       scales: torch.Tensor, kst: tuple[int, int, int],
                       sst: tuple[int, int, int], fmt: KVFormat, block_table: torch.Tensor,
                       row_request: torch.Tensor, key_end: torch.Tensor, out: torch.Tensor,
                       fp8: bool) -> None:
        """:func:`_indexer_pages_kernel` into ``out`` over typed views of the keys (element
        steps ``kst`` / ``sst`` = page, first, row: as :func:`paged_index_views` gives)."""
        cfg = self.indexer_config
        n, heads, d = q.shape
        m = block_table.shape[1]
        both_fp8, upcast = dot_types(_indexer_pages_kernel, q, keys.dtype, fp8)
        # DeepGEMM's page-major order (rows of the values alone: 16-byte pieces, cp.async when
        # pipelined) has its own launch; the pool's part-major rows (4-byte pieces) theirs
        major = kst[2] == d
        pp = max(1, min(cfg["PAGED_MAJOR_PAGES" if major else "PAGED_PAGES"], m))
        stages = cfg["PAGED_MAJOR_STAGES" if major else "PAGED_STAGES"]
        self._launch(("indexer_pages", q.dtype, keys.dtype, heads, d, fmt.page_size, kst[2],
                      sst[2], pp, stages, cfg["PAGED_KEYS_M"], upcast),
                     _indexer_pages_kernel, (triton.cdiv(m, pp), n),
                     (q, w, keys, scales, block_table, row_request, key_end, out, m,
                      m * fmt.page_size, q.stride(0), q.stride(1), q.stride(2), w.stride(0),
                      w.stride(1), block_table.stride(0), block_table.stride(1), out.stride(0),
                      kst[0], kst[1], sst[0], sst[1]),
                     {"H": heads, "HP": pow2(heads), "D": d,
                      "DP": dot_width(d, both_fp8, upcast), "S": fmt.page_size,
                      "KROW": kst[2], "SROW": sst[2], "PAGES": pp, "STAGES": stages,
                      "KEYS_M": cfg["PAGED_KEYS_M"], "FP8": fp8,
                      "UPCAST": upcast,
                      "KALIGN": row_alignment((kst[0], kst[1]), keys.element_size())},
                     cfg["paged_warps"], 1)

    # -- top-k ----------------------------------------------------------------------------------
    def topk(self, logits: torch.Tensor, k: int, key_start: torch.Tensor,
             key_end: torch.Tensor) -> torch.Tensor:
        """Columns of the k largest logits in each row's range; int32 [N, k], -1 padded; rows
        holding at most k keys list them all ascending (:func:`.topk.topk`, ``topk_method``). See
        :class:`cpkv.ops.api.KVOps`.

        Raises:
            ValueError: ``logits`` is not 2-D float, ``k`` is negative or a range is mis-shaped."""
        return select_topk(logits, k, key_start, key_end, self.topk_method)

    def indexer_topk(self, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor,
                     k_scale: torch.Tensor | None, key_start: torch.Tensor,
                     key_end: torch.Tensor, topk: int) -> torch.Tensor:
        """``topk(indexer_logits(...))`` as one op: int32 [N, topk]. Views of at least
        ``INDEXER_TOPK["MIN_T"]`` keys, more than ``FEW_ROWS`` rows and the exact top-k take the
        fused path (:mod:`.indexer_topk`); the choice depends on shapes and settings only.

        Raises:
            ValueError: an argument does not fit (as the reference)."""
        fp8 = check_indexer_topk_args(q, w, k, k_scale, key_start, key_end, topk)
        n, _, d = q.shape
        t = k.shape[0]
        if (t >= INDEXER_TOPK["MIN_T"] and n > self.indexer_config["FEW_ROWS"]
                and 0 < topk < t and topk <= TOPK_RADIX_MAX_K and self.topk_method == "radix"):
            both_fp8, upcast = dot_types(_indexer_kernel, q, k.dtype, fp8)
            return fused_indexer_topk(q, w, k, k_scale, key_start, key_end, topk, fp8=fp8,
                                      dot_width=dot_width(d, both_fp8, upcast), upcast=upcast,
                                      interpreted=interpreted(_indexer_kernel),
                                      sample_logits=self.indexer_logits, launch=self._launch)
        logits = self.indexer_logits(q, w, k, k_scale, key_start, key_end)
        return self.topk(logits, topk, key_start, key_end)

    def v4_index_topk(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                      limit: torch.Tensor, scale: float, k: int) -> torch.Tensor:
        """DeepSeek-V4's indexer and top-k over compressed index keys (see
        :class:`cpkv.ops.api.KVOps`) on :meth:`indexer_topk` (the same ``sum_h w relu(q . k)``
        with ``scale`` folded into ``w``, each row's keys ``[0, limit)``; fused at long key
        counts): int64 [N, k], -1 padded.

        Raises:
            ValueError: an argument does not fit (as the reference).
            OpDeclined: float32 queries or keys on a GPU (its dots would round them)."""
        check_v4_index_scores_args(q, w, keys, limit)
        check_v4_topk_args(w, k)
        if q.is_cuda and torch.float32 in (q.dtype, keys.dtype):
            # the GPU's dots round float32 operands (tf32); float32 runs want the exact scores
            raise OpDeclined(f"q {q.dtype} / keys {keys.dtype}: float32 scores run on the next "
                             "backend (Triton's tensor-core dots take bf16 / fp8)")
        n, e = q.shape[0], keys.shape[0]
        if n == 0 or k == 0 or e == 0:
            return torch.full((n, k), -1, dtype=torch.long, device=q.device)
        start = torch.zeros(n, dtype=torch.long, device=q.device)
        end = limit.to(device=q.device, dtype=torch.long).clamp(0, e)
        got = self.indexer_topk(q, (w.float() * scale).contiguous(), keys, None, start, end, k)
        return got.long()

    # -- sparse MLA -----------------------------------------------------------------------------
    def sparse_mla(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                   dv: int) -> torch.Tensor:
        """Sparse MLA prefill (absorbed form) over the selected latent rows; float32 [N, H, dv].
        See :class:`cpkv.ops.api.KVOps`.

        Raises:
            ValueError: a shape or dtype does not match, or ``dv`` is out of range.
        """
        check_sparse_mla_args(q, kv, indices, dv)
        n, heads, dk = q.shape
        nk = indices.shape[1]
        if n == 0 or heads == 0 or kv.shape[0] == 0 or nk == 0:
            return torch.zeros(n, heads, dv, dtype=torch.float32, device=q.device)
        out = torch.empty(n, heads, dv, dtype=torch.float32, device=q.device)
        lowp = kv.dtype in _LOWP and q.dtype == kv.dtype  # 16-bit path
        cfg = self.mla_config if lowp else self.mla_fp32_config
        bh = min(cfg["BLOCK_H"], pow2(heads))
        bk = min(cfg["BLOCK_K"], pow2(nk))
        upcast = interpreted(_sparse_mla_kernel) or not lowp
        da, db = pow2(dv), pow2(dk - dv)
        key = ("mla", q.dtype, kv.dtype, dk, dv, bh, bk, upcast)
        self._launch(key, _sparse_mla_kernel, (n, triton.cdiv(heads, bh)),
                     (q, kv, indices, out, heads, nk, float(scale) * math.log2(math.e),
                      q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
                      indices.stride(0), indices.stride(1), out.stride(0), out.stride(1)),
                     {"DV": dv, "DK": dk, "DA": da, "DB": db, "HAS_B": dk > dv, "BLOCK_H": bh,
                      "BLOCK_K": bk, "UPCAST": upcast, "LOWP": lowp,
                      "P_SPLIT": cfg["P_SPLIT"], "P_FP16": cfg["P_FP16"] == 1,
                      "P_CAT": cfg["P_CAT"] == 1 and cfg["P_SPLIT"] == 2},
                     cfg["num_warps"], cfg["num_stages"])
        return out

    def sparse_mla_paged(self, q: torch.Tensor, pages: torch.Tensor, rows: torch.Tensor,
                         fmt: KVFormat, scale: float, dv: int) -> torch.Tensor:
        """Sparse MLA over latent rows read from part-major pages: the selected rows gathered
        and dequantized in one pass (``fp8_unpack`` through an index) into q's dtype, then
        :meth:`sparse_mla`. See :class:`cpkv.ops.api.KVOps`."""
        check_sparse_mla_paged_args(q, pages, rows, fmt, dv)
        dtype = q.dtype if q.dtype in _LOWP else torch.float32
        lat, idx = paged_latent(pages, rows, fmt, dtype, self.kv.fp8_unpack, self.kv.page_gather)
        return self.sparse_mla(q, lat, idx, scale, dv)
