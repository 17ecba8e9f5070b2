"""Errors a user can cause, as one line with the fix (the CLI prints it once, exit 1).

A rank's error reaches the parent as :class:`~cpkv.runtime.RankFailed` with its type's qualified
name and message; the ones a user can cause get a hint naming the setting or the fix. The
traceback is for ``-v`` / ``--debug``.
"""

from __future__ import annotations

from cpkv.fallback import FallbackError
from cpkv.models import ModelLoadError
from cpkv.runtime import RankFailed, RankTimeout
from cpkv.settings import SettingsError

__all__ = ["hint_for", "one_line"]

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
