#!/usr/bin/env bash
# Installs what building and testing meshla needs on a fresh Debian machine with the CUDA toolkit
# (nvcc, cuBLASLt, NCCL), then builds and installs the package. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
command -v nvcc >/dev/null 2>&1 || {
  echo "setup: nvcc not found; meshla needs the CUDA toolkit (13.x) with NCCL to build" >&2
  exit 1
}

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
command -v clang-format >/dev/null 2>&1 || missing+=(clang-format)
[ -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] || [ -f /usr/lib/cmake/GTest/GTestConfig.cmake ] || missing+=(libgtest-dev)
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

python3 -m pip install -q --disable-pip-version-check \
  "torch>=2.4" jax optax numpy pytest ruff "nanobind>=2.0" "scikit-build-core>=0.10" "nvidia-cutlass==4.2.*" \
  "nvidia-nvml-dev==13.*" mkdocs mkdocstrings-python pymdown-extensions
# cuBLASMp's header builds the optional cuBLASMp backend; 0.7 is the last release that runs on
# NCCL 2.28. --no-deps: its NCCL, cuBLAS and NVSHMEM come with PyTorch or the CUDA toolkit.
python3 -m pip install -q --disable-pip-version-check --no-deps "nvidia-cublasmp-cu13==0.7.*"
# cuSOLVERMp's header builds the process solver's engine; 0.8 is the last release on NCCL 2.28.
python3 -m pip install -q --disable-pip-version-check --no-deps "nvidia-cusolvermp-cu13==0.8.*"
# One build for the package and the C++ unit tests (scripts/test.sh runs them from it), in
# build/<wheel tag>. Its steps are shown as they go ([done/total] what), the whole log kept.
echo "setup: building meshla (the CUDA kernels take several minutes on a few cores)"
mkdir -p build
log=build/setup.log
status=0
python3 -m pip install -v --disable-pip-version-check --no-build-isolation --no-deps \
  --config-settings=cmake.define.MESHLA_BUILD_TESTS=ON . 2>&1 | tee "$log" |
  { grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\] ' || true; } || status=$?
[ "$status" -eq 0 ] ||
  { echo "setup: the build failed; its last lines (all of it in $log):"; tail -40 "$log"; exit 1; }
python3 -c "import meshla; print('setup: meshla installed at', meshla.__file__)"
