"""What every process of the main job is handed, and the prefill loop the roles share."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from cpkv.comm import CPGroup
from cpkv.settings import Settings

from ..prefill import PrefillResult
from ..session import PrefillSession

__all__ = ["BatchDone", "JobSpec", "open_session", "prefill_batches"]

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

    @property
    def rids(self) -> list[str]:
        """The request id of each prompt."""
        return [f"p{i}" for i in range(len(self.prompts))]

    def batches(self) -> list[list[int]]:
        """Tokens of each prompt per prefill batch (0 = not in that batch)."""
        if not any(self.prefix_lens):
            return [[len(p) for p in self.prompts]]
        return [list(self.prefix_lens),
                [len(p) - n for p, n in zip(self.prompts, self.prefix_lens, strict=True)]]


def open_session(group: CPGroup, spec: JobSpec) -> tuple[PrefillSession, float]:
    """Load the job's model and open a prefill session on ``group``; returns it and the load
    time in seconds."""
    from cpkv.models import load_model

    t0 = time.perf_counter()
    model = load_model(spec.model_dir)
    return PrefillSession(model, spec.settings, group), time.perf_counter() - t0


def _nothing(batch: list[tuple[int, bool]], res: PrefillResult) -> None:
    return None


def prefill_batches(session: PrefillSession, spec: JobSpec,
                    after: BatchDone = _nothing) -> PrefillResult:
    """Prefill the job's batches (cached prefixes first), calling ``after`` after each; returns
    the last batch's result."""
    rids, done = spec.rids, [0] * len(spec.prompts)
    batches = spec.batches()
    res: PrefillResult | None = None
    for b, counts in enumerate(batches):
        idx = [i for i, n in enumerate(counts) if n > 0]
        last = b == len(batches) - 1
        res = session.prefill([(rids[i], spec.prompts[i][done[i]:done[i] + counts[i]]) for i in idx],
                              capture_topk=spec.capture_topk and last)
        for i in idx:
            done[i] += counts[i]
        after([(i, done[i] == len(spec.prompts[i])) for i in idx], res)
    if res is None:
        raise ValueError("the job has no prompts")
    return res
