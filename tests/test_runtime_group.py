"""cpkv.runtime: CPGroup collectives on Gloo, and run_ranks' bounded waits and error propagation.

Rank functions are top-level (``spawn`` pickles them by name). Checks that need every rank's data
run inside the ranks; a failed assertion there comes back as RankFailed with the rank's traceback.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from multiprocessing import resource_tracker

import pytest
import torch

from cpkv.comm import CollectiveCheckError, CPGroup
from cpkv.contracts import FallbackReason
from cpkv.fallback import report_fallback
from cpkv.runtime import (
    RankFailed,
    RankResult,
    RankTimeout,
    run_ranks,
)

# Spawning a rank imports torch (a few seconds on a small CPU machine); failures must be reported
# well before the run timeout, which is set far above this.
FAST_S = 25.0

DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int64,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.bool,
    torch.float8_e4m3fn,
]
MAX_ROWS = 3


def _rows(rank: int, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s rows: values that name the rank, row and column, exact in every dtype."""
    numel = n * (torch.Size(shape).numel() if shape else 1)
    vals = (torch.arange(numel, dtype=torch.float32) + 7 * rank + 1) % 13
    if dtype == torch.bool:
        vals = (vals % 2) == 1
    return vals.to(dtype).reshape(n, *shape)


def _n_rows(rank: int) -> int:
    return [0, 3, 1, 2][rank % 4]  # uneven, and rank 0 sends nothing


def _check_all_gather(group: CPGroup) -> None:
    for dtype in DTYPES:
        for shape in [(4,), (), (2, 3)]:
            local = _rows(group.rank, _n_rows(group.rank), shape, dtype)
            out = group.all_gather_rows(local, MAX_ROWS)
            assert out.dtype == dtype and out.device == group.device
            assert tuple(out.shape) == (group.size * MAX_ROWS, *shape), (dtype, shape, out.shape)
            for r in range(group.size):
                n = _n_rows(r)
                got = out[r * MAX_ROWS : r * MAX_ROWS + n]
                want = _rows(r, n, shape, dtype)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (dtype, shape, r)
            assert torch.equal(local, _rows(group.rank, _n_rows(group.rank), shape, dtype))
    # Every rank empty, and a non-contiguous input that fills max_rows exactly.
    empty = group.all_gather_rows(torch.empty(0, 5, dtype=torch.bfloat16), 0)
    assert tuple(empty.shape) == (0, 5)
    full = _rows(group.rank, 4, (MAX_ROWS,), torch.float32).t()  # [3, 4], not contiguous
    out = group.all_gather_rows(full, MAX_ROWS)
    for r in range(group.size):
        want = _rows(r, 4, (MAX_ROWS,), torch.float32).t()
        assert torch.equal(out[r * MAX_ROWS : (r + 1) * MAX_ROWS], want)


def _collectives(group: CPGroup) -> dict[str, object]:
    """Every CPGroup method; returns what the parent checks."""
    assert group.backend == "gloo" and group.device == torch.device("cpu")
    _check_all_gather(group)

    flags = {"all": True, "not_rank_1": group.rank != 1, "only_rank_0": group.rank == 0}
    if group.rank % 2:  # insertion order differs between ranks; agree_all sorts the keys
        flags = dict(reversed(flags.items()))
    agreed = group.agree_all(flags)
    try:
        group.agree_all({f"key_of_rank_{group.rank}": True})
        mismatch = "no error"
    except ValueError as exc:
        mismatch = str(exc)

    same = group.all_equal("plan-hash-abc")
    differ = group.all_equal(f"plan-hash-{group.rank}")

    group.check_all(True, "fine")
    try:
        group.check_all(group.rank not in (1, group.size - 1), f"pool exhausted on rank {group.rank}")
        check = "no error"
    except CollectiveCheckError as exc:
        check = str(exc)
    group.barrier()

    report_fallback("gather", "cuda", "torch", FallbackReason.OP_NOT_PROVIDED, f"rank {group.rank}")
    return {"agreed": agreed, "mismatch": mismatch, "same": same, "differ": differ, "check": check}


