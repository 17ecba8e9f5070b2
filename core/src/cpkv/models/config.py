"""``DeepseekV32Config``: the fields of an HF ``config.json`` that the DeepSeek-V3.2 math needs.

Parsed with pydantic (unknown keys ignored, the value frozen). RoPE is accepted in both spellings:
transformers 5 ``rope_parameters`` (``rope_type``, ``rope_theta``, yarn keys) and the older top-level
``rope_theta`` + ``rope_scaling`` (``type`` or ``rope_type``), normalised into :class:`RopeConfig`.
"""

from __future__ import annotations

from typing import Any, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["MODEL_TYPE", "DeepseekV32Config", "RopeConfig"]

MODEL_TYPE: Final = "deepseek_v32"


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


class DeepseekV32Config(BaseModel):
    """The DeepSeek-V3.2 hyper-parameters, from an HF ``config.json`` (``model_type: deepseek_v32``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

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
        data = dict(data)
        mt = data.get("model_type", MODEL_TYPE)
        if mt != MODEL_TYPE:
            raise ValueError(f"model_type must be {MODEL_TYPE!r}, got {mt!r}")
        if "rope" not in data:
            data["rope"] = _rope_from_raw(data)
        if data.get("mlp_layer_types") is None and "num_hidden_layers" in data:
            n = int(data["num_hidden_layers"])
            k = min(int(data.get("first_k_dense_replace", 3)), n)
            data["mlp_layer_types"] = ["dense"] * k + ["sparse"] * (n - k)
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
        d["architectures"] = ["DeepseekV32ForCausalLM"]
        d["num_key_value_heads"] = self.num_attention_heads
        d["attention_bias"] = False
        d["mlp_bias"] = False
        d["dtype"] = "float32"
        return d
