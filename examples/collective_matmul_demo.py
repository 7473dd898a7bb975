"""Tensor-parallel MLP block with meshla's collective matmul, checked against plain PyTorch.

    torchrun --nproc-per-node=N examples/collective_matmul_demo.py [--cpu]

Each rank holds a row shard of the activations. The up projection gathers the rows while it
multiplies (all_gather_matmul), the down projection multiplies and reduce-scatters
(matmul_reduce_scatter), so every rank ends with its own rows of the block's output.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import meshla.torch as mt


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="CPU tensors over gloo")
    parser.add_argument("--tokens", type=int, default=None, help="rows per rank")
    parser.add_argument("--hidden", type=int, default=None)
    args = parser.parse_args()
    # A 2-core CPU gets a small problem; a GPU one the size of a real layer.
    args.tokens = args.tokens or (128 if args.cpu else 4096)
    args.hidden = args.hidden or (256 if args.cpu else 4096)

    if args.cpu:
        device, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo")
    else:
        device, dtype = torch.device("cuda", int(os.environ["LOCAL_RANK"])), torch.bfloat16
        torch.cuda.set_device(device)
        dist.init_process_group("gloo")  # meshla needs no NCCL process group of torch's
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = mt.group_from_process_group(device=device)
    tokens, hidden, inner = args.tokens * tp, args.hidden, 4 * args.hidden

    # Every rank draws the same full weights and activations and keeps its slices.
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=dtype)
    w_up = torch.randn(hidden, inner, generator=gen, device=device, dtype=dtype) / hidden**0.5
    w_down = torch.randn(inner, hidden, generator=gen, device=device, dtype=dtype) / inner**0.5
    rows = slice(rank * tokens // tp, (rank + 1) * tokens // tp)
    cols = slice(rank * inner // tp, (rank + 1) * inner // tp)
    x_shard = x[rows].contiguous()
    w_up_shard, w_down_shard = w_up[:, cols].contiguous(), w_down[cols].contiguous()

    def block():
        h = mt.all_gather_matmul(x_shard, w_up_shard, group)  # [tokens, inner/tp]
        return mt.matmul_reduce_scatter(torch.relu(h), w_down_shard, group)  # [tokens/tp, hidden]

    out = block()
    reference = (torch.relu(x.double() @ w_up.double()) @ w_down.double())[rows]
    error = ((out.double() - reference).norm() / reference.norm()).item()

    for _ in range(3):
        block()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        block()
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed_ms = (time.perf_counter() - start) / 10 * 1e3

    summary = torch.tensor([error, elapsed_ms], dtype=torch.float64)
    dist.all_reduce(summary, op=dist.ReduceOp.MAX)
    if rank == 0:
        where = "CPU (gloo)" if args.cpu else torch.cuda.get_device_name(device)
        print(f"meshla demo: tp={tp} on {where}, {str(dtype)[6:]}, tokens={tokens}, "
              f"hidden={hidden}: relative error {summary[0]:.2e} vs float64, "
              f"{summary[1]:.2f} ms per MLP block (slowest rank)")
        ok = summary[0] < (1e-2 if dtype == torch.bfloat16 else 1e-5)
        print("meshla demo:", "OK" if ok else "FAILED: error above tolerance")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
