"""Run a module with some Triton tuning values overridden, for a tuning session on a GPU before
a value goes into ``cpkv_backend_triton.tuning.TABLE`` (every row of the op changes).

Usage: python benchmarks/with_tuning.py OP.FIELD=VALUE[,OP.FIELD=VALUE...] MODULE [ARGS...]
e.g.   python benchmarks/with_tuning.py INDEXER.ASYNC=1 cpkv_backend_cuda.bench --out x.json
OP is a ``tuning.Op`` member name (INDEXER, SPARSE_MLA, TOPK, TOPK_LONG, ...).
"""

from __future__ import annotations

import dataclasses
import runpy
import sys

from cpkv_backend_triton import tuning


def override(spec: str) -> None:
    """Apply ``OP.FIELD=VALUE,...`` to every row of each named op (then forget cached lookups)."""
    changes: dict[tuning.Op, dict[str, int]] = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        op_name, _, field = key.partition(".")
        changes.setdefault(tuning.Op[op_name], {})[field] = int(value)
    rows = []
    for r in tuning.TABLE:
        if r.op in changes:
            r = dataclasses.replace(r, params=dataclasses.replace(r.params, **changes[r.op]))
        rows.append(r)
    tuning.TABLE = tuple(rows)
    tuning.cache_clear()
    print(f"tuning overridden: {spec}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    override(sys.argv[1])
    mod = sys.argv[2]
    sys.argv = [mod, *sys.argv[3:]]
    runpy.run_module(mod, run_name="__main__", alter_sys=True)
