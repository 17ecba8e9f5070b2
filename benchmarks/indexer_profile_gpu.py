"""The prefill indexer for Nsight Compute (issue 38): the Triton backend's ``indexer_logits`` at
its tuned launch (``TRITON_CPKV_TUNING`` overrides it), called twice (compile, then the same
shape) on DeepSeek-V3.2's fp8 inputs, 4096 rows x 32K keys: ``bash
benchmarks/indexer_ncu_gpu.sh OUT_DIR`` runs it under Nsight Compute (stall reasons).
"""

from __future__ import annotations

import torch
from indexer_prefill_sweep_gpu import fp8_inputs  # benchmarks/ is the script's sys.path[0]

from cpkv_backend_triton.attention import AttentionKernels


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    args = fp8_inputs(4096, 32768, dev, g)
    ak = AttentionKernels()
    for _ in range(2):
        ak.indexer_logits(*args)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
