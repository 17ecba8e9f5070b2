"""DeepSeek-V3.2 / GLM-5 per-layer math for context-parallel prefill (everything except the
attention core).

GLM-5 (``glm_moe_dsa``) is this math with two differences (docs/models.md): a *shared-indexer*
layer (``config.layer_indexers[i] == "shared"``) has no indexer and reuses the previous full
layer's top-k selection (its :class:`AttentionInputs` carry no indexer tensors, the pool stores
its latent only: :meth:`DeepseekV32.kv_formats`), and the indexer applies *interleaved* RoPE
(``config.index_rope``; DeepSeek-V3.2 half-split).

The driver owns the attention: per layer it calls :meth:`DeepseekV32.attention_inputs`, stores
``latent`` / ``index_k`` in the KV pool, scores the indexer, picks the top-k keys, runs sparse MLA on the
absorbed query against the latent keys with :attr:`DeepseekV32.softmax_scale`, then calls
:meth:`DeepseekV32.attention_output` and :meth:`DeepseekV32.mlp`. The math follows transformers'
``modeling_deepseek_v32`` (MLA in absorbed form, which equals its expanded form):

* ``q = [q_nope @ W_UK, rope_interleave(q_rot)]`` per head, ``latent = [kv_a_layernorm(kv_pass),
  rope_interleave(k_rot)]``; score ``q . latent``; output latent ``o = softmax(.) @ latent[:kv_lora_rank]``;
  value per head ``o @ W_UV^T``; then ``o_proj``.
* indexer: ``logit(i, j) = sum_h index_w[i, h] * relu(index_q[i, h] . index_k[j])`` (every scale folded
  into ``index_w``).

Every method is per row: rows may come from several requests in any order; ``positions`` carries each
row's absolute position.

The multi-token-prediction (MTP) draft layer, loaded with ``mtp=True``, is decoder layer
:attr:`DeepseekV32.mtp_layer` (``= num_layers``) of the same per-layer API, wrapped as in the
DeepSeek-V3 report (MTP section): for row i, ``x = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))``
(:meth:`~DeepseekV32.draft_embed`, :meth:`~DeepseekV32.draft_input`), the decoder layer, then
``shared_head``: ``h'_i = shared_head.norm(x)`` (:meth:`~DeepseekV32.draft_hidden`) and
``logits = shared_head.head(h'_i)`` (:meth:`~DeepseekV32.draft_logits`), a guess of token i+2.
``h_i`` is the target's last hidden state after the final norm (:meth:`~DeepseekV32.final_hidden`,
what SGLang and vLLM feed their MTP layers); chaining feeds ``h'_i`` back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cpkv.contracts import KVDtype, KVFormat

from .config import DeepseekV32Config
from .loader import CheckpointReader, read_config
from .rope import RopeFn, apply_rope, mla_softmax_scale, rope_inv_freq

__all__ = ["AttentionInputs", "DeepseekV32", "NormFn"]

_SUB_NORM_EPS = 1e-6  # q_a_layernorm, kv_a_layernorm, indexer k_norm: fixed eps in the reference


@dataclass
class AttentionInputs:
    """What one layer's attention needs for ``N`` rows (``H`` heads)."""

    q: torch.Tensor
    """``[N, H, kv_lora_rank + qk_rope_head_dim]`` absorbed query: ``q_nope @ W_UK`` ++ roped ``q_rot``."""
    latent: torch.Tensor
    """``[N, kv_lora_rank + qk_rope_head_dim]``: ``kv_a_layernorm(kv_pass)`` ++ roped ``k_rot`` (KV pool)."""
    index_q: torch.Tensor | None
    """``[N, index_n_heads, index_head_dim]`` indexer queries (rope on the first rope dims:
    half-split for DeepSeek-V3.2, interleaved for GLM-5); None on a shared-indexer layer."""
    index_w: torch.Tensor | None
    """``[N, index_n_heads]`` float32 head weights, every scale folded in; None when shared."""
    index_k: torch.Tensor | None
    """``[N, index_head_dim]`` indexer key (pool's index-K); None on a shared-indexer layer."""

    @property
    def shared(self) -> bool:
        """A shared-indexer layer: it reuses the previous full layer's top-k selection."""
        return self.index_k is None


