#!/usr/bin/env bash
# Session 19, the second call (.whl with --flashmla): page_rows / index_q_fp8 / rms_norm
# conformance on the GPU, the decode row and profile after the block-table upload change,
# page_rows and rms_norm, the RMSNorm probe, then the |s|-split indexer experiment
# (speed, clocks, top-k recall; the script is gone, see the last line).
# Usage: bash benchmarks/session19b_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" > /dev/null
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
timeout 60 "$py" -c "
import cpkv.testing.conformance as c
from cpkv_backend_triton.ops import TritonOps
for op in ('page_rows', 'index_q_fp8', 'rms_norm'):
    c.check_op(TritonOps(), c.reference_backend(), op, device='cuda'); print(op, 'conforms on the GPU')
" 2>&1 | tail -3
timeout 90 "$py" -m pytest tests/test_decode_step.py tests/test_triton_norm.py -m gpu -q \
  -p no:cacheprovider --tb=short 2>&1 | tail -3
timeout 70 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
  --out "$out/decode_64x128k.json" 2>&1 | grep -A3 "gpu_vs_bytes" | head -4
timeout 60 "$py" benchmarks/decode_profile_gpu.py "$out/decode_profile.json" 64 131072 2>&1 \
  | grep -v Warn | tail -4
timeout 40 "$py" benchmarks/rmsnorm_probe_gpu.py "$out/rmsnorm_probe.json" 2>&1 | tail -3
# The |s|-split experiment ran here (benchmarks/results/session20/a/indexer_abs.json); its script
# was removed in session 20: the kernel is ABS_PARTS 2 of cpkv_backend_triton.indexer_tile, timed
# against DeepGEMM by benchmarks/indexer_parts_gpu.py (with .dg built).
