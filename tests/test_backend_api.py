"""The declared plugin APIs: the backend API (``cpkv.ops.api``) and the transfer SDK
(``cpkv.disagg.api``) are complete and documented; a backend's op modules import cpkv only
through the first (their ``plugin`` modules use the registration API as well), every module of a
transfer plugin only through the second (their ``plugin`` modules, the light entry points, use the
registration API instead)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cpkv.disagg.api as sdk
import cpkv.ops.api as api

ROOT = Path(__file__).resolve().parents[1]
# the packages (a fresh clone's editable install also leaves *.egg-info folders under src/)
BACKENDS = [p.parent for p in (*sorted((ROOT / "backends").glob("*/src/*/__init__.py")),
                               *sorted((ROOT / "examples").glob("*/src/*/__init__.py")))]
#: the transfer plugins' packages
TRANSFERS = [p.parent for p in sorted((ROOT / "plugins").glob("*/src/*/__init__.py"))]
#: what a backend's ``plugin`` module may import from cpkv (the registration API)
PLUGIN_API = {"cpkv.contracts", "cpkv.plugin"}
#: outside the op API, by design: the reference formulas of rope and of DeepSeek-V4's top-k (the
#: torch reference calls them), and the benches' timing and reference loading (bench modules
#: are tools, not ops)
ALSO = {"cpkv.models.rope", "cpkv.models.v4_topk", "cpkv.bench.timing",
        "cpkv.testing.conformance"}
#: a backend's ``bench`` module (``python -m <backend>.bench``) is a tool beside the ops: it
#: writes cpkv's bench rows and builds op tables to compare, so it may use the bench and
#: registration APIs too; no op module imports it (checked below)
BENCH_TOOL = {"cpkv.bench.gpu", "cpkv.bench.report", *PLUGIN_API}


def _cpkv_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "cpkv":
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "cpkv")
    return found


@pytest.mark.parametrize("mod", [api, sdk], ids=lambda m: m.__name__)
def test_every_name_in_all_exists_and_is_documented(mod: object) -> None:
    names: list[str] = mod.__all__
    assert len(names) == len(set(names))
    doc = mod.__doc__ or ""
    for name in names:
        assert hasattr(mod, name), name
        assert name in doc, f"{mod.__name__}'s docstring does not mention {name}"


@pytest.mark.parametrize("pkg", BACKENDS, ids=lambda p: p.name)
def test_backends_import_cpkv_only_through_the_api(pkg: Path) -> None:
    assert list(pkg.glob("*.py")), pkg
    for path in sorted(pkg.glob("*.py")):
        allowed = {"cpkv.ops.api", *ALSO} | (PLUGIN_API if path.stem == "plugin" else set()) \
            | (BENCH_TOOL if path.stem == "bench" else set())
        extra = _cpkv_imports(path) - allowed
        assert not extra, f"{path.relative_to(ROOT)} imports {sorted(extra)} (not the backend API)"
        if path.stem != "bench":
            tree = ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            assert not any(isinstance(n, ast.ImportFrom) and (
                n.module == f"{pkg.name}.bench" or (n.level and n.module == "bench"))
                for n in tree), f"{path.relative_to(ROOT)} imports the bench tool"


def test_backends_names_from_the_api_are_in_all() -> None:
    """Every name a backend takes from ``cpkv.ops.api`` is declared in its ``__all__``."""
    for pkg in BACKENDS:
        for path in sorted(pkg.glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module == "cpkv.ops.api":
                    names = {a.name for a in node.names}
                    assert names <= set(api.__all__), (path.name, names - set(api.__all__))


@pytest.mark.parametrize("pkg", TRANSFERS, ids=lambda p: p.name)
def test_transfer_plugins_import_cpkv_only_through_the_sdk(pkg: Path) -> None:
    assert list(pkg.glob("*.py")), pkg
    for path in sorted(pkg.glob("*.py")):
        allowed = {"cpkv.disagg.api"} | (PLUGIN_API if path.stem == "plugin" else set())
        extra = _cpkv_imports(path) - allowed
        assert not extra, f"{path.relative_to(ROOT)} imports {sorted(extra)} (not cpkv.disagg.api)"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "cpkv.disagg.api":
                names = {a.name for a in node.names}
                assert names <= set(sdk.__all__), (path.name, names - set(sdk.__all__))


def test_the_transfer_plugins_are_found() -> None:
    assert {p.name for p in TRANSFERS} >= {"cpkv_transfer_nccl", "cpkv_transfer_mooncake"}


def test_the_decode_receiver_is_a_part_sink() -> None:
    """``Link.recv_part`` is handed a :class:`~cpkv.disagg.api.PartSink`: what the core passes
    (the decode receiver) has its one method, with the same parameters."""
    import inspect

    from cpkv.disagg import DecodeReceiver

    want = inspect.signature(sdk.PartSink.place_packed)
    got = inspect.signature(DecodeReceiver.place_packed)
    assert list(got.parameters) == list(want.parameters)
    link = inspect.signature(sdk.Link.recv_part)
    assert link.parameters["sink"].annotation in ("PartSink", sdk.PartSink)
