#!/usr/bin/env bash
# One H100/H200 (.whl from `gpu-wheels --flashmla`; ~6 min): the long-row top-k's filter in
# Gluon (cpkv_backend_triton/topk_filter_gluon.py, tuning TOPK_LONG GLUON, off until this run).
# Session 15 measured the Triton filter at 1.5-1.7 TB/s on an H100 (copy 3.0): bound by its
# instructions (the coalesced layout's block scan is 8 warp scans, ~680 PTX lines a block);
# the Gluon kernel keeps 8 consecutive columns a thread (2 16-byte loads, one warp scan, ~240
# lines, 37 registers, no shared-memory conversion; compiled here for sm90 with Triton 3.9 and
# 3.6). Predictions: the filter 1.7x faster (4096 x 480K 4.50 -> ~2.7 ms, 1024 x 480K 1.22 ->
# ~0.75, a decode layer 0.045 -> ~0.03 ms); long_512k_topk_share 0.20 -> ~0.14 on an H100
# (the logits' bytes alone are 0.08), long_1m_fp8_mfu 0.51 -> ~0.53. If it holds: GLUON = 1 in
# tuning.py's TOPK_LONG row (and the H200's rows rerun).
#
# Steps: the Gluon filter's GPU test (bit-equal to the Triton filter) and the top-k GPU tests;
# the sweep (table vs gluon variants, exact against torch.topk); `cpkv bench long` at 512K / 1M
# with the table and with TRITON_CPKV_TUNING=TOPK_LONG.GLUON=1 (the ranks inherit it); the
# decode step with GLUON=1.
# Usage: bash benchmarks/session16_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 90 "$py" -m pytest tests/test_triton_attention.py -q -rA -p no:cacheprovider --tb=short \
  -k "gluon or (topk and gpu)" 2>&1 | tee "$out/topk_gpu_tests.log" | tail -6
timeout 120 "$py" benchmarks/topk_sweep_gpu.py "$out/topk_sweep.json" 2>&1 | tail -24
long=(--tokens 524288,1048576 --chunks 65536 --fixed-budget-mb 0 --recall-tokens "" --no-hf
      --hf-tokens 0 --no-bf16-compare)
timeout 150 "$py" -m cpkv.cli bench long --out "$out/long_table.json" "${long[@]}" 2>&1 | tail -12
TRITON_CPKV_TUNING=TOPK_LONG.GLUON=1 timeout 150 "$py" -m cpkv.cli bench long \
  --out "$out/long_gluon.json" "${long[@]}" 2>&1 | tail -12
TRITON_CPKV_TUNING=TOPK_LONG.GLUON=1 timeout 70 "$py" -m cpkv.cli bench decode --batches 64 \
  --contexts 131072 --no-mtp --out "$out/decode_gluon.json" 2>&1 | tail -6
