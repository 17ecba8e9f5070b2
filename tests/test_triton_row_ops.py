"""The Triton backend's row ops ``rope``, ``index_q_fp8`` and ``rms_norm``
(cpkv_backend_triton.rope / quant / norm) against the torch reference through the conformance
suite, kernels that skip a step failing it, and the model's rotations through the rope kernel.

Without CUDA the kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here only
around the import and for this module's tests); with CUDA the interpreter tests skip and the
``gpu`` ones run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import cpkv.testing.conformance as conf
from cpkv.contracts import Op, OpDeclined
from cpkv.models import load_model, write_tiny_checkpoint
from cpkv.ops import hadamard_rotate, quantize_index_q
from triton_interp import assert_op_mixed_in, import_kernels, interp

RopeKernels = import_kernels("cpkv_backend_triton.rope", "_rope_kernel").RopeKernels
QuantKernels = import_kernels("cpkv_backend_triton.quant", "_index_q_kernel").QuantKernels
NormKernels = import_kernels("cpkv_backend_triton.norm", "_rms_norm_kernel").NormKernels

#: each op's part of ``TritonOps``
PARTS = {Op.ROPE: RopeKernels, Op.INDEX_Q_FP8: QuantKernels, Op.RMS_NORM: NormKernels}

pytestmark = pytest.mark.usefixtures("triton_interpreter")


@pytest.mark.parametrize("op", list(PARTS))
def test_op_declared_and_mixed_in(op: Op) -> None:
    assert_op_mixed_in(op)


@interp
@pytest.mark.parametrize("op", list(PARTS))
def test_conformance_interpreter(ref: Any, op: Op) -> None:
    conf.check_op(PARTS[op](), ref, op.value, device="cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(PARTS))
def test_conformance_gpu(ref: Any, op: Op) -> None:
    conf.check_op(PARTS[op](), ref, op.value, device="cuda")


def test_rope_bad_inputs_raise_value_error() -> None:
    impl = RopeKernels()
    x, c = torch.zeros(3, 2, 8), torch.zeros(3, 8)
    with pytest.raises(ValueError, match="style"):
        impl.rope(x, c, c, "neox")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cos"):
        impl.rope(x, torch.zeros(3, 6), c, "half")
    with pytest.raises(ValueError, match="R even"):
        impl.rope(torch.zeros(3, 7), torch.zeros(3, 7), torch.zeros(3, 7), "half")
    with pytest.raises(ValueError, match="out must be"):
        impl.rope(x, c, c, "half", torch.zeros(3, 2, 8, dtype=torch.float64))


def test_index_q_bad_inputs_raise_value_error() -> None:
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


def test_index_q_small_head_dim_rotation_declined() -> None:
    with pytest.raises(OpDeclined, match="head dim 8"):
        QuantKernels().index_q_fp8(torch.randn(2, 2, 8), torch.ones(2, 2), True)


def test_rms_norm_bad_inputs_raise_value_error() -> None:
    with pytest.raises(ValueError, match="unit column stride"):
        NormKernels().rms_norm(torch.zeros(4, 8).t(), torch.zeros(4), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        NormKernels().rms_norm(torch.zeros(4, 8), torch.zeros(8, dtype=torch.float64), 1e-6)


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


@interp
def test_a_norm_without_its_weight_fails_the_check(ref: Any) -> None:
    class Unweighted:
        def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
            return ref.rms_norm(x, torch.ones_like(w), eps)

    with pytest.raises(AssertionError, match="rms_norm"):
        conf.check_op(Unweighted(), ref, "rms_norm", device="cpu")


@pytest.mark.gpu
def test_index_q_deepseek_shape_gpu() -> None:
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


def _attention_inputs_agree(device: str, dtype: torch.dtype, tmp: Path, rel: float,
                            arch: str = "v32") -> None:
    """The model's four rotations through the kernel equal its reference path within ``rel`` of
    each tensor's largest value (fp32: summation order; bf16: one rounding instead of three);
    ``arch="glm5"``: GLM-5's indexer rotates interleaved pairs (DeepSeek-V3.2: half-split)."""
    from cpkv.models.tiny import ARCHS

    m = load_model(str(write_tiny_checkpoint(tmp / "ckpt", seed=5, **ARCHS[arch])),
                   device=device, dtype=dtype)
    assert m.config.index_rope == ("interleave" if arch == "glm5" else "half")
    g = torch.Generator().manual_seed(0)
    n = 19
    x = torch.randn(n, m.config.hidden_size, generator=g).to(device, dtype)
    pos = torch.randint(0, 4000, (n,), generator=g).to(device)
    rope = m.rope_cos_sin(pos, m.dtype)
    want = m.attention_inputs(0, x, pos, rope)
    got = m.attention_inputs(0, x, pos, rope, RopeKernels().rope)
    for name in ("q", "latent", "index_q", "index_k"):
        a, b = getattr(got, name).float(), getattr(want, name).float()
        err = float((a - b).abs().max() / b.abs().max())
        assert err <= rel, f"{name}: {err:.3g} of its largest value"


@interp
@pytest.mark.parametrize("arch", ["v32", "glm5"])
def test_model_rotations_through_the_kernel(tmp_path: Path, arch: str) -> None:
    _attention_inputs_agree("cpu", torch.float32, tmp_path, 1e-6, arch)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["v32", "glm5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_rotations_through_the_kernel_gpu(tmp_path: Path, dtype: torch.dtype,
                                                arch: str) -> None:
    _attention_inputs_agree("cuda", dtype, tmp_path, 1e-6 if dtype == torch.float32 else 1.6e-2,
                            arch)
