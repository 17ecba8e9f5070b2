"""The long-row top-k's kernels at the two shapes issue 38 measures, on one GPU: a prompt chunk's
rows against ~480K keys (1024 rows: `long_512k_topk_share`'s chunk, scaled) and a decode step's
64 rows of 128K keys in a 256K-column bucket (`decode_64x128k`). Per launch configuration of
``TOPK_LONG`` (the tuning row, then variants): device ms of the whole op, each kernel's share
(torch.profiler), exact against the torch reference's sets. Logits are indexer-like (random
64-head fp8 indexer) so the floor's sample sees the real spread. JSON -> OUT (argv[1]).

    python benchmarks/topk_sweep_gpu.py OUT.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import cpkv_backend_triton.topk as T
from cpkv.bench.gpu import kernel_profile
from cpkv.bench.timing import device_ms

K = 2048


def _indexer_logits(n: int, t: int, ke: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """fp32 [n, t] logits of a 64 x 128 fp8 indexer, -inf past each row's end (in blocks of
    rows: one [n, t] output, no bigger temporary)."""
    from cpkv_backend_triton.attention import AttentionKernels

    tri = AttentionKernels()
    k = torch.randn(t, 128, generator=g, device="cuda").to(torch.float8_e4m3fn)
    sc = torch.rand(t, generator=g, device="cuda") + 0.5
    out = torch.empty(n, t, device="cuda")
    for r0 in range(0, n, 256):
        r1 = min(n, r0 + 256)
        q = torch.randn(r1 - r0, 64, 128, generator=g, device="cuda").bfloat16()
        w = torch.randn(r1 - r0, 64, generator=g, device="cuda") * 0.1
        ks = torch.zeros(r1 - r0, dtype=torch.int64, device="cuda")
        out[r0:r1] = tri.indexer_logits(q, w, k, sc, ks, ke[r0:r1])
    return out


def _exact(got: torch.Tensor, x: torch.Tensor, ke: torch.Tensor) -> bool:
    """The same sets as torch.topk (random logits: no ties at the k-th place)."""
    want = torch.topk(x, K, dim=1).indices.sort(1).values
    return bool(torch.equal(got.long().sort(1).values, want)) and bool((got < ke[:, None]).all())


def sweep_case(name: str, n: int, t: int, ke: torch.Tensor, configs: dict[str, dict[str, int]],
          g: torch.Generator) -> dict[str, Any]:
    x = _indexer_logits(n, t, ke, g)
    ks = torch.zeros(n, dtype=torch.int64, device="cuda")
    saved = dict(T.TOPK_LONG)
    res: dict[str, Any] = {"rows": n, "columns": t, "mean_keys": float(ke.float().mean()),
                           "logits_gb": float(ke.sum()) * 4 / 1e9}
    try:
        for label, over in configs.items():
            T.TOPK_LONG = {**saved, **over}  # type: ignore[assignment]
            got = T.topk(x, K, ks, ke)
            ok = _exact(got, x, ke)
            ms = device_ms(lambda: T.topk(x, K, ks, ke), iters=10)
            kern = kernel_profile(lambda: T.topk(x, K, ks, ke), top=None)
            res[label] = {"ms": ms, "exact": ok, "config": over,
                          "kernels": {k["kernel"]: round(k["ms"], 4) for k in kern[1:]}}
            parts = " ".join(f"{k['kernel'].replace('_kernel', '')}={k['ms']:.3f}"
                             for k in kern[1:5])
            print(f"{name:8s} {label:14s} {ms:8.3f} ms exact={ok} {parts}", flush=True)
    finally:
        T.TOPK_LONG = saved  # type: ignore[assignment]
    return res


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "k": K,
                           "table": dict(T.TOPK_LONG)}
    # session 15 (results/session15/topk_sweep_h100.json) measured 16-byte loads from aligned
    # blocks (a layout conversion before the candidates' scatter: the filter 1.34x slower)
    prompt = {"table": {}, "gluon": {"GLUON": 1}, "gluon_block_2048": {"GLUON": 1, "BLOCK": 2048},
              "gluon_warps_8": {"GLUON": 1, "num_warps": 8},
              "block_2048": {"BLOCK": 2048}, "block_4096": {"BLOCK": 4096},
              "warps_8": {"num_warps": 8}, "sample_2048": {"SAMPLE": 2048},
              "programs_2048": {"PROGRAMS": 2048}}
    n, t = 1024, 1 << 19
    ke = torch.arange(t - n + 1, t + 1, device="cuda") - 32768  # rows at 448K-480K keys
    out["prompt_1024x480k"] = sweep_case("prompt", n, t, ke, prompt, g)
    # the row blocks `cpkv bench long` gives the top-k at 512K keys on an H100 (a 9.2 GB logits
    # budget: ~4.4K rows a call): PROGRAMS 2048 made one split a row, 2.08 waves of programs
    n = 4096
    ke = torch.arange(t - n + 1, t + 1, device="cuda") - 32768
    out["prompt_4096x480k"] = sweep_case("prompt4k", n, t, ke, prompt, g)
    # session 14's variants (split_4k/8k, CAP 2K/4K, HELD) measured on an H100 in
    # results/session15/topk_sweep_before_h100.json: none beat the table by more than 7 %
    decode = {"table": {}, "gluon": {"GLUON": 1}, "gluon_block_512": {"GLUON": 1, "BLOCK": 512},
              "split_8k_sel8": {"SPLIT_MIN": 8192, "select_warps": 8},
              "sample_1024": {"SAMPLE": 1024}, "block_2048": {"BLOCK": 2048},
              "sample_2048_sel8": {"SAMPLE": 2048, "select_warps": 8}}
    n, t = 64, 1 << 18
    ke = torch.randint(131072 - 4096, 131073, (n,), generator=g, device="cuda")
    out["decode_64x128k"] = sweep_case("decode", n, t, ke, decode, g)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
