"""DeepSeek-V4's per-layer math (transformers' ``modeling_deepseek_v4``), written per row so a
context-parallel driver can call it on its own segment, and a one-rank reference forward.

The pieces (docs/models.md, "DeepSeek-V4"):

* mHC residual streams: ``hc_mult`` copies of the hidden state; each block collapses them
  (``pre``), and expands its output back (``post``) plus a Sinkhorn-normalised mix (``comb``)
  of the input streams (:meth:`DeepseekV4.hc_pre`, :meth:`DeepseekV4.hc_post`).
* Attention: one K = V head of ``head_dim`` (RoPE on its trailing ``qk_rope_head_dim`` dims,
  interleaved pairs; sliding-only layers use the ``main`` rope, CSA / HCA layers ``compress``),
  queries per head unweighted-RMS-normed, a per-head sink logit in the softmax, inverse RoPE on
  the output, grouped output projection.
* Keys a query ``t`` reads: the window rows ``[t - W + 1, t]``, and on compressed layers the
  compressed entries: HCA all causal ones (``(w + 1) * m <= t + 1``), CSA the indexer's top-k
  of them (:func:`stable_topk`: score descending, entry index ascending; -1 padded). The
  attention reads them by index from one buffer of window rows and entries (FlashMLA's sparse
  form: no per-row copy of the keys).
* The compressor's pool, the indexer, the top-k and the attention with the sink are ops
  (``v4_compress``, ``v4_index_scores``, ``v4_topk``, ``v4_attention`` of
  :class:`cpkv.contracts.KVOps`): the model calls the op table it was given
  (:meth:`DeepseekV4.bind_ops`; ``cpkv.ops.v4_op_table`` resolves one through the registry),
  the rest (projections, norms, rope, mHC, MoE) is its own. Every product pads its row count
  (:func:`_linear`), so a row's result does not depend on how many rows are computed with it.
* Compressor (:meth:`DeepseekV4.compress`): entry ``w`` of rate m is
  ``norm(sum_j softmax_j(Z_j + B_j) * C_j)`` over its window's m rows, roped at position
  ``w * m``; CSA's (main and indexer) have 2m slots: the previous window's first half (Ca) and
  this window's second half (Cb) — entry 0's Ca slots are empty.
* MoE with sqrt-softplus scores (hash-routed layers take the experts from a token table),
  clamped SwiGLU, one shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .rope import rope_inv_freq
from .v4_config import CSA, HCA, SWA, DeepseekV4Config
from .v4_topk import stable_topk
from .v4_weights import MTP_PREFIX, V4CheckpointReader, read_v4_config

if TYPE_CHECKING:
    from cpkv.contracts import KVOps

__all__ = ["DeepseekV4", "V4Compressor", "stable_topk", "v4_rope"]


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4RMSNorm (weighted) / UnweightedRMSNorm (``weight`` None)."""
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(dt)


def v4_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4's interleaved RoPE on the trailing ``2 * cos.shape[-1]`` dims of ``x`` ``[N, ..., D]``
    with per-row half-size ``cos`` / ``sin`` ``[N, R/2]`` (``-sin``: the inverse rotation)."""
    c = cos.repeat_interleave(2, dim=-1)
    s = sin.repeat_interleave(2, dim=-1)
    while c.dim() < x.dim():
        c, s = c.unsqueeze(1), s.unsqueeze(1)
    r = c.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    rot = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, ((rope.float() * c) + (rot.float() * s)).to(x.dtype)], dim=-1)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` of rows ``x`` ``[N, in]`` with N padded to a multiple of
    :data:`_ROW_BLOCK`: a CPU GEMM sums otherwise for row counts off a multiple of 4 (fewer
    than 12, or split over threads), so each row's result would depend on how many rows a
    context-parallel rank or a chunk holds."""
    n = x.shape[0]
    pad = -n % _ROW_BLOCK if n else _ROW_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    return F.linear(x, weight)[:n]


#: row counts of the model's products are padded to a multiple of this (see :func:`_linear`)
_ROW_BLOCK = 16


