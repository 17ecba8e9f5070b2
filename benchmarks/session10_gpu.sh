#!/usr/bin/env bash
# One H200 call over the merged tree (issues 36 and 37's GPU checks): DeepGEMM built, the
# embedding GPU tests (DeepGEMM's paged indexer and FlashMLA's fp8 sparse decode reading the
# engines' two-part layout in place, the engine example on CUDA CP1/CP2, a decode write in a CUDA
# graph), and a GLM-5-attention checkpoint through `cpkv run --device cuda` against its one-rank
# reference. Usage: bash benchmarks/session10_gpu.sh OUT_DIR   (with .whl and .dg carried)
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
timeout 180 "$py" -m pytest tests/test_embed_gpu.py -v -rs -p no:cacheprovider --tb=short \
  2>&1 | tee "$out/embed_gpu_tests.log" | tail -20
"$py" -m cpkv.cli init-model /tmp/glm5-att --preset glm5-attention 2>&1 | tail -2
timeout 150 "$py" -m cpkv.cli run --device cuda --config examples/one_gpu.toml --model /tmp/glm5-att \
  --report "$out/glm5_run_h200.json" 2>&1 | tee "$out/glm5_run.log" | tail -25
