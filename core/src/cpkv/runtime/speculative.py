"""Speculative greedy decoding with the MTP draft layer on the (non-CP) decode rank.

State between steps, per request: the pool holds target and MTP KV of positions ``[0, m)``; the
last emitted token ``t_m`` is not in it yet; ``d_1..d_k`` are draft guesses of ``t_{m+1}..``.

A step is one batch (:meth:`CPPrefill.run` with ``draft_next="greedy"``) that extends every
request by ``[t_m, d_1, .., d_k]``: the target's greedy choice ``g_j`` at each row verifies the
drafts (``d_j`` is accepted while ``d_j == g_{j-1}``, greedy acceptance), and the MTP layer runs
on the same rows with ``g_j`` as each row's next token. With ``a`` drafts accepted the step emits
``g_0..g_a``; rows ``m..m+a`` are exactly what plain greedy decoding would have computed, so their
KV (both layers' kinds) stays and the rows of rejected drafts are dropped
(:meth:`PageTable.truncate`). The MTP row ``m+a`` guesses the next draft ``d'_1``; with
``k > 1`` the MTP layer is chained on its own output (``h'`` and the previous guess, one position
further, :meth:`CPPrefill.run_draft`) and those speculative rows are dropped again before the next
step. The first step verifies the one draft the prefill's MTP row gave.

Greedy speculative output is token for token plain greedy output: every emitted token is the
target's greedy choice after a prefix of emitted tokens.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from cpkv.comm import note_progress

from .decoder import Verified

if TYPE_CHECKING:
    from cpkv.kv import ShardedKVPool

    from .session import PrefillSession

__all__ = ["DriverSteps", "SpeculationStats", "SpeculativeSteps", "speculative_generate"]


class SpeculativeSteps(Protocol):
    """The two steps speculative decoding takes (:class:`~cpkv.runtime.decoder.LeanDecoder`, or
    the prefill driver through :class:`DriverSteps`)."""

    def verify(self, batch: Sequence[tuple[Hashable, Sequence[int]]]) -> Verified: ...

    def draft(self, batch: Sequence[tuple[Hashable, int]], h: torch.Tensor
              ) -> tuple[list[int], torch.Tensor]: ...


class DriverSteps:
    """:class:`SpeculativeSteps` through the prefill driver (a one-rank session): the verify
    step is a batch with every row's logits and the draft layer fed the target's choices, the
    draft step :meth:`~cpkv.runtime.prefill.CPPrefill.run_draft`."""

    def __init__(self, session: PrefillSession) -> None:
        self.session = session

    def verify(self, batch: Sequence[tuple[Hashable, Sequence[int]]]) -> Verified:
        res = self.session.prefill(batch, all_logits=True, draft_next="greedy")
        assert res.all_logits is not None and res.all_draft_logits is not None
        assert res.all_draft_hidden is not None
        choice = res.all_logits.argmax(dim=-1).tolist()  # one host sync per step
        guess = res.all_draft_logits.argmax(dim=-1).tolist()
        c, g, row = [], [], 0
        for _, ids in batch:
            c.append(choice[row:row + len(ids)])
            g.append(guess[row:row + len(ids)])
            row += len(ids)
        return Verified(c, g, res.all_draft_hidden)

    def draft(self, batch: Sequence[tuple[Hashable, int]], h: torch.Tensor
              ) -> tuple[list[int], torch.Tensor]:
        logits, hd = self.session.driver.run_draft(batch, h)
        return logits.argmax(dim=-1).tolist(), hd


@dataclass
class SpeculationStats:
    """What speculation did over one generation."""

    #: batched verify steps (every active request in one batch)
    steps: int = 0
    #: the batched decode steps plain greedy decoding takes for the same tokens
    plain_steps: int = 0
    #: draft tokens proposed and accepted, over all requests
    proposed: int = 0
    accepted: int = 0
    #: (request, step) pairs: each emits 1 + its accepted drafts
    request_steps: int = 0
    #: draft tokens per step (k)
    draft_tokens: int = 1
    #: accepted drafts per step, per request (diagnostics)
    accepted_per_request: dict[str, list[int]] = field(default_factory=dict)

    @property
    def accept_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a request gains per verify step (1 + its accepted drafts), on average."""
        return (self.request_steps + self.accepted) / self.request_steps if self.request_steps else 0.0

    @property
    def steps_saved(self) -> int:
        return self.plain_steps - self.steps

    def as_dict(self) -> dict[str, float | int]:
        return {"draft_tokens": self.draft_tokens, "steps": self.steps,
                "plain_steps": self.plain_steps, "steps_saved": self.steps_saved,
                "proposed": self.proposed, "accepted": self.accepted,
                "accept_rate": self.accept_rate, "mean_accepted_length": self.mean_accepted_length}


