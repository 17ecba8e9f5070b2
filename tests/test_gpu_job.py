"""``cpkv run --device cuda`` end to end on GPUs: CP prefill, the transfer to the decode rank,
decode steps (CUDA graphs) and the one-rank reference, compared by the job itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.multiprocess, pytest.mark.slow]

ONE_GPU = str(Path(__file__).parents[1] / "examples" / "one_gpu.toml")


def _mooncake_available() -> bool:
    try:
        from cpkv_transfer_mooncake.plugin import probe
    except ImportError:
        return False
    return probe().available


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "cpkv.cli", "run", "--device", "cuda",
                          "--report", str(report), *args], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out, json.loads(report.read_text())


@pytest.mark.mooncake
@pytest.mark.skipif(not _mooncake_available(), reason="the mooncake transfer cannot run here")
def test_one_gpu_run_decodes_as_the_reference(tmp_path: Path) -> None:
    """CP1 and the decode rank on one GPU (Mooncake over CUDA IPC): the decode rank's greedy
    tokens, its steps replayed from CUDA graphs, equal the reference's."""
    out, rep = _run(tmp_path, "--config", ONE_GPU, "--decode-tokens", "16")
    assert "the decode rank shares GPU 0" in " ".join(out.stdout.split())
    assert rep["device"] == "cuda" and rep["correct"]
    dec = rep["decode"]
    assert dec["tokens_match_reference"] and len(dec["tokens"][0]) == 16
    assert dec["steps"]["graphs"] and dec["steps"]["captured"] >= 1
    assert sum(rep["transfer"]["bytes_per_rank"]) > 0
    assert rep["gpus"] == [0, 0]  # prefill rank 0 and the decode rank


@pytest.mark.gpu(2)
def test_two_gpu_run_decodes_as_the_reference(tmp_path: Path) -> None:
    """CP1 on GPU 0, the decode rank on GPU 1, the nccl transfer: tokens equal the reference's."""
    _, rep = _run(tmp_path, "--cp", "1", "--decode-tokens", "16")
    dec = rep["decode"]
    assert rep["correct"] and dec["tokens_match_reference"] and dec["steps"]["graphs"]
    assert rep["gpus"] == [0, 1]
