"""DeepSeek-V4's ops behind the registry: a run that asks for the Triton or CUDA backend gets
the ``v4_*`` ops from torch, as a reported fallback; a model without an op table says how to
bind one; each op's row is the same bit for bit whatever else the call holds (other rows, more
entries, masked keys past the row's), which makes CP == one rank and chunked == one piece."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from cpkv.contracts import Availability, FallbackReason, Op, PluginKind
from cpkv.models.deepseek_v4 import DeepseekV4
from cpkv.models.tiny import write_tiny_checkpoint
from cpkv.models.v4_reference import reference_forward
from cpkv.ops import V4_OPS, OpTable, v4_op_table
from cpkv.ops.api import OpMethods
from cpkv.plugin import BackendRegistry, PluginHost
from cpkv.testing.conformance import check_backend, reference_backend


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v4ops") / "tiny", seed=3,
                                 model_type="deepseek_v4")


def _gpu_registry() -> BackendRegistry:
    """The discovered backends, with Triton and CUDA available as on a GPU host (their real
    op lists; loading one gives stand-ins of its ops that are never called here)."""
    host = PluginHost()
    try:
        specs = host.backends().specs
    finally:
        host.close()

    def stand_in(ops: frozenset[str]) -> Any:
        return lambda: OpMethods({Op(o): (lambda *a: None) for o in ops})

    return BackendRegistry(PluginKind.BACKEND, [
        dataclasses.replace(s, probe=Availability.yes, device_types=None,
                            load=stand_in(frozenset(o.value if isinstance(o, Op) else o
                                                    for o in s.ops)))
        if n in ("triton", "cuda") else s for n, s in specs.items()])


def test_triton_and_cuda_pass_v4_ops_to_torch_visibly(tiny_v4: Path) -> None:
    """Triton provides the fused indexer top-k (``v4_index_topk``, on its V3.2 indexer) and
    CUDA, where FlashMLA is installed, the attention; every other ``v4_*`` op goes to torch,
    in one reported fallback naming each."""
    from cpkv_backend_cuda.plugin import FLASH_MLA, installed

    with capture_logs() as logs:
        table = OpTable.resolve(_gpu_registry(), ["cuda", "triton", "torch"], V4_OPS)
    cuda = {Op.V4_ATTENTION} if installed(FLASH_MLA) else set()
    want = {o.value: "cuda" if o in cuda else "triton" if o is Op.V4_INDEX_TOPK else "torch"
            for o in V4_OPS}
    assert table.chosen == want
    events = [e for e in logs if e.get("event") == "cpkv.fallback"]
    assert {(e["requested"], e["selected"], e["reason"]) for e in events} == {
        ("cuda", b, FallbackReason.OP_NOT_PROVIDED) for b in set(want.values()) - {"cuda"}}
    to_torch = next(e for e in events if e["selected"] == "torch")
    for op in V4_OPS:
        if want[op.value] == "torch":
            assert f"cuda: does not provide {op.value}" in to_torch["detail"]
            assert f"triton: does not provide {op.value}" in to_torch["detail"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU's fallback to torch")
def test_the_model_runs_on_a_table_of_passed_over_ops_as_on_torch(tiny_v4: Path) -> None:
    """On a host without a GPU a run that asks for cuda gets every ``v4_*`` op from torch (a
    reported fallback) and computes exactly what torch's table does."""
    ids = torch.randint(0, 256, (29,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = reference_forward(DeepseekV4.load(tiny_v4, ops=v4_op_table(("cuda", "torch"))),
                                ids)
        want = reference_forward(DeepseekV4.load(tiny_v4, ops=v4_op_table()), ids)
    assert torch.equal(got, want)


def test_a_model_without_ops_says_how_to_bind_them(tiny_v4: Path) -> None:
    model = DeepseekV4.load(tiny_v4)
    with pytest.raises(RuntimeError, match="bind_ops"):
        model.topk(torch.zeros(1, 3), 2)
    model.bind_ops(v4_op_table())
    assert model.topk(torch.tensor([[1.0, 3.0, 3.0]]), 2).tolist() == [[1, 2]]


def test_conformance_covers_the_v4_ops() -> None:
    ref = reference_backend()
    names = [o.value for o in V4_OPS]
    assert check_backend(ref, ref, ops=names) == names


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(0, 300), st.integers(0, 40), st.integers(0, 2**31))
def test_attention_rows_do_not_depend_on_the_rest_of_the_call(rows: int, keys: int, extra: int,
                                                              seed: int) -> None:
    """A row's result: the same with trailing -1 slots (a longer chunk's future entries), a
    longer buffer, or alone; and the softmax with the sink over the gathered keys."""
    ops = reference_backend()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 4, 32, generator=g)
    kv = torch.randn(keys + 7, 32, generator=g)
    idx = torch.randint(0, keys + 7, (rows, keys + extra), generator=g)
    idx[torch.rand(rows, keys + extra, generator=g) >= 0.8] = -1
    idx[:, keys:] = -1
    sink = torch.randn(4, generator=g)
    whole = ops.v4_attention(q, kv, idx, sink, 0.2)
    assert torch.equal(whole, ops.v4_attention(q, kv, idx[:, :keys], sink, 0.2))
    longer = torch.cat([kv, torch.randn(5, 32, generator=g)])
    assert torch.equal(whole, ops.v4_attention(q, longer, idx.to(torch.int32), sink, 0.2))
    i = int(torch.randint(0, rows, (1,), generator=g))
    assert torch.equal(whole[i:i + 1], ops.v4_attention(q[i:i + 1], kv, idx[i:i + 1], sink, 0.2))
    keys_i, read = kv[idx[i].clamp(min=0)], idx[i] >= 0
    logits = torch.cat([(q[i] @ keys_i[read].T) * 0.2, sink[:, None]], dim=1).softmax(-1)
    torch.testing.assert_close(whole[i], logits[:, :-1] @ keys_i[read], rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(0, 60), st.integers(0, 30), st.integers(0, 2**31))
