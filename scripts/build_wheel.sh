#!/usr/bin/env bash
# Builds meshla's wheel for the GPU machines' Python (3.12) here, into .whl/, so that a lease
# installs it (tests/gpu/build.sh) instead of spending device time on the build. .whl/COMMIT
# records the commit, and whether the tree had uncommitted changes.
#   PYTHON=python3.12 scripts/build_wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3.12}
gpu_jax=${GPU_JAX:-0.11.2}  # the GPU machines' jax and jaxlib
"$python" -c "import sys; assert sys.version_info[:2] == (3, 12), sys.version" ||
  { echo "the GPU machines run Python 3.12: set PYTHON to one"; exit 1; }
# Without jax the build leaves out the JAX solvers' handlers (XLA's FFI headers come with jaxlib),
# and the GPU suite's JAX solver checks fail on such a wheel.
"$python" -c "import jax.ffi" 2>/dev/null ||
  { echo "$python cannot import jax.ffi: pip install 'jax[cpu]==$gpu_jax' for it first"; exit 1; }
# The handlers take the FFI API version of the headers they were built with, and a jaxlib older
# than those headers refuses to register them (a wheel built with jaxlib 0.12's failed on the GPU
# machines' 0.11.2): build with the machines' version.
built_jax=$("$python" -c "import jaxlib; print(jaxlib.__version__)")
[ "$built_jax" = "$gpu_jax" ] || {
  echo "$python has jaxlib $built_jax, the GPU machines $gpu_jax: pip install 'jax[cpu]==$gpu_jax'"
  exit 1
}
# Without cuBLASMp's header the build leaves out that backend, and the suite's cublasmp model
# fails (a new machine's first wheel did). Asked for explicitly below, so that a build directory
# configured without it turns it on.
"$python" -c "import nvidia.cublasmp.cu13" 2>/dev/null ||
  { echo "$python cannot import nvidia.cublasmp.cu13: pip install --no-deps 'nvidia-cublasmp-cu13==0.7.*' for it first"; exit 1; }
# The same for cuSOLVERMp's header (the process solver's engine; its wheel puts it in nvidia/cu13).
"$python" -c "import nvidia, os, sys; sys.exit(not os.path.exists(os.path.join(list(nvidia.__path__)[0], 'cu13/include/cusolverMp.h')))" 2>/dev/null ||
  { echo "$python lacks cuSOLVERMp's header: pip install --no-deps 'nvidia-cusolvermp-cu13==0.8.*' for it first"; exit 1; }
export CUTLASS_INCLUDE_DIR=${CUTLASS_INCLUDE_DIR:-$PWD/.deps/cutlass/include}
# A pip-installed CMake may not look in the toolkit's lib/ for cusolverMg.
cusolvermg=$(ls "${CUDA_HOME:-/usr/local/cuda}"/lib*/libcusolverMg.so 2>/dev/null | head -1)
export CMAKE_ARGS="${CMAKE_ARGS:-} -DMESHLA_WITH_CUBLASMP=ON -DMESHLA_WITH_CUSOLVERMP=ON ${cusolvermg:+-DCUSOLVERMG_LIBRARY=$cusolvermg}"
rm -rf .whl/meshla-*.whl
# An object whose entry in ninja's log lists no headers is never rebuilt when they change (one
# such entry kept a stale forward pass in the wheels of a whole session: bench/NOTES.md 54):
# removed here, so that this build compiles it again.
for dir in build/cp312-*/; do
  [ -f "$dir/build.ninja" ] || continue
  ninja -C "$dir" -t deps 2>/dev/null | awk '/: #deps 0,/ { sub(":", "", $1); print $1 }' |
    while read -r object; do
      echo "no dependencies recorded for $dir$object: rebuilding it"
      rm -f "$dir$object"
    done
done
"$python" -m pip wheel --no-build-isolation --no-deps -q -w .whl .
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.whl' || echo -dirty)" >.whl/COMMIT
echo "built .whl/$(cd .whl && ls meshla-*.whl) at $(cat .whl/COMMIT)"
