#!/usr/bin/env bash
# Session 21's second call (.whl with --flashmla, .dg), by the card that comes:
# - an H200: every issue-38 row (benchmarks/issue38_rows_gpu.sh, ~9 min);
# - otherwise (~4 min): the decode top-k (the per-split select with COMPACT, few_BLOCK: the
#   table against session 20's launches, benchmarks/topk_decode_flat_gpu.py), the decode row,
#   the fused indexer top-k's select with COMPACT 0 / 1 (benchmarks/fused_compact_ab_gpu.py).
# Usage: bash benchmarks/session21c_gpu.sh OUT_DIR
out=${1:?OUT_DIR}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu"
if [[ $gpu == *H200* ]]; then
  exec bash benchmarks/issue38_rows_gpu.sh "$out/rows"
fi
source benchmarks/gpu_setup.sh "$out/h100" > /dev/null  # out is now OUT_DIR/h100
timeout 120 "$py" benchmarks/topk_decode_flat_gpu.py "$out/topk_decode_select.json" \
  "$out/best.env" 2>&1 | grep -v Warn | tail -9
timeout 70 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
  --out "$out/decode_64x128k.json" 2>&1 | grep -A4 "gpu_vs_bytes" | head -5
timeout 150 "$py" benchmarks/fused_compact_ab_gpu.py "$out/fused_compact_ab.json" 2>&1 \
  | grep -v Warn | tail -10
