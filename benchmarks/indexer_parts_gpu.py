"""The prefill indexer's head sum, ``ABS_PARTS`` 0 (``w * relu(s)``) against 2 and 3 (the signed
half as fp8 parts of the rows' weighted query sum, :mod:`cpkv_backend_triton.indexer_tile`), each
against DeepGEMM in the same process: ``indexer_fp8_vs_deepgemm`` (the issue-38 row, geometric
mean over its four shapes) and the fused indexer + top-k at a long prompt's chunk (4096 rows x
512K keys, the path ``long_1m_fp8_mfu`` takes), its set against the plain path's.

Usage (one GPU, .whl carried, DeepGEMM built: benchmarks/gpu_setup.sh OUT deepgemm):
    [PARTS="0 3 2"] python benchmarks/indexer_parts_gpu.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys

import torch

import cpkv_backend_triton.attention as attention
from cpkv.bench.gpu import ceilings
from cpkv.bench.timing import device_ms
from cpkv_backend_cuda.bench import PREFILL_SHAPES, _triton, prefill_rows
from cpkv_backend_cuda.plugin import deepgemm_ops


def _fused(tri: object, dev: torch.device, n: int = 4096, t: int = 524288
           ) -> tuple[dict[str, float], torch.Tensor]:
    from cpkv.ops.api import hadamard_rotate, quantize_fp8, quantize_index_q

    g = torch.Generator(device=dev).manual_seed(5)
    k8, scale = quantize_fp8(hadamard_rotate(torch.randn(t, 128, dtype=torch.bfloat16,
                                                         device=dev, generator=g)), None, "ue8m0")
    q = hadamard_rotate(torch.randn(n, 64, 128, dtype=torch.bfloat16, device=dev, generator=g))
    w = torch.randn(n, 64, device=dev, generator=g) * (64 ** -0.5 * 128 ** -0.5)
    q8, w8 = quantize_index_q(q, w)
    ks = torch.zeros(n, dtype=torch.int64, device=dev)
    ke = torch.arange(t - n + 1, t + 1, dtype=torch.int64, device=dev)

    def run() -> torch.Tensor:
        return tri.indexer_topk(q8, w8, k8, scale, ks, ke, 2048)  # type: ignore[attr-defined]

    got = run()
    ms = device_ms(run, iters=5)
    return {"ms": ms, "tflops": 2 * 64 * 128 * float((ke - ks).sum()) / ms / 1e9,
            "first_row_cols": int(got[0].ne(-1).sum())}, got


def main() -> None:
    dev = torch.device("cuda", 0)
    dg = deepgemm_ops()
    ceil = ceilings(dev)
    base = dict(attention.INDEXER_DEFAULT)
    out: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "ceilings": ceil}
    picks: dict[int, torch.Tensor] = {}
    for parts in (int(p) for p in os.environ.get("PARTS", "0 3 2").split()):
        # read at each AttentionKernels(): the backend loaded next takes it
        attention.INDEXER_DEFAULT = {**base, "ABS_PARTS": parts}  # type: ignore[assignment]
        tri = _triton()
        detail: dict[str, object] = {}
        rows = prefill_rows(dg, tri, dev, ceil, detail, PREFILL_SHAPES)
        fused, got = _fused(tri, dev)
        picks[parts] = got.sort(1).values.cpu()
        if parts and 0 in picks:
            same = (picks[parts] == picks[0]).float().mean().item()
            fused["set_same_as_parts0"] = same
        res = {"rows": {r.name: r.ratio for r in rows}, "detail": detail, "fused_4kx512k": fused}
        out[f"parts{parts}"] = res
        print(parts, json.dumps({"rows": res["rows"], "fused": fused}), flush=True)
        torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
