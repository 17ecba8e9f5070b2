"""fp8 (e4m3) quantization and the indexer's rotation: the formulas of the pool's packed format
and of the indexer's fp8 queries.

Per block of ``block`` values of a row (the whole row when ``block`` is None), in fp32, one of two
scale formats (:data:`ScaleFormat`)::

    "amax" (the latent):   amax  = max(|x_block|).clamp_min(FP8_AMAX_FLOOR)
                           scale = amax / FP8_E4M3_MAX            # a true IEEE division
    "ue8m0" (the indexer): amax  = max(|x_block|).clamp_min(UE8M0_AMAX_FLOOR)
                           scale = 2^ceil(log2(amax * (1 / FP8_E4M3_MAX)))   # a power of two
    q = e4m3(clamp(x_block / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX))   # round to nearest even

``x ~ float32(q) * scale``. "ue8m0" is DeepSeek-V3.2's own indexer quantization
(``inference/kernel.py`` ``act_quant(x, 128, "ue8m0")``: the power of two taken from the fp32
bits of ``amax * (1/448)``, exact, no ``log2`` rounding). The index-K part of an fp8 pool and the
indexer's fp8 queries use it, after :func:`hadamard_rotate` (DeepSeek's ``rotate_activation``);
the latent part keeps "amax" (the smallest error for values that attention reads back).

The torch reference's ``fp8_pack``, the indexer's query quantization (:func:`quantize_index_q`),
the conformance suite, the benches and the kernels' tests all call :func:`quantize_fp8`, so a
kernel that matches it bit for bit matches the reference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from cpkv.contracts import KVFormat
    from cpkv.contracts.ops import KVPart

__all__ = ["FP8_AMAX_FLOOR", "FP8_E4M3_MAX", "UE8M0_AMAX_FLOOR", "ScaleFormat",
           "hadamard_rotate", "pack_fp8", "quantize_fp8", "quantize_index_q", "scale_format"]

#: largest finite float8_e4m3fn value; a block's amax maps onto it
FP8_E4M3_MAX = 448.0
#: smallest amax of an "amax" block's scale, so an all-zero block divides by a positive number
FP8_AMAX_FLOOR = 1e-12
#: smallest amax of a "ue8m0" block (DeepSeek's ``act_quant`` clamps at 1e-4)
UE8M0_AMAX_FLOOR = 1e-4

#: a block's scale: "amax" (amax / 448) or "ue8m0" (that rounded up to a power of two)
ScaleFormat = Literal["amax", "ue8m0"]


def scale_format(part: KVPart) -> ScaleFormat:
    """The scale format of an fp8 pool's ``part``: "ue8m0" for the index-K (and the indexer's
    fp8 queries, which meet it), "amax" for the latent."""
    return "ue8m0" if part == "index_k" else "amax"


def _pow2_ceil(r: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= ``r`` (fp32, positive, normal), from its bits: exponent + 1
    when any mantissa bit is set (DeepSeek's ``fast_round_scale``)."""
    import torch

    bits = r.view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def quantize_fp8(x: torch.Tensor, block: int | None = None,
                 scale_fmt: ScaleFormat = "amax") -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` quantized to e4m3 per block of its last dim (the module docstring's formula).

    Args:
        x: float [..., D], any float dtype (computed in fp32).
        block: values per scale along the last dim; None: one scale per row (``block = D``).
        scale_fmt: "amax" (the latent's) or "ue8m0" (the indexer's power-of-two scales).

    Returns:
        ``(q, scale)``: float8_e4m3fn [..., D] and float32 scales, [..., D // block] (or [...]
        when ``block`` is None).

    Raises:
        ValueError: ``block`` does not divide D, or an unknown ``scale_fmt``.
    """
    import torch

    d = x.shape[-1]
    b = d if block is None else block
    if b <= 0 or d % b:
        raise ValueError(f"quantize_fp8: block {block} does not divide the last dim {d}")
    vals = x.float().reshape(*x.shape[:-1], d // b, b)
    amax = vals.abs().amax(dim=-1, keepdim=True)
    if scale_fmt == "ue8m0":
        amax = amax.clamp_min(UE8M0_AMAX_FLOOR)
        scale = _pow2_ceil(amax * amax.new_full((), 1.0 / FP8_E4M3_MAX))
    elif scale_fmt == "amax":
        amax = amax.clamp_min(FP8_AMAX_FLOOR)
        # a true division by a device tensor: torch divides by a Python scalar by multiplying
        # with its reciprocal on CUDA (not on the CPU), which is 1 ulp off for some amax
        scale = amax / amax.new_full((), FP8_E4M3_MAX)
    else:
        raise ValueError(f"quantize_fp8: scale_fmt must be 'amax' or 'ue8m0', got {scale_fmt!r}")
    q = (vals / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    lead = x.shape[:-1] if block is None else vals.shape[:-1]
    return q.reshape(x.shape), scale.reshape(lead)


_SIGNS: dict[tuple[str, int | None, str], torch.Tensor] = {}


def _hadamard_signs(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix of +-1 (symmetric; exact in any float dtype), cached
    per device and dtype. Built on ``device`` from index arithmetic (``H[i, j] = (-1)^popcount(i
    & j)``): no host tensor is copied over, so even the first call inside a layer loop does not
    sync the device."""
    import torch

    key = (device.type, device.index, f"{dtype}:{n}")
    h = _SIGNS.get(key)
    if h is None:
        i = torch.arange(n, device=device)
        both = i[:, None] & i[None, :]
        parity = torch.zeros_like(both)
        for b in range(max(1, n.bit_length())):
            parity ^= (both >> b) & 1
        h = _SIGNS[key] = (1 - 2 * parity).to(dtype)
    return h


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3.2's ``rotate_activation``: the Hadamard transform of the last dim (D, a
    power of two; 128 for DeepSeek's index heads), scaled by ``D^-0.5``, in ``x``'s dtype:
    ``(float32(x) @ H) * D^-0.5`` rounded once (``H`` the +-1 Sylvester matrix, the order
    ``fast_hadamard_transform`` uses). Orthonormal, so ``rot(q) . rot(k) = q . k``; the fp8
    quantization after it sees evened-out values (an outlier spread over the row).

    One GEMM pass (no host sync): on CUDA a 16-bit ``x`` is multiplied with fp32 output (the
    +-1 entries are exact), elsewhere in fp32.

    Args:
        x: float [..., D].

    Returns:
        a new tensor of ``x``'s shape and dtype.

    Raises:
        ValueError: D is not a power of two.
    """
    import torch

    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_rotate: the last dim {n} is not a power of two")
    flat = x.reshape(-1, n)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        y = torch.mm(flat, _hadamard_signs(n, x.device, x.dtype), out_dtype=torch.float32)
    else:
        y = flat.float() @ _hadamard_signs(n, x.device, torch.float32)
    return y.mul_(n ** -0.5).to(x.dtype).view(x.shape)


def quantize_index_q(q: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's queries in fp8 with their scales folded into the head weights.

    ``(q8, w')`` with ``(q8, s) = quantize_fp8(q, None, "ue8m0")`` per (row, head) and
    ``w' = w * s``: DeepSeek's ``weights * q_scale``. Since ``relu(s * x) = s * relu(x)`` for
    ``s > 0``, ``indexer_logits(q8, w', k8, k_scale, ...)`` is the indexer on the quantized q.
    ``q`` is taken as given: the caller rotates it (:func:`hadamard_rotate`) when the keys are
    an fp8 pool's (rotated) index-K. Plain torch, no host sync.

    Args:
        q: float [N, H, D]; w: float32 [N, H].

    Returns:
        float8_e4m3fn [N, H, D] and float32 [N, H].
    """
    q8, s = quantize_fp8(q, None, scale_format("index_k"))
    return q8, w * s


def pack_fp8(x: torch.Tensor, fmt: KVFormat, part: KVPart) -> torch.Tensor:
    """Rows -> the packed fp8 bytes of ``part`` (:func:`~cpkv.ops.layout.fp8_layout`): the e4m3
    values of :func:`quantize_fp8` (the part's :func:`scale_format`), their fp32 scales, then
    (latent) the rope dims as bf16; little-endian. What every backend's ``fp8_pack`` must equal
    bit for bit (656 B latent, 132 B index-K at DeepSeek-V3.2's sizes). Plain torch, no host
    sync; the caller rotates an index-K first (:func:`hadamard_rotate`) when the pool's is.

    Args:
        x: float [N, dims + rope dims] (latent) or [N, index dims] (index-K).

    Raises:
        ValueError: ``x`` is not 2-D or its last dim does not match ``fmt`` and ``part``.
    """
    import torch

    from .layout import fp8_layout

    dims, block, rope, _ = fp8_layout(fmt, part)
    if x.dim() != 2 or x.shape[1] != dims + rope:
        raise ValueError(f"fp8_pack({part}): expected x of shape [N, {dims + rope}] for {fmt!r}, "
                         f"got {tuple(x.shape)}")
    q, scale = quantize_fp8(x[:, :dims], block, scale_format(part))
    parts = [q.view(torch.uint8), scale.contiguous().view(torch.uint8)]
    if rope:
        parts.append(x[:, dims:].to(torch.bfloat16).contiguous().view(torch.uint8))
    return torch.cat(parts, dim=1)
