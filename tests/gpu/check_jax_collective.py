"""GPU checks of meshla.jax's collective matmuls: every op × dtype × layout × backend on global
arrays against a float64 numpy reference, a sequence-parallel MLP's loss and gradients against
jax.grad of plain jax.numpy, a data × tensor mesh, a tensor axis of one, and many calls of random
ops in one jitted fori_loop. Fresh random inputs each run. The outputs are XLA's buffers, which it
allocates for each run: they cannot be poisoned from here; a stale one shows as a wrong value
only if XLA handed back a buffer that already held the right result (the fori_loop check feeds
each call's output into the next to catch that).

Process models: one process driving every GPU (XLA calls the handlers on one thread per GPU), or
with --processes N one process per GPU under jax.distributed (this script launches them; each
group's NCCL id goes through jax.distributed's key-value store). --command-buffers sets XLA's
--xla_gpu_enable_command_buffer before jax starts: "" turns them off, "+COLLECTIVES" adds the
collectives to the default kinds."""

import os
import sys

from processes import add_arguments as add_process_arguments
from processes import launch as launch_processes
from reporting import Reporter, check_parser

# The families of checks (``--families``): what tests/gpu/test_gpu_suite.py selects with -k.
FAMILIES = ("ops", "gradients", "loop", "donation")
parser = check_parser(__doc__, "jax-collective", FAMILIES)
parser.add_argument("--command-buffers", default=None,
                    help="XLA's --xla_gpu_enable_command_buffer (default: XLA's own)")
add_process_arguments(parser)
args = parser.parse_args()
if args.processes and args.process_id is None:
    sys.exit(launch_processes(__file__, args.processes))
if args.command_buffers is not None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
                               + args.command_buffers).strip()

import jax  # noqa: E402

if args.process_id is not None:
    jax.distributed.initialize(args.coordinator, num_processes=args.processes,
                               process_id=args.process_id, local_device_ids=[args.process_id])
# The references' float32 matmuls in full float32, as meshla's are (not TF32).
jax.config.update("jax_default_matmul_precision", "highest")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import meshla.jax as mj  # noqa: E402

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def error(actual, expected) -> float:
    actual = np.asarray(actual, np.float64)
    if not np.isfinite(actual).all():
        return float("inf")
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def put(value, mesh, spec=P()):
    """``value`` (the same on every process) as a global array laid out by ``spec``."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda index: value[index])


def fetch(array) -> np.ndarray:
    """A global array's whole value on this process."""
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


