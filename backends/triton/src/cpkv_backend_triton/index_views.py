"""Typed views of index-K in pool pages for the paged indexer kernels: the part-major pool layer
or DeepGEMM's page-major pages as flat views of the index-K value type (and the fp8 scales as a
float32 view of the same storage), with the element steps the kernels address rows by; the
padded head dim of an indexer dot. Views, not pointer casts: the interpreter runs them too."""

from __future__ import annotations

import math
from typing import Any

import torch

from cpkv.ops.api import KVDtype, KVFormat, OpDeclined

from .launch import interpreted, pow2

__all__ = ["dot_types", "dot_width", "index_page_views", "paged_index_views", "pages_tileable",
           "row_alignment"]


def dot_types(kernel: Any, q: torch.Tensor, keys: torch.dtype, fp8: bool) -> tuple[bool, bool]:
    """``(both_fp8, upcast)`` of an indexer dot of ``q`` against keys of dtype ``keys``: fp8
    queries on fp8 keys take the fp8 x fp8 dot, q and (converted) keys of one 16-bit type the
    16-bit dot, anything else (and every dot of an interpreted ``kernel``) fp32 (``upcast``)."""
    both_fp8 = fp8 and q.dtype == torch.float8_e4m3fn
    lowp = q.dtype in (torch.bfloat16, torch.float16) and (fp8 or keys == q.dtype)
    return both_fp8, interpreted(kernel) or not (both_fp8 or lowp)


def dot_width(d: int, fp8: bool, upcast: bool) -> int:
    """The padded head dim (``DP``) of an indexer dot: a tensor-core dot of fp8 operands needs
    K >= 32 (16-bit ones K >= 16), so a small head dim is padded (the pad lanes load as zero);
    the fp32 (``UPCAST``) dot takes the power of two at or above 16."""
    return pow2(d, 32 if fp8 and not upcast else 16)


def paged_index_views(pages: torch.Tensor, fmt: KVFormat
                       ) -> tuple[torch.Tensor, tuple[int, int, int], tuple[int, int, int]]:
    """The pool layer ``pages`` as a flat view of its index-K value type, with ``(page,
    first, row)`` element steps (token ``p * S + s`` at ``p * page + first + s * row``), and the
    fp8 scales' steps in a float32 view (zeros for float pools).

    Raises:
        OpDeclined: a byte offset is not a multiple of the view's element size."""
    s, nl, ib, b = (fmt.page_size, fmt.latent_bytes_per_token, fmt.index_bytes_per_token,
                    fmt.bytes_per_token)
    fp8 = fmt.dtype is KVDtype.FP8
    kdt = torch.float8_e4m3fn if fp8 else (torch.float32 if fmt.dtype is KVDtype.FP32
                                           else torch.bfloat16)
    esz = 4 if fp8 else kdt.itemsize  # the widest view taken of the storage
    steps = (s * b, s * nl, ib) + ((s * nl + fmt.index_head_dim,) if fp8 else ())
    if any(x % esz for x in steps) or pages.storage_offset() % esz:
        raise OpDeclined(f"indexer_logits_paged reads {fmt.dtype.value} index-K in place through "
                         f"{esz}-byte views: the byte offsets (page {s * b}, index part {s * nl}, "
                         f"row {ib}, storage offset {pages.storage_offset()}) must be multiples "
                         f"of {esz}")
    flat = pages.view(-1)
    k = flat.view(kdt)
    ksz = kdt.itemsize
    kst = (s * b // ksz, s * nl // ksz, ib // ksz)
    sst = (s * b // 4, (s * nl + fmt.index_head_dim) // 4, ib // 4) if fp8 else (0, 0, 0)
    return k, kst, sst


def row_alignment(steps: tuple[int, ...], itemsize: int) -> int:
    """The largest power of two (elements, at most 16 bytes' worth) dividing every step of a key
    row's first element: what each row's start is a multiple of."""
    g = math.gcd(*steps)
    a = 1
    while a * 2 * itemsize <= 16 and g % (a * 2) == 0:
        a *= 2
    return a


def pages_tileable(page_size: int) -> bool:
    """Whether :func:`_indexer_pages_kernel` tiles pages of this size (a dot's key operand of
    ``page_size`` rows: a power of two, at least 16)."""
    return page_size >= 16 and page_size & (page_size - 1) == 0


def index_page_views(index_pages: torch.Tensor, fmt: KVFormat
                      ) -> tuple[torch.Tensor, tuple[int, int, int], tuple[int, int, int]]:
    """Page-major index-K pages (uint8 [P, >= S x index bytes]) as a flat view of the
    value type with ``(page, first, row)`` element steps, and the fp8 scales' steps in a float32
    view (``p * page + S * D / 4 + s``; zeros for float formats).

    Raises:
        OpDeclined: the page stride, storage offset or value bytes misfit the view."""
    s, dim = fmt.page_size, fmt.index_head_dim
    fp8 = fmt.dtype is KVDtype.FP8
    kdt = torch.float8_e4m3fn if fp8 else (torch.float32 if fmt.dtype is KVDtype.FP32
                                           else torch.bfloat16)
    esz = 4 if fp8 else kdt.itemsize
    ps0 = index_pages.stride(0)
    if ps0 % esz or index_pages.storage_offset() % esz or (s * dim) % esz:
        raise OpDeclined(f"indexer_logits_index_pages reads {fmt.dtype.value} index-K through "
                         f"{esz}-byte views: the page stride {ps0}, the storage offset "
                         f"{index_pages.storage_offset()} and the page's value bytes must be "
                         f"multiples of {esz}")
    span = (index_pages.shape[0] - 1) * ps0 + s * fmt.index_bytes_per_token
    span += (-span) % esz
    flat = index_pages.as_strided((span,), (1,))
    ksz = kdt.itemsize
    k = flat.view(kdt)
    kst = (ps0 // ksz, 0, dim)
    sst = (ps0 // 4, s * dim // 4, 1) if fp8 else (0, 0, 0)
    return k, kst, sst
