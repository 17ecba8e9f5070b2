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
  of them (:func:`stable_topk`: score descending, entry index ascending; -1 padded).
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

import torch
import torch.nn.functional as F

from .rope import rope_inv_freq
from .v4_config import CSA, HCA, DeepseekV4Config
from .v4_weights import V4CheckpointReader, read_v4_config

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


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-``k`` column indices per row of ``scores`` ``[N, E]`` (-inf: not selectable), ties
    broken by the lower index (contract rule 39); -1 where fewer than ``k`` are selectable."""
    n, e = scores.shape
    if k == 0 or e == 0:
        return torch.full((n, k), -1, dtype=torch.long, device=scores.device)
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    idx = order.indices[:, :k]
    ok = torch.isfinite(order.values[:, :k])
    out = torch.where(ok, idx, torch.full_like(idx, -1))
    if out.shape[1] < k:
        out = F.pad(out, (0, k - out.shape[1]), value=-1)
    return out


def _pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``sum_j softmax_j(gate) * kv_j`` over the slots (dim 1) of ``[n, S, d]``, softmax in
    float32, as elementwise ops over the slots in a fixed order: each entry's value does not
    depend on how many windows are pooled together (CP == one rank bit for bit; a fused
    softmax or sum over dim 1 vectorises by shape and differs in the last bit)."""
    g = gate.float()
    e = (g - g.amax(dim=1, keepdim=True)).exp()
    denom = e[:, 0]
    for j in range(1, e.shape[1]):
        denom = denom + e[:, j]
    out = kv[:, 0] * (e[:, 0] / denom).to(kv.dtype)
    for j in range(1, e.shape[1]):
        out = out + kv[:, j] * (e[:, j] / denom).to(kv.dtype)
    return out


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


