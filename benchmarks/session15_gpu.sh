#!/usr/bin/env bash
# One H100/H200, issue 38 after session 15's first runs (session14_gpu.sh a and b, on an H100):
# the async Gluon indexer failed to compile there (Triton 3.6 names the TMA load
# async_copy_global_to_shared; fixed by an alias). Part `a` (.whl with --flashmla, .dg; ~9 min):
# its GPU conformance tests, its launch sweep against the Triton kernel, the DeepGEMM bench with
# ASYNC=1 (benchmarks/with_tuning.py), and the decode step with FlashMLA present (session 14's
# part a ran without it: Triton's sparse MLA plus an fp8 unpack, 0.32 ms a layer).
# Predictions: async 1.1-1.3x the Triton kernel at 4Kx128K and 2Kx512K (then
# indexer_fp8_vs_deepgemm ~1.15-1.35); decode_64x128k_gpu_vs_bytes ~2.0 on the H100 with FlashMLA
# (2.40 without).
# Usage: bash benchmarks/session15_gpu.sh OUT_DIR a
part=${2:?a}
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
if [ "$part" = a ]; then
  timeout 100 "$py" -m pytest tests/test_triton_attention.py -q -rA -p no:cacheprovider \
    --tb=short -k "async" 2>&1 | tee "$out/async_gpu_tests.log" | tail -6
  timeout 130 "$py" benchmarks/indexer_prefill_sweep_gpu.py "$out/indexer_async_sweep.json" \
    async 2>&1 | tail -20
  timeout 130 "$py" benchmarks/with_tuning.py INDEXER.ASYNC=1 cpkv_backend_cuda.bench \
    --out "$out/deepgemm_async.json" 2>&1 | grep -v "^prefill_\|^paged_" | tail -12
  timeout 90 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
    --out "$out/decode_64x128k_flashmla.json" 2>&1 | tail -8
  timeout 60 "$py" benchmarks/decode_profile_gpu.py "$out/decode_profile_flashmla.json" 64 131072 \
    2>&1 | tail -12
fi
