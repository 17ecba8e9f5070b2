"""The shape of the code: imports run one way through cpkv's layers, and no modules import each
other (in cpkv-core and in every backend and transfer plugin distribution).

Every import statement counts: at module level, inside functions (lazy imports) and under
``TYPE_CHECKING``: a type-only import upward is still a dependency upward.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "src"

#: bottom up; a module may import its own layer (other packages of it too) and the ones below
LAYERS: tuple[tuple[str, ...], ...] = (
    # _lifetime: rank processes' first import (stdlib only); logs: the logger every layer uses
    # (stdlib logging and structlog); _faults: the test-only fault hooks (stdlib only)
    ("cpkv.contracts", "cpkv._lifetime", "cpkv.logs", "cpkv._faults"),
    ("cpkv.comm",),
    ("cpkv.settings", "cpkv.fallback", "cpkv.models"),
    ("cpkv.plugin", "cpkv.planning"),
    ("cpkv.ops",),
    ("cpkv.kv",),
    ("cpkv.cache", "cpkv.disagg"),
    ("cpkv.runtime", "cpkv.embed"),
    ("cpkv.testing", "cpkv.bench"),
    ("cpkv.cli", "cpkv.__main__"),  # the command and `python -m cpkv`
)
#: the packages whose own modules must form no import cycle
DISTRIBUTIONS = [CORE, *sorted((ROOT / "backends").glob("*/src")),
                 *sorted((ROOT / "plugins").glob("*/src"))]


def _modules(src: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules among ``known`` that module ``name`` imports: ``from x import y`` counts as
    ``x.y`` when that is a module, else as ``x``."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            for a in node.names:
                found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod)
    return found & known


def _graph(src: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same distribution it imports. cpkv's package root is left
    out: it holds only lazy re-exports of the public API (``__getattr__``) and ``__version__``."""
    mods = {n: p for n, p in _modules(src).items() if n != "cpkv"}
    known = set(mods)
    return {name: _imports(name, path, known) - {name} for name, path in mods.items()}


def _layer(module: str) -> int | None:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_core_package_has_a_layer() -> None:
    missing = sorted(m for m in _graph(CORE) if _layer(m) is None)
    assert missing == [], f"modules outside the layer table: {missing}"


def test_imports_run_one_way() -> None:
    graph = _graph(CORE)
    upward = []
    for mod, deps in sorted(graph.items()):
        lm = _layer(mod)
        assert lm is not None
        for dep in sorted(deps):
            ld = _layer(dep)
            if ld is not None and ld > lm:
                upward.append(f"{mod} (layer {lm}) imports {dep} (layer {ld})")
    assert upward == [], "\n".join(upward)


@pytest.mark.parametrize("src", DISTRIBUTIONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_import_cycles(src: Path) -> None:
    assert _cycles(_graph(src)) == []


def test_the_checks_can_fail() -> None:
    """The cycle finder and the layer table see what they must (guards the checks above)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert _layer("cpkv.kv.pool") > _layer("cpkv.comm.group") > _layer("cpkv.contracts")  # type: ignore[operator]
    graph = _graph(CORE)
    assert "cpkv.comm" in graph["cpkv.kv.materialize"]
    assert "cpkv.kv.batch" in graph["cpkv.kv.pool"]


@pytest.mark.multiprocess
def test_importing_the_pool_loads_no_runtime() -> None:
    code = ("import sys, cpkv.kv; "
            "print(sorted(m for m in sys.modules if m.startswith(('cpkv.runtime', 'cpkv.cli'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout
