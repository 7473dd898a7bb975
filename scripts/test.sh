#!/usr/bin/env bash
# The test command: C++ unit tests (ctest), the GPU suite where this machine has a GPU, then the
# Python tests (pytest). Needs scripts/setup.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x /usr/local/cuda/bin/nvcc ] && export PATH=/usr/local/cuda/bin:$PATH

echo "== clang-format, ruff"
git ls-files '*.hpp' '*.cpp' '*.cu' '*.cuh' | xargs clang-format --dry-run --Werror
python3 -m ruff check python tests bench examples scripts

echo "== C++ unit tests"
cmake -S . -B build/tests -G Ninja -DMESHLA_BUILD_TESTS=ON >/dev/null
cmake --build build/tests
ctest --test-dir build/tests --output-on-failure

gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -ge 1 ]; then
  echo "== GPU suite ($gpus GPUs)"
  MESHLA_SKIP_BUILD=1 tests/gpu/run.sh
else
  echo "== GPU suite skipped: it needs a CUDA GPU and this machine has none"
fi

echo "== Python tests"
python3 -m pytest tests/python -q
