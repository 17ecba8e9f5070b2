"""Rank processes die with the process that started them, from their first moment.

:func:`cpkv.runtime.launch.run_ranks` names itself in :data:`PARENT_ENV` while it starts rank
processes; the first import of ``cpkv`` in such a process (unpickling the rank's function, or
the console script's own import when ``spawn`` re-runs it) calls :func:`die_with_parent_from_env`
before torch or anything slow is imported, so a parent killed even by SIGKILL during the ranks'
imports leaves nothing behind. Imports nothing of cpkv (it runs in ``cpkv/__init__``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

__all__ = ["PARENT_ENV", "die_with_parent", "die_with_parent_from_env"]

#: the pid of the process starting rank processes (set only while it starts them; not a
#: ``CPKV_`` name: it is no setting)
PARENT_ENV = "_CPKV_RANK_PARENT_PID"

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``;
    elsewhere the launcher's watchdog thread does it later), and exit at once if ``parent_pid``
    is no longer the parent (it died before that)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def die_with_parent_from_env() -> None:
    """:func:`die_with_parent` when :data:`PARENT_ENV` names this process's parent (a rank being
    started); nothing otherwise (any other process that imports cpkv)."""
    value = os.environ.get(PARENT_ENV, "")
    if value.isdigit() and int(value) == os.getppid():
        die_with_parent(int(value))
