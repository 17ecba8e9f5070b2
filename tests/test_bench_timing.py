"""The benchmark timers: call counts and the CPU path (the GPU path runs in `cpkv bench gpu`)."""

from __future__ import annotations

import time

import pytest
import torch

from cpkv.bench.timing import device_ms, median_ms


@pytest.mark.parametrize("timer", [
    median_ms,
    pytest.param(device_ms, marks=pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="with a GPU, device_ms times the GPU (test_device_ms_hides_host_work_on_gpu)")),
])
def test_timers_call_warmup_plus_iters_and_measure_the_call(timer) -> None:  # type: ignore[no-untyped-def]
    calls = []

    def fn() -> None:
        calls.append(1)
        time.sleep(0.002)

    kwargs = {"warmup": 2, "iters": 5}
    ms = timer(fn, "cpu", **kwargs) if timer is median_ms else timer(fn, **kwargs)
    assert len(calls) == 7
    assert 1.5 <= ms < 200  # the 2 ms sleep, not zero and not the whole loop


@pytest.mark.gpu
def test_device_ms_hides_host_work_on_gpu() -> None:
    """A call whose host part (5 ms of sleep) dwarfs its GPU part: GPU time stays small."""
    x = torch.ones(1 << 20, device="cuda")

    def fn() -> None:
        time.sleep(0.005)
        x.mul_(1.0)

    assert device_ms(fn, iters=5, lead_ms=20) < 2.0 < median_ms(fn, "cuda", iters=5)


@pytest.mark.gpu
def test_host_timeline_sees_host_work_before_the_first_kernel() -> None:
    """10 ms of host work, then two kernels with 10 ms of host work between them: the
    timeline puts the first 10 ms before the first kernel and the second in the gaps."""
    from cpkv.bench.gpu import host_timeline

    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()

    def fn() -> None:
        time.sleep(0.010)
        x.mul_(1.0)
        torch.cuda.synchronize()  # the GPU is idle while the host sleeps again
        time.sleep(0.010)
        x.mul_(1.0)

    t = host_timeline(fn)
    assert 9.0 <= t["host_before_first_kernel_ms"] < 100
    assert 9.0 <= t["gaps_between_kernels_ms"] < 100
    assert 0 < t["kernel_busy_ms"] < 5
    assert t["wall_ms"] >= 20


def _glue(x: torch.Tensor) -> torch.Tensor:
    return (x @ x).relu()


def _outer(x: torch.Tensor) -> torch.Tensor:
    return _glue(x).sum()


def test_op_sources_names_the_functions_that_ran_each_op() -> None:
    """Each top-level torch op with the innermost frames of the named package that ran it, its
    time and calls; ops outside the package are left out."""
    from cpkv.bench.gpu import op_sources

    x = torch.randn(64, 64)
    rows = op_sources(lambda: (_outer(x), _outer(x), x.sin()), package="test_bench_timing")
    by_op = {r["op"]: r for r in rows}
    assert {"aten::matmul", "aten::relu", "aten::sum"} <= set(by_op)
    mm = by_op["aten::matmul"]
    assert mm["calls"] == 2 and mm["ms"] > 0
    assert "_glue" in mm["source"][0] and "_outer" in mm["source"][1]
    assert "_outer" in by_op["aten::sum"]["source"][0]
    assert all(len(r["source"]) <= 3 for r in rows)
