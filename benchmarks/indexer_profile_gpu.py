"""The prefill indexer for Nsight Compute (issue 38): the Triton backend's ``indexer_logits`` at
its tuned launch (``TRITON_CPKV_TUNING`` overrides it), called twice (compile, then the same
shape) on DeepSeek-V3.2's fp8 inputs, 4096 rows x 32K keys: ``bash
benchmarks/indexer_ncu_gpu.sh OUT_DIR`` runs it under Nsight Compute (stall reasons).
"""

from __future__ import annotations

import torch

from cpkv.ops.api import hadamard_rotate, quantize_fp8, quantize_index_q
from cpkv_backend_triton.attention import AttentionKernels


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    n, t, heads, dim = 4096, 32768, 64, 128
    q = hadamard_rotate(torch.randn(n, heads, dim, dtype=torch.bfloat16, device=dev, generator=g))
    w = torch.randn(n, heads, device=dev, generator=g) * (heads ** -0.5 * dim ** -0.5)
    k = hadamard_rotate(torch.randn(t, dim, dtype=torch.bfloat16, device=dev, generator=g))
    k8, scale = quantize_fp8(k, None, "ue8m0")
    q8, w8 = quantize_index_q(q, w)
    ks = torch.zeros(n, dtype=torch.int64, device=dev)
    ke = torch.arange(t - n + 1, t + 1, dtype=torch.int64, device=dev)
    ak = AttentionKernels()
    for _ in range(2):
        ak.indexer_logits(q8, w8, k8, scale, ks, ke)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
