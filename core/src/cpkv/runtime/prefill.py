"""The CP prefill driver: one batch through every layer on one rank of a CP group.

Per batch (host work, once): plan -> reserve pages and out-cache locations -> this rank's rows,
positions and key ranges as device tensors. Per layer (no host sync, no host-built tensors):
attention inputs of the local rows -> write KV to own pages -> materialize the full view ->
indexer logits in row chunks under the memory budget -> top-k -> sparse MLA -> o_proj, MLP/MoE.
After the last layer: all-gather the hidden states, rerange to natural order, final logits.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import structlog
import torch

from cpkv.contracts import CPPlan, KVDtype, KVFormat, SplitMode
from cpkv.kv import BatchKV, FullView, ShardedKVPool, unpack_rows
from cpkv.ops import quantize_index_q
from cpkv.planning import plan_batch

if TYPE_CHECKING:
    from cpkv.comm import CPGroup
    from cpkv.models import DeepseekV32
    from cpkv.ops import OpTable

__all__ = ["CPPrefill", "LayerHook", "PrefillResult", "TopkCapture", "row_chunks"]

log = structlog.get_logger(__name__)


@dataclass
class TopkCapture:
    """Per layer, the top-k choice of every extend token in natural order (tests and debug)."""

    indices: list[torch.Tensor] = field(default_factory=list)  # int32 [T_extend, k]
    scores: list[torch.Tensor] = field(default_factory=list)  # float32 [T_extend, k]


@dataclass
class PrefillResult:
    """What one CP prefill batch hands back."""

    plan: CPPlan
    #: float32 [requests, vocab]: logits of each request's last extend token, in batch order
    last_logits: torch.Tensor
    #: float32 [extend tokens, vocab] in natural order (only when asked for)
    all_logits: torch.Tensor | None
    #: seconds per phase on this rank
    seconds: dict[str, float]
    topk: TopkCapture | None = None


class LayerHook(Protocol):
    """Called by :meth:`CPPrefill.run` around the layer loop (the layer-pipelined transfer).

    ``batch_ready`` runs once after the batch's pages are reserved (the pool's page table holds
    them), before any layer; ``layer_written(layer)`` right after ``layer``'s KV is in the pool
    (it must not sync the host with the device: rule 22)."""

    def batch_ready(self, plan: CPPlan, rids: Sequence[Hashable]) -> None: ...

    def layer_written(self, layer: int) -> None: ...


def row_chunks(num_rows: int, bytes_per_row: int, budget_bytes: int) -> list[tuple[int, int]]:
    """Row ranges whose temporaries (``bytes_per_row`` each) stay under ``budget_bytes`` (rule 21:
    indexer logits are 4 x keys bytes per row)."""
    per = max(1, budget_bytes // max(1, bytes_per_row))
    return [(s, min(num_rows, s + per)) for s in range(0, num_rows, per)]


class CPPrefill:
    """Runs prefill batches of a loaded model on one rank of a CP group over a sharded pool.

    Args:
        model: the loaded model (``cpkv.models.DeepseekV32``).
        pool: this rank's pool (``cpkv.runtime.setup.create_pool``).
        ops: the op table (KV and attention ops).
        mode: split mode of the plans.
        logits_budget_bytes: indexer logits memory bound per chunk of rows.
    """

    def __init__(self, model: DeepseekV32, pool: ShardedKVPool, ops: OpTable, *,
                 mode: SplitMode | str = SplitMode.ZIGZAG,
                 logits_budget_bytes: int = 256 << 20, prefetch: bool = True,
                 indexer_fp8: bool = False) -> None:
        self.model, self.pool, self.ops = model, pool, ops
        #: quantize the indexer's q to fp8 when its keys are fp8 (fp8 x fp8 tensor cores)
        self.indexer_fp8 = indexer_fp8
        self.group: CPGroup = pool.group
        self.mode = SplitMode(mode)
        self.budget = logits_budget_bytes
        self.prefetch = prefetch
        cfg = model.config
        self.topk = cfg.index_topk
        self.dv = cfg.kv_lora_rank
        self.device = self.group.device

    # ---- once per batch -------------------------------------------------------------------
    def plan(self, batch: Sequence[tuple[Hashable, Sequence[int]]]) -> CPPlan:
        """The split plan of ``batch`` (request id, new token ids), continuing cached requests."""
        specs = [self.pool.request_spec(rid, len(ids)) for rid, ids in batch]
        return plan_batch(specs, self.group.size, self.pool.fmt.page_size, self.mode)

    def _rank_inputs(self, plan: CPPlan, kv: BatchKV,
                     batch: Sequence[tuple[Hashable, Sequence[int]]]) -> dict[str, Any]:
        """This rank's token ids, positions and key ranges (rule 7), built per row block with
        torch ops on the host and copied to the device once per batch."""
        cu = [0]
        for n in kv.materialize.seq_lens:  # host copy: no device read
            cu.append(cu[-1] + n)
        ids, pos, ks = [], [], []
        for b in plan.rank_blocks(self.group.rank):
            p0 = plan.requests[b.request].prefix_len
            ids.append(torch.as_tensor(list(batch[b.request][1][b.start - p0:b.end - p0]),
                                       dtype=torch.int64))
            pos.append(torch.arange(b.start, b.end, dtype=torch.int64))
            ks.append(torch.full((b.end - b.start,), cu[b.request], dtype=torch.int64))
        empty = torch.zeros(0, dtype=torch.int64)
        positions = torch.cat(pos) if pos else empty
        key_start = torch.cat(ks) if ks else empty
        dev = self.device
        return {
            "ids": (torch.cat(ids) if ids else empty).to(dev),
            "positions": positions.to(dev),
            "key_start": key_start.to(dev),
            "key_end": (key_start + positions + 1).to(dev),
            "num_keys": cu[-1],
            "max_position": int(positions.max()) if positions.numel() else 0,  # host tensor
        }

    # ---- the batch ----------------------------------------------------------------------------
    def run(self, batch: Sequence[tuple[Hashable, Sequence[int]]], *, all_logits: bool = False,
            capture_topk: bool = False, hook: LayerHook | None = None) -> PrefillResult:
        """Prefill ``batch``: [(request id, token ids of the extend)], continuing any request the
        pool already holds (its cached tokens are the prefix). Commits the KV on success and
        gives the batch's pages back on failure.

        Raises:
            PoolExhausted: not enough pages (nothing changed on any rank).
            ValueError: empty batch or empty extend.
        """
        if not batch or any(len(ids) == 0 for _, ids in batch):
            raise ValueError("every request in a batch needs at least one new token")
        t = time.perf_counter()
        seconds: dict[str, float] = {}
        plan = self.plan(batch)
        kv = self.pool.prepare(plan, [rid for rid, _ in batch])
        try:
            inputs = self._rank_inputs(plan, kv, batch)
            if hook is not None:
                hook.batch_ready(plan, [rid for rid, _ in batch])
            seconds["plan"] = time.perf_counter() - t
            out = self._layers(kv, inputs, seconds, capture_topk, hook)
            t = time.perf_counter()
            hidden = kv.rows.gather(out["x"], self.group, self.ops)
            last = torch.tensor([o + r.extend_len - 1 for o, r in
                                 zip(plan.natural_offsets(), plan.requests, strict=True)],
                                device=hidden.device)
            logits = self.model.final_logits(hidden if all_logits else hidden[last])
            seconds["gather_logits"] = time.perf_counter() - t
        except BaseException:
            self.pool.abort(kv)
            raise
        self.pool.commit(kv)
        return PrefillResult(plan=plan,
                             last_logits=logits[last] if all_logits else logits,
                             all_logits=logits if all_logits else None, seconds=seconds,
                             topk=out["topk"])

    def _layers(self, kv: BatchKV, inputs: dict[str, Any], seconds: dict[str, float],
                capture: bool, hook: LayerHook | None = None) -> dict[str, Any]:
        m, ops, pool = self.model, self.ops, self.pool
        fmt = pool.fmt
        x = m.embed(inputs["ids"])
        pos, ks, ke = inputs["positions"], inputs["key_start"], inputs["key_end"]
        rope = m.rope_cos_sin(pos, m.dtype, inputs["max_position"])  # once per batch
        chunks = row_chunks(kv.rows.num_local, 4 * inputs["num_keys"], self.budget)
        # sparse MLA temporaries per row (a reference backend gathers k latent rows and scores them)
        dk = m.config.kv_lora_rank + m.config.qk_rope_head_dim
        mla_chunks = row_chunks(kv.rows.num_local,
                                4 * self.topk * (dk + 2 * m.config.num_attention_heads), self.budget)
        cap = TopkCapture() if capture else None
        # the next layer's cached prefix pages move while this layer computes (rule 17: one more
        # layer's view in memory); the same decision on every rank (plan + settings only)
        nxt = pool.prefetch(0, kv) if self.prefetch else None
        phase = dict.fromkeys(("attn_inputs", "write", "materialize", "indexer", "sparse_mla",
                               "mlp"), 0.0)
        for layer in range(m.num_layers):
            t0 = time.perf_counter()
            a = m.attention_inputs(layer, x, pos, rope)
            t1 = time.perf_counter()
            pool.write(layer, kv, a.latent, a.index_k)
            if hook is not None:
                hook.layer_written(layer)
            t2 = time.perf_counter()
            view = pool.materialize(layer, kv, nxt)
            nxt = pool.prefetch(layer + 1, kv) if self.prefetch and layer + 1 < m.num_layers \
                else None
            lat, idx_k, idx_scale = _view_tensors(view, fmt, ops, a.q.dtype)
            t3 = time.perf_counter()
            picks, scores = [], []
            iq, iw = a.index_q, a.index_w
            if self.indexer_fp8 and idx_scale is not None:  # fp8 keys: fp8 queries too
                iq, iw = quantize_index_q(iq, iw)
            for s, e in chunks:
                logits = ops.indexer_logits(iq[s:e], iw[s:e], idx_k, idx_scale, ks[s:e], ke[s:e])
                top = ops.topk(logits, self.topk, ks[s:e], ke[s:e])
                picks.append(top)
                if cap is not None:
                    scores.append(torch.where(top >= 0, logits.gather(1, top.clamp_min(0).long()),
                                              float("-inf")))
            top = torch.cat(picks) if picks else torch.zeros(0, self.topk, dtype=torch.int32,
                                                              device=self.device)
            t4 = time.perf_counter()
            # row chunks bound the sparse-attention temporaries (latent outputs are fp32 [H, 512]
            # per row: 34 GB for 128K rows at DeepSeek sizes if taken at once)
            attn = [m.attention_output(layer, ops.sparse_mla(a.q[s:e], lat, top[s:e],
                                                               m.softmax_scale, self.dv).to(x.dtype))
                    for s, e in mla_chunks]
            if attn:  # a rank may hold no rows of a tiny batch
                x = x + (attn[0] if len(attn) == 1 else torch.cat(attn))
            t5 = time.perf_counter()
            x = x + m.mlp(layer, x)
            t6 = time.perf_counter()
            for k, v in zip(phase, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5),
                            strict=True):
                phase[k] += v
            if cap is not None:
                cap.indices.append(kv.rows.gather(top, self.group, ops))
                cap.scores.append(kv.rows.gather(torch.cat(scores) if scores else
                                                 torch.zeros(0, self.topk, device=self.device),
                                                 self.group, ops))
        seconds.update(phase)
        return {"x": x, "topk": cap}


def _view_tensors(view: FullView, fmt: KVFormat, ops: OpTable, dtype: torch.dtype,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Latent keys in compute dtype; index keys as the indexer takes them (fp8 + per-token scale
    for an fp8 pool: never widened before the indexer)."""
    if fmt.dtype is not KVDtype.FP8:
        lat, idx = view.unpack(fmt, ops, dtype)
        return lat, idx, None
    d = fmt.index_head_dim
    lat = unpack_rows(view.latent, fmt, "latent", ops, dtype)
    k = view.index_k[:, :d].contiguous().view(torch.float8_e4m3fn)
    scale = view.index_k[:, d:d + 4].contiguous().view(torch.float32).reshape(-1)
    return lat, k, scale
