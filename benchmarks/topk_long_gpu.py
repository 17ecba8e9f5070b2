"""Top-k at long rows on one GPU: the one-read path (floor, filter, select) against the two-read
path (bracket, histogram, compaction) and the torch reference, on indexer logits of random
q/k (the v32-attention shapes: 64 heads x 128 dims, fp8 keys) and on Gaussian ones; causal
ranges of the last rows of a prompt. Prints one JSON line per case (device ms, exact against the
reference) and writes them to OUT (argv[1]).

The ``TOPK_LONG`` row's ``MIN_T`` (where the one-read path takes over) comes from it.

Command: bash benchmarks/gpu.sh OUT topk_long   (python benchmarks/topk_long_gpu.py OUT.jsonl)
Card: one GPU.
Writes: OUT.jsonl, one line a case {kind, rows, keys, one_read_ms, two_read_ms, *_exact};
        docs/perf.md "Tuning sweeps".
"""

from __future__ import annotations

import json
import sys
from functools import partial

import torch
from topk_long_sweep_gpu import OPS, override  # benchmarks/ is the script's sys.path[0]

from cpkv.bench.timing import device_ms
from cpkv.plugin import PluginHost


def logits_of(kind: str, n: int, t: int, g: torch.Generator,
              tri: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ks = torch.zeros(n, dtype=torch.int64, device="cuda")
    ke = torch.arange(t - n + 1, t + 1, device="cuda")
    if kind == "gauss":
        x = torch.randn(n, t, generator=g, device="cuda")
        return x.masked_fill(torch.arange(t, device="cuda")[None] >= ke[:, None], float("-inf")), ks, ke
    q = torch.randn(n, 64, 128, generator=g, device="cuda").bfloat16()
    w = torch.randn(n, 64, generator=g, device="cuda") * 0.1
    k = (torch.randn(t, 128, generator=g, device="cuda")).to(torch.float8_e4m3fn)
    sc = torch.rand(t, generator=g, device="cuda") + 0.5
    return tri.indexer_logits(q, w, k, sc, ks, ke), ks, ke


def small_cases(ref: object) -> dict[str, bool]:
    """The interpreter tests' edge cases, compiled: ties, -inf, one value, signed zeros, ranges
    empty / clipped / shorter than k, with the long path forced (tiny sample, CAP, splits)."""
    out = {}
    g = torch.Generator().manual_seed(7)
    ks = torch.tensor([0, 0, 5, 30, -3, 100, 0, 149, 10], device="cuda")
    ke = torch.tensor([150, 80, 5, 140, 200, 90, 3, 150, 137], device="cuda")
    for config in ("long", "default"):
        override("TOPK_LONG", {"MIN_T": 1, "SAMPLE": 16, "CAP": 32, "BLOCK": 16, "PROGRAMS": 64,
                               "SPLIT_MIN": 32, "REFINE": 16} if config == "long" else {})
        for kind in ("randn", "ties", "neg_inf", "equal", "zeros"):
            x = torch.randn(9, 150, generator=g) * 3
            if kind == "ties":
                x = x.round()
            elif kind == "neg_inf":
                x = torch.where(torch.rand(9, 150, generator=g) < 0.4, float("-inf"), x.round())
            elif kind == "equal":
                x = torch.full((9, 150), 0.5)
            elif kind == "zeros":
                x = torch.where(torch.rand(9, 150, generator=g) < 0.5, -0.0, 0.0)
                x[:, ::7] = 1.0
            x = x.cuda()
            ok = True
            for k in (1, 24, 150, 200):
                got, want = OPS.topk(x, k, ks, ke), ref.topk(x, k, ks, ke)
                ok &= bool(torch.equal(got.sort(1).values, want.sort(1).values))
            out[f"{config}/{kind}"] = ok
    override("TOPK_LONG", {})
    return out


def sweep(tri: object) -> None:
    """Launch shapes of the one-read path at 1024 rows x 512K keys, and where one call's time
    goes (torch.profiler, per kernel)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator(device="cuda").manual_seed(1)
    x, ks, ke = logits_of("indexer", 1024, 524288, g, tri)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        OPS.topk(x, 2048, ks, ke)
        torch.cuda.synchronize()
    print(json.dumps({e.key[:40]: round(e.self_device_time_total / 1e3, 3)
                      for e in prof.key_averages() if e.self_device_time_total}), flush=True)
    for blk in (1024, 2048, 4096):
        for warps in (4, 8):
            for progs in (2048, 8192):
                override("TOPK_LONG", {"BLOCK": blk, "num_warps": warps, "PROGRAMS": progs})
                ms = device_ms(partial(OPS.topk, x, 2048, ks, ke), iters=10)
                print(json.dumps({"BLOCK": blk, "num_warps": warps, "PROGRAMS": progs,
                                  "ms": round(ms, 3)}), flush=True)
    override("TOPK_LONG", {})


def main() -> None:
    if sys.argv[2:] == ["sweep"]:
        sweep(PluginHost().backends().load("triton"))
        return
    host = PluginHost()
    tri, ref = host.backends().load("triton"), host.backends().load("torch")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    edge = small_cases(ref)
    print(json.dumps({"edge_cases": edge}), flush=True)
    rows.append({"edge_cases": edge})
    for kind, n, t in (("indexer", 1024, 65536), ("indexer", 1024, 131072),
                       ("indexer", 1024, 524288), ("gauss", 1024, 524288),
                       ("indexer", 512, 1048576), ("gauss", 512, 1048576)):
        x, ks, ke = logits_of(kind, n, t, g, tri)
        want = ref.topk(x, 2048, ks, ke).sort(1).values
        res = {"kind": kind, "rows": n, "keys": t}
        for name, min_t in (("one_read", 1), ("two_read", 1 << 40)):
            override("TOPK_LONG", {"MIN_T": min_t})
            got = OPS.topk(x, 2048, ks, ke)
            res[f"{name}_exact"] = bool(torch.equal(got.sort(1).values, want))
            res[f"{name}_ms"] = device_ms(partial(OPS.topk, x, 2048, ks, ke), iters=10)
        override("TOPK_LONG", {})
        res["indexer_or_gen_logits_gb"] = x.numel() * 4 / 1e9
        res["read_once_ms_at_3tbps"] = x.numel() * 4 / 3.0e9
        print(json.dumps(res), flush=True)
        rows.append(res)
        del x
        torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
