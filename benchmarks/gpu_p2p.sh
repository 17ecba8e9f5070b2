# The GPU checks and kernel/materialization rows after the P2P materialization and the timing
# change (2x H200): GPU tests (fp8_unpack bit-exact at 64K, peer_gather conformance, P2P views on
# NCCL + symmetric memory, no host sync), the copy-kernel launch sweep, then
# `cpkv bench gpu --skip-prefill`.
set -e
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PYTHONPATH
timeout 330 python3 -m pytest tests/test_triton_kv.py tests/test_gpu.py -m gpu -q -p no:cacheprovider -W default --tb=short 2>&1 | grep -v "debug \|^  warn\|Warning" | tail -25 || echo "tests rc=$?"
timeout 120 python3 benchmarks/gpu_explore.py kvtune > $OUT/explore_kvtune.jsonl 2>$OUT/explore_kvtune.err || echo "kvtune rc=$?"
timeout 300 python3 -m cpkv.cli bench gpu --skip-prefill --out $OUT/gpu_kernels.json 2>&1 | grep -v "debug \|cpkv.fallback\|cpkv.kv.peer" | tail -20 || echo "bench rc=$?"
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "explore_kvtune.jsonl")
rows = [json.loads(l) for l in open(p) if l.startswith("{")]
best = sorted((r for r in rows if "gather" in r and isinstance(r.get("gather"), float)), key=lambda r: -r["gather"])[:6]
for r in rows[:1] + best:
    print({k: (round(v) if isinstance(v, float) else v) for k, v in r.items()})
PY
