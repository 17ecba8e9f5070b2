"""The ``cpkv`` command as users run it: real subprocesses, stdout and stderr apart (bad values
of ``cpkv plan``, which fail before any work, in this process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from cpkv.cli import main

pytestmark = pytest.mark.multiprocess  # every test runs the ``cpkv`` command in a subprocess

ISSUE_PLAN = ["plan", "--cp", "4", "--page-size", "64", "--mode", "zigzag", "--extend",
              "1010,600,7", "--prefix", "0,70,0", "--prefix-owner", "interleave", "--json"]


def cpkv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cpkv.cli", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


def test_plan_json_matches_the_contract() -> None:
    out = cpkv(*ISSUE_PLAN)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    r0, r1, r2 = plan["requests"]
    # request 0: page-aligned, 8 segments, boundaries on pages except the request's end
    assert r0["page_aligned"] is True and len(r0["segments"]) == 8
    assert all(s["start"] % 64 == 0 for s in r0["segments"])
    assert [s["end"] % 64 == 0 for s in r0["segments"]] == [True] * 7 + [False]
    assert r0["segments"][-1]["end"] == 1010
    # request 1: head fragment 70-127 on rank 1, the owner of page 1; the rest page-aligned
    head = r1["segments"][0]
    assert (head["start"], head["end"], head["rank"]) == (70, 128, 1)
    assert r1["page_owners"][1] == 1 and r1["page_aligned"] is True
    assert all(s["start"] % 64 == 0 for s in r1["segments"][1:])
    # request 2: token-balanced fallback, reported on stderr (never on stdout)
    assert r2["page_aligned"] is False and r2["fallback"] == "short_extend"
    assert "cpkv.fallback" in out.stderr and "short_extend" in out.stderr
    assert "#2 (P=0, E=7)" in out.stderr
    # page_owners: one entry per logical page the request spans
    assert len(r0["page_owners"]) == 16 and len(r1["page_owners"]) == 11


def test_plan_table() -> None:
    out = cpkv("plan", "--cp", "2", "--extend", "300,5")
    assert out.returncode == 0, out.stderr
    assert "[0,64)->0" in out.stdout and "max_rank_len" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--cp", "2", "--extend", "a,b"], "comma-separated integers"),
        (["plan", "--cp", "2", "--extend", "10,0"], "every extend length must be >= 1"),
        (["plan", "--cp", "2", "--extend", "10", "--prefix", "1,2"], "--prefix has 2 values"),
        (["plan", "--cp", "0", "--extend", "10"], "0 is not in the range x>=1"),
    ],
)
def test_plan_rejects_bad_input(args: list[str], message: str) -> None:
    # in this process (a subprocess per case cost seconds of imports; the one-line convention
    # is checked end to end in test_error_lines)
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 1 and message in out.stderr  # a bad value: one line, exit 1
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_run_default_shards_kv_and_reports(tmp_path) -> None:  # type: ignore[no-untyped-def]
    report = tmp_path / "report.json"
    out = cpkv("run", "--report", str(report))
    assert out.returncode == 0, out.stderr
    assert "correct" in out.stdout
    data = json.loads(report.read_text())
    assert data["cp"] == 2 and data["mode"] == "zigzag" and data["correct"] is True
    assert data["max_rel_err_vs_reference"] <= data["tolerance"]
    per_rank, replicated = data["kv_bytes_per_rank"], data["kv_bytes_replicated"]
    assert sum(per_rank) == replicated  # no replica anywhere
    assert all(0.35 < b / replicated < 0.65 for b in per_rank)  # about 1/C each
    reasons = {e["reason"] for e in data["fallbacks"]}
    assert {"short_extend", "owner_write"} <= reasons  # the 40-token prompt
    assert "plugin_unavailable" not in reasons  # the default order passes over quietly
    assert set(data["backends"]["chosen"]) >= {"rerange", "sparse_mla", "page_copy"}
    # served one by one: the second prompt hits the first's 100 shared tokens (mid-page), the
    # follow-up all 600 of the first; the reference ran without a cache and still matches
    assert data["cache"]["hit_tokens"] == [0, 100, 0, 600]
    # every request's pages move to decode, its cached prefix too: more than the ranks keep
    assert sum(data["transfer"]["bytes_per_rank"]) > sum(per_rank)
    assert data["decode"]["tokens_match_reference"] is True


@pytest.mark.slow
def test_run_with_a_small_pool_brings_prefixes_back_from_the_host_tier(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """7 pages per rank cannot keep the first prompt while the second runs: it is evicted to
    the host tier, and the follow-up loads it back; every result still equals the reference."""
    report = tmp_path / "report.json"
    out = cpkv("run", "--report", str(report),
               env={"CPKV_KV__PAGES_PER_RANK": "7", "CPKV_CACHE__HOST_PAGES": "32"})
    assert out.returncode == 0, out.stderr
    data = json.loads(report.read_text())
    assert data["correct"] is True and data["decode"]["tokens_match_reference"] is True
    c = data["cache"]
    assert c["hit_tokens"] == [0, 100, 0, 600] and c["host_pages"] == 32
    assert c["pages_evicted"] > 0 and c["pages_saved_to_host"] > 0
    assert c["pages_loaded_from_host"] > 0


@pytest.mark.slow  # 4.8 s: a whole cpkv run
def test_run_with_error_policy_fails_with_the_reason() -> None:
    out = cpkv("run", env={"CPKV_FALLBACK__POLICY": "error"})
    assert out.returncode == 1
    assert "fallback refused by policy 'error'" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.skipif(__import__("torch").cuda.device_count() >= 3, reason="enough GPUs to run")
def test_run_on_cuda_without_a_gpu_per_process_says_so() -> None:
    out = cpkv("run", "--device", "cuda")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "needs a GPU per process: 3 processes" in out.stderr


def test_run_reports_settings_errors() -> None:
    out = cpkv("run", env={"CPKV_KV__SHARD": "1"})
    assert out.returncode == 1 and "CPKV_KV__SHARD" in out.stderr


@pytest.mark.slow
def test_run_under_torchrun_one_process_per_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``torchrun --nproc-per-node 3 -m cpkv run``: each process is one rank of one Gloo world
    (CP2 prefill ranks, then the decode rank), the CP size comes from the world size, and rank 0
    reports the same checks as cpkv's own spawner."""
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "3", "-m", "cpkv", "run", "--report", str(report)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "CPKV_FALLBACK__POLICY": "warn"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("correct: CP logits") == 1  # only rank 0 reports
    data = json.loads(report.read_text())
    assert data["cp"] == 2 and data["correct"] is True
    assert data["cache"]["hit_tokens"] == [0, 100, 0, 600]
    assert data["decode"]["tokens_match_reference"] is True


