"""Ctrl-C and SIGTERM in a rank of a torchrun world.

Ctrl-C reaches every process of the terminal's group, and torchrun's agent stops its workers
with SIGTERM. A rank must then stop at once, even while its main thread waits in a collective
or a store wait in C++, where Python's handlers would not run until the wait returns (the
decode rank ran on for 30 s until the agent killed it). So the signals' C-level handler, which
runs in whatever thread the signal reaches at once, wakes a thread of cpkv's through
:func:`signal.set_wakeup_fd` (a pipe it reads, the GIL released): that thread prints ``cpkv:
interrupted`` (rank 0, on SIGINT) and ends the process with 128 + the signal number (130 for
Ctrl-C) without unwinding.

What torchrun does is its own: its agent turns its own SIGINT into a ``SignalException`` with a
traceback and exits 1, whatever the ranks' status.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["STOPPING", "stop_at_once_on_signals"]

#: the signals a rank stops on
STOPPING = (signal.SIGINT, signal.SIGTERM)


def stop_at_once_on_signals(announce: bool) -> None:
    """Make SIGINT and SIGTERM end this process at once with 128 + their number, printing
    ``cpkv: interrupted`` on stderr first when ``announce`` (rank 0) and the signal is SIGINT.
    Only from the main thread (elsewhere: nothing)."""
    if threading.current_thread() is not threading.main_thread():
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    for sig in STOPPING:  # the Python-level handler does nothing: the thread below acts
        signal.signal(sig, lambda signum, frame: None)
    signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def wait() -> None:
        while True:
            got = os.read(read_end, 1)
            if got and got[0] in STOPPING:
                if announce and got[0] == signal.SIGINT:
                    os.write(2, b"cpkv: interrupted\n")
                os._exit(128 + got[0])

    threading.Thread(target=wait, daemon=True, name="cpkv-signals").start()
