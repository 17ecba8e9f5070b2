#!/usr/bin/env bash
# Issue 37 item 1 on one H200: every KV layout (token_major, part_major, two_part) on CUDA and
# the page-movement rows of `cpkv bench gpu` for each, then `cpkv run --device cuda` on a GLM-5
# attention checkpoint (per-layer page sizes, moved by Mooncake over CUDA IPC: issue 36's refusal
# gone) from token-major and from two-part prefill pools (re-laid out for the part-major decode
# pool while staged on the device).
# -> OUT_DIR/layouts_gpu_tests.log, gpu_layouts_h200.json, glm5_{token_major,two_part}_run.{log,json}.
# Run from the repository root with .whl carried (no DeepGEMM needed). About 5 minutes.
#
# Usage: bash benchmarks/session11_layout_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$SECONDS
timeout 100 "$py" -m pytest tests/test_layouts.py -q -rA -p no:cacheprovider --tb=short \
  -k cuda 2>&1 | tee "$out/layouts_gpu_tests.log" | tail -8
echo "tests: $((SECONDS - t0)) s"; t0=$SECONDS
# kernels only (no prefill, no prefetch): the *_64k_bw rows against a device copy of the bytes
timeout 150 "$py" -m cpkv.cli bench gpu --skip-prefill --prefetch-prefix 0 \
  --out "$out/gpu_layouts_h200.json" 2>&1 | tail -4
"$py" - "$out/gpu_layouts_h200.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    if r["name"].endswith("_64k_bw"):
        print(f"{r['name']:34s} {r['value']:8.0f} GB/s  vs copy {r['ratio']:.3f}")
PY
echo "bench: $((SECONDS - t0)) s"; t0=$SECONDS
"$py" -m cpkv.cli init-model /tmp/glm5-att --preset glm5-attention 2>&1 | tail -1
# issue 36's refused run (Mooncake with per-layer page sizes), then the same from two-part pools
for layout in token_major two_part; do
  CPKV_KV__LAYOUT=$layout timeout 120 "$py" -m cpkv.cli run --device cuda \
    --config examples/one_gpu.toml --model /tmp/glm5-att --report "$out/glm5_${layout}_run.json" \
    2>&1 | tee "$out/glm5_${layout}_run.log" | tail -6
  echo "run $layout: $((SECONDS - t0)) s"; t0=$SECONDS
done
