"""The transient full view and conversions between compute tensors and the stored format."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cpkv.contracts import KVDtype, KVFormat, PageLayout
from cpkv.ops import fp8_index_keys, gather_latent, pack_fp8, part_index, part_view

if TYPE_CHECKING:
    from cpkv.ops import KVPart, OpTable

__all__ = ["AttentionKeys", "FullView", "pack_rows", "row_dims", "unpack_rows"]

_FLOAT = {KVDtype.BF16: torch.bfloat16, KVDtype.FP32: torch.float32}


def row_dims(fmt: KVFormat, part: KVPart) -> tuple[int, int]:
    """(values per token, stored bytes per token) of one buffer."""
    if part == "latent":
        return fmt.kv_lora_rank + fmt.rope_dim, fmt.latent_bytes_per_token
    return fmt.index_head_dim, fmt.index_bytes_per_token


def pack_rows(x: torch.Tensor, fmt: KVFormat, part: KVPart, ops: OpTable | None = None
              ) -> torch.Tensor:
    """Compute rows [N, D] -> stored bytes [N, B] (bf16/fp32: a byte view; fp8: the backend's
    pack, or with no ``ops`` the reference formula :func:`cpkv.ops.pack_fp8`, which every
    backend's equals bit for bit)."""
    d, _ = row_dims(fmt, part)
    if x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"{part} rows must be [N, {d}] for {fmt.dtype.value}, got {tuple(x.shape)}")
    if fmt.dtype is KVDtype.FP8:
        return pack_fp8(x, fmt, part) if ops is None else ops.fp8_pack(x, fmt, part)
    return x.to(_FLOAT[fmt.dtype]).contiguous().view(torch.uint8)


