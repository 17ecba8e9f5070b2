# Sourced first by a session's one-call script (`source benchmarks/by_card_gpu.sh OUT_DIR`):
# on an H200 it runs every issue-38 row (benchmarks/issue38_rows_gpu.sh into OUT_DIR/rows,
# ~9 min; .whl and .dg carried) in place of the caller; on another card it prints the card
# and returns, and the caller's own steps run.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $gpu"
if [[ $gpu == *H200* ]]; then
  exec bash benchmarks/issue38_rows_gpu.sh "${1:?OUT_DIR}/rows"
fi
