#!/usr/bin/env bash
# Session 21's second call (.whl with --flashmla; ~4 min, any card: ~9.5 min of device time
# left, under the issue-38 rows' ~9 plus a start): the decode row (on an H200 the issue's
# decode row), the decode top-k (the per-split select with COMPACT, few_BLOCK: the table
# against session 20's launches, benchmarks/topk_decode_select_gpu.py), the fused indexer
# top-k's select with COMPACT 0 / 1 (benchmarks/fused_compact_ab_gpu.py).
# Usage: bash benchmarks/session21c_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" > /dev/null
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
timeout 70 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
  --out "$out/decode_64x128k.json" 2>&1 | grep -A4 "gpu_vs_bytes" | head -5
timeout 120 "$py" benchmarks/topk_decode_select_gpu.py "$out/topk_decode_select.json" \
  "$out/best.env" 2>&1 | grep -v Warn | tail -9
timeout 150 "$py" benchmarks/fused_compact_ab_gpu.py "$out/fused_compact_ab.json" 2>&1 \
  | grep -v Warn | tail -10
