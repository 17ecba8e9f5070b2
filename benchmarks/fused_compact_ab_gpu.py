"""The fused indexer top-k's select with ``COMPACT`` 0 and 1 (its last two radix rounds over the
k-th key's 16-bit bin only, copied into the row's output slots), alternating in one process at
the long-prompt shapes (DeepSeek fp8 numerics, causal tails, k = 2048; the inputs of
``indexer_topk_gpu.py``): device ms of the op, the select kernel's ms (profile), outputs equal.
Predicted: the select ~0.7x (two of its five passes over ~2 % of the candidates, one copy pass
more), the op -3 to -5 % at 8192 x 512K (the select ~39 of the op's ~75 ms of top-k work there
in session 17 was less: ~2 ms a call).

    python benchmarks/fused_compact_ab_gpu.py OUT.json
"""

from __future__ import annotations

import json
import sys
from functools import partial
from typing import Any

import torch

sys.path.insert(0, "benchmarks")
import indexer_topk_gpu as B

from cpkv.bench.gpu import kernel_profile
from cpkv.bench.timing import device_ms


def main() -> None:
    impl = B.A.AttentionKernels()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "cases": []}
    for n, t in ((4096, 262144), (8192, 524288)):
        args = B.inputs(n, t)
        res: dict[str, Any] = {"rows": n, "keys": t}
        got = {}
        for rnd in range(2):
            for c in (0, 1):
                B.use({**B.DEFAULT, "COMPACT": c})
                got[c] = impl.indexer_topk(*args, B.K)
                ms = device_ms(partial(impl.indexer_topk, *args, B.K), iters=5)
                prof = kernel_profile(partial(impl.indexer_topk, *args, B.K), top=8)
                sel = [r["ms"] for r in prof if "_fused_select" in r.get("kernel", "")]
                res[f"compact{c}_{rnd}"] = {"ms": ms, "select_ms": sel[0] if sel else None}
                print(n, t, c, rnd, f"{ms:.3f} ms select {sel}", flush=True)
        res["outputs_equal"] = bool(torch.equal(got[0], got[1]))
        print("outputs equal", res["outputs_equal"], flush=True)
        out["cases"].append(res)
        del args, got
        torch.cuda.empty_cache()
    B.use(B.DEFAULT)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
