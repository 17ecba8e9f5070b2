"""The backend API: every cpkv name a backend's kernel modules may import, in one place.

A backend (``cpkv_backend_torch``, ``cpkv_backend_triton``, ``cpkv_backend_cuda``, a third
party's: see docs/writing-a-backend.md) implements :class:`KVOps` with its own kernels and takes
from cpkv only what is listed here (its ``plugin`` module also uses :mod:`cpkv.plugin`'s
registrar and :mod:`cpkv.contracts`' ``Availability`` / ``Op``). Anything else in cpkv may change
without notice.

The op protocol and the types in its signatures
    :class:`KVOps` (one method per :class:`Op`: signatures, shapes, semantics), :class:`Op`,
    :class:`KVFormat` (bytes per token and page), :class:`KVDtype`, :class:`PageLayout`,
    :data:`KVPart` (``"latent"`` / ``"index_k"``), :data:`RopeStyle`.

Composing a backend object
    :class:`OpMethods`: op -> bound method, for a backend whose ops are methods of several
    kernel objects (no forwarding method per op; the op table calls them directly).

Declining and reporting
    :class:`OpDeclined`: raise it from an op for a shape the kernel does not take; the call then
    runs on the next backend of the preference, reported once as a fallback.
    :func:`report_fallback` with a :class:`FallbackReason`: every other visible step away from
    what was asked (e.g. a kernel variant that did not fit), through the one choke point.

Argument checks (run them first: one wording of the errors in every backend; metadata only)
    :func:`check_page_copy_args`, :func:`check_peer_gather_args`, :func:`check_indexer_args`,
    :func:`check_indexer_paged_args`, :func:`check_indexer_index_pages_args`,
    :func:`check_indexer_topk_args`, :func:`check_topk_args`,
    :func:`check_sparse_mla_args`, :func:`check_sparse_mla_paged_args`, :func:`check_rope_args`,
    :func:`check_index_q_args`, :func:`check_page_rows_args`, :func:`check_fp8_store_args`,
    :func:`check_rms_norm_args`; DeepSeek-V4's :func:`check_v4_compress_args`,
    :func:`check_v4_index_scores_args`, :func:`check_v4_topk_args`,
    :func:`check_v4_attention_args`.

Page layout (the byte arithmetic of the formats table, :mod:`cpkv.ops.layout`)
    :func:`fp8_layout` (dims, block, rope dims and bytes of a packed fp8 row), :func:`part_view`
    / :func:`part_index` (one part's rows of a page buffer, in either layout),
    :func:`page_blocks` (writable latent / index-K halves of page blocks), :func:`gather_latent`
    / :func:`paged_latent` (``sparse_mla_paged`` composed from a backend's own
    ``fp8_unpack`` / ``page_gather`` and ``sparse_mla``), :func:`paged_index_tokens` /
    :func:`paged_index_keys` (a request's index-K keys copied out of its pages: the
    ``indexer_logits_paged`` composition through ``page_gather`` and ``indexer_logits``),
    :func:`index_page_keys` (the same out of page-major index-K pages: ``indexer_logits_index_pages``),
    :func:`fp8_index_keys` (stored fp8 index-K rows as the indexer's keys and scales).

fp8 numerics (:mod:`cpkv.ops.fp8`)
    :func:`quantize_fp8` (the one quantization formula: what ``fp8_pack`` must match bit for
    bit; "amax" scales for the latent, DeepSeek's power-of-two "ue8m0" for the index-K:
    :func:`scale_format`, a :class:`ScaleFormat`), :func:`pack_fp8` (a part's packed bytes from
    it: the reference every backend's ``fp8_pack`` equals), :data:`FP8_E4M3_MAX`, :data:`FP8_AMAX_FLOOR`,
    :data:`UE8M0_AMAX_FLOOR`, :func:`hadamard_rotate` (DeepSeek's ``rotate_activation``: an
    fp8 pool's index-K and the queries that meet it are rotated), :func:`quantize_index_q` (the
    indexer's fp8 queries with their scales folded into the head weights).

The reference formula of the ``rope`` op is :func:`cpkv.models.rope.apply_rope`, and that of
``v4_topk`` (rule 39's tie-break) :func:`cpkv.models.v4_topk.stable_topk` (they import torch and
the model code, so they are not re-exported here: this module imports neither).
"""

from __future__ import annotations

from cpkv.contracts import (
    FallbackReason,
    KVDtype,
    KVFormat,
    KVOps,
    KVPart,
    Op,
    OpDeclined,
    PageLayout,
    RopeStyle,
)
from cpkv.fallback import report_fallback

from .checks import (
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
    check_v4_attention_args,
    check_v4_compress_args,
    check_v4_index_scores_args,
    check_v4_topk_args,
)
from .fp8 import (
    FP8_AMAX_FLOOR,
    FP8_E4M3_MAX,
    UE8M0_AMAX_FLOOR,
    ScaleFormat,
    hadamard_rotate,
    pack_fp8,
    quantize_fp8,
    quantize_index_q,
    scale_format,
)
from .layout import (
    fp8_index_keys,
    fp8_layout,
    gather_latent,
    index_page_keys,
    page_blocks,
    paged_index_keys,
    paged_index_tokens,
    paged_latent,
    part_index,
    part_view,
)
from .methods import OpMethods

__all__ = [
    "FP8_AMAX_FLOOR",
    "FP8_E4M3_MAX",
    "UE8M0_AMAX_FLOOR",
    "FallbackReason",
    "KVDtype",
    "KVFormat",
    "KVOps",
    "KVPart",
    "Op",
    "OpDeclined",
    "OpMethods",
    "PageLayout",
    "RopeStyle",
    "ScaleFormat",
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
    "check_v4_attention_args",
    "check_v4_compress_args",
    "check_v4_index_scores_args",
    "check_v4_topk_args",
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
    "report_fallback",
    "scale_format",
]
