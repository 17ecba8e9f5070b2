#!/usr/bin/env bash
# Session 21, call A (.whl with --flashmla; ~4 min): fp8_store's GPU conformance (two_part pages
# included), the decode step's KV write A/B (fp8_store against session 19's pack + write,
# benchmarks/decode_write_ab_gpu.py), the decode row and its kernel profile.
# Usage: bash benchmarks/session21a_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" > /dev/null
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
timeout 60 "$py" -c "
import cpkv.testing.conformance as c
from cpkv_backend_triton.ops import TritonOps
c.check_op(TritonOps(), c.reference_backend(), 'fp8_store', device='cuda'); print('fp8_store conforms on the GPU')
" 2>&1 | tail -2
timeout 150 "$py" benchmarks/decode_write_ab_gpu.py "$out/decode_write_ab.json" 2>&1 \
  | grep -v Warn | tail -5
timeout 70 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
  --out "$out/decode_64x128k.json" 2>&1 | grep -A4 "gpu_vs_bytes" | head -5
timeout 90 "$py" benchmarks/decode_profile_gpu.py "$out/decode_profile_64x128k.json" 64 131072 \
  2>&1 | tail -25
