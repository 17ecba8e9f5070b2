"""What the job's processes hand back (each prefill rank, the decode rank, the reference), and
what the CP run and the reference run hand the report."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from cpkv.comm import CPGroup
from cpkv.contracts import FallbackEvent
from cpkv.disagg import TransferManifest

from ..decode import DecodeSteps
from ..session import PrefillSession
from ..speculative import SpeculationStats
from ..warmup import WarmupReport
from .spec import Served

__all__ = ["Backends", "CPRun", "DecodeReport", "PrefillResult", "RankReport", "ReferenceRun",
           "SenderReport", "compare_topk", "overlap_rows", "rank_report"]


@dataclass(frozen=True)
class Backends:
    """The report's ``backends``: which backend each op took, and why backends of the
    preference were passed over."""

    #: op -> backend
    chosen: Mapping[str, str] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()

    @classmethod
    def of(cls, session: PrefillSession) -> Backends:
        return cls(chosen=dict(session.ops.chosen), skipped=tuple(session.ops.skipped))

    def to_json(self) -> dict[str, object]:
        return {"chosen": dict(self.chosen), "skipped": list(self.skipped)}


@dataclass
class RankReport:
    """What one prefill rank (or the reference) hands back."""

    rank: int
    last_logits: torch.Tensor
    kv_bytes: int
    kv_bytes_replicated: int
    seconds: dict[str, float]
    #: how the pool built its full views: "all_gather", "p2p" or "replica"
    materialize: str = "all_gather"
    topk_indices: list[torch.Tensor] = field(default_factory=list)
    topk_scores: list[torch.Tensor] = field(default_factory=list)
    #: extend tokens of each request of the captured (last) batch, in batch order
    topk_extends: list[int] = field(default_factory=list)
    #: per prompt: tokens taken from the prefix cache
    hits: list[int] = field(default_factory=list)
    #: cache counters (PrefixCache.stats) after the run; empty without a cache
    cache: dict[str, int] = field(default_factory=dict)
    backends: Backends = field(default_factory=Backends)
    #: with the draft layer: float32 [prompts, vocab] draft logits of each prompt's last row
    draft_logits: torch.Tensor | None = None
    #: the session's effective indexer logits budget (MiB) and whether "auto" chose it
    logits_budget_mb: int = 0
    logits_budget_auto: bool = False
    #: per batch, the wall seconds of each chunk (empty: the batch ran in one piece)
    chunk_seconds: list[list[float]] = field(default_factory=list)
    #: the session's start-up warm-up (``runtime.warmup_tokens``); None: off
    warmup: WarmupReport | None = None


def rank_report(group: CPGroup, session: PrefillSession, served: Served,
                load_s: float) -> RankReport:
    """The report of a rank after the job's batches."""
    res = served.last
    cap, foot = res.topk, session.pool.footprint()
    return RankReport(
        rank=group.rank,
        last_logits=served.last_logits.cpu(),
        kv_bytes=foot.bytes_held,
        kv_bytes_replicated=foot.replicated_bytes,
        # "load": the model; "prefill": every batch (wall); the rest: the last batch's phases
        seconds={**res.seconds, "load": load_s, "prefill": served.seconds},
        materialize=session.pool.store.views.mode.value,
        topk_indices=[t.cpu() for t in cap.indices] if cap else [],
        topk_scores=[t.cpu() for t in cap.scores] if cap else [],
        topk_extends=served.last_extends,
        hits=served.hits,
        cache=dict(vars(session.cache.stats)) if session.cache is not None else {},
        backends=Backends.of(session),
        draft_logits=served.draft_logits.cpu() if served.draft_logits is not None else None,
        logits_budget_mb=session.logits_budget_mb, logits_budget_auto=session.logits_budget_auto,
        chunk_seconds=served.chunk_seconds, warmup=session.warmup,
    )


@dataclass
class DecodeReport:
    """What the decode rank hands back."""

    tokens: list[list[int]]
    bytes_per_rank: list[int]
    entries: int
    seconds: dict[str, float]
    #: debug only: request -> CRC32 of each logical page as published (before decoding)
    page_crcs: dict[str, list[int]] = field(default_factory=dict)
    #: debug only: the same over each page's valid rows only (what decoding may read)
    valid_crcs: dict[str, list[int]] = field(default_factory=dict)
    #: speculative decoding's statistics; None without it
    speculation: SpeculationStats | None = None
    #: layers of the decode pool (the MTP layer's included)
    kv_layers: int = 0
    #: how the decode steps ran
    steps: DecodeSteps | None = None


