"""The job's reference: the same prompts on one rank (prefill, then greedy generation), or a
bounded part of them (``run.reference``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from cpkv.comm import CPGroup
from cpkv.contracts import MaterializeMode
from cpkv.settings import Settings

from ..decode import DecodeWorker, greedy
from ..prefill import PrefillResult
from ..session import PrefillSession
from .results import RankReport, rank_report
from .spec import JobSpec, job_model, prefill_batches

__all__ = ["ReferencePlan", "reference_plan", "reference_rank"]


@dataclass(frozen=True)
class ReferencePlan:
    """What the reference computes of a job (:func:`reference_plan`)."""

    #: ``run.reference``: "full", "sample" or "off"
    mode: str
    #: per prompt, the tokens the reference computes (its first ones; 0 with "off")
    lengths: tuple[int, ...]
    #: per prompt, whether it is computed whole (its last-token logits and decode tokens can be
    #: checked)
    whole: tuple[bool, ...]
    #: the reference's spec (one rank, no cache, the prompts cut to ``lengths``); None: "off"
    spec: JobSpec | None

    @property
    def sampled(self) -> list[int]:
        """Prompts computed on a prefix only."""
        return [i for i, w in enumerate(self.whole) if not w]


def reference_settings(settings: Settings) -> Settings:
    """The job's settings on one rank without a prefix cache or a warm-up (the CP ranks compiled
    the kernels): the same backends, pool format and layout, split mode and chunking as the job,
    so the reference runs the kernels the job does ("p2p" views read one rank's pool as
    "all_gather" does: one rank has no peers to map)."""
    kv = settings.kv
    if kv.materialize is MaterializeMode.P2P:  # one rank has no peers to map
        kv = kv.model_copy(update={"materialize": MaterializeMode.ALL_GATHER})
    return settings.with_cp_size(1).model_copy(update={
        "kv": kv, "cache": settings.cache.model_copy(update={"enabled": False}),
        "runtime": settings.runtime.model_copy(update={"warmup_tokens": 0})})


def reference_plan(spec: JobSpec) -> ReferencePlan:
    """The reference of ``spec`` by its ``run.reference``: "full" every prompt whole; "sample"
    each prompt's first ``run.reference_tokens`` tokens (a prompt no longer is whole); "off"
    nothing. A prefix length of ``spec.prefix_lens`` is cut to leave the last batch at least a
    token of each of its prompts."""
    run = spec.settings.run
    if run.reference == "off":
        return ReferencePlan("off", (0,) * len(spec.prompts), (False,) * len(spec.prompts), None)
    cut = run.reference_tokens if run.reference == "sample" else None
    prompts = tuple(p[:cut] if cut is not None else p for p in spec.prompts)
    prefix = tuple(min(n, len(p) - 1) for n, p in zip(spec.prefix_lens, prompts, strict=True)) \
        if spec.prefix_lens else ()
    s = spec.holding_all(reference_settings(spec.settings), 1)
    ref = JobSpec(spec.model_dir, prompts, s, spec.capture_topk, prefix, spec.decode_tokens,
                  spec.batch_size, mtp=spec.mtp, device=spec.device)
    return ReferencePlan(run.reference, tuple(len(p) for p in prompts),
                         tuple(len(p) == len(q) for p, q in zip(prompts, spec.prompts,
                                                                strict=True)), ref)


def reference_rank(spec: JobSpec, generate: Sequence[int] | None = None
                   ) -> tuple[RankReport, list[list[int] | None]]:
    """Prefill ``spec``'s prompts on one rank in the job's batches **without** a prefix cache
    (every prompt computed from its first token, in ``runtime.chunk_tokens`` chunks as the job
    is: chunking changes no logit and no top-k choice), then ``spec.decode_tokens`` greedy
    tokens for each prompt of ``generate`` (indices; None: every prompt) with the same batched
    steps as the decode rank: a :class:`DecodeWorker`'s (its one-rank session prefills, its
    lean steps decode), so that the comparison isolates what CP prefill and the transfer do.
    Without tokens to generate the prefill runs on a one-rank :class:`PrefillSession` of the
    job's own settings (its pool layout). ``spec.settings.cp.size`` must be 1. Progress is
    noted as "prefill" and "decode" (tokens). The report's ``seconds`` has "load", "prefill"
    and "decode" (generation) wall times; the tokens are per prompt (None: not generated)."""
    t0 = time.perf_counter()
    s = spec.settings
    model = job_model(spec, "cuda:0" if spec.device == "cuda" else "cpu")
    worker = None
    if generate is None:
        generate = range(len(spec.prompts))
    if spec.decode_tokens and generate:
        worker = DecodeWorker(model, s, model.device)
        session = worker.session
    else:
        session = PrefillSession(model, s, CPGroup.single(model.device, s.runtime.timeout_s))
    group = session.group
    load_s = time.perf_counter() - t0
    first: dict[int, int] = {}

    def keep(batch: list[tuple[int, bool]], res: PrefillResult) -> None:
        for (i, _), tok in zip(batch, greedy(res.last_logits), strict=True):
            first[i] = tok

    served = prefill_batches(session, spec, keep, use_cache=False)
    rep = rank_report(group, session, served, load_s)
    rids = spec.rids
    t0 = time.perf_counter()
    tokens: list[list[int] | None] = [None] * len(spec.prompts)
    if worker is not None:
        made = worker.generate([(rids[i], first[i]) for i in generate], spec.decode_tokens)
        for i, toks in zip(generate, made, strict=True):
            tokens[i] = toks
    rep.seconds["decode"] = time.perf_counter() - t0
    return rep, tokens
