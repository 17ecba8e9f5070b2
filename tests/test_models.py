"""cpkv.models against transformers' DeepSeek-V3.2 and GLM-5: same logits from the per-layer API
with a dense, masked reference of the sparse attention (GLM-5's shared-indexer layers reuse the
last full layer's keys); GLM-5 indexer schedules; loader errors; yarn rope; ``init-model``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cpkv.contracts import KVDtype
from cpkv.models import (
    TINY_DEFAULTS,
    AttentionInputs,
    DeepseekV32,
    DeepseekV32Config,
    ModelLoadError,
    load_model,
    write_tiny_checkpoint,
)
from cpkv.models.deepseek_v32 import _rms_norm
from cpkv.testing.checkpoints import copy_checkpoint

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from helpers import hf_logits, hf_random_model  # noqa: E402

SEQ = 40  # longer than index_topk=16: the indexer really drops keys




# ---------------------------------------------------------------------------- reference forward
def sparse_attention_reference(m: DeepseekV32, a: AttentionInputs, positions: torch.Tensor) -> torch.Tensor:
    """One request's rows in order: indexer top-min(index_topk, i+1) causal keys, softmax over those only."""
    c = m.config
    n = a.q.shape[0]
    causal = positions[None, :] <= positions[:, None]  # [query, key]
    scores = torch.einsum("nhd,td->nht", a.index_q.float(), a.index_k.float()).relu()
    logits = torch.einsum("nh,nht->nt", a.index_w, scores).masked_fill(~causal, float("-inf"))
    topk = logits.topk(min(c.index_topk, n), dim=-1).indices
    keep = torch.zeros_like(causal).scatter(1, topk, True) & causal
    assert bool((keep.sum(-1) == torch.clamp(torch.arange(1, n + 1), max=c.index_topk)).all())
    att = torch.einsum("nhc,tc->nht", a.q.float(), a.latent.float()) * m.softmax_scale
    att = att.masked_fill(~keep[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("nht,tc->nhc", att, a.latent[:, : c.kv_lora_rank].float()).to(a.q.dtype)


def reference_logits(m: DeepseekV32, ids: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(ids.shape[0])
    x = m.embed(ids)
    full: AttentionInputs | None = None  # the last full layer's inputs: its keys are reused
    for layer in range(m.num_layers):
        a = m.attention_inputs(layer, x, pos)
        if a.shared:
            assert full is not None and a.index_q is None and a.index_w is None
            a.index_q, a.index_w, a.index_k = full.index_q, full.index_w, full.index_k
        else:
            full = a
        x = x + m.attention_output(layer, sparse_attention_reference(m, a, pos))
        x = x + m.mlp(layer, x)
    return m.final_logits(x)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory: pytest.TempPathFactory, arch: str) -> tuple[Path, torch.nn.Module]:
    tmp = tmp_path_factory.mktemp(f"hf-{arch}")
    return tmp, hf_random_model(tmp, arch=arch)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=3)


def prompt(vocab: int, n: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- against transformers
def test_logits_match_transformers(hf_ckpt: tuple[Path, torch.nn.Module], arch: str) -> None:
    path, hf = hf_ckpt
    m = DeepseekV32.load(path)
    if arch == "glm5":  # the shared layers were read as such: no indexer, latent-only KV
        assert m.index_layers == (True, False, False, True)
        assert [f.index_k for f in m.kv_formats("bf16", 64)] == list(m.index_layers)
    ids = prompt(m.config.vocab_size)
    err = rel_err(reference_logits(m, ids), hf_logits(hf, ids))
    print(f"transformers-saved checkpoint, float32: max rel err {err:.2e}")
    assert err <= 1e-4


def test_tiny_checkpoint_loads_in_transformers(tiny_ckpt: Path) -> None:
    m = DeepseekV32.load(tiny_ckpt)
    hf = transformers.DeepseekV32ForCausalLM.from_pretrained(tiny_ckpt, attn_implementation="eager").eval()
    ids = prompt(m.config.vocab_size, seed=2)
    ours, theirs = reference_logits(m, ids), hf_logits(hf, ids)
    err = rel_err(ours, theirs)
    print(f"write_tiny_checkpoint, float32: max rel err {err:.2e}")
    assert err <= 1e-4
    assert ours.std() > 0.1  # well-conditioned: logits are not ~0


def test_yarn_rope_matches_transformers(tmp_path: Path) -> None:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}
    hf = hf_random_model(tmp_path, seed=4, rope_parameters=rope, max_position_embeddings=512)
    m = DeepseekV32.load(tmp_path)
    assert m.config.rope.type == "yarn"
    assert m.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert m.softmax_scale != pytest.approx(m.config.qk_head_dim ** -0.5)
    inv, scale = m._inv_freq, m._rope_scaling
    assert torch.equal(inv, hf.model.rotary_emb.inv_freq) and scale == hf.model.rotary_emb.attention_scaling
    ids = prompt(m.config.vocab_size, n=80, seed=5)  # past original_max_position_embeddings
    err = rel_err(reference_logits(m, ids), hf_logits(hf, ids))
    print(f"yarn rope, float32: max rel err {err:.2e}")
    assert err <= 1e-4


def test_legacy_rope_keys(tmp_path: Path) -> None:
    write_tiny_checkpoint(tmp_path / "c", rope_theta=5e5,
                          rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 64,
                                        "mscale": 1.0, "mscale_all_dim": 1.0})
    cfg = DeepseekV32.load(tmp_path / "c").config
    assert (cfg.rope.type, cfg.rope.theta, cfg.rope.factor) == ("yarn", 5e5, 40)


