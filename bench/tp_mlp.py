"""Tensor-parallel MLP training step: meshla's layers against PyTorch's tensor parallelism.

One process per GPU; the whole world is the tensor-parallel group:
  torchrun --nproc-per-node=TP bench/tp_mlp.py --commit SHA --out bench/results/F.json

The step is the forward and backward (input and weight gradients) of a Llama-70B-sized MLP
with sequence parallelism in bf16, without biases as Llama's: x [M/tp, 8192] -> column-parallel
8192 -> 28672 -> gelu -> row-parallel 28672 -> 8192 -> y [M/tp, 8192]; each rank draws its own x
and y's gradient. Variants, all on the same weights and inputs:

- meshla, meshla_compiled: mt.ColumnParallelLinear and mt.RowParallelLinear (backend "auto"),
  eager and under torch.compile(fullgraph=True).
- torch_dtensor: torch.nn.Linear layers sharded by torch.distributed.tensor.parallel
  (ColwiseParallel with its input sharded on the sequence, RowwiseParallel with its output
  sharded on it: NCCL all-gather and reduce-scatter beside the GEMMs), eager.
- torch_async_tp: that compiled with inductor's micro-pipeline tensor parallelism (PyTorch's
  async TP, as TorchTitan enables it): the collectives fused with the GEMMs over symmetric memory.
  Its row records how many collectives inductor fused ("fused_collectives", of 4: the forward's
  all-gather and reduce-scatter and the backward's), as the pass fuses only matmuls it recognises
  and says little when it finds none. Biases would keep the forward's from fusing (addmm).
- gemm: the step's GEMMs and gelu on local shapes without any communication (the input already
  gathered, the outputs not reduced): the limit that hiding communication reaches.

Every variant's output and gradients are checked against torch_dtensor's; a time is the median
over repetitions of `iters` steps (bench/collective_matmul.py's time_ms), on the slowest rank.
Each token count is appended to --out as its own run as soon as it is measured, so a run cut short
keeps the sizes done. Its compiles take minutes: on a lent machine, run one group size per call.
"""

import argparse
from typing import Callable

# First: it sets the multicast-off environment before torch, NCCL or NVSHMEM can read it.
from collective_matmul import (
    HIDDEN,
    INTERMEDIATE,
    agreed_error,
    append_run,
    bench_parser,
    check_launch,
    enable_symm_mem,
    init_world,
    number,
    relative_error,
    run_record,
    slowest_rank,
    time_ms,
)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from progress import Progress

CHECK_TOLERANCE = 2e-2


def whole_mlp(device) -> torch.nn.Sequential:
    """The unsharded MLP, drawn alike on every rank (the same seed), in bf16, without biases."""
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False), torch.nn.GELU(),
        torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False)).to(device=device, dtype=torch.bfloat16)


class MeshlaMLP(torch.nn.Module):
    def __init__(self, whole: torch.nn.Sequential, group):
        super().__init__()
        import meshla.torch as mt
        self.fc1 = mt.ColumnParallelLinear.from_linear(whole[0], group, sequence_parallel=True)
        self.fc2 = mt.RowParallelLinear.from_linear(whole[2], group, sequence_parallel=True)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def dtensor_mlp(whole: torch.nn.Sequential, tp: int, colwise=None,
                rowwise=None) -> torch.nn.Sequential:
    """`whole` (copied) under torch's tensor parallelism, sequence parallel: the first Linear
    column-parallel, the second row-parallel, by torch's ColwiseParallel and RowwiseParallel or
    the given styles of the same signature (torchao's Float8 ones, say)."""
    from copy import deepcopy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    mesh = init_device_mesh("cuda", (tp,))
    colwise, rowwise = colwise or ColwiseParallel, rowwise or RowwiseParallel
    return parallelize_module(deepcopy(whole), mesh, {
        "0": colwise(input_layouts=Shard(0)),
        "2": rowwise(output_layouts=Shard(0))})


