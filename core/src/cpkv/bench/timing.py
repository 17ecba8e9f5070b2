"""The one timer of every benchmark: median milliseconds, CUDA events on a GPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["median_ms"]


def median_ms(fn: Callable[[], Any], device: torch.device | str = "cuda", warmup: int = 3,
              iters: int = 20) -> float:
    """Median milliseconds of ``fn`` after ``warmup`` calls: CUDA events around each call on a
    CUDA device (the current stream), ``perf_counter`` elsewhere."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
