"""Prefix-cache benchmark (CPU, CP ranks over Gloo): requests sharing a long prefix, served one
request per batch in order, with the cache enabled against the same requests without it.

Workload: a shared ``prefix``-token prompt followed by a distinct ``suffix``-token tail per
request (the tails' first tokens all differ, so every hit is exactly the prefix: the first
request misses, each later one hits ``prefix`` tokens). Each request is admitted (starting from
the longest cached prefix), prefilled from its hit on, and finished (cached, released).

Both runs happen in the same rank processes, on the same loaded model: first without the cache,
then with it; each after one warm-up request that is not timed (the cache is cleared after its
warm-up, so the timed run starts empty) and a ``gc.collect()``. The pool is sized so that every
page of the run fits on one rank: nothing is evicted. Timings are wall time per request
(admit + prefill + finish), the slowest rank's; the totals are their sums.

Correctness is part of the measurement: the cached run's last-token logits must equal the
no-cache run's within :data:`TOLERANCE` (relative to the largest logit) for every request.
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cpkv.contracts import cdiv

from .report import BenchRow

if TYPE_CHECKING:
    from cpkv.comm import CPGroup
    from cpkv.settings import Settings

__all__ = ["TOLERANCE", "CacheSpec", "bench_rank", "bench_settings", "expected_hit_fraction",
           "pages_per_rank", "run", "workload"]

#: max relative error of the cached run's last-token logits against the no-cache run (bf16 pool)
TOLERANCE = 1e-3


@dataclass(frozen=True)
class CacheSpec:
    """One benchmark run (picklable: it goes to every rank)."""

    model_dir: str
    requests: int
    prefix: int
    suffix: int
    settings: Settings
    seed: int = 0


def workload(requests: int, prefix: int, suffix: int, vocab: int, seed: int = 0,
             ) -> tuple[list[int], list[tuple[str, list[int]]]]:
    """The warm-up prompt and the timed requests ``[(rid, tokens)]``: a shared ``prefix`` and a
    ``suffix`` per request whose first tokens all differ (so each later request hits exactly the
    prefix); the warm-up starts with a token the prefix does not start with (it shares nothing)."""
    if requests < 1 or prefix < 1 or suffix < 1:
        raise ValueError("requests, prefix and suffix must be >= 1")
    if requests > vocab - 1:
        raise ValueError(f"at most {vocab - 1} requests (distinct first suffix tokens)")
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    shared = toks(prefix)
    firsts = rng.sample(range(vocab), requests)
    reqs = [(f"r{i}", [*shared, firsts[i], *toks(suffix - 1)]) for i in range(requests)]
    warm = toks(prefix + suffix)
    warm[0] = (shared[0] + 1) % vocab
    return warm, reqs


def expected_hit_fraction(requests: int, prefix: int, suffix: int) -> float:
    """Hit tokens / prompt tokens of :func:`workload`: every request but the first hits the
    whole prefix."""
    return (requests - 1) * prefix / (requests * (prefix + suffix))


def pages_per_rank(requests: int, prefix: int, suffix: int, page_size: int) -> int:
    """Pool pages per rank such that every page of the run fits on one rank (no eviction, however
    the pages spread over ranks): the cached prefix, each request's own pages (the page a hit
    ends inside is copied, hence the floor), and one request's worth of headroom (the warm-up or
    the request in flight of the no-cache run)."""
    whole = cdiv(prefix + suffix, page_size)
    own = whole - prefix // page_size
    return cdiv(prefix, page_size) + requests * own + whole


def bench_settings(cp: int, requests: int, prefix: int, suffix: int, page_size: int = 64,
                   ) -> Settings:
    """The benchmark's settings: ``cp`` ranks, zigzag, bf16 pool of :func:`pages_per_rank`
    pages of ``page_size`` tokens, the torch ops."""
    from cpkv.settings import load_settings

    return load_settings(
        cp={"size": cp, "mode": "zigzag"},
        kv={"dtype": "bf16", "page_size": page_size,
            "pages_per_rank": pages_per_rank(requests, prefix, suffix, page_size)},
        backend={"preference": ["torch"]})


def _serve(session: Any, reqs: list[tuple[str, list[int]]]) -> dict[str, Any]:
    """Serve ``reqs`` one per batch; wall time, hit and last-token logits of each."""
    out: dict[str, Any] = {"seconds": [], "hits": [], "logits": [], "phases": {}}
    session.group.barrier()
    for rid, toks in reqs:
        t = time.perf_counter()
        hit = session.admit(rid, toks)
        res = session.prefill([(rid, toks[hit:])])
        session.finish(rid, toks)
        out["seconds"].append(time.perf_counter() - t)
        out["hits"].append(hit)
        out["logits"].append(res.last_logits[0].float().cpu())
        for k, v in res.seconds.items():
            out["phases"][k] = out["phases"].get(k, 0.0) + v
    return out


def bench_rank(group: CPGroup, spec: CacheSpec) -> dict[str, Any]:
    """One rank of the benchmark: the no-cache run, then the cached run (see the module
    docstring). Returns per-request seconds and hits of both runs, the phase split, cache
    counters and the max relative logit error of the cached run."""
    from cpkv.cache import CacheStats
    from cpkv.models import load_model
    from cpkv.runtime.session import PrefillSession

    model = load_model(spec.model_dir)
    warm, reqs = workload(spec.requests, spec.prefix, spec.suffix, model.config.vocab_size,
                          spec.seed)
    out: dict[str, Any] = {}
    for name, enabled in (("no_cache", False), ("cache", True)):
        s = spec.settings.model_copy(
            update={"cache": spec.settings.cache.model_copy(update={"enabled": enabled})})
        session = PrefillSession(model, s, group)
        _serve(session, [("warmup", warm)])
        if session.cache is not None:  # the timed run starts from an empty cache
            session.cache.clear()
            session.cache.stats = CacheStats()
        gc.collect()
        res = _serve(session, reqs)
        if session.cache is not None:
            res["stats"] = dict(session.cache.stats.__dict__)
            if res["stats"]["pages_evicted"]:
                raise RuntimeError(f"the cache evicted pages during the timed run: {res['stats']}")
            session.cache.clear()
        out[name] = res
        del session
        gc.collect()
    errs = [((a - b).abs().amax() / b.abs().amax()).item()
            for a, b in zip(out["cache"]["logits"], out["no_cache"]["logits"], strict=True)]
    for r in out.values():
        del r["logits"]
    out["max_rel_err"] = max(errs)
    return out


def run(model_dir: str | Path, settings: Settings, *, requests: int, prefix: int, suffix: int,
        timeout_s: float = 3600.0, progress: Callable[[str], None] = lambda s: None,
        ) -> tuple[list[BenchRow], dict[str, Any]]:
    """Run :func:`bench_rank` on ``settings.cp.size`` Gloo ranks. Returns the rows
    ``prefix_cache_speedup`` and ``prefix_cache_hit_fraction`` and the detail (per-request
    seconds, phase split, settings, ``max_rel_err`` and ``correct``). Does not raise on a logit
    mismatch: the caller checks ``detail["correct"]``.
    """
    from cpkv.runtime import run_ranks

    spec = CacheSpec(str(model_dir), requests, prefix, suffix, settings)
    cp = settings.cp.size
    progress(f"CP{cp}: {requests} requests of {prefix} + {suffix} tokens, no cache then cache")
    load = [os.getloadavg()[0]]  # other work on the host shows here (both runs share it)
    res = [r.value for r in run_ranks(bench_rank, cp, args=(spec,), timeout_s=timeout_s)]
    load.append(os.getloadavg()[0])

    def per_request(run_name: str) -> list[float]:  # the slowest rank's time of each request
        return [max(v) for v in zip(*(r[run_name]["seconds"] for r in res), strict=True)]

    off, on = per_request("no_cache"), per_request("cache")
    t_off, t_on = sum(off), sum(on)
    hits = res[0]["cache"]["hits"]
    total = requests * (prefix + suffix)
    want = expected_hit_fraction(requests, prefix, suffix)
    err = max(r["max_rel_err"] for r in res)
    ps = settings.kv.page_size
    rows = [
        # ratio = the speedup (cached tokens/s over no-cache tokens/s, as cp2_vs_cp1_*_speedup)
        BenchRow.of("prefix_cache_speedup", total / t_on, "prompt tokens/s",
                    f"no-cache prompt tokens/s, same requests and ranks ({t_off:.3g} s vs "
                    f"{t_on:.3g} s)", total / t_off),
        BenchRow.of("prefix_cache_hit_fraction", sum(hits) / total, "hit tokens / prompt tokens",
                    f"predicted {requests - 1}*{prefix}/({requests}*{prefix + suffix})", want),
    ]
    detail: dict[str, Any] = {
        "workload": {"requests": requests, "prefix": prefix, "suffix": suffix,
                     "batching": "one request per batch, in order; admit, prefill, finish"},
        "settings": {"cp": cp, "mode": settings.cp.mode.value, "backend": "gloo",
                     "kv_dtype": str(settings.kv.dtype), "page_size": ps,
                     "pages_per_rank": settings.kv.pages_per_rank,
                     "ops": list(settings.backend.preference)},
        "seconds_no_cache": t_off,
        "seconds_cache": t_on,
        "per_request_seconds_no_cache": off,
        "per_request_seconds_cache": on,
        "phase_seconds_rank0": {"no_cache": res[0]["no_cache"]["phases"],
                                "cache": res[0]["cache"]["phases"]},
        "hits": hits,
        "hit_fraction_predicted": want,
        # if a request's time scaled with the tokens it computes (the indexer reads every key of
        # the view per computed row in both runs): no-cache tokens / cached-run computed tokens
        "speedup_predicted_by_computed_tokens": total / (total - sum(hits)),
        "cache_stats": res[0]["cache"]["stats"],
        "max_rel_err": err,
        "tolerance": TOLERANCE,
        "correct": err <= TOLERANCE,
        "hits_agree_across_ranks": all(r["cache"]["hits"] == hits for r in res),
        "host_load_1min_before_after": load,
        # glibc serves temporaries over this (default: dynamic, at most 32 MiB) by fresh mmaps
        "env_MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }
    return rows, detail
