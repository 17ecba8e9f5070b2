"""DeepSeek-V4 checkpoints: config.json parsing in every form transformers' DeepseekV4Config
takes (compared with transformers' own normalisation), refusals that name the field and value,
``cpkv init-model --arch v4`` writing a checkpoint that transformers and cpkv both load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cpkv.models import ModelLoadError
from cpkv.models.v4_config import CSA, HCA, SWA, DeepseekV4Config
from cpkv.models.v4_tiny import V4_TINY_DEFAULTS, v4_tiny_config
from cpkv.models.v4_weights import V4CheckpointReader, read_v4_config

transformers = pytest.importorskip("transformers")

BASE = {k: v for k, v in V4_TINY_DEFAULTS.items()
        if k not in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters")}


def _hf(raw: dict) -> transformers.DeepseekV4Config:
    return transformers.DeepseekV4Config(**{k: v for k, v in raw.items() if k != "model_type"})


FORMS = [
    {"layer_types": [SWA, CSA, HCA, CSA], "mlp_layer_types": ["hash_moe"] + ["moe"] * 3},
    {"compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 2},  # legacy, MTP entry last
    {"compress_rate_csa": 8, "compress_rate_hca": 32},  # legacy rates, V4-Pro's default types
    {"compress_rates": {CSA: 4, HCA: 16}, "num_hidden_layers": 6},
    {"rope_parameters": {"rope_type": "yarn", "factor": 16.0,
                         "original_max_position_embeddings": 256}},
    {"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 5000.0},
                         "compress": {"rope_type": "yarn", "rope_theta": 40000.0, "factor": 2.0,
                                      "original_max_position_embeddings": 512,
                                      "attention_factor": 1.0}}},
    {"qk_rope_head_dim": 16},  # legacy rotated dims
]


@pytest.mark.parametrize("form", FORMS)
def test_config_forms_match_transformers(form: dict) -> None:
    raw = {**BASE, **form}
    ours, hf = DeepseekV4Config.model_validate(raw), _hf(raw)
    assert list(ours.layer_types) == hf.layer_types
    assert list(ours.mlp_layer_types) == hf.mlp_layer_types
    assert {CSA: ours.compress_rate_csa, HCA: ours.compress_rate_hca} == hf.compress_rates
    assert ours.qk_rope_head_dim == hf.qk_rope_head_dim
    for which, rope in (("main", ours.rope_main), ("compress", ours.rope_compress)):
        theirs = hf.rope_parameters[which]
        assert rope.type == theirs["rope_type"] and rope.theta == theirs["rope_theta"]
        if rope.type == "yarn":
            assert rope.factor == theirs["factor"]
            assert rope.attention_factor == theirs["attention_factor"]
    # a round trip through hf_dict is the same config, and transformers reads it alike
    again = DeepseekV4Config.model_validate(ours.hf_dict())
    assert again == ours
    hf2 = _hf(ours.hf_dict())
    assert hf2.layer_types == hf.layer_types
    for which in ("main", "compress"):  # ours spells out yarn's defaults (beta_fast, ...)
        mine, theirs = hf2.rope_parameters[which], hf.rope_parameters[which]
        assert {k: mine.get(k) for k in theirs} == theirs


@pytest.mark.parametrize(("bad", "field", "value"), [
    ({"num_key_value_heads": 2}, "num_key_value_heads", "2"),
    ({"layer_types": [SWA, "full_attention", CSA, CSA]}, "layer_types", "full_attention"),
    ({"compress_ratios": [0, 8, 128, 4]}, "compress_ratios", "8"),
    ({"scoring_func": "softmax"}, "scoring_func", "softmax"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config", "fp8"),
    ({"mlp_layer_types": ["dense"] * 4}, "mlp_layer_types", "dense"),
    ({"o_groups": 3}, "o_groups", "3"),
    ({"n_shared_experts": 2}, "n_shared_experts", "2"),
    ({"attention_bias": True}, "attention_bias", "True"),
])
def test_refusals_name_field_and_value(tmp_path: Path, bad: dict, field: str, value: str) -> None:
    raw = {**BASE, **bad}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError) as err:
        read_v4_config(tmp_path)
    assert field in str(err.value) and value in str(err.value)


def test_ownership_unit() -> None:
    cfg = v4_tiny_config()
    assert cfg.rates == (4, 16)
    assert cfg.ownership_unit(8) == 16 and cfg.ownership_unit(64) == 64
    flash = DeepseekV4Config.model_validate({"layer_types": [SWA, CSA, HCA],
                                             "num_hidden_layers": 3})
    assert flash.ownership_unit(64) == 128 and flash.ownership_unit(256) == 256


def test_v32_loader_names_v4(tmp_path: Path) -> None:
    from cpkv.models.loader import read_config

    (tmp_path / "config.json").write_text(json.dumps(V4_TINY_DEFAULTS))
    with pytest.raises(ModelLoadError, match=r"deepseek_v4.*DeepseekV4"):
        read_config(tmp_path)


def test_init_model_v4_loads_in_transformers_and_cpkv(tmp_path: Path) -> None:
    from cpkv.cli import main

    out = tmp_path / "v4"
    res = CliRunner().invoke(main, ["init-model", str(out), "--arch", "v4", "--seed", "3"])
    assert res.exit_code == 0, res.output
    assert "DeepSeek-V4" in res.output
    _, info = transformers.DeepseekV4ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    with V4CheckpointReader(out) as r:
        assert r.config == v4_tiny_config()
    bad = CliRunner().invoke(main, ["init-model", str(tmp_path / "x"), "--arch", "v4",
                                    "--dense-layers", "1"])
    assert bad.exit_code != 0 and "--dense-layers" in bad.output


def test_init_model_v4_mtp_writes_the_draft_layer_transformers_skips(tmp_path: Path) -> None:
    from cpkv.cli import main

    out = tmp_path / "v4mtp"
    res = CliRunner().invoke(main, ["init-model", str(out), "--arch", "v4", "--mtp"])
    assert res.exit_code == 0, res.output
    _, info = transformers.DeepseekV4ForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with V4CheckpointReader(out, mtp=True) as r:
        assert r.config.num_nextn_predict_layers == 1
        assert r.get("mtp.0.e_proj.weight", None).shape == (64, 64)
    bad = CliRunner().invoke(main, ["init-model", str(tmp_path / "y"), "--arch", "v4", "--mtp",
                                    "--draft", "agree"])
    assert bad.exit_code != 0 and "draft='random'" in bad.output, bad.output


def test_presets_have_v4_attention_dimensions() -> None:
    from cpkv.models.tiny import PRESETS, tiny_config

    flash = tiny_config(**PRESETS["v4-flash-attention"])
    pro = tiny_config(**PRESETS["v4-pro-attention"])
    assert isinstance(flash, DeepseekV4Config) and isinstance(pro, DeepseekV4Config)
    for c, heads, topk in ((flash, 64, 512), (pro, 128, 1024)):
        assert (c.head_dim, c.qk_rope_head_dim, c.num_attention_heads, c.index_topk) == (
            512, 64, heads, topk)
        assert (c.sliding_window, c.rates, c.index_n_heads, c.index_head_dim) == (
            128, (4, 128), 64, 128)
        assert c.rope_compress.type == "yarn" and c.rope_compress.attention_factor == 1.0
