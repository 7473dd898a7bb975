"""Collective matmul benchmark: meshla against NCCL + torch.matmul and PyTorch SymmetricMemory.

One process per GPU; the whole world is the tensor-parallel group:
  torchrun --nproc-per-node=TP bench/collective_matmul.py --commit SHA --out bench/results/F.json

Shapes are a transformer MLP in bf16 (--models: Llama-70B's hidden 8192 and intermediate 28672
by default, Qwen2.5-14B's 5120 / 13824, Llama-3-8B's 4096 / 14336): all_gather_matmul is the
column-parallel up projection, matmul_reduce_scatter and matmul_all_reduce the row-parallel down
projection. The weights are stored as models keep them (--layout linear: torch.nn.Linear's
[out, in], called with trans_b=True) or as [in, out] (--layout kn). The bar is the fastest GEMM of
the same per-GPU product in either layout (gemm_linear: a @ w.t() of w [n, k]; gemm_kn: a @ b of
b [k, n]), whose time is the row "gemm": every ratio is a time over it. Every variant of one
(op, M) runs on the same inputs. For all_gather_matmul, gemm_blocks and gemm_blocks_pushing time
the GEMM work of the copy-engine all-gather without and with its concurrent pushes (PyTorch's
symmetric memory, no meshla): the floor of that design. A time is the median over repetitions of
`iters` back-to-back calls, after `--warmup-ms` of the variant alone, taken on the slowest rank.
Rank 0 appends the run to the JSON file at --out and prints a table last.
"""

import os

# Never use NVLink multicast (NVLS): set before torch, NCCL or NVSHMEM can read the environment.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in MULTICAST_OFF.items():
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from datetime import datetime, timedelta, timezone  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from progress import Progress  # noqa: E402

HIDDEN, INTERMEDIATE = 8192, 28672
# (hidden, intermediate) of the MLPs whose shapes --models names.
MODELS = {"llama-70b": (HIDDEN, INTERMEDIATE), "qwen2.5-14b": (5120, 13824),
          "llama-3-8b": (4096, 14336)}
LAYOUTS = ("linear", "kn")
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
CHECK_TOLERANCE = 2e-2


@dataclass
class Case:
    """One (op, M): its operands, preallocated outputs and a zero-argument callable per variant."""

    n: int
    k: int
    variants: dict[str, Callable[[], object]]  # gemm_linear and gemm_kn among them
    torch_out: torch.Tensor  # written by torch_sequential
    meshla_out: torch.Tensor  # written by every meshla variant


def randn(*shape: int) -> torch.Tensor:
    # Random, never zeros (a GEMM on zeros draws less power and runs faster); scaled so that bf16
    # sums over thousands of products stay well inside range.
    return torch.randn(*shape, dtype=torch.bfloat16, device="cuda").mul_(0.02)


def empty(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=torch.bfloat16, device="cuda")


def gemm_variants(a, b_kn, w_nk, out) -> dict[str, Callable[[], object]]:
    """The same product in both weight layouts: the bar every variant is measured against is the
    faster of the two."""
    return {"gemm_linear": lambda: torch.matmul(a, w_nk.t(), out=out),
            "gemm_kn": lambda: torch.matmul(a, b_kn, out=out)}


def meshla_variants(meshla_op, a, b_kn, w_nk, layout, group, out,
                    args) -> dict[str, Callable[[], object]]:
    """meshla_<algorithm> on NCCL at its defaults, meshla_symmetric (the copy-engine backend),
    meshla_cublasmp (cuBLASMp's own overlap), meshla_auto (meshla's own choice), plus the sweeps:
    meshla_<algorithm>_s<sms>_c<chunks>[_t<ctas>]
    on NCCL and meshla_symmetric_c<chunks>, and all_gather_matmul's GEMM forced into each form
    (meshla_symmetric_per_batch, meshla_symmetric_one_launch; --gather-forms). Each is called
    with the weights in `layout`; cuBLASMp's always as [n, k], the layout its GEMM+AllReduce
    needs."""
    b, trans_b = (w_nk, True) if layout == "linear" else (b_kn, False)
    settings = [(backend, algorithm, (-1, 0, 0)) for backend, algorithm in (
        ("nccl", "sequential"), ("nccl", "pipelined"), ("nccl", "ring"), ("symmetric", "ring"),
        ("auto", "auto"))]
    settings += [("nccl", algorithm, knobs) for algorithm in ("pipelined", "ring")
                 for knobs in args.sweep]
    settings += [("symmetric", "ring", (-1, chunks, 0)) for chunks in args.symmetric_chunks]
    variants = {"meshla_cublasmp": lambda: meshla_op(a, w_nk, group, trans_b=True,
                                                     backend="cublasmp", out=out)}
    if meshla_op.__name__ == "all_gather_matmul":
        for form, form_group in args.gather_form_groups.items():
            variants[f"meshla_symmetric_{form}"] = built_with_form(
                form, lambda g=form_group: meshla_op(a, b, g, trans_b=trans_b,
                                                     backend="symmetric", out=out))
    for backend, algorithm, (sms, chunks, ctas) in settings:
        name = "meshla_" + ("symmetric" if backend == "symmetric" else algorithm)
        if backend == "symmetric" and chunks:
            name += f"_c{chunks}"
        elif (sms, chunks, ctas) != (-1, 0, 0):
            name += f"_s{sms}_c{chunks}" + (f"_t{ctas}" if ctas else "")
        variants[name] = (lambda backend=backend, algorithm=algorithm, sms=sms, chunks=chunks,
                          ctas=ctas: meshla_op(a, b, group, trans_b=trans_b, backend=backend,
                                               algorithm=algorithm, comm_sms=sms, chunks=chunks,
                                               comm_ctas=ctas, out=out))
    return variants


def built_with_form(form: str, fn: Callable[[], object]) -> Callable[[], object]:
    """fn, whose first call builds its plan with MESHLA_GATHER_GEMM=form: all_gather_matmul's
    GEMM per batch or in one launch instead of the faster of the two on this GPU. fn runs on a
    group of its own, so that the plan is not the one meshla_symmetric built."""
    built = False

    def call():
        nonlocal built
        if built:
            return fn()
        os.environ["MESHLA_GATHER_GEMM"] = form
        try:
            return fn()
        finally:
            del os.environ["MESHLA_GATHER_GEMM"]
            built = True
    return call


