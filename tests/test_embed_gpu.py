"""Issue 37 on one H200: the field's kernels read pages cpkv wrote in the engines' two-part
layout, in place (DeepGEMM's ``fp8_fp4_paged_mqa_logits`` on the index-K tensor, FlashMLA's fp8
sparse decode on the latent tensor), each equal to the torch reference over the same rows in
cpkv's part-major pool; and the engine example on CUDA, CP1 and CP2 (two ranks sharing the GPU,
Gloo collectives), with the default backends.

The layout halves of these tests (``*_layout_on_cpu``) run anywhere: the reference reading the
two-part tensors equals the reference reading the part-major pool, so the GPU tests compare the
kernels with a reference whose input is already checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpkv.contracts import KVFormat
from cpkv.embed import KVBufferSpec, write_rows
from cpkv.ops.api import quantize_index_q
from cpkv.testing.conformance import FP8_DOT_REL, reference_backend
from helpers import run_engine_example

DS = KVFormat.deepseek_v32("fp8")
PS = DS.page_size
CUDA = torch.cuda.is_available()


def _written(pages: int, seed: int, device: str = "cpu") -> tuple[KVBufferSpec, KVBufferSpec]:
    """The same fp8 rows (packed by the reference) written through cpkv into a two-part spec
    (the engines' layout) and a part-major one (cpkv's decode pool)."""
    ref = reference_backend()
    g = torch.Generator().manual_seed(seed)
    lat = ref.fp8_pack(torch.randn(pages * PS, 576, generator=g), DS, "latent")
    idx = ref.fp8_pack(torch.randn(pages * PS, 128, generator=g), DS, "index_k")
    rows = torch.randperm(pages * PS, generator=g)  # written in a random order
    two = KVBufferSpec.allocate(DS, 1, pages, "two_part", device=device)
    part = KVBufferSpec.allocate(DS, 1, pages, "part_major", device=device)
    for spec in (two, part):
        write_rows(spec, 0, rows.to(device), lat[rows].to(device), idx[rows].to(device))
    return two, part


def _indexer_case(requests: int, m: int, spare: int, heads: int, seed: int
                  ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(requests * m + spare, generator=g)[:requests * m]
    table = table.reshape(requests, m).to(torch.int32)
    lengths = torch.tensor([1, 2 * 64 + 33, 3 * 64, m * 64])[:requests]
    row_request = torch.arange(requests, dtype=torch.int32).repeat_interleave(2)
    key_end = (lengths.repeat_interleave(2) - torch.tensor([1, 0]).repeat(requests)).clamp_min(1)
    n = row_request.numel()
    q = torch.randn(n, heads, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(n, heads, generator=g) * (heads ** -0.5 * 128 ** -0.5)
    q8, w8 = quantize_index_q(q, w)
    return q8, w8, table, row_request, key_end.to(torch.int64)


def _latent_case(n: int, heads: int, k: int, pages: int, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, pages * PS, (n, k), dtype=torch.int32, generator=g)
    rows[::3, k // 2:] = -1
    q = torch.randn(n, heads, 576, generator=g).to(torch.bfloat16)
    return q, rows


def test_two_part_tensors_hold_what_the_reference_reads_layout_on_cpu() -> None:
    """DeepGEMM's index pages are the two-part index-K tensor byte for byte; the reference's
    sparse decode over the two-part latent tensor (a latent-only page format) equals it over the
    part-major pool."""
    from cpkv_backend_cuda import deepgemm

    two, part = _written(12, 1)
    pm, ik, lt = part.layers[0].kv, two.layers[0].index_k, two.layers[0].latent
    assert pm is not None and ik is not None and lt is not None
    assert torch.equal(deepgemm.part_major_index_pages(pm, DS.latent_bytes_per_token), ik)
    ref = reference_backend()
    q, rows = _latent_case(6, 16, 64, 12, 2)
    want = ref.sparse_mla_paged(q.float(), pm, rows, DS, 576 ** -0.5, 512)
    got = ref.sparse_mla_paged(q.float(), lt, rows, DS.latent_only(), 576 ** -0.5, 512)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [32, 64])
def test_deepgemm_paged_indexer_reads_the_two_part_index_k_in_place(heads: int) -> None:
    from cpkv_backend_cuda import plugin

    if not plugin.installed(plugin.DEEP_GEMM) or not plugin.probe().available:
        pytest.skip("deep_gemm is not installed or the cuda backend cannot run here")
    requests, m, spare = 4, 5, 3
    two, part = _written(requests * m + spare, heads, "cuda")
    q8, w8, table, row_request, key_end = _indexer_case(requests, m, spare, heads, heads)
    pm, ik = part.layers[0].kv, two.layers[0].index_k
    assert pm is not None and ik is not None
    want = reference_backend().indexer_logits_paged(q8, w8, pm.cpu(), DS, table, row_request,
                                                    key_end)
    ptr = ik.data_ptr()
    got = plugin.deepgemm_ops().indexer_logits_index_pages(
        q8.cuda(), w8.cuda(), ik, DS, table.cuda(), row_request.cuda(), key_end.cuda()).cpu()
    assert ik.data_ptr() == ptr  # read in place: the engine's tensor itself
    assert torch.equal(got.isneginf(), want.isneginf())
    fin = want.isfinite()
    big = float(want[fin].abs().max())
    err = float((got[fin] - want[fin]).abs().max())
    assert err <= FP8_DOT_REL * big + 1e-5, (err, big)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [64, 128])
def test_flashmla_sparse_decode_reads_the_two_part_latent_in_place(heads: int) -> None:
    from cpkv_backend_cuda import plugin

    if not plugin.probe().available:
        pytest.skip(plugin.probe().reason)
    ops = plugin.load()
    pages = 48
    two, part = _written(pages, heads, "cuda")
    lt, pm = two.layers[0].latent, part.layers[0].kv
    assert lt is not None and pm is not None
    q, rows = _latent_case(16, heads, 2048, pages, heads)
    got = ops.sparse_mla_paged(q.cuda(), lt, rows.cuda(), DS.latent_only(), 576 ** -0.5, 512)
    want = reference_backend().sparse_mla_paged(q, pm.cpu(), rows, DS, 576 ** -0.5, 512)
    assert got.shape == (16, heads, 512)
    err = ((got.float().cpu() - want).abs().amax() / want.abs().amax()).item()
    assert err < 2e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [1, 2])
def test_engine_example_on_cuda_equals_prefill_session(ranks: int, tmp_path: Path) -> None:
    """CP1 and CP2 (two ranks sharing the GPU, Gloo collectives), default backends."""
    if not CUDA:
        pytest.skip("no CUDA device")
    out = run_engine_example(ranks, tmp_path, "--device", "cuda", "--backends",
                          "cuda,triton,torch")
    assert out["ok"] and out["cp"] == ranks and out["device"] == "cuda:0", out
    assert out["max_rel_diff"] <= 1e-5 and out["transfer"] and out["no_copy"]


@pytest.mark.gpu
def test_decode_write_replays_in_a_cuda_graph() -> None:
    """A decode step's ``cpkv::put_bytes`` captured once in a CUDA graph over fixed-capacity
    ``DecodeMetadata``; each replay after ``fill`` writes that step's rows (padding on the
    scratch page only), the engine's two-part tensors in place."""
    from cpkv.comm import CPGroup
    from cpkv.embed import DecodeMetadata, EngineKV, backend_ops, read_rows

    dev = torch.device("cuda", 0)
    g = CPGroup.single(dev)
    spec = KVBufferSpec.allocate(DS, 1, 12, "two_part", device=dev)
    kv = EngineKV(spec, g, backend_ops(g))
    md = DecodeMetadata(4, 3, PS, dev, pad_row=11 * PS)  # slot 11: the scratch page
    a, b = spec.layers[0].parts()
    lat = torch.zeros(4, DS.latent_bytes_per_token, dtype=torch.uint8, device=dev)
    idx = torch.zeros(4, DS.index_bytes_per_token, dtype=torch.uint8, device=dev)
    md.fill([[0]], [1])
    torch.ops.cpkv.put_bytes(a, b, md.write_rows, lat, idx, kv.handle)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.cpkv.put_bytes(a, b, md.write_rows, lat, idx, kv.handle)
    for step, (slots, lens) in enumerate((([[2], [5, 6]], [3, 70]), ([[2], [5, 6], [8]], [4, 71, 1]))):
        md.fill(slots, lens)
        lat.fill_(step + 1)
        idx.fill_(step + 11)
        graph.replay()
        rows = md.write_rows[: md.num_requests]
        got_l, got_i = read_rows(spec, 0, rows)
        assert bool((got_l == step + 1).all()) and got_i is not None
        assert bool((got_i == step + 11).all())
    torch.cuda.synchronize()
    kv.close()
