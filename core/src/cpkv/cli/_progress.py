"""Progress of long work, as the rank processes note it (:func:`cpkv.comm.note_progress`): tokens
done of all, tokens/s and an estimate of the time left, per batch and per chunk. On a terminal
it is the text of the live status line; otherwise a log line every :data:`EVERY_S` seconds (and
the last one), so a piped or CI run is never silent for long."""

from __future__ import annotations

import time
from collections.abc import Callable

import click

__all__ = ["ProgressLine"]

#: seconds between two progress lines when stderr is not a terminal
EVERY_S = 10.0


def _eta(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.0f} s"


class ProgressLine:
    """A ``run_ranks`` ``on_progress`` sink (rank, what, done, total): the first rank's prefill
    and the decode rank's decode (``decode_rank``) are shown.

    Args:
        show: where the text goes on a terminal (the status line), or None to print lines.
        quiet: print nothing (``-q``).
    """

    def __init__(self, show: Callable[[str], None] | None, *, decode_rank: int | None = None,
                 quiet: bool = False, every_s: float = EVERY_S) -> None:
        self.show, self.decode_rank, self.quiet, self.every_s = show, decode_rank, quiet, every_s
        self.started: dict[str, tuple[float, int]] = {}  # what -> (time, done) at its first note
        self.printed: float | None = None  # when the last line was printed (None: never)

    def text(self, what: str, done: int, total: int, now: float) -> str:
        """``prefill: 24,576 of 65,536 tokens (37.5 %), 812 tokens/s, about 50 s left``."""
        t0, d0 = self.started.setdefault(what, (now, done))
        line = f"{what}: {done:,} of {total:,} tokens ({done / max(1, total):.1%})"
        rate = (done - d0) / (now - t0) if now > t0 and done > d0 else 0.0
        if rate > 0:
            line += f", {rate:,.0f} tokens/s, about {_eta((total - done) / rate)} left"
        return line

    def __call__(self, rank: int, what: str, done: int, total: int) -> None:
        if self.quiet or not total or not (rank == 0 or rank == self.decode_rank):
            return
        if (what == "decode") != (rank == self.decode_rank):
            return
        now = time.monotonic()
        line = self.text(what, done, total, now)
        if self.show is not None:
            self.show(line)
        elif self.printed is None or now - self.printed >= self.every_s or done >= total:
            self.printed = now
            click.echo(f"progress {line}", err=True)
