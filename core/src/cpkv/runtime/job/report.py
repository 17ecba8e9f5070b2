"""The job's report (``cpkv run``; ``to_json`` for ``--report``) and its verdict: whether the CP
run agreed with the one-rank reference, and if not, how it did not."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from cpkv.settings import Settings

from .results import Backends, CPRun, ReferenceRun, compare_topk, tail_rows
from .sections import (
    Cache,
    Chunks,
    Decode,
    Draft,
    FallbackRow,
    LogitsBudget,
    Seconds,
    Transfer,
    Warmup,
    max_rel_err,
)
from .tolerances import DEFAULT_TOLERANCES, Tolerances

__all__ = ["Check", "JobReport", "Verdict"]


class Check(StrEnum):
    """What the verdict compares of the CP run with the reference."""

    #: last-token logits
    LOGITS = "logits"
    #: the indexer's top-k sets (up to ties)
    TOPK = "topk"
    #: the decode rank's greedy tokens
    DECODE_TOKENS = "decode_tokens"
    #: the MTP draft layer's logits under CP prefill
    DRAFT_LOGITS = "draft_logits"
    #: speculative decoding's tokens against plain greedy
    SPECULATIVE_TOKENS = "speculative_tokens"


@dataclass(frozen=True)
class Verdict:
    """Whether the job's CP run agreed with the reference (:meth:`JobReport.verdict`)."""

    passed: bool
    #: one line per failed check, saying what differed and by how much
    failures: tuple[str, ...] = ()
    #: the checks that failed
    failed: frozenset[Check] = frozenset()
    #: the relative logit tolerance the verdict took (:meth:`Tolerances.logits`)
    tolerance: float = 0.0