def unpack_rows(b: torch.Tensor, fmt: KVFormat, part: KVPart, ops: OpTable,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored bytes [N, B] -> values [N, D] in ``dtype`` (fp8 dequantised by its scales)."""
    if fmt.dtype is KVDtype.FP8:
        return ops.fp8_unpack(b, fmt, part, dtype)
    return b.contiguous().view(_FLOAT[fmt.dtype]).to(dtype)


@dataclass(frozen=True)
class FullView:
    """Every key the batch's rows may read, requests concatenated in natural order: request i's
    keys [0, P_i + E_i) are keys ``cu_seqlens[i]:cu_seqlens[i+1]``; positions past a request's
    valid length never appear (tail pages are masked).

    The keys stay where the materialization left them: ``pages`` (the pool layer itself, the
    all-gather's receive buffer in rank-major page order, or natural-order rows as [T, 1, B]),
    with key j at token row ``index[j]`` of ``pages`` (``index`` None: row j). Consumers read
    through the index in the pass they make anyway (:meth:`keys`: the fp8 dequantization, the
    split of the index-K bytes), so no natural-order copy of the whole view is made first.
    ``ops`` is the pool's op table (the gathers and dequantization read through it).
    ``rows_of`` holds, per part, the :func:`~cpkv.ops.part_index` of ``index`` when the strategy
    translated it once for the batch (part-major pages); otherwise it is translated per call.
    """

    pages: torch.Tensor  # uint8 [P, S, latent bytes + index bytes], contiguous
    index: torch.Tensor | None  # int64 [T] token rows of pages, or None (row j is key j)
    fmt: KVFormat
    layout: PageLayout
    cu_seqlens: torch.Tensor  # int64 [B + 1], on the view's device
    seq_lens: tuple[int, ...]  # host copy of the key counts (from the plan, no sync)
    ops: OpTable
    rows_of: Mapping[str, torch.Tensor] | None = None

    @property
    def num_keys(self) -> int:
        return self.pages.shape[0] * self.pages.shape[1] if self.index is None \
            else self.index.shape[0]

    def _rows(self, part: KVPart, keys: torch.Tensor | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The part's rows and the row of each key (``keys``: view keys; None: all of them)."""
        rows = part_view(self.pages, self.fmt, self.layout, part)
        if keys is None and self.rows_of is not None:
            return rows, self.rows_of[part]
        tokens = self.index if keys is None else (
            keys if self.index is None else self.index.index_select(0, keys))
        if tokens is None and self.layout is PageLayout.PART_MAJOR:
            tokens = torch.arange(self.num_keys, device=self.pages.device)
        return rows, None if tokens is None else part_index(tokens, self.fmt, self.layout, part)

    def _bytes(self, part: KVPart) -> torch.Tensor:
        rows, idx = self._rows(part)
        return rows if idx is None else self.ops.page_gather(rows, idx)

    def latent(self) -> torch.Tensor:
        """uint8 [T, latent bytes] in natural order (a copy when the view has an index)."""
        return self._bytes("latent")

    def index_k(self) -> torch.Tensor:
        """uint8 [T, index bytes] in natural order (a copy when the view has an index; [T, 0]
        for a layer without index-K)."""
        if not self.fmt.index_k:
            return self._no_index(torch.uint8)
        return self._bytes("index_k")

    def _no_index(self, dtype: torch.dtype) -> torch.Tensor:
        """The index keys of a layer without index-K: [T, 0]."""
        return torch.empty((self.num_keys, 0), dtype=dtype, device=self.pages.device)

    def token_rows(self, top: torch.Tensor) -> torch.Tensor:
        """int32 [N, k]: the token row of ``pages`` (page x S + slot) each view key of ``top``
        (int32 [N, k], -1 empty) is at, -1 kept: where a paged kernel reads it in place."""
        if self.index is None:
            return top
        rows = self.index.index_select(0, top.clamp_min(0).reshape(-1).long()).view(top.shape)
        return torch.where(top >= 0, rows.to(torch.int32), top)

    def unpack(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent [T, kv_lora_rank + rope_dim], index_k [T, index_head_dim]) in ``dtype``."""
        fmt, ops = self.fmt, self.ops
        if not fmt.index_k:
            if fmt.dtype is KVDtype.FP8:
                lr, li = self._rows("latent")
                return ops.fp8_unpack(lr, fmt, "latent", dtype, li), self._no_index(dtype)
            return unpack_rows(self.latent(), fmt, "latent", ops, dtype), self._no_index(dtype)
        if fmt.dtype is KVDtype.FP8:
            (lr, li), (ir, ii) = self._rows("latent"), self._rows("index_k")
            return (ops.fp8_unpack(lr, fmt, "latent", dtype, li),
                    ops.fp8_unpack(ir, fmt, "index_k", dtype, ii))
        return (unpack_rows(self.latent(), fmt, "latent", ops, dtype),
                unpack_rows(self.index_k(), fmt, "index_k", ops, dtype))

    def index_keys(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The indexer's keys alone (see :meth:`keys`): fp8 [T, D] with fp32 scales [T] for an
        fp8 pool, else [T, D] in ``dtype`` with None; [T, 0] and None for a layer without
        index-K (it reuses another layer's selection)."""
        fmt = self.fmt
        if not fmt.index_k:
            return self._no_index(dtype), None
        if fmt.dtype is not KVDtype.FP8:
            return unpack_rows(self.index_k(), fmt, "index_k", self.ops, dtype), None
        return fp8_index_keys(self.index_k(), fmt)  # one gather of the index bytes

    def selected_latent(self, top: torch.Tensor,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the latent rows a top-k choice reads, for batches that read fewer rows than the
        view holds (decode steps, short extends after a long prefix): ``top`` int32 [N, k] (view
        keys, -1 empty) -> (latent [N * k, Dk] in ``dtype``, indices int32 [N, k] into it, -1
        kept), gathered and dequantized in one pass from where the view's rows are."""
        rows, idx = self._rows("latent", top.clamp_min(0).reshape(-1).long())
        assert idx is not None
        return gather_latent(rows, idx, top, self.fmt, dtype, self.ops.fp8_unpack,
                             self.ops.page_gather)

    def keys(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the attention kernels take, one pass over each part: latent keys [T, Dk] in
        ``dtype``; index keys as the indexer takes them (an fp8 pool's stay fp8 [T, D] with their
        fp32 scales [T], never widened; float pools' in ``dtype``, scales None)."""
        if self.fmt.dtype is not KVDtype.FP8:
            lat, idx = self.unpack(dtype)
            return lat, idx, None
        rows, where = self._rows("latent")
        lat = self.ops.fp8_unpack(rows, self.fmt, "latent", dtype, where)
        return (lat, *self.index_keys(dtype))

    def attention_keys(self, dtype: torch.dtype, *, whole: bool) -> AttentionKeys:
        """What one layer's attention reads from this view, in ``dtype``: the indexer's keys,
        and the latent rows either dequantized whole now (``whole``) or read per top-k choice
        later (:meth:`AttentionKeys.sparse_mla`: in place on part-major pages, else only the
        picked rows gathered), for batches that read fewer rows than the view holds."""
        if whole:
            lat, idx_k, scale = self.keys(dtype)
            return AttentionKeys(self, dtype, idx_k, scale, lat)
        idx_k, scale = self.index_keys(dtype)
        return AttentionKeys(self, dtype, idx_k, scale, None)


@dataclass(frozen=True)
class AttentionKeys:
    """A layer's keys as its attention reads them (:meth:`FullView.attention_keys`)."""

    view: FullView
    dtype: torch.dtype
    #: the indexer's keys: fp8 [T, D] with fp32 scales [T] (fp8 pool), else [T, D] and None
    index_k: torch.Tensor
    index_scale: torch.Tensor | None
    #: every latent key [T, Dk] in ``dtype``, or None: read per choice by :meth:`sparse_mla`
    latent: torch.Tensor | None

    def sparse_mla(self, q: torch.Tensor, top: torch.Tensor, softmax_scale: float,
                   dv: int) -> torch.Tensor:
        """Sparse MLA of queries ``q`` [N, H, Dk] over their top-k choice ``top`` (int32
        [N, k] view keys, -1 empty) -> [N, H, dv], reading the latent keys the way this view
        holds them. Device ops only (no host sync)."""
        v, ops = self.view, self.view.ops
        if self.latent is not None:
            return ops.sparse_mla(q, self.latent, top, softmax_scale, dv)
        if v.layout is PageLayout.PART_MAJOR:  # the picks read where they are
            return ops.sparse_mla_paged(q, v.pages, v.token_rows(top), v.fmt, softmax_scale, dv)
        rows, ind = v.selected_latent(top, self.dtype)
        return ops.sparse_mla(q, rows, ind, softmax_scale, dv)
