"""meshla's three pillars in PyTorch, each against PyTorch's own way of doing the same:

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc-per-node=N examples/demo_torch.py      # one process per GPU
    torchrun --nproc-per-node=2 examples/demo_torch.py --cpu    # without GPUs: gloo, CPU paths

1. A tensor-parallel MLP block (sequence parallel): meshla's all_gather_matmul and
   matmul_reduce_scatter against torch.distributed's all-gather, matmul, matmul, reduce-scatter.
2. A Mixture-of-Experts layer's grouped GEMM, forward and backward: meshla's GroupedLinear
   against a loop of one matmul per expert.
3. A distributed Cholesky solve over every rank's GPU: meshla.torch.linalg.cho_solve_shard
   against torch.linalg on one GPU.

Every result is checked against float64; rank 0 prints a line per pillar: what ran where, the
times (median of several runs, slowest rank) and the error.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import meshla.torch as mt
from meshla.torch import linalg


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="CPU tensors over gloo")
    parser.add_argument("--runs", type=int, default=10)
    return parser.parse_args()


class Demo:
    """The rank's device, its sizes (small on a CPU, a real layer's on a GPU) and how to time."""

    def __init__(self, cpu: bool, runs: int):
        self.cpu, self.runs = cpu, runs
        if cpu:
            self.device, self.dtype = torch.device("cpu"), torch.float32
            dist.init_process_group("gloo")
        else:
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            self.dtype = torch.bfloat16
            torch.cuda.set_device(self.device)
            # NCCL for torch's own collectives; meshla bootstraps over any backend.
            dist.init_process_group("cpu:gloo,cuda:nccl")
        self.rank, self.tp = dist.get_rank(), dist.get_world_size()
        self.where = ("CPU (gloo; meshla's reference paths, for correctness, not speed)" if cpu else
                      f"{self.tp}x {torch.cuda.get_device_name(self.device)}")

    def random(self, *shape, scale=1.0, dtype=None):
        """The same tensor on every rank (one seed), on this rank's device."""
        generator = torch.Generator(device=self.device).manual_seed(hash(shape) % 2**31)
        return scale * torch.randn(*shape, generator=generator, device=self.device,
                                   dtype=dtype or self.dtype)

    def time_ms(self, fn) -> float:
        """Median milliseconds of fn() over self.runs, after a warm-up; the slowest rank's."""
        fn()
        samples = []
        for _ in range(self.runs):
            self.sync()
            start = time.perf_counter()
            fn()
            self.sync()
            samples.append((time.perf_counter() - start) * 1e3)
        slowest = torch.tensor([statistics.median(samples)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return slowest.item()

    def sync(self):
        if not self.cpu:
            torch.cuda.synchronize(self.device)

    def report(self, pillar: str, ours: float, theirs: float, how: str, error: float,
               tolerance: float):
        worst = torch.tensor([error], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if self.rank == 0:
            verdict = "OK" if worst.item() < tolerance else "FAILED: error above tolerance"
            print(f"[torch] {pillar} on {self.where}: meshla {ours:.3f} ms, {how} {theirs:.3f} ms "
                  f"({theirs / ours:.2f}x); error {worst.item():.1e} vs float64: {verdict}",
                  flush=True)
        return worst.item() < tolerance


def round_up(size: int, multiple: int) -> int:
    """Sizes that split evenly over any number of ranks (with 16-byte rows on each)."""
    return -(-size // multiple) * multiple


def relative_error(out, reference) -> float:
    return ((out.double() - reference).norm() / reference.norm()).item()


def mlp_block(demo: Demo) -> bool:
    tp, rank = demo.tp, demo.rank
    tokens, hidden = (128 * tp, 256) if demo.cpu else (4096 * tp, 4096)
    inner = round_up(4 * hidden, 8 * tp)
    group = mt.group_from_process_group(device=demo.device)
    x = demo.random(tokens, hidden)
    w_up = demo.random(inner, hidden, scale=hidden**-0.5)  # nn.Linear weights: [out, in]
    w_down = demo.random(hidden, inner, scale=inner**-0.5)
    rows = slice(rank * tokens // tp, (rank + 1) * tokens // tp)
    cols = slice(rank * inner // tp, (rank + 1) * inner // tp)
    x_shard = x[rows].contiguous()
    up, down = w_up[cols].contiguous(), w_down[:, cols].contiguous()

    def meshla_block():
        h = mt.all_gather_matmul(x_shard, up, group, trans_b=True)
        return mt.matmul_reduce_scatter(torch.relu(h), down, group, trans_b=True)

    def torch_block():
        gathered = x_shard.new_empty(tokens, hidden)
        dist.all_gather_into_tensor(gathered, x_shard)
        partial = torch.relu(gathered @ up.T) @ down.T
        if demo.cpu:  # gloo has no reduce-scatter: the sum everywhere, then this rank's rows
            dist.all_reduce(partial)
            return partial[rows]
        out = partial.new_empty(tokens // tp, hidden)
        dist.reduce_scatter_tensor(out, partial)
        return out

    reference = (torch.relu(x.double() @ w_up.double().T) @ w_down.double().T)[rows]
    error = max(relative_error(meshla_block(), reference),
                relative_error(torch_block(), reference))
    how = "torch all-gather, matmuls, " + ("all-reduce" if demo.cpu else "reduce-scatter")
    return demo.report(f"tensor-parallel MLP block, {tokens} tokens x {hidden}, tp={tp}, "
                       f"{str(demo.dtype)[6:]}", demo.time_ms(meshla_block),
                       demo.time_ms(torch_block), how, error,
                       1e-2 if demo.dtype == torch.bfloat16 else 1e-5)


def moe_layer(demo: Demo) -> bool:
    experts, hidden, ffn, tokens = (4, 64, 128, 512) if demo.cpu else (8, 4096, 2048, 32768)
    layer = mt.GroupedLinear(experts, hidden, ffn, bias=False, device=demo.device,
                             dtype=demo.dtype)
    sizes = torch.full((experts,), tokens // experts, dtype=torch.int64)
    sizes[0], sizes[-1] = sizes[0] + tokens // (2 * experts), sizes[-1] - tokens // (2 * experts)
    m_splits = sizes.to(demo.device)
    x = demo.random(tokens, hidden).requires_grad_()
    weights = [w.detach() for w in layer.weights()]
    starts = [0, *torch.cumsum(sizes, 0).tolist()[:-1]]

    def meshla_layer():
        layer(x, m_splits).sum().backward()

    def loop_layer():  # PyTorch's own way: one matmul per expert, autograd through the loop
        ws = [w.detach().requires_grad_() for w in weights]
        outs = [x[s:s + n] @ w.T for s, n, w in zip(starts, sizes.tolist(), ws)]
        torch.cat(outs).sum().backward()

    y = layer(x, m_splits)
    reference = torch.cat([x.detach()[s:s + n].double() @ w.double().T
                           for s, n, w in zip(starts, sizes.tolist(), weights)])
    error = relative_error(y, reference)
    return demo.report(f"MoE grouped GEMM forward + backward, {experts} experts, {tokens} tokens, "
                       f"{hidden} -> {ffn}, {str(demo.dtype)[6:]}", demo.time_ms(meshla_layer),
                       demo.time_ms(loop_layer), "a matmul per expert", error,
                       1e-2 if demo.dtype == torch.bfloat16 else 1e-5)


def solve(demo: Demo) -> bool:
    tp, rank = demo.tp, demo.rank
    n = round_up(512 if demo.cpu else 16384, tp)
    rows = slice(rank * n // tp, (rank + 1) * n // tp)
    m = demo.random(n, n, scale=n**-0.5, dtype=torch.float64)
    a = m @ m.T + torch.eye(n, dtype=torch.float64, device=demo.device)  # positive definite
    b = demo.random(n, 1, dtype=torch.float64)
    a_block, b_block = a[rows].contiguous(), b[rows].contiguous()

    def meshla_solve():
        return linalg.cho_solve_shard(a_block, b_block).x

    def torch_solve():  # the whole matrix on this rank's one device
        return torch.cholesky_solve(b, torch.linalg.cholesky(a))

    x = torch.cat(_gathered(meshla_solve()))  # every rank's row block of X
    error = relative_error(a @ x, b)  # the residual ||A X - B|| / ||B||
    return demo.report(f"Cholesky solve, n={n}, float64, A split over the ranks",
                       demo.time_ms(meshla_solve), demo.time_ms(torch_solve),
                       "torch.linalg on one device", error, 1e-8)


def _gathered(block):
    parts = [torch.empty_like(block) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, block.contiguous())
    return parts


def main():
    args = parse_args()
    demo = Demo(args.cpu, args.runs)
    results = [mlp_block(demo), moe_layer(demo), solve(demo)]
    if demo.rank == 0:
        print("[torch] demo:", "OK" if all(results) else "FAILED")
    dist.destroy_process_group()
    raise SystemExit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
