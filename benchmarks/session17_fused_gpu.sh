#!/usr/bin/env bash
# Issue 38 item 3 on one GPU: the fused indexer top-k rebuilt (session 17: the plain indexer's
# grid and tiles, the candidate append as inline PTX in the epilogue, an order-free select that
# sorts its k columns) against the plain path (the Triton indexer writing [N, T] fp32 logits,
# then the one-read top-k with the Gluon filter), DeepSeek fp8 numerics, causal ranges, k = 2048.
#   1. benchmarks/indexer_topk_gpu.py -> OUT/indexer_topk.json (edge cases compiled, three
#      shapes: sets / outputs equal, no host sync, plain indexer / plain top-k / fused ms, the
#      filter kernel over the plain indexer kernel, flagged rows' cost, a recency bias).
#   2. `cpkv bench long` at 512K in 64K chunks, plain (the table's MIN_T, off) then fused
#      (TRITON_CPKV_TUNING=INDEXER_TOPK.MIN_T=196608): long_512k_topk_share and _fp8_mfu.
# Run from the repository root with .whl carried (gpu-wheels --flashmla); ~6-8 minutes.
#
# Predictions (before the run; H100 figures from session 16):
#   - edge: every entry true; sets_equal and outputs_equal true, rows_differ 0, flagged 0,
#     no_host_sync true in every case; recent: 0 rows flagged (a row's CAP does not depend on
#     where its candidates lie).
#   - filter_over_indexer 1.02-1.05 (the append adds ~2 % of the tile's instructions; 164
#     registers, 3 CTAs an SM as the plain kernel); session 11's filter was 1.21-1.25.
#   - fused_speedup (plain / fused) 1.04-1.08 at 8192 x 512K: plain = indexer x ~1.13, fused =
#     indexer x (filter ~1.03 + sample 0.008 + floor ~0.01 + select ~0.02).
#   - bench long 512K: long_512k_topk_share 0.131 plain -> ~0.03-0.04 fused (the filter counts
#     as the indexer); long_512k_fp8_mfu up ~0.02-0.04.
#
# Usage: bash benchmarks/session17_fused_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$out/gpu.txt"
timeout 300 "$py" benchmarks/indexer_topk_gpu.py "$out/indexer_topk.json" 2>&1 \
  | tee "$out/indexer_topk.log" | tail -14
long=(--tokens 524288 --chunks 65536 --fixed-budget-mb 0 --recall-tokens "" --no-hf
      --hf-tokens 0 --no-bf16-compare)
timeout 120 "$py" -m cpkv.cli bench long --out "$out/long_plain.json" "${long[@]}" 2>&1 \
  | tail -8
TRITON_CPKV_TUNING=INDEXER_TOPK.MIN_T=196608 timeout 120 "$py" -m cpkv.cli bench long \
  --out "$out/long_fused.json" "${long[@]}" 2>&1 | tail -8