def test_bfloat16_runs_close_to_float32(tiny_ckpt: Path) -> None:
    m32, m16 = DeepseekV32.load(tiny_ckpt), DeepseekV32.load(tiny_ckpt, dtype=torch.bfloat16)
    ids = prompt(m32.config.vocab_size, n=12)  # shorter than index_topk: no top-k ties to flip
    a = m16.attention_inputs(1, m16.embed(ids), torch.arange(12))
    assert a.q.dtype == a.latent.dtype == a.index_q.dtype == a.index_k.dtype == torch.bfloat16
    assert a.index_w.dtype == torch.float32
    l16, l32 = reference_logits(m16, ids), reference_logits(m32, ids)
    assert l16.dtype == torch.float32 and rel_err(l16, l32) < 0.1


# ---------------------------------------------------------------------------- API details
def test_shapes_formats_and_row_independence(tiny_ckpt: Path) -> None:
    m = DeepseekV32.load(tiny_ckpt)
    c = m.config
    assert m.num_layers == 3 and c.mlp_layer_types == ("dense", "sparse", "sparse")
    n = 10
    x = torch.randn(n, c.hidden_size)
    pos = torch.tensor([7, 0, 3, 100, 1, 2, 5000, 4, 9, 8])  # rows of several requests, any order
    a = m.attention_inputs(2, x, pos)
    assert a.q.shape == (n, c.num_attention_heads, c.kv_lora_rank + c.qk_rope_head_dim)
    assert a.latent.shape == (n, c.kv_lora_rank + c.qk_rope_head_dim)
    assert a.index_q.shape == (n, c.index_n_heads, c.index_head_dim)
    assert a.index_w.shape == (n, c.index_n_heads) and a.index_k.shape == (n, c.index_head_dim)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    b = m.attention_inputs(2, x[perm], pos[perm])
    for f in ("q", "latent", "index_q", "index_w", "index_k"):
        torch.testing.assert_close(getattr(b, f), getattr(a, f)[perm])
    assert m.attention_output(1, torch.randn(n, c.num_attention_heads, c.kv_lora_rank)).shape == (n, 64)
    for layer in range(3):
        y = m.mlp(layer, x)
        assert y.shape == x.shape
        torch.testing.assert_close(m.mlp(layer, x[perm]), y[perm])
    assert m.final_logits(x).shape == (n, c.vocab_size)
    fmt = m.kv_format("fp8", 64)
    assert fmt.dtype is KVDtype.FP8 and (fmt.kv_lora_rank, fmt.rope_dim, fmt.index_head_dim) == (32, 8, 16)
    assert fmt.quant_block == 32 and m.kv_format(KVDtype.BF16, 16).page_size == 16
    assert m.softmax_scale == pytest.approx(24 ** -0.5)


