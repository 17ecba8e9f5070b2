"""Chunked prefill (``runtime.chunk_tokens``): how a batch's long requests are cut into chunks, and
how the chunks' results are put back together as one batch's.

A request whose extend is longer than ``chunk_tokens`` is prefilled in chunks of at most that many
tokens. Chunks end on page boundaries (``chunk_tokens`` is a multiple of the page size; a chunk
that starts inside a page, after a cache hit, ends at the last page boundary within
``chunk_tokens`` of its start), so a non-final chunk writes and sends whole pages only (rule 26).
The batch runs in rounds: round ``j`` is one prefill batch holding the ``j``-th chunk of every
request that has one (short requests run whole in round 0). Each chunk continues the request the
pool holds, so the last chunk's logits equal the unchunked batch's (same keys, same top-k).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .prefill import PrefillResult, TopkCapture

__all__ = ["ChunkPiece", "chunk_rounds", "merge_results"]


@dataclass(frozen=True)
class ChunkPiece:
    """One request's chunk in a round: ``ids[start:end]`` of request ``index`` of the batch."""

    index: int
    start: int
    end: int
    #: the request's last chunk in this batch
    last: bool


def chunk_rounds(prefix_extend: Sequence[tuple[int, int]], chunk_tokens: int,
                 page_size: int) -> list[list[ChunkPiece]]:
    """The rounds of a batch whose requests hold ``(prefix tokens, new tokens)`` each: one round
    when no extend is longer than ``chunk_tokens`` (or chunking is off: 0).

    Raises:
        ValueError: ``chunk_tokens`` is not a multiple of ``page_size``.
    """
    if chunk_tokens and chunk_tokens % page_size:
        raise ValueError(f"runtime.chunk_tokens = {chunk_tokens} is not a multiple of the page "
                         f"size {page_size}")
    per: list[list[ChunkPiece]] = []
    for i, (prefix, extend) in enumerate(prefix_extend):
        if not chunk_tokens or extend <= chunk_tokens:
            per.append([ChunkPiece(i, 0, extend, True)])
            continue
        pieces, pos, end = [], prefix, prefix + extend
        while pos < end:
            # the last page boundary within chunk_tokens of pos (> pos: chunk_tokens >= a page)
            stop = min(end, (pos + chunk_tokens) // page_size * page_size)
            pieces.append(ChunkPiece(i, pos - prefix, stop - prefix, stop == end))
            pos = stop
        per.append(pieces)
    rounds = max(len(p) for p in per) if per else 0
    return [[p[j] for p in per if j < len(p)] for j in range(rounds)]


def _stitch(parts: list[list[torch.Tensor]]) -> torch.Tensor:
    """Rows per request in batch order: ``parts[i]`` = the rows of request ``i``'s chunks, in
    round order."""
    return torch.cat([t for per in parts for t in per])


def _key_offsets(res: PrefillResult) -> list[int]:
    """Where each request's keys start in the flat full view of a round (cached + new tokens of
    the requests before it): the offsets its top-k indices are relative to."""
    out, off = [], 0
    for r in res.plan.requests:
        out.append(off)
        off += r.prefix_len + r.extend_len
    return out


def _rows_of(res: PrefillResult, k: int) -> slice:
    """Natural-order rows of the ``k``-th request of a round's result."""
    off = res.plan.natural_offsets()[k]
    return slice(off, off + res.plan.requests[k].extend_len)


def _present(t: torch.Tensor | None) -> torch.Tensor:
    """A per-round output every round has (the rounds share their options)."""
    assert t is not None
    return t


def merge_results(rounds: list[list[ChunkPiece]], results: list[PrefillResult],
                  num_requests: int, chunk_seconds: Sequence[float]) -> PrefillResult:
    """One batch's result from its rounds' (``results[j]`` of ``rounds[j]``): each request's
    last-row outputs from its last chunk; per-row outputs (``all_logits``, top-k captures, the
    draft layer's) concatenated in natural order (request by request, chunk by chunk; top-k
    indices as offsets into the whole batch's view, as the one-piece batch gives them); phase
    seconds summed; ``plan`` the last round's; ``chunk_seconds`` as given (one per round)."""
    last: list[tuple[int, int]] = [(0, 0)] * num_requests  # request -> (round, slot in it)
    rows: list[list[tuple[int, int]]] = [[] for _ in range(num_requests)]
    for j, pieces in enumerate(rounds):
        for k, p in enumerate(pieces):
            rows[p.index].append((j, k))
            if p.last:
                last[p.index] = (j, k)

    def pick(get: Callable[[PrefillResult], torch.Tensor | None]) -> torch.Tensor | None:
        if get(results[last[0][0]]) is None:
            return None
        return torch.stack([_present(get(results[j]))[k] for j, k in last])

    def per_row(get: Callable[[PrefillResult], torch.Tensor | None]) -> torch.Tensor | None:
        if get(results[0]) is None:
            return None
        return _stitch([[_present(get(results[j]))[_rows_of(results[j], k)] for j, k in rows[i]]
                        for i in range(num_requests)])

    topk = None
    if results[0].topk is not None:
        # a round's top-k indices are offsets into that round's view; the batch's view holds
        # every request whole: shift each chunk's picks to where its request's keys start there
        ends = [results[j].plan.requests[k].prefix_len + results[j].plan.requests[k].extend_len
                for j, k in last]
        whole = [sum(ends[:i]) for i in range(num_requests)]
        starts = [_key_offsets(r) for r in results]
        caps = [r.topk for r in results if r.topk is not None]
        assert len(caps) == len(results)  # every round captured (the same capture_topk)
        topk = TopkCapture()
        for layer in range(len(results[0].topk.indices)):
            picks = []
            for i in range(num_requests):
                for j, k in rows[i]:
                    t = caps[j].indices[layer][_rows_of(results[j], k)]
                    shift = whole[i] - starts[j][k]
                    picks.append(torch.where(t >= 0, t + shift, t) if shift else t)
            topk.indices.append(torch.cat(picks))
            topk.scores.append(_stitch([[caps[j].scores[layer][_rows_of(results[j], k)]
                                         for j, k in rows[i]] for i in range(num_requests)]))
    seconds: dict[str, float] = {}
    for r in results:
        for key, v in r.seconds.items():
            seconds[key] = seconds.get(key, 0.0) + v
    out = PrefillResult(plan=results[-1].plan,
                        last_logits=torch.stack([results[j].last_logits[k] for j, k in last]),
                        all_logits=per_row(lambda r: r.all_logits), seconds=seconds, topk=topk,
                        draft_logits=pick(lambda r: r.draft_logits),
                        draft_hidden=pick(lambda r: r.draft_hidden),
                        all_draft_logits=per_row(lambda r: r.all_draft_logits),
                        all_draft_hidden=per_row(lambda r: r.all_draft_hidden),
                        draft_embedding=results[-1].draft_embedding)
    out.chunk_seconds = tuple(chunk_seconds)
    return out
