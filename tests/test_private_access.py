"""Library code reads no other object's private state: no ``obj._name`` (one leading underscore,
not a dunder) on anything but ``self`` or ``cls``, in core/src, backends/*/src and plugins/*/src.
A unit that needs another's state gets a public, typed accessor instead."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (file relative to the repository root, attribute): justified exceptions, each with its why
ALLOWED: dict[tuple[str, str], str] = {
    ("core/src/cpkv/bench/timing.py", "_sleep"): "torch.cuda._sleep: torch's only GPU spin "
    "kernel (queued ahead of timed work so events measure GPU time, not launch time)",
    ("core/src/cpkv/bench/gpu.py", "_scaled_mm"): "torch._scaled_mm: torch's fp8 matmul (the "
    "fp8 ceiling the indexer is measured against; no public fp8 GEMM exists)",
    ("core/src/cpkv/contracts/plan.py", "_asdict"): "NamedTuple's public API (the underscore "
    "only avoids field-name clashes)",
    ("core/src/cpkv/_lifetime.py", "_exit"): "os._exit: the documented exit without cleanup "
    "(a rank whose parent is gone)",
    ("core/src/cpkv/runtime/launch.py", "_exit"): "os._exit: a rank process ends without "
    "running the parent's atexit handlers it inherited",
    ("core/src/cpkv/cli/_signals.py", "_exit"): "os._exit: a torchrun rank ends at once on "
    "Ctrl-C, its main thread still in a collective",
}


def _library_files() -> list[Path]:
    roots = [ROOT / "core" / "src", *ROOT.glob("backends/*/src"), *ROOT.glob("plugins/*/src")]
    return sorted(p for r in roots for p in r.rglob("*.py"))


def private_accesses(source: str) -> list[tuple[int, str, str]]:
    """(line, the accessed expression, attribute) of every ``x._name`` whose ``x`` is not the
    bare name ``self`` or ``cls``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node), name))
    return found


def test_the_check_finds_private_access() -> None:
    src = "def f(pool, self):\n    a = pool._refs\n    b = self._mine\n    c = pool.__class__\n"
    assert [(line, attr) for line, _, attr in private_accesses(src)] == [(2, "_refs")]


def test_no_cross_module_private_access() -> None:
    files = _library_files()
    assert len(files) > 50, "library sources not found"
    bad = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for line, expr, attr in private_accesses(path.read_text()):
            if (rel, attr) not in ALLOWED:
                bad.append(f"{rel}:{line}: {expr}")
    assert not bad, "private state read across objects:\n" + "\n".join(bad)
