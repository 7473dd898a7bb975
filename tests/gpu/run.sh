#!/usr/bin/env bash
# Builds meshla and runs the whole GPU suite on this machine's GPUs; the last line is
# "N passed, N failed". Logs and the per-check results go to $LOG_DIR (default $OUT/gpu-suite).
#   tests/gpu/run.sh            build, then every process model
#   tests/gpu/run.sh threads    only the named models (grouped, solver, jax-collective,
#                               jax-collective-processes, solver-processes, watchdog,
#                               processes, cublasmp, threads, network)
#   MESHLA_SKIP_BUILD=1 ...     reuse the installed package
set -uo pipefail
# Never NVLink multicast: it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
LOG_DIR=${LOG_DIR:-${OUT:-/tmp}/gpu-suite}
mkdir -p "$LOG_DIR"
results="$LOG_DIR/results.jsonl"
: >"$results"

if [ "${MESHLA_SKIP_BUILD:-0}" != 1 ]; then
  tests/gpu/build.sh >"$LOG_DIR/build.log" 2>&1 || { tail -40 "$LOG_DIR/build.log"; echo "0 passed, 1 failed"; exit 1; }
fi

gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus ($(nvidia-smi --query-gpu=name --format=csv,noheader | head -1))"

# Runs one launcher under a time limit; a launcher that dies or hangs counts as a failed check.
launch() {
  local label=$1
  shift
  echo "== $label: $*"
  local started=$SECONDS
  timeout "${MESHLA_LAUNCH_TIMEOUT:-300}" "$@" >"$LOG_DIR/$label.log" 2>&1
  local status=$?
  echo "   $label took $((SECONDS - started)) s"
  if [ "$status" -ne 0 ]; then
    # 124: the time limit; above 128: killed by signal (status - 128), e.g. 139 a segfault.
    echo "{\"model\": \"$label\", \"name\": \"launcher\", \"rank\": -1, \"ok\": false, \"detail\": \"exited with status $status; see $label.log\"}" >>"$results"
    echo "$label exited with status $status"
    # A rank's own error comes before torchrun's long traceback of its launcher: show both ends.
    if [ "$(wc -l <"$LOG_DIR/$label.log")" -gt 70 ]; then
      head -50 "$LOG_DIR/$label.log"
      echo "[...]"
      tail -15 "$LOG_DIR/$label.log"
    else
      cat "$LOG_DIR/$label.log"
    fi
  fi
}

check=tests/gpu/check_collective_matmul.py
models=${*:-grouped solver jax-collective jax-collective-processes solver-processes watchdog processes cublasmp threads network}
wants() { [[ " $models " == *" $1 "* ]]; }
# The grouped GEMM, the watchdog and the processes model's tp=1 group need one GPU; the other
# collective models two or more.
if [ "$gpus" -ge 1 ] && wants grouped; then
  launch grouped python3 tests/gpu/check_grouped.py --results "$results" --model grouped
fi
# The dense solvers: one process driving 1, 2 and 4 GPUs (as many as there are).
if [ "$gpus" -ge 1 ] && wants solver; then
  MESHLA_LAUNCH_TIMEOUT=${MESHLA_SOLVER_TIMEOUT:-600} launch solver python3 tests/gpu/check_solver.py --results "$results" --model solver
fi
# meshla.jax's collective matmuls, one process driving every GPU; command buffers at XLA's
# default, off, and with the collectives in them.
if [ "$gpus" -ge 1 ] && wants jax-collective; then
  launch jax-collective python3 tests/gpu/check_jax_collective.py --results "$results" --model jax-collective
  launch jax-collective-no-command-buffers python3 tests/gpu/check_jax_collective.py --command-buffers "" --results "$results" --model jax-collective-no-command-buffers
  launch jax-collective-command-buffer-collectives python3 tests/gpu/check_jax_collective.py --command-buffers +COLLECTIVES --results "$results" --model jax-collective-command-buffer-collectives
fi
# The same with one process per GPU under jax.distributed (the script launches them).
if [ "$gpus" -ge 2 ] && wants jax-collective-processes; then
  launch jax-collective-processes python3 tests/gpu/check_jax_collective.py --processes "$gpus" --results "$results" --model jax-collective-processes
fi
# The dense solvers with one process per GPU (the *_shard forms, CUDA IPC to the first rank).
if [ "$gpus" -ge 2 ] && wants solver-processes; then
  launch solver-processes-tp2 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node=2 tests/gpu/check_solver_processes.py --results "$results" --model solver-processes-tp2
  [ "$gpus" -ge 4 ] && launch solver-processes-tp4 torchrun --nproc-per-node=4 tests/gpu/check_solver_processes.py --results "$results" --model solver-processes-tp4
fi
# A collective matmul that never finishes ends its process at the timeout.
if [ "$gpus" -ge 1 ] && wants watchdog; then
  launch watchdog python3 tests/gpu/check_watchdog.py --results "$results" --model watchdog
fi
# The collective checks in a group of one rank (any machine with a GPU: the ops' local paths,
# autograd, layers, graphs, stress); the checks of disagreeing ranks need two and are left out.
if [ "$gpus" -ge 1 ] && wants processes; then
  launch processes-tp1 env CUDA_VISIBLE_DEVICES=0 torchrun --nproc-per-node=1 "$check" --results "$results" --model processes-tp1
fi
if [ "$gpus" -lt 2 ]; then
  echo "skipped: the multi-rank collective models need at least 2 GPUs, this machine has $gpus"
else
  wants processes && launch processes-tp2 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node=2 "$check" --results "$results" --model processes-tp2
  if wants processes && [ "$gpus" -ge 4 ]; then
    launch processes-tp4 env CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc-per-node=4 "$check" --results "$results" --model processes-tp4
  fi
  # cuBLASMp's backend (needs the nvidia-cublasmp-cu13 wheel; a check says so when it is missing).
  if wants cublasmp; then
    launch cublasmp-tp2 env CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node=2 "$check" --cublasmp --results "$results" --model cublasmp-tp2
    [ "$gpus" -ge 4 ] && launch cublasmp-tp4 env CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc-per-node=4 "$check" --cublasmp --results "$results" --model cublasmp-tp4
  fi
  wants threads && launch threads python3 "$check" --threads --results "$results" --model threads
  # NCCL's network transport (the path that crosses nodes) instead of NVLink / shared memory.
  wants network && launch network env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 torchrun --nproc-per-node=$((gpus >= 4 ? 4 : 2)) "$check" --quick --results "$results" --model network
fi
python3 tests/gpu/summarize.py "$results"
