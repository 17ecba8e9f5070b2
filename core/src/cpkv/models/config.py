"""The fields of an HF ``config.json`` that the DSA math needs: :class:`DeepseekV32Config`
(``model_type: deepseek_v32``) and :class:`GlmMoeDsaConfig` (``glm_moe_dsa``, GLM-5: the same
attention with shared-indexer layers and an interleaved indexer RoPE; docs/models.md).

Parsed with pydantic (unknown keys ignored, the value frozen). RoPE is accepted in both spellings:
transformers 5 ``rope_parameters`` (``rope_type``, ``rope_theta``, yarn keys) and the older top-level
``rope_theta`` + ``rope_scaling`` (``type`` or ``rope_type``), normalised into :class:`RopeConfig`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["GLM_MODEL_TYPE", "MODEL_TYPE", "MODEL_TYPES", "DeepseekV32Config", "GlmMoeDsaConfig",
           "IndexerType", "RopeConfig", "config_class", "indexer_schedule"]

MODEL_TYPE: Final = "deepseek_v32"
GLM_MODEL_TYPE: Final = "glm_moe_dsa"

#: a layer's indexer: ``full`` runs its own and caches index-K; ``shared`` reuses the previous
#: full layer's top-k selection and caches no index-K
IndexerType = Literal["full", "shared"]


class RopeConfig(BaseModel):
    """Rotary embedding: ``default`` or ``yarn`` (the DeepSeek-V3 family's long-context rope)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["default", "yarn"] = "default"
    theta: float = Field(10000.0, gt=0)
    # yarn only
    factor: float | None = Field(None, gt=0)
    original_max_position_embeddings: int | None = Field(None, ge=1)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


_ROPE_KEYS = {
    "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
    "attention_factor", "truncate",
}


def _raw_of_type(data: dict[str, Any], own: str) -> dict[str, Any]:
    """A copy of a raw config whose ``model_type`` (``own`` when absent) is ``own``.

    Raises:
        ValueError: another model type.
    """
    mt = data.get("model_type", own)
    if mt != own:
        raise ValueError(f"model_type must be {own!r}, got {mt!r}")
    return dict(data)


def _rope_from_raw(data: dict[str, Any]) -> dict[str, Any]:
    """Normalise ``rope_parameters`` / ``rope_scaling`` + ``rope_theta`` the way transformers 5 does."""
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a JSON object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"unsupported rope type {rope_type!r}: cpkv supports 'default' and 'yarn'")
    theta = params.get("rope_theta", data.get("rope_theta")) or 10000.0
    if params.get("partial_rotary_factor", data.get("partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
        raise ValueError("unsupported rope: partial_rotary_factor != 1")
    out: dict[str, Any] = {"type": rope_type, "theta": theta}
    if rope_type == "yarn":
        for k in _ROPE_KEYS:
            if params.get(k) is not None:
                out[k] = params[k]
        # transformers: `beta_fast or 32`, `beta_slow or 1`; original_max defaults to max_position_embeddings
        out["beta_fast"] = params.get("beta_fast") or 32.0
        out["beta_slow"] = params.get("beta_slow") or 1.0
        out.setdefault("original_max_position_embeddings", data.get("max_position_embeddings"))
        if out.get("factor") is None and out.get("original_max_position_embeddings"):
            out["factor"] = data["max_position_embeddings"] / out["original_max_position_embeddings"]
        if out.get("factor") is None:
            raise ValueError("yarn rope needs `factor` (or max_position_embeddings and the original one)")
    return out


def indexer_schedule(data: dict[str, Any], num_layers: int) -> list[str]:
    """A GLM-5 config's per-layer indexer types, in every form a config gives them (transformers'
    ``GlmMoeDsaConfig``): ``indexer_types`` explicit; else ``index_topk_pattern`` (a string of
    ``F`` full / ``S`` shared, or a list of types); else ``index_topk_freq`` (default 1: every
    layer full) with ``index_skip_topk_offset`` (default 2): layer i is full when
    ``max(i - offset + 1, 0) % freq == 0``.

    Raises:
        ValueError: a pattern character other than F and S.
    """
    if data.get("indexer_types") is not None:
        return list(data["indexer_types"])
    pattern = data.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, str):
            return list(pattern)
        bad = sorted(set(pattern) - {"F", "S"})
        if bad:
            raise ValueError(f"index_topk_pattern holds {bad}: only F (full) and S (shared)")
        return ["full" if ch == "F" else "shared" for ch in pattern]
    freq = max(int(data.get("index_topk_freq", 1) or 1), 1)
    offset = int(data.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


class DeepseekV32Config(BaseModel):
    """The DeepSeek-V3.2 hyper-parameters, from an HF ``config.json`` (``model_type: deepseek_v32``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    #: the family's name in messages and its HF architecture
    family: ClassVar[str] = "DeepSeek-V3.2"
    architecture: ClassVar[str] = "DeepseekV32ForCausalLM"
    #: the indexer's RoPE pairing: DeepSeek-V3.2 half-split, GLM-5 interleaved
    index_rope: ClassVar[Literal["half", "interleave"]] = "half"

    model_type: Literal["deepseek_v32"] = MODEL_TYPE
    vocab_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    moe_intermediate_size: int = Field(ge=1)
    num_hidden_layers: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    n_shared_experts: int = Field(1, ge=0)
    n_routed_experts: int = Field(ge=1)
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = Field(ge=1)
    q_lora_rank: int = Field(ge=1)
    qk_rope_head_dim: int = Field(ge=2)
    v_head_dim: int = Field(ge=1)
    qk_nope_head_dim: int = Field(ge=1)
    n_group: int = Field(1, ge=1)
    topk_group: int = Field(1, ge=1)
    num_experts_per_tok: int = Field(ge=1)
    norm_topk_prob: bool = True
    hidden_act: Literal["silu"] = "silu"
    rms_norm_eps: float = Field(1e-6, gt=0)
    index_topk: int = Field(2048, ge=1)
    index_head_dim: int = Field(128, ge=1)
    index_n_heads: int = Field(64, ge=1)
    first_k_dense_replace: int = Field(3, ge=0)
    mlp_layer_types: tuple[Literal["dense", "sparse"], ...]
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = Field(163840, ge=1)
    tie_word_embeddings: bool = False
    #: multi-token-prediction layers stored after the last decoder layer
    #: (``model.layers.{num_hidden_layers}.*``; DeepSeek-V3.2 ships 1). cpkv uses the first.
    num_nextn_predict_layers: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = _raw_of_type(data, cls.model_fields["model_type"].default)
        if "rope" not in data:
            data["rope"] = _rope_from_raw(data)
        n_field = cls.model_fields["num_hidden_layers"]
        n_default = None if n_field.is_required() else n_field.default
        if data.get("mlp_layer_types") is None and (n := data.get("num_hidden_layers",
                                                               n_default)) is not None:
            n = int(n)
            k = min(int(data.get("first_k_dense_replace", 3)), n)
            data["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (n - k)
        cls._derive(data)
        for key in ("attention_bias", "mlp_bias"):
            if data.get(key):
                raise ValueError(f"{key}=true is not supported (DeepSeek-V3.2 has no biases there)")
        if data.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"scoring_func must be 'sigmoid', got {data['scoring_func']!r}")
        return data

    @model_validator(mode="after")
    def _check(self) -> Self:
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError(f"mlp_layer_types has {len(self.mlp_layer_types)} entries, "
                             f"num_hidden_layers is {self.num_hidden_layers}")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts={self.n_routed_experts} not divisible by "
                             f"n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group={self.topk_group} > n_group={self.n_group}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok > n_routed_experts")
        if self.n_routed_experts // self.n_group < 2:
            raise ValueError("group-limited routing needs at least 2 experts per group")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even and <= "
                             f"index_head_dim={self.index_head_dim}")
        return self

    @classmethod
    def _derive(cls, data: dict[str, Any]) -> None:
        """Fields a family derives from the raw config (in place): none for DeepSeek-V3.2."""

    @property
    def layer_indexers(self) -> tuple[IndexerType, ...]:
        """Per decoder layer, its indexer: every DeepSeek-V3.2 layer runs its own."""
        full: tuple[IndexerType, ...] = ("full",)
        return full * self.num_hidden_layers

    def index_k_layers(self, mtp: bool = False) -> tuple[bool, ...]:
        """Per KV layer (the MTP layer last with ``mtp``: it runs its own indexer), whether it
        caches index-K."""
        return tuple(t == "full" for t in self.layer_indexers) + ((True,) if mtp else ())

    @property
    def mtp_mlp_type(self) -> Literal["dense", "sparse"]:
        """The MTP layer's MLP: as a decoder layer at index ``num_hidden_layers`` (MoE after the
        first ``first_k_dense_replace`` layers, as in DeepSeek-V3's release)."""
        return "dense" if self.num_hidden_layers < self.first_k_dense_replace else "sparse"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def hf_dict(self) -> dict[str, Any]:
        """A transformers-5 ``config.json`` body (what :func:`write_tiny_checkpoint` writes)."""
        d = self.model_dump(exclude={"rope"})
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        rope: dict[str, Any] = {"rope_type": self.rope.type, "rope_theta": self.rope.theta}
        if self.rope.type == "yarn":
            rope.update(self.rope.model_dump(exclude={"type", "theta"}, exclude_none=True))
        d["rope_parameters"] = rope
        d["architectures"] = [self.architecture]
        d["num_key_value_heads"] = self.num_attention_heads
        d["attention_bias"] = False
        d["mlp_bias"] = False
        d["dtype"] = "float32"
        return d


class GlmMoeDsaConfig(DeepseekV32Config):
    """GLM-5's hyper-parameters (``model_type: glm_moe_dsa``, transformers' ``GlmMoeDsaConfig``):
    DeepSeek-V3.2's with per-layer indexer types (:func:`indexer_schedule`) and GLM-5's
    dimensions as defaults (hidden 6144, 78 layers, first 3 dense, 64 heads, q_lora 2048,
    kv_lora 512 + rope 64, qk_nope 192, v 256, indexer 32 x 128 top-2048, MoE 256 / 8 active,
    1 shared expert, vocabulary 154880)."""

    family: ClassVar[str] = "GLM-5"
    architecture: ClassVar[str] = "GlmMoeDsaForCausalLM"
    index_rope: ClassVar[Literal["half", "interleave"]] = "interleave"

    model_type: Literal["glm_moe_dsa"] = GLM_MODEL_TYPE  # type: ignore[assignment]
    vocab_size: int = Field(154880, ge=1)
    hidden_size: int = Field(6144, ge=1)
    intermediate_size: int = Field(12288, ge=1)
    moe_intermediate_size: int = Field(2048, ge=1)
    num_hidden_layers: int = Field(78, ge=1)
    num_attention_heads: int = Field(64, ge=1)
    n_routed_experts: int = Field(256, ge=1)
    kv_lora_rank: int = Field(512, ge=1)
    q_lora_rank: int = Field(2048, ge=1)
    qk_rope_head_dim: int = Field(64, ge=2)
    v_head_dim: int = Field(256, ge=1)
    qk_nope_head_dim: int = Field(192, ge=1)
    num_experts_per_tok: int = Field(8, ge=1)
    rms_norm_eps: float = Field(1e-5, gt=0)
    index_n_heads: int = Field(32, ge=1)
    max_position_embeddings: int = Field(202752, ge=1)
    #: per decoder layer: "full" (own indexer, caches index-K) or "shared" (the previous full
    #: layer's top-k, no indexer weights, latent-only KV)
    indexer_types: tuple[IndexerType, ...]

    @classmethod
    def _derive(cls, data: dict[str, Any]) -> None:
        n = int(data.get("num_hidden_layers", cls.model_fields["num_hidden_layers"].default))
        data["indexer_types"] = indexer_schedule(data, n)

    @model_validator(mode="after")
    def _check_schedule(self) -> Self:
        if len(self.indexer_types) != self.num_hidden_layers:
            raise ValueError(f"indexer_types has {len(self.indexer_types)} entries, "
                             f"num_hidden_layers is {self.num_hidden_layers}")
        if self.indexer_types and self.indexer_types[0] != "full":
            raise ValueError("layer 0 is 'shared', but a shared layer reuses the previous full "
                             "layer's top-k and none comes before it")
        return self

    @property
    def layer_indexers(self) -> tuple[IndexerType, ...]:
        return self.indexer_types

    def hf_dict(self) -> dict[str, Any]:
        d = super().hf_dict()
        d["indexer_types"] = list(self.indexer_types)
        d["head_dim"] = self.qk_rope_head_dim
        return d


#: the model types cpkv loads, with their configs
MODEL_TYPES: dict[str, type[DeepseekV32Config]] = {
    MODEL_TYPE: DeepseekV32Config,
    GLM_MODEL_TYPE: GlmMoeDsaConfig,
}


def config_class(model_type: object) -> type[DeepseekV32Config]:
    """The config class of ``model_type``.

    Raises:
        ValueError: a model type cpkv does not know (one line naming it and the known ones).
    """
    cls = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if model_type == "deepseek_v4":
        raise ValueError("model_type 'deepseek_v4' (DeepSeek-V4) is read by "
                         "cpkv.models.read_v4_config and loaded by cpkv.models.DeepseekV4 "
                         "(cpkv run serves it through its own prefill job), not by the "
                         "DeepSeek-V3.2 / GLM-5 loader")
    if cls is None:
        known = ", ".join(f"{k} ({c.family})" for k, c in MODEL_TYPES.items())
        raise ValueError(f"model_type {model_type!r} is not an architecture cpkv knows; it "
                         f"loads {known}")
    return cls
