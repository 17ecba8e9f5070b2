"""Which collective this process waits in now, and when it last made progress (read by the rank
launcher's watchdog thread and the transfer's progress beacon: a rank that hangs is named by the
collective it hangs in, and a rank that works is never taken for a hung one)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Progress", "current_wait", "last_progress", "latest_progress", "note_progress",
           "waiting_in"]

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


@dataclass(frozen=True)
class Progress:
    """What this process last reported doing (:func:`note_progress`).

    Attributes:
        seq: how many times progress was noted (0: never); a new value means new progress.
        what: the work, e.g. ``"prefill"`` or ``"decode"``.
        done: units of ``what`` done so far (tokens), when known (else 0).
        total: units of ``what`` in all (0: unknown).
        at: ``time.monotonic()`` of the note.
    """

    seq: int = 0
    what: str = ""
    done: int = 0
    total: int = 0
    at: float = 0.0


_progress = Progress()
#: the latest note of each ``what``: a reader that samples now and then (a relay thread) still
#: sees how each piece of work ended, though a later one was noted since
_latest: dict[str, Progress] = {}


def note_progress(what: str | None = None, done: int | None = None,
                  total: int | None = None) -> None:
    """Note that this process made progress (a layer, a row chunk, a batch, a decode step): one
    object store, no host sync, so the hot loops may call it. ``what`` / ``done`` / ``total``
    update the description (unchanged where None)."""
    global _progress
    p = _progress
    _progress = Progress(p.seq + 1, p.what if what is None else what,
                         p.done if done is None else done, p.total if total is None else total,
                         time.monotonic())
    _latest[_progress.what] = _progress


def last_progress() -> Progress:
    """The latest :func:`note_progress` of this process."""
    return _progress


def latest_progress() -> dict[str, Progress]:
    """The latest :func:`note_progress` of this process for each ``what``, in the order each
    ``what`` was first noted (a copy)."""
    return _latest.copy()
