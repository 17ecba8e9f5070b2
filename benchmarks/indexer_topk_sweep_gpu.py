"""The ``INDEXER_TOPK`` tuning row's sweep (the fused indexer top-k's select and floor
launches) at 8192 rows x 512K keys (DeepSeek fp8 numerics, causal tails, k = 2048): each kernel's
device ms from a profile of one fused call, by the select's warps and candidates a step, then by
the floor's radix rounds (the output must stay equal to the table's).

Command: bash benchmarks/gpu.sh OUT indexer_topk_sweep
         (python benchmarks/indexer_topk_sweep_gpu.py OUT.json)
Card: one GPU with fp8 tensor cores.
Writes: OUT.json, a list of {select_warps, SELECT_BLOCK | FLOOR_ROUNDS, equal, <kernel>: ms};
        docs/perf.md "Tuning sweeps".
"""

from __future__ import annotations

import json
import sys
from functools import partial
from typing import Any

import torch

from cpkv.bench.gpu import kernel_profile

sys.path.insert(0, "benchmarks")
from indexer_topk_gpu import DEFAULT, OPS, K, inputs, use


def main() -> None:
    impl = OPS
    base = DEFAULT  # the table's row, the fused path on from 192K keys
    use(base)
    q8, w8, k8, sc, ks, ke = inputs(8192, 524288, seed=3)
    want = impl.indexer_topk(q8, w8, k8, sc, ks, ke, K)
    rows: list[dict[str, Any]] = []
    for warps in (2, 4, 8):
        for block in (512, 1024, 2048):
            use({**base, "select_warps": warps, "SELECT_BLOCK": block})
            got = impl.indexer_topk(q8, w8, k8, sc, ks, ke, K)
            prof = kernel_profile(partial(impl.indexer_topk, q8, w8, k8, sc, ks, ke, K), top=8)
            ms = {r["kernel"]: r["ms"] for r in prof if "kernel" in r}
            r = {"select_warps": warps, "SELECT_BLOCK": block, "equal": bool(torch.equal(got, want)),
                 **{k: v for k, v in ms.items() if k.startswith("_")}}
            print(json.dumps(r), flush=True)
            rows.append(r)
    for rounds in (4, 3):
        use({**base, "FLOOR_ROUNDS": rounds})
        got = impl.indexer_topk(q8, w8, k8, sc, ks, ke, K)
        prof = kernel_profile(partial(impl.indexer_topk, q8, w8, k8, sc, ks, ke, K), top=8)
        ms = {r["kernel"]: r["ms"] for r in prof if "kernel" in r}
        r = {"FLOOR_ROUNDS": rounds, "equal": bool(torch.equal(got, want)),
             **{k: v for k, v in ms.items() if k.startswith("_")}}
        print(json.dumps(r), flush=True)
        rows.append(r)
    use(base)
    with open(sys.argv[1], "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
