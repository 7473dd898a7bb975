#!/usr/bin/env bash
# One call on a lent GPU machine: build, GPU suite, benchmark. Everything lands in $OUT.
#   tests/gpu/job.sh COMMIT [suite] [bench] [mlp-bench] [grouped-bench] [one-rank-bench] [solver-bench]
#     [cusolvermp-bench] [process-solver-bench]
#   (default: suite and bench; SUITE_K selects suite tests as pytest's -k does, e.g.
#   SUITE_K="threads or grouped"; BENCH_TP the group sizes of bench,
#   2 and 4 by default; CUSOLVERMP_GPUS the world sizes of cusolvermp-bench, CUSOLVERMP_BENCH_ARGS
#   its grids, sizes and blocks; PROCESS_SOLVER_GPUS the world size of process-solver-bench, 2 by
#   default, PROCESS_SOLVER_ARGS its sizes and dtypes)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
commit=${1:?commit sha}
shift
steps=${*:-suite bench}
OUT=${OUT:-/tmp/meshla-job}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv; nvidia-smi topo -m; nvidia-smi topo -p2p n; } >"$OUT/machine.txt" 2>&1
# A carried wheel (scripts/build_wheel.sh) must be of the commit being measured.
if [ -f .whl/COMMIT ] && [ "$(cat .whl/COMMIT)" != "$commit" ]; then
  echo "the carried wheel is of $(cat .whl/COMMIT), not $commit: rebuild it or leave .whl out"
  exit 1
fi
tests/gpu/build.sh >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
for step in $steps; do
  case $step in
    suite)
      # The lease returns at most 8 files: the per-launcher logs come back as one archive.
      LOG_DIR=/tmp/meshla-suite MESHLA_SKIP_BUILD=1 tests/gpu/run.sh ${SUITE_K:+-k "$SUITE_K"} 2>&1 | tee "$OUT/suite.txt" | tail -60
      cp /tmp/meshla-suite/results.jsonl "$OUT/suite_results.jsonl"
      tar -czf "$OUT/suite_logs.tar.gz" -C /tmp/meshla-suite --exclude results.jsonl . 2>/dev/null
      ;;
    grouped-bench)
      timeout "${BENCH_TIMEOUT:-400}" python3 bench/grouped_linear.py --commit "$commit" \
        --out "$OUT/grouped_linear_$(date -u +%Y%m%dT%H%M%SZ).json" >"$OUT/grouped_bench.txt" 2>&1
      tail -45 "$OUT/grouped_bench.txt"
      ;;
    one-rank-bench)
      # The collective matmuls on a group of one rank against torch.mm (bench/one_rank.py).
      timeout "${BENCH_TIMEOUT:-400}" python3 bench/one_rank.py --commit "$commit" \
        --out "$OUT/one_rank_$(date -u +%Y%m%dT%H%M%SZ).json" >"$OUT/one_rank_bench.txt" 2>&1
      tail -12 "$OUT/one_rank_bench.txt"
      ;;
    solver-bench)
      timeout "${BENCH_TIMEOUT:-400}" python3 bench/dense_solver.py --commit "$commit" \
        --out "$OUT/dense_solver_$(date -u +%Y%m%dT%H%M%SZ).json" ${SOLVER_BENCH_ARGS:-} \
        >"$OUT/solver_bench.txt" 2>&1
      tail -45 "$OUT/solver_bench.txt"
      ;;
    cusolvermp-bench)
      # cuSOLVERMp potrf on every 2-D grid of 1, 2 and 4 GPUs (issue 5's scaling question).
      root=$(python3 -c "import nvidia.cu13 as m, os; print(next(p for p in m.__path__ if os.path.exists(p + '/include/cusolverMp.h')))")
      nvcc -std=c++17 -shared -Xcompiler -fPIC -O2 -arch=sm_90 bench/cusolvermp_potrf.cu \
        -I"$root/include" -L"$root/lib" -l:libcusolverMp.so.0 -lnccl -Xlinker -rpath,"$root/lib" \
        -o /tmp/libcusolvermp_potrf.so >"$OUT/cusolvermp_build.txt" 2>&1 || { tail -20 "$OUT/cusolvermp_build.txt"; continue; }
      json="$OUT/cusolvermp_potrf_$(date -u +%Y%m%dT%H%M%SZ).json"
      for p in ${CUSOLVERMP_GPUS:-1 2 4}; do
        [ "$gpus" -ge "$p" ] || continue
        CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((p - 1))) timeout "${BENCH_TIMEOUT:-400}" torchrun --nproc-per-node=$p \
          bench/cusolvermp_potrf.py --library /tmp/libcusolvermp_potrf.so --commit "$commit" --out "$json" \
          ${CUSOLVERMP_BENCH_ARGS:-} 2>&1 | grep -v '^W1' >"$OUT/cusolvermp_p$p.txt"
        grep -v -E '^\s|^Traceback|^torch\.distributed' "$OUT/cusolvermp_p$p.txt" | tail -40
      done
      ;;
    process-solver-bench)
      # The shard solves' engines, one process per GPU (bench/process_solver.py).
      p=${PROCESS_SOLVER_GPUS:-2}
      CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((p - 1))) timeout "${BENCH_TIMEOUT:-400}" \
        torchrun --standalone --nproc-per-node=$p bench/process_solver.py --commit "$commit" \
        --out "$OUT/process_solver_$(date -u +%Y%m%dT%H%M%SZ).json" ${PROCESS_SOLVER_ARGS:-} \
        2>&1 | grep -v '^W1' >"$OUT/process_solver_bench.txt"
      grep '^{' "$OUT/process_solver_bench.txt"; tail -5 "$OUT/process_solver_bench.txt"
      ;;
    mlp-bench)
      # A tensor-parallel MLP's training step, meshla's layers against PyTorch's (MLP_BENCH_TP:
      # the group sizes, 2 and 4 by default; MLP_BENCH_ARGS: bench/tp_mlp.py's options).
      json="$OUT/tp_mlp_$(date -u +%Y%m%dT%H%M%SZ).json"
      for tp in ${MLP_BENCH_TP:-2 4}; do
        [ "$gpus" -ge "$tp" ] || continue
        CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((tp - 1))) timeout "${BENCH_TIMEOUT:-400}" torchrun --nproc-per-node=$tp \
          bench/tp_mlp.py --commit "$commit" --out "$json" ${MLP_BENCH_ARGS:-} \
          2>&1 | grep -v '^W1' >"$OUT/mlp_bench_tp$tp.txt"
        tail -25 "$OUT/mlp_bench_tp$tp.txt"
      done
      ;;
    bench)
      stamp=$(date -u +%Y%m%dT%H%M%SZ)
      json="$OUT/collective_matmul_${stamp}.json"
      for tp in ${BENCH_TP:-2 4}; do
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
