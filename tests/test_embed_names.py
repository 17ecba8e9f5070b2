"""Nothing an engine needs is reachable only through private or undocumented names: the example
engine (examples/engine/engine.py) and the engine written from the guide
(tests/test_embed_guide.py) import from ``cpkv`` / ``cpkv.embed`` only names docs/embedding.md
lists, touch no private attribute of another object, and every attribute they use of cpkv's
engine-facing types is listed there too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import cpkv
from cpkv.contracts import CPPlan, RequestPlan
from cpkv.disagg import TransferManifest
from cpkv.embed import (
    DecodeMetadata,
    EngineBatch,
    EngineKV,
    FullView,
    KeyRanges,
    KVBufferSpec,
    LayerKV,
    LogitsRows,
)
from cpkv.models.deepseek_v32 import AttentionInputs

ROOT = Path(__file__).resolve().parents[1]
#: cpkv's types an engine holds: every public attribute it reads must be documented
ENGINE_TYPES = (EngineKV, EngineBatch, KeyRanges, LogitsRows, LayerKV, FullView, KVBufferSpec,
                DecodeMetadata, TransferManifest, cpkv.CPGroup, CPPlan, RequestPlan)
#: the example's model stands in for the engine's own: its API is not cpkv.embed's
MODEL_TYPES = (cpkv.DeepseekV32, AttentionInputs)
#: test harness imports the guide's program may use besides cpkv / cpkv.embed
HARNESS = {("cpkv.runtime.launch", "run_ranks")}


def _public(types: tuple[type, ...]) -> set[str]:
    out: set[str] = set()
    for t in types:
        out |= {n for n in dir(t) if not n.startswith("_")}
        out |= set(getattr(t, "__dataclass_fields__", {}))
        out |= set(getattr(t, "model_fields", {}))
    return out


def doc_names(text: str) -> set[str]:
    """Identifiers in the guide's backtick spans and indented code blocks."""
    spans = re.findall(r"`([^`\n]+)`", text)
    spans += [line for line in text.splitlines() if line.startswith("    ")]
    return {n for s in spans for n in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", s)}


def uses(source: str) -> dict[str, set[str]]:
    """What a program takes from cpkv: imported names, private attributes of other objects,
    attributes of cpkv's engine-facing types (less the program's own and other libraries')."""
    tree = ast.parse(source)
    own: set[str] = set()
    imported: set[str] = set()
    foreign: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cpkv"):
            for a in node.names:
                if (node.module, a.name) in HARNESS:
                    continue
                if node.module not in ("cpkv", "cpkv.embed"):
                    foreign.add(f"{node.module}.{a.name}")
                imported.add(a.name)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)  # dataclass fields of the program's own classes
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
    attrs: set[str] = set()
    private: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = ast.unparse(node.value)
        if base == "cpkv":
            imported.add(node.attr)
        elif node.attr.startswith("_") and base != "self" and not node.attr.startswith("__"):
            private.add(f"{base}.{node.attr}")
        attrs.add(node.attr)
    others = _public(MODEL_TYPES) | set(dir(torch.Tensor)) | set(dir(torch.distributed)) | {
        n for t in (list, dict, tuple, str, set) for n in dir(t)}
    cpkv_attrs = (attrs & _public(ENGINE_TYPES)) - own - others
    return {"imported": imported, "private": private, "foreign": foreign,
            "attributes": cpkv_attrs}


@pytest.mark.parametrize("program", ["examples/engine/engine.py", "tests/test_embed_guide.py"])
def test_engine_uses_only_documented_names(program: str) -> None:
    documented = doc_names((ROOT / "docs" / "embedding.md").read_text())
    used = uses((ROOT / program).read_text())
    assert not used["private"], f"{program} reaches into private names: {used['private']}"
    assert not used["foreign"], f"{program} imports from cpkv's internals: {used['foreign']}"
    missing = (used["imported"] | used["attributes"]) - documented
    assert not missing, f"{program} uses names docs/embedding.md does not list: {sorted(missing)}"
    assert used["attributes"], "the check saw no attribute of cpkv's types (it would pass empty)"


def test_the_check_sees_an_undocumented_name() -> None:
    """The check fails a program that reaches past the guide (a private field, an undocumented
    attribute, an internal module)."""
    bad = ("from cpkv.kv.table import PageTable\n"
           "def f(kv, b):\n    kv._pool.pages.free(1)\n    return b.kv.rows.num_local\n")
    used = uses(bad)
    assert used["private"] == {"kv._pool"} and used["foreign"] == {"cpkv.kv.table.PageTable"}
    documented = doc_names((ROOT / "docs" / "embedding.md").read_text())
    assert "PageTable" not in documented
