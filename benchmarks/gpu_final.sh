#!/usr/bin/env bash
# The GPU run of docs/perf.md (2 GPUs): the GPU tests (kernels, rope, models, two-GPU runs),
# then `cpkv bench gpu` -> OUT_DIR/gpu_h200.json. Run from the repository root.
#
# Usage: bash benchmarks/gpu_final.sh [OUT_DIR] [cpkv bench gpu options, e.g. --sizes 65536]
#   OUT_DIR       where the report goes (default: $BENCH_OUT, else benchmarks/results)
#   BENCH_WHEELS  optional: a folder of wheels (cpkv's distributions and whatever the machine
#                 lacks) installed into a private folder put first on PYTHONPATH, for a machine
#                 where cpkv is not installed; without it the current environment is used
#   PYTHON        the interpreter (default python3)
set -eu
out=${1:-${BENCH_OUT:-benchmarks/results}}
if (($#)); then shift; fi
py=${PYTHON:-python3}
# keep NVLink multicast off (NCCL NVLS, symmetric memory, NVSHMEM): not every machine allows it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [[ -n ${BENCH_WHEELS:-} ]]; then
  site=$(mktemp -d)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$BENCH_WHEELS"/*.whl
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$out"
# a failing GPU test is reported, and the benchmark still runs; the attention kernels' tests
# need hypothesis (not on the GPU machine: add its cp312 wheel to BENCH_WHEELS)
tests=(tests/test_triton_kv.py tests/test_triton_rope.py tests/test_gpu.py tests/test_models.py
       tests/test_torch_ops.py tests/test_prefill.py)
if "$py" -c "import hypothesis" 2>/dev/null; then tests+=(tests/test_triton_attention.py); fi
timeout 420 "$py" -m pytest "${tests[@]}" -m gpu -q \
  -p no:cacheprovider -W default --tb=line || echo "GPU tests failed (rc=$?)" >&2
"$py" -m cpkv.cli bench gpu --out "$out/gpu_h200.json" "$@"
