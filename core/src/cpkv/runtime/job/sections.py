"""The sections of the job's report, each built (``of``) from what its producer handed back:
the CP run's ranks, the reference, the settings (:mod:`.results`). ``to_json`` gives the
section as the report's JSON holds it (``cpkv run --report``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from cpkv.contracts import FallbackEvent
from cpkv.settings import Settings

from ..decode import DecodeSteps
from ..speculative import SpeculationStats
from .results import CPRun, ReferenceRun

__all__ = ["Cache", "Chunks", "Decode", "Draft", "FallbackRow", "LogitsBudget", "Reference",
           "Seconds", "Transfer", "Warmup", "max_rel_err", "rows_rel_err", "tokens_match"]


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest, over rows, of a row's largest |a - b| relative to its largest |b|."""
    return ((a - b).abs().amax(dim=-1) / b.abs().amax(dim=-1).clamp_min(1e-30)).max().item()


def rows_rel_err(a: torch.Tensor, b: torch.Tensor, rows: Sequence[int]) -> float | None:
    """:func:`max_rel_err` over ``rows`` of ``a`` and ``b`` (None: no rows)."""
    if not rows:
        return None
    idx = torch.tensor(list(rows), dtype=torch.int64)
    return max_rel_err(a[idx], b[idx])


@dataclass(frozen=True)
class FallbackRow:
    """One fallback of the job, tagged with where it happened: a prefill rank (its number),
    ``"decode"`` or ``"reference"``."""

    rank: int | str
    event: FallbackEvent

    @classmethod
    def rows(cls, cp: CPRun, ref: ReferenceRun | None) -> tuple[FallbackRow, ...]:
        """Each prefill rank's, the decode rank's, then the reference's (None: it did not run)."""
        return (*(cls(p.rank, e) for p in cp.prefill for e in p.fallbacks),
                *(cls("decode", e) for e in cp.decode_fallbacks),
                *(cls("reference", e) for e in (ref.fallbacks if ref is not None else ())))

    def to_json(self) -> dict[str, object]:
        return {"rank": self.rank, **self.event.model_dump(mode="json")}


@dataclass(frozen=True)
class Seconds:
    """Time per phase: ``cp_startup`` (spawning the processes, imports, joining the group and
    loading the model: the slowest process), ``cp_prefill`` (every batch, the slowest prefill
    rank), ``cp_decode`` (the decode rank's generation); ``reference_startup`` (its model load,
    in the caller's process), ``reference_prefill``, ``reference_decode`` (0 with the reference
    off); ``cp_total`` and ``reference_total`` (wall); and the detail of the last batch
    (``cp_plan``, ...) and of the decode rank (``decode_load``, ``decode_receive``, ``decode_decode``)."""

    #: spawning a process to its model being loaded, the slowest process
    cp_startup: float
    #: every batch, the slowest prefill rank
    cp_prefill: float
    #: the decode rank's generation (0 without decode)
    cp_decode: float
    reference_startup: float
    reference_prefill: float
    reference_decode: float
    #: wall
    cp_total: float
    reference_total: float
    #: the last batch's phases (plan, write, ...), the slowest prefill rank each
    cp_phases: Mapping[str, float] = field(default_factory=dict)
    #: the decode rank's phases (load, receive, decode)
    decode_phases: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, cp: CPRun, ref: ReferenceRun | None) -> Seconds:
        phases = {k: max(p.report.seconds.get(k, 0.0) for p in cp.prefill)
                  for k in cp.rank0.seconds}
        starts = [p.startup_seconds + p.report.seconds["load"] for p in cp.prefill]
        dec = cp.decode
        if dec is not None:
            starts.append(cp.decode_startup_seconds + dec.seconds["load"])
        rs = ref.report.seconds if ref is not None else {}
        return cls(cp_startup=max(starts), cp_prefill=phases["prefill"],
                   cp_decode=dec.seconds["decode"] if dec is not None else 0.0,
                   reference_startup=rs.get("load", 0.0),
                   reference_prefill=rs.get("prefill", 0.0),
                   reference_decode=rs.get("decode", 0.0), cp_total=cp.wall_seconds,
                   reference_total=ref.wall_seconds if ref is not None else 0.0,
                   cp_phases={k: v for k, v in phases.items() if k not in ("load", "prefill")},
                   decode_phases=dict(dec.seconds) if dec is not None else {})

    def to_json(self) -> dict[str, float]:
        return {"cp_startup": self.cp_startup, "cp_prefill": self.cp_prefill,
                "cp_decode": self.cp_decode, "reference_startup": self.reference_startup,
                "reference_prefill": self.reference_prefill,
                "reference_decode": self.reference_decode, "cp_total": self.cp_total,
                "reference_total": self.reference_total,
                **{f"cp_{k}": v for k, v in self.cp_phases.items()},
                **{f"decode_{k}": v for k, v in self.decode_phases.items()}}


