"""A third-party backend as users write one (``examples/custom_backend``), installed for real with
pip: discovery, selection through a settings file, the conformance suite, and the fallbacks when
it is unavailable or fails to load."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch

from cpkv import fallback
from cpkv.contracts import FallbackReason, Op, PluginInfo
from cpkv.ops import KV_OPS, OpTable
from cpkv.plugin import PluginHost
from cpkv.settings import load_settings
from cpkv.testing.conformance import (
    BasePageOpsTests,
    check_backend,
    check_op,
    reference_backend,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_backend"
OTHER_OPS = [o.value for o in KV_OPS if o.value != "rerange"]

# every test uses the example installed by ``pip install`` in a subprocess (autouse ``example``)
pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="session")
def example_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip install`` the example distribution into a private folder (once per session).

    Built from a copy, so the build leaves no ``build/`` or ``*.egg-info`` in the repository.
    """
    src = tmp_path_factory.mktemp("example_src") / "custom_backend"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                                "__pycache__"))
    site = tmp_path_factory.mktemp("example_site")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
           "--no-index", "--disable-pip-version-check", "--quiet", "--target", str(site), str(src)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"pip install of the example backend took over 300 s: {exc}")
    if res.returncode != 0:
        pytest.fail(f"pip install of the example backend failed ({res.returncode}):\n"
                    f"{res.stdout}\n{res.stderr}")
    assert list(site.glob("cpkv_example_backend-0.1.0.dist-info/entry_points.txt")), \
        sorted(p.name for p in site.iterdir())
    return site


def _forget_example() -> None:
    for mod in [m for m in sys.modules if m.split(".")[0] == "cpkv_example_backend"]:
        del sys.modules[mod]
    importlib.invalidate_caches()


@pytest.fixture(autouse=True)
def example(example_site: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The installed example on ``sys.path`` for one test (importlib.metadata then sees its
    dist-info and entry point); no ``EXAMPLE_BACKEND_*`` variables (``CPKV_*``: conftest.py)."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("EXAMPLE_BACKEND_"):
            monkeypatch.delenv(name)
    _forget_example()
    monkeypatch.syspath_prepend(str(example_site))
    importlib.invalidate_caches()
    yield example_site
    _forget_example()  # sys.path is restored by monkeypatch


@pytest.fixture
def host() -> Iterator[PluginHost]:
    h = PluginHost()
    yield h
    h.close()


def _info(host: PluginHost, name: str) -> PluginInfo:
    (info,) = [i for i in host.infos() if i.name == name]
    return info


def _settings_file(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "cpkv.toml"
    path.write_text('[backend]\nname = "example"\n' + extra)
    return path


def _resolve(tmp_path: Path) -> tuple[OpTable, list[Any], list[dict[str, Any]]]:
    """Select the KV ops with the settings file's preference; the fallback events and logs."""
    settings = load_settings(_settings_file(tmp_path))
    h = PluginHost(disable=settings.plugins.disable, allow=settings.plugins.allow)
    try:
        with fallback.recording(settings.fallback.policy) as rec, \
                structlog.testing.capture_logs() as logs:
            table = OpTable.resolve(h.backends(), settings.backend.effective_preference())
    finally:
        h.close()
    return table, rec.events, [e for e in logs if e["event"] == "cpkv.fallback"]


# ---- discovery -------------------------------------------------------------------------------
def test_discovered_with_its_distribution_and_version(host: PluginHost) -> None:
    info = _info(host, "example")
    assert (info.distribution, info.version) == ("cpkv-example-backend", "0.1.0")
    assert info.entry_point == "cpkv_example_backend.plugin"
    assert info.ops == ("rerange",)
    assert info.availability.available, info.availability
    assert info.description
    # discovery and probing imported the light plugin module, not the op
    assert "cpkv_example_backend.plugin" in sys.modules
    assert "cpkv_example_backend.ops" not in sys.modules


def test_plugin_module_does_not_import_torch(example: Path) -> None:
    code = ("import sys; import cpkv_example_backend.plugin; "
            "assert 'torch' not in sys.modules, 'the plugin module imported torch'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=120, env={**_env(), "PYTHONPATH": str(example)})
    assert res.returncode == 0, res.stderr


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("CPKV_", "EXAMPLE_"))}


# ---- selection from the settings file ---------------------------------------------------------
def test_settings_select_example_for_rerange_and_torch_for_the_rest(tmp_path: Path) -> None:
    settings = load_settings(_settings_file(tmp_path))
    assert settings.backend.effective_preference() == ["example", "cuda", "triton", "torch"]
    table, events, logs = _resolve(tmp_path)
    assert table.chosen == {"rerange": "example", **dict.fromkeys(OTHER_OPS, "torch")}
    assert type(table.rerange.__self__).__name__ == "ExampleOps"
    # one event per (selected backend, reason): every other op stepped from example to torch
    assert [(e.op, e.requested, e.selected, e.reason) for e in events] == [
        ("backend_select", "example", "torch", FallbackReason.OP_NOT_PROVIDED)]
    assert events[0].detail.startswith(f"for {', '.join(OTHER_OPS)}; ")
    for op in OTHER_OPS:
        assert f"example: does not provide {op}" in events[0].detail
    assert [(e["log_level"], e["reason"], e["requested"], e["selected"]) for e in logs] == [
        ("warning", "op_not_provided", "example", "torch")]
    assert logs[0]["detail"] == events[0].detail

    gathered = torch.randn(8, 3, 5)
    perm = torch.tensor([0, 1, 2, 4, 5, 6])
    assert torch.equal(table.rerange(gathered, perm), gathered[perm])


def test_fallback_policy_error_refuses_the_step(tmp_path: Path) -> None:
    settings = load_settings(_settings_file(tmp_path, '[fallback]\npolicy = "error"\n'))
    h = PluginHost()
    try:
        with fallback.recording(settings.fallback.policy), \
                pytest.raises(fallback.FallbackError, match="op_not_provided"):
            OpTable.resolve(h.backends(), settings.backend.effective_preference())
        # asking only for what the example provides needs no fallback
        with fallback.recording(settings.fallback.policy) as rec:
            table = OpTable.resolve(h.backends(), settings.backend.effective_preference(),
                                    ops=[Op.RERANGE])
        assert table.chosen == {"rerange": "example"} and rec.events == []
    finally:
        h.close()


# ---- the conformance suite on a third-party backend -------------------------------------------
def test_example_passes_the_conformance_suite(host: PluginHost) -> None:
    impl = host.backends().load("example")
    ref = reference_backend()
    assert type(ref).__module__ == "cpkv_backend_torch.ops"
    assert check_backend(impl, ref) == ["rerange"]
    assert check_backend(impl, ref, ops=["rerange"]) == ["rerange"]
    with pytest.raises(AssertionError, match="has no method 'page_gather'"):
        check_op(impl, ref, "page_gather")


@pytest.mark.slow  # 5 CPU seconds (a pytest run of the example)
def test_example_tests_subclass_the_conformance_classes(example: Path) -> None:
    """The example's own tests (``examples/custom_backend/tests``) run cpkv's base test classes:
    its op passes, the ops it does not provide are skipped."""
    import os

    path = os.pathsep.join([str(example), *filter(None, [os.environ.get("PYTHONPATH")])])
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          str(EXAMPLE / "tests")], capture_output=True, text=True, check=False,
                         timeout=300, env={**_env(), "PYTHONPATH": path}, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed, 5 skipped" in res.stdout, res.stdout
    assert "does not provide page_gather" in res.stdout


