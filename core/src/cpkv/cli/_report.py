"""What ``cpkv run`` adds around the job: the report's context (settings, version, machine) and
the environment of engines that log on their own."""

from __future__ import annotations

import logging
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from cpkv.bench import machine_description
from cpkv.settings import Settings

__all__ = ["SECRET_WORDS", "engine_log_env", "report_context"]

#: settings keys holding any of these words are left out of a written report
SECRET_WORDS = ("password", "secret", "token_", "credential", "api_key")


def _without_secrets(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _without_secrets(v) for k, v in data.items()
                if not any(w in k.lower() for w in SECRET_WORDS)}
    return data


def report_context(settings: Settings) -> dict[str, object]:
    """``settings`` (the effective values, JSON; keys that could hold secrets left out),
    ``version`` (cpkv-core's) and ``machine`` (CPU, cores, Python, torch, GPUs)."""
    try:
        ver = version("cpkv-core")
    except PackageNotFoundError:
        ver = "unknown"
    return {"settings": _without_secrets(settings.model_dump(mode="json")), "version": ver,
            "machine": machine_description()}


def engine_log_env(level: int) -> None:
    """The log level of engines that log on their own (Mooncake's glog, ``MC_LOG_LEVEL``, read
    when the engine is imported in the rank processes, which inherit this environment), unless
    the user set it: their lines reach the log stream as ``rank.stderr`` events (glog E and W
    lines at info level), so a quiet run still shows none of them."""
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if level <= logging.DEBUG
                          else "WARNING" if level <= logging.INFO else "ERROR")
