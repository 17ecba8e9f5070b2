# Kernel detail behind docs/perf.md: the Triton backend's own sweeps (launch configs, precision
# modes, same-size copies). One H200.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PYTHONPATH
timeout 250 python3 -m cpkv_backend_triton.bench_attention --sweep > $OUT/attention_sweep.jsonl 2>$OUT/attention_sweep.err || echo "attention sweep rc=$?"
timeout 150 python3 -c "
import json, sys
from cpkv_backend_triton.bench import bench_kv
for r in bench_kv('cuda'): print(json.dumps(r))
" > $OUT/kv_bench.jsonl 2>$OUT/kv_bench.err || echo "kv bench rc=$?"
python3 - <<'PY'
import json, os
for f in ("attention_sweep.jsonl", "kv_bench.jsonl"):
    p = os.path.join(os.environ["OUT"], f)
    for line in open(p):
        try:
            r = json.loads(line)
        except Exception:
            continue
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
PY
