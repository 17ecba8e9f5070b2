"""The ``TOPK_LONG`` tuning row's sweep (the long-row top-k: floor, filter, select): per
launch configuration (the table's row, then variants), at a prompt chunk's rows against ~480K
keys (1024 rows) and a decode step's 64 rows of ~128K keys in a 256K-column bucket: device ms
of the whole op, each kernel's share (torch.profiler), exact against the torch reference's sets.
Logits come from a random 64-head fp8 indexer, so the floor's sample sees the real spread.
``sweep_case`` is shared with topk_long_decode_sweep_gpu.py.

Command: bash benchmarks/gpu.sh OUT topk_long_sweep   (python benchmarks/topk_long_sweep_gpu.py OUT.json)
Card: one GPU.
Writes: OUT.json {device, k, table, <case>: {<config>: {ms, exact, config, kernels}}};
        docs/perf.md "Tuning sweeps".
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch

from cpkv.bench.gpu import kernel_profile
from cpkv.bench.timing import device_ms
from cpkv_backend_triton import tuning
from cpkv_backend_triton.attention import AttentionKernels

K = 2048
#: the Triton backend's ops (``topk``, ``indexer_logits``), launched with the tuning table's
#: row of this process's device, or the row :func:`override` put in force
OPS = AttentionKernels()


def override(op: str, cfg: Mapping[str, int]) -> None:
    """The launch constants of tuning row ``op`` (an ``Op`` name, e.g. ``TOPK_LONG``) for the
    calls that follow, through the backend's own override (``TRITON_CPKV_TUNING``, read again
    after ``tuning.cache_clear()``); an empty ``cfg`` puts the table back."""
    spec = ",".join(f"{op}.{k}={v}" for k, v in cfg.items())
    if spec:
        os.environ[tuning.TUNING_ENV] = spec
    else:
        os.environ.pop(tuning.TUNING_ENV, None)
    tuning.cache_clear()


def _indexer_logits(n: int, t: int, ke: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """fp32 [n, t] logits of a 64 x 128 fp8 indexer, -inf past each row's end (in blocks of
    rows: one [n, t] output, no bigger temporary)."""
    tri = OPS
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
    res: dict[str, Any] = {"rows": n, "columns": t, "mean_keys": float(ke.float().mean()),
                           "logits_gb": float(ke.sum()) * 4 / 1e9}
    try:
        for label, over in configs.items():
            override("TOPK_LONG", over)
            got = OPS.topk(x, K, ks, ke)
            ok = _exact(got, x, ke)
            ms = device_ms(lambda: OPS.topk(x, K, ks, ke), iters=10)
            kern = kernel_profile(lambda: OPS.topk(x, K, ks, ke), top=None)
            res[label] = {"ms": ms, "exact": ok, "config": over,
                          "kernels": {k["kernel"]: round(k["ms"], 4) for k in kern[1:]}}
            parts = " ".join(f"{k['kernel'].replace('_kernel', '')}={k['ms']:.3f}"
                             for k in kern[1:5])
            print(f"{name:8s} {label:14s} {ms:8.3f} ms exact={ok} {parts}", flush=True)
    finally:
        override("TOPK_LONG", {})
    return res


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "k": K,
                           "table": dict(tuning.tuned(tuning.Launch.TOPK_LONG))}
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