@pytest.mark.multiprocess
# 4 ranks: 10.3 CPU seconds, twice 2 ranks' for the same collectives
@pytest.mark.parametrize("size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_collectives_on_gloo(size: int, no_leftover_ranks: None) -> None:
    results = run_ranks(_collectives, size, timeout_s=60.0)
    assert [r.rank for r in results] == list(range(size))
    for res in results:
        assert isinstance(res, RankResult) and res.seconds > 0
        v = res.value
        assert v["agreed"] == {"all": True, "not_rank_1": False, "only_rank_0": False}
        assert "different key sets" in v["mismatch"]
        assert v["same"] is True and v["differ"] is False
        # Every rank raised alike, naming both failing ranks and their messages.
        failing = ", ".join(str(r) for r in sorted({1, size - 1}))
        assert v["check"].startswith(f"collective check failed on rank(s) {failing} of {size}: ")
        assert "rank 1: pool exhausted on rank 1" in v["check"]
        assert f"rank {size - 1}: pool exhausted on rank {size - 1}" in v["check"]
        assert [(e.op, e.reason, e.detail) for e in res.fallbacks] == [
            ("gather", FallbackReason.OP_NOT_PROVIDED, f"rank {res.rank}")
        ]
    assert len({r.value["check"] for r in results}) == 1


def test_single_group_works_without_distributed() -> None:
    g = CPGroup.single()
    assert (g.rank, g.size, g.backend, g.device) == (0, 1, "local", torch.device("cpu"))
    local = _rows(0, 2, (3,), torch.bfloat16)
    out = g.all_gather_rows(local, 4)
    assert tuple(out.shape) == (4, 3) and torch.equal(out[:2], local)
    assert tuple(g.all_gather_rows(torch.empty(0, 3, dtype=torch.uint8), 0).shape) == (0, 3)
    assert g.agree_all({"b": False, "a": True}) == {"a": True, "b": False}
    assert g.all_equal("x") is True
    g.check_all(True, "fine")
    with pytest.raises(CollectiveCheckError, match="rank 0: pool exhausted"):
        g.check_all(False, "pool exhausted")
    g.barrier()
    with pytest.raises(ValueError, match="do not fit"):
        g.all_gather_rows(torch.zeros(5, 2), 4)


# -- failures -------------------------------------------------------------------------------------


def _child_pids() -> set[int]:
    """Live or zombie children of this process (Linux ``/proc``), less multiprocessing's resource
    tracker, which ``spawn`` starts once per parent and keeps by design."""
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                out.add(int(entry))
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
    return out - {tracker}


@pytest.fixture
def no_leftover_ranks() -> Iterator[None]:
    """Every rank process is gone (neither running nor a zombie) when run_ranks returns."""
    if not os.path.isdir("/proc"):
        yield
        return
    before = _child_pids()
    yield
    assert _child_pids() <= before, "rank processes left behind"


def _rank1_raises(group: CPGroup) -> None:
    if group.rank == 1:
        raise ValueError("boom from rank 1")
    group.barrier()  # never completes: rank 1 does not join


def _rank1_raises_others_block(group: CPGroup) -> None:
    if group.rank == 1:
        time.sleep(0.5)  # the others are inside their waits by now
        raise ValueError("boom from rank 1")
    if group.rank == 2:
        time.sleep(1000)  # blocked outside any collective: only termination ends it
    group.all_gather_rows(torch.zeros(1, 4), 1)


def _rank1_sleeps(group: CPGroup) -> int:
    if group.rank == 1:
        time.sleep(1000)
    return group.rank


def _rank1_exits(group: CPGroup) -> None:
    if group.rank == 1:
        os._exit(3)
    group.barrier()


def _unpicklable_result(group: CPGroup) -> object:
    return lambda: group.rank


@pytest.mark.multiprocess
def test_rank_error_propagates_fast(no_leftover_ranks: None) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_rank1_raises, 2, timeout_s=120.0)
    elapsed = time.monotonic() - t0
    err = info.value
    assert str(err).startswith("ValueError: boom from rank 1 [rank 1 of 2]")
    assert "Traceback" in str(err) and "_rank1_raises" in str(err)
    assert (err.rank, err.error_type, err.exitcode) == (1, "ValueError", None)
    assert elapsed < FAST_S, f"took {elapsed:.1f} s"


@pytest.mark.multiprocess
@pytest.mark.slow  # 6 CPU seconds
def test_blocked_ranks_are_terminated_after_a_failure(no_leftover_ranks: None) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_rank1_raises_others_block, 3, timeout_s=120.0)
    elapsed = time.monotonic() - t0
    assert str(info.value).startswith("ValueError: boom from rank 1 [rank 1 of 3]")
    assert info.value.rank == 1
    assert 2 in info.value.others  # the sleeping rank, terminated
    assert elapsed < FAST_S, f"took {elapsed:.1f} s"