def speculative_generate(session: PrefillSession, first: Sequence[tuple[Hashable, int, int]],
                         num_tokens: int, draft_tokens: int = 1,
                         steps: SpeculativeSteps | None = None,
                         ) -> tuple[list[list[int]], SpeculationStats]:
    """``num_tokens`` greedy tokens per request by speculative decoding on a one-rank session
    whose model has its MTP layer: ``first`` is ``(request id, first token, first draft)`` per
    request (the prefill's greedy token and its MTP row's guess of the token after it).
    ``draft_tokens`` (k) drafts are verified per step (the first step verifies one).

    ``steps``: how the verify and draft steps run (the decode worker's lean steps); the prefill
    driver's (:class:`DriverSteps`) when None.

    Returns the tokens (the first one included) and the statistics.

    Raises:
        ValueError: ``draft_tokens < 1``, no MTP layer, or a CP session.
    """
    if draft_tokens < 1:
        raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
    if session.model.mtp_layer is None:
        raise ValueError("speculative decoding needs the model's MTP layer (load it with mtp=True)")
    if session.group.size != 1:
        raise ValueError("speculative decoding runs on the (non-CP) decode rank")
    run = steps if steps is not None else DriverSteps(session)
    pool = session.pool
    stats = SpeculationStats(draft_tokens=draft_tokens, plain_steps=max(0, num_tokens - 1))
    out = {rid: [tok] for rid, tok, _ in first}
    pending = {rid: tok for rid, tok, _ in first}
    drafts: dict[Hashable, list[int]] = {rid: [d] for rid, _, d in first}
    for rid, _, _ in first:
        stats.accepted_per_request[str(rid)] = []
    active = [rid for rid, _, _ in first if num_tokens > 1]
    while active:
        batch = [(rid, [pending[rid], *drafts[rid]]) for rid in active]
        base = {rid: pool.pages.requests[rid].valid_len for rid in active}
        res = run.verify(batch)
        note_progress("decode")  # the launcher's bound is on silence
        stats.steps += 1
        chain: list[tuple[Hashable, int, int]] = []  # (rid, first new draft, its row)
        row = 0
        for (rid, ids), choice, guess in zip(batch, res.choice, res.guess, strict=True):
            d = ids[1:]
            a = 0
            while a < len(d) and d[a] == choice[a]:
                a += 1
            stats.proposed += len(d)
            stats.accepted += a
            stats.request_steps += 1
            stats.accepted_per_request[str(rid)].append(a)
            out[rid].extend(choice[:a + 1])
            pending[rid] = choice[a]
            pool.pages.truncate(rid, base[rid] + a + 1)  # rows of rejected drafts go
            chain.append((rid, guess[a], row + a))
            row += len(ids)
        active = [rid for rid in active if len(out[rid]) < num_tokens]
        chain = [c for c in chain if c[0] in active]
        for rid, d1, _ in chain:
            drafts[rid] = [d1]
        if draft_tokens > 1 and chain:
            _chain(run, pool, chain, res.hidden, drafts, draft_tokens)
    return [out[rid][:num_tokens] for rid, _, _ in first], stats


def _chain(run: SpeculativeSteps, pool: ShardedKVPool, chain: Sequence[tuple[Hashable, int, int]],
           hidden: torch.Tensor, drafts: dict[Hashable, list[int]], k: int) -> None:
    """Drafts 2..k: the MTP layer on its own output, one position further each time (its
    speculative KV rows are dropped once the chain is done)."""
    rids = [rid for rid, _, _ in chain]
    keep = {rid: pool.pages.requests[rid].valid_len for rid in rids}
    h = hidden[torch.tensor([r for _, _, r in chain], device=hidden.device)]
    try:
        for _ in range(k - 1):
            guess, h = run.draft([(rid, drafts[rid][-1]) for rid in rids], h)
            for rid, t in zip(rids, guess, strict=True):
                drafts[rid].append(t)
    finally:
        for rid in rids:
            pool.pages.truncate(rid, keep[rid])
