"""A tiny random DeepSeek-V3.2 or GLM-5 checkpoint in the HF format, and :func:`load_model`.

:func:`write_tiny_checkpoint` writes ``config.json`` (``model_type: deepseek_v32``, or
``glm_moe_dsa`` with ``model_type="glm_moe_dsa"``, e.g. ``**ARCHS["glm5"]``: a mixed schedule of
full and shared-indexer layers; default rope) and one ``model.safetensors`` (per-expert layout,
float32) that transformers' ``DeepseekV32ForCausalLM`` / ``GlmMoeDsaForCausalLM``
``.from_pretrained`` loads as well. Weights are deterministic for a seed and scaled so activations stay
well-conditioned (projections ~ N(0, 1/fan_in), output projections half that, norms ~ 1).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from .config import GLM_MODEL_TYPE, DeepseekV32Config, GlmMoeDsaConfig, config_class
from .deepseek_v32 import DeepseekV32
from .errors import ModelLoadError
from .loader import expected_shapes
from .v4_config import V4_MODEL_TYPE, DeepseekV4Config
from .v4_tiny import V4_PRESETS, v4_tiny_config, v4_tiny_state

__all__ = ["ARCHS", "PRESETS", "TINY_DEFAULTS", "checkpoint_num_parameters", "default_cache_dir",
           "load_model", "tiny_config", "write_tiny_checkpoint"]

TINY_DEFAULTS: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "index_n_heads": 16,  # with few heads sum_h w relu(q.k) is often exactly 0: ties
    "index_head_dim": 16,
    "index_topk": 16,
    "n_routed_experts": 8,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,  # an MTP draft layer, as DeepSeek-V3.2 ships
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}

#: the architectures of the tiny model (``cpkv init-model --arch``): overrides of
#: :data:`TINY_DEFAULTS`. ``glm5``: GLM-5 (``glm_moe_dsa``) with 4 layers on the schedule
#: ``index_topk_freq = 3``, ``index_skip_topk_offset = 1``: full, shared, shared, full (layer i is
#: full when ``(i - offset + 1) % freq == 0``; longer models continue it), and GLM-5's eps
ARCHS: dict[str, dict[str, Any]] = {
    "v32": {},
    "glm5": {"model_type": GLM_MODEL_TYPE, "num_hidden_layers": 4, "index_topk_freq": 3,
             "index_skip_topk_offset": 1, "rms_norm_eps": 1e-5},
    # DeepSeek-V4: its own defaults (:data:`cpkv.models.v4_tiny.V4_TINY_DEFAULTS`)
    "v4": {"model_type": V4_MODEL_TYPE},
}

#: named overrides of :data:`TINY_DEFAULTS` (``cpkv init-model --preset``)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    # DeepSeek-V3.2's attention at full size (hidden 7168, 128 heads, latent 512 + rope 64,
    # indexer 64 x 128, top-2048) in 2 dense layers with a small MLP and vocabulary: the GPU job
    # runs the real kernel shapes (the MoE reference computes every expert; engines bring theirs)
    "v32-attention": dict(
        hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
        index_head_dim=128, index_topk=2048, intermediate_size=2048, vocab_size=1024,
        num_hidden_layers=2, first_k_dense_replace=2, max_position_embeddings=163840,
        num_nextn_predict_layers=0,  # ~0.4 G parameters more; init-model --mtp adds it
    ),
    # GLM-5's attention at full size (hidden 6144, 64 heads, q_lora 2048, latent 512 + rope 64,
    # qk_nope 192, v 256, indexer 32 x 128, top-2048) in 2 dense layers: the first runs its
    # indexer, the second is a shared-indexer layer (latent-only KV, the first's top-k)
    "glm5-attention": dict(
        model_type=GLM_MODEL_TYPE, hidden_size=6144, num_attention_heads=64, q_lora_rank=2048,
        kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
        index_n_heads=32, index_head_dim=128, index_topk=2048, intermediate_size=2048,
        vocab_size=1024, num_hidden_layers=2, first_k_dense_replace=2,
        index_topk_freq=2, index_skip_topk_offset=1, rms_norm_eps=1e-5,
        max_position_embeddings=202752, num_nextn_predict_layers=0,
    ),
    # DeepSeek-V4-Flash's / V4-Pro's attention at full size (:data:`V4_PRESETS`)
    **{k: {"model_type": V4_MODEL_TYPE, **v} for k, v in V4_PRESETS.items() if k != "tiny"},
}

#: ``draft="agree"``: the residual branches (o_proj, down projections) of every layer are scaled
#: by this, so the target's next token is mostly a function of the current one, and the MTP layer
#: is built to compute that function (see :func:`_agreeing_draft`)
AGREE_BRANCH_SCALE = 0.05
DRAFTS = ("random", "agree")

_FORMAT_VERSION = 2  # bump when the generated weights change for the same parameters
_ALLOWED = (set(DeepseekV32Config.model_fields) | set(GlmMoeDsaConfig.model_fields)
            | {"rope_parameters", "rope_theta", "rope_scaling", "index_topk_pattern",
               "index_topk_freq", "index_skip_topk_offset"})


def tiny_config(**overrides: Any) -> DeepseekV32Config | DeepseekV4Config:
    """The tiny model's config: :data:`TINY_DEFAULTS` with ``overrides`` (config.json keys;
    ``model_type`` picks the family, every form of a GLM-5 indexer schedule is taken;
    ``deepseek_v4``: :func:`~cpkv.models.v4_tiny.v4_tiny_config`)."""
    if overrides.get("model_type") == V4_MODEL_TYPE:
        return v4_tiny_config(**overrides)
    unknown = set(overrides) - _ALLOWED
    if unknown:
        raise TypeError(f"unknown tiny-model parameter(s): {sorted(unknown)}")
    raw = {**TINY_DEFAULTS, **overrides}
    if ("rope_scaling" in overrides or "rope_theta" in overrides) and "rope_parameters" not in overrides:
        raw.pop("rope_parameters")  # the legacy keys given: let them define the rope
    return config_class(raw.get("model_type", "deepseek_v32")).model_validate(raw)


def _init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):  # indexer k_norm bias
        return 0.1 * torch.randn(shape, generator=gen)
    if leaf == "e_score_correction_bias":
        return 0.02 * torch.randn(shape, generator=gen)
    if leaf == "embed_tokens":
        return torch.randn(shape, generator=gen)
    fan_in = shape[-1]
    std = 1.0 / math.sqrt(fan_in)
    if leaf in ("o_proj", "down_proj"):
        std *= 0.5  # residual branches: keep the stream from growing layer over layer
    return std * torch.randn(shape, generator=gen)


def _tiny_state(cfg: DeepseekV32Config | DeepseekV4Config, seed: int,
                draft: str = "random") -> dict[str, torch.Tensor]:
    if isinstance(cfg, DeepseekV4Config):
        if draft != "random":
            raise ValueError(f"draft={draft!r} is built for DeepSeek-V3.2 / GLM-5 checkpoints; a "
                             "DeepSeek-V4 one takes draft='random'")
        return v4_tiny_state(cfg, seed)
    gen = torch.Generator().manual_seed(seed)
    # the MTP layer's weights come last: the target's are the same with or without it
    shapes = expected_shapes(cfg, mtp=cfg.num_nextn_predict_layers > 0)
    if cfg.tie_word_embeddings:
        del shapes["lm_head.weight"]
    state = {name: _init(name, shape, gen).contiguous() for name, shape in shapes.items()}
    if draft == "agree":
        _agreeing_draft(state, cfg)
    return state


def _agreeing_draft(state: dict[str, torch.Tensor], cfg: DeepseekV32Config) -> None:
    """Make the MTP layer agree with the target, in place.

    Every layer's residual branches (``o_proj``, MLP/expert ``down_proj``) are scaled by
    :data:`AGREE_BRANCH_SCALE`: the target's last hidden state is then mostly the embedding of
    the current token, so its greedy next token is (mostly) ``g(t) = argmax lm_head(norm(
    embed(t)))``. The MTP layer at row i sees ``t_{i+1}`` and must guess the target's choice
    after it, ``g(t_{i+1})``: its ``eh_proj`` passes the (normed) embedding through and drops
    ``h``, its own branches are scaled alike, and ``shared_head`` is the target's final norm and
    ``lm_head``. Attention still contributes a little everywhere, so the two disagree now and
    then (both paths of speculative acceptance run)."""
    if cfg.num_nextn_predict_layers < 1:
        raise ValueError("draft='agree' needs an MTP layer (num_nextn_predict_layers >= 1)")
    for name, t in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")) or name.endswith(".experts.down_proj"):
            t.mul_(AGREE_BRANCH_SCALE)
    hs, p = cfg.hidden_size, f"model.layers.{cfg.num_hidden_layers}"
    state[f"{p}.enorm.weight"] = torch.ones(hs)
    state[f"{p}.eh_proj.weight"] = torch.cat([torch.eye(hs), torch.zeros(hs, hs)], dim=1)
    state[f"{p}.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state[f"{p}.shared_head.norm.weight"] = state["model.norm.weight"].clone()
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    state[f"{p}.shared_head.head.weight"] = head.clone()


def _write_files(dst: Path, cfg: DeepseekV32Config | DeepseekV4Config, seed: int,
                 draft: str = "random") -> None:
    from safetensors.torch import save_file

    save_file(_tiny_state(cfg, seed, draft), str(dst / "model.safetensors"), metadata={"format": "pt"})
    body = cfg.hf_dict() | {"cpkv_tiny_seed": seed} | ({"cpkv_tiny_draft": draft} if draft != "random"
                                                        else {})
    (dst / "config.json").write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")


def write_tiny_checkpoint(path: str | Path, *, seed: int = 0, overwrite: bool = False,
                          draft: str = "random", **overrides: Any) -> Path:
    """Write a tiny random DeepSeek-V3.2 checkpoint to ``path`` and return it.

    ``overrides`` are config.json keys over :data:`TINY_DEFAULTS` (which include one MTP layer:
    ``num_nextn_predict_layers=0`` writes none). ``draft="agree"`` builds the target and its MTP
    layer so that the draft mostly guesses the target's next token (:func:`_agreeing_draft`).
    The write is atomic: files go to a temporary directory next to ``path`` that is renamed into
    place, so an interrupted write leaves no half checkpoint. An existing non-empty ``path``
    raises :class:`FileExistsError` unless ``overwrite`` (then ``model.safetensors`` and
    ``config.json`` are replaced, each atomically, config last).
    """
    cfg = tiny_config(**overrides)
    if draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {draft!r}")
    if draft == "agree" and cfg.num_nextn_predict_layers < 1:
        raise ValueError("draft='agree' needs an MTP layer (num_nextn_predict_layers >= 1)")
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    non_empty = path.exists() and (not path.is_dir() or any(path.iterdir()))
    if non_empty and not overwrite:
        raise FileExistsError(f"{path} exists and is not empty")
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    _remove_stale_temporaries(path)
    # the writer's pid in the name: a later write removes what a killed one left (SIGKILL runs
    # no cleanup)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_tmp_prefix(path)}{os.getpid()}-", dir=path.parent))
    try:
        _write_files(tmp, cfg, seed, draft)
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():  # as any new file: safetensors writes 0600
            os.chmod(f, 0o666 & ~umask)
        if non_empty:
            os.replace(tmp / "model.safetensors", path / "model.safetensors")
            os.replace(tmp / "config.json", path / "config.json")
        else:
            os.chmod(tmp, 0o777 & ~umask)
            try:
                os.replace(tmp, path)  # replaces an empty directory; fails if another writer won the race
            except OSError:
                if not (path / "config.json").is_file():
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _tmp_prefix(path: Path) -> str:
    return f".{path.name}.tmp-"


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary directories of writes of ``path`` whose writer process is gone."""
    for d in path.parent.glob(f"{_tmp_prefix(path)}*"):
        pid = d.name[len(_tmp_prefix(path)):].split("-", 1)[0]
        if not pid.isdigit() or not d.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def checkpoint_num_parameters(path: str | Path) -> int:
    """Number of parameters stored in a checkpoint directory's safetensors files (headers only)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                total += math.prod(h.get_slice(k).get_shape())
    return total


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/cpkv/models`` (``~/.cache/cpkv/models`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cpkv" / "models"


def _tiny_key(seed: int, overrides: dict[str, Any], draft: str = "random") -> str:
    cfg = tiny_config(**overrides)
    body: dict[str, Any] = {"v": _FORMAT_VERSION, "seed": seed, "config": cfg.hf_dict()}
    if draft != "random":
        body["draft"] = draft
    blob = json.dumps(body, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def resolve_checkpoint(path_or_tiny: str | Path, cache_dir: str | Path | None = None, *,
                       seed: int = 0, draft: str = "random", **tiny_overrides: Any) -> Path:
    """The checkpoint directory for ``path_or_tiny``; ``"tiny"`` is written once into the cache
    (``<cache_dir>/tiny-<hash of seed, config and draft>``, ``cache_dir`` defaulting to
    :func:`default_cache_dir`). Safe when several ranks call it at once.

    Raises:
        ModelLoadError: a path that is neither ``"tiny"`` nor an existing directory.
    """
    if str(path_or_tiny) == "tiny":
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        ckpt = root / f"tiny-{_tiny_key(seed, tiny_overrides, draft)}"
        if not (ckpt / "config.json").is_file():
            with contextlib.suppress(FileExistsError):
                write_tiny_checkpoint(ckpt, seed=seed, draft=draft, **tiny_overrides)
        return ckpt
    if tiny_overrides or draft != "random":
        raise TypeError(f"tiny-model parameters given for a checkpoint path: {sorted(tiny_overrides)}")
    path = Path(path_or_tiny).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{path_or_tiny!r} is neither 'tiny' nor an existing checkpoint directory")
    return path


def load_model(path_or_tiny: str | Path, cache_dir: str | Path | None = None,
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               *, seed: int = 0, mtp: bool = False, draft: str = "random",
               **tiny_overrides: Any) -> DeepseekV32:
    """Load a checkpoint directory, or ``"tiny"``: the tiny model, written once into the cache and
    loaded through the same loader as any other (see :func:`resolve_checkpoint`). ``mtp``: with
    the MTP draft layer (:class:`ModelLoadError` when the checkpoint has none)."""
    ckpt = resolve_checkpoint(path_or_tiny, cache_dir, seed=seed, draft=draft, **tiny_overrides)
    return DeepseekV32.load(ckpt, dtype=dtype, device=device, mtp=mtp)
