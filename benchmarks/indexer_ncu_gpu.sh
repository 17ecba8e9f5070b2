#!/usr/bin/env bash
# One GPU (.whl carried; ~1 min): Nsight Compute's issue-slot use and stall reasons of the
# prefill indexer at its tuned launch (benchmarks/indexer_profile_gpu.py; TRITON_CPKV_TUNING
# overrides the launch, e.g. INDEXER.num_stages=4) -> OUT_DIR/ncu_stalls.csv. Session 16's run:
# benchmarks/results/session16/ncu_stalls_h100.csv (docs/perf.md).
# Usage: bash benchmarks/indexer_ncu_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}"
m="regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$"
m="$m,smsp__warps_active.avg.per_cycle_active,smsp__issue_active.avg.pct_of_peak_sustained_active"
timeout 90 ncu --csv --page raw --metrics "$m" -k regex:_indexer_kernel \
  "$py" benchmarks/indexer_profile_gpu.py > "$out/ncu_stalls.csv" 2> "$out/ncu.err"
echo "ncu rc $?"; tail -2 "$out/ncu.err"
