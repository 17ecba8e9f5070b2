"""Launch configurations of the paged indexer (``indexer_logits_paged``, Triton) in a decode step
of B requests of CTX tokens each (the 2-layer ``v32-attention`` stack, fp8 pool): the op's GPU
time per configuration on the inputs a real step passed it, against the bytes it must read.

Usage: python benchmarks/indexer_paged_sweep_gpu.py OUT.json [B] [CTX]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

CONFIGS = [{"PAGED_BLOCK_N": bn, "paged_warps": w, "PAGED_ROWS": r}
           for bn in (64, 128, 256, 512) for w in (4, 8) for r in (1, 2)]


def _rank(group: Any, ckpt: str, b: int, ctx: int) -> dict[str, Any]:
    from cpkv.bench.decode import DecodeBenchSpec, filled_worker
    from cpkv.bench.gpu import cuda_ms
    from cpkv.models import load_model

    model = load_model(ckpt, dtype=torch.bfloat16, device=group.device)
    worker, rids = filled_worker(model, DecodeBenchSpec(ckpt, (b,), (ctx,)), b, ctx, False,
                                 group.device)
    ops = worker.session.ops
    op = ops.indexer_logits_paged
    impl = op.__self__.attention_kernels  # the Triton backend's AttentionKernels
    seen: list[tuple[Any, ...]] = []

    def record(*args: Any) -> Any:
        seen.append(args)
        return op(*args)

    ops._impls["indexer_logits_paged"] = record  # the step's calls are recorded
    worker.step([(rid, 1) for rid in rids])
    ops._impls["indexer_logits_paged"] = op
    args = seen[0]
    q, _, _, fmt, table, _, key_end = args
    ref = impl.indexer_logits_paged(*args)
    keys = int(key_end.sum().item())
    need = keys * (q.shape[2] + 4)  # fp8 index-K and its fp32 scale per key
    rows = []
    base = dict(impl.indexer_config)
    for cfg in CONFIGS:
        impl.indexer_config = {**base, **cfg}
        try:
            out = impl.indexer_logits_paged(*args)
            same = bool(torch.equal(out, ref))
            ms = cuda_ms(lambda: impl.indexer_logits_paged(*args))
            rows.append({**cfg, "ms": ms, "GBps": need / ms / 1e6, "equal": same})
        except Exception as exc:  # a configuration out of resources: say so, go on
            rows.append({**cfg, "error": repr(exc)[:200]})
    impl.indexer_config = base
    return {"rows": b, "ctx": ctx, "q": str(q.dtype), "heads": q.shape[1], "dim": q.shape[2],
            "table_width": table.shape[1], "page_size": fmt.page_size, "key_bytes": need,
            "default": {k: base[k] for k in CONFIGS[0]}, "configs": rows}


def main() -> None:
    from cpkv.bench.gpu import v32_stack
    from cpkv.models import write_tiny_checkpoint
    from cpkv.runtime import run_ranks

    out = Path(sys.argv[1])
    b = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 131072
    stack = v32_stack(2, ctx + 4096)
    ckpt = str(write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "stack", seed=0, **stack))
    res = run_ranks(_rank, 1, args=(ckpt, b, ctx), backend="nccl", timeout_s=900)[0].value
    out.write_text(json.dumps(res, indent=1))
    print(f"{b} x {ctx}: q {res['q']}, {res['key_bytes'] / 1e9:.2f} GB of keys")
    for r in sorted(res["configs"], key=lambda r: r.get("ms", 1e9)):
        cfg = f"BN {r['PAGED_BLOCK_N']:3d} warps {r['paged_warps']} rows {r['PAGED_ROWS']}"
        if "ms" in r:
            print(f"{cfg}  {r['ms']:7.3f} ms  {r['GBps']:7.0f} GB/s  equal {r['equal']}")
        else:
            print(f"{cfg}  {r['error']}")


if __name__ == "__main__":
    main()
