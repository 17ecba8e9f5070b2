#!/usr/bin/env bash
# Issue 34's GPU run (one H200): the fp8 indexer's GPU tests (conformance of the Triton fp8
# indexer and fp8 pack, the no-host-sync layer loop with the default numerics), then
# `cpkv bench long` and `cpkv bench gpu` with the default numerics -> OUT_DIR/long_h200.json,
# OUT_DIR/gpu_h200_1gpu.json. Run from the repository root.
#
# Usage: bash benchmarks/indexer_fp8_gpu.sh OUT_DIR
#   BENCH_WHEELS  optional: a folder of wheels installed into a private folder first on PYTHONPATH
set -u
out=${1:?OUT_DIR}
py=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
if [[ -n ${BENCH_WHEELS:-} ]]; then
  site=$(mktemp -d)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$BENCH_WHEELS"/*.whl || exit 1
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 100 "$py" -m pytest tests/test_triton_attention.py tests/test_triton_kv.py \
  tests/test_fp8_numerics.py tests/test_gpu.py -m "gpu and not multiprocess" -q \
  -k "conformance or bit_exact or no_host_sync or fp8" -p no:cacheprovider --tb=short \
  2>&1 | tee "$out/gpu_tests.log" | tail -30
timeout 330 "$py" -m cpkv.cli bench long --out "$out/long_h200.json" \
  --tokens 262144,524288,1048576 --chunks 65536 --fixed-budget-mb 0 2>&1 | tail -40
timeout 140 "$py" -m cpkv.cli bench gpu --out "$out/gpu_h200_1gpu.json" \
  --sizes 65536,131072 --prefetch-prefix 0 2>&1 | tail -30
