"""Fixtures shared by every test module.

Markers (declared in pyproject.toml): ``gpu``, ``multiprocess`` (spawns rank processes or CLI
subprocesses), ``mooncake`` and ``slow`` (over ~10 s). ``gpu`` is the one GPU skip: a test marked
``@pytest.mark.gpu`` is skipped ("no CUDA device") where torch sees none, and one marked
``@pytest.mark.gpu(2)`` where fewer than 2 are present (:func:`pytest_runtest_setup`).
While developing, run the fast subset with ``python -m pytest -m "not slow"``; CI runs everything.

The duration check (:func:`pytest_runtest_makereport`): a test not marked ``slow`` (nor ``gpu``:
GPU tests run on another machine, at its costs) whose call phase takes longer than the ini option
``unmarked_test_limit_s`` (default :data:`UNMARKED_TEST_LIMIT_S`, 20 s: twice the ~10 s rule, a
margin for a loaded CI machine; registered here, not set in pyproject.toml, because pytest runs
that collect no module under tests/, like the example backend's own tests, would reject the
unknown key under ``--strict-config``) fails with the duration, so the fast subset stays fast.
Mark such a test ``slow`` or make it cheaper (smaller shapes, fewer hypothesis examples, a shared
fixture). ``-o unmarked_test_limit_s=0`` turns the check off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator
from typing import Any

import pytest

#: the default of ``unmarked_test_limit_s`` (seconds): twice the ~10 s rule for the ``slow`` mark
UNMARKED_TEST_LIMIT_S = 20.0


def _import_triton_for_the_interpreter() -> None:
    """Without CUDA, import triton first under ``TRITON_INTERPRET=1`` (restored after): its
    standard library (``tl.sort``, ``tl.cumsum``, ...) is made by ``@triton.jit`` at import,
    and an interpreted kernel can call it only if it was made under the interpreter. A test
    module that imported triton plainly before the first :func:`triton_interp.import_kernels`
    broke the interpreted top-k ("Cannot call @triton.jit'd outside of the scope of a
    kernel"): the suite passed only in alphabetical order. Nothing where triton or this
    folder's ``triton_interp`` is absent (a copy of this file alone: test_duration_check)."""
    try:
        from triton_interp import interpreter_env
    except ImportError:
        return
    with interpreter_env(), contextlib.suppress(ImportError):
        import triton  # noqa: F401


_import_triton_for_the_interpreter()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("unmarked_test_limit_s", "a test not marked slow (nor gpu) whose call takes "
                  "longer than this many seconds fails (0: no check)",
                  default=str(UNMARKED_TEST_LIMIT_S))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """Fail a passing test's call that is too slow for the fast subset (see the module doc)."""
    report = yield
    limit = float(item.config.getini("unmarked_test_limit_s"))
    if (call.when == "call" and report.passed and limit > 0 and call.duration > limit
            and item.get_closest_marker("slow") is None and item.get_closest_marker("gpu") is None):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {call.duration:.1f} s, over the "
                           f"{limit:g} s limit for a test not marked slow (unmarked_test_limit_s): "
                           f"mark it @pytest.mark.slow or make it cheaper")
    return report


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


#: the model families the tests whose fixture is a model run on (docs/models.md): DeepSeek-V3.2,
#: and GLM-5 with shared-indexer layers (``cpkv.models.tiny.ARCHS``)
ARCH_NAMES = ("v32", "glm5")


@pytest.fixture(scope="session", params=ARCH_NAMES)
def arch(request: pytest.FixtureRequest) -> str:
    """The tiny model's architecture (``write_tiny_checkpoint(..., **ARCHS[arch])``): a module's
    model fixture that takes it runs each of its tests on both families."""
    return str(request.param)


@pytest.fixture(scope="module")
def triton_interpreter() -> Any:
    """``TRITON_INTERPRET=1`` (without CUDA) for one Triton kernel module's tests, which name it
    in ``pytestmark``: the interpreter also reads it at launch (``triton_interp``)."""
    from triton_interp import interpreter_env

    with interpreter_env():
        yield


@pytest.fixture(scope="module")
def ref() -> Any:
    """The torch reference backend, loaded through the plugin registry (one per module).

    Imported here, not at the top: a conftest import error would stop every module."""
    from cpkv.testing.conformance import reference_backend

    return reference_backend()
