#!/usr/bin/env bash
# Issue 38's GPU run (one H200): DeepGEMM built from source, the cuda backend's DeepGEMM tests,
# cpkv's indexers against DeepGEMM's (prefill and paged), then the first pass of a fresh process
# over a 1M-token prompt after the warm-up (empty compile caches), and a second process's first
# pass with the caches the first left (the persistent cache alone, no warm-up).
# -> OUT_DIR/deepgemm_tests.log, deepgemm_h200.json, first_pass_fresh.json,
#    first_pass_cached.json. Run from the repository root, with .whl (gpu-wheels --flashmla) and
#    .dg (../shared/tools/gpu-deepgemm) carried.
#
# Usage: bash benchmarks/issue38_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout 170 "$py" -m pytest tests/test_deepgemm.py tests/test_cuda_backend.py -q -rA \
  --durations=8 -p no:cacheprovider --tb=short 2>&1 | tee "$out/deepgemm_tests.log" | tail -25
timeout 120 "$py" -m cpkv_backend_cuda.bench --out "$out/deepgemm_h200.json" 2>&1 | tail -14
cache=$(mktemp -d)
timeout 200 "$py" -m cpkv.bench.first_pass --out "$out/first_pass_fresh.json" \
  --cache-dir "$cache" --tokens 1048576 --chunk 65536 --second-chunk 131072 2>&1 | tail -6
timeout 80 "$py" -m cpkv.bench.first_pass --out "$out/first_pass_cached.json" \
  --cache-dir "$cache" --tokens 524288 --chunk 65536 --warmup 0 2>&1 | tail -4
