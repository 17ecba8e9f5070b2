"""The parent's side of rank logging: events the ranks send, logged once each.

A rank's events reach the parent as plain dicts (structlog's event dict: ``event``, ``level``,
the key-value pairs). Identical events of several ranks (the same level, event and values) seen
within a short window are logged as one, ``ranks=0,1``; an event of one rank carries ``rank=``.
The parent logs through ``structlog.get_logger("cpkv.rank")``: whatever configured structlog in
the parent (the CLI) decides the format, the stream and the level. What the ranks write to their
stderr themselves (C++ libraries: glog, torch) comes as lines (:class:`StderrLines`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from cpkv.logs import get_logger

__all__ = ["LogSetup", "RankLogMerger", "StderrLines", "rank_label"]

#: called first in each rank with a sink that hands one event dict to the parent
LogSetup = Callable[[Callable[[dict[str, Any]], None]], None]

#: how long an event waits for the same event from the other ranks before it is logged
MERGE_WINDOW_S = 0.5

log = get_logger("cpkv.rank")


def rank_label(rank: int, size: int, names: Sequence[str] | None = None, *,
               short: bool = False) -> str:
    """How messages name a rank: ``"rank 1 of 2"``, or with ``names`` e.g.
    ``"the decode rank (rank 2 of 3)"``; ``short`` drops the ``"of N"`` part."""
    plain = f"rank {rank}" if short else f"rank {rank} of {size}"
    if names is None or names[rank] == f"rank {rank}":
        return plain
    return names[rank] if short else f"{names[rank]} ({plain})"


def _short(rank: int, names: Sequence[str] | None) -> str:
    """A rank in a log line: ``"1"``, or its name without "the" and "rank" (``"decode"``)."""
    if names is None or names[rank] == f"rank {rank}":
        return str(rank)
    return names[rank].removeprefix("the ").removesuffix(" rank")


def _key(event: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f"{k}={event[k]!r}" for k in sorted(event))


class RankLogMerger:
    """Collects the ranks' events and logs each distinct one once, naming its ranks.

    An event is logged when every rank sent it, or :data:`MERGE_WINDOW_S` after the first rank
    did; :meth:`flush` with ``force`` logs everything pending (the end of a run), in the order
    the events first arrived.
    """

    def __init__(self, size: int, names: Sequence[str] | None = None,
                 window_s: float = MERGE_WINDOW_S) -> None:
        self.size = size
        self.names = names
        self.window_s = window_s
        self._pending: dict[tuple[str, ...], tuple[float, dict[str, Any], list[int]]] = {}

    def add(self, rank: int, event: dict[str, Any]) -> None:
        """One event dict from ``rank``."""
        key = _key(event)
        if key in self._pending:
            self._pending[key][2].append(rank)
        else:
            self._pending[key] = (time.monotonic(), dict(event), [rank])
        self.flush()

    def next_due(self) -> float | None:
        """Monotonic time when the oldest pending event is due, or None."""
        if not self._pending:
            return None
        return min(t for t, _, _ in self._pending.values()) + self.window_s

    def flush(self, force: bool = False) -> None:
        """Log the events that every rank sent or whose window passed (all with ``force``)."""
        now = time.monotonic()
        for key, (t, event, ranks) in list(self._pending.items()):
            if force or len(ranks) >= self.size or now >= t + self.window_s:
                del self._pending[key]
                self._emit(event, ranks)

    def _emit(self, event: dict[str, Any], ranks: list[int]) -> None:
        fields = dict(event)
        name = str(fields.pop("event", ""))
        level = logging.getLevelName(str(fields.pop("level", "info")).upper())
        fields.pop("timestamp", None)
        labels = [_short(r, self.names) for r in sorted(set(ranks))]
        if len(labels) == 1:
            fields["rank"] = labels[0]
        else:
            fields["ranks"] = ",".join(labels)
        log.log(level if isinstance(level, int) else logging.INFO, name, **fields)


# glog's line prefix: severity, date, time, thread, source] message (Mooncake's engine; torch's
# c10 logging writes the same in brackets: "[W1201 12:00:00.1 123 TCPStore.cpp:1] ...", the
# thread left out by some builds)
_GLOG = re.compile(r"^\[?([IWEF])\d{4} [\d:.]+ +(?:\d+ +)?([^\]\s]+)\] ?(.*)$")
# torch.distributed's prefix of a rank's C++ lines: "[rank0]:"
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:")
# the C++ stack frames torch appends to its errors: detail, not one warning per frame
_FRAME = re.compile(r"^(frame #\d+:|Exception raised from |<omitting python frames>|\s+(at|from) )")
#: glog severities as cpkv levels: the engine's own lines are detail (-v); its failures reach
#: the user as the plugin's errors, so an "E" line of a run that succeeds is no warning
_GLOG_LEVEL = {"I": "debug", "W": "info", "E": "info", "F": "error"}
_NOISE = ("WARNING: Logging before InitGoogleLogging() is written to STDERR",)


class StderrLines:
    """What the rank processes write to their stderr (C++ libraries, stray prints), as events
    of the merger: ``rank.stderr`` with the line; glog lines (``E1201 ... file.cpp:12] text``)
    at their severity (I debug, W and E info, F error) with the source, so identical lines of
    several ranks merge; any other line at warning level."""

    def __init__(self, merger: RankLogMerger) -> None:
        self.merger = merger
        self._partial: dict[int, bytes] = {}

    def feed(self, rank: int, data: bytes) -> None:
        """Bytes read from ``rank``'s stderr; empty at its end (a partial last line is logged)."""
        buf = self._partial.pop(rank, b"") + data
        *lines, rest = buf.split(b"\n")
        if not data and rest:
            lines, rest = [*lines, rest], b""
        if rest:
            self._partial[rank] = rest
        for raw in lines:
            line = raw.decode(errors="replace").rstrip()
            if line and line not in _NOISE:
                self.merger.add(rank, _event(line))


def _event(line: str) -> dict[str, Any]:
    line = _RANK_PREFIX.sub("", line)
    if _FRAME.match(line):
        return {"event": "rank.stderr", "level": "debug", "line": line}
    m = _GLOG.match(line)
    if m is None:
        return {"event": "rank.stderr", "level": "warning", "line": line}
    sev, source, text = m.groups()
    return {"event": "rank.stderr", "level": _GLOG_LEVEL[sev], "line": text, "source": source}
