"""Fixtures shared by every test module.

Markers (declared in pyproject.toml): ``gpu``, ``multiprocess`` (spawns rank processes or CLI
subprocesses), ``mooncake`` and ``slow`` (over ~10 s). ``gpu`` is the one GPU skip: a test marked
``@pytest.mark.gpu`` is skipped ("no CUDA device") where torch sees none, and one marked
``@pytest.mark.gpu(2)`` where fewer than 2 are present (:func:`pytest_runtest_setup`).
While developing, run the fast subset with ``python -m pytest -m "not slow"``; CI runs everything.

The duration check (:func:`pytest_runtest_makereport`): a test not marked ``slow`` (nor ``gpu``:
GPU tests run on another machine, at its costs) whose call phase uses more than the ini option
``unmarked_test_limit_s`` (default :data:`UNMARKED_TEST_LIMIT_S`, 30 s) of CPU time fails with
its times, so the fast subset stays fast. CPU time, not wall time: the test process's own
(every thread) plus that of the child processes it started and reaped (rank processes, CLI
subprocesses, their children), so a busy machine, where a correct test waits for a core, does
not fail it, and a test that keeps both cores busy counts twice. A test that mostly waits (a
sleep, a timeout) uses little CPU: it fails when its wall time passes
:data:`WAITING_FACTOR` times the limit instead (waiting is not what load stretches most).
Registered here, not set in pyproject.toml, because pytest runs that collect no module under
tests/, like the example backend's own tests, would reject the unknown key under
``--strict-config``. Mark such a test ``slow`` or make it cheaper (smaller shapes, fewer
hypothesis examples, a shared fixture). ``-o unmarked_test_limit_s=0`` turns the check off.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Generator
from typing import Any

import pytest
from hypothesis import settings

# no deadline: hypothesis' per-example wall-time limit fails correct tests on a busy machine
settings.register_profile("cpkv", deadline=None)
settings.load_profile("cpkv")

# the mooncake engine reads these when it is imported (in the rank processes too, which inherit
# them): quiet glog, and listening ports away from the usual ones
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("MC_MIN_RPC_PORT", "47310")
os.environ.setdefault("MC_MAX_RPC_PORT", "47990")

#: the default of ``unmarked_test_limit_s`` (CPU seconds): over the ~10 s rule for the ``slow``
#: mark with a margin: 3 x for a one-thread test, 1.5 x for one that keeps both of 2 cores busy
#: (20 CPU seconds in 10 s), whose CPU time a loaded machine also stretches a little (caches)
UNMARKED_TEST_LIMIT_S = 30.0

#: a test that waits fails past this many times the limit in wall time (module doc)
WAITING_FACTOR = 4.0

#: the call phase's (CPU seconds, wall seconds), kept by :func:`pytest_runtest_call`
_CALL_COST = pytest.StashKey[tuple[float, float]]()


def cpu_seconds() -> float:
    """CPU time (user + system) of this process, every thread, and of its reaped children."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def over_the_limit(cpu: float, wall: float, limit: float) -> bool:
    """True when a call that used ``cpu`` CPU seconds in ``wall`` seconds is too slow for an
    unmarked test: over ``limit`` CPU seconds, or waiting past :data:`WAITING_FACTOR` x limit."""
    return limit > 0 and (cpu > limit or wall > WAITING_FACTOR * limit)


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


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow_on_arch(*archs): the test's runs on these model "
                            "families (the ``arch`` fixture) are slow; the others stay fast")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` the runs a ``slow_on_arch`` marker names: a test that runs on both model
    families keeps one of them in the fast subset (the other is in CI's full run)."""
    for item in items:
        marker = item.get_closest_marker("slow_on_arch")
        spec = getattr(item, "callspec", None)
        if marker is not None and spec is not None and spec.params.get("arch") in marker.args:
            item.add_marker(pytest.mark.slow)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("unmarked_test_limit_s", "a test not marked slow (nor gpu) whose call uses "
                  "more than this many CPU seconds (its own and its children's) fails "
                  "(0: no check)",
                  default=str(UNMARKED_TEST_LIMIT_S))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """Measure the call's CPU and wall time (:func:`cpu_seconds`) for the duration check."""
    cpu0, wall0 = cpu_seconds(), time.monotonic()
    try:
        yield
    finally:
        item.stash[_CALL_COST] = (cpu_seconds() - cpu0, time.monotonic() - wall0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    """Fail a passing test's call that is too slow for the fast subset (see the module doc)."""
    report = yield
    limit = float(item.config.getini("unmarked_test_limit_s"))
    if (call.when != "call" or not report.passed or limit <= 0
            or item.get_closest_marker("slow") is not None
            or item.get_closest_marker("gpu") is not None):
        return report
    cpu, wall = item.stash.get(_CALL_COST, (0.0, call.duration))
    if over_the_limit(cpu, wall, limit):
        what = (f"used {cpu:.1f} CPU seconds ({wall:.1f} s wall), over the {limit:g} s limit"
                if cpu > limit else f"waited {wall:.1f} s ({cpu:.1f} CPU seconds), over "
                f"{WAITING_FACTOR:g} x the {limit:g} s limit")
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} {what} for a test not marked slow "
                           f"(unmarked_test_limit_s): mark it @pytest.mark.slow or make it cheaper")
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
