"""DeepSeek-V4's sparse attention with the sink through cpkv (``v4_attention`` of the op table
resolved for cuda: the cuda backend's FlashMLA V4 kernel) against ``flash_mla_sparse_fwd``
called directly on the same inputs (int32 indices already padded to 64-slot blocks, kv
[S, 1, 512]). Shapes of a prefill chunk: V4-Flash (64 heads; a CSA row's 128 window slots +
top-512 entries = 640) and V4-Pro (128 heads; 128 + top-1024 = 1152), over a buffer of window
rows and entries. Also the result against the torch backend (fp32) as a check.

Rows (JSON list in OUT, argv[1]): per case the device milliseconds (median of CUDA events
with the host work hidden behind a spin kernel) and the ``wall`` milliseconds (median of CUDA
events without the spin: a host slower than the kernels shows) of both; ``ratio`` = direct /
cpkv (1.0: no cost; the criterion is >= 0.95); TFLOP/s of the cpkv call (4 N H K 512 flops).

Command: bash benchmarks/gpu.sh OUT v4_attention   (python benchmarks/v4_attention_gpu.py OUT.json)
Card: one Hopper GPU with sgl-flash-mla installed (.whl: ../shared/tools/gpu-wheels --flashmla).
Writes: OUT.json; docs/perf.md "DeepSeek-V4 sparse attention".
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from cpkv.bench.timing import device_ms, median_ms
from cpkv.contracts import Op
from cpkv.ops import OpTable
from cpkv.plugin import PluginHost

CASES = (("v4-flash", 4096, 64, 640, 65536), ("v4-flash", 16384, 64, 640, 262144),
         ("v4-pro", 4096, 128, 1152, 65536))


def case(table: OpTable, fm: Any, name: str, n: int, heads: int, k: int, s: int
         ) -> dict[str, Any]:
    """One row: the op through the table and the kernel called directly, same inputs."""
    from cpkv_backend_torch.v4 import V4TorchOps

    g = torch.Generator(device="cuda").manual_seed(n + heads)
    q = torch.randn(n, heads, 512, dtype=torch.bfloat16, device="cuda", generator=g)
    kv = torch.randn(s, 512, dtype=torch.bfloat16, device="cuda", generator=g)
    ind = torch.randint(0, s, (n, k), device="cuda", generator=g, dtype=torch.int32)
    ind[:, :128] = torch.arange(128, device="cuda", dtype=torch.int32)  # window rows
    ind[::5, k - 100:] = -1  # rows with fewer entries
    sink = torch.randn(heads, device="cuda", generator=g)
    scale = 512 ** -0.5
    pad = -k % 64
    direct_ind = torch.cat([ind, ind.new_full((n, pad), -1)], 1) if pad else ind
    kv3, ind3 = kv.unsqueeze(1), direct_ind.unsqueeze(1).contiguous()

    def ours() -> torch.Tensor:
        return table.v4_attention(q, kv, ind, sink, scale)

    def direct() -> torch.Tensor:
        return fm.flash_mla_sparse_fwd(q, kv3, ind3, scale, 512, attn_sink=sink,
                                       use_legacy=True)[0]

    got = ours()
    same = torch.equal(got, direct())
    want = torch.cat([V4TorchOps().v4_attention(q[r:r + 512].float(), kv.float(),
                                                ind[r:r + 512], sink, scale)
                      for r in range(0, min(n, 2048), 512)])
    err = ((got[:want.shape[0]].float() - want).abs().amax() / want.abs().amax()).item()
    ms = {f: device_ms(fn, warmup=5, iters=30) for f, fn in (("cpkv", ours), ("direct", direct))}
    wall = {f: median_ms(fn, "cuda", 5, 30) for f, fn in (("cpkv", ours), ("direct", direct))}
    flops = 4 * n * heads * k * 512
    return {"case": name, "rows": n, "heads": heads, "slots": k, "buffer": s,
            "equal_to_direct": same, "rel_err_vs_fp32": err, "cpkv_ms": ms["cpkv"],
            "direct_ms": ms["direct"], "ratio": ms["direct"] / ms["cpkv"],
            "cpkv_wall_ms": wall["cpkv"], "direct_wall_ms": wall["direct"],
            "wall_ratio": wall["direct"] / wall["cpkv"], "tflops": flops / ms["cpkv"] / 1e9}


def main(out: str) -> None:
    import flash_mla

    host = PluginHost()
    try:
        table = OpTable.resolve(host.backends(), ["cuda", "torch"], [Op.V4_ATTENTION],
                                device_type="cuda")
    finally:
        host.close()
    chosen = table.chosen[Op.V4_ATTENTION.value]
    rows = []
    for spec in CASES:
        row = {"backend": chosen, **case(table, flash_mla, *spec)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
