"""The decode worker (not CP): greedy decode steps over KV received from the prefill ranks.

The decode pool is a one-rank, full-layout :class:`~cpkv.kv.ShardedKVPool` (``CPGroup.single()``)
that a :class:`~cpkv.disagg.DecodeReceiver` fills. A decode step (and speculative decoding's
verify and draft steps) is a lean step of :class:`~cpkv.runtime.decoder.LeanDecoder`: the new
tokens' KV appended to their request's pages, the indexer and sparse attention reading the pages
in place through a block table; replayed from CUDA graphs on GPUs. :func:`decode_step` is the
same step through the prefill driver (a one-token extend), the reference. :class:`DecodeSession`
is what a decode process embeds: the worker plus the receiving side of a transfer
(:meth:`DecodeSession.connect`, :meth:`DecodeSession.receive`).
The job's reference (:func:`cpkv.runtime.job.reference_rank`) is greedy generation through the
prefill driver in one process, prefill included.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from cpkv.comm import CPGroup, note_progress
from cpkv.contracts import MaterializeMode
from cpkv.disagg import DecodeReceiver, DecodeTransfer, Link, Received, Transport, open_link

from .decoder import LeanDecoder
from .session import PrefillSession
from .speculative import SpeculationStats, speculative_generate

if TYPE_CHECKING:
    from cpkv.models import DeepseekV32
    from cpkv.plugin import PluginHost
    from cpkv.settings import Settings

__all__ = ["DecodeSession", "DecodeSteps", "DecodeWorker", "decode_step", "generate",
           "generate_with", "greedy"]


@dataclass(frozen=True)
class DecodeSteps:
    """How a worker's decode steps ran so far."""

    #: the last step replayed a CUDA graph
    graphs: bool
    #: step shapes captured in CUDA graphs
    captured: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def greedy(logits: torch.Tensor) -> list[int]:
    """Greedy tokens of float logits ``[requests, vocab]``."""
    return [int(t) for t in logits.float().argmax(dim=-1).tolist()]


def decode_step(session: PrefillSession, batch: Sequence[tuple[Hashable, int]]) -> list[int]:
    """One batched decode step on a one-rank session: a one-token extend of every request."""
    return greedy(session.prefill([(rid, [tok]) for rid, tok in batch]).last_logits)


def generate(session: PrefillSession, first: Sequence[tuple[Hashable, int]],
             num_tokens: int) -> list[list[int]]:
    """``num_tokens`` greedy tokens per request: ``first`` then ``num_tokens - 1`` steps."""
    return generate_with(lambda batch: decode_step(session, batch), first, num_tokens)


def generate_with(step: Callable[[Sequence[tuple[Hashable, int]]], list[int]],
                  first: Sequence[tuple[Hashable, int]], num_tokens: int) -> list[list[int]]:
    """``num_tokens`` greedy tokens per request by ``step``: ``first`` then ``num_tokens - 1``
    steps, every request in each."""
    out = [[tok] for _, tok in first]
    cur = list(first)
    for k in range(num_tokens - 1):
        nxt = step(cur)
        note_progress("decode", (k + 2) * len(first), num_tokens * len(first))
        for o, t in zip(out, nxt, strict=True):
            o.append(t)
        cur = [(rid, t) for (rid, _), t in zip(cur, nxt, strict=True)]
    return out