def test_conformance_classes_fail_a_wrong_op() -> None:
    class Reversed:
        def rerange(self, gathered: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
            return gathered[perm.flip(0)]

    class Suite(BasePageOpsTests):  # not collected: the name does not start with Test
        ops = Reversed()  # type: ignore[assignment]  # a one-op backend, not a whole KVOps
        provides = frozenset({Op.RERANGE})

    with pytest.raises(AssertionError, match="rerange"):
        Suite().test_rerange()


# ---- unavailable, broken ----------------------------------------------------------------------
def test_unavailable_example_falls_back_to_torch(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXAMPLE_BACKEND_UNAVAILABLE", "1")
    h = PluginHost()
    try:
        av = _info(h, "example").availability
    finally:
        h.close()
    assert not av.available and av.reason == "EXAMPLE_BACKEND_UNAVAILABLE is set"
    table, events, logs = _resolve(tmp_path)
    assert table.chosen == dict.fromkeys((o.value for o in KV_OPS), "torch")
    # the probe says no before the op is looked at: one plugin_unavailable event for all ops
    assert [(e.requested, e.selected, e.reason) for e in events] == [
        ("example", "torch", FallbackReason.PLUGIN_UNAVAILABLE)]
    assert "rerange" in events[0].detail.split(";")[0]
    assert "example: EXAMPLE_BACKEND_UNAVAILABLE is set" in events[0].detail
    assert [e["reason"] for e in logs] == ["plugin_unavailable"]
    assert "cpkv_example_backend.ops" not in sys.modules  # never loaded


def test_broken_example_falls_back_to_torch(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXAMPLE_BACKEND_BROKEN", "1")
    _forget_example()  # a fresh import of the plugin module, which now raises
    with structlog.testing.capture_logs() as logs:
        h = PluginHost()
    try:
        failed = [e for e in logs if e["event"] == "cpkv.plugin.load_failed"]
        assert [(e["name"], e["group"]) for e in failed] == [("example", "cpkv.backends")]
        assert "EXAMPLE_BACKEND_BROKEN=1" in failed[0]["error"]
        info = _info(h, "example")
        assert (info.distribution, info.version) == ("cpkv-example-backend", "0.1.0")
        assert not info.availability.available
        assert "failed to load" in info.availability.reason
        assert _info(h, "torch").availability.available  # the others still load
    finally:
        h.close()
    table, events, fb_logs = _resolve(tmp_path)
    assert table.chosen == dict.fromkeys((o.value for o in KV_OPS), "torch")
    assert [(e.requested, e.selected, e.reason) for e in events] == [
        ("example", "torch", FallbackReason.PLUGIN_LOAD_FAILED)]
    assert "EXAMPLE_BACKEND_BROKEN=1" in events[0].detail
    assert [e["reason"] for e in fb_logs] == ["plugin_load_failed"]
