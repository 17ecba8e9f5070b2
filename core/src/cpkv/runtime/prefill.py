"""The CP prefill driver: one batch through every layer on one rank of a CP group.

Per batch (host work, once): plan -> reserve pages and out-cache locations -> this rank's rows,
positions and key ranges as device tensors. Per layer (no host sync, no host-built tensors):
attention inputs of the local rows -> write KV to own pages -> materialize the full view ->
indexer logits in row chunks under the memory budget -> top-k (one ``indexer_topk`` op per chunk
unless the scores are captured) -> sparse MLA -> o_proj, MLP/MoE.
After the last layer: the last rows' hidden states from their owners (every row's, all-gathered
and reranged to natural order, when every row's logits are asked for), final logits.

A model loaded with its MTP layer (``model.mtp_layer``) then runs the draft layer on the same
rows (contract rule 32, :meth:`CPPrefill._draft`): it is one more layer of the pool (same pages,
same owners, same plan, written directly by the compute owner). Each rank embeds only its local
draft ids (each row's next token; the sampled first token for a request's last row) padded to the
plan's ``max_rank_len`` and trimmed back; without usable plan metadata it embeds the whole batch
and takes its rows (fallback ``draft_plan_missing``).
"""

from __future__ import annotations

import array
import time
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from cpkv.comm import note_progress
from cpkv.contracts import CPPlan, FallbackReason, KVDtype, Op, SplitMode
from cpkv.fallback import report_fallback
from cpkv.kv import BatchKV, ShardedKVPool, to_device_at_once
from cpkv.logs import get_logger
from cpkv.ops import hadamard_rotate
from cpkv.planning import plan_batch

from .progress import BatchProgress

if TYPE_CHECKING:
    from cpkv.comm import CPGroup
    from cpkv.models import DeepseekV32
    from cpkv.ops import OpTable

__all__ = ["BATCH_PLAN", "CPPrefill", "DraftInputs", "DraftNext", "LayerHook", "PrefillResult",
           "RankInputs", "SyncFreeRegion", "TopkCapture", "row_chunks"]

#: ``draft_plan`` default: the draft layer uses the batch's own plan
BATCH_PLAN: Any = object()

#: the draft layer's next token per row: ``"prompt"``: the batch's next token (each request's
#: last row: its ``next_ids`` entry, or the sampled first token); ``"greedy"``: the target's
#: greedy choice at every row (a decode step verifying drafts)
DraftNext = Literal["prompt", "greedy"]

log = get_logger(__name__)


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
    #: with the draft layer: float32 [requests, vocab] draft logits of each request's last row
    #: (its guess of the token after the sampled first token), batch order
    draft_logits: torch.Tensor | None = None
    #: with the draft layer: [requests, hidden] ``h'`` of each request's last row (chaining)
    draft_hidden: torch.Tensor | None = None
    #: with the draft layer and ``all_logits``: float32 [extend tokens, vocab], natural order
    all_draft_logits: torch.Tensor | None = None
    #: with the draft layer and ``all_logits``: [extend tokens, hidden], natural order
    all_draft_hidden: torch.Tensor | None = None
    #: with the draft layer: how its input was embedded, "local" (rule 32) or "full" (fallback)
    draft_embedding: str | None = None
    #: wall seconds of each chunk of a chunked prefill (``runtime.chunk_tokens``), in order;
    #: empty for a batch prefilled in one piece
    chunk_seconds: tuple[float, ...] = ()


@dataclass(frozen=True)
class DraftInputs:
    """The draft layer's input ids of one rank (host work once per batch, on the device).

    ``local``: the ids are this rank's rows padded to the plan's ``max_rank_len`` (rule 32),
    else the whole batch in natural order (the ``draft_plan_missing`` fallback). Rows ``fill``
    of ``ids`` (int64) take the target's choice at rows ``src`` (int64) before embedding."""

    local: bool
    ids: torch.Tensor
    fill: torch.Tensor
    src: torch.Tensor


