"""The main job: CP prefill of prompts on C rank processes, the same prompts on one rank as the
reference, and a report (KV bytes per rank vs a replica, time per phase, fallbacks, correctness).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cpkv.fallback import recording

from .group import CPGroup
from .launch import run_ranks

__all__ = ["JobReport", "JobSpec", "RankReport", "compare_topk", "prefill_rank", "run_job"]


@dataclass(frozen=True)
class JobSpec:
    """Everything a rank needs (pickled to every rank process)."""

    model_dir: str
    prompts: tuple[tuple[int, ...], ...]
    settings: Any  # cpkv.settings.Settings
    capture_topk: bool = False
    #: tokens of each prompt prefilled in an earlier batch (its KV then comes from the cache)
    prefix_lens: tuple[int, ...] = ()


@dataclass
class RankReport:
    rank: int
    last_logits: torch.Tensor
    kv_bytes: int
    kv_bytes_replicated: int
    seconds: dict[str, float]
    topk_indices: list[torch.Tensor] = field(default_factory=list)
    topk_scores: list[torch.Tensor] = field(default_factory=list)


def prefill_rank(group: CPGroup, spec: JobSpec) -> RankReport:
    """One rank of the job: load the model, prefill the prompts (cached prefixes first)."""
    from cpkv.models import load_model

    from .session import PrefillSession

    t0 = time.perf_counter()
    model = load_model(spec.model_dir)
    session = PrefillSession(model, spec.settings, group)
    load_s = time.perf_counter() - t0
    rids = [f"p{i}" for i in range(len(spec.prompts))]
    if spec.prefix_lens:
        first = [(r, p[:n]) for r, p, n in zip(rids, spec.prompts, spec.prefix_lens, strict=True)
                 if n > 0]
        if first:
            session.prefill(first)
    cut = spec.prefix_lens or (0,) * len(rids)
    res = session.prefill([(r, p[n:]) for r, p, n in zip(rids, spec.prompts, cut, strict=True)],
                          capture_topk=spec.capture_topk)
    cap = res.topk
    return RankReport(
        rank=group.rank,
        last_logits=res.last_logits.float().cpu(),
        kv_bytes=session.pool.bytes_held(),
        kv_bytes_replicated=session.pool.replicated_bytes(),
        seconds={"load": load_s, **res.seconds},
        topk_indices=[t.cpu() for t in cap.indices] if cap else [],
        topk_scores=[t.cpu() for t in cap.scores] if cap else [],
    )


def compare_topk(a: list[torch.Tensor], sa: list[torch.Tensor], b: list[torch.Tensor],
                 sb: list[torch.Tensor], rel_tie: float = 1e-6) -> int:
    """Rows whose top-k sets differ, ignoring keys whose score ties the k-th within ``rel_tie``.

    a/b: per layer int32 [rows, k] indices; sa/sb: their scores. Returns the count of rows with a
    real difference (0 means the sets are identical up to ties).
    """
    bad = 0
    for ia, xa, ib, xb in zip(a, sa, b, sb, strict=True):
        for r in range(ia.shape[0]):
            pa = {int(i): float(s) for i, s in zip(ia[r], xa[r], strict=True) if i >= 0}
            pb = {int(i): float(s) for i, s in zip(ib[r], xb[r], strict=True) if i >= 0}
            if pa.keys() == pb.keys():
                continue
            floor = min([*pa.values(), *pb.values()])
            tol = rel_tie * max(1.0, abs(floor))
            diff = [pa.get(i, pb.get(i)) for i in pa.keys() ^ pb.keys()]
            if any(abs(s - floor) > tol for s in diff if s is not None):
                bad += 1
    return bad


@dataclass
class JobReport:
    cp: int
    mode: str
    kv_dtype: str
    prompt_lens: list[int]
    kv_bytes_per_rank: list[int]
    kv_bytes_replicated: int
    max_rel_err_vs_reference: float
    topk_rows_differing: int | None
    fallbacks: list[dict[str, Any]]
    seconds: dict[str, float]
    logits: torch.Tensor  # float32 [prompts, vocab], CP run, input order
    reference_logits: torch.Tensor

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if not isinstance(v, torch.Tensor)}
        return d


def run_job(settings: Any, model_dir: str, prompts: Sequence[Sequence[int]], *,
            prefix_lens: Sequence[int] = (), capture_topk: bool = True,
            progress: Callable[[str], None] = lambda s: None) -> JobReport:
    """CP prefill on ``settings.cp.size`` ranks, then the one-rank reference; compare.

    Raises:
        RankFailed / RankTimeout: a rank failed (its own error) or hung.
    """
    spec = JobSpec(model_dir=model_dir, prompts=tuple(tuple(p) for p in prompts),
                   settings=settings, capture_topk=capture_topk, prefix_lens=tuple(prefix_lens))
    c = settings.cp.size
    progress(f"CP{c} prefill on {c} rank processes")
    t = time.perf_counter()
    results = run_ranks(prefill_rank, c, args=(spec,), timeout_s=settings.runtime.timeout_s,
                        fallback_policy=settings.fallback.policy.value)
    cp_wall = time.perf_counter() - t
    progress("single-rank reference")
    ref_settings = settings.model_copy(update={"cp": settings.cp.model_copy(update={"size": 1})})
    t = time.perf_counter()
    with recording(settings.fallback.policy) as ref_rec:
        ref = prefill_rank(CPGroup.single(), JobSpec(model_dir, spec.prompts, ref_settings,
                                                     capture_topk, spec.prefix_lens))
    ref_wall = time.perf_counter() - t
    r0 = results[0].value
    err = ((r0.last_logits - ref.last_logits).abs().amax(dim=-1)
           / ref.last_logits.abs().amax(dim=-1).clamp_min(1e-30)).max().item()
    topk_bad = (compare_topk(r0.topk_indices, r0.topk_scores, ref.topk_indices, ref.topk_scores)
                if capture_topk else None)
    fallbacks = [{"rank": r.rank, **e.model_dump(mode="json")} for r in results for e in r.fallbacks]
    fallbacks += [{"rank": "reference", **e.model_dump(mode="json")} for e in ref_rec.events]
    phases = {k: max(r.value.seconds.get(k, 0.0) for r in results) for k in r0.seconds}
    return JobReport(
        cp=c, mode=settings.cp.mode.value, kv_dtype=settings.kv.dtype.value,
        prompt_lens=[len(p) for p in prompts],
        kv_bytes_per_rank=[r.value.kv_bytes for r in results],
        kv_bytes_replicated=r0.kv_bytes_replicated,
        max_rel_err_vs_reference=err, topk_rows_differing=topk_bad, fallbacks=fallbacks,
        seconds={"cp_wall": cp_wall, "reference_wall": ref_wall,
                 **{f"cp_{k}": v for k, v in phases.items()}},
        logits=r0.last_logits, reference_logits=ref.last_logits)
