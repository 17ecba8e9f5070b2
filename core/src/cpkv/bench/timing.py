"""The timers of every benchmark: median milliseconds, CUDA events on a GPU.

Two views of the same call on a GPU:

* :func:`median_ms` (eager): events around each call issued from an idle queue, so the host's
  launch work (Python, argument checks, the launcher) is inside the interval whenever it is
  longer than the GPU work. This is what a caller that synchronises after every call sees.
* :func:`device_ms`: the queue is first filled with a spin kernel (``torch.cuda._sleep``) longer
  than the host's launch work, so the interval is the GPU's execution time of the call's kernels
  and collectives alone. This is what the call costs inside a prefill, where the host runs ahead
  of the GPU by many kernels; kernel bandwidth and the copy ceilings are measured this way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["device_ms", "median_ms"]


def median_ms(fn: Callable[[], Any], device: torch.device | str = "cuda", warmup: int = 3,
              iters: int = 20) -> float:
    """Median milliseconds of ``fn`` after ``warmup`` calls: CUDA events around each call on a
    CUDA device (the current stream), ``perf_counter`` elsewhere."""
    if torch.device(device).type == "cuda":
        return _event_ms(fn, warmup, iters, before=None)
    for _ in range(warmup):
        fn()
    times: list[float] = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _event_ms(fn: Callable[[], Any], warmup: int, iters: int,
              before: Callable[[], Any] | None) -> float:
    """Median of CUDA-event intervals around ``fn`` on the current stream, ``before`` queued
    ahead of each start event."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    torch.cuda.synchronize()
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if before is not None:
            before()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


_CYCLES_PER_MS: list[float] = []


def _cycles_per_ms() -> float:
    """Spin-kernel cycles per millisecond on the current device (measured once)."""
    if not _CYCLES_PER_MS:
        n = 2_000_000
        torch.cuda._sleep(n)  # warm
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(n)
        b.record()
        b.synchronize()
        _CYCLES_PER_MS.append(n / max(a.elapsed_time(b), 1e-3))
    return _CYCLES_PER_MS[0]


def device_ms(fn: Callable[[], Any], warmup: int = 3, iters: int = 20,
              lead_ms: float = 2.0, align: Callable[[], Any] | None = None) -> float:
    """Median GPU milliseconds of ``fn`` with its host launch work hidden: before each call the
    current stream gets a ``lead_ms`` spin kernel, so the start event and the call's kernels are
    queued before the GPU reaches them. ``lead_ms`` must exceed the call's host time (the
    default, 2 ms, is ~10x the host work of the ops measured here). On a CPU: :func:`median_ms`.

    Collectives inside ``fn``: pass ``align`` (a tiny collective, e.g. an all-reduce of one
    element), queued after the spin and before the start event, so that every rank's interval
    starts when all ranks' GPUs are there (host skew between ranks stays outside).
    """
    if not torch.cuda.is_available():
        return median_ms(fn, "cpu", warmup, iters)
    cycles = int(_cycles_per_ms() * lead_ms)

    def lead() -> None:
        torch.cuda._sleep(cycles)
        if align is not None:
            align()

    return _event_ms(fn, warmup, iters, before=lead)