def weights(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One weight in both layouts: b [k, n] and w = b.t() stored [n, k] (nn.Linear's)."""
    b_kn = randn(k, n)
    return b_kn, b_kn.t().contiguous()


def all_gather_matmul_case(m: int, tp: int, shape: tuple[int, int], meshla_op, group,
                           group_name: str, symm_mem_error, args) -> Case:
    hidden, intermediate = shape
    k, n = hidden, intermediate // tp
    block = m // tp
    a = randn(block, k)
    b_kn, w_nk = weights(k, n)
    b = w_nk.t() if args.layout == "linear" else b_kn  # the product's [k, n] operand
    gathered, torch_out, meshla_out = empty(m, k), empty(m, n), empty(m, n)

    def gemm_blocks():
        # The GEMM work of the copy-engine all-gather: one GEMM per rank's block.
        for q in range(tp):
            rows = slice(q * block, (q + 1) * block)
            torch.matmul(gathered[rows], b, out=torch_out[rows])

    def collective():
        dist.all_gather_into_tensor(gathered, a)

    def torch_sequential():
        collective()
        torch.matmul(gathered, b, out=torch_out)

    def torch_symm_mem():
        # Allocates its outputs on every call: that is the API PyTorch offers.
        torch.ops.symm_mem.fused_all_gather_matmul(a, [b], gather_dim=0, group_name=group_name)

    variants = {**gemm_variants(gathered, b_kn, w_nk, torch_out), "collective": collective,
                "torch_sequential": torch_sequential, "torch_symm_mem": torch_symm_mem}
    if not symm_mem_error:
        variants["gemm_blocks"] = gemm_blocks
        variants["gemm_blocks_pushing"] = gemm_blocks_pushing(a, gemm_blocks, group_name)
    variants.update(meshla_variants(meshla_op, a, b_kn, w_nk, args.layout, group, meshla_out,
                                    args))
    return Case(n, k, variants, torch_out, meshla_out)


def gemm_blocks_pushing(a: torch.Tensor, gemm_blocks: Callable[[], None], group_name: str):
    """gemm_blocks while the copy engine pushes this rank's block `a` into every peer's
    symmetric buffer (PyTorch's), one push after another on a side stream, as meshla's symmetric
    backend does. The pushes take no SM: gemm_blocks_pushing / gemm_blocks is what the concurrent
    copies cost the GEMMs through memory and power, the floor of any copy-engine overlap."""
    import torch.distributed._symmetric_memory as symm_mem

    rank, tp = dist.get_rank(), dist.get_world_size()
    slots = symm_mem.empty(tp * a.numel(), dtype=a.dtype, device=a.device)
    handle = symm_mem.rendezvous(slots, group_name)
    # This rank's slot in each peer's buffer, in ring order.
    targets = [handle.get_buffer(peer, (tp, *a.shape), a.dtype)[rank]
               for peer in ((rank + step) % tp for step in range(1, tp))]
    side = torch.cuda.Stream(priority=-1)

    def call():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for target in targets:
                target.copy_(a)
        gemm_blocks()
        main.wait_stream(side)
    call.buffers = (slots, handle)  # alive as long as the variant
    return call


def row_parallel_case(op: str, m: int, tp: int, shape: tuple[int, int], meshla_op, group,
                      group_name: str, args) -> Case:
    """matmul_reduce_scatter or matmul_all_reduce: a [M, K/tp] @ b [K/tp, N], summed over ranks."""
    hidden, intermediate = shape
    k, n = intermediate // tp, hidden
    a = randn(m, k)
    b_kn, w_nk = weights(k, n)
    b = w_nk.t() if args.layout == "linear" else b_kn  # the product's [k, n] operand
    partial = empty(m, n)
    reduce_scatter = op == "matmul_reduce_scatter"
    torch_out = empty(m // tp, n) if reduce_scatter else partial
    meshla_out = empty(m // tp, n) if reduce_scatter else empty(m, n)

    def collective():
        if reduce_scatter:
            dist.reduce_scatter_tensor(torch_out, partial)
        else:
            # In place: the sum grows with every call, which NCCL's time does not depend on.
            dist.all_reduce(partial)

    def torch_sequential():
        torch.matmul(a, b, out=partial)
        collective()

    def torch_symm_mem():
        torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0,
                                                       group_name=group_name)

    variants = {**gemm_variants(a, b_kn, w_nk, partial), "collective": collective,
                "torch_sequential": torch_sequential}
    if reduce_scatter:  # PyTorch has no fused matmul + all-reduce
        variants["torch_symm_mem"] = torch_symm_mem
    variants.update(meshla_variants(meshla_op, a, b_kn, w_nk, args.layout, group, meshla_out,
                                    args))
    return Case(n, k, variants, torch_out, meshla_out)


def agreed_error(fn: Callable[[], object]) -> str | None:
    """Runs fn once on every rank: None if it ran everywhere, else the first failing rank's error.

    Every rank must then take the same branch (a rank that skips a collective the others run
    would hang them), so the outcome is exchanged between ranks.
    """
    error = None
    try:
        fn()
        torch.cuda.synchronize()
    except Exception as e:  # an unsupported variant is recorded, not fatal
        error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {rank}: {e}" for rank, e in enumerate(errors) if e), None)


def enable_symm_mem() -> str | None:
    def setup():
        import torch.distributed._symmetric_memory as symm_mem
        with warnings.catch_warnings():
            # Newer torch deprecates the call (groups are enabled on first use); older needs it.
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)

    return agreed_error(setup)


def slowest_rank(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_ms(fn: Callable[[], object], iters: int, warmup_ms: float, reps: int) -> float:
    """Milliseconds per call: median over reps of `iters` back-to-back calls, slowest rank. These
    GEMMs run the GPUs at their power limit, and the clocks follow the power draw within a few
    tenths of a second (bench/NOTES.md, experiment 49): each variant first runs alone for
    `warmup_ms`, so that it is timed at the clocks of its own steady state (a variant that also
    drives NVLink draws more) rather than at those the variant before it left."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    # Every rank makes as many calls: the collectives in them pair up.
    for _ in range(math.ceil(warmup_ms / max(slowest_rank(start.elapsed_time(end)), 1e-3))):
        fn()
    samples = []
    for _ in range(reps):
        # Start every repetition from idle GPUs and aligned ranks, so no rank times a wait for
        # another rank's leftover work.
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return slowest_rank(statistics.median(samples))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_case(op: str, m: int, tp: int, case: Case, symm_mem_error, args) -> list[dict]:
    case.variants["torch_sequential"]()
    reference = case.torch_out.clone()
    unavailable = {}
    for name, fn in case.variants.items():
        # The first call also builds meshla's plan and PyTorch's workspace outside the timing.
        error = symm_mem_error if name == "torch_symm_mem" and symm_mem_error else agreed_error(fn)
        if error:
            unavailable[name] = error
    check_error = None
    for checked in ("meshla_ring", "meshla_symmetric"):
        if checked in unavailable:
            continue
        case.meshla_out.fill_(float("nan"))
        case.variants[checked]()
        error = slowest_rank(relative_error(case.meshla_out, reference))
        check_error = error if check_error is None or not error < check_error else check_error
        if not error < CHECK_TOLERANCE and dist.get_rank() == 0:  # NaN fails too
            print(f"WARNING: {op} M={m}: {checked} differs from torch_sequential, relative "
                  f"error {error:.2e} >= {CHECK_TOLERANCE}", flush=True)
    times = {name: time_ms(fn, args.iters, args.warmup_ms, args.reps)
             for name, fn in case.variants.items() if name not in unavailable}
    # The bar: the faster layout of the same product ("gemm", a row of its own).
    gemms = {name: times[name] for name in ("gemm_linear", "gemm_kn") if name in times}
    fastest = min(gemms, key=gemms.get) if gemms else None
    if fastest:
        times["gemm"] = gemms[fastest]
    bar = times.get("gemm")
    baseline = times.get("meshla_sequential")
    rows = []
    for name in ["gemm", *case.variants]:
        t = times.get(name)
        rows.append({
            "op": op, "m": m, "n": case.n, "k": case.k, "tp": tp, "variant": name,
            "layout": fastest.removeprefix("gemm_") if name == "gemm" and fastest else
            None if name.startswith("gemm_") or name == "collective" else args.layout,
            "time_ms": t,
            "ratio": t / bar if t and bar else None,  # 1.0: as fast as the fastest GEMM alone
            "speedup_vs_meshla_sequential": baseline / t if t and baseline else None,
            # the worse of meshla ring and symmetric vs torch_sequential, this (op, M)
            "check_error": check_error,
            "unavailable": unavailable.get(name) or (None if t else "no GEMM timed"),
        })
    return rows


def number(x: float | None, digits: int) -> str:
    """A table cell: x to `digits` decimals, or "-" where there is none."""
    return "-" if x is None else f"{x:.{digits}f}"


def print_table(rows: list[dict]):
    print(f"{'op':<22} {'M':>6} {'tp':>3} {'variant':<18} {'time_ms':>9} {'ratio':>6} "
          f"{'speedup':>8}  note")
    for r in rows:
        note = f"unavailable: {r['unavailable']}" if r["unavailable"] else ""
        print(f"{r['op']:<22} {r['m']:>6} {r['tp']:>3} {r['variant']:<18} "
              f"{number(r['time_ms'], 3):>9} {number(r['ratio'], 2):>6} "
              f"{number(r['speedup_vs_meshla_sequential'], 2):>8}  {note}".rstrip())
    print("ratio = time / gemm (the faster layout of the GEMM alone); speedup = "
          "meshla_sequential time / time")


def append_run(path: str, run: dict):
    """Adds this run to the file's list of runs, so several tp sizes can share one file."""
    runs = []
    if os.path.exists(path):
        with open(path) as f:
            runs = json.load(f)["runs"]
    runs.append(run)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"runs": runs}, f, indent=2)
        f.write("\n")


def bench_parser(description: str, tokens: list[int], iters: int) -> argparse.ArgumentParser:
    """The options this benchmark and bench/tp_mlp.py share: the commit, the output file, the
    token counts (args.m) and the timing (see time_ms), with each one's defaults."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", required=True, help="the meshla commit being measured")
    parser.add_argument("--out", required=True, help="JSON file; an existing one gets this run "
                        "appended to its 'runs'")
    parser.add_argument("--tokens", dest="m", type=int, nargs="+", default=tokens,
                        help="token counts M (rows of the whole activation); divisible by tp")
    parser.add_argument("--iters", type=int, default=iters, help="back-to-back calls per timing")
    parser.add_argument("--warmup-ms", type=float, default=500.0,
                        help="untimed calls of each variant before its timings, in ms")
    parser.add_argument("--reps", type=int, default=5, help="timings; the median is reported")
    return parser


def parse_args() -> argparse.Namespace:
    parser = bench_parser(__doc__, tokens=[4096, 8192, 16384], iters=20)
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), metavar="OP",
                        help=f"ops to time, of: {', '.join(OPS)} (default: all)")
    parser.add_argument("--sweep", nargs="*", default=[], metavar="SMS:CHUNKS[:CTAS]",
                        help="extra meshla pipelined/ring settings to time, e.g. 8:0 16:4 8:0:8 "
                        "(comm_sms:chunks:comm_ctas; -1, 0 and 0 mean the defaults)")
    parser.add_argument("--symmetric-chunks", type=int, nargs="*", default=[], metavar="C",
                        help="extra chunk counts (reduce rounds) to time on the symmetric backend")
    parser.add_argument("--layout", choices=LAYOUTS, default="linear",
                        help="how the weights are stored for the collective variants: linear "
                        "(nn.Linear's [out, in], trans_b=True; default) or kn ([in, out])")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["llama-70b"],
                        metavar="MODEL", help=f"MLP shapes to time, of: {', '.join(MODELS)} "
                        "(default: llama-70b)")
    parser.add_argument("--gather-forms", action="store_true",
                        help="also time all_gather_matmul's symmetric GEMM in each form, per "
                        "batch and in one launch (meshla_symmetric_per_batch, _one_launch)")
    args = parser.parse_args()
    try:
        knobs = [[int(v) for v in item.split(":")] for item in args.sweep]
        if any(len(k) not in (2, 3) for k in knobs):
            raise ValueError
        args.sweep = [tuple(k + [0] * (3 - len(k))) for k in knobs]
    except ValueError:
        parser.error("--sweep takes comm_sms:chunks or comm_sms:chunks:comm_ctas integers")
    check_launch(parser, args)
    return args


def check_launch(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The checks of a torchrun launch and of the timing options (--tokens as args.m, --iters,
    --warmup-ms, --reps) that this benchmark and bench/tp_mlp.py share."""
    if "LOCAL_RANK" not in os.environ:
        parser.error("launch with torchrun --nproc-per-node=TP (one process per GPU)")
    tp = int(os.environ["WORLD_SIZE"])
    intermediates = [MODELS[name][1] for name in getattr(args, "models", ["llama-70b"])]
    if any(size % tp for size in intermediates) or any(m % tp for m in args.m):
        parser.error(f"the world size {tp} must divide the intermediate sizes {intermediates} "
                     "and every --tokens")
    if min(args.iters, args.reps) < 1 or args.warmup_ms < 0:
        parser.error("--iters and --reps must be at least 1, --warmup-ms at least 0")


def init_world() -> torch.device:
    """This process's GPU, with the NCCL process group of the torchrun world initialised. Its
    collectives time out after 3 minutes (NCCL's default is 10), so that a rank left waiting ends
    the run inside job.sh's time limit with an error instead of at the limit."""
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl", device_id=device, timeout=timedelta(minutes=3))
    return device


def run_record(device: torch.device, args: argparse.Namespace, rows: list[dict],
               **fields) -> dict:
    """A run as append_run stores it: the machine, software, date and timing options, the
    benchmark's own `fields` (which may name another dtype), and its rows."""
    return {
        "device": torch.cuda.get_device_name(device),
        "device_count": torch.cuda.device_count(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "env": {name: os.environ.get(name) for name in MULTICAST_OFF},
        "dtype": "bfloat16", "iters": args.iters, "warmup_ms": args.warmup_ms, "reps": args.reps,
        "tp": dist.get_world_size(),
        **fields,
        "rows": rows,
    }


def main():
    args = parse_args()
    # Imported after parsing so that --help works on a machine without meshla's CUDA build.
    import meshla.torch as mt

    device = init_world()
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # ranks hold different shards
    group = mt.group_from_process_group(device=device)
    # One group per forced form: a group caches one plan per shape.
    args.gather_form_groups = {form: mt.group_from_process_group(device=device)
                               for form in ("per_batch", "one_launch")} if args.gather_forms else {}
    group_name = dist.group.WORLD.group_name
    symm_mem_error = enable_symm_mem()

    rows = []
    progress = Progress("collective_matmul", len(args.models) * len(args.ops) * len(args.m),
                        enabled=rank == 0)
    for model in args.models:
        shape = MODELS[model]
        for op in args.ops:
            for m in args.m:
                progress.start(f"{model} {op} M={m}")
                meshla_op = getattr(mt, op)
                if op == "all_gather_matmul":
                    case = all_gather_matmul_case(m, tp, shape, meshla_op, group, group_name,
                                                  symm_mem_error, args)
                else:
                    case = row_parallel_case(op, m, tp, shape, meshla_op, group, group_name, args)
                rows += [{"model": model, **row}
                         for row in bench_case(op, m, tp, case, symm_mem_error, args)]
                del case  # free this shape's tensors before the next one's

    if rank == 0:
        append_run(args.out, run_record(device, args, rows, layout=args.layout,
                                        ratio_to="gemm (the faster layout of the GEMM alone)"))
        print_table(rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
