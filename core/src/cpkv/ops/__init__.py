"""cpkv's compute ops: the per-run op table (the core's side) and the backend API.

* :mod:`cpkv.ops.api`: the one public module a backend imports from (the op protocol, argument
  checks, page-layout helpers, fp8 quantization; see its docstring). Its names are re-exported
  here for the core.
* :mod:`cpkv.ops.table`: :class:`OpTable` (op -> the backend chosen for it, resolved once per run)
  and the op groups :data:`KV_OPS`, :data:`ATTN_OPS`, :data:`ALL_OPS`.
* :mod:`cpkv.ops.checks`, :mod:`cpkv.ops.layout`, :mod:`cpkv.ops.fp8`: where the API's
  functions live.
"""

from __future__ import annotations

from .api import (
    FP8_AMAX_FLOOR,
    FP8_E4M3_MAX,
    UE8M0_AMAX_FLOOR,
    KVOps,
    KVPart,
    check_fp8_store_args,
    check_index_q_args,
    check_indexer_args,
    check_indexer_index_pages_args,
    check_indexer_paged_args,
    check_indexer_topk_args,
    check_page_copy_args,
    check_page_rows_args,
    check_peer_gather_args,
    check_rms_norm_args,
    check_rope_args,
    check_sparse_mla_args,
    check_sparse_mla_paged_args,
    check_topk_args,
    fp8_index_keys,
    fp8_layout,
    gather_latent,
    hadamard_rotate,
    index_page_keys,
    pack_fp8,
    page_blocks,
    paged_index_keys,
    paged_index_tokens,
    paged_latent,
    part_index,
    part_view,
    quantize_fp8,
    quantize_index_q,
    scale_format,
)
from .table import ALL_OPS, ATTN_OPS, KV_OPS, OpTable

__all__ = [
    "ALL_OPS",
    "ATTN_OPS",
    "FP8_AMAX_FLOOR",
    "FP8_E4M3_MAX",
    "KV_OPS",
    "UE8M0_AMAX_FLOOR",
    "KVOps",
    "KVPart",
    "OpTable",
    "check_fp8_store_args",
    "check_index_q_args",
    "check_indexer_args",
    "check_indexer_index_pages_args",
    "check_indexer_paged_args",
    "check_indexer_topk_args",
    "check_page_copy_args",
    "check_page_rows_args",
    "check_peer_gather_args",
    "check_rms_norm_args",
    "check_rope_args",
    "check_sparse_mla_args",
    "check_sparse_mla_paged_args",
    "check_topk_args",
    "fp8_index_keys",
    "fp8_layout",
    "gather_latent",
    "hadamard_rotate",
    "index_page_keys",
    "pack_fp8",
    "page_blocks",
    "paged_index_keys",
    "paged_index_tokens",
    "paged_latent",
    "part_index",
    "part_view",
    "quantize_fp8",
    "quantize_index_q",
    "scale_format",
]
