"""Reading an HF-format DSA checkpoint directory (DeepSeek-V3.2 ``deepseek_v32``, GLM-5
``glm_moe_dsa``): ``config.json`` + ``*.safetensors``.

Names are transformers' (``model.layers.{i}.self_attn.q_a_proj.weight``, ...). Routed experts come in
either layout: per expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (DeepSeek's release and what
transformers 5 ``save_pretrained`` writes) or packed ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` /
``mlp.experts.down_proj`` ``[E, H, I]`` (transformers' in-memory layout). FP8 block-quantised weights
(``*.weight`` in float8_e4m3fn with ``*.weight_scale_inv``, DeepSeek's release) are dequantised on load.
The multi-token-prediction (MTP) layer ``model.layers.{num_hidden_layers}.*`` (DeepSeek's release
naming, see :func:`mtp_shapes`) is read only when asked for (``mtp=True``); otherwise it is ignored.
Its ``embed_tokens`` and ``shared_head.head`` may be absent: the main model's are shared then.
A GLM-5 shared-indexer layer has no ``self_attn.indexer.*`` weights; the MTP layer runs its own
indexer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from cpkv.logs import get_logger

from .config import DeepseekV32Config, config_class
from .errors import ModelLoadError

__all__ = ["CheckpointReader", "expected_shapes", "invalid_config", "mtp_shapes", "read_config",
           "read_config_json", "shard_files", "shard_keys"]

log = get_logger(__name__)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_SCALE_SUFFIX = "_scale_inv"


def read_config_json(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """``(path/config.json, its JSON object)``; :class:`ModelLoadError` naming what is wrong
    (no such directory, no config.json, unreadable JSON, not an object)."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"checkpoint path {path} is not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"{path} has no config.json: not an HF-format checkpoint directory")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{cfg_file}: cannot read JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{cfg_file}: expected a JSON object")
    return cfg_file, raw


def invalid_config(cfg_file: Path, family: str, exc: ValidationError) -> ModelLoadError:
    """The :class:`ModelLoadError` of a config that fails validation: every field and why."""
    msgs = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
    return ModelLoadError(f"{cfg_file}: invalid {family} config: {msgs}")


def read_config(path: str | Path) -> DeepseekV32Config:
    """Parse ``path/config.json``; :class:`ModelLoadError` with a clear message for anything wrong."""
    cfg_file, raw = read_config_json(path)
    try:
        cls = config_class(raw.get("model_type"))
    except ValueError as exc:
        raise ModelLoadError(f"{cfg_file}: {exc}") from exc
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise invalid_config(cfg_file, cls.family, exc) from exc


def _few(names: Iterable[str], n: int = 5) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _layer_shapes(cfg: DeepseekV32Config, i: int, mlp_type: str, packed: bool,
                  indexer: bool = True) -> dict[str, tuple[int, ...]]:
    """The weights of decoder layer ``i`` (``model.layers.{i}.*``) and their shapes (no indexer
    weights without ``indexer``: a shared-indexer layer)."""
    hs, nh = cfg.hidden_size, cfg.num_attention_heads
    p = f"model.layers.{i}"
    a = f"{p}.self_attn"
    out: dict[str, tuple[int, ...]] = {
        f"{p}.input_layernorm.weight": (hs,),
        f"{p}.post_attention_layernorm.weight": (hs,),
        f"{a}.q_a_proj.weight": (cfg.q_lora_rank, hs),
        f"{a}.q_a_layernorm.weight": (cfg.q_lora_rank,),
        f"{a}.q_b_proj.weight": (nh * cfg.qk_head_dim, cfg.q_lora_rank),
        f"{a}.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, hs),
        f"{a}.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        f"{a}.kv_b_proj.weight": (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        f"{a}.o_proj.weight": (hs, nh * cfg.v_head_dim),
    }
    if indexer:
        out |= {
            f"{a}.indexer.wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
            f"{a}.indexer.wk.weight": (cfg.index_head_dim, hs),
            f"{a}.indexer.k_norm.weight": (cfg.index_head_dim,),
            f"{a}.indexer.k_norm.bias": (cfg.index_head_dim,),
            f"{a}.indexer.weights_proj.weight": (cfg.index_n_heads, hs),
        }
    m = f"{p}.mlp"
    if mlp_type == "dense":
        inter = cfg.intermediate_size
        return out | {f"{m}.gate_proj.weight": (inter, hs), f"{m}.up_proj.weight": (inter, hs),
                      f"{m}.down_proj.weight": (hs, inter)}
    e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    out |= {f"{m}.gate.weight": (e, hs), f"{m}.gate.e_score_correction_bias": (e,)}
    if packed:
        out |= {f"{m}.experts.gate_up_proj": (e, 2 * inter, hs), f"{m}.experts.down_proj": (e, hs, inter)}
    else:
        for j in range(e):
            out |= {f"{m}.experts.{j}.gate_proj.weight": (inter, hs),
                    f"{m}.experts.{j}.up_proj.weight": (inter, hs),
                    f"{m}.experts.{j}.down_proj.weight": (hs, inter)}
    if cfg.n_shared_experts:
        si = inter * cfg.n_shared_experts
        out |= {f"{m}.shared_experts.gate_proj.weight": (si, hs),
                f"{m}.shared_experts.up_proj.weight": (si, hs),
                f"{m}.shared_experts.down_proj.weight": (hs, si)}
    return out


