"""The decode top-k's filter (the Gluon kernel at a decode step's 64 rows of ~128K keys in a
256K-column bucket, session 18's inputs): ``PREFETCH`` (each block's load issued before the
previous block's scan), the block, the warps and the splits, each against the table; device ms
of the op and each kernel's, exact against ``torch.topk``'s sets. Beside them, the bytes the
filter reads streamed by a kernel that only sums them, over the same (row, split) grid and
block: what that grid can read, against the same run's copy bandwidth.

Session 21 measured the filter at ~25 us (~1.3 TB/s) on an H100, its block 1024 -> 2048 columns
32 -> 25 us, 4096 no better: latency (one block in flight a program, then its scan) or the grid?

    python benchmarks/topk_filter_sweep_gpu.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from topk_sweep_gpu import sweep_case

from cpkv.bench.gpu import ceilings
from cpkv.bench.timing import device_ms

CONFIGS = {
    "table": {},
    "prefetch": {"PREFETCH": 1},
    "prefetch_block1k": {"PREFETCH": 1, "few_BLOCK": 1024},
    "prefetch_block4k": {"PREFETCH": 1, "few_BLOCK": 4096},
    "warps8": {"num_warps": 8},
    "prefetch_warps8": {"PREFETCH": 1, "num_warps": 8},
    "split16k": {"few_SPLIT_MIN": 16384},
    "prefetch_split16k": {"PREFETCH": 1, "few_SPLIT_MIN": 16384},
}


@triton.jit
def _read_kernel(x_ptr, ke_ptr, out_ptr, CS, NS, sx0, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    end = tl.load(ke_ptr + row).to(tl.int32)
    c_lo = j * CS
    c_hi = tl.minimum(c_lo + CS, end)
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * sx0 + cols, mask=cols < c_hi, other=0.0)
    tl.store(out_ptr + row * NS + j, tl.sum(acc, axis=0))


def _read(x: torch.Tensor, ke: torch.Tensor, ns: int, block: int, warps: int) -> float:
    n, t = x.shape
    cs = triton.cdiv(triton.cdiv(t, ns), block) * block
    out = torch.empty(n, ns, device=x.device)

    def go() -> None:
        _read_kernel[(n, ns)](x, ke, out, cs, ns, x.stride(0), BLOCK=block, num_warps=warps)

    return device_ms(go, iters=50)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    n, t = 64, 1 << 18
    ke = torch.randint(131072 - 4096, 131073, (n,), generator=g, device="cuda")
    out: dict[str, object] = {"device": torch.cuda.get_device_name(), "configs": CONFIGS,
                              "copy_gbps": ceilings(torch.device("cuda"))["copy_gbps"]}
    out["decode_64x128k"] = sweep_case("decode64", n, t, ke, CONFIGS, g)
    x = torch.randn(n, t, device="cuda", generator=g)
    gb = float(ke.sum()) * 4 / 1e9
    reads = {}
    for ns, block, warps in ((8, 2048, 4), (8, 4096, 4), (8, 2048, 8), (16, 2048, 4),
                             (32, 2048, 4), (8, 8192, 8)):
        ms = _read(x, ke, ns, block, warps)
        key = f"splits{ns}_block{block}_warps{warps}"
        reads[key] = {"ms": ms, "gbps": gb / ms * 1e3}
        print(f"read-only {key:28s} {ms * 1e3:7.1f} us {gb / ms * 1e3:7.0f} GB/s", flush=True)
    out["read_only"] = reads
    print(f"copy {out['copy_gbps']:.0f} GB/s; logits {gb * 1e3:.1f} MB")
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
