"""The fields of an HF ``config.json`` of DeepSeek-V4 (``model_type: deepseek_v4``) that cpkv
serves: :class:`DeepseekV4Config`.

Every form transformers 5.25's ``DeepseekV4Config`` accepts is taken and normalised the same way:

* ``layer_types`` (``sliding_attention`` / ``compressed_sparse_attention`` /
  ``heavily_compressed_attention``); else the legacy per-layer ``compress_ratios`` (0 / 4 / 128);
  else V4-Pro's default (2 HCA layers, then HCA / CSA alternating). Truncated to
  ``num_hidden_layers`` (DeepSeek's release lists the MTP layer too).
* ``compress_rates`` ``{layer type: rate}`` (defaults 4 and 128; legacy ``compress_rate_csa`` /
  ``compress_rate_hca`` fold in).
* ``mlp_layer_types`` (``hash_moe`` / ``moe``); else the first ``num_hash_layers`` (default 3)
  hash-routed.
* Both RoPE parameter sets: ``rope_parameters`` nested ``{"main": ..., "compress": ...}``, or
  flat (then ``main`` is default rope at ``rope_theta`` and ``compress`` is the flat dict, yarn
  or default, at ``compress_rope_theta``; a yarn ``compress`` gets ``attention_factor = 1.0``
  unless given). The rotated dims are ``head_dim * partial_rotary_factor`` (legacy
  ``qk_rope_head_dim``), the trailing dims of a head.

A value cpkv cannot serve is refused with the field and the value in the message.
"""

from __future__ import annotations

from math import lcm
from typing import Any, ClassVar, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .config import RopeConfig, _raw_of_type, _rope_from_raw

__all__ = ["CSA", "HCA", "LAYER_TYPES", "SWA", "V4_MODEL_TYPE", "DeepseekV4Config", "LayerType",
           "MlpType"]

V4_MODEL_TYPE: Final = "deepseek_v4"

SWA: Final = "sliding_attention"
CSA: Final = "compressed_sparse_attention"
HCA: Final = "heavily_compressed_attention"
LayerType = Literal["sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention"]
LAYER_TYPES: Final = (SWA, CSA, HCA)
MlpType = Literal["hash_moe", "moe"]

_RATIO_TO_TYPE = {0: SWA, 4: CSA, 128: HCA}  # transformers' legacy ``compress_ratios`` map
_DEFAULT_RATES = {CSA: 4, HCA: 128}


