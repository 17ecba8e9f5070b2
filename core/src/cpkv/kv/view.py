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
    """Every key the batch's rows may read, in natural order, requests concatenated.

    Request i's keys [0, P_i + E_i) are rows ``cu_seqlens[i]:cu_seqlens[i+1]``, in the stored
    format; positions past a request's valid length never appear (tail pages are masked).
    """

    latent: torch.Tensor  # uint8 [T, latent bytes]
    index_k: torch.Tensor  # uint8 [T, index bytes]
    cu_seqlens: torch.Tensor  # int64 [B + 1], on the view's device
    seq_lens: tuple[int, ...]  # host copy of the key counts (from the plan, no sync)

    def unpack(self, fmt: KVFormat, ops: OpTable,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent [T, kv_lora_rank + rope_dim], index_k [T, index_head_dim]) in ``dtype``."""
        return (unpack_rows(self.latent, fmt, "latent", ops, dtype),
                unpack_rows(self.index_k, fmt, "index_k", ops, dtype))
