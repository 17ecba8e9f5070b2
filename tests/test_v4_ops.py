"""DeepSeek-V4's ops behind the registry: a run that asks for the Triton or CUDA backend gets
the ``v4_*`` ops from torch, as a reported fallback; a model without an op table says how to
bind one; each op's row is the same bit for bit whatever else the call holds (other rows, more
entries, masked keys past the row's), which makes CP == one rank and chunked == one piece."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from cpkv.contracts import Availability, FallbackReason, PluginKind
from cpkv.models.deepseek_v4 import DeepseekV4
from cpkv.models.tiny import write_tiny_checkpoint
from cpkv.models.v4_reference import reference_forward
from cpkv.ops import V4_OPS, OpTable, v4_op_table
from cpkv.plugin import BackendRegistry, PluginHost
from cpkv.testing.conformance import check_backend, reference_backend


@pytest.fixture(scope="module")
def tiny_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v4ops") / "tiny", seed=3,
                                 model_type="deepseek_v4")


def _gpu_registry() -> BackendRegistry:
    """The discovered backends, with Triton and CUDA available as on a GPU host (their real
    op lists; nothing of theirs is loaded: they provide no op asked for here)."""
    host = PluginHost()
    try:
        specs = host.backends().specs
    finally:
        host.close()
    yes = dataclasses.replace
    return BackendRegistry(PluginKind.BACKEND, [
        yes(s, probe=Availability.yes, device_types=None) if n in ("triton", "cuda") else s
        for n, s in specs.items()])


def test_triton_and_cuda_pass_v4_ops_to_torch_visibly(tiny_v4: Path) -> None:
    with capture_logs() as logs:
        table = OpTable.resolve(_gpu_registry(), ["cuda", "triton", "torch"], V4_OPS)
    assert table.chosen == {o.value: "torch" for o in V4_OPS}
    events = [e for e in logs if e.get("event") == "cpkv.fallback"]
    assert len(events) == 1, events
    ev = events[0]
    assert (ev["requested"], ev["selected"], ev["reason"]) == (
        "cuda", "torch", FallbackReason.OP_NOT_PROVIDED)
    for op in V4_OPS:
        assert f"cuda: does not provide {op.value}" in ev["detail"]
        assert f"triton: does not provide {op.value}" in ev["detail"]
    # the model runs on that table exactly as on torch's
    ids = torch.randint(0, 256, (29,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = reference_forward(DeepseekV4.load(tiny_v4, ops=table), ids)
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
