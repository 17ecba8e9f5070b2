#!/usr/bin/env bash
# One H100/H200 (.whl from `gpu-wheels --flashmla`, .dg from `gpu-deepgemm`; ~8 min): the
# warp-specialized ping-pong prefill indexer (cpkv_backend_triton/indexer_ws.py) against the
# Triton kernel and DeepGEMM (benchmarks/indexer_ws_gpu.py: predictions in its header), then
# `cpkv bench long` with the Gluon top-k filter on by default (the kernel now named
# _topk_filter_gluon_kernel, so long_512k_topk_share counts it: predicted ~0.14-0.15 on an
# H100, long_1m_fp8_mfu ~0.53).
# Usage: bash benchmarks/session16b_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
(command -v ncu nsys; ls /usr/local/cuda/bin | grep -i "ncu\|nsys\|nsight") > "$out/profilers.txt" 2>&1
timeout 240 "$py" benchmarks/indexer_ws_gpu.py "$out/indexer_ws.json" 2>&1 | tail -40
long=(--tokens 524288,1048576 --chunks 65536 --fixed-budget-mb 0 --recall-tokens "" --no-hf
      --hf-tokens 0 --no-bf16-compare)
timeout 170 "$py" -m cpkv.cli bench long --out "$out/long.json" "${long[@]}" 2>&1 | tail -14
