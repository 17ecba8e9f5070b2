# Exploration behind docs/perf.md (one H200): fp8_unpack mismatches, KV kernels eager vs device
# time, sparse-MLA launch configurations, the copy kernels' launch shape.
set -e
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PYTHONPATH
SECS=${SECS:-fp8diag kv mla kvtune}
for s in $SECS; do
  timeout 240 python3 benchmarks/gpu_explore.py $s > $OUT/explore_$s.jsonl 2>$OUT/explore_$s.err || echo "$s rc=$?"
  tail -3 $OUT/explore_$s.err | grep -v Warning || true
done
python3 - <<'PY'
import json, os, glob
for p in sorted(glob.glob(os.path.join(os.environ["OUT"], "explore_*.jsonl"))):
    for line in open(p):
        try:
            r = json.loads(line)
        except Exception:
            continue
        if r.get("sec") == "fp8diag":
            r["examples"] = r["examples"][:2]
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
PY