@dataclass(frozen=True)
class RankInputs:
    """One rank's inputs of a batch, built once per batch (rule 7), device tensors and host ints.

    ``ids``, ``positions``, ``key_start``, ``key_end``: int64 [local rows]: each row's token
    id, absolute position and causal key range ``[key_start, key_end)`` in the full view;
    ``last``: int64 [requests], each request's last extend row in natural order;
    ``num_keys``: the full view's keys; ``max_position``: the largest local position (host
    ints from the plan: no sync); ``draft``: the draft layer's ids when it runs."""

    ids: torch.Tensor
    positions: torch.Tensor
    key_start: torch.Tensor
    key_end: torch.Tensor
    last: torch.Tensor
    num_keys: int
    max_position: int
    draft: DraftInputs | None = None


#: a context factory entered around each part of a batch's device work that must not read a
#: device value back to the host (rule 22), given the part's name: ``"layers"`` (a layer loop:
#: rope table, writes, views, indexer, attention, MLP) or ``"draft"`` (the draft layer:
#: embedding, layer, shared_head)
SyncFreeRegion = Callable[[str], AbstractContextManager[object]]


def _no_guard(_part: str) -> AbstractContextManager[object]:
    return nullcontext()


class LayerHook(Protocol):
    """Called by :meth:`CPPrefill.run` around the layer loop (the layer-pipelined transfer).

    ``batch_ready`` runs once after the batch's pages are reserved (the pool's page table holds
    them), before any layer; ``layer_written(layer)`` right after ``layer``'s KV is in the pool
    (it must not sync the host with the device: rule 22)."""

    def batch_ready(self, plan: CPPlan, rids: Sequence[Hashable]) -> None: ...

    def layer_written(self, layer: int) -> None: ...


#: on a CPU, the indexer's row chunks are also kept under this many logits bytes (2^23 row x key
#: pairs): a CPU computes them at a few GFLOP/s, so a chunk of the budget's size (512 MiB: 2,048
#: rows of a 65,536-key view) ran for minutes between two progress notes; smaller chunks change
#: no result (rows are independent) and cost nothing measurable there (the torch backend's
#: indexer already works in row pieces of ~4 MB)
CPU_PROGRESS_CHUNK_BYTES = 32 << 20


