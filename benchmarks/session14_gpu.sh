#!/usr/bin/env bash
# One H200, issue 38's decode step and long-row top-k after session 14's changes: the decode rank's
# pool is two_part (the paged indexer reads index-K in DeepGEMM's page order through the new op
# indexer_logits_index_pages), the top-k floor is a radix select over its sample (was a 4096-key
# sort: 0.1 ms of each decode layer), the filter skips blocks without candidates.
#
# part `a` (.whl carried; ~7 min): the decode-step GPU tests (graphs, two_part and part_major);
# `topk_sweep_gpu.py` (the long path's kernels at a prompt chunk's 1024 x 480K and a decode step's
# 64 x 128K, launch variants, exact against torch.topk); `cpkv bench decode` at 64 x 128K; the
# step's kernel profile. Predictions: floor 0.10 -> <= 0.02 ms a decode layer; the decode step
# 2.23 -> ~1.9 ms GPU (indexer 0.35 -> 0.29 a layer, floor -0.08), gpu_vs_bytes ~2.4; the prompt
# chunk's top-k (1024 x 480K) 2.1 -> ~1.2 ms.
#
# part `b` (.whl and .dg; ~9 min): DeepGEMM built; the indexer GPU conformance (the new op on
# Triton, DeepGEMM's paged test, the async Gluon indexer's tests); `python -m
# cpkv_backend_cuda.bench` (same-run rows); the async indexer's launch sweep against the Triton
# kernel (`indexer_prefill_sweep_gpu.py OUT async`). Predictions: paged row (identical tensors)
# ~1.15; the async kernel 1.1-1.3x the Triton kernel at 4Kx128K / 2Kx512K (then ASYNC = 1 in the
# tuning row and indexer_fp8_vs_deepgemm ~1.2-1.35).
#
# Usage: bash benchmarks/session14_gpu.sh OUT_DIR a|b
part=${2:?a or b}
if [ "$part" = b ]; then source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
else source benchmarks/gpu_setup.sh "${1:?OUT_DIR}"; fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
if [ "$part" = a ]; then
  timeout 100 "$py" -m pytest tests/test_decode_step.py -q -rA -p no:cacheprovider --tb=short \
    2>&1 | tee "$out/decode_gpu_tests.log" | tail -6
  timeout 170 "$py" benchmarks/topk_sweep_gpu.py "$out/topk_sweep_h200.json" 2>&1 | tail -14
  timeout 120 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 \
    --out "$out/decode_64x128k.json" 2>&1 | tail -10
  timeout 90 "$py" benchmarks/decode_profile_gpu.py "$out/decode_profile_64x128k.json" 64 131072 \
    2>&1 | tail -16
  exit 0
fi
timeout 200 "$py" -m pytest tests/test_triton_attention.py tests/test_deepgemm.py -q -rA \
  -p no:cacheprovider --tb=short \
  -k "(conformance_gpu and indexer) or page_tiles_gpu or deepgemm or async" \
  2>&1 | tee "$out/indexer_gpu_tests.log" | tail -8
timeout 150 "$py" -m cpkv_backend_cuda.bench --out "$out/deepgemm_h200.json" 2>&1 | tail -14
timeout 120 "$py" benchmarks/indexer_prefill_sweep_gpu.py "$out/indexer_async_sweep_h200.json" \
  async 2>&1 | tail -20
