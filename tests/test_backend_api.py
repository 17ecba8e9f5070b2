"""The declared backend API (``cpkv.ops.api``): complete, documented, and the only cpkv module a
backend's op modules import (their ``plugin`` modules use the registration API as well)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cpkv.ops.api as api

ROOT = Path(__file__).resolve().parents[1]
# the packages (a fresh clone's editable install also leaves *.egg-info folders under src/)
BACKENDS = [p.parent for p in (*sorted((ROOT / "backends").glob("*/src/*/__init__.py")),
                               *sorted((ROOT / "examples").glob("*/src/*/__init__.py")))]
#: what a backend's ``plugin`` module may import from cpkv (the registration API)
PLUGIN_API = {"cpkv.contracts", "cpkv.plugin"}
#: outside the op API, by design: the reference formula of rope (the torch reference calls it),
#: and the benches' timing and reference loading (bench modules are tools, not ops)
ALSO = {"cpkv.models.rope", "cpkv.bench.timing", "cpkv.testing.conformance"}


def _cpkv_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "cpkv":
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "cpkv")
    return found


def test_every_name_in_all_exists_and_is_documented() -> None:
    assert len(api.__all__) == len(set(api.__all__))
    doc = api.__doc__ or ""
    for name in api.__all__:
        assert hasattr(api, name), name
        assert name in doc, f"cpkv.ops.api's docstring does not mention {name}"


@pytest.mark.parametrize("pkg", BACKENDS, ids=lambda p: p.name)
def test_backends_import_cpkv_only_through_the_api(pkg: Path) -> None:
    assert list(pkg.glob("*.py")), pkg
    for path in sorted(pkg.glob("*.py")):
        allowed = {"cpkv.ops.api", *ALSO} | (PLUGIN_API if path.stem == "plugin" else set())
        extra = _cpkv_imports(path) - allowed
        assert not extra, f"{path.relative_to(ROOT)} imports {sorted(extra)} (not the backend API)"


def test_backends_names_from_the_api_are_in_all() -> None:
    """Every name a backend takes from ``cpkv.ops.api`` is declared in its ``__all__``."""
    for pkg in BACKENDS:
        for path in sorted(pkg.glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module == "cpkv.ops.api":
                    names = {a.name for a in node.names}
                    assert names <= set(api.__all__), (path.name, names - set(api.__all__))
