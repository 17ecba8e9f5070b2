"""The long-row top-k at a decode step's few rows (issue 38's ``decode_64x128k_gpu_vs_bytes``):
the select's ``COMPACT`` (its last two radix rounds over the keys of the k-th key's 16-bit bin
only), the floor's ``FLOOR_ROUNDS``, the filter's ``few_BLOCK`` for few rows, each against the
table, at 64 and 256 rows of ~128K keys in a 256K-column bucket (session 18's
``topk_decode_sweep_gpu.py`` inputs); device ms of the op and each kernel's, exact against
``torch.topk``'s sets. JSON -> OUT (argv[1]); the fastest exact configuration at 64 rows as a
``TRITON_CPKV_TUNING`` value -> argv[2] (for a decode row that follows in the same call).

Session 21 ran it twice on H100s (docs/perf.md): first as ``topk_decode_flat_gpu.py``, with a
select that read a row's splits as one flat run (1.7x slower, reverted; those configurations
are in ``results/session21/call1/h100/topk_decode_flat.json``), then with the per-split select
and these configurations: the op 0.088 ms with session 20's launches, 0.073 with COMPACT 1,
few_BLOCK 2048 and FLOOR_ROUNDS 3 (the table since).

    python benchmarks/topk_decode_select_gpu.py OUT.json BEST.env
"""

from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, "benchmarks")
from topk_sweep_gpu import sweep_case

#: against the table (COMPACT 1, few_BLOCK 2048, FLOOR_ROUNDS 3 since session 21): session
#: 20's launches and each field back
CONFIGS = {
    "table": {},
    "session20": {"COMPACT": 0, "few_BLOCK": 0, "FLOOR_ROUNDS": 4},
    "compact0": {"COMPACT": 0},
    "block0": {"few_BLOCK": 0},
    "block4k": {"few_BLOCK": 4096},
    "rounds4": {"FLOOR_ROUNDS": 4},
}


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, object] = {"device": torch.cuda.get_device_name(), "configs": CONFIGS}
    t = 1 << 18
    best: tuple[float, str] = (float("inf"), "table")
    for n in (64, 256):
        ke = torch.randint(131072 - 4096, 131073, (n,), generator=g, device="cuda")
        confs = CONFIGS if n == 64 else {k: CONFIGS[k] for k in ("table", "session20")}
        res = sweep_case(f"decode{n}", n, t, ke, confs, g)
        out[f"decode_{n}x128k"] = res
        if n == 64:
            best = min((r["ms"], k) for k, r in res.items()
                       if isinstance(r, dict) and r.get("exact"))
    out["best_64"] = best[1]
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)
    env = ",".join(f"TOPK_LONG.{k}={v}" for k, v in CONFIGS[best[1]].items())
    with open(sys.argv[2], "w") as f:
        f.write(env)
    print(f"best at 64 rows: {best[1]} {best[0]:.4f} ms -> {env!r}")


if __name__ == "__main__":
    main()
