"""The ``cuda`` backend's DeepGEMM indexer: which ops it lists, the calls it declines, the pass
that places DeepGEMM's compressed rows (interpreter on the CPU), DeepGEMM's index-K page layout,
and on an H200 with DeepGEMM the conformance suite and the paged kernel against the reference."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import torch

from cpkv.contracts import KVDtype, KVFormat, Op, OpDeclined
from cpkv.ops.api import quantize_index_q
from cpkv.testing.conformance import FP8_DOT_REL, check_op, reference_backend
from cpkv_backend_cuda import deepgemm, plugin
from triton_interp import CUDA, import_kernels, interpreter_env

place = import_kernels("cpkv_backend_cuda._place", "_place_kernel")

DEVICE = "cuda" if CUDA else "cpu"
DS = KVFormat.deepseek_v32(KVDtype.FP8)


@pytest.fixture(autouse=True)
def _interpret() -> Iterator[None]:
    with interpreter_env():
        yield


def _dg_available() -> tuple[bool, str]:
    if not plugin.installed(plugin.DEEP_GEMM):
        return False, "deep_gemm is not installed"
    av = plugin.probe()
    return av.available, av.reason


needs_deepgemm = pytest.mark.skipif(not _dg_available()[0], reason=_dg_available()[1] or "ok")


def test_the_backend_lists_the_ops_of_the_installed_libraries(monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    def only(*names: str) -> Callable[[Any], bool]:
        return lambda lib: lib.module in names

    monkeypatch.setattr(plugin, "MEASURED", {})
    assert plugin.provided_ops(only()) == frozenset()
    assert plugin.provided_ops(only("flash_mla")) == {Op.SPARSE_MLA, Op.SPARSE_MLA_PAGED,
                                                      Op.V4_ATTENTION}
    assert plugin.provided_ops(only("deep_gemm")) == {Op.INDEXER_LOGITS,
                                                      Op.INDEXER_LOGITS_INDEX_PAGES}
    monkeypatch.setitem(plugin.MEASURED, Op.INDEXER_LOGITS, "slower than triton (test)")
    monkeypatch.setitem(plugin.MEASURED, Op.INDEXER_LOGITS_INDEX_PAGES, "slower (test)")
    assert plugin.provided_ops(only("flash_mla", "deep_gemm")) == {
        Op.SPARSE_MLA, Op.SPARSE_MLA_PAGED, Op.V4_ATTENTION}


def _fp8_case(n: int, t: int, heads: int, g: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8 indexer inputs as DeepSeek-V3.2 quantizes them: random bf16 q / k (unrotated: the
    rotation does not change the kernel's arithmetic), ue8m0 keys by the reference's fp8_pack,
    queries by quantize_index_q (scales folded into the head weights)."""
    ref = reference_backend()
    q = torch.randn(n, heads, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(n, heads, generator=g) * (heads ** -0.5 * 128 ** -0.5)
    packed = ref.fp8_pack(torch.randn(t, 128, generator=g), DS, "index_k")
    k8 = packed[:, :128].contiguous().view(torch.float8_e4m3fn)
    scale = packed[:, 128:].contiguous().view(torch.float32)[:, 0]
    q8, w8 = quantize_index_q(q, w)
    return q8, w8, k8, scale


def test_calls_deepgemm_cannot_take_are_declined_before_any_work() -> None:
    called: list[Any] = []
    ops = deepgemm.DeepGEMMOps(cast(Any, types.SimpleNamespace(
        fp8_fp4_mqa_logits=lambda *a: called.append(a),
        fp8_fp4_paged_mqa_logits=lambda *a: called.append(a))))
    g = torch.Generator().manual_seed(0)
    q8, w8, k8, scale = _fp8_case(4, 64, 64, g)
    ks, ke = torch.zeros(4, dtype=torch.int64), torch.full((4,), 64, dtype=torch.int64)
    with pytest.raises(OpDeclined, match="needs CUDA tensors"):
        ops.indexer_logits(q8, w8, k8, scale, ks, ke)
    pages = deepgemm.pack_index_pages(k8, scale)
    table = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(OpDeclined, match="needs CUDA tensors"):
        ops.indexer_logits_index_pages(q8, w8, pages, DS, table,
                                       torch.zeros(4, dtype=torch.int32), ke)
    assert called == []
    bf16 = q8.to(torch.bfloat16)
    assert "fp8 queries" in (deepgemm.decline_reason(bf16, w8, k8, scale) or "")
    assert "fp8 keys" in (deepgemm.decline_reason(q8, w8, k8.to(torch.bfloat16), None) or "")
    assert "16 index heads" in (deepgemm.decline_reason(q8[:, :16], w8[:, :16], k8, scale) or "")
    assert "head dim 16" in (deepgemm.decline_reason(q8[..., :16], w8, k8[:, :16], scale) or "")


def _compressed(full: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, pad: int
                ) -> torch.Tensor:
    """``full``'s rows as DeepGEMM writes them: keys [ks, ke) from column 0, garbage after,
    rows strided (``pad`` extra columns)."""
    n, t = full.shape
    out = torch.full((n, t + pad), 12345.0, device=full.device)[:, :t]
    for i in range(n):
        a, b = int(ks[i]), int(ke[i])
        out[i, :max(b - a, 0)] = full[i, a:b]
    return out


def test_place_rows_moves_each_range_to_its_columns_and_masks_the_rest() -> None:
    """Rows starting at 0 (tail only), shifted rows shorter and longer than a block, empty and
    whole ranges, a range ending at T; random values: equal to the dense rows, -inf outside."""
    g = torch.Generator().manual_seed(3)
    t = 5 * place.PLACE_CONFIG["BLOCK"] + 77
    b = place.PLACE_CONFIG["BLOCK"]
    ks = torch.tensor([0, 0, 3, 100, b + 5, 0, t - 1, 7, 2 * b], dtype=torch.int32)
    ke = torch.tensor([10, t, 3 * b, b + 50, t, 0, t, 7, 2 * b + 1], dtype=torch.int32)
    full = torch.randn(ks.numel(), t, generator=g)
    got = _compressed(full.to(DEVICE), ks, ke, 100)
    place.place_rows(got, ks.to(DEVICE), ke.to(DEVICE))
    col = torch.arange(t)
    inside = (col >= ks[:, None].long()) & (col < ke[:, None].long())
    assert torch.equal(got.cpu(), torch.where(inside, full, float("-inf")))


def _part_major(pages: int, g: torch.Generator) -> torch.Tensor:
    ref = reference_backend()
    ps, nl = DS.page_size, DS.latent_bytes_per_token
    lat = ref.fp8_pack(torch.randn(pages * ps, 576, generator=g), DS, "latent")
    idx = ref.fp8_pack(torch.randn(pages * ps, 128, generator=g), DS, "index_k")
    return torch.cat([lat.view(pages, ps * nl), idx.view(pages, -1)], 1).view(pages, ps, -1)


def test_deepgemm_index_pages_hold_the_part_major_pools_keys() -> None:
    """A part-major fp8 page's index-K in DeepGEMM's layout: 64 x 128 values then 64 scales,
    the same bytes, and its view has DeepGEMM's strides; a row stride not a multiple of 4 is
    refused."""
    g = torch.Generator().manual_seed(5)
    pool = _part_major(3, g)
    dgp = deepgemm.part_major_index_pages(pool, DS.latent_bytes_per_token)
    assert dgp.shape == (3, 64 * 132)
    idx = pool.reshape(3, -1)[:, 64 * DS.latent_bytes_per_token:].reshape(3, 64, 132)
    assert torch.equal(dgp[:, :64 * 128].reshape(3, 64, 128), idx[..., :128])
    assert torch.equal(dgp[:, 64 * 128:].reshape(3, 64, 4), idx[..., 128:])
    k8 = idx[..., :128].reshape(-1, 128).contiguous().view(torch.float8_e4m3fn)
    sc = idx[..., 128:].reshape(-1, 4).contiguous().view(torch.float32)[:, 0]
    assert torch.equal(deepgemm.pack_index_pages(k8, sc), dgp)
    view = deepgemm.index_page_view(dgp)
    assert view.shape == (3, 64, 1, 132) and view.stride() == (64 * 132, 132, 132, 1)
    wide = torch.zeros(3, 64 * 132 + 2, dtype=torch.uint8)[:, :64 * 132]
    with pytest.raises(ValueError, match="multiple of 4"):
        deepgemm.index_page_view(wide)


class _DeepGEMMFirst:
    """``indexer_logits`` on DeepGEMM, a declined call on the Triton backend (as the op table
    does); counts the calls DeepGEMM took."""

    def __init__(self, dg: Any, nxt: Any) -> None:
        self.dg, self.nxt, self.taken = dg, nxt, 0

    def indexer_logits(self, *args: Any) -> torch.Tensor:
        try:
            out: torch.Tensor = self.dg.indexer_logits(*args)
        except OpDeclined:
            return self.nxt.indexer_logits(*args)  # type: ignore[no-any-return]
        self.taken += 1
        return out


@pytest.mark.gpu
@needs_deepgemm
def test_deepgemm_indexer_passes_the_conformance_suite() -> None:
    """The suite's indexer cases (arbitrary key ranges, several requests, the fp8 indexer's
    top-k choice): DeepGEMM takes the 64-head fp8 x fp8 ones, Triton the rest."""
    from cpkv.plugin import PluginHost

    host = PluginHost()
    try:
        triton_ops = host.backends().load("triton")
    finally:
        host.close()
    impl = _DeepGEMMFirst(plugin.deepgemm_ops(), triton_ops)
    check_op(impl, reference_backend(), "indexer_logits", device="cuda")
    assert impl.taken >= 10


@pytest.mark.gpu
@needs_deepgemm
@pytest.mark.parametrize("heads", [32, 64])
def test_deepgemm_paged_indexer_over_its_pages_equals_the_reference(heads: int) -> None:
    """The same keys as part-major pool pages (the reference's paged op) and as DeepGEMM's
    index pages: random block tables over a pool with spare pages, several rows per request,
    key_end at 1, inside a page, on a boundary, at M x 64; fp8 tolerance, -inf exactly past
    key_end."""
    g = torch.Generator().manual_seed(heads)
    ref = reference_backend()
    requests, m, per, spare = 5, 6, 2, 4
    pool = _part_major(requests * m + spare, g)
    table = torch.randperm(requests * m + spare, generator=g)[:requests * m]
    table = table.reshape(requests, m).to(torch.int32)
    last = 1 + int(torch.randint(0, m * 64, (1,), generator=g))
    lengths = torch.tensor([1, 5 * 64 + 33, 3 * 64, m * 64, last])
    row_request = torch.arange(requests, dtype=torch.int32).repeat_interleave(per)
    offset = torch.arange(per).repeat(requests) - (per - 1)  # each request's last row: 0
    key_end = (lengths.repeat_interleave(per) + offset).clamp_min(0).to(torch.int64)
    n = row_request.numel()
    q = torch.randn(n, heads, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(n, heads, generator=g) * (heads ** -0.5 * 128 ** -0.5)
    q8, w8 = quantize_index_q(q, w)
    want = ref.indexer_logits_paged(q8, w8, pool, DS, table, row_request, key_end)
    dgp = deepgemm.part_major_index_pages(pool, DS.latent_bytes_per_token)
    # the pages as rows of a wider buffer (a pool's page stride), poisoned around them
    buf = torch.full((dgp.shape[0], dgp.shape[1] + 64), 0x7F, dtype=torch.uint8)
    buf[:, :dgp.shape[1]] = dgp
    got = plugin.deepgemm_ops().indexer_logits_index_pages(
        q8.cuda(), w8.cuda(), buf[:, :dgp.shape[1]].cuda(), DS, table.cuda(), row_request.cuda(),
        key_end.cuda()).cpu()
    assert got.shape == want.shape
    assert torch.equal(got.isneginf(), want.isneginf())
    fin = want.isfinite()
    big = float(want[fin].abs().max())
    err = float((got[fin] - want[fin]).abs().max())
    assert err <= FP8_DOT_REL * big + 1e-5, (err, big)
