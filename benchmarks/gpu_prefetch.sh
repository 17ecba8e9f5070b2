# The prefetch measurement of docs/perf.md alone (2x H200): a 64K-token cached prefix, then a
# 4096-token extend, with and without the side-stream prefetch; no kernel or CP rows.
set -e
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 benchmarks/prefetch_bench.py
