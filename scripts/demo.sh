#!/usr/bin/env bash
# Sets up meshla and runs its demos on every visible GPU: the three pillars in PyTorch (one
# process per GPU) and in JAX (one process driving them all), each against the framework's own
# way. Without GPUs it says so and runs the same code on the CPU paths (two gloo processes, two
# host devices).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# PyTorch and JAX share the GPUs: JAX takes memory as it needs it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 1 ]; then
  echo "demo: $gpus CUDA GPU(s)"
  torchrun --standalone --nproc-per-node="$gpus" examples/demo_torch.py
  python3 examples/demo_jax.py
else
  echo "demo: no CUDA GPU here; running the CPU reference paths (2 gloo processes, 2 host devices)"
  torchrun --standalone --nproc-per-node=2 examples/demo_torch.py --cpu
  XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu python3 examples/demo_jax.py
fi