@dataclass
class SenderReport:
    """What a prefill rank of the disaggregated job hands back."""

    prefill: RankReport
    bytes_sent: int
    entries: int
    seconds: float
    #: the manifests it sent, in order (chunks of one request continue each other)
    manifests: list[TransferManifest] = field(default_factory=list)
    #: debug only: request -> {logical page: CRC32} of the pages this rank owns
    page_crcs: dict[str, dict[int, int]] = field(default_factory=dict)
    #: transfer.pipeline: "request" or "layer"
    pipeline: str = "request"
    #: per request sent: its batch's prefill start -> the decode published it (seconds)
    ready_seconds: list[float] = field(default_factory=list)
    #: seconds of this rank's sends that ran while its prefill still computed
    overlap_seconds: float = 0.0
    #: seconds this rank's sends took in all
    send_seconds: float = 0.0


def overlap_rows(a: list[tuple[int, int]], b: list[tuple[int, int]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows two captures both hold: capture ``a`` holds, request by request (batch order),
    the rows of the positions ``[start, end)`` of ``a[i]``, capture ``b`` those of ``b[i]``
    (e.g. a cached run's tail of each prompt, and a reference's first tokens of it). Returns
    int64 row indices into ``a`` and into ``b`` of the positions both hold, in the same order."""
    ra: list[int] = []
    rb: list[int] = []
    oa = ob = 0
    for (sa, ea), (sb, eb) in zip(a, b, strict=True):
        lo, hi = max(sa, sb), min(ea, eb)
        if hi > lo:
            ra.extend(range(oa + lo - sa, oa + hi - sa))
            rb.extend(range(ob + lo - sb, ob + hi - sb))
        oa += ea - sa
        ob += eb - sb
    return torch.tensor(ra, dtype=torch.int64), torch.tensor(rb, dtype=torch.int64)


def compare_topk(a: list[torch.Tensor], sa: list[torch.Tensor], b: list[torch.Tensor],
                 sb: list[torch.Tensor], rel_tie: float = 1e-6) -> int:
    """Rows whose top-k sets differ, ignoring keys whose score ties the k-th within ``rel_tie``
    of the row's score scale (its largest selected |score|, at least 1).

    a/b: per layer int32 [rows, k] indices; sa/sb: their scores. Returns the count of rows with a
    real difference (0 means the sets are identical up to ties).
    """
    bad = 0
    for ia, xa, ib, xb in zip(a, sa, b, sb, strict=True):
        # rows whose sorted indices agree hold the same set (indices are distinct but for the
        # -1 padding): only the others are looked at one by one
        same = (ia.sort(dim=1).values == ib.sort(dim=1).values).all(dim=1)
        for r in torch.nonzero(~same).flatten().tolist():
            pa = {int(i): float(s) for i, s in zip(ia[r], xa[r], strict=True) if i >= 0}
            pb = {int(i): float(s) for i, s in zip(ib[r], xb[r], strict=True) if i >= 0}
            if pa.keys() == pb.keys():
                continue
            both = [*pa.values(), *pb.values()]
            floor = min(both)
            tol = rel_tie * max(1.0, max(abs(v) for v in both))
            diff = [pa.get(i, pb.get(i)) for i in pa.keys() ^ pb.keys()]
            if any(abs(s - floor) > tol for s in diff if s is not None):
                bad += 1
    return bad


@dataclass(frozen=True)
class PrefillResult:
    """One prefill rank of the CP run: its report, its fallbacks, its process's startup."""

    rank: int
    report: RankReport
    fallbacks: tuple[FallbackEvent, ...]
    #: spawning the process to its joining the group (0 under torchrun)
    startup_seconds: float


@dataclass(frozen=True)
class CPRun:
    """What the CP run (the prefill ranks and, with decode, the decode rank) handed back."""

    prefill: tuple[PrefillResult, ...]
    #: wall seconds of the whole run, spawning included
    wall_seconds: float
    #: with decode: each prefill rank's sender report, in rank order
    senders: tuple[SenderReport, ...] = ()
    decode: DecodeReport | None = None
    decode_fallbacks: tuple[FallbackEvent, ...] = ()
    decode_startup_seconds: float = 0.0

    @property
    def rank0(self) -> RankReport:
        return self.prefill[0].report


@dataclass(frozen=True)
class ReferenceRun:
    """What the one-rank reference handed back (``run.reference``)."""

    report: RankReport
    #: its greedy tokens per prompt (None: not generated: no decode, or a prompt computed on a
    #: prefix only)
    tokens: list[list[int] | None]
    fallbacks: tuple[FallbackEvent, ...]
    wall_seconds: float
    #: "full" or "sample"
    mode: str = "full"
    #: per prompt, the tokens it computed (the prompt's first ones; empty: every prompt whole)
    lengths: tuple[int, ...] = ()
    #: per prompt, whether it computed it whole (empty: every prompt)
    whole: tuple[bool, ...] = ()
    #: the prompts of the job's last batch (whose top-k sets both runs captured), in order
    last_batch: tuple[int, ...] = ()

    def computed_whole(self, prompt: int) -> bool:
        """Whether the reference computed prompt ``prompt`` whole."""
        return not self.whole or self.whole[prompt]
