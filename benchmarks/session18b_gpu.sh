#!/usr/bin/env bash
# Session 18, second call (one GPU, .whl with --flashmla): the decode top-k's few-row launches
# (benchmarks/topk_decode_sweep_gpu.py), the decode row before / after them, the SM clock under
# the matmul and the indexer, the fused path's plain-path test alone (timed).
# Usage: bash benchmarks/session18b_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}"
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"
timeout 200 "$py" benchmarks/topk_decode_sweep_gpu.py "$out/topk_decode_sweep.json" 2>&1 | tail -20
few="TOPK_LONG.FEW_ROWS=256,TOPK_LONG.few_floor_warps=16,TOPK_LONG.few_select_warps=16"
few="$few,TOPK_LONG.few_SPLIT_MIN=8192,TOPK_LONG.few_CAP=2048,TOPK_LONG.HELD=8192"
for v in table few; do
  if [ $v = few ]; then export TRITON_CPKV_TUNING=$few; fi
  timeout 80 "$py" -m cpkv.cli bench decode --batches 64 --contexts 131072 --no-mtp \
    --out "$out/decode_$v.json" > /dev/null 2>&1
  "$py" -c "import json,sys; [print(sys.argv[2], r['name'], round(r['ratio'], 4)) for r in
json.load(open(sys.argv[1]))['results'] if r['name'].endswith('gpu_vs_bytes')]" \
    "$out/decode_$v.json" "$v"
done
unset TRITON_CPKV_TUNING
timeout 60 "$py" benchmarks/clock_probe_gpu.py "$out/clock_probe.json" 2>&1 | tail -6
timeout 200 "$py" -m pytest tests/test_triton_attention.py -q -p no:cacheprovider --durations=3 \
  -k "fused_indexer_topk_equals" 2>&1 | tail -6