class DecodeWorker:
    """Greedy decoding on received KV, on one process.

    Args:
        model: the loaded model (the prefill ranks' checkpoint).
        settings: run settings of the prefill group. The decode pool has one rank that holds
            whole requests, so its capacity is ``cp.size x kv.pages_per_rank`` pages (what the
            prefill ranks hold together), and it keeps no prefix cache.
        device: where the decode pool and compute live.
    """

    def __init__(self, model: DeepseekV32, settings: Settings, device: torch.device | str = "cpu",
                 host: PluginHost | None = None) -> None:
        one = settings.with_cp_size(1).model_copy(update={
            # the decode layout's pages: the step's kernels read them in place
            "kv": settings.kv.model_copy(
                update={"pages_per_rank": settings.kv.pages_per_rank * settings.cp.size,
                        "layout": settings.decode.layout,
                        # one rank: its views read its own pool in place (p2p would map nothing)
                        "materialize": MaterializeMode.ALL_GATHER}),
            "cache": settings.cache.model_copy(update={"enabled": False}),
            # the decode rank's session prefills no prompt: nothing to warm up
            "runtime": settings.runtime.model_copy(update={"warmup_tokens": 0})})
        self.session = PrefillSession(model, one, CPGroup.single(device, settings.runtime.timeout_s),
                                      host)
        self.pool = self.session.pool
        self.receiver = DecodeReceiver(self.pool.pages, self.pool.store, debug=settings.debug)
        #: the lean steps (graphs on CUDA)
        self.decoder = LeanDecoder(model, self.pool.pages, self.pool.store, self.session.ops,
                                   cuda_graphs=settings.decode.cuda_graphs,
                                   max_batch=settings.decode.max_batch,
                                   indexer_fp8=self.session.settings.runtime.indexer_dtype
                                   == "fp8")

    def step(self, batch: Sequence[tuple[Hashable, int]]) -> list[int]:
        """One decode step: append each request's token, return the next greedy tokens."""
        return self.decoder.step(batch)

    def generate(self, first: Sequence[tuple[Hashable, int]], num_tokens: int) -> list[list[int]]:
        """``num_tokens`` greedy tokens per request: the first one (from the prefill's logits)
        then ``num_tokens - 1`` decode steps, all requests batched together."""
        return generate_with(self.step, first, num_tokens)

    def speculate(self, first: Sequence[tuple[Hashable, int, int]], num_tokens: int,
                  draft_tokens: int = 1) -> tuple[list[list[int]], SpeculationStats]:
        """``num_tokens`` greedy tokens per request by speculative decoding with the MTP layer
        (``first``: request id, first token, the prefill's first draft); see
        :func:`~cpkv.runtime.speculative.speculative_generate`."""
        return speculative_generate(self.session, first, num_tokens, draft_tokens,
                                    steps=self.decoder)

    def release(self, rid: Hashable) -> None:
        self.pool.pages.free(rid)

    def steps_info(self) -> DecodeSteps:
        """How the decode steps ran so far."""
        last = self.decoder.last
        return DecodeSteps(graphs=last is not None and last.graph, captured=self.decoder.captures)


class DecodeSession:
    """A decode process's side of prefill -> decode transfer: a :class:`DecodeWorker` and the
    receiving protocol (offers, reservation, data, publish; nothing partial is published).

    Args:
        model, settings, device, host: as for :class:`DecodeWorker`.
    """

    def __init__(self, model: DeepseekV32, settings: Settings, device: torch.device | str = "cpu",
                 host: PluginHost | None = None) -> None:
        self.settings = settings
        self.worker = DecodeWorker(model, settings, device, host)
        self.pool = self.worker.pool
        self._rx: DecodeTransfer | None = None

    def connect(self, transport: Transport, *, cp_size: int,
                world_ranks: tuple[int, ...] | None = None) -> Link:
        """Join the transfer from ``cp_size`` prefill ranks as endpoint ``cp_size`` (a collective
        with their :meth:`PrefillSession.connect`)."""
        link = open_link(transport, self.settings, endpoint=cp_size, cp_size=cp_size,
                         pool=self.pool, world_ranks=world_ranks)
        self._rx = DecodeTransfer(link, self.worker.receiver, cp_size)
        return link

    def receive(self) -> Received:
        """Receive, check and publish the next request the prefill ranks send.

        Raises:
            RuntimeError: :meth:`connect` was not called.
            TransferError: refused or failed; nothing of it was published.
        """
        if self._rx is None:
            raise RuntimeError("DecodeSession.receive needs a transfer: call connect(...) first")
        return self._rx.receive()

    def close(self) -> None:
        """Tear the transfer down (quarantined slots come back: no sender can write any more)."""
        if self._rx is not None:
            self._rx.close()
            self._rx = None

    def step(self, batch: Sequence[tuple[Hashable, int]]) -> list[int]:
        """One decode step (see :meth:`DecodeWorker.step`)."""
        return self.worker.step(batch)

    def generate(self, first: Sequence[tuple[Hashable, int]], num_tokens: int) -> list[list[int]]:
        """Greedy tokens per request (see :meth:`DecodeWorker.generate`)."""
        return self.worker.generate(first, num_tokens)

    def speculate(self, first: Sequence[tuple[Hashable, int, int]], num_tokens: int,
                  draft_tokens: int = 1) -> tuple[list[list[int]], SpeculationStats]:
        """Speculative greedy tokens per request (see :meth:`DecodeWorker.speculate`)."""
        return self.worker.speculate(first, num_tokens, draft_tokens)

    def release(self, rid: Hashable) -> None:
        """Free a finished request's pages."""
        self.worker.release(rid)

    def steps_info(self) -> DecodeSteps:
        """How the decode steps ran (see :meth:`DecodeWorker.steps_info`)."""
        return self.worker.steps_info()
