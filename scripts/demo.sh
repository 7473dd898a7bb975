#!/usr/bin/env bash
# Sets up meshla and runs a collective-matmul demo on every visible GPU; without GPUs it says so
# and runs the same code on the CPU path with two gloo processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 1 ]; then
  echo "demo: $gpus CUDA GPU(s), one process each"
  exec torchrun --standalone --nproc-per-node="$gpus" examples/collective_matmul_demo.py
else
  echo "demo: no CUDA GPU here; running the CPU reference path with 2 gloo processes"
  exec torchrun --standalone --nproc-per-node=2 examples/collective_matmul_demo.py --cpu
fi