class DeepseekV4:
    """A loaded DeepSeek-V4 (inference only) with the per-row layer API and
    :meth:`reference_logits`, the one-rank forward of one prompt."""

    def __init__(self, config: DeepseekV4Config, layers: list[_Layer], embed: torch.Tensor,
                 norm: torch.Tensor, head: torch.Tensor,
                 hc_head: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.config = config
        self._layers = layers
        self._embed, self._norm, self._head, self._hc_head = embed, norm, head, hc_head
        self.dtype, self.device = embed.dtype, embed.device
        self.num_layers = config.num_hidden_layers
        r = config.qk_rope_head_dim
        self._inv_freq = {}
        for which, rope in (("main", config.rope_main), ("compress", config.rope_compress)):
            inv, scale = rope_inv_freq(rope, r)
            self._inv_freq[which] = (inv.to(self.device), scale)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> DeepseekV4:
        """Load a DeepSeek-V4 checkpoint directory; :class:`ModelLoadError` if it doesn't fit.

        Norms, position biases, sinks, the mHC weights and the router bias stay float32 (as
        transformers keeps them)."""
        cfg = read_v4_config(path)
        f32 = torch.float32
        with V4CheckpointReader(path, cfg) as r:
            def g(name: str, dt: torch.dtype | None = dtype) -> torch.Tensor:
                return r.get(name, dt, device)

            def comp(p: str, rate: int, overlap: bool) -> V4Compressor:
                return V4Compressor(wkv=g(f"{p}.wkv.weight"), wgate=g(f"{p}.wgate.weight"),
                                    ape=g(f"{p}.ape", f32), norm=g(f"{p}.norm.weight", f32),
                                    rate=rate, overlap=overlap)

            layers = []
            for i, kind in enumerate(cfg.layer_types):
                p, a, f = f"layers.{i}", f"layers.{i}.attn", f"layers.{i}.ffn"
                e = cfg.n_routed_experts
                w13 = torch.stack([torch.cat([g(f"{f}.experts.{j}.w1.weight"),
                                              g(f"{f}.experts.{j}.w3.weight")]) for j in range(e)])
                w2 = torch.stack([g(f"{f}.experts.{j}.w2.weight") for j in range(e)])
                hash_moe = cfg.mlp_layer_types[i] == "hash_moe"
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
                layers.append(layer)
            embed = g("embed.weight")
            head = embed if r.tied_head else g("head.weight")
            hc_head = (g("hc_head_fn", f32), g("hc_head_base", f32), g("hc_head_scale", f32))
            return cls(cfg, layers, embed, g("norm.weight", f32), head, hc_head)

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
        mixes = F.linear(flat, fn)
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
        q_res = _rms(F.linear(h, w.wq_a), w.q_norm, c.rms_norm_eps)
        q = F.linear(q_res, w.wq_b).view(h.shape[0], c.num_attention_heads, c.head_dim)
        q = _rms(q, None, c.rms_norm_eps)
        cos, sin = self.rope_cos_sin(positions, self._layer_rope(layer))
        return v4_rope(q, cos, sin), q_res

    def window_kv(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[N, head_dim]`` K = V rows (normed, roped): the window rows."""
        w = self._layers[layer]
        kv = _rms(F.linear(h, w.wkv), w.kv_norm, self.config.rms_norm_eps)
        cos, sin = self.rope_cos_sin(positions, self._layer_rope(layer))
        return v4_rope(kv, cos, sin)

    def compressors(self, layer: int) -> tuple[V4Compressor | None, V4Compressor | None]:
        """``(main, indexer)`` compressors of a layer (None where it has none)."""
        w = self._layers[layer]
        return w.compressor, w.indexer

    def compressor_inputs(self, comp: V4Compressor, h: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv, gate)`` ``[N, w]`` projections of normed rows (the carry state's rows)."""
        return F.linear(h, comp.wkv), F.linear(h, comp.wgate)

    def compress(self, comp: V4Compressor, kv: torch.Tensor, gate: torch.Tensor,
                 first_entry: int, prior: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """Entries ``[n, d]`` of the ``n = rows // m`` whole windows in ``kv`` / ``gate``
        ``[rows, w]`` (rows from a window boundary; a partial last window is ignored), entry
        ``first_entry`` first. ``prior``: CSA's ``(kv, gate)`` ``[m, w]`` rows of the window
        before the first (its Ca half is used); None: no such window (entry 0, or unknown)."""
        m, d = comp.rate, comp.dim
        n = kv.shape[0] // m
        kv = kv[: n * m].view(n, m, kv.shape[-1])
        gate = gate[: n * m].view(n, m, gate.shape[-1]) + comp.ape
        if comp.overlap:
            new_kv = kv.new_zeros((n, 2 * m, d))
            new_gate = gate.new_full((n, 2 * m, d), float("-inf"))
            new_kv[:, m:] = kv[..., d:]
            new_gate[:, m:] = gate[..., d:]
            if n > 1:
                new_kv[1:, :m] = kv[:-1, :, :d]
                new_gate[1:, :m] = gate[:-1, :, :d]
            if prior is not None and n:
                new_kv[0, :m] = prior[0][:, :d].to(new_kv.dtype)
                new_gate[0, :m] = (prior[1] + comp.ape)[:, :d].to(new_gate.dtype)
            kv, gate = new_kv, new_gate
        pooled = _pool(kv, gate)
        entries = _rms(pooled, comp.norm, self.config.rms_norm_eps)
        pos = torch.arange(n, device=kv.device) * m + first_entry * m
        cos, sin = self.rope_cos_sin(pos, "compress")
        return v4_rope(entries, cos, sin)

    def index_scores(self, layer: int, h: torch.Tensor, q_res: torch.Tensor,
                     positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Indexer scores ``[N, E]`` float32 of rows against compressed index keys ``[E, d]``
        (entry e of the request), -inf where entry e is not complete for the row."""
        c, w = self.config, self._layers[layer]
        assert w.idx_wq_b is not None and w.idx_weights is not None
        q = F.linear(q_res, w.idx_wq_b).view(h.shape[0], c.index_n_heads, c.index_head_dim)
        cos, sin = self.rope_cos_sin(positions, "compress")
        q = v4_rope(q, cos, sin)
        s = torch.matmul(q.float(), keys.float().t().unsqueeze(0))  # [N, h, E]
        s = F.relu(s) * c.index_head_dim ** -0.5
        wts = F.linear(h, w.idx_weights).float() * c.index_n_heads ** -0.5
        scores = (s * wts.unsqueeze(-1)).sum(dim=1)
        limit = (positions.to(scores.device) + 1) // c.compress_rate_csa
        future = torch.arange(keys.shape[0], device=scores.device)[None, :] >= limit[:, None]
        return scores.masked_fill(future, float("-inf"))

    def attend(self, layer: int, q: torch.Tensor, keys: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Softmax attention with the sink: ``q [N, H, D]`` over per-row keys ``[N, K, D]``
        (K = V), ``mask [N, K]`` True where a key is read. -> ``[N, H, D]``."""
        w = self._layers[layer]
        logits = torch.matmul(q, keys.transpose(1, 2)) * self.config.head_dim ** -0.5
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        sink = w.sink.to(logits.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
        full = torch.cat([logits, sink], dim=-1)
        full = full - full.max(dim=-1, keepdim=True).values
        probs = F.softmax(full, dim=-1, dtype=full.dtype)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys)

    def attention_output(self, layer: int, o: torch.Tensor, positions: torch.Tensor
                         ) -> torch.Tensor:
        """Inverse rope on ``o [N, H, D]`` and the grouped output projection -> ``[N, hidden]``."""
        c, w = self.config, self._layers[layer]
        cos, sin = self.rope_cos_sin(positions, self._layer_rope(layer))
        o = v4_rope(o, cos, -sin)
        g = c.o_groups
        per = c.num_attention_heads * c.head_dim // g
        x = o.reshape(o.shape[0], g, per).transpose(0, 1)  # [g, N, in]
        wt = w.wo_a.view(g, c.o_lora_rank, per).transpose(1, 2)  # [g, in, o_lora]
        y = torch.bmm(x, wt).transpose(0, 1).reshape(o.shape[0], g * c.o_lora_rank)
        return F.linear(y, w.wo_b)

    # ------------------------------------------------------------------ MoE
    def moe(self, layer: int, collapsed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``ffn_norm`` then the routed experts (every expert over every row, weighted by its
        routing weight, 0 when not chosen: no data-dependent shapes) and the shared one."""
        c, w = self.config, self._layers[layer]
        h = _rms(collapsed, w.ffn_norm, c.rms_norm_eps)
        logits = F.linear(h, w.router)
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
            y = F.linear(self._swiglu(F.linear(h, w.experts_w13[j])), w.experts_w2[j])
            out = out + (y * gates[:, j:j + 1]).to(out.dtype)
        return out + F.linear(self._swiglu(F.linear(h, w.shared_w13)), w.shared_w2)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        lim = self.config.swiglu_limit
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=lim)) * up.clamp(min=-lim, max=lim)

    def final_logits(self, streams: torch.Tensor) -> torch.Tensor:
        """Collapse the streams (``hc_head``), final norm, ``head``: -> ``[N, vocab]`` float32."""
        c = self.config
        fn, base, scale = self._hc_head
        flat = _rms(streams.flatten(1).float(), None, c.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, fn) * scale + base) + c.hc_eps
        x = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return F.linear(_rms(x, self._norm, c.rms_norm_eps), self._head).float()
