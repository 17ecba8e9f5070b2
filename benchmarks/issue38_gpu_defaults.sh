#!/usr/bin/env bash
# Issue 38's second GPU run (one H200), the defaults as chosen by the first run's measurements
# (the Triton prefill indexer; DeepGEMM not needed): the first pass of a fresh process over a
# 1M-token prompt after the warm-up (empty compile caches), and the decode step at 64 x 128K
# against reading its bytes once -> OUT_DIR/first_pass_fresh_defaults.json, decode_64x128k.json.
# Usage: bash benchmarks/issue38_gpu_defaults.sh OUT_DIR   (with .whl carried)
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}"
timeout 70 "$py" -m cpkv.cli bench decode --out "$out/decode_64x128k.json" --batches 64 \
  --contexts 131072 --no-mtp 2>&1 | tail -12
timeout 155 "$py" -m cpkv.bench.first_pass --out "$out/first_pass_fresh_defaults.json" \
  --cache-dir "$(mktemp -d)" --tokens 1048576 --chunk 65536 2>&1 | tail -4
