"""The job's report (``cpkv run``; ``to_json`` for ``--report``) and its verdict: whether the CP
run agreed with the one-rank reference, and if not, how it did not."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch

from cpkv.settings import Settings

from .results import Backends, CPRun, RankReport, ReferenceRun, compare_topk, overlap_rows
from .sections import (
    Cache,
    Chunks,
    Decode,
    Draft,
    FallbackRow,
    LogitsBudget,
    Reference,
    Seconds,
    Transfer,
    Warmup,
    rows_rel_err,
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
    #: the checks that ran (the reference's mode and the job's phases decide which can)
    checked: frozenset[Check] = frozenset()


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
    #: over the prompts the reference computed whole (None: none; see ``reference``)
    max_rel_err_vs_reference: float | None
    #: None: no top-k rows were compared (not captured, or no reference)
    topk_rows_differing: int | None
    fallbacks: tuple[FallbackRow, ...]
    seconds: Seconds
    logits: torch.Tensor  # float32 [prompts, vocab], CP run, input order
    #: None: no reference ran; a prompt it computed on a prefix holds that prefix's logits
    reference_logits: torch.Tensor | None
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
    #: what the reference computed and what was compared with it (None: not told; a report
    #: built by :meth:`of` always has it)
    reference: Reference | None = None
    #: top-k rows compared (each in every layer)
    topk_rows_compared: int = 0

    @classmethod
    def of(cls, settings: Settings, prompts: Sequence[Sequence[int]], cp: CPRun,
           ref: ReferenceRun | None, *, capture_topk: bool, mtp: bool, draft_tokens: int,
           device: str, gpus: Sequence[int] | None,
           tolerances: Tolerances = DEFAULT_TOLERANCES) -> JobReport:
        """The report of a CP run against its reference (``settings``: the job's, resolved;
        ``ref`` None: the reference was off): the last-token logits (and the draft layer's) of
        the prompts the reference computed whole, the top-k rows both captured (the last
        batch's rows the reference computed too), the decode tokens where it generated.

        Raises:
            RuntimeError: the bytes the prefill ranks sent and the decode rank received differ.
        """
        r0 = cp.rank0
        rr = ref.report if ref is not None else None
        whole = [i for i in range(len(prompts)) if ref is not None and ref.computed_whole(i)]
        topk_bad, topk_rows = None, 0
        if capture_topk and ref is not None and rr is not None:
            ia, ib = overlap_rows(*_capture_spans(prompts, r0, ref))
            topk_rows = int(ia.numel())
            if topk_rows:
                topk_bad = compare_topk([t[ia] for t in r0.topk_indices],
                                        [t[ia] for t in r0.topk_scores],
                                        [t[ib] for t in rr.topk_indices],
                                        [t[ib] for t in rr.topk_scores],
                                        rel_tie=tolerances.tie(device))
        decode = Decode.of(cp, ref)
        draft = Draft.of(draft_tokens, cp, ref) if mtp else None
        return cls(
            cp=settings.cp.size, mode=settings.cp.mode.value, kv_dtype=str(settings.kv.dtype),
            indexer_dtype=settings.runtime.indexer_dtype, materialize=r0.materialize,
            backends=r0.backends, prompt_lens=[len(p) for p in prompts],
            kv_bytes_per_rank=[p.report.kv_bytes for p in cp.prefill],
            kv_bytes_replicated=r0.kv_bytes_replicated,
            max_rel_err_vs_reference=(rows_rel_err(r0.last_logits, rr.last_logits, whole)
                                      if rr is not None else None),
            topk_rows_differing=topk_bad, fallbacks=FallbackRow.rows(cp, ref),
            seconds=Seconds.of(cp, ref), logits=r0.last_logits,
            reference_logits=rr.last_logits if rr is not None else None,
            transfer=Transfer.of(settings, cp), decode=decode,
            cache=Cache.of(settings, cp, prompts), draft=draft, device=device,
            gpus=list(gpus) if gpus is not None else None,
            logits_budget=LogitsBudget.of(cp), chunks=Chunks.of(settings, cp),
            warmup=Warmup.of(cp),
            reference=_reference(settings, prompts, ref, whole, topk_rows, decode, draft,
                                 capture_topk, len(r0.topk_indices)),
            topk_rows_compared=topk_rows)

    def verdict(self, tolerances: Tolerances = DEFAULT_TOLERANCES) -> Verdict:
        """Pass or fail, with one line per failure: the CP logits (and the MTP draft layer's)
        within :meth:`Tolerances.logits` of the reference's, no real top-k difference, and
        the decode rank's tokens (plain or speculative) equal to the reference's greedy ones."""
        tol = tolerances.logits(self.kv_dtype, self.device)
        failed: list[tuple[Check, str]] = []
        checked: set[Check] = set()
        err = self.max_rel_err_vs_reference
        if err is not None:
            checked.add(Check.LOGITS)
            if not err <= tol:  # NaN fails too
                failed.append((Check.LOGITS, f"CP logits vs one rank: max relative error "
                                             f"{err:.2e} > tolerance {tol:.0e}"))
        if self.topk_rows_differing is not None:
            checked.add(Check.TOPK)
            if self.topk_rows_differing:
                failed.append((Check.TOPK, f"{self.topk_rows_differing} rows have different "
                                           f"indexer top-k sets than one rank's"))
        match = self.decode.tokens_match_reference if self.decode is not None else None
        if self.transfer is not None and match is not None:
            checked.add(Check.DECODE_TOKENS)
            if not match:
                failed.append((Check.DECODE_TOKENS, "decode greedy tokens differ from "
                                                    "one-process generation's"))
        if self.draft is not None:
            derr = self.draft.prefill_max_rel_err_vs_reference
            if derr is not None:
                checked.add(Check.DRAFT_LOGITS)
                if not derr <= tol:
                    failed.append((Check.DRAFT_LOGITS, f"MTP draft logits (CP prefill) vs one "
                                                       f"rank: max relative error {derr:.2e} > "
                                                       f"tolerance {tol:.0e}"))
            spec_match = self.draft.tokens_match_reference
            if self.draft.speculation is not None and spec_match is not None:
                checked.add(Check.SPECULATIVE_TOKENS)
                if not spec_match:
                    failed.append((Check.SPECULATIVE_TOKENS, "speculative decoding's tokens "
                                                             "differ from plain greedy on one "
                                                             "rank"))
        return Verdict(passed=not failed, failures=tuple(m for _, m in failed),
                       failed=frozenset(c for c, _ in failed), tolerance=tol,
                       checked=frozenset(checked))

    def to_json(self) -> dict[str, object]:
        """The report as ``--report`` writes it (the logits left out)."""
        def opt(section: Transfer | Decode | Cache | Draft | LogitsBudget | Chunks | Warmup
                | Reference | None) -> object:
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
                "warmup": opt(self.warmup), "reference": opt(self.reference),
                "topk_rows_compared": self.topk_rows_compared}


def _capture_spans(prompts: Sequence[Sequence[int]], r0: RankReport, ref: ReferenceRun
                   ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The positions each request of the last batch captured, in the CP run (the tail after
    its cache hit or prefix chunk) and in the reference (the tail of what it computed): both
    runs end each prompt of the batch (the reference at its sample's end). A reference that
    does not say which prompts it ended (``last_batch`` empty) computed them whole."""
    rr = ref.report
    if ref.last_batch:
        ends = [len(prompts[i]) for i in ref.last_batch]
        ref_ends = [ref.lengths[i] if ref.lengths else len(prompts[i]) for i in ref.last_batch]
    else:
        ends = ref_ends = list(rr.topk_extends)
    return ([(e - n, e) for e, n in zip(ends, r0.topk_extends, strict=True)],
            [(e - n, e) for e, n in zip(ref_ends, rr.topk_extends, strict=True)])


def _reference(settings: Settings, prompts: Sequence[Sequence[int]], ref: ReferenceRun | None,
               whole: list[int], topk_rows: int, decode: Decode | None, draft: Draft | None,
               capture_topk: bool, layers: int) -> Reference:
    """The report's ``reference`` section: what was compared with the reference and what not."""
    run = settings.run
    if ref is None:
        return Reference(mode="off", sample_tokens=None, prompt_tokens=[0] * len(prompts),
                         checked=[], not_checked=["anything: run.reference = 'off' (the CP "
                                                  "run's outputs were not checked against one "
                                                  "rank's)"], seconds=0.0)
    n = len(prompts)
    cut = [i for i in range(n) if not ref.computed_whole(i)]
    checked: list[str] = []
    if whole:
        checked.append(f"last-token logits of {len(whole)} of {n} prompts")
    if topk_rows:
        checked.append(f"indexer top-k sets of {topk_rows:,} rows in each of {layers} layers")
    if decode is not None and decode.tokens_match_reference is not None:
        checked.append(f"decode tokens of {sum(t is not None for t in decode.reference_tokens)} "
                       f"of {n} prompts")
    if draft is not None and draft.prefill_max_rel_err_vs_reference is not None:
        checked.append(f"MTP draft logits of {len(whole)} of {n} prompts")
    not_checked: list[str] = []
    if cut:
        parts = ["last-token logits"] + (["decode tokens"] if decode is not None else []) \
            + (["MTP draft logits"] if draft is not None else [])
        not_checked.append(f"the {', '.join(parts)} of prompt(s) {cut[:8]}"
                           f"{' ...' if len(cut) > 8 else ''}: longer than run.reference_tokens "
                           f"= {run.reference_tokens:,}, the reference computed their first "
                           f"{run.reference_tokens:,} tokens only (run.reference = 'full' "
                           f"computes them whole)")
    if not capture_topk:
        not_checked.append("indexer top-k sets: not captured")
    return Reference(mode=ref.mode, sample_tokens=run.reference_tokens
                     if ref.mode == "sample" else None,
                     prompt_tokens=list(ref.lengths) if ref.lengths else [len(p) for p in prompts],
                     checked=checked, not_checked=not_checked, seconds=ref.wall_seconds)
