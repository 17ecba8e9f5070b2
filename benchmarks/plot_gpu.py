"""Plots a ``cpkv bench gpu`` report's rows as ratios against their targets.

Command: python benchmarks/plot_gpu.py [REPORT] [--out PNG]   (needs matplotlib)
Card: none (reads a report); REPORT defaults to benchmarks/results/gpu_h200x2.json.
Writes: docs/perf_gpu.png (docs/perf.md "CP2 against CP1").
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
#: the targets: ratios of each row's same-run baseline, or absolute values
#: (VALUE_TARGETS)
TARGETS = {
    "gather_64k_bw": 0.85, "scatter_64k_bw": 0.85, "rerange_64k_bw": 0.85,
    "materialize_64k_bw": 1.1, "materialize_64k_bw_all_gather": 0.95,
    "indexer_logits_32k_speedup": 5.0, "indexer_logits_32k_fp8_speedup": 1.5,
    "sparse_mla_prefill_64k_tflops": 0.97,
    "cp2_vs_cp1_16k_speedup": 1.9, "cp2_vs_cp1_64k_speedup": 1.9, "cp2_vs_cp1_128k_speedup": 1.9,
    "cp1_layer_64k_mfu": 0.5, "decode_step_64k_speedup": 1.0,
}
VALUE_TARGETS: dict[str, float] = {}


def _score(r: dict) -> float:
    if r["name"] in VALUE_TARGETS:
        return r["value"] / VALUE_TARGETS[r["name"]]
    return r["ratio"] / TARGETS[r["name"]]


def main() -> None:
    ap = argparse.ArgumentParser(description="Plot a cpkv bench gpu report against its targets.")
    ap.add_argument("report", type=Path, nargs="?",
                    default=Path(os.environ.get("BENCH_OUT") or ROOT / "benchmarks/results")
                    / "gpu_h200x2.json")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/perf_gpu.png")
    args = ap.parse_args()
    data = json.loads(args.report.read_text())
    rows = [r for r in data["results"] if r["name"] in TARGETS or r["name"] in VALUE_TARGETS]
    names = [r["name"] for r in rows]
    got = [_score(r) for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = ["tab:green" if g >= 1 else "tab:red" for g in got]
    ax.barh(names, got, color=colors)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("measured / target (>= 1 meets the target)")
    ax.set_title("cpkv on 2x H200: each row against its same-run baseline, over its target")
    for y, (g, r) in enumerate(zip(got, rows, strict=True)):
        label = (f"{r['value']:.0f} {r['unit']}" if r["name"] in VALUE_TARGETS
                 else f"{r['ratio']:.3g}x")
        ax.text(g, y, f"  {label}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
