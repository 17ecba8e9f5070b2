# Sourced by the one-H200 scripts run from the repository root with .whl carried (and .dg for
# DeepGEMM): `source benchmarks/gpu_setup.sh OUT_DIR [deepgemm]`. Sets out and py, the NVLS
# switches, makes OUT_DIR, installs .whl into /tmp/site and puts it on PYTHONPATH; with
# `deepgemm` also builds DeepGEMM from .dg (its time printed) and puts it on the paths.
set -u
out=${1:?OUT_DIR}
py=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
mkdir -p "$out"
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
if [ "${2:-}" = deepgemm ]; then
  t0=$SECONDS
  timeout 200 bash .dg/build.sh > "$out/dg_build.log" 2>&1 || { echo "DeepGEMM build failed"; exit 1; }
  echo "DeepGEMM build: $((SECONDS - t0)) s"
  export PYTHONPATH=/tmp/dg:/tmp/site LD_LIBRARY_PATH=$PWD/.dg/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