def row_chunks(num_rows: int, bytes_per_row: int, budget_bytes: int) -> list[tuple[int, int]]:
    """Row ranges whose temporaries (``bytes_per_row`` each) stay under ``budget_bytes`` (rule 21:
    indexer logits are 4 x keys bytes per row). Rank-local compute only: the budget may differ
    between ranks (``runtime.logits_budget_mb = "auto"`` reads each device's free memory), so no
    collective may ever depend on these chunks."""
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
                 indexer_fp8: bool = False, select_latent: bool | None = None) -> None:
        self.model, self.pool, self.ops = model, pool, ops
        #: dequantize only the latent rows the top-k reads (None: when a batch's rows read fewer
        #: rows than its view holds, decided per batch from the plan: decode steps)
        self.select_latent = select_latent
        #: an fp8 pool's index-K holds DeepSeek's rotated keys (``hadamard_rotate`` before the
        #: ue8m0 pack), so the queries that meet them are rotated too (q . k is unchanged)
        self.rotate_index = pool.fmt.dtype is KVDtype.FP8
        #: quantize the indexer's q to fp8 when its keys are fp8 (fp8 x fp8 tensor cores)
        self.indexer_fp8 = indexer_fp8 and self.rotate_index
        self.group: CPGroup = pool.group
        self.mode = SplitMode(mode)
        self.budget = logits_budget_bytes
        self.prefetch = prefetch
        cfg = model.config
        self.topk = cfg.index_topk
        self.dv = cfg.kv_lora_rank
        self.device = self.group.device
        #: entered around the parts that must not sync the host (see :data:`SyncFreeRegion`);
        #: nothing by default. A test or a debug run sets a guard here (one that fails on
        #: ``Tensor.item``, tests/test_prefill.py; ``torch.cuda.set_sync_debug_mode("error")``),
        #: a benchmark a timer (it may sync on entry and exit, outside the region)
        self.sync_free_region: SyncFreeRegion = _no_guard

    # ---- once per batch -------------------------------------------------------------------
    def plan(self, batch: Sequence[tuple[Hashable, Sequence[int]]]) -> CPPlan:
        """The split plan of ``batch`` (request id, new token ids), continuing cached requests."""
        specs = [self.pool.pages.request_spec(rid, len(ids)) for rid, ids in batch]
        return plan_batch(specs, self.group.size, self.pool.fmt.page_size, self.mode)

    def _rank_inputs(self, plan: CPPlan, kv: BatchKV,
                     batch: Sequence[tuple[Hashable, Sequence[int]]]) -> RankInputs:
        """This rank's token ids, positions and key ranges (rule 7), and each request's last row
        in natural order: host work per row block (the ids aside), one copy to the device, the
        rows expanded there (:class:`~cpkv.kv.RowLayout`)."""
        cu = [0]
        for n in kv.materialize.seq_lens:  # host copy: no device read
            cu.append(cu[-1] + n)
        rows = kv.rows
        ids = [_token_ids(batch[b.request][1], b.start - plan.requests[b.request].prefix_len,
                          b.end - plan.requests[b.request].prefix_len) for b in rows.blocks]
        empty = torch.zeros(0, dtype=torch.int64)
        last = torch.tensor([o + r.extend_len - 1 for o, r in
                             zip(plan.natural_offsets(), plan.requests, strict=True)],
                            dtype=torch.int64)
        block_cu = torch.tensor([cu[b.request] for b in rows.blocks], dtype=torch.int64)
        ids_d, last_d, block_cu_d = to_device_at_once(
            (torch.cat(ids) if len(ids) > 1 else ids[0] if ids else empty, last, block_cu),
            self.device)
        key_start = rows.per_row(block_cu_d)
        return RankInputs(ids=ids_d, positions=rows.positions, key_start=key_start,
                          key_end=key_start + rows.positions + 1, last=last_d, num_keys=cu[-1],
                          max_position=max((b.end - 1 for b in rows.blocks), default=0))

    # ---- the batch ----------------------------------------------------------------------------
    def run(self, batch: Sequence[tuple[Hashable, Sequence[int]]], *, all_logits: bool = False,
            capture_topk: bool = False, next_ids: Sequence[int | None] | None = None,
            draft_next: DraftNext = "prompt", draft_plan: CPPlan | None = BATCH_PLAN,
            hook: LayerHook | None = None) -> PrefillResult:
        """Prefill ``batch``: [(request id, token ids of the extend)], continuing any request the
        pool already holds (its cached tokens are the prefix). Commits the KV on success and
        gives the batch's pages back on failure.

        With the model's MTP layer loaded the draft layer runs too (see :meth:`_draft`):
        ``next_ids`` gives, per request, the token after its extend when it is known (a non-final
        chunk); None (or no list) means the request's sampled first token. ``draft_next``: see
        :data:`DraftNext`. ``draft_plan`` is the plan metadata the draft layer embeds by (the
        batch's own by default; None or a plan of another batch takes the visible fallback).

        Raises:
            PoolExhausted: not enough pages (nothing changed on any rank).
            ValueError: empty batch or empty extend.
            FallbackError: the draft fallback under policy ``error``.
        """
        if not batch or any(len(ids) == 0 for _, ids in batch):
            raise ValueError("every request in a batch needs at least one new token")
        if next_ids is not None and len(next_ids) != len(batch):
            raise ValueError(f"next_ids has {len(next_ids)} entries for {len(batch)} requests")
        t = time.perf_counter()
        seconds: dict[str, float] = {}
        plan = self.plan(batch)
        kv = self.pool.prepare(plan, [rid for rid, _ in batch])
        try:
            inputs = self._rank_inputs(plan, kv, batch)
            draft = self.model.mtp_layer is not None
            if draft:
                dplan = plan if draft_plan is BATCH_PLAN else draft_plan
                inputs = replace(inputs, draft=self._draft_ids(plan, dplan, batch, next_ids,
                                                                draft_next))
            if hook is not None:
                hook.batch_ready(plan, [rid for rid, _ in batch])
            seconds["plan"] = time.perf_counter() - t
            m = self.model
            # the batch's tokens counted done layer by layer and row chunk by row chunk
            progress = BatchProgress(plan.num_tokens, m.num_layers)
            x, topk = self._layers(kv, inputs, seconds, capture_topk, m.embed(inputs.ids),
                                   range(m.num_layers), hook, progress)
            t = time.perf_counter()
            last = inputs.last
            whole = all_logits or (draft and draft_next == "greedy")
            # only the rows the logits need cross the group (the last rows, unless every row's)
            logits = m.final_logits(kv.gather(x) if whole else kv.gather_rows(x, last))
            seconds["gather_logits"] = time.perf_counter() - t
            res = PrefillResult(plan=plan, last_logits=logits[last] if whole else logits,
                                all_logits=logits if all_logits else None, seconds=seconds,
                                topk=topk)
            if draft:
                t = time.perf_counter()
                # the target's greedy choice: of the last rows (a prompt's sampled first token),
                # or of every row (verifying drafts); stays on the device
                choice = (logits if draft_next == "greedy" else res.last_logits).argmax(dim=-1)
                self._draft(kv, inputs, x, choice, res, all_logits, hook)
                seconds["draft"] = time.perf_counter() - t
        except BaseException:
            self.pool.abort(kv)
            raise
        self.pool.commit(kv)
        return res

    # ---- the draft (MTP) layer ----------------------------------------------------------------
    def run_draft(self, batch: Sequence[tuple[Hashable, int]], h: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """One chained draft step on one rank: for each ``(request id, draft token)`` the MTP
        layer alone at the request's next position, fed the draft token and ``h`` (``[requests,
        hidden]``: the previous draft step's ``h'``). Its KV row is written like any other
        (one more token of the request: call :meth:`PageTable.truncate` once the chain is
        done). Returns ``(draft logits [requests, vocab] float32, h' [requests, hidden])``.

        Raises:
            ValueError: no MTP layer, a CP group, or ``h`` of the wrong shape.
        """
        m = self.model
        layer = m.mtp_layer
        if layer is None:
            raise ValueError("run_draft needs the model's MTP layer")
        if self.group.size != 1:
            raise ValueError("chained draft steps run on the (non-CP) decode rank")
        if h.shape != (len(batch), m.config.hidden_size):
            raise ValueError(f"h must be [{len(batch)}, {m.config.hidden_size}], got {list(h.shape)}")
        one = [(rid, [0]) for rid, _ in batch]  # the target's token there is not used
        plan = self.plan(one)
        kv = self.pool.prepare(plan, [rid for rid, _ in batch])
        try:
            inputs = self._rank_inputs(plan, kv, one)
            ids = torch.tensor([t for _, t in batch], dtype=torch.int64, device=self.device)
            x = m.draft_input(m.draft_embed(ids), h)
            x, _ = self._layers(kv, inputs, {}, False, x, range(layer, layer + 1))
            hd = m.draft_hidden(x)
            logits = m.draft_logits(hd)
        except BaseException:
            self.pool.abort(kv)
            raise
        self.pool.commit(kv)
        return logits, hd

    def _draft_ids(self, plan: CPPlan, dplan: CPPlan | None,
                   batch: Sequence[tuple[Hashable, Sequence[int]]],
                   next_ids: Sequence[int | None] | None, draft_next: DraftNext) -> DraftInputs:
        """The draft layer's input ids, host work once per batch (``plan`` is the batch's,
        ``dplan`` the metadata the draft layer was given). With usable metadata (rule 32): this
        rank's local rows by ``dplan``, padded to its ``max_rank_len``; otherwise (a
        ``draft_plan_missing`` fallback, decided here alike on every rank) the whole batch in
        natural order. Rows whose next token is the target's choice get a placeholder that the
        device fills (:class:`DraftInputs`)."""
        nat: list[torch.Tensor] = []
        fill: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        offs = plan.natural_offsets()
        for i, ((_, ids), req) in enumerate(zip(batch, plan.requests, strict=True)):
            e = req.extend_len
            if draft_next == "greedy":  # every row: the target's choice at that row
                nat.append(torch.zeros(e, dtype=torch.int64))
                fill.append(torch.arange(offs[i], offs[i] + e, dtype=torch.int64))
                src.append(torch.arange(offs[i], offs[i] + e, dtype=torch.int64))
                continue
            nxt = None if next_ids is None else next_ids[i]
            tail = [0 if nxt is None else int(nxt)]
            nat.append(torch.cat((_token_ids(ids, 1, len(ids)),
                                  torch.tensor(tail, dtype=torch.int64))))
            if nxt is None:  # the sampled first token: the choice of the request's last row
                fill.append(torch.tensor([offs[i] + e - 1], dtype=torch.int64))
                src.append(torch.tensor([i], dtype=torch.int64))
        natural = torch.cat(nat)
        fill_rows = torch.cat(fill) if fill else torch.zeros(0, dtype=torch.int64)
        fill_src = torch.cat(src) if src else torch.zeros(0, dtype=torch.int64)
        dev = self.device
        problem = self._draft_plan_problem(dplan, plan)
        if problem is not None:
            report_fallback(op="draft_embedding",
                            requested="embed the local draft tokens padded to max_rank_len",
                            selected="embed every draft token of the batch, keep the local rows",
                            reason=FallbackReason.DRAFT_PLAN_MISSING, detail=problem)
            return DraftInputs(local=False, ids=natural.to(dev), fill=fill_rows.to(dev),
                               src=fill_src.to(dev))
        assert dplan is not None
        # this rank's rows by the plan metadata (natural-order row of each local row), padded
        # to the plan's uniform shape
        offs = dplan.natural_offsets()
        parts = [torch.arange(b.start, b.end, dtype=torch.int64)
                 + (offs[b.request] - dplan.requests[b.request].prefix_len)
                 for b in dplan.rank_blocks(self.group.rank)]
        local = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        pos_of = torch.full((dplan.num_tokens,), -1, dtype=torch.int64)
        pos_of[local] = torch.arange(local.numel())
        mine = pos_of[fill_rows]
        keep = mine >= 0
        padded = torch.zeros(dplan.max_rank_len, dtype=torch.int64)
        padded[: local.numel()] = natural[local]
        return DraftInputs(local=True, ids=padded.to(dev), fill=mine[keep].to(dev),
                           src=fill_src[keep].to(dev))

    @staticmethod
    def _draft_plan_problem(plan: CPPlan | None, want: CPPlan) -> str | None:
        """Why ``plan`` cannot drive the local draft embedding of the batch planned ``want``
        (None: it can). Host integers only, the same on every rank."""
        if plan is None:
            return "no plan metadata was given to the draft layer"
        if (plan.cp_size, plan.page_size) != (want.cp_size, want.page_size):
            return (f"the plan is for CP{plan.cp_size} with {plan.page_size}-token pages, the batch "
                    f"runs on CP{want.cp_size} with {want.page_size}")
        have = [(r.prefix_len, r.extend_len) for r in plan.requests]
        need = [(r.prefix_len, r.extend_len) for r in want.requests]
        if have != need:
            return f"the plan's (prefix, extend) per request {have[:4]} != the batch's {need[:4]}"
        if plan.rank_counts != want.rank_counts:
            return f"the plan's rows per rank {plan.rank_counts} != the batch's {want.rank_counts}"
        if plan != want:
            return f"the plan's segments differ from the batch's ({plan.mode.value} vs {want.mode.value})"
        return None

    def _draft_input_embedding(self, kv: BatchKV, draft: DraftInputs, choice: torch.Tensor
                               ) -> torch.Tensor:
        """Rule 32: ``[local rows, hidden]`` embeddings of this rank's draft ids: the local ids
        padded to ``max_rank_len`` (the same shape on every rank), embedded and trimmed; on the
        fallback the whole batch is embedded and this rank's rows taken."""
        m = self.model
        ids = draft.ids.index_copy(0, draft.fill, choice[draft.src])
        if draft.local:
            return m.draft_embed(ids)[: kv.rows.num_local]
        return kv.split(m.draft_embed(ids))

    def _draft(self, kv: BatchKV, inputs: RankInputs, x: torch.Tensor, choice: torch.Tensor,
               res: PrefillResult, all_logits: bool, hook: LayerHook | None = None) -> None:
        """The MTP layer on this rank's rows: ``eh_proj(cat(enorm(embed(next)), hnorm(h)))``
        with ``h`` the target's final-normed hidden state of each local row, the decoder layer
        as pool layer ``mtp_layer`` (direct writes to own pages, the same full-view machinery),
        ``shared_head``; then the rows are gathered like the target's. No host sync (run inside
        :attr:`sync_free_region` ``("draft")``)."""
        with self.sync_free_region("draft"):
            self._draft_layer(kv, inputs, x, choice, res, all_logits, hook)

    def _draft_layer(self, kv: BatchKV, inputs: RankInputs, x: torch.Tensor, choice: torch.Tensor,
                     res: PrefillResult, all_logits: bool, hook: LayerHook | None) -> None:
        m = self.model
        layer, draft = m.mtp_layer, inputs.draft
        assert layer is not None and draft is not None
        emb = self._draft_input_embedding(kv, draft, choice)
        xd = m.draft_input(emb, m.final_hidden(x))
        phase: dict[str, float] = {}
        xd, _ = self._layers(kv, inputs, phase, False, xd, range(layer, layer + 1), hook)
        last = inputs.last
        res.draft_embedding = "local" if draft.local else "full"
        if all_logits:
            hidden = kv.gather(m.draft_hidden(xd))
            res.draft_hidden = hidden[last]
            res.all_draft_hidden = hidden
            res.all_draft_logits = m.draft_logits(hidden)
            res.draft_logits = res.all_draft_logits[last]
        else:  # only the last rows cross the group
            res.draft_hidden = kv.gather_rows(m.draft_hidden(xd), last)
            res.draft_logits = m.draft_logits(res.draft_hidden)

    def _layers(self, kv: BatchKV, inputs: RankInputs, seconds: dict[str, float],
                capture: bool, x: torch.Tensor, layers: range,
                hook: LayerHook | None = None, progress: BatchProgress | None = None
                ) -> tuple[torch.Tensor, TopkCapture | None]:
        """``layers`` (consecutive pool layers) on this rank's rows, residual stream ``x``;
        ``hook.layer_written(layer)`` after each layer's KV write (the layer-pipelined send).
        Returns the residual stream after the last layer and the captured top-k (``capture``).
        ``progress`` counts the batch's tokens done per layer and row chunk (host counters;
        None: bare notes). Runs inside :attr:`sync_free_region` ``("layers")``."""
        with self.sync_free_region("layers"):
            return self._layer_loop(kv, inputs, seconds, capture, x, layers, hook, progress)

    def _layer_loop(self, kv: BatchKV, inputs: RankInputs, seconds: dict[str, float],
                    capture: bool, x: torch.Tensor, layers: range,
                    hook: LayerHook | None, progress: BatchProgress | None
                    ) -> tuple[torch.Tensor, TopkCapture | None]:
        m, ops, pool = self.model, self.ops, self.pool
        step: Callable[[], None] = progress.step if progress is not None else note_progress
        end_layer: Callable[[], None] = progress.end_layer if progress is not None \
            else note_progress
        pos = inputs.positions
        rope = m.rope_cos_sin(pos, m.dtype, inputs.max_position)  # once per batch
        # the rotations through the op table's ``rope`` when it has one (one Triton pass each
        # on GPUs), else the model's reference sequence
        rotate = ops.rope if ops.has(Op.ROPE) else None
        norm = ops.rms_norm if ops.has(Op.RMS_NORM) else None
        budget = self.budget if self.device.type != "cpu" \
            else min(self.budget, CPU_PROGRESS_CHUNK_BYTES)
        chunks = row_chunks(kv.rows.num_local, 4 * inputs.num_keys, budget)
        # sparse MLA outputs per row: [H, dv] fp32 at most, then the model dtype (a backend with
        # temporaries of its own, like the torch reference's gathered rows, bounds them itself;
        # chunking by those made FlashMLA calls of 37 rows at DeepSeek sizes: half the GPU idle)
        mla_chunks = row_chunks(kv.rows.num_local, 6 * m.config.num_attention_heads * self.dv,
                                self.budget)
        cap = TopkCapture() if capture else None
        select = self.select_latent
        if select is None:  # host ints of the plan: the same on every rank, no sync
            select = kv.rows.num_local * self.topk < inputs.num_keys
        # the next layer's cached prefix pages move while this layer computes (rule 17: one more
        # layer's view in memory); the same decision on every rank (plan + settings only)
        nxt = pool.prefetch(layers.start, kv) if self.prefetch else None
        phase = dict.fromkeys(("attn_inputs", "write", "materialize", "indexer", "sparse_mla",
                               "mlp"), 0.0)
        # per-head values of every sparse-MLA chunk in one buffer (once per batch, rewritten by
        # each layer), then one o_proj GEMM over all rows (o_proj per chunk ran ~20 % under the
        # GEMM's rate at 64K, plus a concatenation)
        values = torch.empty(kv.rows.num_local, m.config.num_attention_heads, m.config.v_head_dim,
                             dtype=m.dtype, device=self.device)
        #: the last full layer's top-k choice (and captured scores): what a shared-indexer layer
        #: (GLM-5) reuses, in the same view coordinates (every layer's view has the same keys)
        shared_top: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        for layer in layers:
            t0 = time.perf_counter()
            if progress is not None:  # units of the layer: its row chunks, its MLP (a shared-
                # indexer layer has no indexer chunks: its end_layer counts them done)
                progress.start_layer(len(chunks) + len(mla_chunks) + 1)
            a = m.attention_inputs(layer, x, pos, rope, rotate, norm)
            t1 = time.perf_counter()
            rot = self.rotate_index
            pool.write(layer, kv, a.latent,
                       None if a.index_k is None else
                       hadamard_rotate(a.index_k) if rot else a.index_k)
            if hook is not None:
                hook.layer_written(layer)
            t2 = time.perf_counter()
            view = pool.materialize(layer, kv, nxt)
            nxt = pool.prefetch(layer + 1, kv) if self.prefetch and layer + 1 < layers.stop \
                else None
            # with ``select`` the latent rows are read later, only those the top-k picks
            keys = view.attention_keys(a.q.dtype, whole=not select)
            idx_k, idx_scale = keys.index_k, keys.index_scale
            t3 = time.perf_counter()
            if a.index_q is None or a.index_w is None:  # shared indexer: the last full layer's
                if shared_top is None:
                    raise ValueError(f"layer {layer} reuses the previous full layer's top-k, but "
                                     f"no full layer ran before it in layers {layers}")
                top, scores = shared_top
            else:
                top, scores = self._select(a.index_q, a.index_w, idx_k, idx_scale, inputs,
                                           chunks, cap is not None, step)
                shared_top = (top, scores)
            t4 = time.perf_counter()
            # row chunks bound the sparse-attention temporaries (latent outputs are fp32 [H, 512]
            # per row: 34 GB for 128K rows at DeepSeek sizes if taken at once)
            for s, e in mla_chunks:
                m.attention_values(layer, keys.sparse_mla(a.q[s:e], top[s:e], m.softmax_scale,
                                                          self.dv), out=values[s:e])
                step()
            if cap is not None:
                cap.indices.append(kv.gather(top))
                cap.scores.append(kv.gather(torch.cat(scores) if scores else
                                            torch.zeros(0, self.topk, device=self.device)))
            # the layer's attention temporaries go before the MLP and the next layer's inputs
            # (held, the query alone, [rows, H, 576] bf16, is 9.7 GB at 64K rows: it was alive
            # while the next layer built its own)
            del a, keys, view, top, idx_k, idx_scale, scores
            if shared_top is not None and not m.shares_top_after(layer):
                shared_top = None  # no later layer reuses it: free it before the MLP
            if kv.rows.num_local:  # a rank may hold no rows of a tiny batch
                x = x + m.output_projection(layer, values)
            t5 = time.perf_counter()
            x = x + m.mlp(layer, x, norm)
            t6 = time.perf_counter()
            end_layer()
            for k, v in zip(phase, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5),
                            strict=True):
                phase[k] += v
        seconds.update(phase)
        return x, cap

    def _select(self, iq: torch.Tensor, iw: torch.Tensor, idx_k: torch.Tensor,
                idx_scale: torch.Tensor | None, inputs: RankInputs,
                chunks: list[tuple[int, int]], capture: bool,
                step: Callable[[], None] = note_progress,
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A full layer's top-k choice of this rank's rows (int32 [rows, topk] view keys) from
        the indexer logits in row chunks, and the captured scores (``capture``); ``step()``
        after each chunk (the progress notes)."""
        ops, ks, ke = self.ops, inputs.key_start, inputs.key_end
        scores: list[torch.Tensor] = []
        if self.indexer_fp8:  # fp8 keys: fp8 queries, rotated as an fp8 pool's index-K is
            iq, iw = ops.index_q_fp8(iq, iw, self.rotate_index)
        elif self.rotate_index:
            iq = hadamard_rotate(iq)
        # each row block's choice written into one buffer (a list then a concatenation held
        # both: 2 x 537 MB at 64K rows)
        top = torch.empty(iq.shape[0], self.topk, dtype=torch.int32, device=self.device)
        # without a capture the choice is all that is kept: the one op lets a backend choose
        # without storing the logits (Triton does for long views: its measured threshold)
        fused = not capture and ops.has(Op.INDEXER_TOPK)
        for s, e in chunks:
            if fused:
                top[s:e] = ops.indexer_topk(iq[s:e], iw[s:e], idx_k, idx_scale, ks[s:e],
                                            ke[s:e], self.topk)
                step()
                continue
            logits = ops.indexer_logits(iq[s:e], iw[s:e], idx_k, idx_scale, ks[s:e], ke[s:e])
            top[s:e] = ops.topk(logits, self.topk, ks[s:e], ke[s:e])
            step()  # the launcher's and the transfer's bounds are on silence
            if capture:
                scores.append(torch.where(top[s:e] >= 0,
                                          logits.gather(1, top[s:e].clamp_min(0).long()),
                                          float("-inf")))
            del logits
        return top, scores


def _token_ids(ids: Sequence[int], start: int, end: int) -> torch.Tensor:
    """Host int64 tensor of ``ids[start:end]``: a slice of a tensor (or an array) without a
    per-element copy (a 1-D tensor of ids used to go through a list of 0-d tensors: ~44 ms per
    64K ids, against ~1 ms for a list and ~0.01 ms for a tensor)."""
    part = ids[start:end]
    if isinstance(part, torch.Tensor):
        return part.to(device="cpu", dtype=torch.int64)
    if isinstance(part, list | tuple) and part:  # through a machine-int array: 3.5x faster
        return torch.frombuffer(array.array("q", part), dtype=torch.int64)
    return torch.as_tensor(part, dtype=torch.int64)