def local(t) -> torch.Tensor:
    """A DTensor parameter's (or gradient's) shard on this rank; a tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def training_step(model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor,
                  results: list | None = None) -> Callable[[], None]:
    """A callable running model's forward and backward on x, with dy as y's gradient; with
    `results`, the step also stores [y, dx, *parameter gradients] there."""
    params = list(model.parameters())

    def step():
        x.grad = None
        for p in params:
            p.grad = None
        y = model(x)
        y.backward(dy)
        if results is not None:
            results[:] = [y.detach(), x.grad, *(local(p.grad) for p in params)]
    return step


def gemm_step(whole: torch.nn.Sequential, m: int, tp: int, rank: int, device):
    """The step's local work with no communication: the GEMMs of this rank's shards on the whole
    (already gathered) rows, and gelu."""
    ffn = INTERMEDIATE // tp
    cols = slice(rank * ffn, (rank + 1) * ffn)
    w1 = whole[0].weight.detach()[cols].contiguous()
    w2 = whole[2].weight.detach()[:, cols].contiguous()
    x_full = torch.randn(m, HIDDEN, device=device, dtype=torch.bfloat16)
    dy_full = torch.randn(m, HIDDEN, device=device, dtype=torch.bfloat16)

    def step():
        h = x_full @ w1.t()
        a = F.gelu(h)
        _ = a @ w2.t()  # the partial sums a reduce-scatter would add
        da = dy_full @ w2
        _ = dy_full.t() @ a  # fc2's weight gradient
        dh = torch.ops.aten.gelu_backward(da, h)
        _ = dh @ w1, dh.t() @ x_full  # fc1's input and weight gradients
    return step


def fused_collectives(step: Callable[[], None]) -> int:
    """Runs step (its first call, which compiles it) and counts the collectives that inductor's
    micro-pipeline pass fused with a matmul in the code it generated, forward and backward."""
    from torch._inductor.utils import run_and_get_code
    with torch._inductor.config.patch(force_disable_caches=True):  # generated, not from a cache
        _, codes = run_and_get_code(step)
    # Call sites only: the generated code also names each fused node in comments (counting those
    # gave "16 of 4" on 2 H200s at 69e4667).
    return sum(code.count("symm_mem.fused_all_gather_matmul.default(")
               + code.count("symm_mem.fused_matmul_reduce_scatter.default(") for code in codes)


def bench_tokens(m: int, tp: int, rank: int, group, symm_mem_error, args, device) -> list[dict]:
    whole = whole_mlp(device)
    torch.manual_seed(1234 + rank)  # each rank its own rows, so a block out of place shows
    x = (torch.randn(m // tp, HIDDEN, device=device, dtype=torch.bfloat16)
         .requires_grad_())
    dy = torch.randn(m // tp, HIDDEN, device=device, dtype=torch.bfloat16)
    meshla = MeshlaMLP(whole, group)
    dtensor = dtensor_mlp(whole, tp)
    models = {"meshla": meshla, "meshla_compiled": torch.compile(meshla, fullgraph=True),
              "torch_dtensor": dtensor}
    if not symm_mem_error:
        models["torch_async_tp"] = torch.compile(dtensor_mlp(whole, tp),
                                                 options={"_micro_pipeline_tp": True})
    results = {name: [] for name in models}
    steps = {name: training_step(model, x, dy, results[name]) for name, model in models.items()}
    steps["gemm"] = gemm_step(whole, m, tp, rank, device)
    del whole

    unavailable = {}
    if symm_mem_error:
        unavailable["torch_async_tp"] = symm_mem_error
    fused = {}

    def first_steps(name):
        # The first steps build meshla's plans and compile the compiled variants, untimed.
        if name == "torch_async_tp":
            fused[name] = fused_collectives(steps[name])
        else:
            steps[name]()
        steps[name]()

    for name in steps:
        error = agreed_error(lambda: first_steps(name))
        if error:
            unavailable[name] = error
    errors = {}
    reference = results["torch_dtensor"]
    for name, got in results.items():
        if name in unavailable or name == "torch_dtensor" or "torch_dtensor" in unavailable:
            continue
        errors[name] = slowest_rank(max(relative_error(g, w) for g, w in zip(got, reference)))
        if not errors[name] < CHECK_TOLERANCE and rank == 0:  # NaN fails too
            print(f"WARNING: M={m}: {name} differs from torch_dtensor, worst relative error "
                  f"{errors[name]:.2e} >= {CHECK_TOLERANCE}", flush=True)
    # The recorded steps keep their results alive: time steps that keep nothing.
    timed = {name: training_step(model, x, dy) for name, model in models.items()}
    timed["gemm"] = steps["gemm"]
    times = {name: time_ms(step, args.iters, args.warmup_ms, args.reps)
             for name, step in timed.items() if name not in unavailable}
    limit = times.get("gemm")
    names = list(timed) + (["torch_async_tp"] if "torch_async_tp" not in timed else [])
    return [{
        "m": m, "tp": tp, "variant": name, "time_ms": times.get(name),
        "ratio_to_gemm": times[name] / limit if name in times and limit else None,
        "speedup_vs_torch_dtensor": (times["torch_dtensor"] / times[name]
                                     if name in times and "torch_dtensor" in times else None),
        "check_error": errors.get(name), "unavailable": unavailable.get(name),
        "fused_collectives": fused.get(name),
    } for name in names]


def print_table(rows: list[dict]):
    print(f"{'M':>6} {'tp':>3} {'variant':<16} {'time_ms':>9} {'/gemm':>6} {'vs dtensor':>10} "
          f"{'check':>8}  note")
    for r in rows:
        note = f"unavailable: {r['unavailable']}" if r["unavailable"] else ""
        if r["fused_collectives"] is not None:
            note += f" fused collectives: {r['fused_collectives']} of 4"
        print(f"{r['m']:>6} {r['tp']:>3} {r['variant']:<16} {number(r['time_ms'], 3):>9} "
              f"{number(r['ratio_to_gemm'], 2):>6} {number(r['speedup_vs_torch_dtensor'], 2):>10} "
              f"{number(r['check_error'], 4):>8}  {note}".rstrip())
    print("time: one training step (forward and backward); /gemm: time / the step's GEMMs "
          "without communication; check: worst relative error against torch_dtensor")


def parse_args() -> argparse.Namespace:
    parser = bench_parser(__doc__, tokens=[8192, 16384], iters=10)
    args = parser.parse_args()
    check_launch(parser, args)
    return args


def main():
    args = parse_args()
    # Imported after parsing so that --help works on a machine without meshla's CUDA build.
    import meshla.torch as mt

    device = init_world()
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = mt.group_from_process_group(device=device)
    symm_mem_error = enable_symm_mem()
    progress = Progress("tp_mlp", len(args.m), enabled=rank == 0)
    for m in args.m:
        progress.start(f"M={m}")
        rows = bench_tokens(m, tp, rank, group, symm_mem_error, args, device)
        torch._dynamo.reset()  # the next size's models compile afresh
        if rank == 0:
            append_run(args.out, run_record(device, args, rows, bench="tp_mlp"))
            print_table(rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