@pytest.mark.slow  # 6 s: waits out a timeout
@pytest.mark.multiprocess
def test_hung_rank_times_out_by_name(no_leftover_ranks: None) -> None:
    timeout = 5.0
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_rank1_sleeps, 2, timeout_s=timeout)
    elapsed = time.monotonic() - t0
    assert info.value.ranks == [1] and info.value.phase == "run"
    assert "no rank made progress for 5 s (runtime.timeout_s" in str(info.value)
    assert "rank 1 of 2 made none" in str(info.value)
    assert timeout <= elapsed < timeout + FAST_S, f"took {elapsed:.1f} s"


@pytest.mark.multiprocess
def test_rank_dying_silently_reports_exit_code(no_leftover_ranks: None) -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(_rank1_exits, 2, timeout_s=120.0)
    assert (info.value.rank, info.value.exitcode, info.value.error_type) == (1, 3, None)
    assert "rank 1 of 2 died without a report: exit code 3" in str(info.value)
    assert time.monotonic() - t0 < FAST_S


@pytest.mark.multiprocess
def test_unpicklable_result_is_a_rank_failure() -> None:
    with pytest.raises(RankFailed, match="could not send the result of rank 0"):
        run_ranks(_unpicklable_result, 1, timeout_s=60.0)


def _tensor_result(group: CPGroup) -> torch.Tensor:
    return torch.full((3, 5), float(group.rank))


@pytest.mark.multiprocess
def test_tensor_results_arrive_by_value() -> None:
    # results travel as plain pickles: a shared-memory handle would die with its rank process
    out = run_ranks(_tensor_result, 2, timeout_s=60.0)
    assert [torch.equal(r.value, torch.full((3, 5), float(r.rank))) for r in out] == [True, True]


def test_rank_threads_share_the_cores() -> None:
    from cpkv.runtime.launch import GPU_RANK_THREADS, rank_threads

    assert rank_threads("gloo", 2, cpus=32) == 16
    assert rank_threads("gloo", 8, cpus=2) == 1
    assert rank_threads("nccl", 2, cpus=32) == GPU_RANK_THREADS
    assert rank_threads("nccl", 8, cpus=16) == 2
    assert rank_threads("gloo", 2, cpus=32, gpu=True) == GPU_RANK_THREADS  # Gloo ranks on GPUs


def test_rank_gpus_place_and_check() -> None:
    """NCCL: rank r on GPU r by default, one rank per GPU; Gloo: the CPU unless placed, and
    then ranks may share a GPU; a placement of the wrong length or naming a missing GPU fails."""
    from cpkv.runtime.launch import rank_gpus

    assert rank_gpus("nccl", 2, None, 2) == [0, 1]
    assert rank_gpus("gloo", 2, None, 0) == [None, None]
    assert rank_gpus("gloo", 2, [0, 0], 1) == [0, 0]
    assert rank_gpus("nccl", 2, [1, 0], 2) == [1, 0]
    with pytest.raises(ValueError, match="needs 3 GPUs, found 2"):
        rank_gpus("nccl", 3, None, 2)
    with pytest.raises(ValueError, match=r"one rank on a GPU.*'gloo'"):
        rank_gpus("nccl", 2, [0, 0], 1)
    with pytest.raises(ValueError, match=r"names GPU\(s\) \[1\]; this host has 1"):
        rank_gpus("gloo", 2, [0, 1], 1)
    with pytest.raises(ValueError, match="place each of the 2 ranks, got 1"):
        rank_gpus("gloo", 2, [0], 1)


def _agree_off_host(group: CPGroup) -> tuple[dict[str, bool], str]:
    # a Gloo group whose ranks compute elsewhere (here "meta": no data, no collectives)
    g = CPGroup(rank=group.rank, size=group.size, backend="gloo", device=torch.device("meta"),
                timeout_s=group.timeout_s)
    agreed = g.agree_all({"a": True, "b": group.rank == 0})
    try:
        g.check_all(group.rank == 0, f"rank {group.rank} says no")
        check = "ok"
    except CollectiveCheckError as exc:
        check = str(exc)
    return agreed, check


@pytest.mark.multiprocess
def test_gloo_group_agrees_in_host_memory(no_leftover_ranks: None) -> None:
    """A Gloo group's agreements run on host tensors whatever device its ranks compute on (ranks
    sharing a GPU: the job's decode rank beside prefill rank 0)."""
    for r in run_ranks(_agree_off_host, 2, timeout_s=60.0):
        agreed, check = r.value
        assert agreed == {"a": True, "b": False}
        assert "rank 1 says no" in check
