"""fp8 (e4m3) quantization: the one formula of the pool's packed format and the indexer's queries.

Per block of ``block`` values of a row (the whole row when ``block`` is None), in fp32::

    amax  = max(|x_block|).clamp_min(FP8_AMAX_FLOOR)   # an all-zero block gets a finite scale
    scale = amax / FP8_E4M3_MAX                        # a true IEEE division (see below)
    q     = e4m3(clamp(x_block / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX))   # round to nearest even

``x ~ float32(q) * scale``. The torch reference's ``fp8_pack``, the indexer's query quantization
(:func:`quantize_index_q`), the conformance suite, the benches and the kernels' tests all call
:func:`quantize_fp8`, so a kernel that matches it bit for bit matches the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["FP8_AMAX_FLOOR", "FP8_E4M3_MAX", "quantize_fp8", "quantize_index_q"]

#: largest finite float8_e4m3fn value; a block's amax maps onto it
FP8_E4M3_MAX = 448.0
#: smallest amax used for a block's scale, so an all-zero block divides by a positive number
FP8_AMAX_FLOOR = 1e-12


def quantize_fp8(x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` quantized to e4m3 per block of its last dim (the module docstring's formula).

    Args:
        x: float [..., D], any float dtype (computed in fp32).
        block: values per scale along the last dim; None: one scale per row (``block = D``).

    Returns:
        ``(q, scale)``: float8_e4m3fn [..., D] and float32 scales, [..., D // block] (or [...]
        when ``block`` is None).

    Raises:
        ValueError: ``block`` does not divide D.
    """
    import torch

    d = x.shape[-1]
    b = d if block is None else block
    if b <= 0 or d % b:
        raise ValueError(f"quantize_fp8: block {block} does not divide the last dim {d}")
    vals = x.float().reshape(*x.shape[:-1], d // b, b)
    amax = vals.abs().amax(dim=-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    # a true division by a device tensor: torch divides by a Python scalar by multiplying with
    # its reciprocal on CUDA (not on the CPU), which is 1 ulp off for some amax
    scale = amax / amax.new_full((), FP8_E4M3_MAX)
    q = (vals / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    lead = x.shape[:-1] if block is None else vals.shape[:-1]
    return q.reshape(x.shape), scale.reshape(lead)


def quantize_index_q(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's queries in fp8 with their scales folded into the head weights.

    ``(q8, w')`` with ``(q8, s) = quantize_fp8(q)`` per (row, head) and ``w' = w * s``. Since
    ``relu(s * x) = s * relu(x)`` for ``s > 0``, ``indexer_logits(q8, w', k8, k_scale, ...)`` is
    the indexer on the quantized q (DeepSeek's own inference quantizes the indexer's q and k
    alike). Plain torch, no host sync.

    Args:
        q: float [N, H, D]; w: float32 [N, H].

    Returns:
        float8_e4m3fn [N, H, D] and float32 [N, H].
    """
    q8, s = quantize_fp8(q)
    return q8, w * s
