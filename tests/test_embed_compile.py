"""One graph for all layers: the per-layer calls name a layer by its tensors (``kv.layer(i)``,
a :class:`LayerKV`), so a compiled per-layer step over a 4-layer KV compiles once per batch
shape, not once per layer (an int layer index is a constant the compiler specializes on)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from cpkv.comm import CPGroup
from cpkv.contracts import KVFormat
from cpkv.embed import EngineBatch, EngineKV, KVBufferSpec, LayerKV

FMT = KVFormat(dtype="fp32", page_size=8, kv_lora_rank=16, rope_dim=8, index_head_dim=8)
LAYERS = 4


def _compiles(step: Callable[..., torch.Tensor], kv: EngineKV,
              layer_arg: Callable[[int], int | LayerKV]) -> tuple[int, list[torch.Tensor]]:
    """Frames compiled for ``step`` over every layer of two batches of different shapes (each a
    new request), and the outputs."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    outs = []
    for i, n in enumerate((20, 37)):
        rid = f"r{i}"
        plan = kv.plan([(rid, n)])
        base = 8 * i
        given = {r: [(o, base + k) for k, o in enumerate(owners)]
                 for r, owners in kv.owners_to_give(plan, [rid]).items()}
        b = kv.prepare(plan, [rid], given)
        g = torch.Generator().manual_seed(i)
        lat = torch.randn(n, FMT.kv_lora_rank + FMT.rope_dim, generator=g)
        idx = torch.randn(n, FMT.index_head_dim, generator=g)
        for layer in range(LAYERS):
            outs.append(compiled(layer_arg(layer), b, lat * (layer + 1), idx))
        kv.commit(b)
    return int(counters["stats"]["unique_graphs"]), outs


def _kv() -> EngineKV:
    return EngineKV(KVBufferSpec.allocate(FMT, LAYERS, 16, "two_part"), CPGroup.single())


def test_one_compilation_per_batch_shape_for_all_layers() -> None:
    kv = _kv()

    def step(lk: LayerKV, b: EngineBatch, lat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        kv.put_bytes(lk, b, *kv.quantize(lat, idx))
        keys, index_k, _ = kv.view(lk, b).keys(torch.float32)
        scores = (index_k @ idx.T).T  # [rows, keys]: a stand-in for the engine's indexer
        return scores.sum() + keys.sum()

    n, outs = _compiles(step, kv, kv.layer)
    kv.close()
    assert n == 2, f"{n} graphs for 2 batch shapes x {LAYERS} layers"
    eager = _kv()
    torch._dynamo.reset()

    def eager_step(lk: LayerKV, b: EngineBatch, lat: torch.Tensor, idx: torch.Tensor
                   ) -> torch.Tensor:
        eager.put_bytes(lk, b, *eager.quantize(lat, idx))
        keys, index_k, _ = eager.view(lk, b).keys(torch.float32)
        return (index_k @ idx.T).T.sum() + keys.sum()

    want = []
    for i, n_rows in enumerate((20, 37)):  # the same batches, eager: the compiled values
        plan = eager.plan([(f"r{i}", n_rows)])
        given = {r: [(o, 8 * i + k) for k, o in enumerate(owners)]
                 for r, owners in eager.owners_to_give(plan, [f"r{i}"]).items()}
        b = eager.prepare(plan, [f"r{i}"], given)
        g = torch.Generator().manual_seed(i)
        lat = torch.randn(n_rows, FMT.kv_lora_rank + FMT.rope_dim, generator=g)
        idx = torch.randn(n_rows, FMT.index_head_dim, generator=g)
        want += [eager_step(eager.layer(layer), b, lat * (layer + 1), idx)
                 for layer in range(LAYERS)]
        eager.commit(b)
    eager.close()
    assert all(torch.allclose(a, w) for a, w in zip(outs, want, strict=True))


def test_an_int_layer_index_compiles_per_layer() -> None:
    """The contrast the count above rules out: the same step taking the layer's index."""
    kv = _kv()

    def step(layer: int, b: EngineBatch, lat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        kv.put_bytes(layer, b, *kv.quantize(lat, idx))
        return kv.view_rows(layer, b).float().sum()

    n, _ = _compiles(step, kv, lambda i: i)
    kv.close()
    assert n > 2
