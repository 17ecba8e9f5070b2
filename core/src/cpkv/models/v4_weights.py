"""Reading a DeepSeek-V4 checkpoint directory (``model_type: deepseek_v4``): ``config.json`` +
``*.safetensors`` in DeepSeek's release naming, the names transformers' ``DeepseekV4ForCausalLM``
converts on load (``layers.{i}.attn.wq_a.weight``, ``layers.{i}.attn.compressor.wkv.weight``,
``layers.{i}.ffn.experts.{e}.w1.weight``, ``hc_head_fn``, ``embed.weight``, ``head.weight``).
A leading ``model.`` (what transformers' ``save_pretrained`` writes before some of them) is
accepted, as is ``embed_tokens`` / ``hc_head.hc_fn`` spelling of the top-level ones. The MTP
draft layer (``mtp.0.*``: a sliding-only block of the same names, ``e_proj`` / ``h_proj`` /
``enorm`` / ``hnorm`` / ``norm`` and its own ``hc_head_*``) is read only when asked for
(``mtp=True``); otherwise its weights are skipped.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from .errors import ModelLoadError
from .loader import invalid_config, read_config_json, shard_keys
from .v4_config import CSA, HCA, SWA, DeepseekV4Config

__all__ = ["MTP_PREFIX", "V4CheckpointReader", "is_v4_checkpoint", "read_v4_config",
           "v4_expected_shapes", "v4_mtp_shapes"]

_ALIASES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
            "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
            "hc_head.hc_scale": "hc_head_scale"}


def _canonical(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    return _ALIASES.get(name, name)


def is_v4_checkpoint(path: str | Path) -> bool:
    """Whether ``path/config.json`` says ``model_type: deepseek_v4`` (False when unreadable:
    the family's own reader reports that)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") == "deepseek_v4"


def read_v4_config(path: str | Path) -> DeepseekV4Config:
    """Parse ``path/config.json`` as a DeepSeek-V4 config.

    Raises:
        ModelLoadError: no such directory or file, unreadable JSON, another model type, or a
            value cpkv cannot serve (the message names the field and the value).
    """
    cfg_file, raw = read_config_json(path)
    try:
        return DeepseekV4Config.model_validate(raw)
    except ValidationError as exc:
        raise invalid_config(cfg_file, DeepseekV4Config.family, exc) from exc


def _compressor(p: str, d: int, rate: int, hs: int, overlap: bool) -> dict[str, tuple[int, ...]]:
    w = 2 * d if overlap else d
    return {f"{p}.wkv.weight": (w, hs), f"{p}.wgate.weight": (w, hs), f"{p}.ape": (rate, w),
            f"{p}.norm.weight": (d,)}


def _layer_shapes(cfg: DeepseekV4Config, p: str, kind: str, mlp: str
                  ) -> dict[str, tuple[int, ...]]:
    """One block's weights under prefix ``p`` (``layers.{i}`` or the MTP layer's ``mtp.0``)."""
    hs, nh, hd, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    inter, e = cfg.moe_intermediate_size, cfg.n_routed_experts
    mix = (2 + n) * n
    a, f = f"{p}.attn", f"{p}.ffn"
    out: dict[str, tuple[int, ...]] = {f"{p}.attn_norm.weight": (hs,), f"{p}.ffn_norm.weight": (hs,)}
    for hc in ("attn", "ffn"):
        out |= {f"{p}.hc_{hc}_fn": (mix, n * hs), f"{p}.hc_{hc}_base": (mix,),
                f"{p}.hc_{hc}_scale": (3,)}
    out |= {f"{a}.wq_a.weight": (cfg.q_lora_rank, hs), f"{a}.q_norm.weight": (cfg.q_lora_rank,),
            f"{a}.wq_b.weight": (nh * hd, cfg.q_lora_rank), f"{a}.wkv.weight": (hd, hs),
            f"{a}.norm.weight": (hd,),
            f"{a}.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, nh * hd // cfg.o_groups),
            f"{a}.wo_b.weight": (hs, cfg.o_groups * cfg.o_lora_rank), f"{a}.attn_sink": (nh,)}
    if kind == CSA:
        out |= _compressor(f"{a}.compressor", hd, cfg.compress_rate_csa, hs, True)
        out |= _compressor(f"{a}.indexer.compressor", cfg.index_head_dim,
                           cfg.compress_rate_csa, hs, True)
        out |= {f"{a}.indexer.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim,
                                             cfg.q_lora_rank),
                f"{a}.indexer.weights_proj.weight": (cfg.index_n_heads, hs)}
    elif kind == HCA:
        out |= _compressor(f"{a}.compressor", hd, cfg.compress_rate_hca, hs, False)
    out[f"{f}.gate.weight"] = (e, hs)
    if mlp == "hash_moe":
        out[f"{f}.gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
    else:
        out[f"{f}.gate.bias"] = (e,)
    for j in range(e):
        out |= {f"{f}.experts.{j}.w1.weight": (inter, hs), f"{f}.experts.{j}.w3.weight": (inter, hs),
                f"{f}.experts.{j}.w2.weight": (hs, inter)}
    out |= {f"{f}.shared_experts.w1.weight": (inter, hs),
            f"{f}.shared_experts.w3.weight": (inter, hs),
            f"{f}.shared_experts.w2.weight": (hs, inter)}
    return out


#: the MTP draft layer's prefix; it is sliding-only with a routed (not hash-routed) MoE, as
#: DeepSeek's reference builds it (``MTPBlock(n_layers, ...)``)
MTP_PREFIX = "mtp.0"


def v4_mtp_shapes(cfg: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    """The MTP draft layer's weights (canonical names) and shapes: its block and its wrapper
    (``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm``, ``hc_head_*``)."""
    hs, n, p = cfg.hidden_size, cfg.hc_mult, MTP_PREFIX
    out = _layer_shapes(cfg, p, SWA, "moe")
    out |= {f"{p}.e_proj.weight": (hs, hs), f"{p}.h_proj.weight": (hs, hs),
            f"{p}.enorm.weight": (hs,), f"{p}.hnorm.weight": (hs,), f"{p}.norm.weight": (hs,),
            f"{p}.hc_head_fn": (n, n * hs), f"{p}.hc_head_base": (n,), f"{p}.hc_head_scale": (1,)}
    return out


def v4_expected_shapes(cfg: DeepseekV4Config, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every weight the model reads (canonical names) and its shape, in a fixed order; ``mtp``:
    the MTP draft layer's too (last)."""
    hs, n = cfg.hidden_size, cfg.hc_mult
    out: dict[str, tuple[int, ...]] = {"embed.weight": (cfg.vocab_size, hs)}
    for i, kind in enumerate(cfg.layer_types):
        out |= _layer_shapes(cfg, f"layers.{i}", kind, cfg.mlp_layer_types[i])
    out |= {"norm.weight": (hs,), "head.weight": (cfg.vocab_size, hs),
            "hc_head_fn": (n, n * hs), "hc_head_base": (n,), "hc_head_scale": (1,)}
    if mtp:
        out |= v4_mtp_shapes(cfg)
    return out


class V4CheckpointReader:
    """Validated, lazily read weights of one DeepSeek-V4 checkpoint (a context manager)."""

    def __init__(self, path: str | Path, cfg: DeepseekV4Config | None = None, *,
                 mtp: bool = False) -> None:
        """Open every shard and check names and shapes against the config; ``mtp``: the MTP
        draft layer's weights too (skipped otherwise).

        Raises:
            ModelLoadError: unreadable files, missing / unexpected / mis-shaped weights, or a
                quantised weight (FP8 / FP4 with a scale: cpkv reads 16/32-bit floats); ``mtp``
                asked of a checkpoint without an MTP layer.
        """
        self.path = Path(path)
        self.mtp = mtp
        self.config = cfg if cfg is not None else read_v4_config(self.path)
        self._stack = ExitStack()
        self._where: dict[str, tuple[Any, str]] = {}
        try:
            for handle, k in shard_keys(self.path, self._stack):
                c = _canonical(k)
                if c.startswith("mtp.") and not mtp:
                    continue
                if c in self._where:
                    raise ModelLoadError(f"{self.path}: weight {c!r} is stored twice")
                self._where[c] = (handle, k)
            self._validate()
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> V4CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _validate(self) -> None:
        cfg = self.config
        expected = v4_expected_shapes(cfg, self.mtp)
        keys = set(self._where)
        if self.mtp and not any(k.startswith("mtp.") for k in keys):
            raise ModelLoadError(f"{self.path}: the checkpoint has no MTP draft layer (no mtp.0.* "
                                 "weights; num_nextn_predict_layers is "
                                 f"{cfg.num_nextn_predict_layers}): run it without --mtp")
        if cfg.tie_word_embeddings and "head.weight" not in keys:
            del expected["head.weight"]
        self.tied_head = "head.weight" not in expected
        scales = sorted(k for k in keys if k.endswith((".scale", "_scale_inv")))
        if scales:
            raise ModelLoadError(f"{self.path}: quantised weights ({', '.join(scales[:3])}): cpkv "
                                 "reads DeepSeek-V4 weights in 16/32-bit floats only")
        problems = []
        missing, unexpected = sorted(expected.keys() - keys), sorted(keys - expected.keys())
        if missing:
            problems.append(f"{len(missing)} missing weight(s): {', '.join(missing[:5])}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected weight(s): {', '.join(unexpected[:5])}")
        for k in sorted(expected.keys() & keys):
            h, raw = self._where[k]
            got = tuple(h.get_slice(raw).get_shape())
            if got != expected[k]:
                problems.append(f"{k} has shape {list(got)}, expected {list(expected[k])}")
        if problems:
            raise ModelLoadError(f"{self.path}: checkpoint does not match its config.json "
                                 f"(DeepSeek-V4, {cfg.num_hidden_layers} layers): "
                                 + ". ".join(problems[:8]))

    def get(self, name: str, dtype: torch.dtype | None,
            device: torch.device | str = "cpu") -> torch.Tensor:
        """One weight (canonical name) in ``dtype`` (None: as stored) on ``device``."""
        h, raw = self._where[name]
        t = h.get_tensor(raw)
        return t.to(device=device, dtype=dtype if dtype is not None else t.dtype)
