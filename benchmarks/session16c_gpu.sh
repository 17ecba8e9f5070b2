#!/usr/bin/env bash
# One H100/H200 (.whl from `gpu-wheels --flashmla`, .dg from `gpu-deepgemm`; ~9 min): the prefill
# indexer's SPLIT (relu(s) = (s + |s|) / 2: 64 FFMA with |s| folded in a head a warp where relu
# costs 64 FMNMX + 64 FFMA; the head loop's SASS 140 instructions against 203, compiled here).
# Steps: its GPU tests; the launch sweep against the default and DeepGEMM
# (indexer_ws_gpu.py: predictions in its header: 1.10-1.25x the default at the large shapes if
# the CUDA cores' issue limits the kernel); Nsight Compute on both kernels (issue slots, tensor
# pipe, stalls); `python -m cpkv_backend_cuda.bench` with INDEXER.SPLIT=1 (indexer_fp8_vs_deepgemm:
# predicted ~1.2-1.3 from 1.04-1.08); `cpkv bench long` with it (long_1m_fp8_mfu 0.53 -> ~0.6;
# long_512k_topk_share 0.13 -> ~0.15, the same top-k over a faster indexer).
# Usage: bash benchmarks/session16c_gpu.sh OUT_DIR
source benchmarks/gpu_setup.sh "${1:?OUT_DIR}" deepgemm
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
timeout 120 "$py" -m pytest tests/test_triton_attention.py -q -rA -p no:cacheprovider --tb=short \
  -k "split" 2>&1 | tee "$out/split_tests.log" | tail -4
timeout 200 "$py" benchmarks/indexer_ws_gpu.py "$out/indexer_split.json" 2>&1 | tail -26
timeout 90 ncu --csv --page details --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section SchedulerStats --section WarpStateStats -k regex:_indexer_kernel \
  "$py" benchmarks/indexer_profile_gpu.py > "$out/ncu.csv" 2> "$out/ncu.err"; echo "ncu rc $?"
tail -3 "$out/ncu.err"
TRITON_CPKV_TUNING=INDEXER.SPLIT=1 timeout 150 "$py" -m cpkv_backend_cuda.bench \
  --out "$out/deepgemm_split.json" 2>&1 | grep -v "^prefill_\|^paged_" | tail -9
long=(--tokens 524288,1048576 --chunks 65536 --fixed-budget-mb 0 --recall-tokens "" --no-hf
      --hf-tokens 0 --no-bf16-compare)
TRITON_CPKV_TUNING=INDEXER.SPLIT=1 timeout 170 "$py" -m cpkv.cli bench long \
  --out "$out/long_split.json" "${long[@]}" 2>&1 | tail -14