@dataclass
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_a: torch.Tensor
    q_a_norm: torch.Tensor
    q_b: torch.Tensor
    kv_a: torch.Tensor
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor  # [H, qk_nope, kv_lora]
    w_uv: torch.Tensor  # [H, v, kv_lora]
    o: torch.Tensor
    #: the indexer (None on a GLM-5 shared-indexer layer)
    idx_wq_b: torch.Tensor | None
    idx_wk: torch.Tensor | None
    idx_k_norm_w: torch.Tensor | None
    idx_k_norm_b: torch.Tensor | None
    idx_w: torch.Tensor | None  # float32
    #: GPUs: idx_w as two 16-bit halves ``[hi; lo]`` (hi + lo = idx_w to ~2^-17), so the head
    #: weights are one 16-bit GEMM with fp32 output instead of an fp32 copy of the hidden states
    #: and an fp32 GEMM (:meth:`DeepseekV32._index_weights`)
    idx_w_split: torch.Tensor | None = None
    # dense MLP (None on MoE layers)
    gate: torch.Tensor | None = None
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    # MoE (None on dense layers)
    router: torch.Tensor | None = None  # float32 [E, hidden]
    router_bias: torch.Tensor | None = None  # float32 [E]
    experts_gate_up: torch.Tensor | None = None  # [E, 2I, hidden]
    experts_down: torch.Tensor | None = None  # [E, hidden, I]
    shared_gate: torch.Tensor | None = None
    shared_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    #: set by :func:`_fuse_projections` (the fields they hold become views into them): one GEMM
    #: for the projections that share an input. ``h_proj`` [q_a; kv_a; idx_wk] of the normed
    #: hidden state, ``r_proj`` [q_b; idx_wq_b] of the normed q_a output, ``gate_up`` and
    #: ``shared_gate_up`` [gate; up] of the MLP's input
    h_proj: torch.Tensor | None = None
    r_proj: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None
    shared_gate_up: torch.Tensor | None = None


#: the fused weights and their parts, per :class:`_Layer` field (:func:`_fuse_projections`)
_FUSED = {"h_proj": ("q_a", "kv_a", "idx_wk"), "r_proj": ("q_b", "idx_wq_b"),
          "gate_up": ("gate", "up"), "shared_gate_up": ("shared_gate", "shared_up")}


def _fuse_projections(layer: _Layer) -> None:
    """Each group of :data:`_FUSED` whose parts the layer has, concatenated by output rows into
    one weight, the parts replaced by views of it (no second copy). A decode step's GEMMs of 64
    rows are a few microseconds each of launch and split-K reduction: one call per input
    instead of 3 (q_a, kv_a, the indexer's wk), 2 (q_b, wq_b) and 2 (gate, up)."""
    for fused, names in _FUSED.items():
        parts = [getattr(layer, n) for n in names]
        have = [(n, t) for n, t in zip(names, parts, strict=True) if t is not None]
        if not have:  # a MoE layer's dense MLP, a layer without shared experts
            continue
        w = torch.cat([t for _, t in have]) if len(have) > 1 else have[0][1]
        setattr(layer, fused, w)
        for (n, _), view in zip(have, w.split([t.shape[0] for _, t in have]), strict=True):
            setattr(layer, n, view)


@dataclass
class _MTP:
    """The MTP layer's own weights (its decoder layer is ``_layers[num_layers]``)."""

    embed: torch.Tensor
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor  # [H, 2H]: columns [:H] take the embedding, [H:] the hidden state
    head_norm: torch.Tensor
    head: torch.Tensor


