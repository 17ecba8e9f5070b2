"""The torch reference of DeepSeek-V4's compressed-attention ops (contract rules 33-40;
:class:`cpkv.ops.api.KVOps` ``v4_*``): the compressor's pool, the indexer over compressed index
keys, the stable top-k and the attention with the sink.

Every row's result depends on that row's inputs alone, bit for bit: not on how many rows,
entries or masked trailing keys a call holds, so a context-parallel rank, a chunk and the
one-piece prefill compute a row alike (rules 35, 37). A CPU GEMM takes other kernels (another
order of summation) for fewer than 12 rows or columns, or a row count off a multiple of 4 split
over threads; a reduction vectorises by its length. So the products here run on operands padded
to multiples of :data:`BLOCK` (:func:`padded_mm`), sums over a varying axis run in fixed-size
blocks added in order (trailing blocks of masked keys add exact zeros), and sums over slots and
heads are elementwise adds in a fixed order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import cpkv.ops.api as api
from cpkv.models.v4_topk import stable_topk

__all__ = ["BLOCK", "KEY_BLOCK", "ROW_BLOCK", "V4TorchOps", "padded_mm"]

#: products run on row and column counts padded to a multiple of this
BLOCK = 16
#: attention sums over keys in blocks of this many (the last padded with masked keys)
KEY_BLOCK = 256
#: ``v4_attention`` computes this many rows at a time (a block's gathered keys: ROW_BLOCK x
#: KEY_BLOCK x D floats); rows are independent, so the blocking does not change a row's bits
ROW_BLOCK = 512


def _pad0(x: torch.Tensor, to: int) -> torch.Tensor:
    """``x`` with zero rows appended up to a multiple of ``to`` (at least ``to``)."""
    pad = max(to, -(-x.shape[0] // to) * to) - x.shape[0]
    return torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]) if pad else x


def padded_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` computed with M and N padded to multiples of :data:`BLOCK`:
    each element is the same for any M and N."""
    m, n = a.shape[0], b.shape[1]
    return (_pad0(a, BLOCK) @ _pad0(b.t(), BLOCK).t())[:m, :n]


