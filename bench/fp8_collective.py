"""FP8 collective matmul benchmark (issue 38): meshla's scaled ops against the fp8 GEMM alone,
torch's sequential ops (an all-gather of the fp8 bytes, then torch._scaled_mm; torch._scaled_mm,
then a bf16 reduce-scatter or all-reduce) and PyTorch SymmetricMemory's fused scaled ops, with
meshla's bf16 op of the same shape for reference.

One process per GPU; the whole world is the tensor-parallel group:
  torchrun --nproc-per-node=TP bench/fp8_collective.py --commit SHA --out bench/results/F.json

Llama-70B's MLP (hidden 8192, intermediate 28672): all_gather_matmul is the up projection
(k = 8192, n = 28672 / tp), the reductions the down projection (k = 28672 / tp, n = 8192);
float8_e4m3fn operands, weights stored [out, in], bfloat16 products, tensorwise scales (--rowwise:
one per row and column) drawn in [0.5, 1.5). Every ratio is a time over "fp8_gemm",
torch._scaled_mm of the same per-GPU product. Each meshla fp8 variant's output is compared with
torch's sequential op's first (error_vs_torch_sequential, a warning past 2e-2). Times as
bench/collective_matmul.py's (median of repetitions after a warm-up alone, slowest rank). A
variant that fails (a fused op this torch lacks) is recorded with its error. Rank 0 appends the
run to --out and prints a table.
"""

import os

from collective_matmul import MULTICAST_OFF  # noqa: F401  (sets the no-multicast environment)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from collective_matmul import (  # noqa: E402
    agreed_error, append_run, bench_parser, enable_symm_mem, init_world, relative_error,
    run_record, slowest_rank, time_ms)
from progress import Progress  # noqa: E402

HIDDEN, INTERMEDIATE = 8192, 28672
FP8 = torch.float8_e4m3fn
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
CHECK_TOLERANCE = 2e-2  # two bfloat16 products of the same fp8 operands, summed in another order


def scales(rows: int, n: int, rowwise: bool, device):
    """a's and b's scales in [0.5, 1.5), the same on every rank (a tensorwise all-gather's
    a_scale is the whole gathered a's; rowwise, each rank takes its rows' of the whole)."""
    gen = torch.Generator(device=device).manual_seed(99)
    shapes = ((rows, 1), (1, n)) if rowwise else ((), ())
    return tuple(torch.rand(shape, generator=gen, device=device) + 0.5 for shape in shapes)


