#!/usr/bin/env bash
# The GPU run of issue #15 (2 GPUs of one host): prefill CP1 on cuda:0 -> decode on cuda:1, a
# DeepSeek-V3.2-attention-sized stack (cpkv init-model --preset v32-attention, 16 layers), at 32K
# and 128K tokens: time to ready with transfer.pipeline = layer vs request vs the prefill alone,
# and each plugin's GB/s against a raw cuda:0 -> cuda:1 copy of the same bytes, same run.
# Writes OUT_DIR/transfer_h200_{nccl,mooncake_tcp,mooncake_nvlink}.json. Run from the repo root.
#
# Usage: bash benchmarks/transfer_gpu.sh [OUT_DIR] [extra cpkv bench transfer options]
#   BENCH_WHEELS  optional: a folder of wheels (shared/tools/gpu-wheels --mooncake) installed
#                 into a private folder put first on PYTHONPATH; without it the environment is used
#   PYTHON        the interpreter (default python3)
set -u
out=${1:-${BENCH_OUT:-benchmarks/results}}
if (($#)); then shift; fi
py=${PYTHON:-python3}
# keep NVLink multicast off (NCCL NVLS, symmetric memory, NVSHMEM): not every machine allows it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
if [[ -n ${BENCH_WHEELS:-} ]]; then
  site=$(mktemp -d)
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$BENCH_WHEELS"/*.whl
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$out"
"$py" -m cpkv.cli plugins || true   # says why mooncake is unavailable, if it is
# the CPU fault tests where they apply (Gloo + Mooncake over 127.0.0.1 with the CUDA wheel)
timeout 300 "$py" -m pytest tests/test_late_write.py tests/test_transfer_pipeline.py -q \
  -p no:cacheprovider -W default --tb=line || echo "transfer tests failed (rc=$?)" >&2
common=(--gpus --cp 1 --preset v32-attention --layers 16 --tokens 32768,131072 "$@")
timeout 900 "$py" -m cpkv.cli bench transfer "${common[@]}" --plugins nccl \
  --out "$out/transfer_h200_nccl.json" || echo "nccl run failed (rc=$?)" >&2
timeout 900 "$py" -m cpkv.cli bench transfer "${common[@]}" --plugins mooncake \
  --mooncake-protocol tcp --out "$out/transfer_h200_mooncake_tcp.json" \
  || echo "mooncake tcp run failed (rc=$?)" >&2
timeout 900 "$py" -m cpkv.cli bench transfer "${common[@]}" --plugins mooncake \
  --mooncake-protocol nvlink --out "$out/transfer_h200_mooncake_nvlink.json" \
  || echo "mooncake nvlink run failed (rc=$?)" >&2
