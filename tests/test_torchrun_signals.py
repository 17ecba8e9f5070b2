"""Ctrl-C under torchrun stops every rank, the decode rank included, within 2 s, with cpkv's one
line and status 130 from the ranks (a thread waits for the signals: a Python handler would wait
for a collective or a store wait in C++ to return); a rank that waits for a message logs
nothing while it waits (no c10d timeout warnings)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from cpkv._faults import HANG_ENV
from cpkv.disagg.transport import WAIT_SLICE_S, StoreSideChannel
from helpers import alive, children

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def test_a_rank_waiting_for_a_message_logs_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    """The decode rank waits through a prefill of any length: in slices, re-reading the other
    ranks' progress, none of which may log (a timed-out store wait logs two c10d warnings)."""
    host = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", host.port, 1, False, timedelta(seconds=30))
    rx = StoreSideChannel(host, 1, timeout_s=30.0, endpoints=2)
    tx = StoreSideChannel(client, 0, timeout_s=30.0, endpoints=2)
    late = threading.Timer(4 * WAIT_SLICE_S, lambda: tx.send(1, "offer"))
    late.start()
    try:
        assert rx.recv(0) == "offer"
    finally:
        late.join()
        rx.close()
        tx.close()
    assert "c10d" not in capfd.readouterr().err


_BLOCKED = """
import sys
from datetime import timedelta
import torch.distributed as dist
from cpkv.cli._signals import stop_at_once_on_signals
stop_at_once_on_signals(announce=True)
store = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=300))
print("waiting", flush=True)
store.wait(["never"])  # in C++, where a Python handler would not run
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize(("sig", "status", "line"), [(signal.SIGINT, 130, "cpkv: interrupted\n"),
                                                     (signal.SIGTERM, 143, "")])
def test_a_signal_ends_a_rank_waiting_in_cxx_at_once(sig: int, status: int, line: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "waiting\n"
        time.sleep(0.2)
        proc.send_signal(sig)
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == status
        assert time.monotonic() - t0 < 2.0
        assert proc.communicate()[1] == line
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()  # closes the pipes


@pytest.mark.multiprocess
@pytest.mark.slow
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
        workers = children(proc.pid)
        assert len(workers) == 3, workers
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        t0 = time.monotonic()
        while any(map(alive, workers)) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        stopped = time.monotonic() - t0
        assert not any(map(alive, workers)), "a rank still runs 10 s after Ctrl-C"
        assert stopped < 2.0, f"the last rank stopped {stopped:.1f} s after Ctrl-C"
        proc.wait(timeout=60)  # torchrun's own status and traceback are torchrun's
        reader.join(timeout=10)
        text = "".join(seen)
        assert text.count("cpkv: interrupted\n") == 1, text[-3000:]  # rank 0's line alone
        assert "waitForInput" not in text, text[-3000:]  # the waiting decode rank was quiet
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
