#!/usr/bin/env bash
# Session 22's first call (.whl with --flashmla, .dg), by the card that comes:
# - an H200: every issue-38 row (benchmarks/issue38_rows_gpu.sh, ~9 min);
# - otherwise (~4 min): fp8_store's GPU conformance (170 s: it compiles every layout's
#   variants; session 21's 60 s printed nothing) and the decode row on that host (the baseline
#   for this session's decode filter A/B).
# Usage: bash benchmarks/session22_gpu.sh OUT_DIR
out=${1:?OUT_DIR}
source benchmarks/by_card_gpu.sh "$out"  # an H200: the issue-38 rows instead of what follows
source benchmarks/gpu_setup.sh "$out/other" > /dev/null  # out is now OUT_DIR/other
timeout 70 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
  --out "$out/decode_64x128k.json" 2>&1 | grep -A4 "gpu_vs_bytes" | head -5
t0=$SECONDS
timeout 170 "$py" -c "
import cpkv.testing.conformance as c
from cpkv_backend_triton.ops import TritonOps
c.check_op(TritonOps(), c.reference_backend(), 'fp8_store', device='cuda'); print('fp8_store conforms on the GPU')
" 2>&1 | tail -2
echo "fp8_store conformance: $((SECONDS - t0)) s"
