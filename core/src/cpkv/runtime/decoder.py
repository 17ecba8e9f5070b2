"""The lean decode step: new tokens of each request on the (non-CP) decode rank, as device work on
persistent buffers, replayed from CUDA graphs on GPUs.

A step does on the host only what changes: each request's new pages when its tail page fills (the
page table, all or nothing), then one copy of the step's inputs into buffers that live as long as
the step's shape: token ids, positions, the new KV's token rows, each row's key count, and each
request's block table (its pages' slots; a row is rewritten only when the request's page table
changed, by its version). On the device, per layer: attention inputs, the new KV rows written into
the request's pages, the indexer over the request's keys read in place through the block table
(``indexer_logits_index_pages`` on the engines' ``two_part`` pool, whose index-K lies in
DeepGEMM's page order: 16-byte key rows; ``indexer_logits_paged`` on a part-major one), top-k,
the block table turning the picks into token rows, sparse MLA over them in place
(``sparse_mla_paged``), the MLP; then the final logits and the greedy tokens.
No split plan, no batch of row layouts, no host read until the tokens.

Three kinds of step, one machinery:

* :meth:`LeanDecoder.step`: one token per request (a plain decode step). A model with its MTP
  layer runs it too on the same row (its KV rows are written: speculation may follow).
* :meth:`LeanDecoder.verify`: ``R`` tokens per request (the last emitted token and ``R - 1``
  drafts), causal among themselves: the target's greedy choice at every row, then the MTP layer on
  the same rows with those choices as next tokens: its guesses and ``h'``.
* :meth:`LeanDecoder.draft`: the MTP layer alone, one position further per request, fed a draft
  token and the previous ``h'`` (chained drafts).

Shapes: a batch is padded to its bucket (powers of two up to ``decode.max_batch``), the block
table to a power-of-two number of pages covering the longest request; padded rows repeat the first
request (same tokens, positions and KV rows: they write the bytes it writes). Each shape is
captured once, after one eager run of the real step that compiles its kernels, into a CUDA graph
sharing one memory pool, and replayed. The model's rope table grows by reallocation when a longer
block table first appears: the graphs captured before are then dropped and captured again, so no
replay reads a freed table.

Eager steps, the same device work: on CPUs (said once), with ``decode.cuda_graphs = false``, for
a batch past the largest bucket, or when a capture fails (fallback ``decode_eager``, once per
cause). The decode pool keeps no prefix cache, so no request's tail page is shared.
"""

from __future__ import annotations

import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cpkv.contracts import BufferLayout, FallbackReason, KVDtype, KVFormat, Op
from cpkv.fallback import report_fallback
from cpkv.logs import get_logger
from cpkv.ops import hadamard_rotate

if TYPE_CHECKING:
    from cpkv.kv import KVStore, PageTable, RequestPages
    from cpkv.models import DeepseekV32
    from cpkv.ops import OpTable

__all__ = ["DecodeShape", "LastStep", "LeanDecoder", "Verified", "bucket_of"]

log = get_logger(__name__)


def bucket_of(n: int, smallest: int = 1) -> int:
    """The power of two at least ``n`` (and ``smallest``)."""
    b = max(1, smallest)
    while b < n:
        b *= 2
    return b


@dataclass(frozen=True)
class DecodeShape:
    """A step's static shape: ``batch`` requests (a bucket), ``pages`` block-table columns,
    ``rows`` new tokens per request; ``draft``: the MTP layer alone (a chained draft step)."""

    batch: int
    pages: int
    rows: int = 1
    draft: bool = False


@dataclass(frozen=True)
class _LayerPages:
    """One pool layer as the step's kernels read it in place: the latent pages ``sparse_mla_paged``
    reads (``latent_fmt`` their format), and the index-K the indexer reads (a part-major
    layer's pages, or a two_part layer's index-K tensor: ``index_pages``); ``fmt`` the layer's
    format."""

    latent: torch.Tensor
    latent_fmt: KVFormat
    index: torch.Tensor | None
    fmt: KVFormat
    index_pages: bool


