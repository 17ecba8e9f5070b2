#!/usr/bin/env bash
# Session 19, a slim call for the last device minutes (.whl with --flashmla): the decode row
# after the block-table upload change, page_rows and rms_norm (first: what a cut-short call
# still brings back), page_rows / index_q_fp8 / rms_norm conformance on the GPU, the decode
# profile and the RMSNorm probe (~3 min).
# Usage: bash benchmarks/session19c_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" > /dev/null
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
timeout 70 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
  --out "$out/decode_64x128k.json" 2>&1 | tail -3
timeout 60 "$py" -c "
import cpkv.testing.conformance as c
from cpkv_backend_triton.ops import TritonOps
for op in ('page_rows', 'index_q_fp8', 'rms_norm'):
    c.check_op(TritonOps(), c.reference_backend(), op, device='cuda'); print(op, 'conforms on the GPU')
" 2>&1 | tail -3
timeout 60 "$py" benchmarks/decode_profile_gpu.py "$out/decode_profile.json" 64 131072 2>&1 \
  | grep -v Warn | tail -4
timeout 40 "$py" benchmarks/rmsnorm_probe_gpu.py "$out/rmsnorm_probe.json" 2>&1 | tail -3