def mtp_shapes(cfg: DeepseekV32Config, packed: bool = False) -> dict[str, tuple[int, ...]]:
    """The first MTP layer's weights in DeepSeek's release naming (``model.layers.{L}.*`` with
    ``L = num_hidden_layers``): ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj`` ``[H, 2H]``,
    the decoder layer (DSA attention with its indexer, MLP or MoE), ``shared_head.norm``,
    ``shared_head.head``."""
    hs, L = cfg.hidden_size, cfg.num_hidden_layers
    p = f"model.layers.{L}"
    return {f"{p}.embed_tokens.weight": (cfg.vocab_size, hs), f"{p}.enorm.weight": (hs,),
            f"{p}.hnorm.weight": (hs,), f"{p}.eh_proj.weight": (hs, 2 * hs),
            **_layer_shapes(cfg, L, cfg.mtp_mlp_type, packed),
            f"{p}.shared_head.norm.weight": (hs,), f"{p}.shared_head.head.weight": (cfg.vocab_size, hs)}


def expected_shapes(cfg: DeepseekV32Config, packed_layers: Iterable[int] = (), *,
                    mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every weight name the model needs and its shape, in a fixed order (the MTP layer's last,
    with ``mtp``).

    Layers in ``packed_layers`` expect the packed expert layout, the others the per-expert one.
    """
    packed = set(packed_layers)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i, kind in enumerate(cfg.layer_indexers):
        out |= _layer_shapes(cfg, i, cfg.mlp_layer_types[i], i in packed, kind == "full")
    out["model.norm.weight"] = (cfg.hidden_size,)
    out["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if mtp:
        out |= mtp_shapes(cfg, cfg.num_hidden_layers in packed)
    return out


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (its index's, else every ``*.safetensors``).

    Raises:
        ModelLoadError: an unreadable index, missing shards, or no weight file.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: cannot read the weight_map: {exc}") from exc
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shard files that are missing: {_few(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    return files


def shard_keys(path: Path, stack: ExitStack) -> Iterator[tuple[Any, str]]:
    """Every stored weight name of the checkpoint at ``path`` with the open safetensors handle
    that holds it (each shard opened into ``stack``, closed with it).

    Raises:
        ModelLoadError: an unreadable index or shard (see :func:`shard_files`).
    """
    from safetensors import SafetensorError, safe_open

    for f in shard_files(path):
        try:
            handle = stack.enter_context(safe_open(str(f), framework="pt"))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{f}: not a readable safetensors file: {exc}") from exc
        for k in handle.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
            yield handle, k


class CheckpointReader:
    """Validated, lazily read weights of one checkpoint directory (use as a context manager)."""

    def __init__(self, path: str | Path, cfg: DeepseekV32Config | None = None, *,
                 mtp: bool = False) -> None:
        """Open every shard and check names and shapes against the config.

        Args:
            mtp: also read (and require) the first MTP layer.

        Raises:
            ModelLoadError: unreadable files, missing/unexpected/mis-shaped weights, or ``mtp``
                asked of a checkpoint without an MTP layer.
        """

        self.path = Path(path)
        self.config = cfg if cfg is not None else read_config(self.path)
        self.mtp = mtp
        if mtp and self.config.num_nextn_predict_layers < 1:
            raise ModelLoadError(f"{self.path}: the MTP draft layer was asked for, but this checkpoint "
                                 f"has none (config.json: num_nextn_predict_layers = "
                                 f"{self.config.num_nextn_predict_layers}); load it without MTP")
        self._stack = ExitStack()
        self._where: dict[str, Any] = {}
        try:
            for handle, k in shard_keys(self.path, self._stack):
                if k in self._where:
                    raise ModelLoadError(f"{self.path}: weight {k!r} is stored in more than one shard")
                self._where[k] = handle
            self._validate()
        except BaseException:
            self._stack.close()
            raise

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        cfg = self.config
        keys = set(self._where)
        ignored = set()
        last = cfg.num_hidden_layers + (1 if self.mtp else 0)  # layers read: [0, last)
        for k in keys:
            m = _LAYER_RE.match(k)
            if (m and int(m.group(1)) >= last) or k.endswith("rotary_emb.inv_freq"):
                ignored.add(k)
        if ignored:
            log.info("ignoring weights the model does not use (MTP layer / rope buffers)",
                     count=len(ignored), example=min(ignored), path=str(self.path))
        keys -= ignored
        self.packed_layers = {i for i in range(last)
                              if f"model.layers.{i}.mlp.experts.gate_up_proj" in keys}
        expected = expected_shapes(cfg, self.packed_layers, mtp=self.mtp)
        if cfg.tie_word_embeddings and "lm_head.weight" not in keys:
            del expected["lm_head.weight"]
        self.tied_lm_head = "lm_head.weight" not in expected
        #: MTP ``embed_tokens`` / ``shared_head.head`` absent: the main model's are shared
        self.mtp_shared: set[str] = set()
        if self.mtp:
            p = f"model.layers.{cfg.num_hidden_layers}"
            for name in (f"{p}.embed_tokens.weight", f"{p}.shared_head.head.weight"):
                if name not in keys:
                    del expected[name]
                    self.mtp_shared.add(name)
            if len(keys & {k for k in expected if k.startswith(p + ".")}) == 0:
                raise ModelLoadError(f"{self.path}: the MTP draft layer was asked for, but no "
                                     f"{p}.* weight is stored (config.json says "
                                     f"num_nextn_predict_layers = {cfg.num_nextn_predict_layers})")
        scales = {k for k in keys if k.endswith(_SCALE_SUFFIX) and k[: -len(_SCALE_SUFFIX)] in expected}
        missing = expected.keys() - keys
        unexpected = keys - expected.keys() - scales
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing weight(s): {_few(missing)}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected weight(s): {_few(unexpected)}")
        bad = []
        for k in sorted(expected.keys() & keys):
            got = tuple(self._where[k].get_slice(k).get_shape())
            if got != expected[k]:
                bad.append(f"{k} has shape {list(got)}, expected {list(expected[k])}")
        if bad:
            more = f" ... and {len(bad) - 5} more" if len(bad) > 5 else ""
            problems.append(f"{len(bad)} mis-shaped weight(s): " + "; ".join(bad[:5]) + more)
        if problems:
            raise ModelLoadError(f"{self.path}: checkpoint does not match its config.json "
                                 f"({cfg.family}, {cfg.num_hidden_layers} layers): " + ". ".join(problems))
        self._scales = scales
        self.expected = expected

    # ------------------------------------------------------------------ reading
    def get(self, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """One weight, dequantised when stored as FP8 with a block scale, in ``dtype`` on ``device``."""
        t = self._where[name].get_tensor(name)
        scale_name = name + _SCALE_SUFFIX
        if scale_name in self._scales:
            t = _dequant_blocks(t, self._where[scale_name].get_tensor(scale_name), name)
        return t.to(device=device, dtype=dtype)

    def experts(self, layer: int, dtype: torch.dtype, device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed experts packed: ``gate_up [E, 2I, H]`` (gate rows first), ``down [E, H, I]``."""
        m = f"model.layers.{layer}.mlp.experts"
        if layer in self.packed_layers:
            return self.get(f"{m}.gate_up_proj", dtype, device), self.get(f"{m}.down_proj", dtype, device)
        e = self.config.n_routed_experts
        gate_up = torch.stack([torch.cat([self.get(f"{m}.{j}.gate_proj.weight", dtype, device),
                                          self.get(f"{m}.{j}.up_proj.weight", dtype, device)])
                               for j in range(e)])
        down = torch.stack([self.get(f"{m}.{j}.down_proj.weight", dtype, device) for j in range(e)])
        return gate_up, down

    def names(self) -> Iterator[str]:
        return iter(self.expected)


def _dequant_blocks(w: torch.Tensor, scale_inv: torch.Tensor, name: str) -> torch.Tensor:
    """DeepSeek FP8 block dequantisation: ``w * scale_inv`` with one scale per ``[bo, bi]`` block."""
    if w.dim() != 2 or scale_inv.dim() != 2:
        raise ModelLoadError(f"{name}: block scale needs 2-D weight and scale, got {list(w.shape)} "
                             f"and {list(scale_inv.shape)}")
    (o, i), (so, si) = w.shape, scale_inv.shape
    bo, bi = -(-o // so), -(-i // si)
    if -(-o // bo) != so or -(-i // bi) != si:
        raise ModelLoadError(f"{name}: scale shape {[so, si]} does not tile weight shape {[o, i]}")
    s = scale_inv.float().repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
    return w.float() * s
