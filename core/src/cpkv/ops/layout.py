"""Page-layout arithmetic: where each part of a token's bytes lies in the pool's page buffers.

The byte counts are :class:`~cpkv.contracts.KVFormat`'s (the contract's formats table); this
module turns them into offsets and tensor views in either :class:`~cpkv.contracts.PageLayout`:
the packed fp8 row of one part (:func:`fp8_layout`), one part's rows of a page buffer
(:func:`part_view`, :func:`part_index`), a page block's writable halves (:func:`page_blocks`),
the latent rows a sparse-attention op reads (:func:`gather_latent`, :func:`paged_latent`) and
the index-K keys of a request's pages (:func:`paged_index_tokens`, :func:`paged_index_keys`).
Views only: nothing here copies, syncs or allocates host tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from cpkv.contracts import KVDtype, PageLayout

if TYPE_CHECKING:
    import torch

    from cpkv.contracts import KVFormat, KVPart

__all__ = ["fp8_index_keys", "fp8_layout", "gather_latent", "index_page_keys", "page_blocks",
           "paged_index_keys",
           "paged_index_tokens", "paged_latent", "part_index", "part_view"]


def fp8_layout(fmt: KVFormat, part: KVPart) -> tuple[int, int, int, int]:
    """``(dims, quant_block, rope_dim, bytes_per_token)`` of the packed fp8 ``part`` of ``fmt``.

    ``dims`` values per token are e4m3, in blocks of ``quant_block`` with one fp32 scale each;
    ``rope_dim`` bf16 values follow (latent only). The one definition every backend packs to.

    Raises:
        ValueError: unknown ``part``, or ``kv_lora_rank`` not divisible by ``quant_block``.
    """
    if part == "latent":
        dims, block, rope = fmt.kv_lora_rank, fmt.quant_block, fmt.rope_dim
        if dims % block:
            raise ValueError(f"fp8 latent needs kv_lora_rank divisible by quant_block, got "
                             f"kv_lora_rank={dims}, quant_block={block}")
    elif part == "index_k":
        dims, block, rope = fmt.index_head_dim, fmt.index_head_dim, 0
    else:
        raise ValueError(f"part must be 'latent' or 'index_k', got {part!r}")
    return dims, block, rope, dims + 4 * (dims // block) + 2 * rope


def _part_span(fmt: KVFormat, page_size: int, part: KVPart) -> tuple[int, int, int]:
    """(byte offset of ``part`` in a token-major row, its bytes per token, the row step U of a
    part-major buffer: U divides every row start of that part)."""
    nl, b = fmt.latent_bytes_per_token, fmt.bytes_per_token
    lo, n = (0, nl) if part == "latent" else (nl, b - nl)
    first = lo * page_size  # the part's offset inside a part-major page
    return lo, n, math.gcd(page_size * b, first, n)


def part_view(pages: torch.Tensor, fmt: KVFormat, layout: PageLayout, part: KVPart,
              ) -> torch.Tensor:
    """One part's rows of a page buffer, for reading: [R, bytes of the part].

    ``pages`` is a contiguous uint8 [P, S, latent + index bytes] buffer (a pool layer, an
    all-gather's receive buffer) whose token t is slot t % S of page t // S. Token-major: the
    column slice of the token rows (row t is token t). Part-major: the part's rows are not evenly
    spaced, so this is an overlapping strided view whose row i starts i * U bytes in
    (:func:`part_index` gives a token's row): read it, never write through it.
    """
    lo, n, unit = _part_span(fmt, pages.shape[1], part)
    if layout is PageLayout.TOKEN_MAJOR:
        return pages.reshape(-1, fmt.bytes_per_token)[:, lo:lo + n]
    return pages.as_strided(((pages.numel() - n) // unit + 1, n), (unit, 1),
                            pages.storage_offset())


def page_blocks(pages: torch.Tensor, layout: PageLayout, latent_bytes: int,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Writable views of each page block's latent and index-K bytes: ``[n, S, latent]`` and
    ``[n, S, index]`` of a contiguous uint8 ``[n, S, latent + index]`` tensor of blocks laid out
    in ``layout`` (token-major: each token's latent then index-K bytes; part-major: the S latent
    rows, then the S index-K rows)."""
    n, s, b = pages.shape
    if layout is PageLayout.TOKEN_MAJOR:
        return pages[..., :latent_bytes], pages[..., latent_bytes:]
    flat = pages.view(n, s * b)
    return (flat[:, :s * latent_bytes].view(n, s, latent_bytes),
            flat[:, s * latent_bytes:].view(n, s, b - latent_bytes))


def part_index(tokens: torch.Tensor, fmt: KVFormat, layout: PageLayout, part: KVPart,
               ) -> torch.Tensor:
    """The rows of :func:`part_view` that hold ``tokens`` (int64 token rows: page x S + slot)."""
    if layout is PageLayout.TOKEN_MAJOR:
        return tokens
    s = fmt.page_size
    lo, n, unit = _part_span(fmt, s, part)
    return (tokens // s) * (s * fmt.bytes_per_token // unit) + (lo * s + (tokens % s) * n) // unit


def gather_latent(src: torch.Tensor, idx: torch.Tensor, picks: torch.Tensor, fmt: KVFormat,
                  dtype: torch.dtype, unpack: Callable[..., torch.Tensor],
                  gather: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent rows ``idx`` of ``src`` (a part's rows: :func:`part_view`), one per entry of
    ``picks`` (int32 [N, k], -1 empty), dequantized into [N * k, Dk] of ``dtype`` in one pass
    (a backend's ``fp8_unpack`` through the index, or its ``page_gather`` for float formats),
    and int32 [N, k] indices into them, -1 kept: what ``sparse_mla`` takes."""
    import torch

    n, k = picks.shape
    if fmt.dtype is KVDtype.FP8:
        lat = unpack(src, fmt, "latent", dtype, idx)
    else:
        width = torch.float32 if fmt.dtype is KVDtype.FP32 else torch.bfloat16
        lat = gather(src, idx).view(width).to(dtype)
    slots = torch.arange(n * k, dtype=torch.int32, device=picks.device).view(n, k)
    return lat, torch.where(picks >= 0, slots, torch.full_like(slots, -1))


def paged_latent(pages: torch.Tensor, rows: torch.Tensor, fmt: KVFormat, dtype: torch.dtype,
                 unpack: Callable[..., torch.Tensor],
                 gather: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather_latent` of the token rows ``rows`` (int32 [N, k], -1 empty) of part-major
    ``pages``: ``sparse_mla_paged`` composed from a backend's own ops."""
    tokens = rows.clamp_min(0).reshape(-1).long()
    return gather_latent(part_view(pages, fmt, PageLayout.PART_MAJOR, "latent"),
                         part_index(tokens, fmt, PageLayout.PART_MAJOR, "latent"), rows, fmt,
                         dtype, unpack, gather)


def paged_index_tokens(block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """int64 [R, M * S]: request r's keys in order as token rows of the pages (key j is token
    ``block_table[r, j // S] * S + j % S``), from an int32 [R, M] block table: the columns
    ``indexer_logits_paged`` reads."""
    import torch

    slot = torch.arange(page_size, dtype=torch.int64, device=block_table.device)
    rows, pages = block_table.shape
    return (block_table.long()[:, :, None] * page_size + slot).reshape(rows, pages * page_size)


def fp8_index_keys(rows: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored fp8 index-K rows (uint8 [T, index bytes]) as ``indexer_logits`` takes them:
    ``float8_e4m3fn`` [T, D] keys and their float32 [T] scales (contiguous copies)."""
    import torch

    d = fmt.index_head_dim
    return (rows[:, :d].contiguous().view(torch.float8_e4m3fn),
            rows[:, d:d + 4].contiguous().view(torch.float32).reshape(-1))


def paged_index_keys(pages: torch.Tensor, fmt: KVFormat, tokens: torch.Tensor,
                     gather: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The index-K keys of ``tokens`` (int64 [T] token rows of part-major ``pages``), copied
    out with a backend's ``page_gather`` as ``indexer_logits`` takes them: fp8 pools give
    ``float8_e4m3fn`` [T, D] keys and their float32 [T] scales, bf16 / fp32 pools [T, D] keys of
    that dtype and None. ``indexer_logits_paged`` composed from a backend's own ops is this,
    then ``indexer_logits``."""
    import torch

    src = part_view(pages, fmt, PageLayout.PART_MAJOR, "index_k")
    rows = gather(src, part_index(tokens, fmt, PageLayout.PART_MAJOR, "index_k"))
    if fmt.dtype is KVDtype.FP8:
        return fp8_index_keys(rows, fmt)
    return rows.view(torch.float32 if fmt.dtype is KVDtype.FP32 else torch.bfloat16), None


def index_page_keys(index_pages: torch.Tensor, fmt: KVFormat, tokens: torch.Tensor,
                    gather: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`paged_index_keys` of index-K pages in DeepGEMM's page order (uint8 [P, >= S x
    index bytes], unit column stride: page p's S value rows, then its S fp32 scales), the
    ``indexer_logits_index_pages`` composition: the keys of ``tokens`` (int64 [T] token rows
    page x S + slot) copied out with a backend's ``page_gather``."""
    import torch

    s, d = fmt.page_size, fmt.index_head_dim
    fp8 = fmt.dtype is KVDtype.FP8
    vb = d if fp8 else fmt.index_bytes_per_token
    page, slot = tokens // s, tokens % s
    p = index_pages.shape[0]
    vals = index_pages[:, :s * vb].reshape(p * s, vb)  # a view: unit column stride, page stride
    rows = gather(vals, page * s + slot)
    if not fp8:
        return rows.view(torch.float32 if fmt.dtype is KVDtype.FP32 else torch.bfloat16), None
    scales = index_pages[:, s * vb:s * (vb + 4)].reshape(p * s, 4)
    return rows.view(torch.float8_e4m3fn), gather(scales, page * s + slot).view(
        torch.float32).reshape(-1)