class Checks:
    def __init__(self, report: Reporter):
        self.report = report
        # Every process draws the same inputs (one process: a fresh seed).
        seed = int.from_bytes(os.urandom(4), "little") if args.seed is None else args.seed
        self.rng = np.random.default_rng(seed)

    def run(self, name, body):
        self.report.check(name, body, rank=jax.process_index(), traceback_limit=8)

    def random(self, shape, dtype):
        return self.rng.standard_normal(shape).astype(dtype)

    def ops(self, mesh, dtype, trans_b: bool, backend: str, m=512, k=384, n=256):
        """The three ops on global arrays in one jitted function, with a bias."""
        tp = mesh.shape["tp"]
        a = self.random((m, k), dtype)
        b = self.random((n, k) if trans_b else (k, n), dtype)
        bias = self.random((n,), dtype)
        product = (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T if trans_b else
                   np.asarray(a, np.float64) @ np.asarray(b, np.float64))
        expected = product + np.asarray(bias, np.float64)

        def all_three(a, b, bias):
            options = dict(mesh=mesh, axis_name="tp", bias=bias, trans_b=trans_b,
                           backend=backend)
            gathered_product, gathered = mj.all_gather_matmul_global(
                a, b, return_gathered=True, **options)
            return (gathered_product, gathered, mj.matmul_reduce_scatter_global(a, b, **options),
                    mj.matmul_all_reduce_global(a, b, **options))

        def body():
            outputs = jax.jit(all_three)(put(a, mesh), put(b, mesh), put(bias, mesh))
            ag, gathered, rs, ar = map(fetch, outputs)
            errors = [error(x, expected) for x in (ag, rs, ar)]
            exact = np.array_equal(gathered, a)
            ok = max(errors) < TOLERANCE[dtype] and exact
            return ok, f"errors ag/rs/ar {errors}, gathered exact {exact}"

        self.run(f"ops tp={tp} {jnp.dtype(dtype).name} trans_b={trans_b} {backend}", body)

    def scaled_ops(self, mesh, rowwise: bool, backend: str, m=512, k=384, n=256):
        """The three float8 ops inside shard_map (b [n, k], float8_e4m3fn, float32 scales one
        each or one per row and column), bfloat16 out with a bias, against float64 products of
        the dequantized operands: only accumulation and the output's rounding differ."""
        tp = mesh.shape["tp"]
        fp8 = jnp.float8_e4m3fn
        a = self.random((m, k), np.float32).astype(fp8)
        b = self.random((n, k), np.float32).astype(fp8)
        a_scale = self.rng.uniform(0.5, 1.5, m if rowwise else 1).astype(np.float32)
        b_scale = (self.rng.uniform(0.5, 1.5, n if rowwise else 1) / k ** 0.5).astype(np.float32)
        bias = self.random((n,), jnp.bfloat16)

        def dequantized(x, scale):
            return np.asarray(x, np.float64) * np.asarray(scale, np.float64).reshape(
                (-1, 1) if scale.size > 1 else ())

        expected = (dequantized(a, a_scale) @ dequantized(b, b_scale).T
                    + np.asarray(bias, np.float64))
        rows = P("tp") if rowwise else P()
        options = dict(axis_name="tp", mesh=mesh, backend=backend)

        def gather(a, b, a_scale, b_scale, bias):
            return mj.all_gather_scaled_matmul(a, b, a_scale, b_scale, bias=bias, **options)

        def reduce(a, b, a_scale, b_scale, bias):
            return (mj.scaled_matmul_reduce_scatter(a, b, a_scale, b_scale, bias=bias, **options),
                    mj.scaled_matmul_all_reduce(a, b, a_scale, b_scale, bias=bias, **options))

        def body():
            gathered = jax.jit(jax.shard_map(
                gather, mesh=mesh, in_specs=(P("tp", None), P("tp", None), rows, rows, P("tp")),
                out_specs=P(None, "tp")))(*(put(x, mesh, spec) for x, spec in zip(
                    (a, b, a_scale, b_scale, bias),
                    (P("tp", None), P("tp", None), rows, rows, P("tp")))))
            specs = (P(None, "tp"), P(None, "tp"), P(), P(), P())
            scattered, summed = jax.jit(jax.shard_map(
                reduce, mesh=mesh, in_specs=specs, out_specs=(P("tp", None), P())))(
                    *(put(x, mesh, spec) for x, spec in zip((a, b, a_scale, b_scale, bias),
                                                            specs)))
            errors = [error(fetch(x), expected) for x in (gathered, scattered, summed)]
            dtypes = {str(x.dtype) for x in (gathered, scattered, summed)}
            return (max(errors) < 1e-2 and dtypes == {"bfloat16"},
                    f"errors ag/rs/ar {errors}, dtypes {dtypes}")

        recipe = "rowwise" if rowwise else "tensorwise"
        self.run(f"scaled ops tp={tp} {recipe} {backend}", body)

    def mlp_gradients(self, mesh, trans_b: bool, sequence_parallel: bool = True,
                      recompute: bool = False):
        """An MLP over a (data, tp) mesh: loss and every gradient. Sequence parallel, all-gather
        then reduce-scatter (with ``recompute``, the all-gather's rows gathered again in the
        backward); without, column_parallel_matmul (its input's gradient an all-reduce) then
        matmul_all_reduce."""
        data, tp = mesh.shape["data"], mesh.shape["tp"]
        tokens, hidden, ffn = 256 * tp, 128, 256
        x = self.random((data, tokens, hidden), jnp.float32)
        w1 = self.random((ffn, hidden) if trans_b else (hidden, ffn), jnp.float32) * 0.1
        w2 = self.random((hidden, ffn) if trans_b else (ffn, hidden), jnp.float32) * 0.1
        b1, b2 = self.random((ffn,), jnp.float32), self.random((hidden,), jnp.float32)
        kn = (lambda w: w.T) if trans_b else (lambda w: w)

        def plain(x, w1, w2, b1, b2):
            h = jnp.tanh(jnp.matmul(x, kn(w1), precision="highest") + b1)
            return jnp.sum(jnp.tanh(jnp.matmul(h, kn(w2), precision="highest") + b2) ** 2)

        def shard_loss(x, w1, w2, b1, b2):
            options = dict(axis_name="tp", mesh=mesh, trans_b=trans_b)
            if not sequence_parallel:  # x and y the same on every shard of tp
                h = mj.column_parallel_matmul(x[0], w1, bias=b1, **options)
                y = mj.matmul_all_reduce(jnp.tanh(h), w2, bias=b2, **options)
                return jax.lax.psum(jnp.sum(jnp.tanh(y) ** 2), "data")
            h = mj.all_gather_matmul(x[0], w1, bias=b1, recompute_gathered=recompute, **options)
            y = mj.matmul_reduce_scatter(jnp.tanh(h), w2, bias=b2, **options)
            return jax.lax.psum(jnp.sum(jnp.tanh(y) ** 2), ("data", "tp"))

        column = P("tp", None) if trans_b else P(None, "tp")
        row = P(None, "tp") if trans_b else P("tp", None)
        rows = P("data", "tp", None) if sequence_parallel else P("data", None, None)
        specs = (rows, column, row, P("tp"), P())

        def body():
            loss, grads = jax.jit(jax.shard_map(
                jax.value_and_grad(shard_loss, argnums=(0, 1, 2, 3, 4)), mesh=mesh,
                in_specs=specs, out_specs=(P(), specs)))(
                    *[put(v, mesh, s) for v, s in zip((x, w1, w2, b1, b2), specs)])
            loss, grads = float(fetch(loss)), [fetch(g) for g in grads]
            expected_loss = float(plain(x, w1, w2, b1, b2))
            expected = jax.grad(plain, argnums=(0, 1, 2, 3, 4))(x, w1, w2, b1, b2)
            errors = [abs(float(loss) - expected_loss) / abs(expected_loss)]
            errors += [error(g, np.asarray(e, np.float64)) for g, e in zip(grads, expected)]
            return max(errors) < 1e-4, f"loss and gradient errors {errors}"

        form = ("" if sequence_parallel else " column_parallel_matmul") + (
            " recompute_gathered" if recompute else "")
        self.run(f"mlp gradients{form} data={data} tp={tp} trans_b={trans_b}", body)

    def fp8_gradients(self, mesh, recipe: str, sequence_parallel: bool = True):
        """The MLP of mlp_gradients in bfloat16 with fp8=recipe (b as [n, k], no tanh on the
        output; sequence parallel or not, as there): the loss's gradients against jax.grad of
        the plain float32 model, within fp8 rounding's bound
        (tests/python/test_jax_collective_cpu.py derives it). The last tp shard's rows are 10x
        larger, so that with sequence parallelism a scale applied to another shard's rows
        fails."""
        data, tp = mesh.shape["data"], mesh.shape["tp"]
        tokens, hidden, ffn = 256 * tp, 128, 256
        x = self.random((data, tokens, hidden), np.float32)
        x[:, (tp - 1) * tokens // tp:] *= 10
        w1 = self.random((ffn, hidden), np.float32) / hidden ** 0.5
        w2 = self.random((hidden, ffn), np.float32) / ffn ** 0.5
        b2 = self.random((hidden,), np.float32)
        r = self.random((data, tokens, hidden), np.float32)  # the output's gradient
        x, w1, w2, b2 = (np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32)
                         for v in (x, w1, w2, b2))  # the values the bfloat16 model holds

        def plain(x, w1, w2, b2):
            h = jax.nn.relu(jnp.matmul(x, w1.T, precision="highest"))
            return jnp.sum((jnp.matmul(h, w2.T, precision="highest") + b2) * r)

        def shard_loss(x, w1, w2, b2, r):
            options = dict(axis_name="tp", mesh=mesh, trans_b=True, fp8=recipe)
            if not sequence_parallel:
                h = mj.column_parallel_matmul(x[0], w1, **options)
                y = mj.matmul_all_reduce(jax.nn.relu(h), w2, bias=b2, **options)
                return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * r[0]), "data")
            h = mj.all_gather_matmul(x[0], w1, **options)
            y = mj.matmul_reduce_scatter(jax.nn.relu(h), w2, bias=b2, **options)
            return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * r[0]), ("data", "tp"))

        rows = P("data", "tp", None) if sequence_parallel else P("data", None, None)
        specs = (rows, P("tp", None), P(None, "tp"), P())
        bound = 4 * (4.0 ** -3 + 4.0 ** -4) ** 0.5 / 3 ** 0.5  # two e5m2 x e4m3 products deep

        def body():
            grads = jax.jit(jax.shard_map(
                jax.grad(shard_loss, argnums=(0, 1, 2, 3)), mesh=mesh,
                in_specs=(*specs, specs[0]), out_specs=specs))(
                    *[put(jnp.asarray(v, jnp.bfloat16), mesh, s)
                      for v, s in zip((x, w1, w2, b2), specs)], put(r, mesh, specs[0]))
            expected = jax.grad(plain, argnums=(0, 1, 2, 3))(x, w1, w2, b2)
            errors = [error(fetch(g), np.asarray(e, np.float64))
                      for g, e in zip(grads, expected)]
            return max(errors) < bound, f"gradient errors {errors} (bound {bound:.3f})"

        form = "" if sequence_parallel else " column_parallel_matmul"
        self.run(f"fp8 gradients{form} {recipe} data={data} tp={tp}", body)

    def many_calls(self, mesh, calls=2000):
        """Random ops and shapes inside one jitted fori_loop, each output feeding the next call,
        against the same chain in float64 numpy (orthogonal weights keep the values in range):
        an all-gather→GEMM then a GEMM→reduce-scatter through a square or a twice-as-wide
        middle, with b as [k, n] or as [n, k], or a GEMM→all-reduce."""
        tp = mesh.shape["tp"]
        width = 64 * tp
        steps = self.rng.integers(0, 4, calls)

        def orthogonal(rows, cols):  # orthonormal columns
            return np.linalg.qr(self.rng.standard_normal((rows, cols)))[0]

        q = [orthogonal(width, width) for _ in range(6)]
        wide = orthogonal(2 * width, width)  # wideᵀ wide = I
        # (array, sharding): b as the op takes it. [k, n] column-parallel b splits n, row-parallel
        # b splits k; as [n, k] (trans_b) the other way round.
        weights = [(q[0], P(None, "tp")), (q[1], P("tp", None)),
                   (wide.T, P(None, "tp")), (wide @ q[2], P("tp", None)),
                   (q[3], P("tp", None)),
                   (q[4].T, P("tp", None)), (q[5].T, P(None, "tp"))]
        expected_step = [lambda x: x @ q[0] @ q[1], lambda x: x @ q[2], lambda x: x @ q[3],
                         lambda x: x @ q[4] @ q[5]]
        x = self.random((32 * tp, width), jnp.float32)

        def shard_chain(x, *w):
            own = jax.lax.axis_index("tp")

            def through(first, second, trans_b=False):
                def step(x):
                    h = mj.all_gather_matmul(x, first, axis_name="tp", mesh=mesh,
                                             trans_b=trans_b)
                    return mj.matmul_reduce_scatter(h, second, axis_name="tp", mesh=mesh,
                                                    trans_b=trans_b)
                return step

            def reduced(x):
                columns = jax.lax.dynamic_slice_in_dim(
                    jax.lax.all_gather(x, "tp", tiled=True), own * (width // tp), width // tp, 1)
                full = mj.matmul_all_reduce(columns, w[4], axis_name="tp", mesh=mesh)
                return jax.lax.dynamic_slice_in_dim(full, own * x.shape[0], x.shape[0])

            branches = (through(w[0], w[1]), through(w[2], w[3]), reduced,
                        through(w[5], w[6], trans_b=True))
            return jax.lax.fori_loop(
                0, calls, lambda i, x: jax.lax.switch(jnp.asarray(steps)[i], branches, x), x)

        specs = (P("tp", None), *(spec for _, spec in weights))

        def body():
            out = jax.jit(jax.shard_map(shard_chain, mesh=mesh, in_specs=specs,
                                        out_specs=P("tp", None)))(
                put(x, mesh, P("tp", None)),
                *[put(w.astype(np.float32), mesh, spec) for w, spec in weights])
            out = fetch(out)
            expected = np.asarray(x, np.float64)
            for step in steps:
                expected = expected_step[step](expected)
            measured = error(out, expected)
            return measured < 1e-4, f"{calls} calls, error {measured}"

        self.run(f"{calls} calls of random ops and shapes in a fori_loop tp={tp}", body)

    def donated(self, mesh):
        """A jitted call with its input donated: XLA may hand the input's buffer to an output."""
        tp = mesh.shape["tp"]
        a = self.random((128 * tp, 256), jnp.float32)
        b = self.random((256, 256), jnp.float32)
        expected = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
        call = jax.jit(lambda a, b: mj.matmul_all_reduce_global(a, b, mesh=mesh, axis_name="tp"),
                       donate_argnums=0)

        def body():
            errors = [error(fetch(call(put(a, mesh, P(None, "tp")), put(b, mesh, P("tp", None)))),
                            expected) for _ in range(3)]
            return max(errors) < 1e-5, f"errors {errors}"

        self.run(f"donated input tp={tp}", body)


def main():
    report = Reporter(args.results, args.model, args.families)
    checks, run = Checks(report), report.family
    devices = np.array(jax.devices("gpu"))
    count = len(devices)
    buffers = "XLA default" if args.command_buffers is None else repr(args.command_buffers)
    print(f"{count} GPUs in {jax.process_count()} processes: {devices[0].device_kind}; command "
          f"buffers {buffers}", flush=True)
    # A tensor axis of one: one GPU alone where one process drives them all; with one process
    # per GPU (where every process takes part in every call) a data axis over all of them.
    alone = devices[:1].reshape(1, 1) if jax.process_count() == 1 else devices.reshape(count, 1)
    layouts = [alone] + ([devices.reshape(1, count)] if count > 1 else [])
    for layout in layouts:
        mesh = Mesh(layout, ("data", "tp"))
        tp = mesh.shape["tp"]
        for dtype in DTYPES:
            for trans_b in (False, True):
                for backend in (("auto", "nccl", "symmetric") if tp > 1 else ("auto",)):
                    run("ops", checks.ops, mesh, dtype, trans_b, backend)
        for rowwise in (False, True):
            for backend in (("nccl", "symmetric") if tp > 1 else ("auto",)):
                run("ops", checks.scaled_ops, mesh, rowwise, backend)
        run("gradients", checks.mlp_gradients, mesh, True, True, True)  # recompute_gathered
        for sequence_parallel in (True, False):
            run("gradients", checks.mlp_gradients, mesh, True, sequence_parallel)
            for recipe in ("tensorwise", "rowwise"):
                run("gradients", checks.fp8_gradients, mesh, recipe, sequence_parallel)
        run("loop", checks.many_calls, mesh)
        run("donation", checks.donated, mesh)
    if count % 2 == 0:  # a data × tensor mesh: two tensor-parallel groups
        data_tp = Mesh(devices.reshape(2, count // 2), ("data", "tp"))
        run("gradients", checks.mlp_gradients, data_tp, False)
        run("gradients", checks.mlp_gradients, data_tp, False, False)


if __name__ == "__main__":
    main()
