#!/usr/bin/env bash
# One H200, issue 38's paged decode indexer and decode step, then issue 36's GLM-5 1M row.
#
# part `paged` (.whl and .dg carried; ~6 min): DeepGEMM built; the Triton GPU conformance and
# page-tile tests (PAGED_PRECISE 32: keys @ q^T with fp8 partial sums promoted every wgmma,
# now the default; PRECISE 0 a strict xfail); `indexer_paged_sweep_gpu.py --pages` at 64 x 128K
# (every row against the key-tile kernel and the torch fp32 reference; DeepGEMM on the same
# page-major keys); `cpkv bench decode` at 64 x 128K with the defaults; the decode step's kernel
# profile. Predictions: conformance passes with PRECISE 32 (the failing case is mma vs wgmma
# accumulation, not indexing); PRECISE costs <= 3 % (3 x 32 fadds a thread a page against a
# 8.4-KB page read); max_rel_diff_fp32 drops from ~1e-4 to ~1e-7 for PRECISE rows; the decode
# step 3.3 -> ~2.2-2.4 ms GPU (two indexer layers 0.64 -> 0.35 ms each), gpu_vs_bytes ~2.8.
#
# part `long` (.whl carried; ~5 min): `cpkv bench long --preset glm5-attention` at 1M in 64K
# chunks with the warm-up over the longest prompt (session 12's run stalled compiling in
# 384K-704K). Prediction: fp8 ~11-12 s, bf16 ~14 s; no chunk over 1.3x its neighbours.
#
# part `long` also runs first the indexer GPU conformance and page-tile tests again after the
# fp8-query tolerance became per logit (FP8_DOT_REL of its terms' absolute sum) and the default
# went back to PRECISE 0 (the paged run showed PRECISE 32 costs 30 %, not 3 %).
#
# part `rows` (.whl and .dg; ~5 min): the final defaults' same-run rows: `python -m
# cpkv_backend_cuda.bench` (indexer_fp8_vs_deepgemm, indexer_paged_vs_deepgemm on the pool's
# part-major pages and indexer_paged_page_major_vs_deepgemm on DeepGEMM's own tensors) and
# `cpkv bench decode` at 64 x 128K. Predicted: paged 0.35 ms (0.94x DeepGEMM), page-major
# 0.29 ms (1.15x), decode ~2.2 ms GPU (~2.8x its bytes).
#
# Usage: bash benchmarks/session13_gpu.sh OUT_DIR paged|long|rows
part=${2:?paged, long or rows}
if [ "$part" = rows ]; then
  source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
  timeout 200 "$py" -m cpkv_backend_cuda.bench --out "$out/deepgemm_h200.json" 2>&1 | tail -14
  timeout 150 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 \
    --out "$out/decode_64x128k.json" 2>&1 | tail -8
  exit 0
fi
if [ "$part" = paged ]; then source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
else source benchmarks/gpu_setup.sh "${1:?OUT_DIR}"; fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
if [ "$part" = paged ]; then
  timeout 150 "$py" -m pytest tests/test_triton_attention.py tests/test_triton_tuning.py -q -rA \
    -k "gpu or tuning" -p no:cacheprovider --tb=short 2>&1 | tee "$out/paged_gpu_tests.log" | tail -15
  timeout 150 "$py" benchmarks/indexer_paged_sweep_gpu.py --pages "$out/paged_sweep_64x128k.json" \
    64 131072 2>&1 | tail -12
  timeout 120 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 \
    --out "$out/decode_64x128k.json" 2>&1 | tail -12
  timeout 90 "$py" benchmarks/decode_profile_gpu.py "$out/decode_profile_64x128k.json" 64 131072 \
    2>&1 | tail -18
  exit 0
fi
timeout 170 "$py" -m pytest tests/test_triton_attention.py -q -rA -p no:cacheprovider --tb=short \
  -k "page_tiles_gpu or (conformance_gpu and indexer)" 2>&1 | tee "$out/indexer_gpu_tests.log" | tail -12
timeout 400 "$py" -m cpkv.cli bench long --preset glm5-attention --tokens 1048576 --chunks 65536 \
  --fixed-budget-mb 0 --recall-tokens 4096,65536 --out "$out/long_glm5_h200.json" \
  2>&1 | tee "$out/long_glm5.log" | tail -40
