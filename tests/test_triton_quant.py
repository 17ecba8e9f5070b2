"""The Triton ``index_q_fp8`` kernel (cpkv_backend_triton.quant) against the torch reference
through the conformance suite, and the model's fp8 index queries through it.

Without CUDA the kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here only
around the import and for this module's tests, as in test_triton_rope.py); with CUDA the
interpreter tests skip and the ``gpu`` ones run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import cpkv.testing.conformance as conf
from cpkv.contracts import Op
from cpkv.ops import hadamard_rotate, quantize_index_q
from triton_interp import assert_op_mixed_in, import_kernels, interp

quant_mod = import_kernels("cpkv_backend_triton.quant", "_index_q_kernel")
QuantKernels = quant_mod.QuantKernels


pytestmark = pytest.mark.usefixtures("triton_interpreter")


def test_op_declared_and_mixed_in() -> None:
    assert_op_mixed_in(Op.INDEX_Q_FP8)


def test_bad_inputs_raise_value_error() -> None:
    impl = QuantKernels()
    q, w = torch.zeros(3, 2, 128), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="float32"):
        impl.index_q_fp8(q, w.double(), True)
    with pytest.raises(ValueError, match=r"float \[N, H, D\]"):
        impl.index_q_fp8(q[0], w, True)
    with pytest.raises(ValueError, match="power-of-two"):
        impl.index_q_fp8(torch.zeros(3, 2, 96), w, True)
    with pytest.raises(ValueError, match="block"):
        QuantKernels(block=8)


def test_small_head_dim_rotation_declined() -> None:
    from cpkv.contracts import OpDeclined

    with pytest.raises(OpDeclined, match="head dim 8"):
        QuantKernels().index_q_fp8(torch.randn(2, 2, 8), torch.ones(2, 2), True)


@interp
def test_conformance_interpreter(ref: Any) -> None:
    conf.check_op(QuantKernels(), ref, "index_q_fp8", device="cpu")


@interp
def test_a_wrong_rotation_fails_the_check(ref: Any) -> None:
    """The suite catches a kernel that skips the rotation's D^-1/2 (codes all off)."""
    class Unscaled:
        def index_q_fp8(self, q: torch.Tensor, w: torch.Tensor, rotate: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
            x = hadamard_rotate(q) * q.shape[-1] ** 0.5 if rotate else q
            return quantize_index_q(x.to(q.dtype), w)

    with pytest.raises(AssertionError, match="rotate=True"):
        conf.check_op(Unscaled(), ref, "index_q_fp8", device="cpu")


@pytest.mark.gpu
def test_conformance_gpu(ref: Any) -> None:
    conf.check_op(QuantKernels(), ref, "index_q_fp8", device="cuda")


@pytest.mark.gpu
def test_deepseek_shape_gpu() -> None:
    """64 rows x 64 heads x 128 bf16 (a decode step): the reference's codes and scales on all
    but a few elements."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(64, 64, 128, generator=g).to("cuda", torch.bfloat16)
    w = torch.randn(64, 64, generator=g).to("cuda")
    got, gw = QuantKernels().index_q_fp8(q, w, True)
    want, ww = quantize_index_q(hadamard_rotate(q), w)
    same = (got.view(torch.uint8) == want.view(torch.uint8)).float().mean().item()
    assert same >= conf.INDEX_Q_SAME_CODES
    assert (gw == ww).float().mean().item() >= conf.INDEX_Q_SAME_CODES
