"""Shared-GPU mode (issue 37's CP2 on one GPU): which GPU a rank computes on
(:func:`cpkv.comm.rank_gpu`, a pure function), and the startup check that takes Gloo ranks
sharing a GPU with a log line saying so, and refuses NCCL ranks sharing one with the fix."""

from __future__ import annotations

import pytest
import structlog
import torch
from hypothesis import given
from hypothesis import strategies as st

from cpkv.comm import CPGroup, rank_gpu, shared_gpus_line
from cpkv.contracts import KVFormat
from cpkv.fallback import recording
from cpkv.runtime.setup import StartupError, check_startup, resolve_ops
from cpkv.settings import load_settings


@given(ranks=st.integers(1, 16), gpus=st.integers(1, 8), data=st.data())
def test_gloo_ranks_share_gpus_round_robin_nccl_needs_one_each(ranks: int, gpus: int,
                                                                data: st.DataObject) -> None:
    rank = data.draw(st.integers(0, ranks - 1))
    place = rank_gpu("gloo", rank, ranks, gpus)
    assert place.gpu == rank % gpus and 0 <= place.gpu < gpus
    assert place.shared == (ranks > gpus)
    # every GPU gets ranks as evenly as round robin can: counts differ by at most one
    counts = [0] * gpus
    for r in range(ranks):
        counts[rank_gpu("gloo", r, ranks, gpus).gpu] += 1
    assert max(counts) - min(counts) <= 1
    if ranks <= gpus:
        assert rank_gpu("nccl", rank, ranks, gpus).gpu == rank  # a GPU each, no sharing
    else:
        with pytest.raises(ValueError, match="use the gloo backend") as exc:
            rank_gpu("nccl", rank, ranks, gpus)
        assert f"{ranks} ranks need {ranks} GPUs, {gpus} visible" in str(exc.value)


def test_no_gpu_or_a_rank_outside_is_an_error() -> None:
    with pytest.raises(ValueError, match="no GPU is visible"):
        rank_gpu("gloo", 0, 2, 0)
    with pytest.raises(ValueError, match="rank 2 outside the 2 ranks"):
        rank_gpu("gloo", 2, 2, 1)
    line = shared_gpus_line(rank_gpu("gloo", 1, 2, 1))
    assert line == "2 ranks share 1 GPU(s): rank r on GPU r % 1, Gloo collectives through host memory"


def _cuda_group(backend: str, rank: int = 0) -> CPGroup:
    """A CP2 group as its ranks see it on a GPU (no process group: the startup check does not
    communicate)."""
    return CPGroup(rank=rank, size=2, backend=backend,  # type: ignore[arg-type]
                   device=torch.device("cuda", 0), timeout_s=5.0)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_startup_takes_gloo_ranks_sharing_one_gpu_and_says_so(
        backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    settings = load_settings(cp={"size": 2}, kv={"dtype": "bf16"})
    with recording():
        ops, registry = resolve_ops(settings, CPGroup.single())
    fmt = KVFormat(dtype="bf16", page_size=settings.kv.page_size)
    if backend == "nccl":
        with pytest.raises(StartupError, match=r"cp\.size=2: backend 'nccl' puts one rank on a "
                                               r"GPU.*use the gloo backend"):
            check_startup(settings, fmt, _cuda_group("nccl"), ops, registry)
        return
    for rank in (0, 1):
        with structlog.testing.capture_logs() as logs:
            check_startup(settings, fmt, _cuda_group("gloo", rank), ops, registry)
        said = [e for e in logs if e["event"] == "cpkv.gpu.shared"]
        if rank == 0:  # one line for the group, at warning: seen without any logging set up
            assert len(said) == 1 and said[0]["log_level"] == "warning"
            assert (said[0]["ranks"], said[0]["gpus"]) == (2, 1)
            assert "rank r on GPU r % 1" in said[0]["line"]
        else:
            assert said == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a GPU each: nothing to say
    with structlog.testing.capture_logs() as logs:
        check_startup(settings, fmt, _cuda_group("gloo"), ops, registry)
    assert not any(e["event"] == "cpkv.gpu.shared" for e in logs)