@dataclass(frozen=True)
class Transfer:
    """The transfer phase: the plugin, its bytes and its times."""

    plugin: str
    pipeline: str
    bytes_per_rank: list[int]
    entries: int
    #: the slowest rank's transfer
    seconds: float
    send_seconds: float
    #: the send time that ran while its prefill still computed, of the rank whose sends were
    #: hidden least
    overlap_seconds: float
    #: per request, prefill start -> the decode published it (the slowest rank's view)
    ready_seconds_per_request: list[float]

    @property
    def ready_seconds(self) -> float:
        return sum(self.ready_seconds_per_request)

    @classmethod
    def of(cls, settings: Settings, cp: CPRun) -> Transfer | None:
        """None without the decode phase.

        Raises:
            RuntimeError: the bytes the prefill ranks sent and the decode rank received differ.
        """
        dec, senders = cp.decode, cp.senders
        if dec is None:
            return None
        sent = [r.bytes_sent for r in senders]
        if sent != dec.bytes_per_rank:
            raise RuntimeError(f"transfer accounting: prefill ranks sent {sent} bytes, the decode "
                               f"rank received {dec.bytes_per_rank}")
        # ready: per request, the slowest rank's view (they share the decode's publish time)
        ready = [max(v) for v in zip(*(r.ready_seconds for r in senders), strict=True)]
        return cls(plugin=settings.transfer.name, pipeline=settings.transfer.pipeline,
                   bytes_per_rank=sent, entries=dec.entries,
                   seconds=max(r.seconds for r in senders),
                   send_seconds=max(r.send_seconds for r in senders),
                   overlap_seconds=max(senders, key=lambda r: r.send_seconds
                                       - r.overlap_seconds).overlap_seconds,
                   ready_seconds_per_request=ready)

    def to_json(self) -> dict[str, object]:
        return {"plugin": self.plugin, "pipeline": self.pipeline,
                "bytes_per_rank": self.bytes_per_rank, "entries": self.entries,
                "seconds": self.seconds, "send_seconds": self.send_seconds,
                "overlap_seconds": self.overlap_seconds, "ready_seconds": self.ready_seconds,
                "ready_seconds_per_request": self.ready_seconds_per_request}


def tokens_match(tokens: Sequence[Sequence[int]], reference: Sequence[Sequence[int] | None]
                 ) -> bool | None:
    """Whether each prompt's tokens equal the reference's, over the prompts it generated for
    (None: none)."""
    pairs = [(t, r) for t, r in zip(tokens, reference, strict=True) if r is not None]
    return all(list(t) == list(r) for t, r in pairs) if pairs else None


