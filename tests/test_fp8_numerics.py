"""DeepSeek-V3.2's indexer numerics (``cpkv.ops.fp8``): the Hadamard rotation and the ue8m0
power-of-two scales, checked against independent formulations."""

from __future__ import annotations

import math

import pytest
import torch

from cpkv.ops import UE8M0_AMAX_FLOOR, hadamard_rotate, quantize_fp8, quantize_index_q, scale_format


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized fast Walsh-Hadamard transform of the last dim (butterflies, float64)."""
    y = x.double().clone()
    n, h = y.shape[-1], 1
    while h < n:
        y = y.view(*y.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2).reshape(*x.shape)
        h *= 2
    return y


@pytest.mark.parametrize("n", [1, 16, 128])
def test_hadamard_rotate_is_the_scaled_walsh_hadamard_transform(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, 3, n, generator=g)
    got = hadamard_rotate(x)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), _fwht(x) * n ** -0.5, rtol=1e-6, atol=1e-6)
    # orthonormal and symmetric: twice is the identity, dot products are kept
    torch.testing.assert_close(hadamard_rotate(got), x, rtol=1e-5, atol=1e-5)
    q, k = x[:, 0], x[:, 1]
    torch.testing.assert_close((hadamard_rotate(q) * hadamard_rotate(k)).sum(-1),
                               (q * k).sum(-1), rtol=1e-5, atol=1e-5)


def test_hadamard_rotate_bf16_rounds_once() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g).bfloat16()
    got = hadamard_rotate(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (_fwht(x.float()) * 128 ** -0.5).float().bfloat16())


def test_hadamard_rotate_needs_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="not a power of two"):
        hadamard_rotate(torch.randn(2, 96))


def test_ue8m0_scales_are_the_power_of_two_at_or_above_amax_over_448() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(300, 256, generator=g) * torch.logspace(-6, 4, 300, base=2)[:, None]
    x[0] = 0.0  # the floor
    q, s = quantize_fp8(x, 128, "ue8m0")
    assert s.shape == (300, 2) and s.dtype == torch.float32
    amax = x.view(300, 2, 128).abs().amax(-1).clamp_min(UE8M0_AMAX_FLOOR)
    for a, v in zip(amax.flatten().tolist(), s.flatten().tolist(), strict=True):
        m, _ = math.frexp(v)
        assert m == 0.5, v  # a power of two
        assert v >= a / 448 * (1 - 1e-7) and v < 2 * a / 448, (a, v)
    assert torch.equal(s[0], torch.full((2,), 2.0 ** math.ceil(math.log2(1e-4 / 448))))
    vals = q.float().view(300, 2, 128)
    assert vals.abs().max() <= 448
    # the block maximum lands in [224, 448] (not below: the scale is the smallest power of two)
    assert (vals[1:].abs().amax(-1) >= 224).all()
    # an exact power of two amax / 448 keeps its scale (the bits have no mantissa)
    y = torch.zeros(1, 128)
    y[0, 0] = 448.0 * 2.0 ** -5
    _, s1 = quantize_fp8(y, None, "ue8m0")
    assert s1.item() == 2.0 ** -5


def test_amax_scales_unchanged_for_the_latent() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(10, 128, generator=g)
    _, s = quantize_fp8(x, 64)
    assert torch.equal(s, x.view(10, 2, 64).abs().amax(-1) / 448)
    assert (scale_format("latent"), scale_format("index_k")) == ("amax", "ue8m0")
    with pytest.raises(ValueError, match="scale_fmt"):
        quantize_fp8(x, 64, "e8m0")  # type: ignore[arg-type]


def test_index_queries_fold_their_power_of_two_scale_into_the_weights() -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(6, 4, 128, generator=g)
    w = torch.randn(6, 4, generator=g)
    q8, w8 = quantize_index_q(q, w)
    s = w8 / w
    assert torch.equal(s, torch.pow(2.0, torch.ceil(torch.log2(q.abs().amax(-1) / 448))))
    # relu(s x) = s relu(x): the fp8 product times w' is the dequantized query's
    k = torch.randn(9, 128, generator=g)
    a = (torch.relu(torch.einsum("nhd,td->nht", q8.float(), k)) * w8[..., None]).sum(1)
    b = (torch.relu(torch.einsum("nhd,td->nht", q8.float() * s[..., None], k))
         * w[..., None]).sum(1)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
