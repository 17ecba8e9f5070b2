"""One op list: :class:`~cpkv.contracts.Op` and the :class:`~cpkv.contracts.KVOps` Protocol name
the same ops, each method documents itself, and a type checker sees a call of an op the Protocol
does not declare (the op table is typed as ``KVOps``, with no catch-all ``__getattr__`` for it)."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cpkv.contracts import KVOps, Op
from cpkv.ops import ALL_OPS, OpTable

ROOT = Path(__file__).resolve().parents[1]


def _protocol_methods() -> set[str]:
    return {n for n, v in vars(KVOps).items() if inspect.isfunction(v) and not n.startswith("_")}


def test_kvops_declares_exactly_the_ops_of_op() -> None:
    assert _protocol_methods() == {o.value for o in Op}
    assert set(ALL_OPS) == set(Op)


@pytest.mark.parametrize("op", list(Op), ids=str)
def test_every_op_method_documents_its_shapes_and_errors(op: Op) -> None:
    doc = " ".join((inspect.getdoc(getattr(KVOps, op.value)) or "").split())
    assert "[" in doc, f"KVOps.{op.value}'s docstring gives no shapes"
    assert "Raises:" in doc or "Nothing is checked" in doc, \
        f"KVOps.{op.value}'s docstring does not say what it raises"


def test_has_names_the_resolved_ops_only() -> None:
    table = OpTable({"rerange": lambda g, p: g}, {"rerange": "mine"})
    assert table.has(Op.RERANGE) and not table.has(Op.ROPE)
    with pytest.raises(AttributeError, match="no backend was selected for op 'rope'"):
        _ = table.rope


def test_the_core_finds_no_op_by_name() -> None:
    """An optional op is asked for with ``OpTable.has``, never looked up by its name string
    (``getattr(ops, Op.ROPE.value, None)`` is invisible to a type checker)."""
    hits = []
    for path in sorted((ROOT / "core" / "src" / "cpkv").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "getattr" and len(node.args) >= 2 \
                    and "Op." in ast.unparse(node.args[1]):
                hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not hits, hits


# mypy on the core's sources only, torch skipped (its stubs are most of a cold run's time; the
# ops' tensor types become Any, which does not matter for which attributes exist)
_MYPY_INI = """\
[mypy]
python_version = 3.11
follow_imports = silent
[mypy-torch.*]
follow_imports = skip
follow_imports_for_stubs = True
"""


def _mypy(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "mypy.ini").write_text(_MYPY_INI)
    (tmp_path / "use_ops.py").write_text(textwrap.dedent(source))
    env = {"MYPYPATH": str(ROOT / "core" / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini",
                           "--cache-dir", str(tmp_path / "cache"), "use_ops.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.multiprocess
@pytest.mark.slow  # 8 CPU seconds (a mypy run)
def test_mypy_reports_a_call_of_an_undeclared_op(tmp_path: Path) -> None:
    done = _mypy(tmp_path, """\
        from cpkv.contracts import Op
        from cpkv.ops import OpTable


        def use(table: OpTable) -> None:
            if table.has(Op.ROPE):
                table.rope(table.page_gather(1, 2), 3, 4, "half")
            table.rerange(1, 2)
            table.page_copy_twice(1, 2)
            table.rope(1, 2, 3, "sideways")
        """)
    errors = [ln for ln in done.stdout.splitlines() if ": error:" in ln]
    assert len(errors) == 2, done.stdout + done.stderr
    assert 'use_ops.py:9: error: "OpTable" has no attribute "page_copy_twice"' in errors[0]
    assert 'use_ops.py:10: error: Argument 4 to "rope"' in errors[1] and "sideways" in errors[1]


def test_op_methods_hand_out_the_given_callables() -> None:
    from cpkv.ops.api import OpMethods

    def rerange(gathered: object, perm: object) -> object:
        return gathered

    obj = OpMethods({Op.RERANGE: rerange})
    assert obj.rerange is rerange and obj.provided == {Op.RERANGE}
    assert not hasattr(obj, "rope")
    with pytest.raises(AttributeError, match="has no op 'rope': not provided"):
        _ = obj.rope
    with pytest.raises(TypeError, match="topk is 3, not a callable"):
        OpMethods({Op.TOPK: 3})
