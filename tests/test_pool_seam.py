"""The pool is narrow, and each library module uses only the pool attributes named here.

:class:`~cpkv.kv.ShardedKVPool` keeps the per-batch lifecycle, its identity and its two units
(``pages``: the page table, ``store``: the device bytes). A consumer that needs only a unit gets
that unit (the prefix cache a page table and the store's host loads, the decode receiver and the
lean decoder a page table and a store), so it names no pool attribute at all.

The scan: in each library module, the pool-typed expressions are the name ``pool``, any
``x.pool``, ``ShardedKVPool(...)``, ``pools[...]``, names annotated :class:`ShardedKVPool`
(parameters, assignments) and names assigned from a pool-typed expression; every attribute read
on one of them is a use.
"""

from __future__ import annotations

import ast
from pathlib import Path

from cpkv.comm import CPGroup
from helpers import torch_pool

ROOT = Path(__file__).resolve().parents[1]

#: what the pool offers: the lifecycle, its identity, its units, its footprint
POOL_MEMBERS = frozenset({
    "prepare", "write", "prefetch", "materialize", "commit", "abort",  # per batch
    "fmt", "num_layers", "group",  # identity
    "pages", "store",  # the page table and the device store
    "footprint",  # what it holds (reports)
})

#: library module (relative to the repository root) -> the pool attributes it may use; a module
#: not listed uses none
USES: dict[str, frozenset[str]] = {
    "core/src/cpkv/runtime/prefill.py": frozenset({
        "prepare", "write", "prefetch", "materialize", "commit", "abort", "fmt", "group",
        "pages"}),
    "core/src/cpkv/runtime/session.py": frozenset({"pages", "store", "fmt"}),
    "core/src/cpkv/runtime/decode.py": frozenset({"pages", "store"}),
    "core/src/cpkv/runtime/speculative.py": frozenset({"pages"}),
    "core/src/cpkv/runtime/job/results.py": frozenset({"footprint", "store"}),
    "core/src/cpkv/runtime/job/prefill_rank.py": frozenset({"store"}),
    "core/src/cpkv/runtime/job/decode_rank.py": frozenset({"fmt", "num_layers", "pages", "store"}),
    "core/src/cpkv/disagg/flow.py": frozenset({"fmt", "group", "num_layers", "store"}),
    "core/src/cpkv/disagg/sender.py": frozenset({"group", "store"}),
    "core/src/cpkv/disagg/connect.py": frozenset({"store"}),
    "core/src/cpkv/testing/pool_check.py": frozenset({
        "prepare", "write", "prefetch", "materialize", "commit", "abort", "pages", "store",
        "footprint"}),
    "core/src/cpkv/bench/gpu.py": frozenset({
        "prepare", "prefetch", "materialize", "abort", "store", "footprint"}),
    "core/src/cpkv/bench/long.py": frozenset({"footprint"}),
    "core/src/cpkv/bench/decode.py": frozenset({"fmt", "group", "pages", "store"}),
    # the V4 staging pool: its page table (the receiver's slots) and its store (the raw bytes)
    "core/src/cpkv/runtime/v4_transfer.py": frozenset({"pages", "store"}),
}

#: (module, name): a name ``pool`` there that is no pool, with why
NOT_POOLS: dict[tuple[str, str], str] = {
}

#: modules that receive the units, not the pool (issue 35)
UNIT_CONSUMERS = ("core/src/cpkv/cache/prefix.py", "core/src/cpkv/cache/radix.py",
                  "core/src/cpkv/disagg/receiver.py", "core/src/cpkv/runtime/decoder.py")


def _library_files() -> list[Path]:
    roots = [ROOT / "core" / "src", *ROOT.glob("backends/*/src"), *ROOT.glob("plugins/*/src")]
    return sorted(p for r in roots for p in r.rglob("*.py"))


def _is_pool_annotation(node: ast.expr | None) -> bool:
    if node is None:
        return False
    text = ast.unparse(node)
    return text.strip("'\"").split(".")[-1].split(" ")[0] == "ShardedKVPool"


def _pool_typed(e: ast.expr, names: set[str]) -> bool:
    if isinstance(e, ast.Name):
        return e.id in names
    if isinstance(e, ast.Subscript):
        return isinstance(e.value, ast.Name) and e.value.id.endswith("pools")
    if isinstance(e, ast.Call):
        return ast.unparse(e.func).split(".")[-1] == "ShardedKVPool"
    return isinstance(e, ast.Attribute) and e.attr == "pool"


