"""The FLOP count behind `cp1_layer_64k_mfu` and `long_<n>_mfu` (cpkv.bench.gpu.layer_flops,
stack_flops) against torch's own FLOP counter run over the model's dense layer (a GLM-5 shared
layer's too), the attention parts against their formulas, and a mixed schedule's sum."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cpkv.bench.gpu import attention_stack, layer_flops, stack_flops
from cpkv.models import load_model, write_tiny_checkpoint

_COUNT = """
import json, sys
import torch
from torch.utils.flop_counter import FlopCounterMode
from cpkv.models import load_model
model = load_model(sys.argv[1])
layer = int(sys.argv[2])  # a dense layer
cfg = model.config
n = 37
x = torch.randn(n, cfg.hidden_size)
pos = torch.arange(n)
rope = model.rope_cos_sin(pos, model.dtype, n - 1)
with FlopCounterMode(display=False) as fc:
    model.attention_inputs(layer, x, pos, rope)
    model.attention_output(layer, torch.randn(n, cfg.num_attention_heads, cfg.kv_lora_rank))
proj = fc.get_total_flops()
with FlopCounterMode(display=False) as fc:
    model.mlp(layer, x)
print(json.dumps({"n": n, "projections": proj, "mlp": fc.get_total_flops()}))
"""


@pytest.mark.parametrize(("arch", "layer"), [  # 3.5 s each: GLM-5 in CI
    ("v32", 0), pytest.param("glm5", 0, marks=pytest.mark.slow),
    pytest.param("glm5", 1, marks=pytest.mark.slow)])
def test_projection_and_mlp_flops_match_torchs_counter(tmp_path: Path, arch: str,
                                                       layer: int) -> None:
    """In a subprocess: torch's FLOP counter imports triton, and triton imported outside the
    interpreter breaks the interpreted kernels of later tests in this process. GLM-5's layer 1
    is a shared-indexer layer: no indexer projections run (``indexer=False``)."""
    from cpkv.models.tiny import ARCHS

    ckpt = write_tiny_checkpoint(tmp_path / arch, seed=0, **ARCHS[arch],
                                 first_k_dense_replace=2)  # layers 0 and 1 dense
    cfg = load_model(ckpt).config
    out = subprocess.run([sys.executable, "-c", _COUNT, str(ckpt), str(layer)],
                         capture_output=True, text=True, timeout=120, check=True)
    counted = json.loads(out.stdout.strip().splitlines()[-1])
    full = cfg.layer_indexers[layer] == "full"
    assert full == (layer == 0)
    got = layer_flops(cfg, counted["n"], indexer=full)
    assert got["projections"] == counted["projections"]
    assert got["mlp"] == counted["mlp"]


def test_attention_flops_follow_the_causal_selection() -> None:
    from cpkv.models.tiny import tiny_config

    cfg = tiny_config()  # top-16
    k, d = cfg.index_topk, cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.kv_lora_rank
    for n in (1, 5, k, k + 1, 100):
        f = layer_flops(cfg, n)
        keys = sum(i + 1 for i in range(n))
        assert f["indexer"] == 2 * keys * cfg.index_n_heads * cfg.index_head_dim
        picked = sum(min(i + 1, k) for i in range(n))
        assert f["sparse_mla"] == 2 * picked * cfg.num_attention_heads * d


def test_stack_flops_follow_glm5s_schedule() -> None:
    """The glm5-attention stack (full, shared): the shared layer's indexer counts zero and its
    projections lack the indexer's q/k/weights; every part at GLM-5's attention dimensions (64
    heads, qk_nope 192, v 256, latent 512 + 64, indexer 32 x 128, top-2048)."""
    from cpkv.models.tiny import tiny_config

    cfg = tiny_config(**attention_stack("glm5-attention", 2))
    assert cfg.layer_indexers == ("full", "shared")
    n = 4096
    full, shared = layer_flops(cfg, n), layer_flops(cfg, n, indexer=False)
    total = stack_flops(cfg, n)
    assert total == {p: full[p] + shared[p] for p in full}
    attn = (6144 * 2048 + 2048 * 64 * 256 + 64 * 192 * 512 + 6144 * 576 + 64 * 512 * 256
            + 64 * 256 * 6144)  # q_a, q_b, W_UK, kv_a, W_UV, o_proj
    index_proj = 2048 * 32 * 128 + 6144 * 128 + 6144 * 32
    assert shared["projections"] == 2 * n * attn
    assert full["projections"] == 2 * n * (attn + index_proj)
    assert (shared["indexer"], full["indexer"]) == (0.0, 2 * (n * (n + 1) / 2) * 32 * 128)
    picked = sum(min(i + 1, 2048) for i in range(n))
    assert shared["sparse_mla"] == full["sparse_mla"] == 2 * picked * 64 * (512 + 64 + 512)
    # DeepSeek-V3.2: every layer runs its indexer
    v32 = tiny_config(**attention_stack("v32-attention", 2))
    assert stack_flops(v32, n) == {p: 2 * f for p, f in layer_flops(v32, n).items()}
