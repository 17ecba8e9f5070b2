"""What every process of the main job is handed, and the prefill loop the roles share."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cpkv._faults import hang_if_asked
from cpkv.comm import CPGroup, note_progress
from cpkv.contracts import cdiv
from cpkv.settings import Settings

from ..prefill import PrefillResult
from ..session import PrefillSession

if TYPE_CHECKING:
    from cpkv.models import DeepseekV32

__all__ = ["BatchDone", "JobSpec", "Served", "job_model", "open_session", "prefill_batches"]

#: called after each prefill batch with ``[(prompt index, final chunk?)]`` and its result
BatchDone = Callable[[list[tuple[int, bool]], PrefillResult], None]


@dataclass(frozen=True)
class JobSpec:
    """Everything a rank needs (pickled to every rank process)."""

    model_dir: str
    prompts: tuple[tuple[int, ...], ...]
    settings: Settings
    capture_topk: bool = False
    #: tokens of each prompt prefilled in an earlier batch (its KV then comes from the cache;
    #: with a transfer, that batch is a non-final chunk: its whole pages are sent after it)
    prefix_lens: tuple[int, ...] = ()
    #: greedy tokens per prompt on the decode rank (0: no transfer and decode phases)
    decode_tokens: int = 0
    #: prompts per prefill batch, served in order (0: all in one batch); ignored with
    #: ``prefix_lens``. With a cache, each prompt can hit what earlier batches left
    batch_size: int = 0
    #: load the MTP draft layer: CP draft prefill, speculative decoding on the decode rank
    mtp: bool = False
    #: draft tokens per speculative decode step (k)
    draft_tokens: int = 1
    #: "cpu" (Gloo, float32 model) or "cuda" (NCCL, bfloat16 model; rank r on GPU r)
    device: str = "cpu"

    @property
    def dtype(self) -> torch.dtype:
        """The model's compute dtype: bfloat16 on GPUs (the kernels' dtype), float32 on CPUs."""
        return torch.bfloat16 if self.device == "cuda" else torch.float32

    def holding_all(self, settings: Settings, ranks: int) -> Settings:
        """``settings`` with a pool of ``ranks`` ranks big enough to keep every prompt and its
        decoded tokens at once (the reference and the decode rank keep them all)."""
        # speculation holds up to 2k more rows a request (drafts in flight, output past the end)
        extra = self.decode_tokens + (2 * self.draft_tokens if self.mtp else 0)
        need = sum(cdiv(len(p) + extra, settings.kv.page_size) for p in self.prompts)
        if settings.kv.pages_per_rank * ranks >= need:
            return settings
        return settings.model_copy(update={"kv": settings.kv.model_copy(
            update={"pages_per_rank": cdiv(need, ranks)})})

    @property
    def rids(self) -> list[str]:
        """The request id of each prompt."""
        return [f"p{i}" for i in range(len(self.prompts))]

    def batches(self) -> list[list[int]]:
        """Tokens of each prompt per prefill batch (0 = not in that batch), before cache hits:
        the chunks of ``prefix_lens`` (a first batch of prefixes, then the rest), else groups of
        ``batch_size`` whole prompts in order."""
        if any(self.prefix_lens):
            return [list(self.prefix_lens),
                    [len(p) - n for p, n in zip(self.prompts, self.prefix_lens, strict=True)]]
        n = len(self.prompts)
        size = self.batch_size or n
        return [[len(p) if b <= i < b + size else 0 for i, p in enumerate(self.prompts)]
                for b in range(0, n, size)]


def job_model(spec: JobSpec, device: torch.device | str) -> DeepseekV32:
    """The job's model (its checkpoint, dtype and MTP layer) on ``device``."""
    from cpkv.models import load_model

    return load_model(spec.model_dir, dtype=spec.dtype, device=device, mtp=spec.mtp)


def open_session(group: CPGroup, spec: JobSpec) -> tuple[PrefillSession, float]:
    """Load the job's model and open a prefill session on ``group``; returns it and the load
    time in seconds."""
    t0 = time.perf_counter()
    model = job_model(spec, group.device)
    return PrefillSession(model, spec.settings, group), time.perf_counter() - t0


def _nothing(batch: list[tuple[int, bool]], res: PrefillResult) -> None:
    return None