@pytest.mark.parametrize(("env", "args", "message"), [
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"},
     ["--cp", "2"], "torchrun started 2 processes; this job needs 3 (cp.size = 2 + the decode"),
    ({"RANK": "0", "WORLD_SIZE": "3"}, [], "MASTER_ADDR, MASTER_PORT not (torchrun sets all"),
])
def test_run_under_a_launcher_checks_the_world_first(env: dict[str, str], args: list[str],
                                                     message: str) -> None:
    out = cpkv("run", *args, env=env)
    assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr


def test_report_says_where_each_process_ran() -> None:
    """The report's first line names each process's GPU, and says when the decode rank shares
    one with a prefill rank (one GPU fewer than processes)."""
    from types import SimpleNamespace

    from cpkv.cli.run import _where

    assert _where(SimpleNamespace(device="cpu", gpus=None, cp=2)) == "cpu"
    shared = SimpleNamespace(device="cuda", gpus=[0, 0], cp=1)
    assert _where(shared) == "cuda (GPUs 0, 0: the decode rank shares GPU 0)"
    own = SimpleNamespace(device="cuda", gpus=[0, 1, 2], cp=2)
    assert _where(own) == "cuda (GPUs 0, 1, 2)"
    assert _where(SimpleNamespace(device="cuda", gpus=[0, 1], cp=2)) == "cuda (GPUs 0, 1)"
