"""The write recipe: an engine's new KV rows -> the bytes cpkv's pools store, and the indexer's
query-side rotation that goes with them. Plain torch, no op table, no host sync.

DeepSeek-V3.2's fp8 cache (the reference's ``act_quant`` / ``rotate_activation``): the latent's
512 values e4m3 in blocks of 128 with fp32 amax scales, then its 64 rope dims as bf16 (656 B);
the index-K **Hadamard-rotated** (:func:`cpkv.ops.hadamard_rotate`), then its 128 values e4m3
with one fp32 ue8m0 (power-of-two) scale (132 B). The rotation is orthonormal, so the indexer's
queries are rotated the same way (:func:`rotate_index_q`) and ``q . k`` is unchanged; without it
the fp8 keys lose their outliers' precision (the top-k, and the logits, change). bf16 / fp32
formats store the values as they are (no rotation).
"""

from __future__ import annotations

import torch

from cpkv.contracts import KVDtype, KVFormat
from cpkv.kv import pack_rows
from cpkv.ops import hadamard_rotate

__all__ = ["quantize", "rotate_index_q"]


def quantize(fmt: KVFormat, latent: torch.Tensor, index_k: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stored bytes of new KV rows, bit for bit what cpkv's own pool stores for them: what
    :meth:`cpkv.embed.EngineKV.put_bytes` takes.

    Args:
        fmt: the stored format (``fp8``, ``bf16`` or ``fp32``).
        latent: float [N, kv_lora_rank + rope_dim] (the compressed KV and its roped part).
        index_k: float [N, index_head_dim] as the indexer computed it (not rotated), or None
            (a layer without index-K).

    Returns:
        (uint8 [N, latent bytes], uint8 [N, index bytes] or None).

    Raises:
        ValueError: a row width that does not match ``fmt``.
    """
    lat = pack_rows(latent, fmt, "latent")
    if index_k is None or not fmt.index_k:
        return lat, None
    return lat, pack_rows(rotate_index_q(fmt, index_k), fmt, "index_k")


def rotate_index_q(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    """The indexer's queries (float [..., index_head_dim]) as they must meet keys stored in
    ``fmt``: Hadamard-rotated for fp8 (as :func:`quantize` rotates the index-K), unchanged
    otherwise. Also the key-side rotation :func:`quantize` applies."""
    return hadamard_rotate(x) if fmt.dtype is KVDtype.FP8 else x
