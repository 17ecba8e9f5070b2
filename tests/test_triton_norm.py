"""The Triton ``rms_norm`` kernel (cpkv_backend_triton.norm) against the torch reference through
the conformance suite (the CPU interpreter here, the GPU where there is one), and a kernel that
skips the weight failing it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import cpkv.testing.conformance as conf
from cpkv.contracts import Op
from triton_interp import assert_op_mixed_in, import_kernels, interp

NormKernels = import_kernels("cpkv_backend_triton.norm", "_rms_norm_kernel").NormKernels


pytestmark = pytest.mark.usefixtures("triton_interpreter")


def test_op_declared_and_mixed_in() -> None:
    assert_op_mixed_in(Op.RMS_NORM)


def test_bad_inputs_raise_value_error() -> None:
    with pytest.raises(ValueError, match="unit column stride"):
        NormKernels().rms_norm(torch.zeros(4, 8).t(), torch.zeros(4), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        NormKernels().rms_norm(torch.zeros(4, 8), torch.zeros(8, dtype=torch.float64), 1e-6)


@interp
def test_conformance_interpreter(ref: Any) -> None:
    conf.check_op(NormKernels(), ref, "rms_norm", device="cpu")


@interp
def test_a_norm_without_its_weight_fails_the_check(ref: Any) -> None:
    class Unweighted:
        def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
            return ref.rms_norm(x, torch.ones_like(w), eps)

    with pytest.raises(AssertionError, match="rms_norm"):
        conf.check_op(Unweighted(), ref, "rms_norm", device="cpu")


@pytest.mark.gpu
def test_conformance_gpu(ref: Any) -> None:
    conf.check_op(NormKernels(), ref, "rms_norm", device="cuda")
