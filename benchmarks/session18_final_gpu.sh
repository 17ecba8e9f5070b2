#!/usr/bin/env bash
# Session 18, the rows call (one GPU, .whl with --flashmla, .dg): every issue-38 row at today's
# defaults (benchmarks/issue38_rows_gpu.sh, long now with its _sustained twin rows), then the SM
# clock and power probe (cpkv's and DeepGEMM's indexers) and the decode step's kernel profile.
# Usage: bash benchmarks/session18_final_gpu.sh OUT_DIR
bash benchmarks/issue38_rows_gpu.sh "${1:?OUT_DIR}"
source benchmarks/gpu_setup.sh "$1" > /dev/null
export PYTHONPATH=/tmp/dg:/tmp/site LD_LIBRARY_PATH=$PWD/.dg/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
timeout 60 "$py" benchmarks/clock_probe_gpu.py "$out/clock_probe.json" 2>&1 | grep phase
timeout 60 "$py" benchmarks/decode_profile_gpu.py "$out/decode_profile.json" 64 131072 2>&1 \
  | grep -v Warn | tail -8
