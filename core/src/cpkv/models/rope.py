"""Rotary embeddings of DeepSeek-V3.2, bit-compatible with transformers 5.

* ``inv_freq`` / ``attention_scaling``: ``default`` rope, or ``yarn`` as transformers'
  ``_compute_yarn_parameters`` (cos/sin are multiplied by ``attention_scaling``).
* :func:`mla_softmax_scale`: ``qk_head_dim^-0.5`` times yarn's ``mscale(factor, mscale_all_dim)^2``.
* :func:`rope_interleave` (MLA: rotates pairs ``(x0, x1), (x2, x3), ...`` and writes the result
  de-interleaved, ``[evens', odds']``, exactly like transformers' ``apply_rotary_pos_emb_interleave``;
  the query and the key get the same layout, so their dot product is that of the original rope).
* :func:`rope_half` (indexer: ``x * cos + rotate_half(x) * sin``).
* :func:`apply_rope`: either, on ``[N, R]`` or ``[N, H, R]`` rows with per-row ``[N, R]`` cos /
  sin, into ``out`` (may be x itself): the ``rope`` op's reference (the torch backend's), and
  what :class:`~cpkv.models.DeepseekV32` runs when the driver passes no op.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from cpkv.contracts import RopeStyle

from .config import RopeConfig

__all__ = ["RopeFn", "apply_rope", "mla_softmax_scale", "rope_half", "rope_interleave",
           "rope_inv_freq", "yarn_get_mscale"]

#: the ``rope`` op's signature: ``(x, cos, sin, style, out) -> out`` (``cpkv.ops.KVOps.rope``)
RopeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, RopeStyle, "torch.Tensor | None"],
                  torch.Tensor]


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2] float32, attention_scaling)`` for a rope of ``dim`` rotated dims."""
    base = rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0
    assert rope.factor is not None and rope.original_max_position_embeddings is not None
    factor, original_max = rope.factor, rope.original_max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, rope.mscale)
                                     / yarn_get_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = (inv_freq_interpolation * (1 - extrapolation_factor)
                + inv_freq_extrapolation * extrapolation_factor)
    return inv_freq, float(attention_factor)


def mla_softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """MLA softmax scale: ``qk_head_dim^-0.5``, times ``mscale^2`` for yarn with ``mscale_all_dim``."""
    scale = qk_head_dim ** -0.5
    if rope.type != "default" and rope.mscale_all_dim:
        assert rope.factor is not None
        m = yarn_get_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def rope_interleave(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Interleaved-pair rope; ``cos``/``sin`` are ``cat(freqs, freqs)``-shaped and broadcast against ``x``.

    ``out``: where the result goes (e.g. the rope columns of a larger tensor; not ``x``), each
    half written by its last op, so no concatenation pass; the same values either way."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    if out is None:
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    torch.sub(x1 * c, x2 * s, out=out[..., :half])
    torch.add(x2 * c, x1 * s, out=out[..., half:])
    return out


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Half-split rope (``rotate_half``), as the indexer uses. ``out`` may be ``x`` itself (the
    inputs are read into temporaries before the last op writes it); the same values either way."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    if out is None:
        return x * cos + rotated * sin
    return torch.add(x * cos, rotated * sin, out=out)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``rope_interleave`` (``style="interleave"``) or ``rope_half`` (``"half"``) of ``x`` rows
    ``[N, R]`` or ``[N, H, R]`` with per-row ``cos`` / ``sin`` ``[N, R]``, written into ``out``
    when given (x itself: in place), else a new tensor; transformers' op sequence."""
    c, s = (cos, sin) if x.dim() == 2 else (cos[:, None], sin[:, None])
    if style == "half":  # reads x into temporaries before its last op writes out
        return rope_half(x, c, s, out=out)
    if out is None:
        return rope_interleave(x, c, s)
    if out.data_ptr() == x.data_ptr():  # in place: the first half's write would clobber x
        return out.copy_(rope_interleave(x, c, s))
    return rope_interleave(x, c, s, out=out)
