#!/usr/bin/env bash
# Issue 34's second GPU call (one H200): the fp8 indexer's GPU tests with their own time, and
# the defaults' logits across two chunkings (`cpkv bench long` at 256K in 64K and 128K chunks)
# -> OUT_DIR/gpu_tests_v.log, OUT_DIR/long_h200_chunkings.json. Run from the repository root.
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
timeout 240 "$py" -m pytest -v -rA --durations=15 -p no:cacheprovider --tb=short \
  "tests/test_triton_attention.py::test_conformance_gpu" \
  tests/test_triton_kv.py tests/test_fp8_numerics.py tests/test_gpu.py \
  -m "gpu and not multiprocess" -k "not sparse_mla and (conformance or bit_exact or no_host_sync)" \
  2>&1 | tee "$out/gpu_tests_v.log" | tail -45
timeout 200 "$py" -m cpkv.cli bench long --out "$out/long_h200_chunkings.json" \
  --tokens 262144 --chunks 65536,131072 --fixed-budget-mb 0 --recall-tokens "" \
  --no-bf16-compare 2>&1 | tail -12