@dataclass(frozen=True)
class Decode:
    """The decode phase: the decode rank's greedy tokens against the reference's."""

    tokens: list[list[int]]
    #: per prompt (None: the reference did not generate for it: off, or a prompt it computed
    #: on a prefix only)
    reference_tokens: list[list[int] | None]
    #: how the decode steps ran (None: not told)
    steps: DecodeSteps | None = None

    @property
    def tokens_match_reference(self) -> bool | None:
        """Whether the tokens equal the reference's where it generated (None: it did not)."""
        return tokens_match(self.tokens, self.reference_tokens)

    @classmethod
    def of(cls, cp: CPRun, ref: ReferenceRun | None) -> Decode | None:
        """None without the decode phase."""
        if cp.decode is None:
            return None
        theirs = ref.tokens if ref is not None else [None] * len(cp.decode.tokens)
        return cls(tokens=cp.decode.tokens, reference_tokens=list(theirs), steps=cp.decode.steps)

    def to_json(self) -> dict[str, object]:
        return {"tokens": self.tokens, "reference_tokens": self.reference_tokens,
                "tokens_match_reference": self.tokens_match_reference,
                "steps": self.steps.as_dict() if self.steps else {}}


@dataclass(frozen=True)
class Cache:
    """The prefix cache's effect (rank 0's counters; the ranks agree)."""

    #: per prompt, the tokens taken from the cache
    hit_tokens: list[int]
    #: of all prompt tokens
    hit_fraction: float
    pages_evicted: int
    host_pages: int
    pages_saved_to_host: int
    pages_loaded_from_host: int
    recomputed_tokens: int

    @classmethod
    def of(cls, settings: Settings, cp: CPRun, prompts: Sequence[Sequence[int]]) -> Cache | None:
        """None without a cache (``cache.enabled`` off)."""
        if not settings.cache.enabled:
            return None
        r0 = cp.rank0
        st = r0.cache
        return cls(hit_tokens=r0.hits,
                   hit_fraction=sum(r0.hits) / max(1, sum(len(p) for p in prompts)),
                   pages_evicted=st.get("pages_evicted", 0), host_pages=settings.cache.host_pages,
                   pages_saved_to_host=st.get("pages_saved_to_host", 0),
                   pages_loaded_from_host=st.get("pages_loaded_from_host", 0),
                   recomputed_tokens=st.get("recomputed_tokens", 0))

    def to_json(self) -> dict[str, object]:
        return {"enabled": True, "hit_tokens": self.hit_tokens, "hit_fraction": self.hit_fraction,
                "pages_evicted": self.pages_evicted, "host_pages": self.host_pages,
                "pages_saved_to_host": self.pages_saved_to_host,
                "pages_loaded_from_host": self.pages_loaded_from_host,
                "recomputed_tokens": self.recomputed_tokens}


@dataclass(frozen=True)
class Draft:
    """The MTP draft layer (``run.mtp``): its CP prefill logits against the reference's and,
    with decode, speculative decoding's statistics and tokens."""

    #: drafts verified per speculative step (k)
    draft_tokens: int
    #: over the prompts the reference computed whole (None: none)
    prefill_max_rel_err_vs_reference: float | None
    #: None without speculative decoding (no decode phase)
    speculation: SpeculationStats | None = None
    #: the speculative tokens equal the reference's plain greedy ones (None: no decode, or the
    #: reference generated for no prompt)
    tokens_match_reference: bool | None = None
    #: layers of the decode rank's pool (the MTP layer's included)
    decode_kv_layers: int = 0

    @classmethod
    def of(cls, draft_tokens: int, cp: CPRun, ref: ReferenceRun | None) -> Draft:
        a = cp.rank0.draft_logits
        assert a is not None
        err = None
        if ref is not None:
            b = ref.report.draft_logits
            assert b is not None
            err = rows_rel_err(a, b, [i for i in range(a.shape[0]) if ref.computed_whole(i)])
        dec = cp.decode
        if dec is None or dec.speculation is None:
            return cls(draft_tokens, err)
        theirs = ref.tokens if ref is not None else [None] * len(dec.tokens)
        return cls(draft_tokens, err, speculation=dec.speculation,
                   tokens_match_reference=tokens_match(dec.tokens, theirs),
                   decode_kv_layers=dec.kv_layers)

    def to_json(self) -> dict[str, object]:
        d: dict[str, object] = {
            "draft_tokens": self.draft_tokens,
            "prefill_max_rel_err_vs_reference": self.prefill_max_rel_err_vs_reference}
        if self.speculation is not None:
            d |= self.speculation.as_dict() | {"tokens_match_reference":
                                               self.tokens_match_reference,
                                               "decode_kv_layers": self.decode_kv_layers}
        return d


