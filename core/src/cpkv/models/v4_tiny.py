"""A tiny random DeepSeek-V4 checkpoint (``cpkv init-model --arch v4``): its config defaults,
presets with V4-Flash's and V4-Pro's attention dimensions, and its weights.

The weights are in DeepSeek's release naming (:mod:`cpkv.models.v4_weights`), float32, which
transformers' ``DeepseekV4ForCausalLM.from_pretrained`` loads as well. Deterministic for a seed,
scaled so activations stay well-conditioned (projections ~ N(0, 1/fan_in), residual branches
half that, norms ~ 1, hash-routing tables of distinct experts per token). The MTP draft layer
is written when ``num_nextn_predict_layers`` is 1 (``cpkv init-model --arch v4 --mtp``; 0 by
default), after the target's weights: the target's are the same either way.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .v4_config import CSA, HCA, SWA, V4_MODEL_TYPE, DeepseekV4Config
from .v4_weights import v4_expected_shapes

__all__ = ["V4_PRESETS", "V4_TINY_DEFAULTS", "v4_tiny_config", "v4_tiny_state"]

#: the tiny V4: one layer of each kind and a second CSA layer, hash-MoE first; rates 4 and 16
#: and a window of 8 so that many windows and window rows cross rank boundaries at short
#: prompts; 16 indexer heads (few heads make ``sum_h w relu(q.k)`` exactly 0 often: ties)
V4_TINY_DEFAULTS: dict[str, Any] = {
    "model_type": V4_MODEL_TYPE,
    "vocab_size": 256,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "layer_types": [SWA, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 16},
    "num_attention_heads": 4,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,  # 8 rotated dims
    "q_lora_rank": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 4,
    "hc_mult": 4,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    # the compressed layers' rope as V4's: yarn with attention_factor 1 (scaled down)
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 1024},
    "num_nextn_predict_layers": 0,
}

_ATTN_COMMON: dict[str, Any] = dict(
    head_dim=512, partial_rotary_factor=64 / 512, sliding_window=128, index_n_heads=64,
    index_head_dim=128, compress_rates={CSA: 4, HCA: 128}, hc_mult=4, vocab_size=1024,
    n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
    num_hidden_layers=2, layer_types=[CSA, HCA], mlp_layer_types=["moe", "moe"],
    max_position_embeddings=1048576,
    rope_parameters={"rope_type": "yarn", "factor": 16.0,
                     "original_max_position_embeddings": 65536},
)

#: named overrides of :data:`V4_TINY_DEFAULTS` (``cpkv init-model --preset``): V4's attention at
#: full size in one CSA and one HCA layer with a small MoE and vocabulary (GPU runs)
V4_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "v4-flash-attention": dict(_ATTN_COMMON, hidden_size=4096, num_attention_heads=64,
                               q_lora_rank=1024, o_groups=8, o_lora_rank=1024, index_topk=512),
    "v4-pro-attention": dict(_ATTN_COMMON, hidden_size=7168, num_attention_heads=128,
                             q_lora_rank=1536, o_groups=16, o_lora_rank=1024, index_topk=1024),
}

_RAW_KEYS = {"compress_rates", "rope_parameters", "rope_theta", "compress_rope_theta",
             "partial_rotary_factor", "compress_ratios", "num_hash_layers",
             "compress_rate_csa", "compress_rate_hca"}


def v4_tiny_config(**overrides: Any) -> DeepseekV4Config:
    """The tiny V4's config: :data:`V4_TINY_DEFAULTS` with ``overrides`` (config.json keys).

    Raises:
        TypeError: an unknown key.
    """
    unknown = set(overrides) - set(DeepseekV4Config.model_fields) - _RAW_KEYS
    if unknown:
        raise TypeError(f"unknown tiny-model parameter(s): {sorted(unknown)}")
    raw = {**V4_TINY_DEFAULTS, **overrides}
    n = int(raw["num_hidden_layers"])
    for key, cycle in (("layer_types", [SWA, CSA, HCA, CSA]),
                       ("mlp_layer_types", ["hash_moe", "moe", "moe", "moe"])):
        if key not in overrides and len(raw[key]) != n:  # a layer count given alone
            raw[key] = [cycle[i % len(cycle)] for i in range(n)]
    if "compress_ratios" in overrides and "layer_types" not in overrides:
        raw.pop("layer_types")
    return DeepseekV4Config.model_validate(raw)


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator, cfg: DeepseekV4Config
          ) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if leaf == "tid2eid":  # distinct experts per token
        return torch.rand(shape[0], cfg.n_routed_experts, generator=gen).argsort(-1)[:, :shape[1]]
    if leaf in ("bias", "ape", "hc_attn_base", "hc_ffn_base", "hc_head_base"):
        return 0.1 * torch.randn(shape, generator=gen)
    if leaf == "attn_sink":
        return 0.5 * torch.randn(shape, generator=gen)
    if leaf.endswith("_scale"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if leaf == "embed":
        return torch.randn(shape, generator=gen)
    std = 1.0 / math.sqrt(shape[-1])
    if leaf in ("wo_b", "w2"):
        std *= 0.5  # residual branches
    return std * torch.randn(shape, generator=gen)


def v4_tiny_state(cfg: DeepseekV4Config, seed: int) -> dict[str, torch.Tensor]:
    """The tiny V4's weights for ``seed`` (canonical names, release naming)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = v4_expected_shapes(cfg, mtp=cfg.num_nextn_predict_layers > 0)
    if cfg.tie_word_embeddings:
        del shapes["head.weight"]
    return {name: _init(name, shape, gen, cfg).contiguous() for name, shape in shapes.items()}
