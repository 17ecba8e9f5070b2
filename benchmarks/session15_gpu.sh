#!/usr/bin/env bash
# One H100/H200, issue 38 after session 15's first runs (session14_gpu.sh a and b, on an H100):
# the async Gluon indexer failed to compile there (Triton 3.6 names the TMA load
# async_copy_global_to_shared; fixed by an alias). Part `a` (.whl with --flashmla, .dg; ~9 min):
# its GPU conformance tests, its launch sweep against the Triton kernel, the DeepGEMM bench with
# ASYNC=1 (TRITON_CPKV_TUNING=INDEXER.ASYNC=1), and the decode step with FlashMLA present (session 14's
# part a ran without it: Triton's sparse MLA plus an fp8 unpack, 0.32 ms a layer).
# Predictions: async 1.1-1.3x the Triton kernel at 4Kx128K and 2Kx512K (then
# indexer_fp8_vs_deepgemm ~1.15-1.35); decode_64x128k_gpu_vs_bytes ~2.0 on the H100 with FlashMLA
# (2.40 without).
#
# Part `b` (.whl with --flashmla; ~3 min): `topk_sweep_gpu.py` (1024 and 4096 rows x 480K, a
# decode step's 64 x 128K), `cpkv bench long` at 512K / 1M, the decode step. First run with the
# filter's blocks on 16-column boundaries (16-byte loads) and PROGRAMS 8192; predicted the
# filter 1.21 -> ~0.8 ms at 1024 x 480K; measured 1.64 (the range-masked blocks 1.22): the
# v4 layout is converted before the candidates' scatter store (docs/lessons.md). The second run
# (the range-masked filter, PROGRAMS 8192) predicts the 512K chunk's filter 168 -> ~155 ms.
# Usage: bash benchmarks/session15_gpu.sh OUT_DIR a|b
part=${2:?a or b}
if [ "$part" = a ]; then source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
else source benchmarks/gpu_setup.sh "${1:?OUT_DIR}"; fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
if [ "$part" = a ]; then
  timeout 100 "$py" -m pytest tests/test_triton_attention.py -q -rA -p no:cacheprovider \
    --tb=short -k "async" 2>&1 | tee "$out/async_gpu_tests.log" | tail -6
  timeout 130 "$py" benchmarks/indexer_prefill_sweep_gpu.py "$out/indexer_async_sweep.json" \
    async 2>&1 | tail -20
  TRITON_CPKV_TUNING=INDEXER.ASYNC=1 timeout 130 "$py" -m cpkv_backend_cuda.bench \
    --out "$out/deepgemm_async.json" 2>&1 | grep -v "^prefill_\|^paged_" | tail -12
  timeout 90 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
    --out "$out/decode_64x128k_flashmla.json" 2>&1 | tail -8
  timeout 60 "$py" benchmarks/decode_profile_gpu.py "$out/decode_profile_flashmla.json" 64 131072 \
    2>&1 | tail -12
else
  timeout 150 "$py" benchmarks/topk_sweep_gpu.py "$out/topk_sweep.json" 2>&1 | tail -20
  timeout 240 "$py" -m cpkv.cli bench long --out "$out/long.json" --tokens 524288,1048576 \
    --chunks 65536 --fixed-budget-mb 0 --recall-tokens "" --no-hf --hf-tokens 0 \
    --no-bf16-compare 2>&1 | tail -14
  timeout 90 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
    --out "$out/decode_64x128k.json" 2>&1 | tail -8
fi
