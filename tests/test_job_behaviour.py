"""``cpkv run`` as a well-made command line program: one log stream, user errors as one line with
the fix, no rank process left behind whatever kills the parent, Ctrl-C exits 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from cpkv.comm import CPGroup, current_wait, waiting_in
from cpkv.runtime import RankFailed, RankTimeout, run_ranks
from cpkv.runtime.ranklog import RankLogMerger, StderrLines
from helpers import alive, children

pytestmark = pytest.mark.multiprocess  # every test runs the ``cpkv`` command in a subprocess

#: a quick job: no transfer or decode phase, the default prompts
QUICK = ["run", "--decode-tokens", "0"]
#: prompts whose extends are whole multiples of 2C pages: no fallback at CP2
ALIGNED = str(Path(__file__).parents[1] / "examples" / "prompts_aligned.json")


def cpkv(*args: str, env: dict[str, str] | None = None,
         timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cpkv.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _ignores_sigint(pid: int) -> bool:
    """Whether ``pid`` ignores SIGINT now (its ``SigIgn`` mask in /proc): the job's parent does
    while it starts its ranks, so that they ignore Ctrl-C from birth."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    except OSError:
        pass
    return False


def _is_rank(pid: int) -> bool:
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_killing_the_parent_leaves_no_rank_process(sig: signal.Signals) -> None:
    if sig == signal.SIGINT and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        pytest.skip("SIGINT is ignored in this process (e.g. a background job of a "
                    "non-interactive shell): the job inherits that, no Ctrl-C can reach it")
    proc = subprocess.Popen([sys.executable, "-m", "cpkv.cli", *QUICK], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ranks: list[int] = []
        deadline = time.monotonic() + 90
        while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            ranks = [p for p in children(proc.pid) if _is_rank(p)]
        assert len(ranks) == 2, "the two rank processes did not start within 90 s"
        if sig == signal.SIGINT:
            # a Ctrl-C while the parent still starts its ranks is ignored by design (the ranks
            # inherit the ignoring): on a loaded machine that takes seconds, so wait it out
            while _ignores_sigint(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
        time.sleep(1.0)  # inside the job (imports, the process group)
        if sig == signal.SIGINT:  # Ctrl-C: the terminal signals the whole process group
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        rc = proc.wait(timeout=30)
        end = time.monotonic() + 5
        while any(map(alive, ranks)) and time.monotonic() < end:
            time.sleep(0.1)
        left = [p for p in ranks if alive(p)]
        assert not left, f"rank processes {left} outlived the parent ({sig.name}) by 5 s"
        _, err = proc.communicate(timeout=10)
        assert "BrokenPipeError" not in err and "Traceback" not in err, err[-2000:]
        expected = {signal.SIGTERM: 128 + 15, signal.SIGKILL: -9, signal.SIGINT: 130}[sig]
        assert rc == expected, (rc, err[-2000:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_decode_rank_death_is_one_line_naming_the_decode_rank() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "cpkv.cli", "run"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ranks: list[int] = []
        deadline = time.monotonic() + 90
        while len(ranks) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            ranks = sorted(p for p in children(proc.pid) if _is_rank(p))
        assert len(ranks) == 3, "the three processes did not start within 90 s"
        time.sleep(2.0)
        os.kill(ranks[2], signal.SIGKILL)  # started last: the decode rank
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 1, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("Error:")]
    assert errors == [ln for ln in errors if "the decode rank (rank 2 of 3)" in ln], err[-3000:]
    assert len(errors) == 1 and "SIGKILL" in errors[0]
    assert "frame #" not in err and "Traceback" not in err and "TCPStore" not in err


@pytest.mark.slow
def test_default_run_prints_the_report_on_stdout_and_no_rank_events() -> None:
    out = cpkv(*QUICK)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "correct" in out.stdout
    # the ranks' events are not on stdout, and by default not at all (the report lists the
    # fallbacks once): nothing from structlog anywhere
    for stream in (out.stdout, out.stderr):
        assert "cpkv.backend.selected" not in stream and "[info" not in stream
        assert "[warning  ] cpkv.fallback" not in stream
    # at 80 columns (no terminal: rich's default) the tables fit and no cell breaks a word
    assert "startup (spawn, imports, model load)" in out.stdout
    assert all(len(ln) <= 80 for ln in out.stdout.splitlines() if ln[:1] in "┏┃┡│└")
    assert out.stdout.count("fallback split_plan") == len(set(
        ln for ln in out.stdout.splitlines() if ln.startswith("fallback split_plan")))


def _mooncake_available() -> bool:
    try:
        from cpkv_transfer_mooncake.plugin import probe
    except ImportError:
        return False
    return probe().available


@pytest.mark.slow
@pytest.mark.mooncake
@pytest.mark.skipif(not _mooncake_available(), reason="the mooncake transfer cannot run here")
def test_a_mooncake_run_prints_no_engine_lines_unless_verbose() -> None:
    config = str(Path(__file__).parents[1] / "examples" / "mooncake.toml")
    out = cpkv("run", "--config", config)
    assert out.returncode == 0, out.stderr[-3000:]
    # the engine's glog lines ("E1201 ... transfer_metadata.cpp:1098] Local segment descriptor
    # not found") go through the log as info events: not shown by default
    assert "transfer_metadata" not in out.stderr and "InitGoogleLogging" not in out.stderr
    assert "transfer_metadata" not in out.stdout
    verbose = cpkv("-v", "run", "--config", config)
    assert verbose.returncode == 0
    engine = [ln for ln in verbose.stderr.splitlines() if "rank.stderr" in ln
              and "transfer_metadata" in ln]
    assert engine and all("ranks=" in ln or "rank=" in ln for ln in engine)


@pytest.mark.slow
def test_verbose_run_logs_every_rank_once_per_event_on_stderr() -> None:
    out = cpkv("-v", *QUICK)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ranks=0,1" in out.stderr  # identical events of both ranks: one line
    assert "cpkv.fallback" in out.stderr
    assert "cpkv." not in out.stdout and "ranks=" not in out.stdout
    lines = [ln for ln in out.stderr.splitlines() if "cpkv.kv.materialize_auto" in ln
             and "ranks=" in ln]
    assert len(lines) == 1, out.stderr  # one line, not one per rank


@pytest.mark.slow
def test_exhausted_pool_is_one_line_naming_the_setting() -> None:
    out = cpkv(*QUICK, env={"CPKV_KV__PAGES_PER_RANK": "2"})
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, out.stderr
    assert "PoolExhausted" in errors[0] and "kv.pages_per_rank" in errors[0]
    assert "CPKV_KV__PAGES_PER_RANK" in errors[0]
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_exhausted_pool_with_v_shows_the_rank_traceback() -> None:
    out = cpkv("-v", *QUICK, env={"CPKV_KV__PAGES_PER_RANK": "2"})
    assert out.returncode == 1
    assert "--- traceback of rank" in out.stderr and "PoolExhausted" in out.stderr


@pytest.mark.parametrize(("var", "value", "available"), [
    ("CPKV_BACKEND__NAME", "tritn", "torch"),
    ("CPKV_TRANSFER__NAME", "mooncak", "nccl"),
])
def test_unknown_plugin_name_is_a_configuration_error(var: str, value: str,
                                                      available: str) -> None:
    t0 = time.monotonic()
    out = cpkv("run", env={var: value})
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"{value!r}" in out.stderr and "available:" in out.stderr and available in out.stderr
    assert "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 60  # before any rank started


def test_missing_weights_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    out = cpkv("run", "--model", str(tmp_path), "--decode-tokens", "0")
    assert out.returncode == 1
    assert out.stderr.count("Error:") == 1 and "Traceback" not in out.stderr


@pytest.mark.slow
def test_mis_shaped_weights_are_one_line_from_the_ranks(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    assert cpkv("init-model", str(ckpt)).returncode == 0
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] += 32  # the weights no longer match
    (ckpt / "config.json").write_text(json.dumps(cfg))
    out = cpkv("run", "--model", str(ckpt), "--decode-tokens", "0")
    assert out.returncode == 1
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and "ModelLoadError" in errors[0] and "mis-shaped" in errors[0]
    assert "config.json matches its weights" in errors[0] and "Traceback" not in out.stderr


@pytest.mark.slow
def test_bench_writes_to_the_user_cache_unless_out_is_given(tmp_path: Path) -> None:
    tracked = Path(__file__).parents[1] / "benchmarks" / "results" / "plan_cpu.json"
    before = tracked.read_bytes() if tracked.exists() else None
    out = cpkv("bench", "plan", "--repeat", "1", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    written = tmp_path / "cpkv" / "bench" / "plan_cpu.json"
    assert written.is_file() and f"wrote {written}" in out.stdout
    assert (tracked.read_bytes() if tracked.exists() else None) == before


def test_draft_tokens_without_mtp_is_an_error() -> None:
    out = cpkv("run", "--draft-tokens", "2")
    assert out.returncode == 2 and "--draft-tokens needs --mtp" in out.stderr


def test_json_true_is_not_a_token_id(tmp_path: Path) -> None:
    p = tmp_path / "prompts.json"
    p.write_text("[[1, 2, true]]")
    out = cpkv("run", "--prompts", str(p))
    assert out.returncode == 1 and "token ids" in out.stderr


@pytest.mark.slow
def test_error_policy_with_aligned_prompts_runs_and_reports_context(tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    out = cpkv("run", "--prompts", ALIGNED, "--report", str(report),
               env={"CPKV_FALLBACK__POLICY": "error"})
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["fallbacks"] == []
    assert data["settings"]["fallback"]["policy"] == "error" and data["version"]
    assert "Python" in data["machine"]
    sec = data["seconds"]
    for k in ("cp_startup", "cp_prefill", "cp_decode", "reference_startup",
              "reference_prefill", "reference_decode"):
        assert sec[k] >= 0.0
    assert "cp_wall" not in sec
    # startup (spawn, imports, load) is what makes the CP wall time long, not the prefill
    assert sec["cp_startup"] + sec["cp_prefill"] <= sec["cp_total"] + 1.0


def _rank0_waits_rank1_sleeps(group: CPGroup) -> None:
    if group.rank == 0:
        with waiting_in("barrier (group of 2)"):
            time.sleep(1000)
    time.sleep(1000)


@pytest.mark.slow
def test_a_hung_rank_is_named_by_the_collective_it_waits_in() -> None:
    with pytest.raises(RankTimeout) as info:
        run_ranks(_rank0_waits_rank1_sleeps, 2, timeout_s=6.0)
    assert info.value.waiting == {0: "barrier (group of 2)"}
    assert "rank 0 waited in barrier (group of 2)" in str(info.value)


def _last_rank_raises(group: CPGroup) -> None:
    if group.rank == group.size - 1:
        raise ValueError("no pages arrived")
    group.barrier()


@pytest.mark.slow
def test_the_decode_rank_is_called_so() -> None:
    with pytest.raises(RankFailed) as info:
        run_ranks(_last_rank_raises, 2, timeout_s=60.0, names=["rank 0", "the decode rank"])
    assert str(info.value).startswith("ValueError: no pages arrived [the decode rank (rank 1 of 2)]")
    assert info.value.label == "the decode rank (rank 1 of 2)"


def test_rank_events_merge_across_ranks_and_stderr_lines_become_events() -> None:
    merger = RankLogMerger(3, ["rank 0", "rank 1", "the decode rank"], window_s=60.0)
    lines = StderrLines(merger)
    with capture_logs() as logs:
        for r in range(3):
            merger.add(r, {"event": "cpkv.kv.materialize_auto", "level": "info", "why": "cpu"})
        assert len(logs) == 1  # every rank sent it: logged at once, not after the window
        lines.feed(0, b"E1202 01:11:55.1 26614 transfer_metadata.cpp:1098] Local segment descr")
        lines.feed(0, b"iptor not found\nframe #0: c10::Error\n")
        lines.feed(2, b"E1202 01:11:56.2 26615 transfer_metadata.cpp:1098] Local segment "
                      b"descriptor not found\n")
        lines.feed(1, b"a stray line without newline")
        lines.feed(1, b"")
        merger.flush(force=True)
    assert logs[0]["ranks"] == "0,1,decode" and logs[0]["event"] == "cpkv.kv.materialize_auto"
    glog = [e for e in logs if e.get("source") == "transfer_metadata.cpp:1098"]
    assert len(glog) == 1 and glog[0]["ranks"] == "0,decode"  # timestamps differ, text the same
    assert glog[0]["log_level"] == "info"  # an engine's E line of a run is no warning
    frame = next(e for e in logs if e.get("line") == "frame #0: c10::Error")
    assert frame["log_level"] == "debug" and frame["rank"] == "0"
    stray = next(e for e in logs if e.get("line") == "a stray line without newline")
    assert stray["log_level"] == "warning" and stray["rank"] == "1"


def test_torch_distributed_rank_prefixed_cpp_lines_are_detail_not_warnings() -> None:
    """torch.distributed prefixes a rank's C++ lines with ``[rankN]:`` and some builds leave
    the thread out of c10's prefix: the peers' TCPStore lines after a rank dies stay detail."""
    merger = RankLogMerger(2, ["rank 0", "rank 1"], window_s=60.0)
    lines = StderrLines(merger)
    with capture_logs() as logs:
        for r in range(2):
            lines.feed(r, f"[rank{r}]:[W1203 21:16:45.051615123 TCPStore.cpp:125] [c10d] "
                          f"recvValue failed on SocketImpl(fd=26): Connection reset by peer\n"
                          f"[rank{r}]:<omitting python frames>\n".encode())
        merger.flush(force=True)
    tcp = [e for e in logs if e.get("source") == "TCPStore.cpp:125"]
    assert len(tcp) == 1 and tcp[0]["ranks"] == "0,1" and tcp[0]["log_level"] == "info"
    assert tcp[0]["line"].startswith("[c10d] recvValue failed")
    assert all(e["log_level"] != "warning" for e in logs), logs


def _seen_in_barrier(group: CPGroup) -> str | None:
    seen: list[str | None] = []

    def look() -> None:
        time.sleep(0.5)
        w = current_wait()
        seen.append(w[1] if w else None)

    if group.rank == 0:
        t = threading.Thread(target=look)
        t.start()
        group.barrier()  # rank 1 comes 1.5 s later
        t.join()
        return seen[0]
    time.sleep(1.5)
    group.barrier()
    return None


@pytest.mark.slow
def test_a_collective_marks_what_the_rank_waits_in() -> None:
    out = run_ranks(_seen_in_barrier, 2, timeout_s=60.0)
    assert out[0].value == "barrier (group of 2)"
    assert current_wait() is None  # nothing marked outside a collective
