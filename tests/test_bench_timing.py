"""The benchmark timers: call counts and the CPU path (the GPU path runs in `cpkv bench gpu`)."""

from __future__ import annotations

import time

import pytest
import torch

from cpkv.bench.timing import device_ms, median_ms


@pytest.mark.parametrize("timer", [median_ms, device_ms])
def test_timers_call_warmup_plus_iters_and_measure_the_call(timer) -> None:  # type: ignore[no-untyped-def]
    calls = []

    def fn() -> None:
        calls.append(1)
        time.sleep(0.002)

    kwargs = {"warmup": 2, "iters": 5}
    ms = timer(fn, "cpu", **kwargs) if timer is median_ms else timer(fn, **kwargs)
    assert len(calls) == 7
    assert 1.5 <= ms < 200  # the 2 ms sleep, not zero and not the whole loop


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_device_ms_hides_host_work_on_gpu() -> None:
    """A call whose host part (5 ms of sleep) dwarfs its GPU part: GPU time stays small."""
    x = torch.ones(1 << 20, device="cuda")

    def fn() -> None:
        time.sleep(0.005)
        x.mul_(1.0)

    assert device_ms(fn, iters=5, lead_ms=20) < 2.0 < median_ms(fn, "cuda", iters=5)
