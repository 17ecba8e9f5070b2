#!/usr/bin/env bash
# Session 19, one GPU call (.whl with --flashmla, .dg): the index-query op's GPU tests
# (conformance, DeepSeek's shape), then every issue-38 row,
# the clock probe and the decode profile (benchmarks/session18_final_gpu.sh).
# Usage: bash benchmarks/session19_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" > /dev/null
timeout 45 "$py" -m pytest tests/test_triton_quant.py -m gpu -q -p no:cacheprovider --tb=short \
  2>&1 | tail -3
bash benchmarks/session18_final_gpu.sh "$1"
