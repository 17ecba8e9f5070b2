#!/usr/bin/env bash
# Session 21, call B (.whl with --flashmla; ~5 min): the decode top-k after the flat select,
# the floor's rounds and the few-row filter blocks (benchmarks/topk_decode_flat_gpu.py), the
# decode row with the table and with the sweep's fastest exact configuration, the top-k's GPU
# tests. Usage: bash benchmarks/session21b_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" > /dev/null
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 "$py" benchmarks/topk_decode_flat_gpu.py "$out/topk_decode_flat.json" \
  "$out/best.env" 2>&1 | grep -v Warn | tail -18
timeout 70 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
  --out "$out/decode_64x128k_table.json" 2>&1 | grep -A4 "gpu_vs_bytes" | head -5
TRITON_CPKV_TUNING=$(cat "$out/best.env") timeout 70 "$py" -m cpkv.cli bench decode \
  --batches 64 --contexts 131072 --no-mtp --out "$out/decode_64x128k_best.json" 2>&1 \
  | grep -A4 "gpu_vs_bytes" | head -5
timeout 120 "$py" -m pytest tests/test_triton_attention.py -m gpu -k topk -q \
  -p no:cacheprovider --tb=short 2>&1 | tail -3
