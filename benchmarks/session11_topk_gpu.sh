#!/usr/bin/env bash
# Issue 38 item 3 on one H200: the fused indexer top-k (cpkv_backend_triton.indexer_topk: the
# logits never stored) against the plain path (Triton indexer writing [N, T] fp32, then the
# one-read top-k), DeepSeek fp8 numerics, causal ranges, k = 2048.
#   1. benchmarks/indexer_topk_gpu.py -> OUT_DIR/indexer_topk_h200.json: compiled edge cases
#      (conformance with the fused path forced at small sizes and with the defaults; a floor
#      above the k-th key, ties overflowing CAP, ties within CAP), then at 1024 x 512K,
#      4096 x 256K and 8192 x 512K the fused set against the plain path's (every row), device
#      ms (CUDA events, median) of plain indexer / plain top-k / both / fused, the exact pass
#      with every row flagged (256 x 512K), a launch sweep of the filter (8192 x 512K).
#   2. `cpkv bench long` at 512K in 64K chunks -> OUT_DIR/long_512k_h200.json: the
#      long_512k_topk_share row with the fused path on (a fused chunk's filter kernel counts as
#      the indexer, its sample indexer, floor, select and exact kernels as top-k).
# Run from the repository root with .whl carried (gpu-wheels); ~4-5 minutes.
#
# Predictions (written before any run; plain figures from docs/perf.md):
#   - edge: every entry true; the forced cases flag what they force (floor_too_high and
#     ties_overflow: all 12 rows; ties_within_cap: 0).
#   - sets_equal, no_host_sync true, rows_differ 0 in all three cases (the filter computes the plain
#     kernel's logits with the same dots in the same order); flagged_rows 0 (random inputs).
#   - 1024 x 512K: plain indexer ~10 ms, plain top-k ~2.2 ms (share ~0.22 at this row count),
#     plain ~12.2, fused ~10.6 (share ~0.05, 1.15x). 4096 x 256K: indexer ~19 ms, top-k ~4,
#     fused ~20 (share ~0.05). 8192 x 512K: indexer ~78 ms, top-k ~17, fused ~81 (share ~0.04,
#     1.17x). The fused share's risk: the filter's epilogue (a cumsum and scattered int64
#     stores per tile) and fewer, longer programs (16-64 splits x row blocks instead of one
#     program per tile) cost more than the logits' store saved: fused >= plain indexer x 1.1
#     would say so, and the sweep says whether more programs help.
#   - flagged (every row of 256 x 512K exact): ~40 ms (20-100): each flagged row recomputes
#     its logits 5 times on one SM (~10 ms alone), so one flagged row in a chunk costs ~10 ms.
#   - recent (1024 x 512K, each row's candidates crowding its last split): ROW_SHARE_PCT 0
#     (CAP 1024) and 50 (CAP 4096) flag most rows (~100+ ms a call), 100 (CAP 8192) none
#     (~11 ms); if so ROW_SHARE_PCT 100 becomes the default where the sweep allows it.
#   - sweep: PROGRAMS 4096 (SPLIT_MIN 4096) within ~5 % of 1024 at 8192 rows, faster at 1024
#     rows (256 -> 1024 programs); num_warps 8 no better than 4 (the indexer's measured best).
#   - bench long: long_512k_topk_share ~0.02-0.03 (from 0.134: 250 ms of top-k kernels ->
#     ~15 ms sample indexer + ~10 ms floor + ~21 ms select per 2-layer chunk), long_512k_fp8_mfu
#     up by the top-k time saved (~+0.01-0.02).
#
# Usage: bash benchmarks/session11_topk_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout 240 "$py" benchmarks/indexer_topk_gpu.py "$out/indexer_topk_h200.json" 2>&1 \
  | tee "$out/indexer_topk.log" | tail -30
timeout 200 "$py" -m cpkv.cli bench long --out "$out/long_512k_h200.json" --tokens 524288 \
  --chunks 65536 --fixed-budget-mb 0 --recall-tokens "" --hf-tokens 0 --no-bf16-compare \
  2>&1 | tee "$out/long_512k.log" | tail -20