def test_absorbed_equals_expanded(tiny_ckpt: Path) -> None:
    """q . latent with W_UK absorbed == transformers' expanded q_nope . k_nope + q_rot . k_rot."""
    m = DeepseekV32.load(tiny_ckpt)
    c = m.config
    w = m._layers[1]
    x, pos = torch.randn(6, c.hidden_size), torch.arange(6)
    a = m.attention_inputs(1, x, pos)
    k_nope = torch.einsum("tc,hdc->thd", a.latent[:, : c.kv_lora_rank], w.w_uk)
    hn = _rms_norm(x, w.input_norm, c.rms_norm_eps)
    q = torch.nn.functional.linear(_rms_norm(hn @ w.q_a.T, w.q_a_norm, 1e-6), w.q_b).view(6, 4, -1)
    expanded = torch.einsum("nhd,thd->nht", q[..., : c.qk_nope_head_dim], k_nope) + torch.einsum(
        "nhr,tr->nht", a.q[..., c.kv_lora_rank:], a.latent[:, c.kv_lora_rank:])
    torch.testing.assert_close(torch.einsum("nhc,tc->nht", a.q, a.latent), expanded, rtol=1e-5, atol=1e-5)


def test_projections_sharing_an_input_are_one_weight_without_a_copy(tiny_ckpt: Path) -> None:
    """[q_a; kv_a; wk], [q_b; wq_b] and [gate; up] are each one weight whose parts are views of
    it (no second copy), and the layer's outputs are the separate projections'."""
    import torch.nn.functional as F

    m = DeepseekV32.load(tiny_ckpt)
    c = m.config
    w = m._layers[0]
    assert w.h_proj is not None and w.r_proj is not None and w.gate_up is not None
    assert w.idx_wk is not None and w.idx_wq_b is not None
    for fused, parts in ((w.h_proj, (w.q_a, w.kv_a, w.idx_wk)), (w.r_proj, (w.q_b, w.idx_wq_b)),
                         (w.gate_up, (w.gate, w.up))):
        assert all(p is not None and p.untyped_storage().data_ptr()
                   == fused.untyped_storage().data_ptr() for p in parts)
        assert torch.equal(fused, torch.cat(parts))  # type: ignore[arg-type]
    x, pos = torch.randn(5, c.hidden_size), torch.arange(5)
    a = m.attention_inputs(0, x, pos)
    h = _rms_norm(x, w.input_norm, c.rms_norm_eps)
    q_resid = _rms_norm(F.linear(h, w.q_a), w.q_a_norm, 1e-6)
    iq = F.linear(q_resid, w.idx_wq_b).view(5, c.index_n_heads, c.index_head_dim)
    assert a.index_q is not None and a.index_k is not None
    torch.testing.assert_close(a.index_q[..., c.qk_rope_head_dim:], iq[..., c.qk_rope_head_dim:])
    ik = F.layer_norm(F.linear(h, w.idx_wk), (c.index_head_dim,), w.idx_k_norm_w,
                      w.idx_k_norm_b, 1e-6)
    torch.testing.assert_close(a.index_k[..., c.qk_rope_head_dim:], ik[..., c.qk_rope_head_dim:])
    xm = torch.randn(5, c.hidden_size)
    hm = _rms_norm(xm, w.post_norm, c.rms_norm_eps)
    assert w.gate is not None and w.up is not None and w.down is not None
    want = F.linear(F.silu(F.linear(hm, w.gate)) * F.linear(hm, w.up), w.down)
    torch.testing.assert_close(m.mlp(0, xm), want)


