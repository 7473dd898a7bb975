"""FP8 tensor-parallel MLP training (issue 38): meshla's layers with fp8="tensorwise" and
"rowwise" against the same layers in bf16, for speed and for loss.

One process per GPU; the whole world is the tensor-parallel group:
  torchrun --nproc-per-node=TP bench/fp8_mlp.py --commit SHA --out bench/results/F.json

1. Step time: bench/tp_mlp.py's step (Llama-70B's MLP, x [M/tp, 8192] -> column-parallel
   8192 -> 28672 -> gelu -> row-parallel 28672 -> 8192, sequence parallel, no biases, forward
   and backward), each recipe against bf16 on the same weights and inputs, eager, and with
   --compiled also each under torch.compile(fullgraph=True) (inductor fuses the casts' passes).
   Its rows keep each variant's relative error against the eager bf16 step (output and
   gradients; fp8 rounding, not a pass/fail check: the CPU and GPU tests check the layers against
   float64). Where torchao is installed (its wheel carried), its Float8 training
   on torch's tensor parallelism, compiled with inductor's async TP (as TorchTitan runs it), is
   timed beside: torchao_tensorwise (its Float8 TP styles: the all-gather in fp8) and
   torchao_rowwise (torch's plain TP styles, as TorchTitan pairs them with that recipe).
2. Loss: --steps steps of AdamW (lr 1e-3) on a fixed-seed regression task (a smaller MLP, hidden
   1024, inner 4096, 8192 tokens, learning a random teacher MLP's outputs), once in bf16 and once
   per recipe from the same start; each row keeps the mean loss of the last 10 steps and its
   ratio to bf16's.
"""

from collective_matmul import (  # sets the multicast-off environment first
    HIDDEN,
    INTERMEDIATE,
    append_run,
    bench_parser,
    check_launch,
    init_world,
    relative_error,
    run_record,
    slowest_rank,
    time_ms,
)

import torch
import torch.distributed as dist
import torch.nn.functional as F
from collective_matmul import agreed_error, enable_symm_mem
from progress import Progress
from tp_mlp import dtensor_mlp, local

RECIPES = ("tensorwise", "rowwise")


class MLP(torch.nn.Module):
    """Column-parallel -> gelu -> row-parallel, sequence parallel, without biases."""

    def __init__(self, whole: torch.nn.Sequential, group, fp8):
        super().__init__()
        import meshla.torch as mt
        options = dict(sequence_parallel=True, fp8=fp8)
        self.fc1 = mt.ColumnParallelLinear.from_linear(whole[0], group, **options)
        self.fc2 = mt.RowParallelLinear.from_linear(whole[2], group, **options)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def whole_mlp(hidden: int, inner: int, seed: int, device) -> torch.nn.Sequential:
    """The unsharded MLP, drawn alike on every rank (the same seed), in bf16, without biases."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(hidden, inner, bias=False), torch.nn.GELU(),
        torch.nn.Linear(inner, hidden, bias=False)).to(device=device, dtype=torch.bfloat16)


def torchao_mlp(whole: torch.nn.Sequential, tp: int, recipe: str) -> torch.nn.Module:
    """`whole` in torchao's Float8 training (its Linears made Float8Linear with the recipe's
    dynamic scaling) under torch's tensor parallelism, compiled with async TP."""
    from copy import deepcopy

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel
    model = convert_to_float8_training(deepcopy(whole),
                                       config=Float8LinearConfig.from_recipe_name(recipe))
    styles = (Float8ColwiseParallel, Float8RowwiseParallel) if recipe == "tensorwise" else ()
    return torch.compile(dtensor_mlp(model, tp, *styles), options={"_micro_pipeline_tp": True})