def variants(op: str, m: int, tp: int, rowwise: bool, group, group_name: str, device):
    """(the per-GPU product's sizes, {name: call}) for one op and M."""
    import meshla.torch as mt

    gathers = op == "all_gather_matmul"
    k, n = (HIDDEN, INTERMEDIATE // tp) if gathers else (INTERMEDIATE // tp, HIDDEN)
    rows = m // tp if gathers else m
    a = torch.randn(rows, k, device=device).to(FP8)
    w = (torch.randn(n, k, device=device) / k**0.5).to(FP8)
    a_bf16, w_bf16 = a.to(torch.bfloat16), w.to(torch.bfloat16)
    gathered = torch.cat([a] * tp) if gathers else None  # the GEMM alone's operand
    a_scale, w_scale = scales(m if gathers else rows, n, rowwise, device)
    own_scale = a_scale[dist.get_rank() * rows:(dist.get_rank() + 1) * rows] if (
        gathers and rowwise) else a_scale
    product_rows = m if gathers else rows
    block = torch.empty(m // tp, n, dtype=torch.bfloat16, device=device)

    def scaled_mm(x, x_scale):
        return torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=w_scale,
                                out_dtype=torch.bfloat16)

    calls = {"fp8_gemm": lambda: scaled_mm(gathered if gathers else a, a_scale)}
    if gathers:
        def torch_sequential():
            dist.all_gather_into_tensor(gathered.view(torch.uint8), a.view(torch.uint8))
            return scaled_mm(gathered, a_scale)

        def torch_symm_mem():
            return torch.ops.symm_mem.fused_all_gather_scaled_matmul(
                a, [w.t()], own_scale, [w_scale], gather_dim=0, biases=[None],
                result_scales=[None], out_dtypes=[torch.bfloat16], use_fast_accum=[False],
                group_name=group_name)

        meshla_op, bf16_op = mt.all_gather_scaled_matmul, mt.all_gather_matmul
    else:
        all_reduce = op == "matmul_all_reduce"

        def torch_sequential():
            partial = scaled_mm(a, a_scale)
            if all_reduce:
                dist.all_reduce(partial)
                return partial
            dist.reduce_scatter_tensor(block, partial)
            return block

        def torch_symm_mem():
            if all_reduce:
                raise NotImplementedError("torch has no fused scaled matmul + all-reduce")
            return torch.ops.symm_mem.fused_scaled_matmul_reduce_scatter(
                a, w.t(), a_scale, w_scale, "sum", orig_scatter_dim=0,
                scatter_dim_after_maybe_reshape=0, group_name=group_name, output_shape=[m, n],
                out_dtype=torch.bfloat16)

        meshla_op = getattr(mt, "scaled_" + op)
        bf16_op = getattr(mt, op)
    calls["torch_sequential"] = torch_sequential
    calls["torch_symm_mem"] = torch_symm_mem
    for algorithm in ("sequential", "pipelined"):
        calls[f"meshla_nccl_{algorithm}"] = (
            lambda algorithm=algorithm: meshla_op(a, w, own_scale, w_scale, group,
                                                  algorithm=algorithm, backend="nccl"))
    calls["meshla_symmetric"] = lambda: meshla_op(a, w, own_scale, w_scale, group,
                                                  backend="symmetric")
    calls["meshla_auto"] = lambda: meshla_op(a, w, own_scale, w_scale, group)
    calls["meshla_bf16_auto"] = lambda: bf16_op(a_bf16, w_bf16, group, trans_b=True)
    return (product_rows, n, k), calls


def checked(calls, errors) -> dict[str, float]:
    """Each meshla fp8 variant's relative error against torch's sequential op on the same
    operands and scales (slowest rank's), warned about past CHECK_TOLERANCE: a fast variant that
    drops or misplaces a scale must not pass as a speedup."""
    if errors.get("torch_sequential"):
        return {}
    want = calls["torch_sequential"]()
    result = {}
    for name, fn in calls.items():
        if name.startswith("meshla_") and "bf16" not in name and not errors[name]:
            result[name] = slowest_rank(relative_error(fn(), want))
            if not result[name] < CHECK_TOLERANCE and dist.get_rank() == 0:  # NaN fails too
                print(f"WARNING: {name} differs from torch_sequential: relative error "
                      f"{result[name]:.2e} >= {CHECK_TOLERANCE}", flush=True)
    return result


def main():
    parser = bench_parser(__doc__, tokens=[8192, 16384], iters=20)
    parser.add_argument("--rowwise", action="store_true", help="rowwise scales, not tensorwise")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), metavar="OP")
    args = parser.parse_args()
    import meshla.torch as mt

    device = init_world()
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)
    group = mt.group_from_process_group(device=device)
    group_name = dist.group.WORLD.group_name
    symm_mem_error = enable_symm_mem()
    rows = []
    progress = Progress("fp8_collective", len(args.ops) * len(args.m), enabled=rank == 0)
    for op in args.ops:
        for m in args.m:
            progress.start(f"{op} M={m}")
            (prows, n, k), calls = variants(op, m, tp, args.rowwise, group, group_name, device)
            errors = {name: (symm_mem_error if name == "torch_symm_mem" and symm_mem_error
                             else agreed_error(fn)) for name, fn in calls.items()}
            checks = checked(calls, errors)
            times = {name: time_ms(fn, args.iters, args.warmup_ms, args.reps)
                     for name, fn in calls.items() if not errors[name]}
            bar = times.get("fp8_gemm")
            for name in calls:
                t = times.get(name)
                rows.append({"op": op, "m": m, "n": n, "k": k, "tp": tp, "variant": name,
                             "scaling": "rowwise" if args.rowwise else "tensorwise",
                             "time_ms": t, "ratio": t / bar if t and bar else None,
                             "unavailable": errors[name],
                             "error_vs_torch_sequential": checks.get(name)})
    if rank == 0:
        append_run(args.out, run_record(device, args, rows, ratio_to="fp8_gemm",
                                          dtype=str(FP8)[6:]))
        for r in rows:
            cell = (f"{r['time_ms']:8.3f} ms {r['ratio']:5.2f}" if r["time_ms"]
                    else f"unavailable: {r['unavailable']}")
            print(f"{r['op']:<22} M={r['m']:<6} {r['variant']:<22} {cell}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()
