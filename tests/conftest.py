"""Fixtures shared by every test module.

Markers (declared in pyproject.toml): ``gpu``, ``multiprocess`` (spawns rank processes or CLI
subprocesses), ``mooncake`` and ``slow`` (over ~10 s). While developing, run the fast subset with
``python -m pytest -m "not slow"``; CI runs everything.
"""

from __future__ import annotations

import os
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _no_cpkv_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read ``CPKV_*`` variables (case-insensitively): none from the caller's
    environment leaks into a test, nor into the subprocesses it starts from ``os.environ``."""
    for name in list(os.environ):
        if name.upper().startswith("CPKV_"):
            monkeypatch.delenv(name)


@pytest.fixture(scope="module")
def ref() -> Any:
    """The torch reference backend, loaded through the plugin registry (one per module).

    Imported here, not at the top: a conftest import error would stop every module."""
    from cpkv.testing.conformance import reference_backend

    return reference_backend()
