"""The rich consoles of the commands' output.

On a terminal rich wraps at the terminal's width. Piped or redirected, rich would assume 80
columns and fold table cells mid-word; the commands' output there is for files, ``grep`` and
other programs, so it is not wrapped at all (``COLUMNS`` still sets a width when given).
"""

from __future__ import annotations

import os

from rich.console import Console

__all__ = ["HELP_WIDTH", "PIPED_WIDTH", "help_width", "output_console"]

#: the width of a console that writes to no terminal: wide enough that no line of a report wraps
PIPED_WIDTH = 100_000

#: the width of ``--help`` text that writes to no terminal: click would assume 80 columns and
#: break the long default paths mid-word
HELP_WIDTH = 120


def output_console(*, stderr: bool = False, quiet: bool = False) -> Console:
    """A console for stdout (or stderr): the terminal's width on a terminal; piped, no wrapping
    (:data:`PIPED_WIDTH`) unless ``COLUMNS`` names a width."""
    probe = Console(stderr=stderr)
    piped = not probe.is_terminal and not os.environ.get("COLUMNS")
    return Console(stderr=stderr, quiet=quiet, width=PIPED_WIDTH if piped else None)


def help_width() -> dict[str, int]:
    """click's context settings for ``--help``: the terminal's width on a terminal; piped,
    :data:`HELP_WIDTH` unless ``COLUMNS`` names a width."""
    if Console().is_terminal or os.environ.get("COLUMNS"):
        return {}
    return {"terminal_width": HELP_WIDTH, "max_content_width": HELP_WIDTH}
