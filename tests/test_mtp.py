"""The MTP draft layer (issue 14): checkpoint loading, the forward against an independent
reference (transformers' decoder layer wrapped by the DeepSeek-V3 report's MTP formula)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cpkv.models import DeepseekV32, ModelLoadError, write_tiny_checkpoint
from cpkv.models.loader import mtp_shapes

safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=3)


def _copy(src: Path, dst: Path, mutate_cfg=None, mutate_state=None) -> Path:  # type: ignore[no-untyped-def]
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if mutate_cfg:
        mutate_cfg(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    state = safetensors_torch.load_file(src / "model.safetensors")
    if mutate_state:
        mutate_state(state)
    safetensors_torch.save_file(state, str(dst / "model.safetensors"))
    return dst


# ---------------------------------------------------------------------------- checkpoint
def test_mtp_layer_loads_in_the_release_naming(tiny: Path) -> None:
    state = safetensors_torch.load_file(tiny / "model.safetensors")
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    names = mtp_shapes(DeepseekV32.load(tiny).config)
    for leaf in ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head",
                 "self_attn.indexer.wk", "self_attn.kv_a_proj_with_mqa", "mlp.gate"):
        assert f"model.layers.3.{leaf}.weight" in names
    assert all(tuple(state[k].shape) == v for k, v in names.items())
    plain, m = DeepseekV32.load(tiny), DeepseekV32.load(tiny, mtp=True)
    assert (plain.kv_layers, plain.mtp_layer) == (3, None)
    assert (m.num_layers, m.kv_layers, m.mtp_layer) == (3, 4, 3)
    torch.testing.assert_close(m._layers[3].q_a, state["model.layers.3.self_attn.q_a_proj.weight"])
    assert m._mtp is not None and torch.equal(m._mtp.eh_proj, state["model.layers.3.eh_proj.weight"])
    # the target is the same with and without the MTP layer
    x = torch.randn(5, 64)
    assert torch.equal(plain.final_logits(x), m.final_logits(x))
    with pytest.raises(ValueError, match="without its MTP draft layer"):
        plain.draft_embed(torch.tensor([1]))
    with pytest.raises(IndexError):
        plain.attention_inputs(3, x, torch.arange(5))


def test_mtp_shares_embedding_and_head_when_absent(tmp_path: Path, tiny: Path) -> None:
    def drop(s: dict) -> None:  # type: ignore[type-arg]
        del s["model.layers.3.embed_tokens.weight"], s["model.layers.3.shared_head.head.weight"]

    m = DeepseekV32.load(_copy(tiny, tmp_path / "c", mutate_state=drop), mtp=True)
    assert m._mtp is not None and m._mtp.embed is m._embed and m._mtp.head is m._lm_head


def test_asking_mtp_of_a_checkpoint_without_it_is_a_clear_error(tmp_path: Path, tiny: Path) -> None:
    none = write_tiny_checkpoint(tmp_path / "none", seed=3, num_nextn_predict_layers=0)
    assert DeepseekV32.load(none).num_layers == 3  # loads as before
    with pytest.raises(ModelLoadError, match=r"MTP draft layer was asked for.*num_nextn_predict_layers = 0"):
        DeepseekV32.load(none, mtp=True)

    def strip(s: dict) -> None:  # type: ignore[type-arg]
        for k in [k for k in s if k.startswith("model.layers.3.")]:
            del s[k]

    stripped = _copy(tiny, tmp_path / "s", mutate_state=strip)
    assert DeepseekV32.load(stripped).num_layers == 3
    with pytest.raises(ModelLoadError, match=r"no model\.layers\.3\.\* weight is stored"):
        DeepseekV32.load(stripped, mtp=True)

    def half(s: dict) -> None:  # type: ignore[type-arg]
        del s["model.layers.3.eh_proj.weight"]

    with pytest.raises(ModelLoadError, match=r"missing weight\(s\): model\.layers\.3\.eh_proj"):
        DeepseekV32.load(_copy(tiny, tmp_path / "h", mutate_state=half), mtp=True)


def test_init_model_writes_an_mtp_layer(tmp_path: Path) -> None:
    from cpkv.cli.init_model import command

    r = CliRunner().invoke(command, [str(tmp_path / "a"), "--layers", "2"])
    assert r.exit_code == 0, r.output
    assert DeepseekV32.load(tmp_path / "a", mtp=True).mtp_layer == 2
    r = CliRunner().invoke(command, [str(tmp_path / "b"), "--layers", "2", "--no-mtp"])
    assert r.exit_code == 0, r.output
    with pytest.raises(ModelLoadError, match="has none"):
        DeepseekV32.load(tmp_path / "b", mtp=True)
    r = CliRunner().invoke(command, [str(tmp_path / "c"), "--draft", "agree", "--no-mtp"])
    assert r.exit_code != 0 and "needs an MTP layer" in r.output


# ---------------------------------------------------------------------------- the MTP forward
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def mtp_reference(ckpt: Path, ids: torch.Tensor) -> torch.Tensor:
    """Draft logits of every row, from the DeepSeek-V3 report's MTP definition, independent of
    cpkv: the target is transformers' DeepSeek-V3.2 (``h_i``: its last hidden state, after the
    final norm), ``h'_i = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))`` written out here, the
    MTP decoder layer is transformers' decoder layer (a one-layer model fed ``inputs_embeds``),
    and ``shared_head`` is its final norm and head. ``t_{i+1}`` of the last row is the target's
    greedy token."""
    transformers = pytest.importorskip("transformers")
    state = safetensors_torch.load_file(ckpt / "model.safetensors")
    target = transformers.DeepseekV32ForCausalLM.from_pretrained(
        ckpt, attn_implementation="eager").eval()
    cfg = target.config
    n_layers, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    p = f"model.layers.{n_layers}"
    with torch.no_grad():
        h = target.model(input_ids=ids[None]).last_hidden_state[0]
        nxt = torch.cat([ids[1:], target.lm_head(h[-1:]).argmax(-1)])
        e = state[f"{p}.embed_tokens.weight"][nxt]
        x = torch.cat([_rms(e, state[f"{p}.enorm.weight"], eps),
                       _rms(h, state[f"{p}.hnorm.weight"], eps)], -1) @ state[f"{p}.eh_proj.weight"].T
        kind = "dense" if n_layers < cfg.first_k_dense_replace else "sparse"
        one_cfg = transformers.DeepseekV32Config(**{**cfg.to_dict(), "num_hidden_layers": 1,
                                                    "first_k_dense_replace": int(kind == "dense"),
                                                    "mlp_layer_types": [kind],
                                                    "layer_types": ["indexed_attention"]})
        one = transformers.DeepseekV32ForCausalLM(one_cfg).eval()
        sd = {k.replace(f"{p}.", "model.layers.0."): v for k, v in state.items()
              if k.startswith(p + ".")}
        sd["model.norm.weight"] = state[f"{p}.shared_head.norm.weight"]
        sd["lm_head.weight"] = state[f"{p}.shared_head.head.weight"]
        sd["model.embed_tokens.weight"] = state["model.embed_tokens.weight"]
        missing, unexpected = one.load_state_dict(
            {k: v for k, v in sd.items() if not k.split(".")[-2] in ("enorm", "hnorm", "eh_proj")
             and "shared_head" not in k and "layers.0.embed_tokens" not in k}, strict=False)
        assert not [k for k in missing if "experts" not in k], missing
        if any("experts" in k for k in missing):  # transformers keeps the experts packed
            e_ = one_cfg.n_routed_experts
            pre = "model.layers.0.mlp.experts"
            one.model.layers[0].mlp.experts.gate_up_proj.copy_(torch.stack([
                torch.cat([sd[f"{pre}.{j}.gate_proj.weight"], sd[f"{pre}.{j}.up_proj.weight"]])
                for j in range(e_)]))
            one.model.layers[0].mlp.experts.down_proj.copy_(torch.stack([
                sd[f"{pre}.{j}.down_proj.weight"] for j in range(e_)]))
        return one(inputs_embeds=x[None]).logits[0].float()


def test_mtp_forward_equals_the_published_definition(tiny: Path) -> None:
    """One rank: the draft logits of every row (the MTP layer as pool layer ``num_layers``, run
    by the prefill driver) equal the independent reference within the CP tolerance."""
    from cpkv.comm import CPGroup
    from cpkv.fallback import recording
    from cpkv.runtime.session import PrefillSession
    from cpkv.settings import load_settings

    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(4))
    s = load_settings(cp={"size": 1}, kv={"page_size": 8, "dtype": "fp32"},
                      backend={"preference": ["torch"]})
    with recording() as rec:
        session = PrefillSession(DeepseekV32.load(tiny, mtp=True), s, CPGroup.single())
        res = session.prefill([("a", ids.tolist())], all_logits=True)
    assert not rec.events
    assert session.pool.num_layers == 4 and res.draft_embedding == "local"
    ref = mtp_reference(tiny, ids)
    got = res.all_draft_logits
    assert got is not None and got.shape == ref.shape == (40, 512)
    rel = ((got - ref).abs().amax() / ref.abs().amax()).item()
    assert rel < 1e-4, rel
    assert res.draft_logits is not None and torch.equal(res.draft_logits[0], got[-1])
    assert ref.std() > 0.1  # the draft is not degenerate
