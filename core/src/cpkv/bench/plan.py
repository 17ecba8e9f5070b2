"""Planner benchmark: host time to plan large batches, per request, in both split modes.

Baseline, measured in the same run: building the batch's token-id tensor on the host
(``torch.tensor`` of every extend token), which any engine does per batch anyway. The planner
should cost a small fraction of it even for millions of tokens.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import structlog.testing

from cpkv.contracts import OwnerMap, RequestSpec, SplitMode, cdiv
from cpkv.fallback import recording
from cpkv.planning import plan_batch

from .report import BenchRow

#: (label, requests, max extend, prefix share): a decode-heavy mix of short extends, and long ones
SHAPES = [("256x512", 256, 512, 0.5), ("256x16k", 256, 16384, 0.5)]


def _median_s(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of ``fn`` after one warm-up, with the cyclic GC paused (as timeit does)."""
    fn()
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    finally:
        gc.enable()
    return statistics.median(times)


def _batch(n: int, max_extend: int, prefix_share: float, cp: int, ps: int,
           rng: random.Random) -> list[RequestSpec]:
    out = []
    for _ in range(n):
        p = rng.randint(1, 8192) if rng.random() < prefix_share else 0
        out.append(RequestSpec(prefix_len=p, extend_len=rng.randint(1, max_extend),
                               prefix_owners=OwnerMap.interleaved(cdiv(p, ps), cp).owners))
    return out


def run(cp_sizes: tuple[int, ...] = (2, 8), page_size: int = 64, repeat: int = 5,
        progress: Callable[[str], None] = lambda s: None) -> list[BenchRow]:
    """Rows ``plan_<shape>_cp<C>_<mode>_us_per_request`` against the token-tensor baseline."""
    import torch

    rng = random.Random(0)
    rows: list[BenchRow] = []
    for label, n, max_e, share in SHAPES:
        for cp in cp_sizes:
            reqs = _batch(n, max_e, share, cp, page_size, rng)
            tokens = [rng.randrange(1000) for _ in range(sum(r.extend_len for r in reqs))]
            base = _median_s(partial(torch.tensor, tokens, dtype=torch.int64), repeat)
            for mode in SplitMode:
                progress(f"plan {label} CP{cp} {mode.value}")
                # short extends are expected in these mixes: count them, keep them off the log
                with recording(), structlog.testing.capture_logs():
                    dt = _median_s(partial(plan_batch, reqs, cp, page_size, mode), repeat)
                rows.append(BenchRow.of(
                    name=f"plan_{label}_cp{cp}_{mode.value}_us_per_request",
                    value=dt / n * 1e6, unit="us/request",
                    baseline_name=f"torch.tensor of the batch's {len(tokens)} token ids, "
                                  "us/request",
                    baseline_value=base / n * 1e6))
    return rows
