#!/usr/bin/env bash
# Session 22's second call (.whl; any card, ~8 min):
# 1. the decode top-k's filter: benchmarks/topk_filter_sweep_gpu.py (PREFETCH, block, warps,
#    splits; a read-only kernel over the same grid) and the Gluon filter's GPU equality tests;
# 2. the ABS_PARTS decision (docs/perf.md, session 20): benchmarks/numerics_vs_transformers.py
#    on the GPU (transformers' bf16 forward of the 2-layer v32-attention stack, 4096-token
#    prompts) with the table's indexer (ABS_PARTS 0) and with ABS_PARTS 3, the same seeds and
#    prompts.
# Usage: bash benchmarks/session22b_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" > /dev/null
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
timeout 120 "$py" benchmarks/topk_filter_sweep_gpu.py "$out/topk_filter_sweep.json" 2>&1 \
  | grep -v Warn | tail -16
timeout 60 "$py" -m pytest tests/test_triton_attention.py -m gpu -k gluon_filter -q \
  -p no:cacheprovider --tb=short 2>&1 | tail -2
for parts in 0 3; do
  t0=$SECONDS
  TRITON_CPKV_TUNING="INDEXER.ABS_PARTS=$parts" timeout 200 "$py" \
    benchmarks/numerics_vs_transformers.py --device cuda --tokens 4096 --seeds 2 --prompts 2 \
    --out "$out/numerics_cuda_parts$parts.json" 2>&1 | grep -v "^{" | tail -9
  echo "ABS_PARTS $parts: $((SECONDS - t0)) s"
done
