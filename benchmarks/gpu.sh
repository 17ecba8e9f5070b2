#!/usr/bin/env bash
# The GPU driver: runs any subset of the benchmarks behind docs/perf.md in one device call.
#
# Command: bash benchmarks/gpu.sh OUT_DIR STEP...   (from the repository root; `all1` = every
#          one-GPU step, `all2` = every two-GPU step)
# Card:    any CUDA GPU; the card is read once (nvidia-smi) and names every report:
#          OUT_DIR/<bench>_<card>.json (<card> = h100, h200, ...; <card>x2 for two-GPU benches),
#          the name docs/perf.md cites under benchmarks/results/ (copy the files there).
# Writes:  OUT_DIR/card.txt (the card line), OUT_DIR/<step>.log (each step's output), the reports.
# Carry:   .whl (../shared/tools/gpu-wheels --flashmla; --mooncake for `transfer`): installed into
#          /tmp/site first. Steps marked [dg] also need .dg (../shared/tools/gpu-deepgemm):
#          DeepGEMM is built once (~2 min) before the first of them. Without .whl the current
#          environment is used.
#
# Steps (one GPU unless marked 2):
#   tests                every `gpu` test but the Triton backend's (pytest -m gpu, ~8 min)
#   tests_triton         the Triton backend's `gpu` tests (tests/test_triton_*.py, ~6 min)
#   job128k              cpkv run --device cuda --cp 1 --decode-tokens 0, one 131,072-token prompt,
#                        run.reference off / full / sample -> job128k_<mode>_<card>.json (the
#                        reports: CP prefill and reference seconds side by side)
#   gpu                  cpkv bench gpu --sizes 65536,131072   -> gpu_<card>[x2].json (2 GPUs: CP2)
#   layouts              cpkv bench gpu --skip-prefill          -> gpu_layouts_<card>.json
#   transfer (2)         cpkv bench transfer --gpus, nccl and mooncake tcp
#                                                -> transfer_{nccl,mooncake}_<card>x2.json
#   mtp (2)              cpkv bench mtp                         -> mtp_<card>x2.json
#   host                 cpkv bench host                        -> host_<card>.json
#   decode               cpkv bench decode                      -> decode_<card>.json
#   decode_profile       benchmarks/decode_profile_gpu.py 64 x 128K -> decode_profile_<card>.json
#   long                 cpkv bench long (256K-1M, recall, bf16 compare) -> long_<card>.json
#   long_glm5            cpkv bench long --preset glm5-attention -> long_glm5_<card>.json
#   memory               benchmarks/memory_peak_gpu.py          -> memory_peak_<card>.json
#   rows [dg]            the target rows: deepgemm, long_rows, decode_64x128k, first_pass (below)
#   deepgemm [dg]        python -m cpkv_backend_cuda.bench      -> deepgemm_<card>.json
#   long_rows            cpkv bench long at 512K / 1M, rows only -> long_rows_<card>.json
#   decode_64x128k       cpkv bench decode --batches 64 --contexts 131072 -> decode_64x128k_<card>.json
#   first_pass           python -m cpkv.bench.first_pass, fresh compile caches, then cached only
#                                                -> first_pass_<card>.json, first_pass_cached_<card>.json
#   clock [dg optional]  benchmarks/clock_probe_gpu.py          -> clock_probe_<card>.json
#   indexer_topk         benchmarks/indexer_topk_gpu.py         -> indexer_topk_<card>.json
#   numerics             benchmarks/numerics_vs_transformers.py --device cuda
#                                                -> numerics_vs_transformers_<card>.json
#   topk_long            benchmarks/topk_long_gpu.py            -> topk_long_<card>.jsonl
#   v4_attention         benchmarks/v4_attention_gpu.py (FlashMLA's V4 kernel through cpkv vs
#                        called directly)                       -> v4_attention_<card>.json
#   long_v4              cpkv bench long --preset v4-flash-attention, 128K and 1M in chunks of 64K
#                                                               -> long_v4flash_<card>.json
#   indexer_sweep, indexer_paged_sweep [dg], topk_long_sweep, topk_long_decode_sweep,
#   indexer_topk_sweep   the tuning tables' sweeps (benchmarks/<step>_gpu.py) -> <step>_<card>.json
#   (not a step: python benchmarks/plot_gpu.py OUT_DIR/gpu_<card>x2.json plots a report, no GPU)
set -u
out=${1:?usage: bash benchmarks/gpu.sh OUT_DIR STEP...}
shift
(($#)) || { echo "no step given: see the header of benchmarks/gpu.sh" >&2; exit 2; }
py=${PYTHON:-python3}
# keep NVLink multicast off (NCCL NVLS, symmetric memory, NVSHMEM): not every machine allows it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
mkdir -p "$out"

if compgen -G ".whl/*.whl" > /dev/null; then
  # --upgrade: a warm machine may hold an older install in /tmp/site
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# the card check, once: every report below is named after it
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader | tee "$out/card.txt"
card=$("$py" -c "from cpkv.bench import card_name; print(card_name())") || exit 1
ngpu=$(nvidia-smi -L | wc -l)
echo "card: $card, GPUs: $ngpu"

dg_built=0
deepgemm() {  # build DeepGEMM from .dg once and put it on the paths
  ((dg_built)) && return 0
  [[ -f .dg/build.sh ]] || { echo "no .dg carried: DeepGEMM steps skipped" >&2; return 1; }
  local t0=$SECONDS
  timeout 240 bash .dg/build.sh > "$out/dg_build.log" 2>&1 || { echo "DeepGEMM build failed" >&2; return 1; }
  echo "DeepGEMM build: $((SECONDS - t0)) s"
  export PYTHONPATH=/tmp/dg:$PYTHONPATH LD_LIBRARY_PATH=$PWD/.dg/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  dg_built=1
}
two_gpus() { ((ngpu >= 2)) || { echo "$1 needs two GPUs: skipped" >&2; return 1; }; }
cpkv() { "$py" -m cpkv.cli "$@"; }
rows_only=(--recall-tokens "" --no-hf --hf-tokens 0 --no-bf16-compare)

step() {
  case $1 in
    tests)
      timeout 560 "$py" -m pytest tests/ --ignore-glob 'tests/test_triton_*' -m gpu -v -rfE \
        -p no:cacheprovider -o unmarked_test_limit_s=0 --durations=15 ;;
    tests_triton)
      timeout 560 "$py" -m pytest tests/test_triton_*.py -m gpu -v -rfE \
        -p no:cacheprovider -o unmarked_test_limit_s=0 --durations=15 ;;
    job128k)
      local r
      "$py" -c "import json; json.dump([[(i * 7919) % 512 for i in range(131072)]], open('/tmp/p128k.json', 'w'))"
      for r in off full sample; do
        timeout 200 cpkv run --device cuda --cp 1 --decode-tokens 0 --prompts /tmp/p128k.json \
          --reference "$r" --report "$out/job128k_${r}_$card.json" 2> "$out/job128k_$r.err" | tail -4
      done ;;
    gpu)
      local x=""; ((ngpu >= 2)) && x=x2
      timeout 300 cpkv bench gpu --sizes 65536,131072 --prefetch-prefix 0 --out "$out/gpu_${card}${x}.json" ;;
    layouts)
      timeout 150 cpkv bench gpu --skip-prefill --prefetch-prefix 0 --out "$out/gpu_layouts_$card.json" ;;
    transfer)
      two_gpus transfer || return 0
      local common=(--gpus --cp 1 --preset v32-attention --layers 16 --tokens 32768)
      timeout 600 cpkv bench transfer "${common[@]}" --plugins nccl --out "$out/transfer_nccl_${card}x2.json"
      timeout 600 cpkv bench transfer "${common[@]}" --plugins mooncake --mooncake-protocol tcp \
        --out "$out/transfer_mooncake_${card}x2.json" ;;
    mtp)
      two_gpus mtp || return 0
      timeout 300 cpkv bench mtp --out "$out/mtp_${card}x2.json" ;;
    host) timeout 120 cpkv bench host --out "$out/host_$card.json" ;;
    decode) timeout 300 cpkv bench decode --out "$out/decode_$card.json" ;;
    decode_profile)
      timeout 90 "$py" benchmarks/decode_profile_gpu.py "$out/decode_profile_$card.json" 64 131072 ;;
    long) timeout 500 cpkv bench long --tokens 262144,524288,1048576 --chunks 65536 \
            --fixed-budget-mb 0 --out "$out/long_$card.json" ;;
    long_glm5) timeout 300 cpkv bench long --preset glm5-attention --tokens 1048576 --chunks 65536 \
                 --fixed-budget-mb 0 --recall-tokens 4096,65536 --out "$out/long_glm5_$card.json" ;;
    memory) timeout 200 "$py" benchmarks/memory_peak_gpu.py "$out/memory_peak_$card.json" ;;
    rows) local s; for s in deepgemm long_rows decode_64x128k first_pass; do run "$s"; done ;;
    deepgemm)
      deepgemm || return 0
      timeout 150 "$py" -m cpkv_backend_cuda.bench --out "$out/deepgemm_$card.json" ;;
    long_rows) timeout 200 cpkv bench long --tokens 524288,1048576 --chunks 65536 --fixed-budget-mb 0 \
                 "${rows_only[@]}" --out "$out/long_rows_$card.json" ;;
    decode_64x128k) timeout 90 cpkv bench decode --batches 64 --contexts 131072 --no-mtp \
                      --out "$out/decode_64x128k_$card.json" ;;
    first_pass)
      local cache; cache=$(mktemp -d)
      timeout 200 "$py" -m cpkv.bench.first_pass --out "$out/first_pass_$card.json" \
        --cache-dir "$cache" --tokens 1048576 --chunk 65536
      timeout 90 "$py" -m cpkv.bench.first_pass --out "$out/first_pass_cached_$card.json" \
        --cache-dir "$cache" --tokens 524288 --chunk 65536 --warmup 0 ;;
    clock)
      [[ -f .dg/build.sh ]] && deepgemm
      timeout 90 "$py" benchmarks/clock_probe_gpu.py "$out/clock_probe_$card.json" ;;
    indexer_topk) timeout 300 "$py" benchmarks/indexer_topk_gpu.py "$out/indexer_topk_$card.json" ;;
    v4_attention) timeout 200 "$py" benchmarks/v4_attention_gpu.py "$out/v4_attention_$card.json" ;;
    long_v4) timeout 500 cpkv bench long --preset v4-flash-attention --tokens 131072,1048576 \
               --chunks 65536 --out "$out/long_v4flash_$card.json" ;;
    numerics) timeout 300 "$py" benchmarks/numerics_vs_transformers.py --device cuda \
                --out "$out/numerics_vs_transformers_$card.json" ;;
    topk_long) timeout 150 "$py" benchmarks/topk_long_gpu.py "$out/topk_long_$card.jsonl" ;;
    indexer_sweep) timeout 300 "$py" benchmarks/indexer_sweep_gpu.py "$out/$1_$card.json" ;;
    topk_long_sweep) timeout 200 "$py" benchmarks/topk_long_sweep_gpu.py "$out/$1_$card.json" ;;
    indexer_topk_sweep) timeout 200 "$py" benchmarks/indexer_topk_sweep_gpu.py "$out/$1_$card.json" ;;
    indexer_paged_sweep)
      deepgemm
      timeout 200 "$py" benchmarks/indexer_paged_sweep_gpu.py --pages \
        "$out/indexer_paged_sweep_$card.json" 64 131072 ;;
    topk_long_decode_sweep)
      timeout 200 "$py" benchmarks/topk_long_decode_sweep_gpu.py "$out/$1_$card.json" \
        "$out/$1_best_$card.env" ;;
    all1) local s; for s in tests gpu layouts host decode decode_profile long memory rows clock \
            indexer_topk topk_long; do run "$s"; done ;;
    all2) local s; for s in gpu transfer mtp; do run "$s"; done ;;
    *) echo "unknown step $1: see the header of benchmarks/gpu.sh" >&2; return 2 ;;
  esac
}

run() {  # one step: its output to OUT_DIR/<step>.log and the tail here, its time and status
  local t0=$SECONDS rc
  echo "== $1"
  step "$1" > "$out/$1.log" 2>&1
  rc=$?
  tail -8 "$out/$1.log"
  echo "== $1: rc $rc, $((SECONDS - t0)) s"
}

for s in "$@"; do run "$s"; done
