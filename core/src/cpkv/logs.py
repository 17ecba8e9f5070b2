"""cpkv's loggers: quiet as a library, through Python's standard ``logging``.

Every module logs through :func:`get_logger`. While nobody configured structlog (an engine that
embeds cpkv and uses plain ``logging``), an event goes to the standard library logger of its
module (``logging.getLogger("cpkv.runtime.launch")``, key-value pairs in the message): the
application's logging configuration decides what appears and where; with none, Python's last
resort handler prints warnings and errors on stderr and nothing reaches stdout. Once structlog is
configured (the ``cpkv`` command, a rank process forwarding its events to the parent, tests'
``capture_logs``), events go through structlog as configured. cpkv never configures either.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import structlog

__all__ = ["ForwardEvents", "ToSink", "get_logger", "parent_level"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "warn": logging.WARNING, "error": logging.ERROR, "critical": logging.CRITICAL,
           "exception": logging.ERROR}


class _Logger:
    """A structlog-style logger (``log.info("event", key=value)``) that picks its route at
    each call (structlog configured or not: see the module docstring)."""

    def __init__(self, name: str, context: dict[str, Any] | None = None) -> None:
        self.name = name
        self.context = dict(context or {})
        self.stdlib = logging.getLogger(name)

    def bind(self, **kw: Any) -> _Logger:
        return _Logger(self.name, {**self.context, **kw})

    def _log(self, method: str, event: str, kw: dict[str, Any]) -> None:
        if structlog.is_configured():
            getattr(structlog.get_logger(self.name).bind(**self.context), method)(event, **kw)
            return
        level = _LEVELS[method]
        if not self.stdlib.isEnabledFor(level):
            return
        fields = {**structlog.contextvars.get_contextvars(), **self.context, **kw}
        exc_info = method == "exception" or bool(fields.pop("exc_info", False))
        text = " ".join([event, *(f"{k}={v!r}" if isinstance(v, str) and " " in v else f"{k}={v}"
                                  for k, v in fields.items())])
        self.stdlib.log(level, text, exc_info=exc_info, stacklevel=3)

    def debug(self, event: str, **kw: Any) -> None:
        self._log("debug", event, kw)

    def info(self, event: str, **kw: Any) -> None:
        self._log("info", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._log("warning", event, kw)

    warn = warning

    def error(self, event: str, **kw: Any) -> None:
        self._log("error", event, kw)

    def exception(self, event: str, **kw: Any) -> None:
        self._log("exception", event, kw)

    def critical(self, event: str, **kw: Any) -> None:
        self._log("critical", event, kw)

    def log(self, level: int, event: str, **kw: Any) -> None:
        """At a numeric ``logging`` level."""
        name = logging.getLevelName(level).lower()
        self._log(name if name in _LEVELS else "info", event, kw)


class ToSink:
    """The last processor in a rank: hand the event dict to the parent, print nothing here."""

    def __init__(self, sink: Callable[[dict[str, Any]], None]) -> None:
        self.sink = sink

    def __call__(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> Any:
        self.sink(dict(event))
        raise structlog.DropEvent


@dataclass(frozen=True)
class ForwardEvents:
    """A rank launcher's default ``log_setup`` (picklable): the rank's events from ``level`` up
    go to the parent, which logs them through its own loggers (:mod:`cpkv.runtime.ranklog`), as
    ``cpkv run`` does; nothing is printed in the rank."""

    level: int = logging.INFO

    def __call__(self, sink: Callable[[dict[str, Any]], None]) -> None:
        structlog.configure(
            processors=[structlog.contextvars.merge_contextvars,
                        structlog.processors.add_log_level, ToSink(sink)],
            wrapper_class=structlog.make_filtering_bound_logger(self.level),
            cache_logger_on_first_use=False,
        )


def parent_level() -> int:
    """The level from which this process logs cpkv's events: structlog's when it is configured
    with a filtering logger (its ``min_level``), else the ``cpkv`` standard library logger's."""
    if structlog.is_configured():
        level = getattr(structlog.get_logger(), "get_effective_level", None)
        return int(level()) if callable(level) else logging.DEBUG
    return logging.getLogger("cpkv").getEffectiveLevel()


def get_logger(name: str) -> Any:
    """The logger of module ``name`` (see the module docstring); typed ``Any`` like
    ``structlog.get_logger``'s."""
    return _Logger(name)
