"""The long-row top-k at a decode step's few rows (issue 38's ``decode_64x128k_gpu_vs_bytes``):
the ``TOPK_LONG`` few-row launches (``FEW_ROWS``, ``few_floor_warps``, ``few_select_warps``,
``few_SPLIT_MIN``, ``few_CAP``) and ``HELD``, one at a time then combined, at 64 and 256 rows of
~128K keys in a 256K-column bucket; device ms of the op, each kernel's, exact against
``torch.topk``'s sets. JSON -> OUT (argv[1]).

Why: with 64 rows each kernel runs 64 programs, one an SM, and its time is one program's
latency. The floor's 4096-key sample at 4 warps is 32 keys a thread through 4 ballot-based
histograms (ptxas: ~8.5K instructions a thread, 2.5K at 16 warps); the select refines ~3.3K
candidates a row at 4 warps; the filter streams 32K columns a program (8 splits a row, half
of them past a 128K row's end). Predicted (H100, session 16: floor 34, select 46, filter 31 us a
layer): floor at 16 warps ~10 us, select at 16 warps ~25 us, 32 splits of 8K columns ~15 us;
the op ~0.12 -> ~0.05 ms a layer.

    python benchmarks/topk_decode_sweep_gpu.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, "benchmarks")
from topk_sweep_gpu import sweep_case

_FEW = {"FEW_ROWS": 256}
CONFIGS = {
    "table": {},
    "floor8": {**_FEW, "few_floor_warps": 8},
    "floor16": {**_FEW, "few_floor_warps": 16},
    "floor32": {**_FEW, "few_floor_warps": 32},
    "select8": {**_FEW, "few_select_warps": 8},
    "select16": {**_FEW, "few_select_warps": 16},
    "split8k_cap2k": {**_FEW, "few_SPLIT_MIN": 8192, "few_CAP": 2048},
    "split4k_cap2k": {**_FEW, "few_SPLIT_MIN": 4096, "few_CAP": 2048},
    "held4k": {"HELD": 4096},
    "held8k": {"HELD": 8192},
    "f16_s16_8k": {**_FEW, "few_floor_warps": 16, "few_select_warps": 16,
                   "few_SPLIT_MIN": 8192, "few_CAP": 2048},
    "f16_s16_8k_held8k": {**_FEW, "few_floor_warps": 16, "few_select_warps": 16,
                          "few_SPLIT_MIN": 8192, "few_CAP": 2048, "HELD": 8192},
    "f16_s8_8k_held8k": {**_FEW, "few_floor_warps": 16, "few_select_warps": 8,
                         "few_SPLIT_MIN": 8192, "few_CAP": 2048, "HELD": 8192},
    "f16_s16_16k_held8k": {**_FEW, "few_floor_warps": 16, "few_select_warps": 16,
                           "few_SPLIT_MIN": 16384, "few_CAP": 2048, "HELD": 8192},
}


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, object] = {"device": torch.cuda.get_device_name(), "configs": CONFIGS}
    t = 1 << 18
    for n in (64, 256):
        ke = torch.randint(131072 - 4096, 131073, (n,), generator=g, device="cuda")
        confs = CONFIGS if n == 64 else {k: CONFIGS[k] for k in
                                         ("table", "f16_s16_8k", "f16_s16_8k_held8k",
                                          "f16_s8_8k_held8k")}
        out[f"decode_{n}x128k"] = sweep_case(f"decode{n}", n, t, ke, confs, g)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
