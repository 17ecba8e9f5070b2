"""PrefillSession: what an engine embeds on each rank of its CP group."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from cpkv.cache import PrefixCache
from cpkv.comm import CPGroup, last_progress, note_progress
from cpkv.disagg import Link, PrefillTransfer, Sent, TransferRefused, Transport, open_link
from cpkv.kv import PoolExhausted, RequestPages
from cpkv.kv.host import HostPages
from cpkv.ops import DSA_OPS
from cpkv.plugin import PluginHost

from .budget import logits_budget
from .chunked import ChunkPiece, chunk_rounds, merge_results
from .prefill import BATCH_PLAN, CPPrefill, DraftNext, PrefillResult
from .setup import create_pool, has_fp8_tensor_cores
from .warmup import WarmupReport, warm_up

if TYPE_CHECKING:
    from cpkv.comm import CPGroup
    from cpkv.contracts import CPPlan
    from cpkv.models import DeepseekV32
    from cpkv.settings import Settings

__all__ = ["PrefillSession"]


class _LayerSends:
    """The layer-pipelined transfer's hook in the layer loop: opens the batch's first request to
    send once its pages are reserved, then queues each layer's sends after its KV write (on GPUs
    after a CUDA event recorded on the compute stream: no host sync in the loop).

    One request per batch: the decode side takes requests one at a time, in the order they are
    sent, so a second request opened before the layer loop would wait for a grant the decode gives
    only after the first one's last layer. The batch's other requests move after it, whole."""

    def __init__(self, sender: PrefillTransfer, session: PrefillSession,
                 finals: Mapping[Hashable, bool], started: float) -> None:
        self.sender, self.session, self.finals, self.started = sender, session, finals, started

    def batch_ready(self, plan: CPPlan, rids: Sequence[Hashable]) -> None:
        for rid, req in zip(rids, plan.requests, strict=True):
            if rid in self.finals:
                rp = self.session.pool.pages.requests[rid]  # reserved, written during the layer loop
                pages = RequestPages(list(rp.owners), list(rp.slots), req.end)
                # refused (e.g. the decode pool is full): the prefill goes on, and send() offers
                # the request again after it, whole
                with contextlib.suppress(TransferRefused):
                    self.sender.open_request(rid, pages, final=self.finals[rid],
                                             started=self.started)
                return

    def layer_written(self, layer: int) -> None:
        ready = None
        if self.session.group.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        self.sender.layer_written(layer, ready)


class PrefillSession:
    """CP prefill of a loaded model on one rank: the sharded pool, the ops, the driver.

    Every rank of the CP group creates one with the same settings and calls :meth:`prefill`
    with the same batches (the calls are collectives). To hand requests to a decode rank, every
    rank joins a transfer once (:meth:`connect`) and then calls :meth:`send` for a request after
    the batch that computed it (the decode side is :class:`~cpkv.runtime.decode.DecodeSession`).

    Args:
        model: the loaded model (``cpkv.models.load_model``).
        settings: run settings (``cpkv.load_settings``).
        group: this rank's CP group (``CPGroup.from_process_group()``, ``CPGroup.single()``).

    With ``runtime.warmup_tokens`` the session warms up before it returns
    (:mod:`cpkv.runtime.warmup`; a collective like :meth:`prefill`): :attr:`warmup` has its time.

    Raises:
        StartupError: the settings cannot work with this model/group (before any allocation).
        PoolExhausted: the warm-up's prompt does not fit the pool.
    """

    def __init__(self, model: DeepseekV32, settings: Settings, group: CPGroup,
                 host: PluginHost | None = None) -> None:
        # "auto" formats decided for this group's device (fp8 where it has fp8 tensor cores)
        settings = settings.resolved(has_fp8_tensor_cores(group.device))
        self.model, self.settings, self.group = model, settings, group
        # one format per KV layer: a shared-indexer layer (GLM-5) stores its latent only
        fmt = model.kv_formats(settings.kv.pool_dtype(), settings.kv.page_size)
        # a model loaded with its MTP layer: the draft layer's KV is one more layer of the pool
        self.pool = create_pool(settings, fmt, model.kv_layers, group, host, ops=DSA_OPS)
        self.ops = self.pool.store.ops
        problem = settings.cross_section_problem()  # settings built by model_copy skip it
        if problem is not None:
            raise ValueError(problem)
        # "auto" reads this device's free memory now, after the model and the pool took theirs;
        # ranks may get different budgets: it only chunks rank-local compute (budget.py)
        budget = logits_budget(settings.runtime.logits_budget_mb, group.device)
        #: the effective indexer logits/scratch budget, MiB, and whether "auto" chose it
        self.logits_budget_mb, self.logits_budget_auto = budget.mb, budget.auto
        self.driver = CPPrefill(model, self.pool, self.ops, mode=settings.cp.mode,
                                logits_budget_bytes=budget.bytes,
                                prefetch=settings.runtime.prefetch,
                                indexer_fp8=settings.runtime.indexer_dtype == "fp8")
        self._sender: PrefillTransfer | None = None
        #: what the last :meth:`prefill` sent itself: the non-final chunks of a chunked prefill
        #: (:meth:`send`'s results, in order; the caller's own sends are not in it)
        self.chunk_sends: tuple[Sent, ...] = ()
        #: wall clock of the last batch's prefill start and end (transfer timing)
        self._started = self._ended = 0.0
        #: the prefix cache (``cache.enabled``): same tree on every rank, fed by these calls
        self.cache: PrefixCache | None = None
        if settings.cache.enabled:
            c, tier = settings.cache, None
            if c.host_pages:
                tier = HostPages(fmt, model.kv_layers, c.host_pages,
                                 self.pool.pages.allocator.num_ranks, group.device,
                                 self.pool.store.spec.layout)
            self.cache = PrefixCache(self.pool.pages, self.pool.store, group, tier,
                                     evict=c.eviction == "lru")
        #: the start's warm-up (``runtime.warmup_tokens``; None: off): its time and kernels
        self.warmup: WarmupReport | None = None
        if settings.runtime.warmup_tokens:
            self.warmup = self._warm_up(settings.runtime.warmup_tokens)

    def _warm_up(self, tokens: int) -> WarmupReport:
        """:func:`~cpkv.runtime.warmup.warm_up` over ``tokens``: in ``runtime.chunk_tokens``
        chunks, else whole (as this session prefills a prompt)."""
        ps = self.settings.kv.page_size
        try:
            return warm_up(self, tokens, chunk=-(-tokens // ps) * ps)
        except PoolExhausted as exc:
            raise PoolExhausted(f"runtime.warmup_tokens = {tokens}: the warm-up prompt does not "
                                f"fit the pool ({exc}); raise kv.pages_per_rank or lower "
                                f"runtime.warmup_tokens") from exc

    @property
    def draft(self) -> bool:
        """Whether the draft (MTP) layer runs: the model was loaded with it."""
        return self.model.mtp_layer is not None

    def prefill(self, batch: Sequence[tuple[Hashable, Sequence[int]]], *, all_logits: bool = False,
                capture_topk: bool = False, next_ids: Sequence[int | None] | None = None,
                draft_next: DraftNext = "prompt", draft_plan: CPPlan | None = BATCH_PLAN,
                send: Mapping[Hashable, bool] | None = None,
                chunk_tokens: int | None = None) -> PrefillResult:
        """Prefill ``[(request id, new token ids), ...]``; a request the session already holds
        continues from its cached tokens (the prefix may end inside a page). With the draft
        layer, ``next_ids`` (the token after each extend, when known: a non-final chunk),
        ``draft_next`` and ``draft_plan`` are as for :meth:`CPPrefill.run`.

        ``send`` (request id -> is this its final chunk?, in the order :meth:`send` will be
        called) names the requests handed to the decode rank after this batch. With
        ``transfer.pipeline = "layer"`` (and a transfer :meth:`connect`-ed) the pages of the first
        of them start moving during the layer loop, layer by layer (:meth:`send` then only
        concludes it), the others move after the batch. Ignored otherwise.

        Chunked prefill: a request whose extend is longer than ``chunk_tokens`` (default
        ``runtime.chunk_tokens``; 0: off) is prefilled in chunks, one batch each
        (:mod:`cpkv.runtime.chunked`; the draft layer's last row of a non-final chunk takes the
        request's next token). With a transfer connected, the pages each non-final chunk
        completed are sent after it (``send(rid, final=False)``, layer by layer under the layer
        pipeline; their results in :attr:`chunk_sends`) for the requests named in ``send``; the
        caller then sends the rest as usual.
        The result is the batch's (last-row outputs of each request's last chunk, per-row
        outputs concatenated in natural order) with ``chunk_seconds``, the wall time of each
        chunk (on GPUs up to a device sync after it).

        Raises:
            ValueError: ``chunk_tokens`` is not a multiple of the page size; see
                :meth:`CPPrefill.run` for the rest. When a later chunk fails, the earlier ones
                stay committed (the request holds their tokens).
        """
        self.chunk_sends = ()
        n = self.settings.runtime.chunk_tokens if chunk_tokens is None else chunk_tokens
        rounds = chunk_rounds([(self.pool.pages.request_spec(rid, len(ids)).prefix_len, len(ids))
                               for rid, ids in batch], n, self.pool.fmt.page_size)
        if len(rounds) > 1:
            return self._prefill_chunks(batch, rounds, all_logits=all_logits,
                                        capture_topk=capture_topk, next_ids=next_ids,
                                        draft_next=draft_next, draft_plan=draft_plan, send=send)
        return self._prefill_batch(batch, all_logits=all_logits, capture_topk=capture_topk,
                                   next_ids=next_ids, draft_next=draft_next,
                                   draft_plan=draft_plan, send=send)

    def _prefill_chunks(self, batch: Sequence[tuple[Hashable, Sequence[int]]],
                        rounds: list[list[ChunkPiece]], *, all_logits: bool, capture_topk: bool,
                        next_ids: Sequence[int | None] | None, draft_next: DraftNext,
                        draft_plan: CPPlan | None, send: Mapping[Hashable, bool] | None
                        ) -> PrefillResult:
        """The rounds of a chunked batch (:func:`~cpkv.runtime.chunked.chunk_rounds`), each one
        :meth:`_prefill_batch`; non-final chunks of requests in ``send`` are sent after their
        round (in batch order: the layer pipeline opens the round's first one)."""
        sending = bool(send) and self._sender is not None
        results: list[PrefillResult] = []
        seconds: list[float] = []
        for j, pieces in enumerate(rounds):
            sub = [(batch[p.index][0], batch[p.index][1][p.start:p.end]) for p in pieces]
            # the draft layer's last row of a non-final chunk: the prompt's next token
            nxt = [int(batch[p.index][1][p.end]) if not p.last
                   else None if next_ids is None else next_ids[p.index] for p in pieces]
            partial = [batch[p.index][0] for p in pieces
                       if sending and send and not p.last and batch[p.index][0] in send]
            if j < len(rounds) - 1:
                hook_send: Mapping[Hashable, bool] | None = dict.fromkeys(partial, False)
            else:
                # the caller sends these after the call, in its order: pipeline them only when
                # every request it names ends here (else one opened now could wait on another)
                ends = {batch[p.index][0] for p in pieces}
                hook_send = send if send and all(rid in ends for rid in send) else None
            t = time.perf_counter()
            base = last_progress().done  # the driver counts the chunk's tokens from here
            results.append(self._prefill_batch(sub, all_logits=all_logits,
                                               capture_topk=capture_topk, next_ids=nxt,
                                               draft_next=draft_next, draft_plan=draft_plan,
                                               send=hook_send))
            if self.group.device.type == "cuda":  # the chunk's time, not its launch time
                torch.cuda.synchronize(self.group.device)
            seconds.append(time.perf_counter() - t)
            # the progress display's tokens: this chunk's are done
            note_progress(done=base + sum(len(ids) for _, ids in sub))
            for rid in partial:  # whole pages only: the tail page is the next chunk's
                self.chunk_sends += (self.send(rid, final=False),)
        return merge_results(rounds, results, len(batch), seconds)

    def _prefill_batch(self, batch: Sequence[tuple[Hashable, Sequence[int]]], *,
                       all_logits: bool, capture_topk: bool,
                       next_ids: Sequence[int | None] | None, draft_next: DraftNext,
                       draft_plan: CPPlan | None, send: Mapping[Hashable, bool] | None
                       ) -> PrefillResult:
        """One prefill batch through the driver (see :meth:`prefill`)."""
        self._started = time.time()
        hook = None
        if send and self._sender is not None and self.settings.transfer.pipeline == "layer":
            hook = _LayerSends(self._sender, self, send, self._started)
        try:
            return self.driver.run(batch, all_logits=all_logits, capture_topk=capture_topk,
                                   next_ids=next_ids, draft_next=draft_next,
                                   draft_plan=draft_plan, hook=hook)
        except BaseException:
            if hook is not None and self._sender is not None and self._sender.open:
                self._sender.cancel("the prefill of the batch failed")
            raise
        finally:
            self._ended = time.time()

    def admit(self, rid: Hashable, tokens: Sequence[int]) -> int:
        """Start new request ``rid`` (``tokens``: all its token ids) from the longest prefix the
        cache holds: returns the hit in tokens (0 without a cache or a hit; never all of
        ``tokens``: the last one is always computed), the minimum over ranks (a collective:
        one host sync per request). Then prefill ``tokens[hit:]`` for it. Every rank calls it
        alike (every rank holds the same cache).

        Raises:
            ValueError: ``rid`` is already in the pool.
        """
        if rid in self.pool.pages.requests:
            raise ValueError(f"request {rid!r} is already in the pool")
        if self.cache is None or len(tokens) < 2:
            return 0
        match = self.cache.agree(self.cache.match(tokens))
        if self.draft and match.hit_tokens:
            # the draft layer's row at the hit's last position was computed with the cached
            # request's next token, not necessarily this one's: recompute that row
            self.cache.stats.hit_tokens -= 1
            self.cache.stats.recomputed_tokens += 1
            match = self.cache.tree.prefix(match.path, match.hit_tokens - 1)
        hit = self.cache.attach(rid, match)
        if self.settings.debug:
            self.cache.check_agreement()
        return hit

    def finish(self, rid: Hashable, tokens: Sequence[int] | None = None) -> None:
        """Request ``rid`` is done: with ``tokens`` (its token ids from position 0, at least its
        valid length) and a cache, its KV stays cached for later requests; then its own
        references go (pages no one else holds are free again). Call on every rank."""
        if tokens is not None and self.cache is not None:
            self.cache.insert(rid, tokens)
        self.pool.pages.free(rid)

    def pages(self, rid: Hashable) -> RequestPages:
        """The request's logical page table: owner rank and physical slot of each page."""
        return self.pool.pages.requests[rid]

    def close(self) -> None:
        """Stop the transfer's sender thread (after what it has queued); the link stays."""
        if self._sender is not None:
            self._sender.close()

    def release(self, rid: Hashable) -> None:
        """Free a finished request's pages on every rank (call on every rank)."""
        self.pool.pages.free(rid)

    # ---- prefill -> decode transfer ------------------------------------------------------------
    def connect(self, transport: Transport, *,
                world_ranks: tuple[int, ...] | None = None) -> Link:
        """Join a prefill -> decode transfer as endpoint ``group.rank`` (the decode rank is
        endpoint ``group.size``): a collective over the C prefill ranks and the decode rank.
        ``transport`` comes from :func:`cpkv.disagg.select_transport`; ``world_ranks`` maps
        endpoints to ``torch.distributed`` ranks for transports that use a process group.
        Timeout, debug switch and plugin options come from the session's settings."""
        link = open_link(transport, self.settings, endpoint=self.group.rank,
                         cp_size=self.group.size, pool=self.pool, world_ranks=world_ranks)
        self._sender = PrefillTransfer(link, self.pool, self.group.rank, self.group.size,
                                       debug=self.settings.debug,
                                       max_inflight_bytes=self.settings.transfer.max_inflight_mb << 20)
        return link

    def send(self, rid: Hashable, *, final: bool = True,
             meta: Mapping[str, Any] | None = None) -> Sent:
        """Send the pages of ``rid`` this rank owns that were not sent before, with their logical
        positions (every rank calls it with the same arguments, after the batch that computed
        them). ``final=False`` after a non-final chunk of a chunked prefill: only the whole pages
        it completed move (the tail page is still being written); ``final=True`` sends the rest.
        ``meta`` (e.g. ``{"first_token": t}``) reaches the decode side with the request. Returns
        once the decode rank published the request. A request named in the last
        :meth:`prefill`'s ``send`` under the layer pipeline is already moving: this concludes it.

        Raises:
            RuntimeError: :meth:`connect` was not called.
            TransferError: the decode rank refused or did not publish the request.
        """
        if self._sender is None:
            raise RuntimeError("PrefillSession.send needs a transfer: call connect(transport) first")
        if str(rid) in self._sender.open:
            return self._sender.finish(rid, meta, prefill_end=self._ended)
        return self._sender.send_request(rid, self.pages(rid), final=final, meta=meta,
                                         started=self._started)
