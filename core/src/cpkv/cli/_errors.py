"""Errors a user can cause, as one line with the fix (the CLI prints it once, exit 1).

A rank's error reaches the parent as :class:`~cpkv.runtime.RankFailed` with its type's qualified
name and message; the ones a user can cause get a hint naming the setting or the fix. The
traceback is for ``-v`` / ``--debug``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cpkv.fallback import FallbackError
from cpkv.models import ModelLoadError
from cpkv.runtime import RankFailed, RankTimeout
from cpkv.settings import Settings, SettingsError, load_settings, origin_of

__all__ = ["Sources", "hint_for", "load_for_command", "one_line", "resolve_model"]

#: a message that starts with a settings key: ``transfer.name = 'x': ...``, ``run.model: ...``
_LEADING_KEY = re.compile(r"^([a-z_]+(?:\.[a-z_]+)+)(?= = |: )")

_MISSING_LIBRARY = "cannot open shared object file"


def hint_for(type_name: str, message: str) -> str:
    """The fix for an error of type ``type_name`` (qualified or plain) with ``message``, or
    ``""`` when there is none to give."""
    short = type_name.rsplit(".", 1)[-1]
    if short == "PoolExhausted" or "KV pool exhausted" in message:
        return ("raise kv.pages_per_rank ([kv] pages_per_rank in the --config file, or "
                "CPKV_KV__PAGES_PER_RANK), or serve fewer or shorter prompts per batch "
                "(run.batch_size)")
    if short == "FallbackError":
        return ("fallback.policy = 'error' refuses every fallback; set CPKV_FALLBACK__POLICY=warn "
                "to let the run take it (the report lists it)")
    if _MISSING_LIBRARY in message:
        lib = message.split(":")[0].strip().rsplit(" ", 1)[-1]
        if "ibverbs" in message:
            return ("install the system library libibverbs (apt-get install -y libibverbs1), or "
                    "choose another transfer.name")
        return f"install the system library that provides {lib}"
    if short == "ModelLoadError":
        return ("run.model (--model) must name an HF-format DeepSeek-V3.2 checkpoint directory whose "
                "config.json matches its weights, or 'tiny'")
    return ""


def _first_line(message: str) -> str:
    """The message up to the first C++ frame or traceback (torch's errors append pages of them)."""
    lines = [ln for ln in message.strip().splitlines() if ln.strip()]
    keep: list[str] = []
    for ln in lines:
        if ln.startswith(("Exception raised from", "frame #", "Traceback")):
            break
        keep.append(ln.strip())
    return " ".join(keep[:3]) if keep else ""


def one_line(exc: BaseException) -> str | None:
    """The one-line message for an error a user can cause (or any rank's failure), with its fix;
    None for errors that are bugs (the CLI lets them show their traceback)."""
    if isinstance(exc, RankFailed):
        if exc.error_type is None:
            return str(exc).splitlines()[0]
        name = exc.error_type.rsplit(".", 1)[-1]
        msg = f"{exc.label}: {name}: {_first_line(exc.error_message)}"
        hint = hint_for(exc.error_type, exc.error_message)
        return f"{msg}; {hint}" if hint else msg
    if isinstance(exc, RankTimeout):
        return str(exc)
    if isinstance(exc, (SettingsError, ModelLoadError, FallbackError)):
        hint = hint_for(type(exc).__name__, str(exc))
        return f"{exc}; {hint}" if hint and isinstance(exc, FallbackError) else str(exc)
    if isinstance(exc, OSError) and _MISSING_LIBRARY in str(exc):
        return f"{exc}; {hint_for('OSError', str(exc))}"
    return None


class Sources:
    """Where each settings key's value came from in one command, for its error lines: the
    option that set it (``--chunk``), else the ``CPKV_*`` variable, the ``--config`` file, or
    the default.

    Args:
        options: dotted key -> the command's option that sets it (``runtime.chunk_tokens`` ->
            ``--chunk``).
        overrides: the settings the command line gave (:func:`~cpkv.settings.load_settings`'s
            keyword arguments).
        config: the ``--config`` file, if any.
    """

    def __init__(self, options: Mapping[str, str], overrides: Mapping[str, Any],
                 config: Path | None) -> None:
        self._options = dict(options)
        self._overrides = dict(overrides)
        self._config = config

    def describe(self, key: str, origin: str | None = None) -> str:
        """``key`` with its source: ``--chunk (runtime.chunk_tokens)``, ``transfer.name (in
        c.toml)``, ``transfer.name (CPKV_TRANSFER__NAME)``, or ``key`` alone for a default.
        ``origin`` as :class:`~cpkv.settings.SettingsProblem` words it (default: found
        again)."""
        if origin is None:
            origin = origin_of(key.split("."), self._overrides, self._config)
        if origin == "keyword arguments":
            opt = self._options.get(key)
            return f"{opt} ({key})" if opt else key
        if origin.startswith("environment variable "):
            return f"{key} ({origin.removeprefix('environment variable ')})"
        if origin in ("environment", "defaults"):
            return key
        return f"{key} (in {origin})"

    def line(self, exc: SettingsError) -> str:
        """The error as one line, each wrong value led by its source (:meth:`describe`)."""
        if exc.problems:
            return "; ".join(f"{self.describe(p.key, p.origin)}: {p.message}"
                             for p in exc.problems)
        return self.lead(" ".join(str(exc).split()))

    def lead(self, message: str) -> str:
        """``message`` whose leading settings key (``transfer.name = 'x': ...``) gets its
        source; other messages unchanged."""
        m = _LEADING_KEY.match(message)
        if m is None:
            return message
        return self.describe(m.group(1)) + message[m.end():]


def resolve_model(sources: Sources, model: str) -> Path:
    """:func:`~cpkv.models.resolve_checkpoint` of ``run.model``; a path that is no directory is
    one line naming where it was set (``--model``, the file, the variable) and the fix."""
    from cpkv.models import resolve_checkpoint

    try:
        return resolve_checkpoint(model)
    except ModelLoadError:
        raise ModelLoadError(
            f"{sources.describe('run.model')} = {model!r}: no such directory; name an HF-format "
            f"DeepSeek-V3.2, GLM-5 or DeepSeek-V4 checkpoint directory, or 'tiny' (a small random model), or "
            f"write one there with `cpkv init-model {model}`") from None


def load_for_command(options: Mapping[str, str], overrides: Mapping[str, Any],
                     config: Path | None) -> tuple[Settings, Path, Sources]:
    """A command's settings (``config``, ``CPKV_*``, then ``overrides`` from its options) and the
    checkpoint directory of ``run.model``, with the :class:`Sources` that words its errors.

    Raises:
        click.ClickException: a wrong value, as one line naming where it was set.
    """
    import click

    sources = Sources(options, overrides, config)
    try:
        settings = load_settings(config, **overrides)
    except SettingsError as exc:
        raise click.ClickException(sources.line(exc)) from exc
    try:
        return settings, resolve_model(sources, settings.run.model), sources
    except ModelLoadError as exc:
        raise click.ClickException(str(exc)) from exc
