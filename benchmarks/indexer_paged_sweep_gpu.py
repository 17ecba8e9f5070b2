"""Launch configurations of the paged indexer (``indexer_logits_paged``, Triton) in a decode step
of B requests of CTX tokens each (the 2-layer ``v32-attention`` stack, fp8 pool): the op's GPU
time per configuration over the decode pool's pages and the requests' block tables (random
queries and head weights of the model's shapes), against the bytes it must read.

Usage: python benchmarks/indexer_paged_sweep_gpu.py OUT.json [B] [CTX]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch

CONFIGS = [{"PAGED_BLOCK_N": bn, "paged_warps": w, "PAGED_ROWS": r}
           for bn in (64, 128, 256, 512) for w in (4, 8) for r in (1, 2)]


def _inputs(worker: Any, rids: list[Hashable]) -> tuple[Any, ...]:
    """The op's arguments for one step's layer 0: queries and head weights drawn at random, the
    pool's pages, each request's block table (padded to a power of two, as the decoder's)."""
    pool, cfg = worker.pool, worker.decoder.model.config
    dev, b = pool.group.device, len(rids)
    slots = [pool.pages.requests[rid].slots for rid in rids]
    width = 1 << (max(map(len, slots)) - 1).bit_length()
    table = torch.zeros(b, width, dtype=torch.int32)
    for i, s in enumerate(slots):
        table[i, :len(s)] = torch.tensor(s, dtype=torch.int32)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, cfg.index_n_heads, cfg.index_head_dim, generator=g, device=dev,
                    dtype=torch.bfloat16)
    w = torch.rand(b, cfg.index_n_heads, generator=g, device=dev)
    key_end = torch.tensor([pool.pages.requests[rid].valid_len for rid in rids], dtype=torch.int64,
                           device=dev)
    return (q, w, pool.store.kv[0], pool.fmt, table.to(dev),
            torch.arange(b, dtype=torch.int32, device=dev), key_end)


def _sweep(worker: Any, rids: list[Hashable]) -> dict[str, Any]:
    from cpkv.bench.gpu import cuda_ms

    impl = worker.session.ops.indexer_logits_paged.__self__  # Triton's AttentionKernels
    args = _inputs(worker, rids)
    q, _, _, fmt, table, _, key_end = args
    ref = impl.indexer_logits_paged(*args)
    need = int(key_end.sum().item()) * (q.shape[2] + 4)  # fp8 index-K and its fp32 scale a key
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
    return {"rows": len(rids), "q": str(q.dtype), "heads": q.shape[1], "dim": q.shape[2],
            "table_width": table.shape[1], "page_size": fmt.page_size, "key_bytes": need,
            "default": {k: base[k] for k in CONFIGS[0]}, "configs": rows}


def main() -> None:
    from cpkv.bench.decode import probe_filled_worker

    out = Path(sys.argv[1])
    b = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 131072
    res = {"ctx": ctx, **probe_filled_worker(_sweep, b, ctx)}
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
