#!/usr/bin/env bash
# Session 18, first call (one GPU, .whl with --flashmla, .dg): the fused top-k's GPU tests,
# the SM clock and power under the fp8 matmul / cpkv's indexer / DeepGEMM's indexer, the decode
# step's kernels at 64 x 128K, the fused select sweep (FLOOR_ROUNDS 3 against 4).
# Usage: bash benchmarks/session18_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm --format=csv,noheader \
  | tee "$out/gpu.txt"
timeout 150 "$py" -m pytest tests/test_triton_attention.py -q -x -p no:cacheprovider \
  -k "fused or conformance_gpu" 2>&1 | tail -5
timeout 90 "$py" benchmarks/clock_probe_gpu.py "$out/clock_probe.json" 2>&1 | tail -8
timeout 90 "$py" benchmarks/decode_profile_gpu.py "$out/decode_profile.json" 64 131072 2>&1 \
  | tail -18
timeout 150 "$py" benchmarks/fused_select_sweep_gpu.py "$out/fused_select_sweep.json" 2>&1 | tail -12
