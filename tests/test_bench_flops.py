"""The FLOP count behind `cp1_layer_64k_mfu` (cpkv.bench.gpu.layer_flops) against torch's own
FLOP counter run over the model's dense layer, and the attention parts against their formulas."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cpkv.bench.gpu import layer_flops

_COUNT = """
import json, sys
import torch
from torch.utils.flop_counter import FlopCounterMode
from cpkv.models import load_model
model = load_model("tiny", cache_dir=sys.argv[1])  # layer 0 is dense
cfg = model.config
n = 37
x = torch.randn(n, cfg.hidden_size)
pos = torch.arange(n)
rope = model.rope_cos_sin(pos, model.dtype, n - 1)
with FlopCounterMode(display=False) as fc:
    model.attention_inputs(0, x, pos, rope)
    model.attention_output(0, torch.randn(n, cfg.num_attention_heads, cfg.kv_lora_rank))
proj = fc.get_total_flops()
with FlopCounterMode(display=False) as fc:
    model.mlp(0, x)
print(json.dumps({"n": n, "projections": proj, "mlp": fc.get_total_flops()}))
"""


def test_projection_and_mlp_flops_match_torchs_counter(tmp_path: Path) -> None:
    """In a subprocess: torch's FLOP counter imports triton, and triton imported outside the
    interpreter breaks the interpreted kernels of later tests in this process."""
    from cpkv.models.tiny import tiny_config

    out = subprocess.run([sys.executable, "-c", _COUNT, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, check=True)
    counted = json.loads(out.stdout.strip().splitlines()[-1])
    got = layer_flops(tiny_config(), counted["n"])
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
