#!/usr/bin/env bash
# Prepares, on a machine with PyPI, what a GPU machine (no PyPI) needs carried: the CUTLASS headers
# as .deps/cutlass/include and cuBLASMp's wheel in .deps/ (tests/gpu/build.sh), and a Python 3.12
# with what scripts/build_wheel.sh needs to build .whl/ for it. Safe to run again.
#   PYTHON=python3.12 scripts/fetch_carry.sh && PYTHON=python3.12 scripts/build_wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3.12}
# The GPU machines run jax 0.11.2; cuBLASMp 0.7 and cuSOLVERMp 0.8 are the last releases that run
# on their NCCL 2.28.
"$python" -m pip install -q --disable-pip-version-check "jax[cpu]==0.11.2" nanobind \
  scikit-build-core "nvidia-cutlass==4.2.*"
# cuBLASMp's and cuSOLVERMp's wheels and NVML's header, downloaded once: carried as they are (a
# build on the GPU machine installs them), and installed here for build_wheel.sh.
"$python" -m pip download -q --disable-pip-version-check --no-deps -d .deps \
  "nvidia-cublasmp-cu13==0.7.*" "nvidia-cusolvermp-cu13==0.8.*" "nvidia-nvml-dev==13.*"
"$python" -m pip install -q --disable-pip-version-check --no-deps .deps/nvidia_cublasmp_cu13-*.whl \
  .deps/nvidia_cusolvermp_cu13-*.whl .deps/nvidia_nvml_dev-*.whl
cutlass=$("$python" -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")
mkdir -p .deps/cutlass
rm -rf .deps/cutlass/include
cp -r "$cutlass/source/include" .deps/cutlass/include
echo "carry: .deps/cutlass/include ($(du -sh .deps/cutlass | cut -f1)), $(cd .deps && ls nvidia_*.whl | tr '\n' ' ')"
