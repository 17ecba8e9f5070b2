"""The one fallback choke point (contract rule 30).

Every place where cpkv takes another path than asked calls :func:`report_fallback`. It emits one
structlog warning ``cpkv.fallback`` with op, requested, selected, reason and detail, counts the
event on the active :class:`FallbackRecorder`, notifies listeners (the plugin hook
``cpkv_on_fallback``) and raises :class:`FallbackError` instead when the policy is ``error``.
Library code never configures structlog; the CLI does.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from cpkv.contracts import FallbackEvent, FallbackPolicy, FallbackReason
from cpkv.logs import get_logger

__all__ = [
    "FallbackError",
    "FallbackRecorder",
    "add_listener",
    "recorder",
    "recording",
    "report_fallback",
]

log = get_logger("cpkv.fallback")


class FallbackError(RuntimeError):
    """A fallback happened while the policy is ``error``."""

    def __init__(self, event: FallbackEvent) -> None:
        super().__init__(
            f"fallback refused by policy 'error': {event.op}: requested {event.requested!r}, "
            f"would select {event.selected!r} ({event.reason.value}) {event.detail}".rstrip()
        )
        self.event = event


class FallbackRecorder:
    """Collects the fallbacks of one run: the events in order and a count per reason."""

    def __init__(self, policy: FallbackPolicy | str = FallbackPolicy.WARN) -> None:
        self.policy = FallbackPolicy(policy)
        self.events: list[FallbackEvent] = []
        self.counts: Counter[FallbackReason] = Counter()
        self._lock = threading.Lock()

    def record(self, event: FallbackEvent) -> None:
        with self._lock:
            self.events.append(event)
            self.counts[event.reason] += 1


_default = FallbackRecorder()
_active: ContextVar[FallbackRecorder] = ContextVar("cpkv_fallback_recorder", default=_default)
_listeners: list[Callable[[FallbackEvent], None]] = []


def recorder() -> FallbackRecorder:
    """The recorder that :func:`report_fallback` counts on now."""
    return _active.get()


@contextlib.contextmanager
def recording(policy: FallbackPolicy | str = FallbackPolicy.WARN) -> Iterator[FallbackRecorder]:
    """Count fallbacks on a fresh recorder with ``policy`` for the duration of the block."""
    rec = FallbackRecorder(policy)
    token = _active.set(rec)
    try:
        yield rec
    finally:
        _active.reset(token)


def add_listener(fn: Callable[[FallbackEvent], None]) -> Callable[[], None]:
    """Call ``fn(event)`` on every fallback; returns a function that removes it again."""
    _listeners.append(fn)
    return lambda: _listeners.remove(fn) if fn in _listeners else None


def report_fallback(
    op: str,
    requested: str,
    selected: str,
    reason: FallbackReason | str,
    detail: str = "",
) -> FallbackEvent:
    """Report a fallback: log it, count it, tell listeners; raise if the policy is ``error``.

    Raises:
        FallbackError: when the active recorder's policy is ``error`` (nothing is counted then,
            the caller must not proceed on the fallback path).
    """
    event = FallbackEvent(op=op, requested=requested, selected=selected,
                          reason=FallbackReason(reason), detail=detail)
    rec = recorder()
    if rec.policy is FallbackPolicy.ERROR:
        log.error("cpkv.fallback", **event.model_dump(mode="json"), policy="error")
        raise FallbackError(event)
    rec.record(event)
    log.warning("cpkv.fallback", **event.model_dump(mode="json"))
    for fn in _listeners:
        try:
            fn(event)
        except Exception as exc:  # a listener must never break the caller's path
            log.error("cpkv.fallback.listener_failed", listener=repr(fn), error=repr(exc))
    return event
