# GPU tests (copy kernels, P2P views and no host sync on 2 GPUs), then the benchmark
# (docs/perf.md). 2x H200.
set -e
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PYTHONPATH
timeout 300 python3 -m pytest tests/test_triton_kv.py tests/test_gpu.py -m gpu -q -p no:cacheprovider -W default --tb=line 2>&1 | grep -v "debug \|Warning" | tail -4 || true
python3 -m cpkv.cli bench gpu --out $OUT/gpu_h200.json 2>&1 | grep -v "debug \|cpkv.fallback\|cpkv.kv.peer" | tail -44