def torchao_unavailable() -> str | None:
    """Why torchao's variants cannot run here, or None."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        return f"torchao is not installed ({e})"
    return enable_symm_mem()


def step_times(m: int, tp: int, rank: int, group, args, device) -> list[dict]:
    whole = whole_mlp(HIDDEN, INTERMEDIATE, 1234, device)
    torch.manual_seed(1234 + rank)
    x = torch.randn(m // tp, HIDDEN, device=device, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(m // tp, HIDDEN, device=device, dtype=torch.bfloat16)
    models = {"bf16": MLP(whole, group, None),
              **{f"fp8_{recipe}": MLP(whole, group, recipe) for recipe in RECIPES}}
    if args.compiled:
        for name in ("bf16", *(f"fp8_{recipe}" for recipe in RECIPES)):
            models[f"{name}_compiled"] = torch.compile(models[name], fullgraph=True)
    unavailable = {}
    torchao_error = torchao_unavailable()
    for recipe in RECIPES:
        name = f"torchao_{recipe}"
        if torchao_error:
            unavailable[name] = torchao_error
        else:
            models[name] = torchao_mlp(whole, tp, recipe)
    del whole

    def step(model, keep=None):
        x.grad = None
        for p in model.parameters():
            p.grad = None
        y = model(x)
        y.backward(dy)
        if keep is not None:
            keep[:] = [y.detach(), x.grad, *(local(p.grad) for p in model.parameters())]

    results = {}
    for name, model in models.items():
        results[name] = kept = []
        # builds the plans (and compiles); a peer that fails is recorded, not fatal
        error = agreed_error(lambda model=model, kept=kept: step(model, kept))
        if error:
            unavailable[name] = error
    errors = {name: slowest_rank(max(relative_error(g, w) for g, w in
                                     zip(got, results["bf16"])))
              for name, got in results.items() if name not in unavailable}
    del results
    times = {name: time_ms(lambda model=model: step(model), args.iters, args.warmup_ms, args.reps)
             for name, model in models.items() if name not in unavailable}
    return [{"part": "step", "m": m, "tp": tp, "variant": name, "time_ms": t,
             "speedup_vs_bf16": times["bf16"] / t, "error_vs_bf16": errors[name]}
            for name, t in times.items()] + [
        {"part": "step", "m": m, "tp": tp, "variant": name, "time_ms": None,
         "unavailable": why} for name, why in unavailable.items()]


def losses(steps: int, tp: int, rank: int, group, device) -> list[dict]:
    hidden, inner, tokens = 1024, 4096, 8192
    teacher = whole_mlp(hidden, inner, 7, device)
    torch.manual_seed(11)  # the same data on every rank; each takes its rows
    rows = slice(rank * tokens // tp, (rank + 1) * tokens // tp)
    data = []
    with torch.no_grad():
        for _ in range(steps):
            x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
            data.append((x[rows].contiguous(), teacher(x)[rows].contiguous()))
    curves = {}
    for name, fp8 in (("bf16", None), *((f"fp8_{r}", r) for r in RECIPES)):
        model = MLP(whole_mlp(hidden, inner, 3, device), group, fp8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        curve = []
        for x, target in data:
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x).float(), target.float())
            loss.backward()
            optimizer.step()
            summed = loss.detach().reshape(1)
            dist.all_reduce(summed)  # the mean over every rank's rows
            curve.append(summed.item() / tp)
        curves[name] = curve
    final = {name: sum(c[-10:]) / 10 for name, c in curves.items()}
    return [{"part": "loss", "steps": steps, "tp": tp, "variant": name,
             "final_loss": final[name], "ratio_to_bf16": final[name] / final["bf16"],
             "first_loss": curves[name][0]} for name in curves]


def main():
    parser = bench_parser(__doc__, tokens=[8192, 16384], iters=10)
    parser.add_argument("--steps", type=int, default=200, help="training steps of the loss part")
    parser.add_argument("--compiled", action="store_true",
                        help="also time each variant's step under torch.compile")
    args = parser.parse_args()
    check_launch(parser, args)
    import meshla.torch as mt

    device = init_world()
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = mt.group_from_process_group(device=device)
    progress = Progress("fp8_mlp", len(args.m) + 1, enabled=rank == 0)
    rows = []
    for m in args.m:
        progress.start(f"step M={m}")
        rows += step_times(m, tp, rank, group, args, device)
        torch._dynamo.reset()  # the next size compiles afresh
    progress.start(f"loss, {args.steps} steps")
    rows += losses(args.steps, tp, rank, group, device)
    if rank == 0:
        append_run(args.out, run_record(device, args, rows, bench="fp8_mlp",
                                        dtype="bfloat16 and float8_e4m3fn/e5m2"))
        for r in rows:
            if r["part"] == "step" and r["time_ms"] is None:
                print(f"step M={r['m']:<6} {r['variant']:<15} unavailable: {r['unavailable']}")
            elif r["part"] == "step":
                print(f"step M={r['m']:<6} {r['variant']:<15} {r['time_ms']:8.3f} ms  "
                      f"{r['speedup_vs_bf16']:5.2f}x bf16  error vs bf16 {r['error_vs_bf16']:.2e}")
            else:
                print(f"loss {r['steps']} steps {r['variant']:<15} first {r['first_loss']:.4f} "
                      f"last-10 mean {r['final_loss']:.5f} ({r['ratio_to_bf16']:.4f} of bf16)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
