"""Where a decode step's GPU time goes (one GPU): the kernels of one eager lean step of B requests
of CTX tokens each (the 2-layer ``v32-attention`` stack, fp8 pool), largest first.

Usage: python benchmarks/decode_profile_gpu.py OUT.json [B] [CTX]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def _rank(group: Any, ckpt: str, b: int, ctx: int) -> list[dict[str, Any]]:
    from cpkv.bench.decode import DecodeBenchSpec, filled_worker
    from cpkv.bench.gpu import kernel_profile
    from cpkv.models import load_model

    model = load_model(ckpt, dtype=torch.bfloat16, device=group.device)
    worker, rids = filled_worker(model, DecodeBenchSpec(ckpt, (b,), (ctx,)), b, ctx, False,
                                 group.device)
    batch = [(rid, 1) for rid in rids]
    for _ in range(3):
        worker.step(batch)
    return kernel_profile(lambda: worker.step(batch), top=None)


def main() -> None:
    from cpkv.bench.gpu import v32_stack
    from cpkv.models import write_tiny_checkpoint
    from cpkv.runtime import run_ranks

    out = Path(sys.argv[1])
    b = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 131072
    stack = v32_stack(2, ctx + 4096)
    ckpt = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "stack", seed=0, **stack))
    kern = run_ranks(_rank, 1, args=(ckpt, b, ctx), backend="nccl", timeout_s=900)[0].value
    out.write_text(json.dumps(kern, indent=1))
    for k in kern[:16]:
        print(f"{k.get('ms', 0):9.3f} ms  x{k.get('calls', '')}  {str(k.get('kernel'))[:90]}")


if __name__ == "__main__":
    main()
