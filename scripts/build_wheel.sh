#!/usr/bin/env bash
# Builds meshla's wheel for the GPU machines' Python (3.12) here, into .whl/, so that a lease
# installs it (tests/gpu/build.sh) instead of spending device time on the build. .whl/COMMIT
# records the commit, and whether the tree had uncommitted changes.
#   PYTHON=python3.12 scripts/build_wheel.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3.12}
"$python" -c "import sys; assert sys.version_info[:2] == (3, 12), sys.version" ||
  { echo "the GPU machines run Python 3.12: set PYTHON to one"; exit 1; }
export CUTLASS_INCLUDE_DIR=${CUTLASS_INCLUDE_DIR:-$PWD/.deps/cutlass/include}
# A pip-installed CMake may not look in the toolkit's lib/ for cusolverMg.
cusolvermg=$(ls "${CUDA_HOME:-/usr/local/cuda}"/lib*/libcusolverMg.so 2>/dev/null | head -1)
export CMAKE_ARGS="${CMAKE_ARGS:-} ${cusolvermg:+-DCUSOLVERMG_LIBRARY=$cusolvermg}"
rm -rf .whl/meshla-*.whl
"$python" -m pip wheel --no-build-isolation --no-deps -q -w .whl .
echo "$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.whl' || echo -dirty)" >.whl/COMMIT
echo "built .whl/$(cd .whl && ls meshla-*.whl) at $(cat .whl/COMMIT)"
