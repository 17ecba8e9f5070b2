"""structlog setup for the CLI only (library code never configures structlog).

One stream: every event, the parent's and the rank processes', goes to stderr, one line each; the
report goes to stdout. The ranks' events travel to the parent (:class:`RankLogging` is the
``log_setup`` the CLI hands to the rank launcher), which logs them with the rank in the line and
identical events of several ranks once.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import structlog

from cpkv.logs import ToSink

__all__ = ["LEVELS", "RankLogging", "configure_logging", "level_from_flags"]

#: the settings' names of the levels (log.level)
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}


def level_from_flags(verbose: int, quiet: int, default: str = "warning") -> int:
    """The log level: ``-v`` info, ``-vv`` debug, ``-q`` errors only; without flags ``default``
    (a :data:`LEVELS` name: the ``log.level`` setting)."""
    if verbose:
        return logging.INFO if verbose == 1 else logging.DEBUG
    if quiet:
        return logging.ERROR
    return LEVELS[default]


class _Hide:
    """Drops the named events at warning level and below (e.g. ``cpkv.fallback``: ``cpkv run``'s
    report lists every fallback, so by default they are not logged too)."""

    def __init__(self, events: frozenset[str]) -> None:
        self.events = events

    def __call__(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> Any:
        if event.get("event") in self.events and event.get("level") in ("debug", "info", "warning"):
            raise structlog.DropEvent
        return event


class _CurrentStderr:
    """``sys.stderr`` as it is at each write: a live display (the ``cpkv run`` spinner) swaps in a
    proxy that prints above it, so a log line never lands glued to the spinner's line."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: int = logging.WARNING, hide: frozenset[str] = frozenset()) -> None:
    """Human-readable key=value events on stderr, from ``level`` up; ``hide``: event names not
    logged below error level."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,  # e.g. rank="reference" (cpkv.runtime.job)
            structlog.processors.add_log_level,
            _Hide(hide),
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


@dataclass(frozen=True)
class RankLogging:
    """The ranks' logging setup (picklable; the launcher calls it first in each rank with a sink
    to the parent): events from ``level`` up, ``hide`` as in :func:`configure_logging`, each
    handed to the parent instead of printed."""

    level: int = logging.WARNING
    hide: frozenset[str] = frozenset()

    def __call__(self, sink: Callable[[dict[str, Any]], None]) -> None:
        structlog.configure(
            processors=[structlog.processors.add_log_level, _Hide(self.hide), ToSink(sink)],
            wrapper_class=structlog.make_filtering_bound_logger(self.level),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=False,
        )
