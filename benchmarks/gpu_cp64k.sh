# CP2 vs CP1 at 64K only (after the per-batch host work change); 2x H200.
set -e
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
export PYTHONPATH=/tmp/site:$PYTHONPATH
python3 -m cpkv.cli bench gpu --out $OUT/gpu_h200_64k.json --sizes 65536 --prefetch-prefix 0 2>&1 | grep -E "cp2_vs|kv_bytes|wrote" | head
python3 -c "
import json, os; d=json.load(open(os.path.join(os.environ['OUT'], 'gpu_h200_64k.json')))['detail']['prefill']
for c, v in d.items(): print(c, [(r['sizes']['65536']['seconds'], r['sizes']['65536']['phases']['plan']) for r in v])"
