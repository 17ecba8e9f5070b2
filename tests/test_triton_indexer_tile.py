"""The indexer tile's signed-half split (cpkv_backend_triton.indexer_tile, the ``ABS_PARTS`` head
sum): the query parts hold ``sum_h w_h q_h`` to ~2^(-4 parts), the row-tile indexer with three
parts passes the conformance suite's fp8-query bound, and with one part (2^-4) it does not (the
bound would catch a split too coarse for the model's numerics).

Without CUDA the kernels run in Triton's CPU interpreter; with CUDA the ``gpu`` test runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import cpkv.testing.conformance as conf
from triton_interp import CUDA, import_kernels, interp

tile = import_kernels("cpkv_backend_triton.indexer_tile", "_split_kernel")
attention = import_kernels("cpkv_backend_triton.attention", "_indexer_kernel")

pytestmark = pytest.mark.usefixtures("triton_interpreter")
DEVICE = "cuda" if CUDA else "cpu"


def _fp8_queries(n: int, heads: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, heads, d, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = torch.randn(n, heads, generator=g) * torch.exp2(torch.randint(-12, 4, (n, 1),
                                                                    generator=g).float())
    return q.to(DEVICE), w.to(DEVICE)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_split_holds_the_weighted_query_sum(parts: int) -> None:
    q, w = _fp8_queries(37, 8, 128, seed=parts)
    w[5] = 0  # a row whose sum is zero: zero parts, a finite scale
    qw, sh, w2 = tile.split_queries(q, w, parts)
    want = torch.einsum("nh,nhd->nd", w.double(), q.double())
    got = (qw.double() * 2 * sh.double()[:, None, None]).sum(1)
    assert torch.equal(w2, w * 0.5)
    assert bool(sh.isfinite().all()) and bool((sh > 0).all())
    assert not bool(qw[5].float().any())
    amax = want.abs().amax(1, keepdim=True)
    # each part rounds what the others left (2^-4 of it), or sits on the subnormal grid
    # (2^-10 of the scale, 448 scales above the row's largest |qw| at most twice)
    bound = want.abs() * 2.0 ** (-4 * parts) + amax * 2.0 ** -10 / 448 * 2
    assert bool(((got - want).abs() <= bound).all()), float(((got - want).abs() - bound).max())
    if parts > 1:  # the parts do better than one rounding
        one = (qw[:, :1].double() * 2 * sh.double()[:, None, None]).sum(1)
        assert float((got - want).abs().max()) < float((one - want).abs().max())


@pytest.mark.slow  # ~25 s in the interpreter: the suite's indexer sizes
@interp
def test_three_parts_pass_the_conformance_suite(ref: Any) -> None:
    impl = attention.AttentionKernels(indexer_config={"ABS_PARTS": 3})
    conf.check_op(impl, ref, "indexer_logits", device="cpu")


@pytest.mark.slow  # ~25 s in the interpreter
@interp
def test_one_part_fails_the_fp8_query_bound(ref: Any) -> None:
    impl = attention.AttentionKernels(indexer_config={"ABS_PARTS": 1})
    with pytest.raises(AssertionError, match=r"fp8 q.*beyond"):
        conf.check_op(impl, ref, "indexer_logits", device="cpu")


@pytest.mark.gpu
def test_three_parts_conform_on_the_gpu(ref: Any) -> None:
    """Three parts pass on sm90 (two did not on an H100, session 20: the fp8 accumulations of
    the signed half and the heads leave ~1e-3 of the largest logit, docs/perf.md)."""
    impl = attention.AttentionKernels(indexer_config={"ABS_PARTS": 3})
    conf.check_op(impl, ref, "indexer_logits", device="cuda")
