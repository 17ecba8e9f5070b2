#!/usr/bin/env bash
# Session 20, call B (.whl with --flashmla, .dg): the decode row after fp8_store, the prefill
# indexer's head sum ABS_PARTS 0 / 3 against DeepGEMM (benchmarks/indexer_parts_gpu.py), then
# the new ops' GPU tests (fp8_store conformance, the indexer tile's parts, the decode step).
# ~8 min. Usage: bash benchmarks/session20b_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
timeout 70 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
  --out "$out/decode_64x128k.json" 2>&1 | grep -A4 "gpu_vs_bytes" | head -5
PARTS="0 3" timeout 200 "$py" benchmarks/indexer_parts_gpu.py "$out/indexer_parts.json" 2>&1 \
  | tail -4
timeout 60 "$py" -c "
import cpkv.testing.conformance as c
from cpkv_backend_triton.ops import TritonOps
c.check_op(TritonOps(), c.reference_backend(), 'fp8_store', device='cuda'); print('fp8_store conforms on the GPU')
" 2>&1 | tail -2
timeout 90 "$py" -m pytest tests/test_triton_indexer_tile.py tests/test_decode_step.py -m gpu -q \
  -p no:cacheprovider --tb=short 2>&1 | tail -3
