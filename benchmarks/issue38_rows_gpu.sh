#!/usr/bin/env bash
# Every issue-38 row with the defaults, in one call on one GPU (the issue asks for one H200;
# .whl from `gpu-wheels --flashmla`, .dg from `gpu-deepgemm`; ~9 min, under one call's 10):
#   python -m cpkv_backend_cuda.bench     indexer_fp8_vs_deepgemm, indexer_paged_vs_deepgemm
#   cpkv bench long                       long_1m_fp8_mfu, long_512k_topk_share
#   cpkv bench decode                     decode_64x128k_gpu_vs_bytes
#   python -m cpkv.bench.first_pass       long_1m_first_pass_ratio (fresh compile caches)
# Predictions for an H200 from session 16's H100 rows (docs/perf.md): ~1.05-1.1, ~1.15,
# ~0.53, ~0.13, ~1.9-2.3 (the H200's copy rate is 1.4x the H100's, its compute ~1x), ~1.0.
# Usage: bash benchmarks/issue38_rows_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 "$py" -m cpkv_backend_cuda.bench --out "$out/deepgemm.json" 2>&1 \
  | grep -v "^prefill_\|^paged_" | tail -9
long=(--tokens 524288,1048576 --chunks 65536 --fixed-budget-mb 0 --recall-tokens "" --no-hf
      --hf-tokens 0 --no-bf16-compare)
timeout 170 "$py" -m cpkv.cli bench long --out "$out/long.json" "${long[@]}" 2>&1 | tail -12
timeout 70 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
  --out "$out/decode_64x128k.json" 2>&1 | tail -6
timeout 160 "$py" -m cpkv.bench.first_pass --out "$out/first_pass_fresh.json" \
  --cache-dir "$(mktemp -d)" --tokens 1048576 --chunk 65536 2>&1 | tail -4
