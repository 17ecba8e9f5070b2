"""The decode step's KV write, ``fp8_store`` (one Triton pass a part, the index-K rotated in it)
against session 19's sequence (the index-K's rotation as a GEMM, ``fp8_pack`` per part, the
page / offset arithmetic and ``index_put_``), in one process on one GPU: the step's kernels
(eager, device time summed) and the graph step's time, each variant twice, alternating.

Usage: python benchmarks/decode_write_ab_gpu.py OUT.json [B] [CTX]
"""

from __future__ import annotations

import json
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch

from cpkv.kv.store import KVStore
from cpkv.ops import hadamard_rotate

NEW = KVStore.write_rows


def _old(self: KVStore, layer: int, rows: torch.Tensor, latent: torch.Tensor,
         index_k: torch.Tensor | None, rotate: bool = False) -> None:
    """Session 19's write: the index-K's rotation as torch ops, ``fp8_pack`` a part, then the
    buffers' row write (any layout: two_part's values and scales apart)."""
    from cpkv.kv.buffers import write_rows

    lat_b, idx_b = self._pack(layer, latent, hadamard_rotate(index_k)
                              if rotate and index_k is not None else index_k)
    write_rows(self.spec, layer, rows, lat_b, idx_b if idx_b.shape[1] else None)


def _measure(worker: Any, rids: list[Hashable]) -> dict[str, Any]:
    from cpkv.bench.gpu import kernel_profile
    from cpkv.bench.timing import device_ms

    batch = [(rid, 1) for rid in rids]
    res: dict[str, Any] = {}
    for rnd in range(2):
        for name, fn in (("fp8_store", NEW), ("pack_index_put", _old)):
            KVStore.write_rows = fn  # type: ignore[method-assign]
            for _ in range(3):
                worker.step(batch)
            prof = kernel_profile(lambda: worker.step(batch), top=None)
            step = device_ms(lambda: worker.step(batch), iters=30)
            kernels = sum(int(k.get("calls", 0)) for k in prof[1:])
            res[f"{name}_{rnd}"] = {"kernels_ms": prof[0].get("total_ms"), "kernels": kernels,
                                    "step_ms": step, "top": prof[1:30]}
            print(name, rnd, prof[0], kernels, f"step {step:.4f} ms", flush=True)
    KVStore.write_rows = NEW  # type: ignore[method-assign]
    return res


def main() -> None:
    from cpkv.bench.decode import probe_filled_worker

    out = Path(sys.argv[1])
    b = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 131072
    out.write_text(json.dumps(probe_filled_worker(_measure, b, ctx), indent=1))


if __name__ == "__main__":
    main()
