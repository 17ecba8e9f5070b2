"""Probe (session 19): is a decode step's RMSNorm worth a kernel? torch's fused ``F.rms_norm``
(the model's GPU path before session 19) against the ``rms_norm`` op's Triton kernel, 64 rows
of the DeepSeek-V3.2 widths (7168 hidden, 1536 q_lora, 512 kv_lora), bf16 with a bf16 weight;
each timed as a CUDA graph of 20 calls (a decode step replays a graph: launch gaps as there).
Prints and writes one JSON row a shape: us a call for both and their max difference.

Usage (one GPU, .whl carried): python benchmarks/rmsnorm_probe_gpu.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from cpkv_backend_triton.norm import NormKernels

triton_rms = NormKernels().rms_norm


def graph_us(fn, calls: int = 20, reps: int = 50) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * calls)


def main(out: str) -> None:
    rows = []
    for d in (7168, 1536, 512):
        x = torch.randn(64, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
        diff = (triton_rms(x, w, 1e-6).float() - F.rms_norm(x, (d,), w, 1e-6).float()).abs().max()
        t_torch = graph_us(lambda x=x, w=w, d=d: F.rms_norm(x, (d,), w, 1e-6))
        t_triton = graph_us(lambda x=x, w=w: triton_rms(x, w, 1e-6))
        row = {"rows": 64, "dim": d, "torch_us": t_torch, "triton_us": t_triton,
               "max_diff": float(diff), "device": torch.cuda.get_device_name()}
        print(json.dumps(row))
        rows.append(row)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
