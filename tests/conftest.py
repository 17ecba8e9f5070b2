"""Fixtures shared by every test module.

Markers (declared in pyproject.toml): ``gpu``, ``multiprocess`` (spawns rank processes or CLI
subprocesses), ``mooncake`` and ``slow`` (over ~10 s). ``gpu`` is the one GPU skip: a test marked
``@pytest.mark.gpu`` is skipped ("no CUDA device") where torch sees none, and one marked
``@pytest.mark.gpu(2)`` where fewer than 2 are present (:func:`pytest_runtest_setup`).
While developing, run the fast subset with ``python -m pytest -m "not slow"``; CI runs everything.
"""

from __future__ import annotations

import os
from typing import Any

import pytest


@pytest.fixture(autouse=True)
def _structlog_config_restored() -> Any:
    """structlog's configuration as it was before each test: a test that runs the CLI in-process
    (click's CliRunner) configures logging for the command (a filtering logger at warning level),
    and later tests' ``capture_logs()`` would lose their info events."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a ``gpu``-marked test, with a reason, where fewer CUDA devices are present than its
    marker asks for (``gpu``: 1, ``gpu(n)``: n)."""
    marker = item.get_closest_marker("gpu")
    if marker is None:
        return
    import torch  # here, not at the top: only gpu-marked tests pay for it at setup

    need = int(marker.args[0]) if marker.args else 1
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < need:
        pytest.skip("no CUDA device" if have == 0 else f"needs {need} GPUs, {have} present")


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
