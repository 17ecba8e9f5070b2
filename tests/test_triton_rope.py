"""The Triton ``rope`` kernel (cpkv_backend_triton.rope) against the torch reference through the
conformance suite, and inside the model's ``attention_inputs``.

Without CUDA the kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1``, set here only
around the import and for this module's tests, as in test_triton_attention.py); with CUDA the
interpreter tests skip and the ``gpu`` ones run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import cpkv.testing.conformance as conf
from cpkv.contracts import Op
from cpkv.models import load_model, write_tiny_checkpoint
from triton_interp import assert_op_mixed_in, import_kernels, interp

rope_mod = import_kernels("cpkv_backend_triton.rope", "_rope_kernel")
RopeKernels = rope_mod.RopeKernels


pytestmark = pytest.mark.usefixtures("triton_interpreter")


def test_op_declared_and_mixed_in() -> None:
    assert_op_mixed_in(Op.ROPE)


def test_bad_inputs_raise_value_error() -> None:
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


@interp
def test_conformance_interpreter(ref: Any) -> None:
    conf.check_op(RopeKernels(), ref, "rope", device="cpu")


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




@pytest.mark.gpu
def test_conformance_gpu(ref: Any) -> None:
    conf.check_op(RopeKernels(), ref, "rope", device="cuda")