def _pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``sum_j softmax_j(gate) * kv_j`` over the slots (dim 1) of ``[n, S, d]``, softmax in
    float32, as elementwise ops over the slots in a fixed order (a fused softmax or sum over
    dim 1 vectorises by shape and differs in the last bit)."""
    g = gate.float()
    e = (g - g.amax(dim=1, keepdim=True)).exp()
    denom = e[:, 0]
    for j in range(1, e.shape[1]):
        denom = denom + e[:, j]
    out = kv[:, 0] * (e[:, 0] / denom).to(kv.dtype)
    for j in range(1, e.shape[1]):
        out = out + kv[:, j] * (e[:, j] / denom).to(kv.dtype)
    return out


class V4TorchOps:
    """DeepSeek-V4's ops in plain torch (CPU and GPU); part of the torch backend's object."""

    def v4_compress(self, kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, rate: int,
                    overlap: bool, prior: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> torch.Tensor:
        """The gated-softmax pool of whole windows (see :class:`cpkv.ops.api.KVOps`): CSA's
        2 x rate slots are the previous window's Ca half (``prior``'s for the first; empty:
        -inf gates) and this window's Cb half.

        Raises:
            ValueError: a shape or dtype does not fit (as every backend).
        """
        api.check_v4_compress_args(kv, gate, ape, rate, overlap, prior)
        m, w = rate, kv.shape[1]
        n = kv.shape[0] // m
        kv = kv[: n * m].view(n, m, w)
        g = gate[: n * m].view(n, m, w) + ape
        if overlap:
            d = w // 2
            new_kv = kv.new_zeros((n, 2 * m, d))
            new_gate = g.new_full((n, 2 * m, d), float("-inf"))
            new_kv[:, m:] = kv[..., d:]
            new_gate[:, m:] = g[..., d:]
            if n > 1:
                new_kv[1:, :m] = kv[:-1, :, :d]
                new_gate[1:, :m] = g[:-1, :, :d]
            if prior is not None and n:
                new_kv[0, :m] = prior[0][:, :d].to(new_kv.dtype)
                new_gate[0, :m] = (prior[1] + ape)[:, :d].to(new_gate.dtype)
            kv, g = new_kv, new_gate
        return _pool(kv, g)

    def v4_index_scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                        limit: torch.Tensor, scale: float) -> torch.Tensor:
        """``sum_h relu(q[i, h] . keys[e]) * scale * w[i, h]``, -inf from ``limit[i]`` on (see
        :class:`cpkv.ops.api.KVOps`): one padded product of every head, the head sum in order.

        Raises:
            ValueError: a shape or dtype does not fit (as every backend).
        """
        api.check_v4_index_scores_args(q, w, keys, limit)
        n, heads, d = q.shape
        e = keys.shape[0]
        s = padded_mm(q.float().reshape(n * heads, d), keys.float().t()).view(n, heads, e)
        s = F.relu(s) * scale
        w32 = w.float()
        if heads == 0:
            scores = s.new_zeros((n, e))
        else:
            scores = s[:, 0] * w32[:, :1]
            for h in range(1, heads):  # a loop over a shape: the same order for every row
                scores = scores + s[:, h] * w32[:, h:h + 1]
        future = torch.arange(e, device=q.device)[None, :] >= limit.to(q.device)[:, None]
        return scores.masked_fill(future, float("-inf"))

    def v4_topk(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        """Rule 39's top-k: :func:`cpkv.models.v4_topk.stable_topk` (see
        :class:`cpkv.ops.api.KVOps`).

        Raises:
            ValueError: a shape or dtype does not fit (as every backend).
        """
        api.check_v4_topk_args(scores, k)
        return stable_topk(scores, k)

    def v4_index_topk(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                      limit: torch.Tensor, scale: float, k: int) -> torch.Tensor:
        """:meth:`v4_topk` of :meth:`v4_index_scores` (see :class:`cpkv.ops.api.KVOps`): score
        descending, ties by entry.

        Raises:
            ValueError: a shape or dtype does not fit (as every backend).
        """
        return self.v4_topk(self.v4_index_scores(q, w, keys, limit, scale), k)

    def v4_attention(self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                     sink: torch.Tensor, scale: float) -> torch.Tensor:
        """Sparse attention with the sink (see :class:`cpkv.ops.api.KVOps`), in float32, in
        blocks of :data:`ROW_BLOCK` rows (bounded memory); per row the indices in blocks of
        :data:`KEY_BLOCK` (the keys gathered, the last block padded with masked zero keys), the
        row maximum over every block and the sink, then each block's ``exp`` sum and value
        product added in block order, divided once.

        Raises:
            ValueError: a shape or dtype does not fit (as every backend).
        """
        api.check_v4_attention_args(q, kv, indices, sink)
        n = q.shape[0]
        if n <= ROW_BLOCK:
            return self._attend(q, kv, indices.to(q.device), sink.to(q.device), scale)
        return torch.cat([self._attend(q[r:r + ROW_BLOCK], kv,
                                       indices[r:r + ROW_BLOCK].to(q.device), sink.to(q.device),
                                       scale)
                          for r in range(0, n, ROW_BLOCK)])  # a loop over a shape

    @staticmethod
    def _attend(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                scale: float) -> torch.Tensor:
        n, heads, d = q.shape
        qf, top = q.float(), sink.view(1, heads).expand(n, heads)
        blocks = []
        for b in range(0, max(1, indices.shape[1]), KEY_BLOCK):  # a loop over a shape
            ib = indices[:, b:b + KEY_BLOCK]
            if ib.shape[1] < KEY_BLOCK:  # the last block: padded with masked zero keys
                ib = torch.cat([ib, ib.new_full((n, KEY_BLOCK - ib.shape[1]), -1)], dim=1)
            mb = ib >= 0
            kb = kv[ib.clamp(min=0)].float().masked_fill_(~mb[..., None], 0.0)
            lg = (torch.matmul(qf, kb.transpose(1, 2)) * scale).masked_fill_(~mb[:, None, :],
                                                                             float("-inf"))
            blocks.append((lg, kb))
            top = torch.maximum(top, lg.amax(dim=-1))
        denom = (sink.view(1, heads) - top).exp()
        out = qf.new_zeros((n, heads, d))
        for lg, kb in blocks:
            p = lg.sub_(top[..., None]).exp_()
            denom = denom + p.sum(dim=-1)
            out = out + torch.matmul(p, kb)
        return (out / denom[..., None]).to(kv.dtype)
