#!/usr/bin/env bash
# Builds and installs meshla into the current Python on a GPU machine (no network needed there:
# scikit-build-core, nanobind and cmake come with the image).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -z "${NCCL_ROOT:-}" ] && [ ! -f "${CUDA_HOME:-/usr/local/cuda}/include/nccl.h" ]; then
  # NCCL from the nvidia-nccl wheel that PyTorch brings.
  NCCL_ROOT=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null || true)
  export NCCL_ROOT
fi
echo "NCCL_ROOT=${NCCL_ROOT:-<toolkit>}"
# CUTLASS headers carried from the nvidia-cutlass wheel (GPU machines have no PyPI).
if [ -z "${CUTLASS_INCLUDE_DIR:-}" ] && [ -f .deps/cutlass/include/cutlass/cutlass.h ]; then
  export CUTLASS_INCLUDE_DIR=$PWD/.deps/cutlass/include
fi
# cuBLASMp 0.7 carried as its wheel (.deps/nvidia_cublasmp_cu13-*.whl); its NCCL and NVSHMEM
# are the ones PyTorch brings. Without it the build leaves the cuBLASMp backend out. cuSOLVERMp
# 0.8 (.deps/nvidia_cusolvermp_cu13-*.whl): the process solver's engine (cho_solve_shard's
# engine="cusolvermp") and bench/cusolvermp_potrf. NVML's header
# (.deps/nvidia_nvml_dev-*.whl) is for a build here, where the toolkit lacks nvml.h.
for wheel in .deps/nvidia_cublasmp_cu13-*.whl .deps/nvidia_cusolvermp_cu13-*.whl \
  .deps/nvidia_nvml_dev-*.whl; do
  [ -f "$wheel" ] && python3 -m pip install --no-deps --no-index -q "$wheel" 2>&1
done
# A wheel carried in .whl/ (scripts/build_wheel.sh, built on a machine without a GPU for this
# Python) saves the build's minutes of device time; .whl/COMMIT names the tree it was built from.
if compgen -G ".whl/meshla-*.whl" >/dev/null; then
  echo "installing the carried wheel of $(cat .whl/COMMIT)"
  python3 -m pip install --no-deps --no-index --force-reinstall -q .whl/meshla-*.whl 2>&1
else
  python3 -m pip install --no-build-isolation --no-deps --no-index -q . 2>&1
fi
python3 -c "import meshla; print('meshla installed:', meshla.__file__)"
