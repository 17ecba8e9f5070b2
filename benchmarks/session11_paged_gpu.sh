#!/usr/bin/env bash
# The paged decode indexer at the HBM bound (issue 38's indexer_paged_vs_deepgemm), one H200:
# DeepGEMM built; the page-tile kernel's GPU tests (conformance on part-major pools, DeepGEMM's
# page-major order against the reference); then `indexer_paged_sweep_gpu.py --pages` at
# 64 x 128K and 1 x 128K keys: the key-tile kernel (today's default), the page-tile kernel on
# the pool's part-major pages and on DeepGEMM's page-major copy of the same keys (18
# configurations: PAGES 1-16 a program, pipeline depth 1 / 3, 4 / 8 warps, keys @ q^T or
# q @ keys^T) and DeepGEMM's fp8_fp4_paged_mqa_logits, with the same run's copy bandwidth.
# -> OUT_DIR/paged_gpu_tests.log, paged_sweep_64x128k.json, paged_sweep_1x128k.json
# Run from the repository root with .whl (gpu-wheels --flashmla) and .dg (gpu-deepgemm) carried.
#
# Predictions (before the run; 1.09 GB of index-K at 64 x 128K, copy ~4.2 TB/s):
# - key-tile default (BLOCK_N 128, 4 warps): ~0.64 ms (~1.7 TB/s), as the cuda bench measured.
# - page-tile, part-major (132-byte rows: 4-byte loads; a pipelined loop stages them with 4-byte
#   cp.async, the slow case of docs/lessons.md): best at STAGES 1, PAGES 4-8, keys @ q^T:
#   ~0.40-0.45 ms (2.4-2.7 TB/s), ~1.5x the key-tile kernel, DeepGEMM ms / this ~0.75-0.8.
# - page-tile, page-major (16-byte loads; cp.async.cg 16 B when pipelined): best at STAGES 3,
#   PAGES 8: ~0.35-0.40 ms (2.7-3.1 TB/s), DeepGEMM ms / this ~0.85-0.95 (DeepGEMM ~0.33 ms).
# - keys @ q^T (the head sum within warps: 4 bar.sync / 4 shfl in the PTX against 12 / 80)
#   faster than q @ keys^T by ~10-20 %.
# - 1 x 128K (17 MB): launch-bound, ~10-20 us each; the page-tile kernel best at PAGES 1-2
#   (2048 / PAGES programs must cover 132 SMs); DeepGEMM similar.
# Every variant within ~1e-6 of the key-tile default (fp32 sums in another order).
# If a page-tile row wins, set PAGED_KERNEL 1 and its PAGED_* values in the H200 row of
# backends/triton/src/cpkv_backend_triton/tuning.py, naming paged_sweep_64x128k.json.
#
# Usage: bash benchmarks/session11_paged_gpu.sh OUT_DIR   (~4-5 min with the DeepGEMM build)
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout 120 "$py" -m pytest tests/test_triton_attention.py tests/test_triton_tuning.py -q -rA \
  -k "page_tiles or index_pages or tuning or tables" -p no:cacheprovider --tb=short 2>&1 \
  | tee "$out/paged_gpu_tests.log" | tail -8
timeout 200 "$py" benchmarks/indexer_paged_sweep_gpu.py --pages "$out/paged_sweep_64x128k.json" \
  64 131072 2>&1 | tail -22
timeout 60 "$py" benchmarks/indexer_paged_sweep_gpu.py --pages "$out/paged_sweep_1x128k.json" \
  1 131072 2>&1 | tail -8