@dataclass(frozen=True)
class LogitsBudget:
    """The indexer logits budget each prefill rank's session took."""

    mb_per_rank: list[int]
    #: "auto" chose it
    auto: bool

    @classmethod
    def of(cls, cp: CPRun) -> LogitsBudget:
        return cls([p.report.logits_budget_mb for p in cp.prefill], cp.rank0.logits_budget_auto)

    def to_json(self) -> dict[str, object]:
        return {"mb_per_rank": self.mb_per_rank, "auto": self.auto}


@dataclass(frozen=True)
class Chunks:
    """Chunked prefill (``runtime.chunk_tokens``)."""

    chunk_tokens: int
    #: per batch, each chunk's wall seconds on the slowest rank (they run in lock step); empty
    #: for a batch that ran in one piece
    seconds_per_batch: list[list[float]]

    @classmethod
    def of(cls, settings: Settings, cp: CPRun) -> Chunks | None:
        """None without chunked prefill."""
        if not settings.runtime.chunk_tokens:
            return None
        return cls(settings.runtime.chunk_tokens,
                   [[max(ts) for ts in zip(*per, strict=True)] for per in
                    zip(*(p.report.chunk_seconds for p in cp.prefill), strict=True)])

    def to_json(self) -> dict[str, object]:
        return {"chunk_tokens": self.chunk_tokens, "seconds_per_batch": self.seconds_per_batch}


@dataclass(frozen=True)
class Warmup:
    """The prefill ranks' start-up warm-up (``runtime.warmup_tokens``,
    :mod:`cpkv.runtime.warmup`)."""

    tokens: int
    #: per prefill rank, the warm-up's wall seconds (its sessions' start included them)
    seconds_per_rank: list[float]
    #: per prefill rank, kernels its compile caches gained (ranks of one machine share them:
    #: the first to compile a kernel counts it)
    compiled_per_rank: list[int]

    @classmethod
    def of(cls, cp: CPRun) -> Warmup | None:
        """None without a warm-up."""
        reps = [p.report.warmup for p in cp.prefill]
        if not reps or any(w is None for w in reps):
            return None
        done = [w for w in reps if w is not None]
        return cls(done[0].tokens, [w.seconds for w in done], [w.compiled for w in done])

    def to_json(self) -> dict[str, object]:
        return {"tokens": self.tokens, "seconds_per_rank": self.seconds_per_rank,
                "compiled_per_rank": self.compiled_per_rank}


@dataclass(frozen=True)
class Reference:
    """The one-rank reference (``run.reference``): what it computed, what the verdict compared
    with it and what it did not."""

    #: "full", "sample" or "off"
    mode: str
    #: with "sample": ``run.reference_tokens``, the tokens of a prompt it computes at most
    sample_tokens: int | None
    #: per prompt, the tokens it computed (its first ones; 0: none)
    prompt_tokens: list[int]
    #: what was compared, one line each (e.g. "last-token logits of 4 prompts")
    checked: list[str]
    #: what was not compared and why, one line each
    not_checked: list[str]
    #: its wall time (model load, prefill, decode), seconds
    seconds: float

    def to_json(self) -> dict[str, object]:
        return {"mode": self.mode, "sample_tokens": self.sample_tokens,
                "prompt_tokens": self.prompt_tokens, "checked": self.checked,
                "not_checked": self.not_checked, "seconds": self.seconds}
