#!/usr/bin/env bash
# Session 20, call C (.whl with --flashmla; ~2.5 min): the decode step's KV write, fp8_store
# against session 19's pack + index_put_, alternating in one process
# (benchmarks/decode_write_ab_gpu.py), then the decode row.
# Usage: bash benchmarks/session20c_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" > /dev/null
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
timeout 150 "$py" benchmarks/decode_write_ab_gpu.py "$out/decode_write_ab.json" 2>&1 \
  | grep -v Warn | tail -5
timeout 70 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
  --out "$out/decode_64x128k.json" 2>&1 | grep -A4 "gpu_vs_bytes" | head -5
