"""Where a decode step's GPU time goes (one GPU): the kernels of one eager lean step of B requests
of CTX tokens each (the 2-layer ``v32-attention`` stack, fp8 pool), largest first, and (``glue``
in the JSON) the step's torch ops by the cpkv functions that ran them
(:func:`cpkv.bench.gpu.op_sources`: which line's casts, gathers and norms the small kernels are).

Command: bash benchmarks/gpu.sh OUT decode_profile   (64 x 128K; or
         python benchmarks/decode_profile_gpu.py OUT.json [B] [CTX])
Card: one GPU (FlashMLA's wheel carried, or the step runs Triton's sparse MLA).
Writes: OUT.json {kernels: [{total_ms}, {kernel, ms, calls}...], glue}; docs/perf.md "Decode steps".
"""

from __future__ import annotations

import json
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any


def _profile(worker: Any, rids: list[Hashable]) -> dict[str, list[dict[str, Any]]]:
    from cpkv.bench.gpu import kernel_profile, op_sources

    batch = [(rid, 1) for rid in rids]
    for _ in range(3):
        worker.step(batch)
    return {"kernels": kernel_profile(lambda: worker.step(batch), top=None),
            "glue": op_sources(lambda: worker.step(batch), top=80)}


def main() -> None:
    from cpkv.bench.decode import probe_filled_worker

    out = Path(sys.argv[1])
    b = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 131072
    res = probe_filled_worker(_profile, b, ctx)
    out.write_text(json.dumps(res, indent=1))
    for k in res["kernels"][:16]:
        print(f"{k.get('ms', 0):9.3f} ms  x{k.get('calls', '')}  {str(k.get('kernel'))[:90]}")
    for g in res["glue"][:24]:
        print(f"{g['ms']:9.3f} ms  x{g['calls']}  {g['op']:28s} {' < '.join(g['source'])[:100]}")


if __name__ == "__main__":
    main()
