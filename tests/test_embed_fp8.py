"""DeepSeek's fp8 write recipe as one call: ``cpkv.embed.quantize`` (no op table) gives, bit for
bit, the bytes cpkv's own pool stores for the same rows through PrefillSession's write path
(index-K Hadamard-rotated, ue8m0 scales; 656 + 132 B at DeepSeek-V3.2's sizes), and an engine's
two-part tensors written with them hold those bytes."""

from __future__ import annotations

import pytest
import torch

from cpkv.comm import CPGroup
from cpkv.contracts import KVFormat
from cpkv.embed import EngineKV, KVBufferSpec, backend_ops, quantize, read_rows, rotate_index_q
from cpkv.kv import ShardedKVPool
from cpkv.ops import hadamard_rotate
from cpkv.planning import plan_batch

DS = KVFormat(dtype="fp8", page_size=64, kv_lora_rank=512, rope_dim=64, index_head_dim=128,
              quant_block=128)


def _rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(n, 576, generator=g) * torch.logspace(-3, 2, n)[:, None]
    idx = torch.randn(n, 128, generator=g)
    idx[:, 5] *= 40.0  # an outlier channel: what the rotation spreads before the ue8m0 pack
    lat[0] = 0.0  # an all-zero row (the scale floors)
    return lat, idx


@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_equals_cpkv_pools_bytes(seed: int) -> None:
    assert (DS.latent_bytes_per_token, DS.index_bytes_per_token) == (656, 132)
    g = CPGroup.single()
    n = 100
    lat, idx = _rows(n, seed)
    pool = ShardedKVPool(DS, 1, g, backend_ops(g), pages_per_rank=4)
    plan = plan_batch([(0, n)], 1, DS.page_size)
    batch = pool.prepare(plan, ["a"])
    pool.write(0, batch, lat, hadamard_rotate(idx))  # PrefillSession's write of an fp8 pool
    pool.commit(batch)
    rows = torch.tensor([s * 64 + o for s in pool.pages.requests["a"].slots
                         for o in range(64)])[:n]
    want_l, want_i = read_rows(pool.store.spec, 0, rows)
    got_l, got_i = quantize(DS, lat, idx)
    assert got_i is not None and want_i is not None
    assert torch.equal(got_l, want_l) and torch.equal(got_i, want_i)
    # the engine's two-part tensors written with them hold the same bytes
    spec = KVBufferSpec.allocate(DS, 1, 4, "two_part")
    kv = EngineKV(spec, g)
    plan = kv.plan([("a", n)])
    b = kv.prepare(plan, ["a"], {"a": [(0, 3), (0, 1)]})
    kv.put_bytes(0, b, *kv.quantize(lat, idx))
    kv.commit(b)
    el, ei = kv.take_bytes(0, torch.tensor([s * 64 + o for s in (3, 1) for o in range(64)])[:n])
    assert torch.equal(el, want_l) and torch.equal(ei, want_i)
    kv.close()


def test_quantize_without_index_k_and_the_query_rotation() -> None:
    lat, idx = _rows(4, 3)
    got_l, got_i = quantize(DS.latent_only(), lat, None)
    assert got_i is None and got_l.shape == (4, 656)
    # the queries meet rotated keys: q . k unchanged by rotating both (fp8); float formats as is
    q = torch.randn(4, 128)
    assert torch.allclose(rotate_index_q(DS, q) @ hadamard_rotate(idx).T, q @ idx.T, atol=1e-3)
    bf = KVFormat(dtype="bf16", page_size=64, kv_lora_rank=512, rope_dim=64, index_head_dim=128)
    assert torch.equal(rotate_index_q(bf, q), q)
    assert torch.equal(quantize(bf, lat, idx)[1], idx.to(torch.bfloat16).view(torch.uint8))