def test_index_scores_rows_do_not_depend_on_the_rest_of_the_call(rows: int, entries: int,
                                                                 extra: int, seed: int) -> None:
    ops = reference_backend()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 16, 16, generator=g)
    w = torch.randn(rows, 16, generator=g)
    keys = torch.randn(entries + extra, 16, generator=g)
    limit = torch.randint(0, entries + 1, (rows,), generator=g)
    whole = ops.v4_index_scores(q, w, keys, limit, 0.25)
    assert torch.equal(whole[:, :entries], ops.v4_index_scores(q, w, keys[:entries], limit, 0.25))
    assert bool(torch.isneginf(whole[:, entries:]).all())
    i = int(torch.randint(0, rows, (1,), generator=g))
    assert torch.equal(whole[i:i + 1], ops.v4_index_scores(q[i:i + 1], w[i:i + 1], keys,
                                                           limit[i:i + 1], 0.25))


@pytest.mark.gpu
def test_cuda_cp1_equals_the_cpu(tiny_v4: Path) -> None:
    """The same code on a GPU: a tiny V4 prefilled CP1 on cuda (the torch ops; chunked too)
    equals the CPU's within fp32 GEMM differences, argmax equal."""
    from cpkv.comm import CPGroup
    from cpkv.runtime.v4_prefill import v4_prefill_logits

    cpu = DeepseekV4.load(tiny_v4, ops=v4_op_table())
    gpu = DeepseekV4.load(tiny_v4, device="cuda", ops=v4_op_table(device_type="cuda"))
    ids = torch.randint(0, 256, (53,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = v4_prefill_logits(cpu, ids, CPGroup.single(), page_size=4)
        for chunks in (None, [16, 37]):
            got = v4_prefill_logits(gpu, ids, CPGroup.single("cuda"), page_size=4,
                                    chunks=chunks)
            assert got.device.type == "cuda"
            torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
            assert torch.equal(got.argmax(-1).cpu(), want.argmax(-1))
