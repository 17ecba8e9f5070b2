"""The transient full view and conversions between compute tensors and the stored format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cpkv.contracts import KVDtype, KVFormat

if TYPE_CHECKING:
    from cpkv.ops import KVPart, OpTable

__all__ = ["FullView", "pack_rows", "row_dims", "unpack_rows"]

_FLOAT = {KVDtype.BF16: torch.bfloat16, KVDtype.FP32: torch.float32}


def row_dims(fmt: KVFormat, part: KVPart) -> tuple[int, int]:
    """(values per token, stored bytes per token) of one buffer."""
    if part == "latent":
        return fmt.kv_lora_rank + fmt.rope_dim, fmt.latent_bytes_per_token
    return fmt.index_head_dim, fmt.index_bytes_per_token


def pack_rows(x: torch.Tensor, fmt: KVFormat, part: KVPart, ops: OpTable) -> torch.Tensor:
    """Compute rows [N, D] -> stored bytes [N, B] (bf16/fp32: a byte view; fp8: the backend's pack)."""
    d, _ = row_dims(fmt, part)
    if x.dim() != 2 or x.shape[1] != d:
        raise ValueError(f"{part} rows must be [N, {d}] for {fmt.dtype.value}, got {tuple(x.shape)}")
    if fmt.dtype is KVDtype.FP8:
        return ops.fp8_pack(x, fmt, part)
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

    The keys stay where the materialization left them: ``rows`` (the pool's token rows, the
    all-gather's receive buffer in rank-major page order, or a natural-order copy), with key j at
    ``rows[index[j]]`` (``index`` None: ``rows`` is the view itself). Consumers read through the
    index in the pass they make anyway (:meth:`keys`: the fp8 dequantization, the split of the
    index-K bytes), so no natural-order copy of the whole view is made first.
    """

    rows: torch.Tensor  # uint8 [R, latent bytes + index bytes]
    index: torch.Tensor | None  # int64 [T] into rows, or None (rows is [T, B] in natural order)
    latent_bytes: int  # bytes of a row's latent part (the index-K bytes follow)
    cu_seqlens: torch.Tensor  # int64 [B + 1], on the view's device
    seq_lens: tuple[int, ...]  # host copy of the key counts (from the plan, no sync)

    @property
    def num_keys(self) -> int:
        return self.rows.shape[0] if self.index is None else self.index.shape[0]

    def _part(self, lo: int, hi: int | None, ops: OpTable | None) -> torch.Tensor:
        cols = self.rows[:, lo:hi]
        if self.index is None:
            return cols
        if ops is None:
            return cols.index_select(0, self.index)
        return ops.page_gather(cols, self.index)

    def latent(self, ops: OpTable | None = None) -> torch.Tensor:
        """uint8 [T, latent bytes] in natural order (a copy when the view has an index)."""
        return self._part(0, self.latent_bytes, ops)

    def index_k(self, ops: OpTable | None = None) -> torch.Tensor:
        """uint8 [T, index bytes] in natural order (a copy when the view has an index)."""
        return self._part(self.latent_bytes, None, ops)

    def unpack(self, fmt: KVFormat, ops: OpTable,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent [T, kv_lora_rank + rope_dim], index_k [T, index_head_dim]) in ``dtype``."""
        if fmt.dtype is KVDtype.FP8:
            nl = self.latent_bytes
            return (ops.fp8_unpack(self.rows[:, :nl], fmt, "latent", dtype, self.index),
                    ops.fp8_unpack(self.rows[:, nl:], fmt, "index_k", dtype, self.index))
        return (unpack_rows(self.latent(ops), fmt, "latent", ops, dtype),
                unpack_rows(self.index_k(ops), fmt, "index_k", ops, dtype))

    def index_keys(self, fmt: KVFormat, ops: OpTable, dtype: torch.dtype,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The indexer's keys alone (see :meth:`keys`): fp8 [T, D] with fp32 scales [T] for an
        fp8 pool, else [T, D] in ``dtype`` with None."""
        if fmt.dtype is not KVDtype.FP8:
            return unpack_rows(self.index_k(ops), fmt, "index_k", ops, dtype), None
        d = fmt.index_head_dim
        ik = self.index_k(ops)  # [T, D + 4]: natural order, one gather of the index bytes
        return (ik[:, :d].contiguous().view(torch.float8_e4m3fn),
                ik[:, d:d + 4].contiguous().view(torch.float32).reshape(-1))

    def selected_latent(self, top: torch.Tensor, fmt: KVFormat, ops: OpTable,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Only the latent rows a top-k choice reads, for batches that read fewer rows than the
        view holds (decode steps, short extends after a long prefix): ``top`` int32 [N, k] (view
        keys, -1 empty) -> (latent [N * k, Dk] in ``dtype``, indices int32 [N, k] into it, -1
        kept), gathered and dequantized in one pass from where the view's rows are."""
        n, k = top.shape
        keys = top.clamp_min(0).reshape(-1).long()
        rows = keys if self.index is None else self.index.index_select(0, keys)
        nl = self.latent_bytes
        if fmt.dtype is KVDtype.FP8:
            lat = ops.fp8_unpack(self.rows[:, :nl], fmt, "latent", dtype, rows)
        else:
            lat = unpack_rows(ops.page_gather(self.rows[:, :nl], rows), fmt, "latent", ops, dtype)
        slots = torch.arange(n * k, dtype=torch.int32, device=top.device).view(n, k)
        return lat, torch.where(top >= 0, slots, torch.full_like(slots, -1))

    def keys(self, fmt: KVFormat, ops: OpTable, dtype: torch.dtype,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the attention kernels take, one pass over each part: latent keys [T, Dk] in
        ``dtype``; index keys as the indexer takes them (an fp8 pool's stay fp8 [T, D] with their
        fp32 scales [T], never widened; float pools' in ``dtype``, scales None)."""
        if fmt.dtype is not KVDtype.FP8:
            lat, idx = self.unpack(fmt, ops, dtype)
            return lat, idx, None
        lat = ops.fp8_unpack(self.rows[:, :self.latent_bytes], fmt, "latent", dtype, self.index)
        return (lat, *self.index_keys(fmt, ops, dtype))
