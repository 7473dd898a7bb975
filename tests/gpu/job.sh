#!/usr/bin/env bash
# One call on a lent GPU machine: build, GPU suite, benchmark. Everything lands in $OUT.
#   tests/gpu/job.sh COMMIT [suite] [bench] [grouped-bench] [solver-bench]
#   (default: suite and bench; SUITE_MODELS picks suite models)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
commit=${1:?commit sha}
shift
steps=${*:-suite bench}
OUT=${OUT:-/tmp/meshla-job}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nvidia-smi topo -m; } >"$OUT/machine.txt" 2>&1
tests/gpu/build.sh >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
for step in $steps; do
  case $step in
    suite)
      # Per-launcher logs stay on the machine (the lease returns at most 8 files); the results
      # and the summary come back.
      LOG_DIR=/tmp/meshla-suite MESHLA_SKIP_BUILD=1 tests/gpu/run.sh ${SUITE_MODELS:-} 2>&1 | tee "$OUT/suite.txt" | tail -60
      cp /tmp/meshla-suite/results.jsonl "$OUT/suite_results.jsonl"
      ;;
    grouped-bench)
      timeout "${BENCH_TIMEOUT:-400}" python3 bench/grouped_linear.py --commit "$commit" \
        --out "$OUT/grouped_linear_$(date -u +%Y%m%dT%H%M%SZ).json" >"$OUT/grouped_bench.txt" 2>&1
      tail -45 "$OUT/grouped_bench.txt"
      ;;
    solver-bench)
      timeout "${BENCH_TIMEOUT:-400}" python3 bench/dense_solver.py --commit "$commit" \
        --out "$OUT/dense_solver_$(date -u +%Y%m%dT%H%M%SZ).json" ${SOLVER_BENCH_ARGS:-} \
        >"$OUT/solver_bench.txt" 2>&1
      tail -45 "$OUT/solver_bench.txt"
      ;;
    bench)
      stamp=$(date -u +%Y%m%dT%H%M%SZ)
      json="$OUT/collective_matmul_${stamp}.json"
      for tp in 2 4; do
        [ "$gpus" -ge "$tp" ] || continue
        devices=$(seq -s, 0 $((tp - 1)))
        CUDA_VISIBLE_DEVICES=$devices timeout "${BENCH_TIMEOUT:-400}" torchrun --nproc-per-node=$tp \
          bench/collective_matmul.py --commit "$commit" --out "$json" ${BENCH_ARGS:-} \
          2>&1 | grep -v '^W1' >"$OUT/bench_tp$tp.txt"
        tail -45 "$OUT/bench_tp$tp.txt"
      done
      ;;
  esac
done
