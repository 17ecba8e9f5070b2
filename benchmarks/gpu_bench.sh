# The GPU benchmark run of docs/perf.md (2x H200): install the wheels built by
# ../shared/tools/gpu-wheels, then `cpkv bench gpu`.
set -e
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m cpkv.cli bench gpu --out $OUT/gpu_h200.json --sizes ${SIZES:-16384,65536,131072} --layers ${LAYERS:-2} 2>&1 | grep -v "debug \|cpkv.fallback" | tail -40
