"""The ``TOPK_LONG`` row's few-row fields (a decode step's rows: ``COMPACT``, ``few_BLOCK``,
``FLOOR_ROUNDS``), each against the table, at 64 and 256 rows of ~128K keys in a 256K-column
bucket: device ms of the op and each kernel's, exact against ``torch.topk``'s sets. The fastest
exact configuration at 64 rows goes to BEST.env as a ``TRITON_CPKV_TUNING`` value (for a decode
row run after it).

Command: bash benchmarks/gpu.sh OUT topk_long_decode_sweep
         (python benchmarks/topk_long_decode_sweep_gpu.py OUT.json BEST.env)
Card: one GPU.
Writes: OUT.json {device, configs, decode_<n>x128k: {<config>: {ms, exact, kernels}}}, BEST.env;
        docs/perf.md "Tuning sweeps".
"""

from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, "benchmarks")
from topk_long_sweep_gpu import sweep_case

#: against the table (COMPACT 1, few_BLOCK 2048, FLOOR_ROUNDS 3): the launches before those
#: fields, and each field back
CONFIGS = {
    "table": {},
    "before": {"COMPACT": 0, "few_BLOCK": 0, "FLOOR_ROUNDS": 4},
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
        confs = CONFIGS if n == 64 else {k: CONFIGS[k] for k in ("table", "before")}
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