def _bound_pools(node: ast.AST, names: set[str]) -> list[str]:
    """The names ``node`` binds to a pool (an annotation, or a pool-typed value)."""
    if isinstance(node, ast.arg) and _is_pool_annotation(node.annotation):
        return [node.arg]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and (
            _is_pool_annotation(node.annotation)
            or (node.value is not None and _pool_typed(node.value, names))):
        return [node.target.id]
    if not isinstance(node, ast.Assign):
        return []
    if _pool_typed(node.value, names):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    out = []
    if isinstance(node.value, ast.Tuple):  # a, b = pool, x
        for t in node.targets:
            if isinstance(t, ast.Tuple) and len(t.elts) == len(node.value.elts):
                out += [a.id for a, v in zip(t.elts, node.value.elts, strict=True)
                        if isinstance(a, ast.Name) and _pool_typed(v, names)]
    return out


def pool_uses(source: str, not_pools: frozenset[str] = frozenset()) -> dict[str, set[int]]:
    """Attribute -> lines where it is read on a pool-typed expression (see the module
    docstring); names in ``not_pools`` are never pools."""
    tree = ast.parse(source)
    names = {"pool"} - not_pools
    while True:  # names annotated or assigned from a pool-typed expression, to a fixed point
        new = {n for node in ast.walk(tree) for n in _bound_pools(node, names)} - not_pools
        if new <= names:
            break
        names |= new
    found: dict[str, set[int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _pool_typed(node.value, names):
            found.setdefault(node.attr, set()).add(node.lineno)
    return found


def test_the_scan_sees_pool_uses() -> None:
    src = ("def f(kv: ShardedKVPool, other):\n"
           "    a, b = kv, other\n"
           "    a.pages.free(1)\n"
           "    other.table\n"
           "    self.pool.store.kv\n"
           "    p = session.pool\n"
           "    return p.prepare(x), pool.fmt\n")
    assert pool_uses(src) == {"pages": {3}, "store": {5}, "prepare": {7}, "fmt": {7}}
    assert pool_uses("pool = x\npools[0].kv\nShardedKVPool(f).views\n", frozenset({"pool"})) \
        == {"kv": {2}, "views": {3}}


def test_the_pool_is_narrow() -> None:
    pool = torch_pool(CPGroup.single())
    public = {n for n in dir(pool) if not n.startswith("_")}
    assert public == POOL_MEMBERS, (f"added: {sorted(public - POOL_MEMBERS)}, "
                                    f"gone: {sorted(POOL_MEMBERS - public)}")
    assert len(public) <= 12


def test_each_module_uses_only_its_pool_attributes() -> None:
    files = _library_files()
    assert len(files) > 50, "library sources not found"
    problems, seen = [], set()
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel == "core/src/cpkv/kv/pool.py":
            continue
        used = pool_uses(path.read_text(),
                         frozenset(n for (r, n) in NOT_POOLS if r == rel))
        allowed = USES.get(rel, frozenset())
        if used:
            seen.add(rel)
        for attr in sorted(set(used) - allowed):
            problems.append(f"{rel}:{min(used[attr])}: pool.{attr} (not in its list)")
        for attr in sorted(allowed - set(used)):
            problems.append(f"{rel}: lists pool.{attr} but no longer uses it")
    for rel, allowed in USES.items():
        assert allowed <= POOL_MEMBERS, f"{rel} lists what the pool does not offer"
    assert not problems, "\n".join(problems)
    assert seen == set(USES), f"listed but not found: {sorted(set(USES) - seen)}"


def test_unit_consumers_name_no_pool() -> None:
    """The prefix cache, the decode receiver and the lean decoder get a page table and a store
    (or the store's host loads): no pool attribute, no ``ShardedKVPool``, and cache/ imports no
    kv.pool."""
    for rel in UNIT_CONSUMERS:
        src = (ROOT / rel).read_text()
        assert pool_uses(src) == {}, rel
        tree = ast.parse(src)
        named = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                 for a in n.names}
        assert "ShardedKVPool" not in named, rel
    for path in (ROOT / "core/src/cpkv/cache").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "cpkv.kv.pool" and not (
                    node.module == "cpkv.kv" and any(a.name == "ShardedKVPool" for a in node.names)
                ), path
            if isinstance(node, ast.Import):
                assert all(a.name != "cpkv.kv.pool" for a in node.names), path