#: the ``rms_norm`` op's signature: ``(x [N, D], weight [D], eps) -> [N, D]``
#: (``cpkv.ops.KVOps.rms_norm``)
NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
              op: NormFn | None = None) -> torch.Tensor:
    """HF DeepSeek's RMSNorm: normalized in fp32, rounded to x's dtype, times the weight. On a
    GPU (x of the weight's dtype) in fp32 throughout, rounded once: through ``op`` (the
    ``rms_norm`` op on [N, D] rows, one Triton pass a norm) when given, else torch's fused
    ``rms_norm`` (one pass instead of seven over the residual stream, 1.82 -> 0.67 ms per norm
    of 64K x 7168 bf16 on a GPU; HF rounds before the weight, so a quarter of the elements
    differ by one ulp); the CPU keeps HF's exact op sequence."""
    dt = x.dtype
    if x.is_cuda and weight.dtype == dt:
        if op is not None:
            return op(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dt)


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with ``gate_up`` = [gate; up] (one GEMM)."""
    g, u = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, down)


class DeepseekV32:
    """A loaded DeepSeek-V3.2 or GLM-5 with the per-layer API the CP prefill driver calls.
    Inference only."""

    def __init__(self, config: DeepseekV32Config, layers: list[_Layer], embed: torch.Tensor,
                 norm: torch.Tensor, lm_head: torch.Tensor, mtp: _MTP | None = None) -> None:
        if len(layers) != config.num_hidden_layers + (mtp is not None):
            raise ValueError(f"{len(layers)} decoder layers for num_hidden_layers="
                             f"{config.num_hidden_layers}{' + the MTP layer' if mtp else ''}")
        self.config = config
        self._layers = layers
        self._mtp = mtp
        self._embed = embed
        self._norm = norm
        self._lm_head = lm_head
        self.dtype = embed.dtype
        self.device = embed.device
        #: the target's decoder layers (the MTP layer is not one of them)
        self.num_layers = config.num_hidden_layers
        #: index of the MTP layer in the per-layer API and in the KV pool; None when not loaded
        self.mtp_layer: int | None = self.num_layers if mtp is not None else None
        #: KV layers of the pool: the target's, plus the MTP layer's when loaded
        self.kv_layers = self.num_layers + (1 if mtp is not None else 0)
        self.softmax_scale = mla_softmax_scale(config.rope, config.qk_head_dim)
        self._inv_freq, self._rope_scaling = rope_inv_freq(config.rope, config.qk_rope_head_dim)
        self._inv_freq = self._inv_freq.to(self.device)
        self._cos = self._sin = torch.empty(0, config.qk_rope_head_dim, device=self.device)
        c = config
        self.index_scale = (c.index_n_heads ** -0.5) * (c.index_head_dim ** -0.5)
        #: per KV layer: whether it runs its own indexer and caches index-K (False: a GLM-5
        #: shared-indexer layer; the MTP layer runs its own)
        self.index_layers = c.index_k_layers(mtp is not None)
        for layer in layers:
            _fuse_projections(layer)
        if self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16):
            for layer in layers:
                if layer.idx_w is None:
                    continue
                hi = layer.idx_w.to(self.dtype)
                layer.idx_w_split = torch.cat([hi, (layer.idx_w - hi.float()).to(self.dtype)])

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", *, mtp: bool = False) -> DeepseekV32:
        """Load ``path/config.json`` and all safetensors shards; :class:`ModelLoadError` if they don't fit.

        Weights are cast to ``dtype`` except the MoE router (weight and correction bias) and the indexer's
        ``weights_proj``, kept in float32 as transformers keeps them. ``mtp``: also load the MTP draft
        layer (:class:`ModelLoadError` when the checkpoint has none); without it the MTP weights are
        not read.
        """
        cfg = read_config(path)
        f32 = torch.float32
        with CheckpointReader(path, cfg, mtp=mtp) as r:
            def g(name: str, dt: torch.dtype = dtype) -> torch.Tensor:
                return r.get(name, dt, device)

            layers = []
            h, nope, v, lora = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim,
                                cfg.kv_lora_rank)
            kinds = list(cfg.mlp_layer_types) + ([cfg.mtp_mlp_type] if mtp else [])
            indexed = cfg.index_k_layers(mtp)
            for i, kind in enumerate(kinds):
                p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
                kv_b = g(f"{a}.kv_b_proj.weight").view(h, nope + v, lora)
                ix = indexed[i]
                layer = _Layer(
                    input_norm=g(f"{p}.input_layernorm.weight"),
                    post_norm=g(f"{p}.post_attention_layernorm.weight"),
                    q_a=g(f"{a}.q_a_proj.weight"), q_a_norm=g(f"{a}.q_a_layernorm.weight"),
                    q_b=g(f"{a}.q_b_proj.weight"),
                    kv_a=g(f"{a}.kv_a_proj_with_mqa.weight"), kv_a_norm=g(f"{a}.kv_a_layernorm.weight"),
                    w_uk=kv_b[:, :nope].contiguous(), w_uv=kv_b[:, nope:].contiguous(),
                    o=g(f"{a}.o_proj.weight"),
                    idx_wq_b=g(f"{a}.indexer.wq_b.weight") if ix else None,
                    idx_wk=g(f"{a}.indexer.wk.weight") if ix else None,
                    idx_k_norm_w=g(f"{a}.indexer.k_norm.weight") if ix else None,
                    idx_k_norm_b=g(f"{a}.indexer.k_norm.bias") if ix else None,
                    idx_w=g(f"{a}.indexer.weights_proj.weight", f32) if ix else None,
                )
                m = f"{p}.mlp"
                if kind == "dense":
                    layer.gate, layer.up, layer.down = (
                        g(f"{m}.{n}_proj.weight") for n in ("gate", "up", "down"))
                else:
                    layer.router = g(f"{m}.gate.weight", f32)
                    layer.router_bias = g(f"{m}.gate.e_score_correction_bias", f32)
                    layer.experts_gate_up, layer.experts_down = r.experts(i, dtype, device)
                    if cfg.n_shared_experts:
                        layer.shared_gate, layer.shared_up, layer.shared_down = (
                            g(f"{m}.shared_experts.{n}_proj.weight") for n in ("gate", "up", "down"))
                layers.append(layer)
            embed = g("model.embed_tokens.weight")
            lm_head = embed if r.tied_lm_head else g("lm_head.weight")
            norm = g("model.norm.weight")
            draft = None
            if mtp:
                p = f"model.layers.{cfg.num_hidden_layers}"
                draft = _MTP(
                    embed=embed if f"{p}.embed_tokens.weight" in r.mtp_shared
                    else g(f"{p}.embed_tokens.weight"),
                    enorm=g(f"{p}.enorm.weight"), hnorm=g(f"{p}.hnorm.weight"),
                    eh_proj=g(f"{p}.eh_proj.weight"), head_norm=g(f"{p}.shared_head.norm.weight"),
                    head=lm_head if f"{p}.shared_head.head.weight" in r.mtp_shared
                    else g(f"{p}.shared_head.head.weight"))
        return cls(cfg, layers, embed, norm, lm_head, draft)

    # ------------------------------------------------------------------ formats
    def kv_format(self, dtype: KVDtype | str, page_size: int) -> KVFormat:
        """The KV pool's byte layout for this model's latent and index-K (a full layer's)."""
        c = self.config
        return KVFormat(dtype=KVDtype(dtype), kv_lora_rank=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim,
                        index_head_dim=c.index_head_dim, quant_block=min(128, c.kv_lora_rank),
                        page_size=page_size)

    def kv_formats(self, dtype: KVDtype | str, page_size: int) -> tuple[KVFormat, ...]:
        """One format per KV layer (:attr:`kv_layers`): a shared-indexer layer's stores its
        latent only (no index-K)."""
        full = self.kv_format(dtype, page_size)
        return tuple(full if ix else full.latent_only() for ix in self.index_layers)

    def shares_top_after(self, layer: int) -> bool:
        """Whether decoder layer ``layer + 1`` is a shared-indexer layer, which reuses the top-k
        selection the layers up to ``layer`` made (keep it past ``layer``)."""
        nxt = layer + 1
        return nxt < self.num_layers and not self.index_layers[nxt]

    # ------------------------------------------------------------------ helpers
    def _layer(self, layer: int) -> _Layer:
        if not 0 <= layer < len(self._layers):
            raise IndexError(f"layer {layer} out of range [0, {len(self._layers)})")
        return self._layers[layer]

    def _draft(self) -> _MTP:
        if self._mtp is None:
            raise ValueError("this model was loaded without its MTP draft layer (load it with mtp=True)")
        return self._mtp

    def rope_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                     max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[N, qk_rope_head_dim]`` (``cat(freqs, freqs)`` times yarn's attention scaling).

        Served from a float32 table that grows on demand (powers of two) to the largest position seen.
        Pass ``max_position`` (a host integer the caller knows, e.g. from the plan) to avoid reading
        the positions back from the device; the driver computes this once per batch.
        """
        if positions.dim() != 1:
            raise ValueError(f"positions must be 1-D, got shape {list(positions.shape)}")
        if positions.numel() == 0:
            e = torch.empty(0, self.config.qk_rope_head_dim, dtype=dtype, device=self.device)
            return e, e
        pos = positions.to(device=self.device, dtype=torch.long)
        if max_position is None:  # reads the device: callers on the hot path pass max_position
            top = int(pos.max())
            if int(pos.min()) < 0:
                raise ValueError("positions must be >= 0")
        else:
            top = max_position
        if top >= self._cos.shape[0]:
            n = max(1024, 1 << top.bit_length())
            freqs = torch.arange(n, device=self.device).float()[:, None] * self._inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos() * self._rope_scaling, emb.sin() * self._rope_scaling
        return self._cos[pos].to(dtype), self._sin[pos].to(dtype)

    # ------------------------------------------------------------------ the per-layer API
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``[N]`` token ids -> ``[N, hidden]`` residual stream."""
        return F.embedding(ids.to(self.device), self._embed)

    def attention_inputs(self, layer: int, x: torch.Tensor, positions: torch.Tensor,
                         rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                         rotate: RopeFn | None = None, norm: NormFn | None = None,
                         ) -> AttentionInputs:
        """MLA + indexer inputs of ``N`` rows; ``x`` is the residual stream before ``input_layernorm``.

        ``rope``: ``rope_cos_sin(positions, dtype, max_position)`` computed once per batch by the
        caller (every layer uses the same); computed here when omitted. ``rotate``: the ``rope``
        op to apply it with (the driver passes its op table's: one Triton pass per rotation on
        GPUs instead of six strided torch ops); :func:`~cpkv.models.rope.apply_rope`, the
        op's reference, when omitted. ``norm``: the ``rms_norm`` op for the three norms (GPU
        rows; the fused torch path when omitted).
        """
        c, w = self.config, self._layer(layer)
        n = x.shape[0]
        if positions.shape != (n,):
            raise ValueError(f"positions must have shape [{n}], got {list(positions.shape)}")
        x = x.to(self.dtype)
        h = _rms_norm(x, w.input_norm, c.rms_norm_eps, norm)
        cos, sin = rope if rope is not None else self.rope_cos_sin(positions, self.dtype)
        rot: RopeFn = rotate if rotate is not None else apply_rope

        # one GEMM of h for q_a, kv_a and the indexer's wk; one of q_resid for q_b and wq_b
        # (:func:`_fuse_projections`); the parts are column slices of their outputs
        assert w.h_proj is not None and w.r_proj is not None
        lr = c.kv_lora_rank
        k_dim = 0 if w.idx_wk is None else w.idx_wk.shape[0]  # a shared-indexer layer: none
        q_a, kv_a, h_k = F.linear(h, w.h_proj).split(
            [c.q_lora_rank, lr + c.qk_rope_head_dim, k_dim], dim=-1)
        q_resid = _rms_norm(q_a, w.q_a_norm, _SUB_NORM_EPS, norm)
        hq = c.num_attention_heads * c.qk_head_dim
        q_r = F.linear(q_resid, w.r_proj)
        q = q_r[:, :hq].view(n, c.num_attention_heads, c.qk_head_dim)
        q_nope, q_rot = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        # q_nope absorbed by W_UK written straight into the first kv_lora_rank columns of the
        # [N, H, kv_lora_rank + rope] query (a strided batched-GEMM output), the rope part after
        # it: no concatenation pass over the largest tensor of the layer (9.7 GB at 64K rows)
        q_out = torch.empty(n, c.num_attention_heads, lr + c.qk_rope_head_dim, dtype=q.dtype,
                            device=q.device)
        torch.matmul(q_nope.transpose(0, 1), w.w_uk, out=q_out.transpose(0, 1)[..., :lr])
        rot(q_rot, cos, sin, "interleave", q_out[..., lr:])

        kv_pass, k_rot = kv_a.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        latent = torch.cat([_rms_norm(kv_pass, w.kv_a_norm, _SUB_NORM_EPS, norm),
                            rot(k_rot, cos, sin, "interleave", None)], dim=-1)
        if w.idx_wq_b is None or w.idx_wk is None or w.idx_w is None:  # a shared-indexer layer
            return AttentionInputs(q=q_out, latent=latent, index_q=None, index_w=None,
                                   index_k=None)

        r, style = c.qk_rope_head_dim, c.index_rope
        iq = q_r[:, hq:].view(n, c.index_n_heads, c.index_head_dim)
        rot(iq[..., :r], cos, sin, style, iq[..., :r])  # in place
        ik = F.layer_norm(h_k, (c.index_head_dim,), w.idx_k_norm_w, w.idx_k_norm_b,
                          _SUB_NORM_EPS)
        rot(ik[..., :r], cos, sin, style, ik[..., :r])
        iw = self._index_weights(w, h)
        return AttentionInputs(q=q_out, latent=latent, index_q=iq, index_w=iw, index_k=ik)

    def _index_weights(self, w: _Layer, h: torch.Tensor) -> torch.Tensor:
        """``weights_proj(h) * index_scale`` in float32 ``[N, index_n_heads]``. transformers keeps
        ``weights_proj`` in fp32 (an fp32 GEMM over an fp32 copy of ``h``: 2.77 ms per layer at
        64K x 7168 on a GPU); on GPUs one 16-bit GEMM with fp32 output over the weight's
        ``[hi; lo]`` halves, summed (0.56 ms; ~1e-5 of the largest value apart)."""
        assert w.idx_w is not None
        if w.idx_w_split is not None and h.is_cuda and h.dtype == w.idx_w_split.dtype:
            y = torch.mm(h, w.idx_w_split.t(), out_dtype=torch.float32)
            heads = w.idx_w.shape[0]
            return (y[:, :heads] + y[:, heads:]) * self.index_scale
        return F.linear(h.float(), w.idx_w) * self.index_scale

    def attention_output(self, layer: int, out_latent: torch.Tensor) -> torch.Tensor:
        """``[N, H, kv_lora_rank]`` attention output in latent space -> ``[N, hidden]`` (W_UV, o_proj)."""
        return self.output_projection(layer, self.attention_values(layer, out_latent))

    def attention_values(self, layer: int, out_latent: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """``[N, H, kv_lora_rank]`` latent attention output -> per-head values ``[N, H, v_head_dim]``
        (W_UV), one batched GEMM over the heads written in row-major ``[N, H, v]`` (``out``: rows
        of a larger buffer, so that chunks of rows need no concatenation)."""
        w = self._layer(layer)
        n, heads = out_latent.shape[0], out_latent.shape[1]
        if out is None:
            out = torch.empty(n, heads, w.w_uv.shape[1], dtype=self.dtype, device=out_latent.device)
        torch.matmul(out_latent.to(self.dtype).transpose(0, 1), w.w_uv.transpose(1, 2),
                     out=out.transpose(0, 1))
        return out

    def output_projection(self, layer: int, values: torch.Tensor) -> torch.Tensor:
        """``[N, H, v_head_dim]`` values -> ``[N, hidden]`` (o_proj)."""
        return F.linear(values.reshape(values.shape[0], -1), self._layer(layer).o)

    def route(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference routing of normed rows ``h``: ``(weights [N, k] float32, expert ids [N, k])``."""
        c, w = self.config, self._layer(layer)
        if w.router is None or w.router_bias is None:
            raise ValueError(f"layer {layer} is dense, it has no router")
        scores = F.linear(h.float(), w.router).sigmoid()
        choice = scores + w.router_bias
        e, g = c.n_routed_experts, c.n_group
        group_scores = choice.view(-1, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, g, e // g).reshape(-1, e)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        idx = torch.topk(choice, k=c.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, idx

    def mlp(self, layer: int, x: torch.Tensor, norm: NormFn | None = None) -> torch.Tensor:
        """``post_attention_layernorm`` (through ``norm``, the ``rms_norm`` op, when given) then
        the dense MLP or the MoE (routed + shared experts)."""
        w = self._layer(layer)
        h = _rms_norm(x.to(self.dtype), w.post_norm, self.config.rms_norm_eps, norm)
        if w.router is None:
            assert w.gate_up is not None and w.down is not None
            return _swiglu(h, w.gate_up, w.down)
        assert w.experts_gate_up is not None and w.experts_down is not None
        weights, idx = self.route(layer, h)
        # Every expert over every row, weighted by its routing weight (0 when not chosen): no
        # data-dependent shapes, so no host sync in the layer loop (rule 22). This reference
        # spends n_routed_experts / num_experts_per_tok times the routed FLOPs; engines plug in
        # their fused MoE.
        gates = torch.zeros(h.shape[0], self.config.n_routed_experts, dtype=weights.dtype,
                            device=h.device).scatter_(1, idx, weights)
        out = torch.zeros_like(h)
        for j in range(self.config.n_routed_experts):
            gate, up = F.linear(h, w.experts_gate_up[j]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w.experts_down[j])
            out = out + (y * gates[:, j:j + 1]).to(out.dtype)
        if w.shared_gate_up is not None:
            assert w.shared_down is not None
            out = out + _swiglu(h, w.shared_gate_up, w.shared_down)
        return out

    def final_logits(self, x: torch.Tensor, norm: NormFn | None = None) -> torch.Tensor:
        """Final RMSNorm (through ``norm`` when given) and ``lm_head``: ``[N, hidden]`` ->
        ``[N, vocab]`` float32."""
        return self.logits(self.final_hidden(x, norm))

    def final_hidden(self, x: torch.Tensor, norm: NormFn | None = None) -> torch.Tensor:
        """The final RMSNorm of the residual stream: the target's ``h`` the MTP layer takes."""
        return _rms_norm(x.to(self.dtype), self._norm, self.config.rms_norm_eps, norm)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``lm_head`` of normed rows: ``[N, hidden]`` -> ``[N, vocab]`` float32."""
        return F.linear(h, self._lm_head).float()

    # ------------------------------------------------------------------ the MTP draft layer
    def draft_embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The MTP layer's token embedding: ``[N]`` ids -> ``[N, hidden]``."""
        return F.embedding(ids.to(self.device), self._draft().embed)

    def draft_input(self, embedded: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``eh_proj(cat(enorm(embedded), hnorm(h)))``: the residual stream entering the MTP
        decoder layer. ``embedded`` ``[N, hidden]`` (:meth:`draft_embed` of each row's next
        token), ``h`` ``[N, hidden]`` (:meth:`final_hidden` of the target, or :meth:`draft_hidden`
        when chaining)."""
        d, eps = self._draft(), self.config.rms_norm_eps
        both = torch.cat([_rms_norm(embedded.to(self.dtype), d.enorm, eps),
                          _rms_norm(h.to(self.dtype), d.hnorm, eps)], dim=-1)
        return F.linear(both, d.eh_proj)

    def draft_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """``shared_head.norm`` of the MTP decoder layer's output: ``h'`` (fed back when chaining)."""
        return _rms_norm(x.to(self.dtype), self._draft().head_norm, self.config.rms_norm_eps)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``shared_head.head`` of :meth:`draft_hidden` rows: ``[N, vocab]`` float32."""
        return F.linear(h, self._draft().head).float()

    def num_parameters(self) -> int:
        """Parameters held (a tied lm_head counted once)."""
        seen: set[int] = set()
        total = 0
        tensors = [self._embed, self._norm, self._lm_head]
        if self._mtp is not None:
            tensors += list(vars(self._mtp).values())
        for layer in self._layers:
            tensors += [t for k, t in vars(layer).items()
                        if isinstance(t, torch.Tensor) and k != "idx_w_split"  # a copy
                        and k not in _FUSED]  # its parts are counted
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel()
        return total

    def __repr__(self) -> str:
        c = self.config
        shared = sum(not ix for ix in self.index_layers)
        return (f"DeepseekV32(family={c.family}, layers={c.num_hidden_layers}, "
                f"shared_indexer_layers={shared}, hidden={c.hidden_size}, "
                f"heads={c.num_attention_heads}, "
                f"experts={c.n_routed_experts}, mtp={self._mtp is not None}, dtype={self.dtype}, "
                f"device={self.device})")
