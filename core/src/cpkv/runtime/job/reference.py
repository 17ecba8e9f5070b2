"""The job's reference: the same prompts on one rank (prefill, then greedy generation)."""

from __future__ import annotations

import time

from ..decode import DecodeWorker, greedy
from ..prefill import PrefillResult
from .results import RankReport, rank_report
from .spec import JobSpec, job_model, prefill_batches

__all__ = ["reference_rank"]


def reference_rank(spec: JobSpec) -> tuple[RankReport, list[list[int]]]:
    """Prefill on one rank in the job's batches **without** a prefix cache (every prompt
    computed whole), then ``spec.decode_tokens`` greedy tokens per prompt with the same batched
    steps as the decode rank: a :class:`DecodeWorker`'s (its one-rank session prefills, its lean
    steps decode), so that the comparison isolates what CP prefill and the transfer do.
    ``spec.settings.cp.size`` must be 1. The report's ``seconds`` has "load", "prefill" and
    "decode" (generation) wall times."""
    t0 = time.perf_counter()
    model = job_model(spec, "cuda:0" if spec.device == "cuda" else "cpu")
    worker = DecodeWorker(model, spec.settings, model.device)
    session, group = worker.session, worker.session.group
    load_s = time.perf_counter() - t0
    first: dict[int, int] = {}

    def keep(batch: list[tuple[int, bool]], res: PrefillResult) -> None:
        for (i, _), tok in zip(batch, greedy(res.last_logits), strict=True):
            first[i] = tok

    served = prefill_batches(session, spec, keep, use_cache=False)
    rep = rank_report(group, session, served, load_s)
    rids = spec.rids
    t0 = time.perf_counter()
    tokens = (worker.generate([(rids[i], first[i]) for i in range(len(rids))], spec.decode_tokens)
              if spec.decode_tokens else [])
    rep.seconds["decode"] = time.perf_counter() - t0
    return rep, tokens
