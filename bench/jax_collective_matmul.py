"""JAX collective matmul benchmark: meshla.jax against XLA's sharded matmuls, the shard_map +
ppermute collective matmul of JAX's documentation, and meshla.torch, at the same shapes.

One process driving every GPU (the tensor-parallel group is all of them):
  python3 bench/jax_collective_matmul.py --commit SHA --out bench/results/F.json

Shapes are bench/collective_matmul.py's (a Llama-70B MLP in bf16, weights [out, in]):
all_gather_matmul is the column-parallel up projection ([M, 8192] rows sharded, times the
[28672/tp, 8192] weight shard), matmul_reduce_scatter and matmul_all_reduce the row-parallel down
projection ([M, 28672/tp] times [8192, 28672/tp]). Variants of one (op, M), on the same inputs:

  gemm              one GPU's local GEMM of the same size, the faster of the weight layouts
                    ([out, in] and [in, out]), on every GPU at once
  xla_default       jax.jit of x @ w.T on sharded arrays (XLA inserts the collective)
  xla_windowed      the same in a process of its own with XLA's windowed einsum
                    (--xla_gpu_threshold_for_windowed_einsum_mib=0
                    --xla_gpu_multi_streamed_windowed_einsum=true)
  ppermute          shard_map + lax.ppermute ring (JAX's documentation; not for all-reduce)
  meshla_<backend>  meshla.jax's *_global forms, backend auto, nccl and symmetric
  torch_meshla_auto meshla.torch at its defaults (bench/collective_matmul.py under torchrun, one
                    process per GPU; --no-torch leaves it out)

Then one AdamW training step of examples/jax_tp_mlp.py (op mlp_train_step) at the same sizes: one
block, [1, M, 8192] bf16 tokens split over the GPUs, 28672 hidden features, for M in
--mlp-tokens; variants xla_default, xla_windowed (plain jax.numpy on sharded arrays), meshla
(its all-gather→GEMM and GEMM→reduce-scatter, their conjugates in the backward) and
meshla_fp8_tensorwise / meshla_fp8_rowwise (the same in fp8: ``fp8=`` on both ops); then the
same without sequence parallelism (op mlp_train_step_no_sp: every GPU holds all M tokens, meshla
runs column_parallel_matmul and matmul_all_reduce). Each variant's first loss is checked against
xla_default's (fp8's within its rounding); its ratio is its time over XLA's faster variant's.

A time is the median over --reps of --iters back-to-back dispatches of the jitted call, measured
on the host from the first dispatch to the last result, after --warmup-ms of the variant alone
(the clocks follow the power draw: bench/NOTES.md, experiment 49). The calls here take a
millisecond or more, so JAX's dispatch (tens of microseconds) hides behind the GPU's work. Every
variant's output is checked against xla_default's. The run is appended to the JSON at --out and
printed as a table: ratio = time / gemm.
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

# The windowed-einsum and torch subprocesses share the GPUs with this process: no preallocation.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# The torch benchmark's shapes, file format and environment (importing it turns NVLink multicast
# off before NCCL or NVSHMEM can read the environment).
from collective_matmul import HIDDEN, INTERMEDIATE, MULTICAST_OFF, OPS, append_run
from progress import Progress

WINDOWED_FLAGS = ("--xla_gpu_threshold_for_windowed_einsum_mib=0 "
                  "--xla_gpu_multi_streamed_windowed_einsum=true")
CHECK_TOLERANCE = 2e-2
# The example MLP's training step with sequence parallelism, and without it (every tensor-axis
# GPU holds all the tokens: column_parallel_matmul, then matmul_all_reduce).
MLP_STEPS = {"mlp_train_step": True, "mlp_train_step_no_sp": False}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", required=True, help="the meshla commit being measured")
    parser.add_argument("--out", required=True, help="JSON file; an existing one gets this run "
                        "appended to its 'runs'")
    parser.add_argument("--tokens", dest="m", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), metavar="OP")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup-ms", type=float, default=500.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-torch", action="store_true", help="leave out meshla.torch")
    parser.add_argument("--mlp-tokens", type=int, nargs="*", default=[8192, 16384],
                        help="tokens of the MLP training step's batch (none: no MLP)")
    parser.add_argument("--windowed-only", action="store_true",
                        help=argparse.SUPPRESS)  # the xla_windowed process (XLA_FLAGS set)
    args = parser.parse_args()
    if min(args.iters, args.reps) < 1 or args.warmup_ms < 0:
        parser.error("--iters and --reps must be at least 1, --warmup-ms at least 0")
    return args


def time_ms(fn, args) -> float:
    """Milliseconds per call (see the module's docstring)."""
    fn().block_until_ready()
    started = time.perf_counter()
    fn().block_until_ready()
    once = max(time.perf_counter() - started, 1e-6)
    for _ in range(int(args.warmup_ms / 1000 / once)):
        result = fn()
    result = fn()
    result.block_until_ready()
    samples = []
    for _ in range(args.reps):
        started = time.perf_counter()
        for _ in range(args.iters):
            result = fn()
        result.block_until_ready()
        samples.append((time.perf_counter() - started) * 1000 / args.iters)
    return statistics.median(samples)


class Shapes:
    """One (op, M): the global operands, their shardings, and the product's."""

    def __init__(self, jax, mesh, op: str, m: int, seed: int):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.op, self.m, self.tp = op, m, mesh.shape["tp"]
        gathers = op == "all_gather_matmul"
        self.k, self.n = (HIDDEN, INTERMEDIATE) if gathers else (INTERMEDIATE, HIDDEN)
        keys = jax.random.split(jax.random.key(seed))
        # Random, never zeros (a GEMM on zeros draws less power); scaled to stay in range.
        a = 0.02 * jax.random.normal(keys[0], (m, self.k), jax.numpy.bfloat16)
        w = 0.02 * jax.random.normal(keys[1], (self.n, self.k), jax.numpy.bfloat16)
        a_spec = P("tp", None) if gathers else P(None, "tp")
        w_spec = P("tp", None) if gathers else P(None, "tp")
        self.out_spec = {"all_gather_matmul": P(None, "tp"),
                         "matmul_reduce_scatter": P("tp", None),
                         "matmul_all_reduce": P(None, None)}[op]
        self.a = jax.device_put(a, NamedSharding(mesh, a_spec))
        self.w = jax.device_put(w, NamedSharding(mesh, w_spec))
        self.specs = (a_spec, w_spec)
        # The local GEMM: [rows, k_local] @ [k_local, n_local] on every GPU.
        self.local = ((m, self.k, self.n // self.tp) if gathers else
                      (m, self.k // self.tp, self.n))


def xla_variants(jax, mesh, shapes: Shapes) -> dict:
    from jax.sharding import NamedSharding

    product = jax.jit(lambda a, w: a @ w.T,
                      out_shardings=NamedSharding(mesh, shapes.out_spec))
    return {"xla_default": lambda: product(shapes.a, shapes.w)}


def gemm_variant(jax, mesh, shapes: Shapes):
    """Every GPU's local GEMM alone, the faster weight layout."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows, k, n = shapes.local
    tp = shapes.tp
    a = jax.device_put(0.02 * jax.random.normal(jax.random.key(7), (tp * rows, k),
                                                jax.numpy.bfloat16),
                       NamedSharding(mesh, P("tp", None)))
    layouts = {}
    for name, shape, product in (("out_in", (tp * n, k), lambda a, w: a @ w.T),
                                 ("in_out", (tp * k, n), lambda a, w: a @ w)):
        w = jax.device_put(0.02 * jax.random.normal(jax.random.key(8), shape,
                                                    jax.numpy.bfloat16),
                           NamedSharding(mesh, P("tp", None)))
        local = jax.jit(jax.shard_map(product, mesh=mesh, in_specs=(P("tp", None),) * 2,
                                      out_specs=P("tp", None)))
        layouts[name] = (lambda local=local, w=w: local(a, w))
    return layouts


def ppermute_variant(jax, mesh, shapes: Shapes):
    """The collective matmul of JAX's documentation: a ring of ppermutes, each step's transfer
    beside the previous block's GEMM (all-gather→GEMM and GEMM→reduce-scatter only)."""

    lax, tp = jax.lax, shapes.tp
    if shapes.op == "matmul_all_reduce":
        return None

    def gathered(x, w):  # x [m/tp, k], w [n/tp, k] -> [m, n/tp]
        own = lax.axis_index("tp")
        out = jax.numpy.zeros((tp, x.shape[0], w.shape[0]), x.dtype)
        for step in range(tp):
            out = lax.dynamic_update_index_in_dim(out, x @ w.T, (own - step) % tp, 0)
            if step < tp - 1:
                x = lax.ppermute(x, "tp", [(j, (j + 1) % tp) for j in range(tp)])
        return out.reshape(-1, w.shape[0])

    def scattered(x, w):  # x [m, k/tp], w [n, k/tp] -> [m/tp, n]
        own = lax.axis_index("tp")
        blocks = x.reshape(tp, -1, x.shape[1])

        def partial(block):
            return lax.dynamic_index_in_dim(blocks, block % tp, 0, keepdims=False) @ w.T

        total = partial(own + 1)
        for step in range(1, tp):
            total = lax.ppermute(total, "tp", [(j, (j - 1) % tp) for j in range(tp)])
            total = total + partial(own + 1 + step)
        return total

    body = gathered if shapes.op == "all_gather_matmul" else scattered
    call = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=shapes.specs,
                                 out_specs=shapes.out_spec))
    return lambda: call(shapes.a, shapes.w)


def meshla_variants(jax, mesh, shapes: Shapes) -> dict:
    import meshla.jax as mj

    function = getattr(mj, f"{shapes.op}_global")
    variants = {}
    for backend in ("auto", "nccl", "symmetric"):
        call = jax.jit(lambda a, w, backend=backend: function(
            a, w, mesh=mesh, axis_name="tp", trans_b=True, backend=backend))
        variants[f"meshla_{backend}"] = (lambda call=call: call(shapes.a, shapes.w))
    return variants


def mlp_step_variants(jax, mesh, m: int, windowed_only: bool, sequence_parallel: bool) -> dict:
    """The example MLP's training step on the benchmark's sizes, each variant stepping its own
    copy of the same parameters: {variant: fn returning the step's loss}."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "examples"))
    import jax_tp_mlp as example
    from jax.sharding import Mesh

    mesh = Mesh(mesh.devices.reshape(1, -1), ("data", "tp"))
    params, batches = example.sharded_inputs(mesh, 1, 1, m, HIDDEN, INTERMEDIATE,
                                             jax.numpy.bfloat16, sequence_parallel)
    x, target = batches[0]
    losses = {"xla_default": example.plain_loss}
    if not windowed_only:
        for recipe in (None, "tensorwise", "rowwise"):
            losses["meshla" + (f"_fp8_{recipe}" if recipe else "")] = (
                example.sharded_meshla_loss(mesh, 1, recipe, sequence_parallel))
    variants = {}
    for name, loss in losses.items():
        step, init = example.training_step(loss)
        carry = [params, init(params)]

        def one_step(step=step, carry=carry):
            carry[0], carry[1], value = step(carry[0], carry[1], x, target)
            return value

        variants[name] = one_step
    return variants


def relative_error(jax, out, reference) -> float:
    np = jax.numpy
    out, reference = (np.ravel(x).astype(np.float32) for x in (out, reference))
    return float(np.linalg.norm(out - reference) / np.linalg.norm(reference))


def measure(jax, variants: dict, args, reference=None) -> dict:
    """{variant: (time_ms, error against the reference, or why it could not run)}."""
    results = {}
    for name, fn in variants.items():
        try:
            out = fn()
            error = None if reference is None else relative_error(jax, out, reference)
            if error is not None and not error < CHECK_TOLERANCE:
                results[name] = (None, f"differs from xla_default: relative error {error:.2e}")
                continue
            results[name] = (time_ms(fn, args), error)
        except Exception as failure:  # a variant that cannot run is reported, not fatal
            results[name] = (None, f"{type(failure).__name__}: {str(failure)[:200]}")
    return results


def windowed_times(args) -> dict:
    """xla_default in a process of its own with the windowed einsum: {(op, m): result}."""
    with tempfile.NamedTemporaryFile(suffix=".json") as output:
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " "
                                          + WINDOWED_FLAGS).strip())
        command = [sys.executable, __file__, "--windowed-only", "--commit", args.commit,
                   "--out", output.name, "--tokens", *map(str, args.m), "--ops", *args.ops,
                   "--iters", str(args.iters), "--warmup-ms", str(args.warmup_ms),
                   "--reps", str(args.reps), "--mlp-tokens", *map(str, args.mlp_tokens)]
        subprocess.run(command, env=env, check=True)
        with open(output.name) as f:
            return {(r["op"], r["m"]): (r["time_ms"], r["unavailable"]) for r in json.load(f)}


def torch_times(args, tp: int) -> dict:
    """meshla.torch at its defaults, from bench/collective_matmul.py: {(op, m): result}."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "torch.json")
        command = ["torchrun", f"--nproc-per-node={tp}",
                   os.path.join(os.path.dirname(__file__), "collective_matmul.py"),
                   "--commit", args.commit, "--out", path, "--tokens", *map(str, args.m),
                   "--ops", *args.ops, "--iters", str(args.iters), "--warmup-ms",
                   str(args.warmup_ms), "--reps", str(args.reps)]
        subprocess.run(command, check=True)
        with open(path) as f:
            rows = json.load(f)["runs"][-1]["rows"]
    return {(r["op"], r["m"]): (r["time_ms"], r["unavailable"]) for r in rows
            if r["variant"] == "meshla_auto"}


def main():
    args = parse_args()
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = jax.devices()
    tp = len(devices)
    mesh = Mesh(np.array(devices), ("tp",))
    if INTERMEDIATE % tp or any(m % tp for m in args.m + args.mlp_tokens):
        sys.exit(f"the GPU count {tp} must divide {INTERMEDIATE}, every --tokens and every "
                 "--mlp-tokens")
    rows = []

    def add_rows(op: str, m: int, results: dict):
        for name, (time_taken, note) in results.items():
            rows.append({"op": op, "m": m, "tp": tp, "variant": name, "time_ms": time_taken,
                         "unavailable": note if isinstance(note, str) else None,
                         "check_error": note if isinstance(note, float) else None})

    progress = Progress("xla_windowed" if args.windowed_only else "jax_collective_matmul",
                        len(args.ops) * len(args.m) + len(MLP_STEPS) * len(args.mlp_tokens))
    for op in args.ops:
        for m in args.m:
            progress.start(f"{op} M={m}")
            shapes = Shapes(jax, mesh, op, m, seed=m)
            xla = xla_variants(jax, mesh, shapes)
            if args.windowed_only:
                add_rows(op, m, measure(jax, xla, args))
                continue
            reference = xla["xla_default"]()
            variants = dict(xla)
            ppermute = ppermute_variant(jax, mesh, shapes)
            if ppermute is not None:
                variants["ppermute"] = ppermute
            variants.update(meshla_variants(jax, mesh, shapes))
            results = measure(jax, variants, args, reference)
            layouts = measure(jax, gemm_variant(jax, mesh, shapes), args)
            times = [t for t, _ in layouts.values() if t is not None]
            results["gemm"] = (min(times) if times else None,
                               None if times else str(layouts))
            add_rows(op, m, results)
    for (step, sequence_parallel), m in itertools.product(MLP_STEPS.items(), args.mlp_tokens):
        progress.start(f"{step} M={m}")
        try:
            variants = mlp_step_variants(jax, mesh, m, args.windowed_only, sequence_parallel)
            # Each variant's first step starts from the same parameters: their losses must agree.
            xla = {"xla_default": variants.pop("xla_default")}
            reference = xla["xla_default"]()
            results = {**measure(jax, xla, args), **measure(jax, variants, args, reference)}
        except Exception as failure:  # reported in its rows; the operations' rows still land
            note = f"{type(failure).__name__}: {str(failure)[:200]}"
            names = ("xla_default",) if args.windowed_only else (
                "xla_default", "meshla", "meshla_fp8_tensorwise", "meshla_fp8_rowwise")
            results = {name: (None, note) for name in names}
        add_rows(step, m, results)
    if args.windowed_only:
        with open(args.out, "w") as f:
            json.dump(rows, f)
        return
    others = {"xla_windowed": lambda: windowed_times(args)}
    if not args.no_torch:
        others["torch_meshla_auto"] = lambda: torch_times(args, tp)
    for name, measure_other in others.items():
        try:
            times = measure_other()
        except subprocess.CalledProcessError as failure:  # reported; the other rows still land
            cases = [(op, m) for op in args.ops for m in args.m]
            if name == "xla_windowed":
                cases += [(step, m) for step in MLP_STEPS for m in args.mlp_tokens]
            times = {case: (None, f"{name} failed: {failure}") for case in cases}
        for (op, m), (time_taken, note) in times.items():
            rows.append({"op": op, "m": m, "tp": tp, "variant": name, "time_ms": time_taken,
                         "unavailable": note, "check_error": None})
    # The operations against the local GEMM; the training step against XLA's faster variant.
    base = {(r["op"], r["m"]): r["time_ms"] for r in rows if r["variant"] == "gemm"}
    for r in rows:
        if r["op"] in MLP_STEPS and r["time_ms"] is not None and r["variant"].startswith("xla"):
            key = (r["op"], r["m"])
            base[key] = min(base.get(key) or r["time_ms"], r["time_ms"])
    for r in rows:
        reference_time = base.get((r["op"], r["m"]))
        r["ratio"] = r["time_ms"] / reference_time if r["time_ms"] and reference_time else None
    record = {"device": devices[0].device_kind, "device_count": tp,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "commit": args.commit, "jax": jax.__version__, "dtype": "bfloat16",
              "iters": args.iters, "warmup_ms": args.warmup_ms, "reps": args.reps,
              "env": {name: os.environ.get(name) for name in MULTICAST_OFF}, "rows": rows}
    append_run(args.out, record)
    print(f"{'op':<22} {'M':>6} {'variant':<18} {'time_ms':>9} {'ratio':>6}  note")
    order = [*OPS, *MLP_STEPS]
    for r in sorted(rows, key=lambda r: (order.index(r["op"]), r["m"])):
        time_cell = "-" if r["time_ms"] is None else f"{r['time_ms']:.3f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"{r['op']:<22} {r['m']:>6} {r['variant']:<18} {time_cell:>9} {ratio:>6}  "
              f"{r['unavailable'] or ''}".rstrip())
    print("ratio = time / gemm (one GPU's local GEMM of the same size, its faster layout); for "
          "the training steps, time / XLA's faster variant of the same step")


if __name__ == "__main__":
    main()
