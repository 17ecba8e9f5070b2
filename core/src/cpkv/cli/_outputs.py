"""Output files of the commands: checked before any rank starts, written atomically.

``--report``, ``--save-logits`` and ``cpkv bench --out`` name files the command writes at its end;
a directory that cannot take them is found up front (one line naming the option, exit 1), not
after a run of minutes. Every write goes to a temporary file beside the target, renamed over it:
a failed write never leaves a truncated or half-overwritten file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import click

__all__ = ["check_output", "write_atomic"]

#: temporary files start so (hidden, and named so a reader knows what left one behind)
TMP_PREFIX = ".cpkv-tmp-"


def output_problem(path: Path) -> str | None:
    """Why ``path`` cannot be written as a command's output file (None: it can): it is not a
    regular file, or its directory cannot be created or take a new file (tried for real: a
    temporary file is created and removed, so permissions, read-only and virtual file systems
    all count)."""
    if path.is_dir():
        return "a directory"
    if path.exists() and not path.is_file():
        return "not a regular file (a report is written to a temporary file and renamed over it)"
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=parent)
    except OSError as exc:
        return f"cannot write in {parent}: {exc.strerror or exc}"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(tmp)
    return None


def check_output(path: Path | str | None, option: str) -> None:
    """Raise :class:`click.ClickException` (one line naming ``option``) when ``path`` cannot be
    written (:func:`output_problem`); None passes."""
    if path is None:
        return
    why = output_problem(Path(path))
    if why is not None:
        raise click.ClickException(f"{option} {path}: {why}; name a file in a writable directory")


def write_atomic(path: Path | str, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` to a temporary file beside ``path``, then rename it over ``path`` (its
    mode as a new file's under the umask); the temporary file goes away if ``write`` fails."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=p.suffix, dir=p.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600
        tmp.replace(p)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return p