@dataclass(frozen=True)
class JobReport:
    """The main job's report."""

    cp: int
    mode: str
    kv_dtype: str
    #: how the sharded pool built its full views ("all_gather" or "p2p", after any fallback)
    materialize: str
    prompt_lens: list[int]
    #: rank 0's
    backends: Backends
    kv_bytes_per_rank: list[int]
    kv_bytes_replicated: int
    max_rel_err_vs_reference: float
    #: None: the top-k sets were not captured
    topk_rows_differing: int | None
    fallbacks: tuple[FallbackRow, ...]
    seconds: Seconds
    logits: torch.Tensor  # float32 [prompts, vocab], CP run, input order
    reference_logits: torch.Tensor
    #: None without the transfer phase
    transfer: Transfer | None = None
    #: None without the decode phase
    decode: Decode | None = None
    #: None without a cache
    cache: Cache | None = None
    #: with ``run.mtp``
    draft: Draft | None = None
    #: where the job ran: "cpu" (Gloo, float32 model) or "cuda" (bfloat16 model)
    device: str = "cpu"
    #: on GPUs, each process's GPU (the prefill ranks, then the decode rank; the decode rank
    #: shares GPU 0 where there is one GPU fewer than processes); None on CPUs
    gpus: list[int] | None = None
    #: the indexer's queries as run ("fp8" or "bf16": ``runtime.indexer_dtype`` resolved)
    indexer_dtype: str = "bf16"
    logits_budget: LogitsBudget | None = None
    #: with ``runtime.chunk_tokens``
    chunks: Chunks | None = None
    #: with ``runtime.warmup_tokens``
    warmup: Warmup | None = None

    @classmethod
    def of(cls, settings: Settings, prompts: Sequence[Sequence[int]], cp: CPRun,
           ref: ReferenceRun, *, capture_topk: bool, mtp: bool, draft_tokens: int, device: str,
           gpus: Sequence[int] | None, tolerances: Tolerances = DEFAULT_TOLERANCES) -> JobReport:
        """The report of a CP run against its reference (``settings``: the job's, resolved).

        Raises:
            RuntimeError: the bytes the prefill ranks sent and the decode rank received differ.
        """
        r0, rr = cp.rank0, ref.report
        topk_bad = None
        if capture_topk:  # the reference computed whole prompts: compare the rows both computed
            rows = tail_rows(rr.topk_extends, r0.topk_extends)
            topk_bad = compare_topk(r0.topk_indices, r0.topk_scores,
                                    [t[rows] for t in rr.topk_indices],
                                    [t[rows] for t in rr.topk_scores],
                                    rel_tie=tolerances.tie(device))
        return cls(
            cp=settings.cp.size, mode=settings.cp.mode.value, kv_dtype=str(settings.kv.dtype),
            indexer_dtype=settings.runtime.indexer_dtype, materialize=r0.materialize,
            backends=r0.backends, prompt_lens=[len(p) for p in prompts],
            kv_bytes_per_rank=[p.report.kv_bytes for p in cp.prefill],
            kv_bytes_replicated=r0.kv_bytes_replicated,
            max_rel_err_vs_reference=max_rel_err(r0.last_logits, rr.last_logits),
            topk_rows_differing=topk_bad, fallbacks=FallbackRow.rows(cp, ref),
            seconds=Seconds.of(cp, ref), logits=r0.last_logits, reference_logits=rr.last_logits,
            transfer=Transfer.of(settings, cp), decode=Decode.of(cp, ref),
            cache=Cache.of(settings, cp, prompts),
            draft=Draft.of(draft_tokens, cp, ref) if mtp else None, device=device,
            gpus=list(gpus) if gpus is not None else None,
            logits_budget=LogitsBudget.of(cp), chunks=Chunks.of(settings, cp),
            warmup=Warmup.of(cp))

    def verdict(self, tolerances: Tolerances = DEFAULT_TOLERANCES) -> Verdict:
        """Pass or fail, with one line per failure: the CP logits (and the MTP draft layer's)
        within :meth:`Tolerances.logits` of the reference's, no real top-k difference, and
        the decode rank's tokens (plain or speculative) equal to the reference's greedy ones."""
        tol = tolerances.logits(self.kv_dtype, self.device)
        failed: list[tuple[Check, str]] = []
        if not self.max_rel_err_vs_reference <= tol:  # NaN fails too
            failed.append((Check.LOGITS, f"CP logits vs one rank: max relative error "
                                         f"{self.max_rel_err_vs_reference:.2e} > tolerance "
                                         f"{tol:.0e}"))
        if self.topk_rows_differing:
            failed.append((Check.TOPK, f"{self.topk_rows_differing} rows have different "
                                       f"indexer top-k sets than one rank's"))
        if (self.transfer is not None and self.decode is not None
                and not self.decode.tokens_match_reference):
            failed.append((Check.DECODE_TOKENS, "decode greedy tokens differ from one-process "
                                                "generation's"))
        if self.draft is not None:
            err = self.draft.prefill_max_rel_err_vs_reference
            if not err <= tol:
                failed.append((Check.DRAFT_LOGITS, f"MTP draft logits (CP prefill) vs one rank: "
                                                   f"max relative error {err:.2e} > tolerance "
                                                   f"{tol:.0e}"))
            if self.draft.speculation is not None and not self.draft.tokens_match_reference:
                failed.append((Check.SPECULATIVE_TOKENS, "speculative decoding's tokens differ "
                                                         "from plain greedy on one rank"))
        return Verdict(passed=not failed, failures=tuple(m for _, m in failed),
                       failed=frozenset(c for c, _ in failed), tolerance=tol)

    def to_json(self) -> dict[str, object]:
        """The report as ``--report`` writes it (the logits left out)."""
        def opt(section: Transfer | Decode | Cache | Draft | LogitsBudget | Chunks | Warmup | None
                ) -> object:
            return section.to_json() if section is not None else None

        return {"cp": self.cp, "mode": self.mode, "kv_dtype": self.kv_dtype,
                "materialize": self.materialize, "prompt_lens": self.prompt_lens,
                "backends": self.backends.to_json(), "kv_bytes_per_rank": self.kv_bytes_per_rank,
                "kv_bytes_replicated": self.kv_bytes_replicated,
                "max_rel_err_vs_reference": self.max_rel_err_vs_reference,
                "topk_rows_differing": self.topk_rows_differing,
                "fallbacks": [f.to_json() for f in self.fallbacks],
                "seconds": self.seconds.to_json(), "transfer": opt(self.transfer),
                "decode": opt(self.decode), "cache": opt(self.cache), "draft": opt(self.draft),
                "device": self.device, "gpus": self.gpus, "indexer_dtype": self.indexer_dtype,
                "logits_budget": opt(self.logits_budget), "chunks": opt(self.chunks),
                "warmup": opt(self.warmup)}