def _rope_pair(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(main, compress)`` RoPE dicts in transformers' normalised form."""
    rp = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ValueError(f"rope_parameters must be a JSON object, got {rp!r}")
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return dict(rp["main"]), dict(rp["compress"])
    flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    main = {"rope_type": "default", "rope_theta": data.get("rope_theta", 10000.0)}
    compress = {**flat, "rope_theta": data.get("compress_rope_theta", 160000.0)}
    compress.setdefault("rope_type", compress.pop("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return main, compress


def _rope(params: dict[str, Any], max_pos: int, which: str) -> dict[str, Any]:
    params = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    try:
        return _rope_from_raw({"rope_parameters": params, "max_position_embeddings": max_pos})
    except ValueError as exc:
        raise ValueError(f"rope_parameters.{which}: {exc}") from exc


def _refuse(data: dict[str, Any]) -> None:
    """Values cpkv cannot serve: a ValueError naming the field and the value."""
    for key in ("attention_bias", "mlp_bias"):
        if data.get(key):
            raise ValueError(f"{key}={data[key]!r}: DeepSeek-V4 has no biases there")
    fixed = {"num_key_value_heads": (1, "attention has one KV head (K = V)"),
             "n_shared_experts": (1, "has one shared expert"),
             "hidden_act": ("silu", "uses 'silu'")}
    for key, (want, why) in fixed.items():
        if data.get(key, want) != want:
            raise ValueError(f"{key}={data[key]!r}: DeepSeek-V4 {why}")
    if data.get("quantization_config"):
        raise ValueError(f"quantization_config={data['quantization_config']!r}: cpkv loads "
                         "DeepSeek-V4 weights in 16/32-bit floats only (dequantise first)")
    sf = data.get("scoring_func", "sqrtsoftplus")
    if sf not in ("sqrtsoftplus", "sigmoid"):
        raise ValueError(f"scoring_func={sf!r}: cpkv serves 'sqrtsoftplus' and 'sigmoid'")


def _schedules(data: dict[str, Any], n: int) -> None:
    """Compress rates, ``layer_types`` and ``mlp_layer_types`` in transformers' order of
    precedence, in place."""
    rates = data.get("compress_rates") or dict(_DEFAULT_RATES)
    if not isinstance(rates, dict) or set(rates) - {CSA, HCA}:
        raise ValueError(f"compress_rates={rates!r}: keys must be {CSA!r} and {HCA!r}")
    data.setdefault("compress_rate_csa", rates.get(CSA, _DEFAULT_RATES[CSA]))
    data.setdefault("compress_rate_hca", rates.get(HCA, _DEFAULT_RATES[HCA]))
    lt = data.get("layer_types")
    if lt is None and data.get("compress_ratios") is not None:
        bad = [r for r in data["compress_ratios"] if r not in _RATIO_TO_TYPE]
        if bad:
            raise ValueError(f"compress_ratios holds {bad}: only 0 (sliding), 4 (CSA) and "
                             "128 (HCA) map to a layer type")
        lt = [_RATIO_TO_TYPE[r] for r in data["compress_ratios"]]
    if lt is None:
        lt = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    bad = [t for t in lt if t not in LAYER_TYPES]
    if bad:
        raise ValueError(f"layer_types holds {bad}: DeepSeek-V4's are {list(LAYER_TYPES)}")
    data["layer_types"] = list(lt)[:n]
    mlt = data.get("mlp_layer_types")
    if mlt is None:
        n_hash = data.get("num_hash_layers")
        n_hash = 3 if n_hash is None else int(n_hash)
        mlt = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    bad = [t for t in mlt if t not in ("hash_moe", "moe")]
    if bad:
        raise ValueError(f"mlp_layer_types holds {bad}: DeepSeek-V4's are ['hash_moe', 'moe']")
    data["mlp_layer_types"] = list(mlt)[:n]


def _ropes(data: dict[str, Any]) -> None:
    """Both RoPE parameter sets and the rotated dims, in place."""
    head_dim = int(data.get("head_dim", 512))
    prf = data.get("partial_rotary_factor")
    if prf is None:
        legacy = data.get("qk_rope_head_dim")
        prf = legacy / head_dim if legacy is not None else 64 / 512
    data["qk_rope_head_dim"] = int(head_dim * prf)
    main, compress = _rope_pair(data)
    max_pos = int(data.get("max_position_embeddings", 1048576))
    for which, params in (("main", main), ("compress", compress)):
        p = params.get("partial_rotary_factor", prf)
        if p != prf:
            raise ValueError(f"rope_parameters.{which}.partial_rotary_factor={p!r} differs "
                             f"from partial_rotary_factor={prf!r}")
    data["rope_main"] = _rope(main, max_pos, "main")
    data["rope_compress"] = _rope(compress, max_pos, "compress")


class DeepseekV4Config(BaseModel):
    """The DeepSeek-V4 hyper-parameters (defaults: V4-Flash's, as transformers')."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    family: ClassVar[str] = "DeepSeek-V4"
    architecture: ClassVar[str] = "DeepseekV4ForCausalLM"

    model_type: Literal["deepseek_v4"] = V4_MODEL_TYPE
    vocab_size: int = Field(129280, ge=1)
    hidden_size: int = Field(4096, ge=1)
    moe_intermediate_size: int = Field(2048, ge=1)
    num_hidden_layers: int = Field(43, ge=1)
    num_attention_heads: int = Field(64, ge=1)
    head_dim: int = Field(512, ge=2)
    qk_rope_head_dim: int = Field(64, ge=2)
    q_lora_rank: int = Field(1024, ge=1)
    num_experts_per_tok: int = Field(6, ge=1)
    n_routed_experts: int = Field(256, ge=1)
    scoring_func: Literal["sqrtsoftplus", "sigmoid"] = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = Field(1048576, ge=1)
    layer_types: tuple[LayerType, ...]
    compress_rate_csa: int = Field(4, ge=1)
    compress_rate_hca: int = Field(128, ge=1)
    rope_main: RopeConfig
    rope_compress: RopeConfig
    hc_mult: int = Field(4, ge=1)
    hc_sinkhorn_iters: int = Field(20, ge=1)
    hc_eps: float = Field(1e-6, ge=0)
    mlp_layer_types: tuple[MlpType, ...]
    swiglu_limit: float = Field(10.0, gt=0)
    sliding_window: int = Field(128, ge=1)
    o_groups: int = Field(8, ge=1)
    o_lora_rank: int = Field(1024, ge=1)
    index_n_heads: int = Field(64, ge=1)
    index_head_dim: int = Field(128, ge=2)
    index_topk: int = Field(512, ge=1)
    num_nextn_predict_layers: int = Field(1, ge=0)
    hidden_act: Literal["silu"] = "silu"
    rms_norm_eps: float = Field(1e-6, gt=0)
    tie_word_embeddings: bool = False

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = _raw_of_type(data, V4_MODEL_TYPE)
        _refuse(data)
        n = int(data.get("num_hidden_layers", cls.model_fields["num_hidden_layers"].default))
        _schedules(data, n)
        _ropes(data)
        return data

    @model_validator(mode="after")
    def _check(self) -> Self:
        n = self.num_hidden_layers
        for name, types in (("layer_types", self.layer_types),
                            ("mlp_layer_types", self.mlp_layer_types)):
            if len(types) != n:
                raise ValueError(f"{name} has {len(types)} entries, num_hidden_layers is {n}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim >= self.head_dim:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and < "
                             f"head_dim={self.head_dim}")
        if self.qk_rope_head_dim > self.index_head_dim or self.index_head_dim % 2:
            raise ValueError(f"index_head_dim={self.index_head_dim} must be even and >= "
                             f"qk_rope_head_dim={self.qk_rope_head_dim} (the indexer ropes its "
                             "trailing dims)")
        if self.num_attention_heads % self.o_groups:
            raise ValueError(f"o_groups={self.o_groups} does not divide num_attention_heads="
                             f"{self.num_attention_heads}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} > n_routed_experts="
                             f"{self.n_routed_experts}")
        return self

    # ------------------------------------------------------------------ derived
    def rate(self, layer: int) -> int:
        """Layer ``layer``'s compress rate m (0 for a sliding-only layer)."""
        t = self.layer_types[layer]
        return 0 if t == SWA else self.compress_rate_csa if t == CSA else self.compress_rate_hca

    @property
    def rates(self) -> tuple[int, ...]:
        """The distinct compress rates the layers use, ascending."""
        return tuple(sorted({self.rate(i) for i in range(self.num_hidden_layers)} - {0}))

    def ownership_unit(self, page_size: int) -> int:
        """The ownership unit u in tokens: the least common multiple of ``page_size`` and every
        rate the layers use, so that every compressed entry lies inside one unit (contract rule
        34). At V4's rates and a 64-token page: lcm(64, 4, 128) = 128."""
        return lcm(page_size, *self.rates)

    def hf_dict(self) -> dict[str, Any]:
        """A transformers-5 ``config.json`` body (what the tiny writer writes)."""
        d = self.model_dump(exclude={"rope_main", "rope_compress", "compress_rate_csa",
                                     "compress_rate_hca", "qk_rope_head_dim"})
        d["layer_types"] = list(self.layer_types)
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["compress_rates"] = {CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}
        prf = self.qk_rope_head_dim / self.head_dim

        def rope(r: RopeConfig) -> dict[str, Any]:
            out: dict[str, Any] = {"rope_type": r.type, "rope_theta": r.theta,
                                   "partial_rotary_factor": prf}
            if r.type == "yarn":
                out.update(r.model_dump(exclude={"type", "theta"}, exclude_none=True))
            return out

        d["rope_parameters"] = {"main": rope(self.rope_main), "compress": rope(self.rope_compress)}
        d["rope_theta"] = self.rope_main.theta
        d["compress_rope_theta"] = self.rope_compress.theta
        d["partial_rotary_factor"] = prf
        d["architectures"] = [self.architecture]
        d["num_key_value_heads"] = 1
        d["n_shared_experts"] = 1
        d["attention_bias"] = False
        d["mlp_bias"] = False
        d["dtype"] = "float32"
        return d