def _layer_pages(store: KVStore) -> list[_LayerPages]:
    out = []
    for layer, fmt in enumerate(store.fmts):
        if store.spec.layout is BufferLayout.TWO_PART:
            lb = store.spec.layers[layer]
            assert lb.latent is not None
            out.append(_LayerPages(lb.latent, fmt.latent_only(), lb.index_k, fmt, True))
        else:
            pages = store.kv[layer]
            out.append(_LayerPages(pages, fmt, pages if fmt.index_k else None, fmt, False))
    return out


@dataclass(frozen=True)
class LastStep:
    """How the last step ran: its shape, and whether a CUDA graph replayed it."""

    shape: DecodeShape
    graph: bool


@dataclass(frozen=True)
class Verified:
    """A :meth:`LeanDecoder.verify` step's results, per request (batch order), per row:
    ``choice`` the target's greedy token, ``guess`` the MTP layer's (given ``choice`` as the next
    token); ``hidden`` [requests * rows, hidden] the MTP layer's ``h'`` of every row (a copy)."""

    choice: list[list[int]]
    guess: list[list[int]]
    hidden: torch.Tensor


class _Buffers:
    """The persistent inputs and outputs of one shape (device), with their host staging."""

    def __init__(self, shape: DecodeShape, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        b, m, n = shape.batch, shape.pages, shape.batch * shape.rows
        pin = device.type == "cuda"
        #: int64 [4, N] rows: ids, positions, new KV token rows, key counts
        self.host = torch.zeros(4, n, dtype=torch.int64, pin_memory=pin)
        self.host_table = torch.zeros(b, m, dtype=torch.int32, pin_memory=pin)
        self.rows = torch.zeros(4, n, dtype=torch.int64, device=device)
        self.table = torch.zeros(b, m, dtype=torch.int32, device=device)
        self.request = torch.arange(b, dtype=torch.int32,
                                    device=device).repeat_interleave(shape.rows)
        self.key_start = torch.zeros(n, dtype=torch.int64, device=device)
        self.choice = torch.zeros(n, dtype=torch.int64, device=device)
        self.guess = torch.zeros(n, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=device)
        #: a draft step's input h' per request
        self.h_in = torch.zeros(b, hidden, dtype=dtype, device=device)
        #: per request row: (the page table staged, its version), None when not current (the
        #: object is held: an id could be reused by another request's table)
        self.staged: list[tuple[RequestPages, int] | None] = [None] * b
        #: block-table rows staged on the host since the last upload (the device has the rest)
        self.dirty: set[int] = set(range(b))
        #: the requests of the last staged step (rows past it repeat row 0: padding)
        self.filled = b

    def upload(self) -> None:
        """The step's rows, and the block-table rows that changed: a 64 x 128K table is 512 KB
        (~20 us over PCIe a step), and a request's row changes once every ``page_size`` steps."""
        self.rows.copy_(self.host, non_blocking=True)
        rows = sorted(self.dirty)
        if len(rows) * 4 > self.table.shape[0]:
            self.table.copy_(self.host_table, non_blocking=True)
        else:
            for i in rows:
                self.table[i].copy_(self.host_table[i], non_blocking=True)
        self.dirty.clear()


class LeanDecoder:
    """Greedy decode steps over a one-rank pool in the ``two_part`` or part-major layout (see the
    module docstring).

    Args:
        model: the loaded model (its MTP layer, when loaded, runs in every step but
            :meth:`draft`'s, which runs it alone).
        pages: the decode rank's page table (``pool.pages`` of a one-rank pool, no prefix cache).
        store: that pool's bytes (``pool.store``: ``kv.layout`` two_part or part_major).
        ops: the pool's op table (``indexer_logits_paged``, ``topk``, ``sparse_mla_paged``).
        cuda_graphs: capture and replay CUDA graphs on a CUDA device.
        max_batch: the largest bucket captured.
        indexer_fp8: fp8 indexer queries when the index keys are fp8 (``runtime.indexer_dtype``).
    """

    def __init__(self, model: DeepseekV32, pages: PageTable, store: KVStore, ops: OpTable, *,
                 cuda_graphs: bool = True, max_batch: int = 128,
                 indexer_fp8: bool = False) -> None:
        if store.group.size != 1 or store.spec.layout not in (BufferLayout.TWO_PART,
                                                               BufferLayout.PART_MAJOR):
            raise ValueError("the lean decode step needs a one-rank pool in the two_part or "
                             "part_major layout")
        self.model, self.pages, self.store, self.ops = model, pages, store, ops
        #: the norms through the op table's ``rms_norm`` (one Triton pass a norm on GPUs)
        self.norm = ops.rms_norm if ops.has(Op.RMS_NORM) else None
        #: per layer, the tensors the kernels read in place
        self.layers = _layer_pages(store)
        self.device = store.group.device
        self.page_size = store.fmt.page_size
        self.topk = model.config.index_topk
        #: an fp8 pool's index-K is rotated (see :class:`~cpkv.runtime.prefill.CPPrefill`)
        self.rotate_index = store.fmt.dtype is KVDtype.FP8
        self.indexer_fp8 = indexer_fp8 and self.rotate_index
        self.max_batch = bucket_of(max_batch)
        self.graphs = cuda_graphs and self.device.type == "cuda"
        #: the largest position the model's rope table was asked to hold (see the module docstring)
        self._rope_top = -1
        self._buffers: dict[DecodeShape, _Buffers] = {}
        self._graphs: dict[DecodeShape, torch.cuda.CUDAGraph] = {}
        self._eager_shapes: set[DecodeShape] = set()
        self._pool_handle: Any = None  # torch's graph memory pool handle (an opaque token)
        self._said: set[str] = set()
        #: the last step's shape and path
        self.last: LastStep | None = None
        self.captures = 0

    # ---- the steps -----------------------------------------------------------------------------
    def step(self, batch: Sequence[tuple[Hashable, int]]) -> list[int]:
        """Append each ``(request id, token)`` and return each request's next greedy token.

        Raises:
            KeyError: a request is not in the pool.
            ValueError: an empty batch, or a request twice.
            PoolExhausted: no page for a request's next token (nothing changed).
        """
        out = self._extend([(rid, [tok]) for rid, tok in batch], draft=False)
        return out.choice[: len(batch)].tolist()

    def verify(self, batch: Sequence[tuple[Hashable, Sequence[int]]]) -> Verified:
        """Append each request's tokens (every request the same number ``R``: the last emitted
        token and ``R - 1`` drafts) and return, per row, the target's greedy token and the MTP
        layer's guess after it, and the MTP layer's ``h'`` (see :class:`Verified`). Rows of
        rejected drafts stay in the pool: truncate them (``pages.truncate``).

        Raises:
            ValueError: no MTP layer, an empty batch, a request twice, or unequal token counts.
            KeyError, PoolExhausted: as :meth:`step`.
        """
        if self.model.mtp_layer is None:
            raise ValueError("verify needs the model's MTP layer (load it with mtp=True)")
        r = len(batch[0][1]) if batch else 0
        if any(len(ids) != r for _, ids in batch):
            raise ValueError("every request of a verify step needs the same number of tokens")
        buf = self._extend(batch, draft=False)
        n = len(batch) * r
        choice, guess = buf.choice[:n].view(-1, r).tolist(), buf.guess[:n].view(-1, r).tolist()
        return Verified(choice, guess, buf.hidden[:n].clone())

    def draft(self, batch: Sequence[tuple[Hashable, int]], h: torch.Tensor
              ) -> tuple[list[int], torch.Tensor]:
        """One chained draft step: per ``(request id, draft token)`` the MTP layer alone at the
        request's next position, fed the token and ``h`` ([requests, hidden]: the previous
        ``h'``); its KV row is written (one more token of the request: truncate it once the
        chain is done). Returns the MTP layer's greedy guesses and ``h'`` (a copy).

        Raises:
            ValueError: no MTP layer, ``h`` of the wrong shape, an empty batch or a request twice.
            KeyError, PoolExhausted: as :meth:`step`.
        """
        if self.model.mtp_layer is None:
            raise ValueError("draft steps need the model's MTP layer (load it with mtp=True)")
        if h.shape != (len(batch), self.model.config.hidden_size):
            raise ValueError(f"h must be [{len(batch)}, {self.model.config.hidden_size}], "
                             f"got {list(h.shape)}")
        buf = self._extend([(rid, [tok]) for rid, tok in batch], draft=True, h=h)
        n = len(batch)
        return buf.guess[:n].tolist(), buf.hidden[:n].clone()

    # ---- host side -----------------------------------------------------------------------------
    def _extend(self, batch: Sequence[tuple[Hashable, Sequence[int]]], *, draft: bool,
                h: torch.Tensor | None = None) -> _Buffers:
        """Grow, stage, run; on any failure the requests are what they were."""
        if not batch:
            raise ValueError("a decode step needs at least one request")
        if len({rid for rid, _ in batch}) != len(batch):
            raise ValueError("a request appears twice in one decode step")
        shape = self._shape(batch, draft)
        grown = self._grow(batch)
        try:
            buf = self._stage(shape, batch, grown)
            if h is not None:
                buf.h_in[: len(batch)] = h
                buf.h_in[len(batch):] = h[:1]
            graph = self._run(shape, buf)
            # reading the outputs is the step's one host sync (the callers' tolist)
        except BaseException:
            for (rid, _), (pos, _) in zip(batch, grown, strict=True):
                self.pages.truncate(rid, pos)
            raise
        self.last = LastStep(shape, graph)
        return buf

    def _shape(self, batch: Sequence[tuple[Hashable, Sequence[int]]], draft: bool) -> DecodeShape:
        table, s = self.pages.requests, self.page_size
        r = len(batch[0][1])
        longest = max(table[rid].valid_len for rid, _ in batch) + r
        return DecodeShape(bucket_of(len(batch)), bucket_of(-(-longest // s), 16), r, draft)

    def _grow(self, batch: Sequence[tuple[Hashable, Sequence[int]]]
              ) -> list[tuple[int, RequestPages]]:
        """Each request its new tokens longer in the page table, new pages where its tail page
        fills (taken all or nothing): per request (its first new position, its page table)."""
        table, s = self.pages.requests, self.page_size
        reqs = [table[rid] for rid, _ in batch]
        need = [-(-(rp.valid_len + len(ids)) // s) - len(rp.slots)
                for rp, (_, ids) in zip(reqs, batch, strict=True)]
        total = sum(need)
        fresh = iter(self.pages.allocate_pages(0, total, "decode pages") if total else [])
        out: list[tuple[int, RequestPages]] = []
        for (rid, ids), rp, k in zip(batch, reqs, need, strict=True):
            n = rp.valid_len
            self.pages.extend(rid, [(0, next(fresh)) for _ in range(k)], n + len(ids))
            out.append((n, table[rid]))
        return out

    def _stage(self, shape: DecodeShape, batch: Sequence[tuple[Hashable, Sequence[int]]],
               grown: list[tuple[int, RequestPages]]) -> _Buffers:
        """The step's inputs into the shape's host staging: the per-row integers in one tensor,
        and the block-table rows of requests whose pages changed since this shape last staged
        them (a request's page table object and its version say so)."""
        buf = self._buffers.get(shape)
        if buf is None:
            buf = self._buffers[shape] = _Buffers(shape, self.model.config.hidden_size,
                                                  self.model.dtype, self.device)
        s, r, n = self.page_size, shape.rows, len(batch) * shape.rows
        ids = [t for _, toks in batch for t in toks]
        pos = [p + j for p, _ in grown for j in range(r)]
        dst = [rp.slots[(p + j) // s] * s + (p + j) % s for p, rp in grown for j in range(r)]
        vals = ids + pos + dst + [p + 1 for p in pos]
        host, table, staged = buf.host, buf.host_table, buf.staged
        host[:, :n] = torch.tensor(vals, dtype=torch.int64).view(4, n)
        for i, (_, rp) in enumerate(grown):
            held = staged[i]
            if held is None or held[0] is not rp or held[1] != rp.version:
                table[i, :len(rp.slots)] = torch.frombuffer(array.array("i", rp.slots),
                                                            dtype=torch.int32)
                staged[i] = (rp, rp.version)
                buf.dirty.add(i)
        b = len(batch)  # padding: the first request again
        host[:, n:] = host[:, :r].repeat(1, shape.batch - b)
        if b != buf.filled or 0 in buf.dirty:
            table[b:] = table[:1]
            buf.dirty.update(range(b, shape.batch))
            buf.filled = b
        staged[b:] = [None] * (shape.batch - b)
        return buf

    # ---- graphs or eager -----------------------------------------------------------------------
    def _run(self, shape: DecodeShape, buf: _Buffers) -> bool:
        why = self._eager_reason(shape)
        graph = None
        if why is None:
            self._fit_rope(shape)
            graph = self._graphs.get(shape) or self._capture(shape, buf)
        else:
            self._say_eager(why)
        buf.upload()
        if graph is None:
            self._forward(shape, buf)
            return False
        graph.replay()
        return True

    def _eager_reason(self, shape: DecodeShape) -> str | None:
        if self.device.type != "cuda":
            return "cpu"
        if not self.graphs:
            return "decode.cuda_graphs = false"
        if shape.batch > self.max_batch:
            return f"a batch of more than decode.max_batch = {self.max_batch} requests"
        if shape in self._eager_shapes:
            return ""  # its capture failed: said then
        return None

    def _fit_rope(self, shape: DecodeShape) -> None:
        """The model's rope table holds the shape's positions before a capture or a replay; when
        it grows (a reallocation) the graphs captured before read the freed table: they go."""
        top = shape.pages * self.page_size - 1
        if top > self._rope_top:
            self.model.rope_cos_sin(torch.zeros(1, dtype=torch.int64, device=self.device),
                                    self.model.dtype, top)
            self._rope_top = top
            self._graphs.clear()

    def _say_eager(self, why: str) -> None:
        if not why or why in self._said:
            return
        self._said.add(why)
        if why == "cpu":
            log.info("cpkv.decode.eager", why="CUDA graphs need a CUDA device")
            return
        report_fallback(op="decode_step", requested="replay the step's CUDA graph",
                        selected="run the step eagerly", reason=FallbackReason.DECODE_EAGER,
                        detail=why)

    def _capture(self, shape: DecodeShape, buf: _Buffers) -> torch.cuda.CUDAGraph | None:
        """One eager run of the staged step (compiles the shape's kernels; the replay then
        writes the same KV bytes again), then the capture; None (reported, the shape stays
        eager) when the capture fails."""
        buf.upload()
        cur = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(cur)
        try:
            with torch.cuda.stream(stream):
                self._forward(shape, buf)
            cur.wait_stream(stream)
            if self._pool_handle is None:
                self._pool_handle = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool_handle, stream=stream):
                self._forward(shape, buf)
        except Exception as exc:  # any capture failure: eager, visibly
            torch.cuda.synchronize(self.device)
            self._eager_shapes.add(shape)
            report_fallback(op="decode_step", requested="capture the step in a CUDA graph",
                            selected="run the step eagerly", reason=FallbackReason.DECODE_EAGER,
                            detail=f"capture of {shape} failed: {type(exc).__name__}: {exc}")
            return None
        self._graphs[shape] = graph
        self.captures += 1
        log.debug("cpkv.decode.captured", shape=str(shape))
        return graph

    # ---- the device work -----------------------------------------------------------------------
    def _forward(self, shape: DecodeShape, buf: _Buffers) -> None:
        """The device work of one step on ``buf`` (no host sync: captured as is)."""
        m = self.model
        ids, pos = buf.rows[0], buf.rows[1]
        rope = m.rope_cos_sin(pos, m.dtype, shape.pages * self.page_size - 1)
        mtp = m.mtp_layer
        if shape.draft:  # the MTP layer alone, fed the draft tokens and the previous h'
            assert mtp is not None
            x = m.draft_input(m.draft_embed(ids), buf.h_in.repeat_interleave(shape.rows, 0))
            x, _ = self._layer(mtp, x, rope, buf)
            hd = m.draft_hidden(x)
            buf.guess.copy_(m.draft_logits(hd).argmax(dim=-1))
            buf.hidden.copy_(hd)
            return
        x = m.embed(ids)
        picks: torch.Tensor | None = None  # the last full layer's picks (shared layers reuse)
        for layer in range(m.num_layers):
            x, picks = self._layer(layer, x, rope, buf, picks)
        buf.choice.copy_(m.final_logits(x, self.norm).argmax(dim=-1))
        if mtp is not None:  # the MTP layer on the same rows, the target's choice next
            xd = m.draft_input(m.draft_embed(buf.choice), m.final_hidden(x, self.norm))
            hd = m.draft_hidden(self._layer(mtp, xd, rope, buf)[0])
            buf.guess.copy_(m.draft_logits(hd).argmax(dim=-1))
            buf.hidden.copy_(hd)

    def _layer(self, layer: int, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               buf: _Buffers, shared: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer (pool layer ``layer``) on the step's rows (``rope`` computed once
        per step). Returns the residual stream and the layer's picks
        (int32 [rows, k] token rows of the pages, -1 empty); a shared-indexer layer (GLM-5)
        reads ``shared``, the last full layer's picks: the same token rows in its own pages."""
        m, ops, store, s = self.model, self.ops, self.store, self.page_size
        pos, dst, key_end = buf.rows[1], buf.rows[2], buf.rows[3]
        a = m.attention_inputs(layer, x, pos, rope, ops.rope, self.norm)
        rot = self.rotate_index
        store.write_rows(layer, dst, a.latent, a.index_k, rot)
        lp = self.layers[layer]
        if a.index_q is None or a.index_w is None:
            if shared is None:
                raise ValueError(f"layer {layer} reuses the previous full layer's top-k, but no "
                                 f"full layer ran before it")
            rows = shared
        else:
            iq, iw = a.index_q, a.index_w
            assert lp.index is not None, f"layer {layer} runs the indexer: the pool holds its index-K"
            if self.indexer_fp8:  # rotated (an fp8 pool's index-K is) and quantized, one op
                iq, iw = ops.index_q_fp8(iq, iw, rot)
            elif rot:
                iq = hadamard_rotate(iq)
            read = ops.indexer_logits_index_pages if lp.index_pages else ops.indexer_logits_paged
            logits = read(iq, iw, lp.index, lp.fmt, buf.table, buf.request, key_end)
            top = ops.topk(logits, self.topk, buf.key_start, key_end)
            rows = ops.page_rows(top, buf.table, buf.request, s)  # request keys -> token rows
        o = ops.sparse_mla_paged(a.q, lp.latent, rows, lp.latent_fmt, m.softmax_scale,
                                 m.config.kv_lora_rank)
        x = x + m.attention_output(layer, o)
        return x + m.mlp(layer, x, self.norm), rows
