#!/usr/bin/env bash
# Builds meshla and runs the GPU suite (tests/gpu/test_gpu_suite.py) on this machine's GPUs;
# pytest's last line is "N passed, N failed" (tests: a family of checks of one process model).
# Logs and every rank's result per check go to $LOG_DIR (default $OUT/gpu-suite).
#   tests/gpu/run.sh                          build, then every model the GPUs allow
#   tests/gpu/run.sh -k "threads or grouped"  pytest's arguments: some models or families
#   tests/gpu/run.sh --models grouped,threads these models (names in tests/gpu/suite.py)
#   MESHLA_SKIP_BUILD=1 ...                   reuse the installed package
set -uo pipefail
# Never NVLink multicast: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
LOG_DIR=${LOG_DIR:-${OUT:-/tmp}/gpu-suite}
mkdir -p "$LOG_DIR"

if [ "${MESHLA_SKIP_BUILD:-0}" != 1 ]; then
  tests/gpu/build.sh >"$LOG_DIR/build.log" 2>&1 || { tail -40 "$LOG_DIR/build.log"; echo "0 passed, 1 failed"; exit 1; }
fi
echo "GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x $(python3 -c "import torch; print(torch.cuda.device_count())")"
exec python3 -m pytest tests/gpu -q -rfs -p no:cacheprovider --log-dir "$LOG_DIR" "$@"
