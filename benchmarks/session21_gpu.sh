#!/usr/bin/env bash
# Session 21's one call (.whl with --flashmla, .dg), by the card that comes:
# - an H200: every issue-38 row (benchmarks/issue38_rows_gpu.sh, ~9 min);
# - otherwise (~8 min): fp8_store's GPU conformance (60 s: too short, it printed nothing on an
#   H100; give it 150), the KV write A/B and the decode row, the decode top-k sweep, the decode
#   row with its fastest exact configuration and the top-k's GPU tests.
# Usage: bash benchmarks/session21_gpu.sh OUT_DIR
out=${1:?OUT_DIR}
source benchmarks/by_card_gpu.sh "$out"  # an H200: the issue-38 rows instead of what follows
source benchmarks/gpu_setup.sh "$out/h100" > /dev/null  # out is now OUT_DIR/h100
timeout 60 "$py" -c "
import cpkv.testing.conformance as c
from cpkv_backend_triton.ops import TritonOps
c.check_op(TritonOps(), c.reference_backend(), 'fp8_store', device='cuda'); print('fp8_store conforms on the GPU')
" 2>&1 | tail -2
timeout 150 "$py" benchmarks/decode_write_ab_gpu.py "$out/decode_write_ab.json" 2>&1 \
  | grep -v Warn | tail -5
timeout 70 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
  --out "$out/decode_64x128k_table.json" 2>&1 | grep -A4 "gpu_vs_bytes" | head -5
timeout 150 "$py" benchmarks/topk_decode_select_gpu.py "$out/topk_decode_flat.json" \
  "$out/best.env" 2>&1 | grep -v Warn | tail -18
TRITON_CPKV_TUNING=$(cat "$out/best.env") timeout 70 "$py" -m cpkv.cli bench decode \
  --batches 64 --contexts 131072 --no-mtp --out "$out/decode_64x128k_best.json" 2>&1 \
  | grep -A4 "gpu_vs_bytes" | head -5
timeout 100 "$py" -m pytest tests/test_triton_attention.py -m gpu -k topk -q \
  -p no:cacheprovider --tb=short 2>&1 | tail -3