@dataclass
class V4Compressor:
    """One compressor's weights (a layer's main one, or a CSA indexer's)."""

    wkv: torch.Tensor  # [w, hidden], w = 2d (CSA: Ca ++ Cb) or d
    wgate: torch.Tensor
    ape: torch.Tensor  # [m, w] float32 position bias
    norm: torch.Tensor  # [d] float32
    rate: int
    overlap: bool  # CSA: 2m slots (the previous window's Ca and this window's Cb)

    @property
    def dim(self) -> int:
        return self.norm.shape[0]


@dataclass
class _Layer:
    kind: str
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    hc: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # attn/ffn: fn, base, scale
    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor
    wo_b: torch.Tensor
    sink: torch.Tensor
    router: torch.Tensor
    router_bias: torch.Tensor | None
    tid2eid: torch.Tensor | None
    experts_w13: torch.Tensor  # [E, 2I, hidden]
    experts_w2: torch.Tensor  # [E, hidden, I]
    shared_w13: torch.Tensor
    shared_w2: torch.Tensor
    compressor: V4Compressor | None = None
    indexer: V4Compressor | None = None
    idx_wq_b: torch.Tensor | None = None
    idx_weights: torch.Tensor | None = None


@dataclass
class _MTP:
    """The MTP draft layer's own weights (its block is ``_layers[num_layers]``)."""

    e_proj: torch.Tensor
    h_proj: torch.Tensor
    enorm: torch.Tensor
    hnorm: torch.Tensor
    norm: torch.Tensor
    hc_head: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class DeepseekV4:
    """A loaded DeepSeek-V4 (inference only) with the per-row layer API (the one-rank forward
    of one prompt is :func:`cpkv.models.v4_reference.reference_forward`).

    ``ops``: the op table its ``v4_*`` ops run on (:meth:`bind_ops`); calling
    :meth:`compress`, :meth:`index_scores`, :meth:`topk` or :meth:`attend` without one raises
    RuntimeError."""

    def __init__(self, config: DeepseekV4Config, layers: list[_Layer], embed: torch.Tensor,
                 norm: torch.Tensor, head: torch.Tensor,
                 hc_head: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 ops: KVOps | None = None, mtp: _MTP | None = None) -> None:
        if len(layers) != config.num_hidden_layers + (mtp is not None):
            raise ValueError(f"{len(layers)} layers for num_hidden_layers="
                             f"{config.num_hidden_layers}{' + the MTP layer' if mtp else ''}")
        self._ops = ops
        self.config = config
        self._layers = layers
        self._mtp = mtp
        self._embed, self._norm, self._head, self._hc_head = embed, norm, head, hc_head
        self.dtype, self.device = embed.dtype, embed.device
        #: the target's decoder layers (the MTP layer is not one of them)
        self.num_layers = config.num_hidden_layers
        #: index of the MTP draft layer in the per-layer API and the decode state; None when
        #: not loaded
        self.mtp_layer: int | None = self.num_layers if mtp is not None else None
        #: layers with KV: the target's, plus the MTP layer's (window rows only) when loaded
        self.kv_layers = self.num_layers + (1 if mtp is not None else 0)
        r = config.qk_rope_head_dim
        self._inv_freq = {}
        for which, rope in (("main", config.rope_main), ("compress", config.rope_compress)):
            inv, scale = rope_inv_freq(rope, r)
            self._inv_freq[which] = (inv.to(self.device), scale)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", ops: KVOps | None = None, *,
             mtp: bool = False) -> DeepseekV4:
        """Load a DeepSeek-V4 checkpoint directory; :class:`ModelLoadError` if it doesn't fit.
        ``ops``: the op table of its ``v4_*`` ops (or :meth:`bind_ops` later). ``mtp``: also
        load the MTP draft layer (:class:`ModelLoadError` when the checkpoint has none).

        Norms, position biases, sinks, the mHC weights and the router bias stay float32 (as
        transformers keeps them)."""
        cfg = read_v4_config(path)
        f32 = torch.float32
        with V4CheckpointReader(path, cfg, mtp=mtp) as r:
            def g(name: str, dt: torch.dtype | None = dtype) -> torch.Tensor:
                return r.get(name, dt, device)

            def comp(p: str, rate: int, overlap: bool) -> V4Compressor:
                return V4Compressor(wkv=g(f"{p}.wkv.weight"), wgate=g(f"{p}.wgate.weight"),
                                    ape=g(f"{p}.ape", f32), norm=g(f"{p}.norm.weight", f32),
                                    rate=rate, overlap=overlap)

            def block(p: str, kind: str, hash_moe: bool) -> _Layer:
                a, f = f"{p}.attn", f"{p}.ffn"
                e = cfg.n_routed_experts
                w13 = torch.stack([torch.cat([g(f"{f}.experts.{j}.w1.weight"),
                                              g(f"{f}.experts.{j}.w3.weight")]) for j in range(e)])
                w2 = torch.stack([g(f"{f}.experts.{j}.w2.weight") for j in range(e)])
                layer = _Layer(
                    kind=kind, attn_norm=g(f"{p}.attn_norm.weight", f32),
                    ffn_norm=g(f"{p}.ffn_norm.weight", f32),
                    hc={h: (g(f"{p}.hc_{h}_fn", f32), g(f"{p}.hc_{h}_base", f32),
                            g(f"{p}.hc_{h}_scale", f32)) for h in ("attn", "ffn")},
                    wq_a=g(f"{a}.wq_a.weight"), q_norm=g(f"{a}.q_norm.weight", f32),
                    wq_b=g(f"{a}.wq_b.weight"), wkv=g(f"{a}.wkv.weight"),
                    kv_norm=g(f"{a}.norm.weight", f32), wo_a=g(f"{a}.wo_a.weight"),
                    wo_b=g(f"{a}.wo_b.weight"), sink=g(f"{a}.attn_sink", f32),
                    router=g(f"{f}.gate.weight"),
                    router_bias=None if hash_moe else g(f"{f}.gate.bias", f32),
                    tid2eid=g(f"{f}.gate.tid2eid", None).long() if hash_moe else None,
                    experts_w13=w13, experts_w2=w2,
                    shared_w13=torch.cat([g(f"{f}.shared_experts.w1.weight"),
                                          g(f"{f}.shared_experts.w3.weight")]),
                    shared_w2=g(f"{f}.shared_experts.w2.weight"))
                if kind == CSA:
                    m = cfg.compress_rate_csa
                    layer.compressor = comp(f"{a}.compressor", m, True)
                    layer.indexer = comp(f"{a}.indexer.compressor", m, True)
                    layer.idx_wq_b = g(f"{a}.indexer.wq_b.weight")
                    layer.idx_weights = g(f"{a}.indexer.weights_proj.weight")
                elif kind == HCA:
                    layer.compressor = comp(f"{a}.compressor", cfg.compress_rate_hca, False)
                return layer

            layers = [block(f"layers.{i}", kind, cfg.mlp_layer_types[i] == "hash_moe")
                      for i, kind in enumerate(cfg.layer_types)]
            draft = None
            if mtp:  # sliding-only, routed MoE (DeepSeek's MTPBlock(n_layers, ...))
                p = MTP_PREFIX
                layers.append(block(p, SWA, False))
                draft = _MTP(e_proj=g(f"{p}.e_proj.weight"), h_proj=g(f"{p}.h_proj.weight"),
                             enorm=g(f"{p}.enorm.weight", f32), hnorm=g(f"{p}.hnorm.weight", f32),
                             norm=g(f"{p}.norm.weight", f32),
                             hc_head=(g(f"{p}.hc_head_fn", f32), g(f"{p}.hc_head_base", f32),
                                      g(f"{p}.hc_head_scale", f32)))
            embed = g("embed.weight")
            head = embed if r.tied_head else g("head.weight")
            hc_head = (g("hc_head_fn", f32), g("hc_head_base", f32), g("hc_head_scale", f32))
            return cls(cfg, layers, embed, g("norm.weight", f32), head, hc_head, ops, draft)

    def bind_ops(self, ops: KVOps) -> None:
        """Run the ``v4_*`` ops on ``ops`` (an op table resolved for them) from now on."""
        self._ops = ops

    @property
    def ops(self) -> KVOps:
        """The bound op table.

        Raises:
            RuntimeError: none was bound (``load(..., ops=)`` or :meth:`bind_ops`).
        """
        if self._ops is None:
            raise RuntimeError("this DeepseekV4 has no op table for its v4_* ops: load it with "
                               "ops=cpkv.ops.v4_op_table() or call bind_ops(...)")
        return self._ops

    def layer_kind(self, layer: int) -> str:
        """``sliding_attention``, ``compressed_sparse_attention`` or ``heavily_compressed_attention``."""
        return self._layers[layer].kind

    # ------------------------------------------------------------------ rope
    def rope_cos_sin(self, positions: torch.Tensor, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-size ``cos, sin`` ``[N, R/2]`` of rope ``which`` (``main`` / ``compress``)."""
        inv, scale = self._inv_freq[which]
        freqs = positions.to(self.device)[:, None].float() * inv[None, :]
        return (freqs.cos() * scale).to(self.dtype), (freqs.sin() * scale).to(self.dtype)

    def _layer_rope(self, layer: int) -> str:
        return "main" if self._layers[layer].kind == "sliding_attention" else "compress"

    # ------------------------------------------------------------------ mHC
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``[N]`` ids -> ``[N, hc_mult, hidden]`` residual streams."""
        x = F.embedding(ids.to(self.device), self._embed)
        return x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()

    def hc_pre(self, layer: int, which: str, streams: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(post [N, n], comb [N, n, n], collapsed [N, hidden])`` of block ``which``
        (``attn`` / ``ffn``) over streams ``[N, n, hidden]``."""
        c = self.config
        fn, base, scale = self._layers[layer].hc[which]
        hc = c.hc_mult
        flat = _rms(streams.flatten(1).float(), None, c.rms_norm_eps)
        mixes = _linear(flat, fn)
        pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + c.hc_eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc),
                             dim=-1) + c.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + c.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + c.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def hc_post(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor,
                streams: torch.Tensor) -> torch.Tensor:
        """New streams: ``post * out + comb^T @ streams``."""
        dt = streams.dtype
        return (post.to(dt).unsqueeze(-1) * out.unsqueeze(-2)
                + torch.matmul(comb.to(dt).transpose(-1, -2), streams))

    # ------------------------------------------------------------------ attention pieces
    def attn_norm(self, layer: int, collapsed: torch.Tensor) -> torch.Tensor:
        return _rms(collapsed, self._layers[layer].attn_norm, self.config.rms_norm_eps)

    def query(self, layer: int, h: torch.Tensor, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [N, H, head_dim] roped, q_residual [N, q_lora_rank])`` of normed rows ``h``."""
        c, w = self.config, self._layers[layer]
        q_res = _rms(_linear(h, w.wq_a), w.q_norm, c.rms_norm_eps)
        q = _linear(q_res, w.wq_b).view(h.shape[0], c.num_attention_heads, c.head_dim)
        q = _rms(q, None, c.rms_norm_eps)
        cos, sin = self.rope_cos_sin(positions, self._layer_rope(layer))
        return v4_rope(q, cos, sin), q_res

    def window_kv(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[N, head_dim]`` K = V rows (normed, roped): the window rows."""
        w = self._layers[layer]
        kv = _rms(_linear(h, w.wkv), w.kv_norm, self.config.rms_norm_eps)
        cos, sin = self.rope_cos_sin(positions, self._layer_rope(layer))
        return v4_rope(kv, cos, sin)

    def compressors(self, layer: int) -> tuple[V4Compressor | None, V4Compressor | None]:
        """``(main, indexer)`` compressors of a layer (None where it has none)."""
        w = self._layers[layer]
        return w.compressor, w.indexer

    def compressor_inputs(self, comp: V4Compressor, h: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv, gate)`` ``[N, w]`` projections of normed rows (the carry state's rows)."""
        return _linear(h, comp.wkv), _linear(h, comp.wgate)

    def compress(self, comp: V4Compressor, kv: torch.Tensor, gate: torch.Tensor,
                 first_entry: int, prior: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """Entries ``[n, d]`` of the ``n = rows // m`` whole windows in ``kv`` / ``gate``
        ``[rows, w]`` (rows from a window boundary; a partial last window is ignored), entry
        ``first_entry`` first. ``prior``: CSA's ``(kv, gate)`` ``[m, w]`` rows of the window
        before the first (its Ca half is used); None: no such window (entry 0, or unknown)."""
        m = comp.rate
        n = kv.shape[0] // m
        pooled = self.ops.v4_compress(kv, gate, comp.ape, m, comp.overlap, prior)
        entries = _rms(pooled, comp.norm, self.config.rms_norm_eps)
        pos = torch.arange(n, device=kv.device) * m + first_entry * m
        cos, sin = self.rope_cos_sin(pos, "compress")
        return v4_rope(entries, cos, sin)

    def _index_inputs(self, layer: int, h: torch.Tensor, q_res: torch.Tensor,
                      positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The indexer's roped queries ``[N, H, d]``, head weights ``[N, H]`` float32 and each
        row's count of complete entries ``[N]``."""
        c, w = self.config, self._layers[layer]
        assert w.idx_wq_b is not None and w.idx_weights is not None
        q = _linear(q_res, w.idx_wq_b).view(h.shape[0], c.index_n_heads, c.index_head_dim)
        cos, sin = self.rope_cos_sin(positions, "compress")
        q = v4_rope(q, cos, sin)
        wts = _linear(h, w.idx_weights).float() * c.index_n_heads ** -0.5
        return q, wts, (positions.to(q.device) + 1) // c.compress_rate_csa

    def index_scores(self, layer: int, h: torch.Tensor, q_res: torch.Tensor,
                     positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Indexer scores ``[N, E]`` float32 of rows against compressed index keys ``[E, d]``
        (entry e of the request), -inf where entry e is not complete for the row."""
        q, wts, limit = self._index_inputs(layer, h, q_res, positions)
        return self.ops.v4_index_scores(q, wts, keys, limit, self.config.index_head_dim ** -0.5)

    def select(self, layer: int, h: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor,
               keys: torch.Tensor) -> torch.Tensor:
        """The indexer's choice of ``min(index_topk, E)`` entries per row: ``v4_index_topk``
        (scores and top-k in one op, rule 39) -> int64 ``[N, k]``, -1 padded."""
        q, wts, limit = self._index_inputs(layer, h, q_res, positions)
        k = min(self.config.index_topk, keys.shape[0])
        return self.ops.v4_index_topk(q, wts, keys, limit, self.config.index_head_dim ** -0.5, k)

    def topk(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """The indexer's choice: ``v4_topk`` of scores ``[N, E]`` (rule 39's order, -1 padded)
        -> int64 ``[N, k]``."""
        return self.ops.v4_topk(scores, k)

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor,
               indices: torch.Tensor) -> torch.Tensor:
        """Softmax attention with the sink: ``q [N, H, D]`` over the rows ``indices [N, K]``
        (-1: none) of one K = V buffer ``kv [S, D]`` (window rows and compressed entries side
        by side). -> ``[N, H, D]``."""
        return self.ops.v4_attention(q, kv, indices, self._layers[layer].sink,
                                     self.config.head_dim ** -0.5)

    def attention_output(self, layer: int, o: torch.Tensor, positions: torch.Tensor
                         ) -> torch.Tensor:
        """Inverse rope on ``o [N, H, D]`` and the grouped output projection -> ``[N, hidden]``."""
        c, w = self.config, self._layers[layer]
        cos, sin = self.rope_cos_sin(positions, self._layer_rope(layer))
        o = v4_rope(o, cos, -sin)
        g = c.o_groups
        per = c.num_attention_heads * c.head_dim // g
        n = o.shape[0]
        pad = -n % _ROW_BLOCK if n else _ROW_BLOCK  # as _linear: rows alike for any N
        o = torch.cat([o, o.new_zeros((pad, *o.shape[1:]))]) if pad else o
        x = o.reshape(o.shape[0], g, per).transpose(0, 1)  # [g, N, in]
        wt = w.wo_a.view(g, c.o_lora_rank, per).transpose(1, 2)  # [g, in, o_lora]
        y = torch.bmm(x, wt).transpose(0, 1).reshape(o.shape[0], g * c.o_lora_rank)
        return F.linear(y, w.wo_b)[:n]

    # ------------------------------------------------------------------ MoE
    def moe(self, layer: int, collapsed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``ffn_norm`` then the routed experts (every expert over every row, weighted by its
        routing weight, 0 when not chosen: no data-dependent shapes) and the shared one."""
        c, w = self.config, self._layers[layer]
        h = _rms(collapsed, w.ffn_norm, c.rms_norm_eps)
        logits = _linear(h, w.router)
        scores = F.softplus(logits).sqrt() if c.scoring_func == "sqrtsoftplus" else logits.sigmoid()
        if w.tid2eid is not None:
            idx = w.tid2eid[ids.to(w.tid2eid.device)]
        else:
            assert w.router_bias is not None
            idx = torch.topk(scores + w.router_bias, c.num_experts_per_tok, dim=-1,
                             sorted=False).indices
        weights = scores.gather(1, idx)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        gates = torch.zeros(h.shape[0], c.n_routed_experts, dtype=weights.dtype,
                            device=h.device).scatter_(1, idx, weights)
        out = torch.zeros_like(h)
        for j in range(c.n_routed_experts):
            y = _linear(self._swiglu(_linear(h, w.experts_w13[j])), w.experts_w2[j])
            out = out + (y * gates[:, j:j + 1]).to(out.dtype)
        return out + _linear(self._swiglu(_linear(h, w.shared_w13)), w.shared_w2)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        lim = self.config.swiglu_limit
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=lim)) * up.clamp(min=-lim, max=lim)

    def final_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Collapse the streams (``hc_head``), final norm, ``head``: -> ``[N, vocab]`` float32."""
        return self._logits(streams, self._hc_head, self._norm)

    def _logits(self, streams: torch.Tensor,
                hc_head: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                norm: torch.Tensor) -> torch.Tensor:
        c = self.config
        fn, base, scale = hc_head
        flat = _rms(streams.flatten(1).float(), None, c.rms_norm_eps)
        pre = torch.sigmoid(_linear(flat, fn) * scale + base) + c.hc_eps
        x = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return _linear(_rms(x, norm, c.rms_norm_eps), self._head).float()

    # ------------------------------------------------------------------ the MTP draft layer
    def _draft(self) -> _MTP:
        if self._mtp is None:
            raise ValueError("this DeepseekV4 was loaded without its MTP draft layer (load it "
                             "with mtp=True)")
        return self._mtp

    def draft_input(self, streams: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """The MTP layer's input streams ``[N, n, hidden]`` for rows whose target streams (after
        the last layer, before ``hc_head``) are ``streams`` and whose next tokens are
        ``next_ids`` ``[N]``: ``e_proj(enorm(embed(t_{i+1})))`` added to ``h_proj(hnorm(h_i))``
        of every stream (DeepSeek's ``MTPBlock``). Chaining feeds the layer's own output back."""
        d, eps = self._draft(), self.config.rms_norm_eps
        e = _rms(F.embedding(next_ids.to(self.device), self._embed), d.enorm, eps)
        n, k, hs = streams.shape
        h = _linear(_rms(streams, d.hnorm, eps).reshape(n * k, hs), d.h_proj).view(n, k, hs)
        return _linear(e, d.e_proj).unsqueeze(1) + h

    def draft_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """The MTP layer's guesses ``[N, vocab]`` float32 of token i+2 from its output streams:
        its own ``hc_head`` and norm, the shared ``head``."""
        d = self._draft()
        return self._logits(streams, d.hc_head, d.norm)
