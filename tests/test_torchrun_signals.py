"""Issue 33, item 3: Ctrl-C under torchrun stops every rank, the decode rank included, within 2 s
(each rank takes SIGINT's and SIGTERM's default action: a Python handler would wait for a
collective or a store wait in C++ to return)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cpkv._faults import HANG_ENV

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def _workers(agent: int) -> list[int]:
    """Live child processes of torchrun's agent (its workers)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[1]) == agent and fields[0] != "Z":
            out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def test_ctrl_c_under_torchrun_stops_every_rank_within_2_s(tmp_path: Path) -> None:
    # rank 1 hangs in its first batch: rank 0 then waits in a collective and the decode rank for
    # the first offer, the two waits in C++ that held the decode rank 30 s before
    env = {**os.environ, HANG_ENV: "prefill:1", "CPKV_FALLBACK__POLICY": "warn"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "3", "-m", "cpkv", "-v", "run"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env=env, start_new_session=True)
    seen: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            text = "".join(seen)
            if text.count("cpkv.kv.materialize_auto") >= 2:  # both CP ranks in their first batch
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(240), "the ranks did not reach the job:\n" + "".join(seen[-30:])
        time.sleep(3.0)  # the decode rank in its wait for the offer, rank 0 in the collective
        workers = _workers(proc.pid)
        assert len(workers) == 3, workers
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        t0 = time.monotonic()
        while any(map(_alive, workers)) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        stopped = time.monotonic() - t0
        assert not any(map(_alive, workers)), "a rank still runs 10 s after Ctrl-C"
        assert stopped < 2.0, f"the last rank stopped {stopped:.1f} s after Ctrl-C"
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
