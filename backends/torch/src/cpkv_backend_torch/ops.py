"""The torch reference ops: one method per :class:`cpkv.contracts.Op` the backend provides.

Every other backend is checked against these (``cpkv.testing.conformance``), bit for bit, so the
formulas here are the definition:

* ``page_gather`` / ``rerange``: ``index_select`` along dim 0; ``page_scatter``: ``index_copy_``.
* ``fp8_pack``, per quantisation block of one token (computed in fp32)::

      amax  = max(|x_block|).clamp_min(AMAX_FLOOR)      # all-zero blocks get a finite scale
      scale = amax / FP8_E4M3_MAX                       # fp32 IEEE division (not x * (1/448)),
                                                        # stored as 4 little-endian bytes
      q     = (x_block / scale).clamp(-448, 448) -> float8_e4m3fn (round to nearest even)

  rope (latent only) is ``x[:, kv_lora_rank:]`` cast to bf16 and stored as 2 bytes per value.
* ``fp8_unpack``: ``(float32(q) * scale)`` then one cast to the requested dtype; rope is the stored
  bf16 cast to the requested dtype.

No op syncs the host (no ``.item()``, no data-dependent shapes) and none builds host tensors, so
they run unchanged on CPU and CUDA tensors, for any number of rows including 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cpkv.contracts import KVFormat

if TYPE_CHECKING:
    from cpkv.ops import KVPart

__all__ = ["AMAX_FLOOR", "FP8_E4M3_MAX", "TorchOps", "fp8_layout"]

#: largest finite float8_e4m3fn value; a block's amax maps onto it
FP8_E4M3_MAX = 448.0
#: smallest amax used for a block's scale, so an all-zero block divides by a positive number
AMAX_FLOOR = 1e-12

_FP8 = torch.float8_e4m3fn


def fp8_layout(fmt: KVFormat, part: KVPart) -> tuple[int, int, int, int]:
    """``(dims, quant_block, rope_dim, bytes_per_token)`` of the packed ``part`` of ``fmt``.

    ``dims`` is the number of fp8-quantised values per token, in blocks of ``quant_block``, each
    with one fp32 scale; ``rope_dim`` bf16 values follow (latent only).

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


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A packed [N, k] byte slice as its own dense tensor, so it can be viewed as a wider dtype
    (``.contiguous()`` may keep a misaligned storage offset: 1 row, or 0 rows)."""
    return t.clone(memory_format=torch.contiguous_format)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[N, D] of any dtype -> [N, D * itemsize] uint8 (native byte order: little-endian)."""
    return t.contiguous().view(torch.uint8)


class TorchOps:
    """Reference implementation of cpkv's compute ops in plain torch (CPU and GPU)."""

    # ---- page movement ----------------------------------------------------------------------
    def page_gather(self, src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``out[i] = src[index[i]]`` along dim 0.

        Args:
            src: [P, ...] pages or token rows, any dtype.
            index: int64 [n] on ``src.device``; entries may repeat.

        Returns:
            a new contiguous [n, ...] tensor.
        """
        return src.index_select(0, index)

    def page_scatter(self, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
        """``dst[index[i]] = src[i]`` in place along dim 0; other rows of ``dst`` are untouched.

        Args:
            dst: [P, ...] destination (pages or rows).
            index: int64 [n] unique entries on ``dst.device``.
            src: [n, ...] rows of ``dst``'s dtype and trailing shape.

        Raises:
            ValueError: ``src`` does not have the shape [len(index), *dst.shape[1:]] or the dtype
                of ``dst``.
        """
        if src.shape != (index.shape[0], *dst.shape[1:]) or src.dtype != dst.dtype:
            raise ValueError(f"page_scatter: src {tuple(src.shape)} {src.dtype} does not fit "
                             f"index {tuple(index.shape)} into dst {tuple(dst.shape)} {dst.dtype}")
        dst.index_copy_(0, index, src)

    def rerange(self, gathered: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
        """Rank-major padded rows back to natural order: ``natural[n] = gathered[perm[n]]``.

        Args:
            gathered: [C * max_rank_len, ...] all-gathered rows.
            perm: int64 [N] on ``gathered.device`` (the plan's permutation; padded rows unused).

        Returns:
            a new contiguous [N, ...] tensor.
        """
        return gathered.index_select(0, perm)

    # ---- fp8 ---------------------------------------------------------------------------------
    def fp8_pack(self, x: torch.Tensor, fmt: KVFormat, part: KVPart) -> torch.Tensor:
        """Quantise rows to the fp8 pool layout (see the module docstring for the formula).

        Args:
            x: [N, kv_lora_rank + rope_dim] (``latent``) or [N, index_head_dim] (``index_k``),
                any float dtype.

        Returns:
            uint8 [N, B]: e4m3 bytes, fp32 block scales, then (latent) bf16 rope; B is 656 / 132
            for DeepSeek-V3.2.

        Raises:
            ValueError: ``x`` is not 2-D or its last dim does not match ``fmt`` and ``part``.
        """
        dims, block, rope, _ = fp8_layout(fmt, part)
        if x.dim() != 2 or x.shape[1] != dims + rope:
            raise ValueError(f"fp8_pack({part}): expected x of shape [N, {dims + rope}] for {fmt!r}, "
                             f"got {tuple(x.shape)}")
        n = x.shape[0]
        vals = x[:, :dims].float().reshape(n, dims // block, block)
        amax = vals.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR)
        # a true division by a device tensor: torch divides by a Python scalar by multiplying with
        # its reciprocal on CUDA (not on the CPU), which is 1 ulp off for some amax
        scale = amax / amax.new_full((), FP8_E4M3_MAX)  # [N, blocks, 1] fp32
        q = (vals / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(_FP8).reshape(n, dims)
        parts = [q.view(torch.uint8), _bytes(scale.reshape(n, dims // block))]
        if rope:
            parts.append(_bytes(x[:, dims:].to(torch.bfloat16)))
        return torch.cat(parts, dim=1)

    def fp8_unpack(self, packed: torch.Tensor, fmt: KVFormat, part: KVPart,
                   dtype: torch.dtype) -> torch.Tensor:
        """The inverse of :meth:`fp8_pack`: dequantised values (e4m3 x block scale; rope as stored).

        Args:
            packed: uint8 [N, B] as produced by :meth:`fp8_pack`.
            dtype: dtype of the result.

        Returns:
            [N, kv_lora_rank + rope_dim] or [N, index_head_dim] of ``dtype``.

        Raises:
            ValueError: ``packed`` is not 2-D uint8 with B bytes per row.
        """
        dims, block, rope, nbytes = fp8_layout(fmt, part)
        if packed.dim() != 2 or packed.shape[1] != nbytes or packed.dtype != torch.uint8:
            raise ValueError(f"fp8_unpack({part}): expected uint8 [N, {nbytes}] for {fmt!r}, "
                             f"got {packed.dtype} {tuple(packed.shape)}")
        n, blocks = packed.shape[0], dims // block
        q = packed[:, :dims].view(_FP8).float().reshape(n, blocks, block)
        scale = _dense(packed[:, dims:dims + 4 * blocks]).view(torch.float32)
        vals = (q * scale.unsqueeze(-1)).reshape(n, dims).to(dtype)
        if not rope:
            return vals
        rope_vals = _dense(packed[:, dims + 4 * blocks:]).view(torch.bfloat16).to(dtype)
        return torch.cat([vals, rope_vals], dim=1)
