set -e
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())"
python3 -m cpkv.cli plugins 2>&1 | grep -E "triton|torch|cuda" | head -5
timeout 430 python3 -m pytest tests/test_triton_kv.py tests/test_triton_attention.py tests/test_gpu.py tests/test_torch_ops.py tests/test_torch_attention_ops.py -m gpu -q -p no:cacheprovider -W default --tb=line 2>&1 | tail -40 > $OUT/gpu_tests.txt || true
tail -40 $OUT/gpu_tests.txt
