"""The ``cuda`` backend: FlashMLA's sparse MLA prefill, its probe's reasons, and calls it
declines going to the next backend of the preference."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from cpkv.contracts import FallbackReason, Op, OpDeclined
from cpkv.fallback import recording
from cpkv.plugin import PluginHost

cuda_backend = pytest.importorskip("cpkv_backend_cuda.plugin")


def _available() -> tuple[bool, str]:
    av = cuda_backend.probe()
    return av.available, av.reason


def test_probe_names_the_reason_and_load_refuses_without_it() -> None:
    ok, why = _available()
    if ok:
        pytest.skip("the cuda backend can run here")
    assert why and ("CUDA" in why or "compute capability" in why or "flash_mla" in why)
    with pytest.raises(RuntimeError, match="cannot be loaded"):
        cuda_backend.load()


def test_calls_the_kernel_cannot_take_are_declined_before_any_work() -> None:
    from cpkv_backend_cuda.flashmla import FlashMLAOps, decline_reason

    called: list[Any] = []
    ops = FlashMLAOps(types.SimpleNamespace(flash_mla_sparse_fwd=lambda *a, **k: called.append(a)))
    q = torch.zeros(4, 128, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 576, dtype=torch.bfloat16)
    ind = torch.zeros(4, 64, dtype=torch.int32)
    with pytest.raises(OpDeclined, match="needs CUDA tensors"):
        ops.sparse_mla(q, kv, ind, 0.1, 512)
    assert called == []
    assert decline_reason(q[:, :16], kv, ind, 512) == "16 heads (FlashMLA's sparse prefill takes 64 or 128)"
    assert decline_reason(q, kv, ind, 256) == "head dims 576/256 (FlashMLA takes 576/512)"
    assert "q torch.float32" in (decline_reason(q.float(), kv, ind, 512) or "")
    assert decline_reason(q, kv, ind[:, :16], 512) == "top-k 16 (FlashMLA takes a multiple of 64)"
    assert "needs CUDA tensors" in (decline_reason(q[:, :64], kv, ind, 512) or "")


def test_v4_calls_the_kernel_cannot_take_are_declined_before_any_work() -> None:
    from cpkv_backend_cuda.flashmla import FlashMLAOps, v4_decline_reason

    called: list[Any] = []
    ops = FlashMLAOps(types.SimpleNamespace(flash_mla_sparse_fwd=lambda *a, **k: called.append(a)))
    q = torch.zeros(4, 64, 512, dtype=torch.bfloat16)
    kv = torch.zeros(10, 512, dtype=torch.bfloat16)
    ind = torch.zeros(4, 9, dtype=torch.int64)
    sink = torch.zeros(64)
    with pytest.raises(OpDeclined, match="needs CUDA tensors"):
        ops.v4_attention(q, kv, ind, sink, 0.1)
    assert called == []
    assert v4_decline_reason(q[:, :16], kv, ind) == ("16 heads (FlashMLA's V4 sparse prefill "
                                                     "takes 64 or 128)")
    assert v4_decline_reason(q[..., :256], kv[:, :256], ind) == (
        "head dim 256 (FlashMLA's V4 sparse prefill takes 512)")
    assert "q torch.float32" in (v4_decline_reason(q.float(), kv.float(), ind) or "")
    with pytest.raises(ValueError, match="indices int32 / int64"):
        ops.v4_attention(q, kv, ind.float(), sink, 0.1)


needs_flashmla = pytest.mark.skipif(not _available()[0], reason=_available()[1] or "available")


def _ref() -> Any:
    from cpkv_backend_torch.ops import TorchOps

    return TorchOps()


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("heads", [64, 128])
def test_flashmla_sparse_mla_equals_the_torch_reference(heads: int) -> None:
    """DeepSeek-V3.2 shapes, random keys and indices with -1 slots and one row with none: the
    FlashMLA result (bf16 precision, widened) equals the fp32 reference within bf16 rounding,
    and the empty row is zeros."""
    ops = cuda_backend.load()
    g = torch.Generator(device="cuda").manual_seed(heads)
    n, t, k = 192, 8192, 2048
    q = torch.randn(n, heads, 576, dtype=torch.bfloat16, device="cuda", generator=g)
    kv = torch.randn(t, 576, dtype=torch.bfloat16, device="cuda", generator=g)
    ind = torch.randint(0, t, (n, k), dtype=torch.int32, device="cuda", generator=g)
    ind[::3, k // 2:] = -1
    ind[5] = -1
    got = ops.sparse_mla(q, kv, ind, 576 ** -0.5, 512)
    want = torch.cat([_ref().sparse_mla(q[s:s + 32], kv, ind[s:s + 32], 576 ** -0.5, 512)
                      for s in range(0, n, 32)])
    assert got.dtype == torch.bfloat16 and got.shape == (n, heads, 512)  # the kernel's dtype
    assert torch.equal(got[5], torch.zeros_like(got[5]))
    err = ((got.float() - want).abs().amax() / want.abs().amax()).item()
    assert err < 1e-2, err


@pytest.mark.gpu
@needs_flashmla
def test_a_declined_call_runs_on_the_next_backend() -> None:
    from cpkv.ops import OpTable

    host = PluginHost()
    try:
        table = OpTable.resolve(host.backends(), ["cuda", "triton", "torch"], [Op.SPARSE_MLA])
    finally:
        host.close()
    assert table.chosen["sparse_mla"] == "cuda"
    q = torch.randn(8, 16, 576, dtype=torch.bfloat16, device="cuda")  # 16 heads: declined
    kv = torch.randn(300, 576, dtype=torch.bfloat16, device="cuda")
    ind = torch.randint(0, 300, (8, 64), dtype=torch.int32, device="cuda")
    with recording() as rec:
        for _ in range(2):
            got = table.sparse_mla(q, kv, ind, 0.05, 512)
    want = _ref().sparse_mla(q, kv, ind, 0.05, 512)
    assert ((got.float() - want).abs().amax() / want.abs().amax()).item() < 1e-2
    assert [(e.requested, e.selected, e.reason) for e in rec.events] == [
        ("cuda", "triton", FallbackReason.OP_DECLINED)]
    assert "16 heads" in rec.events[0].detail


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize(("heads", "k"), [(64, 640), (128, 200)])
def test_flashmla_v4_attention_equals_the_torch_reference(heads: int, k: int) -> None:
    """DeepSeek-V4 shapes (K = V of 512, a sink per head): window-and-entry indices with -1
    slots (a slot count off the kernel's block of 64 included) and one row with none: the
    FlashMLA result equals the torch backend's fp32 one within bf16 rounding; the empty row
    is zeros."""
    from cpkv_backend_torch.v4 import V4TorchOps

    ops = cuda_backend.load()
    g = torch.Generator(device="cuda").manual_seed(heads)
    n, s = 256, 16384
    q = torch.randn(n, heads, 512, dtype=torch.bfloat16, device="cuda", generator=g)
    kv = torch.randn(s, 512, dtype=torch.bfloat16, device="cuda", generator=g)
    ind = torch.randint(0, s, (n, k), device="cuda", generator=g)
    ind[::3, k // 2:] = -1
    ind[7] = -1
    sink = torch.randn(heads, device="cuda", generator=g)
    got = ops.v4_attention(q, kv, ind, sink, 512 ** -0.5)
    want = V4TorchOps().v4_attention(q.float(), kv.float(), ind, sink, 512 ** -0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (n, heads, 512)
    assert torch.equal(got[7], torch.zeros_like(got[7]))
    err = ((got.float() - want).abs().amax() / want.abs().amax()).item()
    assert err < 1e-2, err


def _paged_case(n: int, heads: int, pages: int, k: int, device: str,
                seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]:
    """q, part-major fp8 pages (DeepSeek-V3.2 format) packed by the torch reference, and token
    rows with -1 slots and one empty row."""
    from cpkv.contracts import KVFormat

    fmt = KVFormat.deepseek_v32("fp8")
    ps, nl = fmt.page_size, fmt.latent_bytes_per_token
    g = torch.Generator().manual_seed(seed)
    lat = _ref().fp8_pack(torch.randn(pages * ps, 576, generator=g), fmt, "latent")
    idx = _ref().fp8_pack(torch.randn(pages * ps, 128, generator=g), fmt, "index_k")
    buf = torch.cat([lat.view(pages, ps * nl), idx.view(pages, -1)], 1).view(pages, ps, -1)
    rows = torch.randint(0, pages * ps, (n, k), dtype=torch.int32, generator=g)
    rows[::3, k // 2:] = -1
    rows[min(1, n - 1)] = -1
    q = torch.randn(n, heads, 576, generator=g).to(torch.bfloat16)
    return q.to(device), buf.contiguous().to(device), rows.to(device), fmt


def test_paged_calls_the_decode_kernel_cannot_take_are_declined() -> None:
    from cpkv.contracts import KVFormat
    from cpkv_backend_cuda.flashmla import FlashMLAOps, decode_decline_reason

    ops = FlashMLAOps(types.SimpleNamespace())
    q, pages, rows, fmt = _paged_case(3, 128, 4, 64, "cpu", 1)
    with pytest.raises(OpDeclined, match="needs CUDA tensors"):
        ops.sparse_mla_paged(q, pages, rows, fmt, 0.1, 512)
    bf16 = KVFormat.deepseek_v32("bf16")
    assert "bf16 pool" in (decode_decline_reason(q, pages, rows, bf16, 512) or "")
    assert "16 heads" in (decode_decline_reason(q[:, :16], pages, rows, fmt, 512) or "")
    assert "top-k 16" in (decode_decline_reason(q, pages, rows[:, :16], fmt, 512) or "")


@pytest.mark.gpu
@needs_flashmla
@pytest.mark.parametrize("heads", [64, 128])
def test_flashmla_decode_reads_part_major_pages_like_the_reference(heads: int) -> None:
    """FlashMLA's fp8 sparse decode over part-major pages (read in place, block stride = a
    page) equals the torch reference (the same rows dequantized, fp32 sparse MLA) within bf16
    rounding; the empty row is zeros."""
    ops = cuda_backend.load()
    q, pages, rows, fmt = _paged_case(24, heads, 96, 2048, "cuda", heads)
    got = ops.sparse_mla_paged(q, pages, rows, fmt, 576 ** -0.5, 512)
    want = _ref().sparse_mla_paged(q, pages, rows, fmt, 576 ** -0.5, 512)
    assert got.shape == (24, heads, 512)
    assert torch.equal(got[1].float(), torch.zeros_like(got[1].float()))
    err = ((got.float() - want).abs().amax() / want.abs().amax()).item()
    assert err < 2e-2, err
