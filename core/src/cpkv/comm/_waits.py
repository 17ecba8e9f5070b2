"""Which collective this process waits in now (read by the rank launcher's watchdog thread, so a
rank that hangs is named by the collective it hangs in)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["current_wait", "waiting_in"]

_seq = itertools.count(1)
# (sequence number, what, monotonic start) of the innermost wait of the main thread, or None.
# A plain module global: one tuple store per collective is all the hot path pays.
_now: tuple[int, str, float] | None = None
_main = threading.main_thread()


@contextmanager
def waiting_in(what: str) -> Iterator[None]:
    """Mark the block as waiting in the collective ``what`` (the main thread only; nested blocks
    show the innermost)."""
    global _now
    if threading.current_thread() is not _main:
        yield
        return
    before = _now
    _now = (next(_seq), what, time.monotonic())
    try:
        yield
    finally:
        _now = before


def current_wait() -> tuple[int, str, float] | None:
    """``(sequence number, what, monotonic start)`` of the collective the main thread waits in
    now, or None. Each new wait gets a new sequence number."""
    return _now
