"""What a rank process tells the launcher's parent (:mod:`.launch`) through its pipe: one of the
frozen dataclasses of :data:`RankMessage`, pickled by value, matched by type in the parent."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cpkv.contracts import FallbackEvent

__all__ = ["Failed", "Finished", "LogEvent", "Progressed", "RankMessage", "Ready", "Waiting"]


@dataclass(frozen=True)
class LogEvent:
    """A structlog event of the rank (the parent logs it, merged across ranks)."""

    rank: int
    #: the event dict (values that do not pickle travel as their repr)
    event: Mapping[str, Any]


@dataclass(frozen=True)
class Progressed:
    """The rank made progress (:func:`cpkv.comm.note_progress`): the run's bound starts again."""

    rank: int
    what: str
    done: int
    #: 0: unknown
    total: int


@dataclass(frozen=True)
class Waiting:
    """The rank has been waiting in a collective for a while (None: it no longer waits)."""

    rank: int
    what: str | None


@dataclass(frozen=True)
class Ready:
    """The rank joined the process group."""

    rank: int


@dataclass(frozen=True)
class Finished:
    """The rank's function returned."""

    rank: int
    value: Any
    fallbacks: list[FallbackEvent]
    #: the function's wall seconds
    seconds: float
    #: spawning the process to its joining the group
    startup_seconds: float


@dataclass(frozen=True)
class Failed:
    """The rank raised (or could not send its result)."""

    rank: int
    #: the exception's qualified type name
    error_type: str
    message: str
    traceback: str
    #: ``time.time()`` when it failed (the earliest failure is the likely cause)
    when: float


RankMessage = LogEvent | Progressed | Waiting | Ready | Finished | Failed
