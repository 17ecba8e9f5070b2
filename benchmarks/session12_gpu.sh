#!/usr/bin/env bash
# One H200 call (issues 36 and 37): the GPU tests of GLM-5 and the embedding seams (FlashMLA on
# GLM-5's 64 heads, interleaved rope, DeepGEMM and FlashMLA reading the two-part layout in place,
# the engine example on CUDA CP1 and CP2 with two Gloo ranks sharing the GPU), a GLM-5-attention
# checkpoint through `cpkv run --device cuda` against its one-rank reference (prefill only:
# --decode-tokens 0), and `cpkv bench long --preset glm5-attention` at 1M in 64K chunks.
# Predicted: tests pass; the run's logits within its bf16 tolerance; 1M defaults ~8-12 s (a
# quarter of v32-attention's indexer FLOPs: 32 index heads, every other layer shared).
# Usage: bash benchmarks/session12_gpu.sh OUT_DIR tests   (with .whl and .dg carried; ~7 min)
#        bash benchmarks/session12_gpu.sh OUT_DIR long    (with .whl; ~7 min)
part=${2:?tests or long}
if [ "$part" = tests ]; then source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
else source benchmarks/gpu_setup.sh "${1:?OUT_DIR}"; fi
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
if [ "$part" = tests ]; then
timeout 330 "$py" -m pytest tests/test_glm5_gpu.py tests/test_triton_rope.py tests/test_gpu_placement.py \
  tests/test_embed_gpu.py tests/test_cuda_backend.py -v -rs -p no:cacheprovider --tb=short \
  2>&1 | tee "$out/gpu_tests.log" | tail -40
exit 0
fi
"$py" -m cpkv.cli init-model /tmp/glm5-att --preset glm5-attention 2>&1 | tail -2
timeout 150 "$py" -m cpkv.cli run --device cuda --model /tmp/glm5-att --decode-tokens 0 \
  --report "$out/glm5_run_h200.json" 2>&1 | tee "$out/glm5_run.log" | tail -25
timeout 420 "$py" -m cpkv.cli bench long --preset glm5-attention --tokens 1048576 --chunks 65536 \
  --fixed-budget-mb 0 --recall-tokens 4096,65536 --out "$out/long_glm5_h200.json" \
  2>&1 | tee "$out/long_glm5.log" | tail -40