def test_packed_experts_and_tied_head_and_mtp(tmp_path: Path, tiny_ckpt: Path) -> None:
    state = safetensors_torch.load_file(tiny_ckpt / "model.safetensors")
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts"
        gu = [torch.cat([state.pop(f"{p}.{e}.gate_proj.weight"), state.pop(f"{p}.{e}.up_proj.weight")])
              for e in range(8)]
        state[f"{p}.gate_up_proj"] = torch.stack(gu)
        state[f"{p}.down_proj"] = torch.stack([state.pop(f"{p}.{e}.down_proj.weight") for e in range(8)])
    state["model.layers.3.self_attn.q_a_proj.weight"] = torch.zeros(2, 2)  # an MTP layer: ignored
    del state["lm_head.weight"]
    cfg["tie_word_embeddings"] = True
    half = len(state) // 2  # two shards + index
    keys = sorted(state)
    out = tmp_path / "packed"
    out.mkdir()
    for name, ks in (("a.safetensors", keys[:half]), ("b.safetensors", keys[half:])):
        safetensors_torch.save_file({k: state[k] for k in ks}, str(out / name))
    idx = {"weight_map": {k: "a.safetensors" if i < half else "b.safetensors" for i, k in enumerate(keys)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(idx))
    (out / "config.json").write_text(json.dumps(cfg))
    packed, ref = DeepseekV32.load(out), DeepseekV32.load(tiny_ckpt)
    x = torch.randn(5, 64)
    torch.testing.assert_close(packed.mlp(1, x), ref.mlp(1, x), rtol=0, atol=0)
    assert packed._lm_head is packed._embed and torch.equal(packed._embed, ref._embed)
    assert packed.num_layers == 3  # the MTP layer's weight was ignored, not an error


def test_fp8_block_weights_are_dequantised(tmp_path: Path, tiny_ckpt: Path) -> None:
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    state = safetensors_torch.load_file(tiny_ckpt / "model.safetensors")
    name = "model.layers.0.self_attn.q_a_proj.weight"  # [32, 64]; 16x16 blocks
    w = state[name]
    scale = w.abs().reshape(2, 16, 4, 16).amax(dim=(1, 3)) / 448
    q = (w / scale.repeat_interleave(16, 0).repeat_interleave(16, 1)).to(torch.float8_e4m3fn)
    state[name], state[name + "_scale_inv"] = q, scale
    out = tmp_path / "fp8"
    out.mkdir()
    safetensors_torch.save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text((tiny_ckpt / "config.json").read_text())
    got = DeepseekV32.load(out)._layers[0].q_a
    torch.testing.assert_close(got, w, rtol=0.07, atol=1e-3)


# ---------------------------------------------------------------------------- loader errors
_copy = copy_checkpoint


def test_loader_errors(tmp_path: Path, tiny_ckpt: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        DeepseekV32.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        DeepseekV32.load(tmp_path / "empty")

    def wrong_type(c: dict) -> None:
        c["model_type"] = "llama"

    known = (r"model_type 'llama' is not an architecture cpkv knows; it loads deepseek_v32 "
             r"\(DeepSeek-V3\.2\), glm_moe_dsa \(GLM-5\)$")
    with pytest.raises(ModelLoadError, match=known) as unknown:
        DeepseekV32.load(_copy(tiny_ckpt, tmp_path / "t", mutate_cfg=wrong_type))
    assert "\n" not in str(unknown.value)  # one line

    def drop(s: dict) -> None:
        del s["model.layers.1.self_attn.indexer.wk.weight"]

    missing = r"1 missing weight\(s\): model\.layers\.1\.self_attn\.indexer\.wk"
    with pytest.raises(ModelLoadError, match=missing):
        DeepseekV32.load(_copy(tiny_ckpt, tmp_path / "m", mutate_state=drop))

    def reshape(s: dict) -> None:
        s["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
        s["model.layers.0.self_attn.extra.weight"] = torch.zeros(1)

    shape = r"o_proj\.weight has shape \[64, 32\], expected \[64, 64\]"
    with pytest.raises(ModelLoadError, match=shape) as ei:
        DeepseekV32.load(_copy(tiny_ckpt, tmp_path / "s", mutate_state=reshape))
    assert "unexpected weight(s): model.layers.0.self_attn.extra.weight" in str(ei.value)

    def dynamic_rope(c: dict) -> None:
        c["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}

    with pytest.raises(ModelLoadError, match="unsupported rope type 'dynamic'"):
        DeepseekV32.load(_copy(tiny_ckpt, tmp_path / "r", mutate_cfg=dynamic_rope))
    with pytest.raises(ModelLoadError, match="neither 'tiny' nor"):
        load_model(str(tmp_path / "missing"))
    assert issubclass(ModelLoadError, ValueError)


def test_config_parsing() -> None:
    cfg = DeepseekV32Config.model_validate({**TINY_DEFAULTS, "model_type": "deepseek_v32", "unknown_key": 1})
    assert cfg.mlp_layer_types == ("dense", "sparse", "sparse") and cfg.rope.type == "default"
    with pytest.raises(ValueError, match="hidden_act"):
        DeepseekV32Config.model_validate({**TINY_DEFAULTS, "hidden_act": "gelu"})


# ---------------------------------------------------------------------------- tiny + CLI
def test_tiny_is_deterministic_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = write_tiny_checkpoint(tmp_path / "a", seed=7)
    b = write_tiny_checkpoint(tmp_path / "b", seed=7)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError):
        write_tiny_checkpoint(a)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    m = load_model("tiny")
    cached = list((tmp_path / "xdg" / "cpkv" / "models").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("tiny-")
    assert m.config.index_topk == TINY_DEFAULTS["index_topk"]
    m2 = load_model("tiny", cache_dir=tmp_path / "c2", dtype=torch.bfloat16)
    assert m2.dtype == torch.bfloat16 and (tmp_path / "c2").is_dir()


def test_init_model_cli(tmp_path: Path) -> None:
    from cpkv.cli.init_model import command

    out = tmp_path / "ckpt"
    r = CliRunner().invoke(command, [str(out), "--seed", "2", "--layers", "2", "--hidden", "32",
                                     "--vocab", "128", "--index-topk", "8"])
    assert r.exit_code == 0, r.output
    assert str(out) in r.output and "parameters" in r.output
    m = DeepseekV32.load(out)
    assert (m.num_layers, m.config.hidden_size, m.config.vocab_size, m.config.index_topk) == (2, 32, 128, 8)
    r = CliRunner().invoke(command, [str(out)])
    assert r.exit_code != 0 and "not empty" in r.output
    r = CliRunner().invoke(command, [str(out), "--force", "--layers", "4"])
    assert r.exit_code == 0, r.output
    assert DeepseekV32.load(out).num_layers == 4
    assert math.isfinite(float(DeepseekV32.load(out).final_logits(torch.zeros(1, 64)).sum()))


def test_the_v32_attention_preset_has_deepseek_v32_attention_shapes(tmp_path: Path) -> None:
    """The preset's config is DeepSeek-V3.2's attention (the fp8 page format is the real 656 +
    132 B per token); the CLI writes it, and size options override it (small here: the full
    preset is ~1 GB of weights)."""
    from cpkv.cli.init_model import command
    from cpkv.models.tiny import PRESETS, tiny_config

    cfg = tiny_config(**PRESETS["v32-attention"])
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
            cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (7168, 128, 512, 64, 64, 128,
                                                                       2048)
    assert cfg.num_hidden_layers == cfg.first_k_dense_replace == 2  # dense: no MoE reference
    out = tmp_path / "v32"
    r = CliRunner().invoke(command, [str(out), "--preset", "v32-attention", "--hidden", "256",
                                     "--heads", "64", "--layers", "1", "--vocab", "64"])
    assert r.exit_code == 0, r.output
    assert "v32-attention" in r.output
    m = DeepseekV32.load(out)
    assert (m.num_layers, m.config.hidden_size, m.config.num_attention_heads) == (1, 256, 64)
    assert (m.config.kv_lora_rank, m.config.index_topk, m.config.index_head_dim) == (512, 2048, 128)
    assert m.kv_format("fp8", 64).bytes_per_token == 656 + 132


@pytest.mark.gpu
def test_rms_norm_on_a_gpu_is_hfs_within_bf16_rounding() -> None:
    """The GPU path (torch's fused rms_norm, the weight inside: rounded once) against HF's op
    sequence (rounded before and after the weight), which the CPU keeps: at most two bf16 ulps
    apart, and closer to the exact product on average."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(512, 7168, generator=g) * 3).to("cuda", torch.bfloat16)
    w = (torch.rand(7168, generator=g) + 0.5).to("cuda", torch.bfloat16)
    got = _rms_norm(x, w, 1e-6).float()
    h = x.float()
    want = (w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)).float()
    step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)  # one bf16 ulp
    assert bool(((got - want).abs() <= 2 * step).all())  # the weight product may round apart
    exact = w.float() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert float((got - exact).abs().mean()) < float((want - exact).abs().mean())


@pytest.mark.gpu
def test_index_weights_on_a_gpu_are_the_fp32_projection(tmp_path: Path) -> None:
    """On GPUs the indexer's head weights are one 16-bit GEMM over the fp32 weight's [hi; lo]
    halves: within ~1e-5 of the fp32 projection HF computes (the CPU computes that one)."""
    m = DeepseekV32.load(write_tiny_checkpoint(tmp_path / "ckpt", seed=2), dtype=torch.bfloat16,
                         device="cuda")
    w = m._layers[0]
    assert w.idx_w_split is not None
    h = torch.randn(300, m.config.hidden_size, device="cuda").to(torch.bfloat16)
    got = m._index_weights(w, h)
    want = torch.nn.functional.linear(h.float(), w.idx_w) * m.index_scale
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) < 5e-5  # hi alone: ~2e-3


# ---------------------------------------------------------------------------- GLM-5 (glm_moe_dsa)
def test_glm5_tiny_checkpoint_loads_in_transformers(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``write_tiny_checkpoint(**ARCHS["glm5"])`` is a GLM-5 checkpoint with a mixed schedule:
    transformers' GlmMoeDsaForCausalLM reads the same schedule and gives the same logits."""
    from cpkv.models.tiny import ARCHS

    ckpt = write_tiny_checkpoint(tmp_path / "glm5", seed=3, **ARCHS["glm5"])
    m = DeepseekV32.load(ckpt)
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()
    assert list(hf.config.indexer_types) == list(m.config.layer_indexers) == [
        "full", "shared", "shared", "full"]
    assert [layer.self_attn.indexer is None for layer in hf.model.layers] == [
        not ix for ix in m.index_layers]
    ids = prompt(m.config.vocab_size, seed=2)
    ours, theirs = reference_logits(m, ids), hf_logits(hf, ids)
    err = rel_err(ours, theirs)
    print(f"write_tiny_checkpoint glm5, float32: max rel err {err:.2e}")
    assert err <= 1e-4 and ours.std() > 0.1
    # the indexer's RoPE is interleaved: half-split (DeepSeek-V3.2's) gives other logits
    monkeypatch.setattr(type(m.config), "index_rope", "half")
    assert rel_err(reference_logits(m, ids), theirs) > 1e-3


@pytest.mark.parametrize("raw", [
    {"indexer_types": ["full", "shared", "full", "full", "shared", "shared"]},
    {"index_topk_pattern": "FSSFSF"},
    {"index_topk_pattern": ["full", "full", "shared", "full", "shared", "shared"]},
    {"index_topk_freq": 3, "index_skip_topk_offset": 1},
    {"index_topk_freq": 4},  # offset 2 by default
    {"index_topk_freq": 2, "index_skip_topk_offset": 3},
    {},  # every layer full
])
def test_glm5_indexer_schedule_in_every_form_is_transformers(raw: dict) -> None:
    from cpkv.models.config import GlmMoeDsaConfig

    want = transformers.GlmMoeDsaConfig(num_hidden_layers=6, **raw).indexer_types
    got = GlmMoeDsaConfig.model_validate({"num_hidden_layers": 6, **raw})
    assert list(got.indexer_types) == list(want)
    assert got.index_k_layers() == tuple(t == "full" for t in want)
    assert got.index_k_layers(mtp=True)[-1] is True  # the MTP layer runs its own indexer


def test_glm5_config_defaults_and_schedule_errors() -> None:
    from cpkv.models.config import GlmMoeDsaConfig

    c = GlmMoeDsaConfig.model_validate({"index_topk_freq": 4})
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.q_lora_rank,
            c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim,
            c.index_n_heads, c.index_head_dim, c.index_topk, c.n_routed_experts,
            c.num_experts_per_tok, c.n_shared_experts, c.vocab_size) == (
        6144, 78, 64, 2048, 512, 64, 192, 256, 32, 128, 2048, 256, 8, 1, 154880)
    assert c.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert 0.2 < c.indexer_types.count("full") / 78 < 0.3  # about a quarter run the indexer
    with pytest.raises(ValueError, match="layer 0 is 'shared'"):
        GlmMoeDsaConfig.model_validate({"num_hidden_layers": 2, "index_topk_pattern": "SF"})
    with pytest.raises(ValueError, match="indexer_types has 3 entries, num_hidden_layers is 2"):
        GlmMoeDsaConfig.model_validate({"num_hidden_layers": 2, "index_topk_pattern": "FSF"})
    with pytest.raises(ValueError, match=r"only F \(full\) and S \(shared\)"):
        GlmMoeDsaConfig.model_validate({"num_hidden_layers": 2, "index_topk_pattern": "FX"})
    with pytest.raises(ValueError, match="model_type must be 'glm_moe_dsa'"):
        GlmMoeDsaConfig.model_validate({"model_type": "deepseek_v32"})


def test_glm5_loader_reads_no_indexer_on_shared_layers(tmp_path: Path) -> None:
    from cpkv.models.tiny import ARCHS

    ckpt = write_tiny_checkpoint(tmp_path / "glm5", seed=3, **ARCHS["glm5"])
    names = set(safetensors_torch.load_file(ckpt / "model.safetensors"))
    assert not any(n.startswith("model.layers.1.self_attn.indexer.") for n in names)
    assert "model.layers.3.self_attn.indexer.wk.weight" in names
    assert "model.layers.4.self_attn.indexer.wk.weight" in names  # the MTP layer: its own

    def extra(s: dict) -> None:  # an indexer on a shared layer: the config says it has none
        s["model.layers.2.self_attn.indexer.wk.weight"] = torch.zeros(16, 64)

    with pytest.raises(ModelLoadError, match=r"unexpected weight\(s\): model\.layers\.2\.self_attn"
                                             r"\.indexer\.wk\.weight") as ei:
        DeepseekV32.load(_copy(ckpt, tmp_path / "x", mutate_state=extra))
    assert "(GLM-5, 4 layers)" in str(ei.value)
    m = DeepseekV32.load(ckpt, mtp=True)
    assert m.index_layers == (True, False, False, True, True) and m.kv_layers == 5
    a = m.attention_inputs(1, torch.randn(3, 64), torch.arange(3))
    assert a.shared and a.index_q is None and a.index_w is None and a.latent.shape == (3, 40)
    assert m.shares_top_after(0) and m.shares_top_after(1) and not m.shares_top_after(2)


@pytest.mark.slow  # 6 CPU seconds
def test_init_model_arch_glm5_and_the_glm5_attention_preset(tmp_path: Path) -> None:
    """``--arch glm5`` writes the tiny GLM-5 (a mixed schedule); the ``glm5-attention`` preset
    is GLM-5's attention (64 heads, q_lora 2048, qk_nope 192, v 256, indexer 32 x 128) with a
    full and a shared layer (size options override it: the full preset is ~0.5 GB)."""
    from cpkv.cli.init_model import command
    from cpkv.models.tiny import PRESETS, tiny_config

    out = tmp_path / "glm5"
    r = CliRunner().invoke(command, [str(out), "--arch", "glm5"])
    assert r.exit_code == 0, r.output
    assert "GLM-5" in r.output
    m = DeepseekV32.load(out)
    assert m.config.model_type == "glm_moe_dsa" and m.index_layers == (True, False, False, True)
    cfg = tiny_config(**PRESETS["glm5-attention"])
    assert (cfg.model_type, cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank,
            cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim,
            cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (
        "glm_moe_dsa", 6144, 64, 2048, 512, 64, 192, 256, 32, 128, 2048)
    assert cfg.indexer_types == ("full", "shared") and cfg.first_k_dense_replace == 2
    small = tmp_path / "att"
    r = CliRunner().invoke(command, [str(small), "--preset", "glm5-attention", "--hidden", "128",
                                     "--vocab", "64", "--layers", "3"])
    assert r.exit_code == 0, r.output
    m = DeepseekV32.load(small)
    assert m.index_layers == (True, False, True) and m.config.num_attention_heads == 64
    fmts = m.kv_formats("fp8", 64)
    assert [f.bytes_per_token for f in fmts] == [656 + 132, 656, 656 + 132]
    r = CliRunner().invoke(command, [str(tmp_path / "bad"), "--arch", "v32", "--preset",
                                     "glm5-attention"])
    assert r.exit_code != 0 and "glm5-attention is a glm5 preset" in r.output
