"""``runtime.logits_budget_mb``: a number wins; "auto" is sized from the device's free memory on
CUDA (an eighth, clamped to [512 MiB, 16 GiB]) and is 512 MiB on a CPU; the session exposes what
it took."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpkv.comm import CPGroup
from cpkv.fallback import recording
from cpkv.models import load_model, write_tiny_checkpoint
from cpkv.runtime.budget import (
    AUTO_MAX_MB,
    AUTO_MIN_MB,
    CPU_AUTO_MB,
    auto_budget_mb,
    logits_budget,
)
from cpkv.runtime.session import PrefillSession
from cpkv.settings import load_settings

GiB = 1 << 30


@pytest.mark.parametrize(("free", "want"), [
    (0, AUTO_MIN_MB),                       # a full device: the floor
    (1 * GiB, AUTO_MIN_MB),                 # an eighth is 128 MiB: still the floor
    (8 * GiB, 1024),                        # an eighth
    (100 * GiB + (9 << 20), 12801),         # an eighth, whole MiB (the odd bytes round down)
    (139 * GiB, AUTO_MAX_MB),               # an eighth is 17.4 GiB: the ceiling
])
def test_auto_budget_is_an_eighth_of_free_memory_clamped(free: int, want: int) -> None:
    assert auto_budget_mb(free) == want


def test_auto_budget_rejects_negative_free_memory() -> None:
    with pytest.raises(ValueError, match="negative"):
        auto_budget_mb(-1)


def test_auto_on_cuda_reads_free_memory_and_a_number_wins() -> None:
    cuda = torch.device("cuda", 0)
    b = logits_budget("auto", cuda, free_bytes=40 * GiB)  # a fake free-memory reading
    assert (b.mb, b.auto, b.bytes) == (5120, True, 5120 << 20)
    assert logits_budget(1024, cuda, free_bytes=40 * GiB) == type(b)(1024, auto=False)
    assert logits_budget("auto", torch.device("cpu")) == type(b)(CPU_AUTO_MB, auto=True)
    with pytest.raises(ValueError, match="logits_budget_mb"):
        logits_budget(0, cuda, free_bytes=40 * GiB)


def test_the_session_reports_the_budget_it_took(tmp_path: Path) -> None:
    model = load_model(str(write_tiny_checkpoint(tmp_path / "ckpt", seed=3)))
    got = []
    for setting in ("auto", 7):
        s = load_settings(cp={"size": 1}, kv={"page_size": 8, "dtype": "fp32"},
                          backend={"preference": ["torch"]},
                          runtime={"logits_budget_mb": setting})
        with recording():
            session = PrefillSession(model, s, CPGroup.single())
        got.append((session.logits_budget_mb, session.logits_budget_auto,
                    session.driver.budget))
    assert got == [(CPU_AUTO_MB, True, CPU_AUTO_MB << 20), (7, False, 7 << 20)]
