"""Output files of the commands: checked before any rank starts, written atomically.

``--report``, ``--save-logits`` and ``cpkv bench --out`` name files the command writes at its end;
a directory that cannot take them is found up front (one line naming the option, exit 1), not
after a run of minutes. Every write goes to a temporary file beside the target, renamed over it:
a failed write never leaves a truncated or half-overwritten file.

A directory that does not exist is an error, never created: a misspelt path must not leave a
directory tree behind. The one exception is cpkv's own cache directory
(``~/.cache/cpkv``, :func:`cpkv_owned`), where the defaults of ``cpkv bench --out`` go.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import click

__all__ = ["check_output", "cpkv_owned", "write_atomic"]

#: temporary files start so (hidden, and named so a reader knows what left one behind)
TMP_PREFIX = ".cpkv-tmp-"


def cpkv_owned(path: Path) -> bool:
    """True when ``path`` lies in cpkv's cache directory (``$XDG_CACHE_HOME/cpkv``, else
    ``~/.cache/cpkv``), whose missing directories cpkv creates."""
    from cpkv.models.tiny import default_cache_dir

    return path.resolve().is_relative_to(default_cache_dir().parent.resolve())


def output_problem(path: Path) -> str | None:
    """Why ``path`` cannot be written as a command's output file (None: it can): it is not a
    regular file, its directory does not exist (created only in cpkv's cache directory:
    :func:`cpkv_owned`) or cannot take a new file (tried for real: a temporary file is created
    and removed, so permissions, read-only and virtual file systems all count)."""
    if path.is_dir():
        return "a directory"
    if path.exists() and not path.is_file():
        return "not a regular file (a report is written to a temporary file and renamed over it)"
    parent = path.parent
    if not parent.is_dir() and not cpkv_owned(parent):
        return (f"the directory {parent} does not exist (cpkv creates none); create it first or "
                f"name a file in an existing directory")
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
        fix = "" if "does not exist" in why else "; name a file in a writable directory"
        raise click.ClickException(f"{option} {path}: {why}{fix}")


def write_atomic(path: Path | str, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` to a temporary file beside ``path``, then rename it over ``path`` (its
    mode as a new file's under the umask); the temporary file goes away if ``write`` fails.
    ``path``'s directory must exist (except in cpkv's cache directory: :func:`cpkv_owned`).

    Raises:
        OSError: the directory is missing or cannot take the file, or ``write`` raised it."""
    p = Path(path)
    if cpkv_owned(p.parent):
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
