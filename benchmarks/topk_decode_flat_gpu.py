"""The long-row top-k at a decode step's few rows after session 21's changes: the select reads a
row's splits as one run (``_flat_load``: one step over any number of splits, where the loop over
splits made 16 splits 2.4x slower in session 18), the floor from fewer radix rounds
(``FLOOR_ROUNDS``), the filter in larger blocks for few rows (``few_BLOCK``), the select's last
two radix rounds over the keys of the k-th key's 16-bit bin only (``COMPACT``). Configurations one
at a time, then combined, at 64 and 256 rows of ~128K keys in a 256K-column bucket (session 18's
``topk_decode_sweep_gpu.py`` inputs); device ms of the op and each kernel's, exact against
``torch.topk``'s sets. JSON -> OUT (argv[1]); the fastest exact configuration at 64 rows as a
``TRITON_CPKV_TUNING`` value -> argv[2] (for the decode row that follows in the same call).

Predicted (H100, session 20's profile: floor 17.2, filter 32.7, select 36.6 us a layer): the
floor at 2 rounds ~9 us; the filter at 4096-column blocks ~14 us (16 KB in flight a program
where 4 KB kept ~1 TB/s); 16K-column splits with the flat select: the filter ~20, the select
~36; COMPACT: the select ~36 -> ~26 (two of its five passes histogram a few percent of the
candidates; one more pass copies them); the op ~0.088 -> ~0.05 ms.

    python benchmarks/topk_decode_flat_gpu.py OUT.json BEST.env
"""

from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, "benchmarks")
from topk_sweep_gpu import _case

#: session 21's second call (the table: the per-split select, COMPACT 1, few_BLOCK 2048; the
#: first call's configurations, on the flat select since reverted, are in its JSON)
CONFIGS = {
    "table": {},
    "session20": {"COMPACT": 0, "few_BLOCK": 0},
    "compact0": {"COMPACT": 0},
    "block0": {"few_BLOCK": 0},
    "block4k": {"few_BLOCK": 4096},
    "rounds3": {"FLOOR_ROUNDS": 3},
}


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, object] = {"device": torch.cuda.get_device_name(), "configs": CONFIGS}
    t = 1 << 18
    best: tuple[float, str] = (float("inf"), "table")
    for n in (64, 256):
        ke = torch.randint(131072 - 4096, 131073, (n,), generator=g, device="cuda")
        confs = CONFIGS if n == 64 else {k: CONFIGS[k] for k in ("table", "session20")}
        res = _case(f"decode{n}", n, t, ke, confs, g)
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
