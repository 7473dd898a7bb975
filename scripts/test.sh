#!/usr/bin/env bash
# The test command: C++ unit tests (ctest), the GPU suite where this machine has a GPU, the
# Python tests (pytest), then the documentation's build. Needs scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH

echo "== clang-format, ruff"
git ls-files '*.hpp' '*.cpp' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror
python3 -m ruff check python tests bench examples scripts docs

echo "== C++ unit tests"
# Built with the package by scripts/setup.sh, in scikit-build-core's build/<wheel tag>; brought up
# to date with the sources here (a no-op right after setup).
# A later `pip install .` without the tests reconfigures the same folder with them off (their
# old binary stays): the cache must still say on.
tag=$(python3 -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
builds=(build/"$tag-$tag-"*/)
build=${builds[0]}
grep -qx 'MESHLA_BUILD_TESTS:BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null ||
  { echo "test: no C++ tests configured for $tag under build/: run scripts/setup.sh first"; exit 1; }
cmake --build "$build"
ctest --test-dir "$build" --output-on-failure

gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -ge 1 ]; then
  echo "== GPU suite ($gpus GPUs)"
  MESHLA_SKIP_BUILD=1 tests/gpu/run.sh
else
  echo "== GPU suite skipped: it needs a CUDA GPU and this machine has none"
fi

echo "== Python tests"
python3 -m pytest tests/python -q

echo "== docs (mkdocs, warnings are errors)"
python3 -m mkdocs build --strict --quiet --site-dir build/site