@dataclass
class Served:
    """What the prefill loop hands back: per prompt its last-token logits and cache hit; the
    last batch's result (its top-k capture) and each of its requests' extend length."""

    last_logits: torch.Tensor  # float32 [prompts, vocab], prompt order
    hits: list[int]
    last: PrefillResult
    last_extends: list[int]
    #: with the draft layer: float32 [prompts, vocab] draft logits of each prompt's last row
    draft_logits: torch.Tensor | None = None
    #: per batch, the wall seconds of each of its chunks (``runtime.chunk_tokens``; empty for a
    #: batch prefilled in one piece)
    chunk_seconds: list[list[float]] = field(default_factory=list)
    #: wall time of the whole loop (every batch, and what ``after`` did), seconds
    seconds: float = 0.0


def prefill_batches(session: PrefillSession, spec: JobSpec, after: BatchDone = _nothing, *,
                    use_cache: bool = True, sending: bool = False, what: str = "prefill"
                    ) -> Served:
    """Prefill the job's batches in order, calling ``after`` after each. A prompt served whole in
    a batch first takes the longest cached prefix (``session.admit``; with ``use_cache`` and
    a session cache), and a prompt whose final chunk ran is finished into the cache after
    ``after`` (which may still send its pages); without ``use_cache`` requests stay in the pool
    (the reference decodes them later). ``sending``: ``after`` sends every request of the
    batch (the session learns it up front: ``PrefillSession.prefill(send=...)``). ``what``
    names the work in the progress notes (tokens done of all prompts' tokens).

    Raises:
        ValueError: the job has no prompts.
    """
    t0 = time.perf_counter()
    rids, done = spec.rids, [0] * len(spec.prompts)
    batches = spec.batches()
    if not batches or not spec.prompts:
        raise ValueError("the job has no prompts")
    hits = [0] * len(spec.prompts)
    last_logits: list[torch.Tensor | None] = [None] * len(spec.prompts)
    draft_logits: list[torch.Tensor | None] = [None] * len(spec.prompts)
    res: PrefillResult | None = None
    extends: list[int] = []
    chunk_seconds: list[list[float]] = []
    cache = use_cache and session.cache is not None
    total = sum(len(p) for p in spec.prompts)
    for b, counts in enumerate(batches):
        idx = [i for i, n in enumerate(counts) if n > 0]
        ends = [done[i] + counts[i] for i in idx]
        if cache:  # a prompt served whole in this batch starts from the cache
            for i in idx:
                if done[i] == 0 and counts[i] == len(spec.prompts[i]):
                    hits[i] = done[i] = session.admit(rids[i], spec.prompts[i])
        extends = [e - done[i] for i, e in zip(idx, ends, strict=True)]
        last = b == len(batches) - 1
        # tokens done (cache hits included) of all: what the progress display shows
        note_progress(what, sum(done), total)
        hang_if_asked("prefill", session.group.rank)
        # the draft layer's last row of a non-final chunk takes the prompt's next token
        nxt = [spec.prompts[i][e] if e < len(spec.prompts[i]) else None
               for i, e in zip(idx, ends, strict=True)]
        res = session.prefill([(rids[i], spec.prompts[i][done[i]:e])
                               for i, e in zip(idx, ends, strict=True)],
                              capture_topk=spec.capture_topk and last, next_ids=nxt,
                              send={rids[i]: e == len(spec.prompts[i])
                                    for i, e in zip(idx, ends, strict=True)} if sending else None)
        chunk_seconds.append(list(res.chunk_seconds))
        for j, (i, e) in enumerate(zip(idx, ends, strict=True)):
            done[i] = e
            last_logits[i] = res.last_logits[j].float()
            if res.draft_logits is not None:
                draft_logits[i] = res.draft_logits[j].float()
        finished = [(i, done[i] == len(spec.prompts[i])) for i in idx]
        note_progress(what, sum(done), total)
        after(finished, res)
        if cache:
            for i, final in finished:
                if final:
                    session.finish(rids[i], spec.prompts[i])
    assert res is not None
    logits = torch.stack([t for t in last_logits if t is not None])
    drafts = [t for t in draft_logits if t is not None]
    return Served(last_logits=logits, hits=hits, last=res, last_extends=extends,
                  draft_logits=torch.stack(drafts) if drafts else None,
                  chunk_seconds=chunk_seconds, seconds=time.perf_counter() - t0)
