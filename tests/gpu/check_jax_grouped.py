"""GPU checks of meshla.jax.grouped_linear and grouped_matmul (one GPU), one JSON line per check.

  python tests/gpu/check_jax_grouped.py --results FILE

Every pass (the product, and through jax.vjp the input, weight and bias gradients) against a
float64 per-group loop over the same (rounded) inputs, for bf16, fp16 and fp32, skewed group sizes
with an empty group, with and without a bias, under jax.jit (XLA's command buffers at their
default), and inside jax.shard_map; grouped_matmul the same way with rhs in ragged_dot's
[G, in, out] layout (the core runs its passes on the other kernels). XLA hands a custom call
fresh output buffers, which NaN cannot be written into before the call; instead each check runs
twice on fresh random inputs of one shape, so that an output left unwritten holds the first run's
values and fails the second. Also:
bad group sizes under jit give NaN, and the next grouped call on the GPU raises the device-side
check's words.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import meshla.jax as mj  # noqa: E402
from reporting import Reporter, check_parser  # noqa: E402

FAMILIES = ("passes", "ragged-layout", "shard-map", "errors")
TOLERANCE = {jnp.bfloat16: 1e-2, jnp.float16: 5e-3, jnp.float32: 1e-5}
# (sizes, in_features, out_features): an empty group, a group of one row, groups past a tile;
# features that are not multiples of 8 (run padded in 16 bits): out only, and both.
SHAPES = [([300, 0, 1, 77, 1000], 64, 128), ([4096, 2048, 0, 2048], 1024, 512),
          ([700, 0, 1300], 1000, 1001), ([5, 300, 0, 90], 61, 37)]


def relative(got, want) -> float:
    got = np.asarray(got, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def loop(x, sizes, weight, bias, dy):
    """y, dx, dweight, dbias in float64."""
    x, weight, dy = (np.asarray(a, np.float64) for a in (x, weight, dy))
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    y, dx = np.zeros((x.shape[0], weight.shape[1])), np.zeros_like(x)
    dweight, dbias = np.zeros_like(weight), np.zeros((len(sizes), weight.shape[1]))
    for g in range(len(sizes)):
        rows = slice(starts[g], starts[g + 1])
        y[rows] = x[rows] @ weight[g].T + (0 if bias is None else np.asarray(bias[g], np.float64))
        dx[rows] = dy[rows] @ weight[g]
        dweight[g] = dy[rows].T @ x[rows]
        dbias[g] = dy[rows].sum(0)
    return y, dx, dweight, dbias


def passes(report: Reporter, seed: int, ragged: bool = False) -> None:
    """Every pass of grouped_linear, or (ragged) of grouped_matmul with rhs [G, in, out]."""
    for sizes, in_features, out_features in SHAPES:
        for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
            for with_bias in (False, True):
                def body():
                    errors = []
                    for run in range(2):
                        keys = jax.random.split(jax.random.key(seed + run), 4)
                        rows = sum(sizes)
                        x = jax.random.normal(keys[0], (rows, in_features), dtype)
                        w = (jax.random.normal(keys[1], (len(sizes), out_features, in_features))
                             / in_features**0.5).astype(dtype)
                        b = (jax.random.normal(keys[2], (len(sizes), out_features), dtype)
                             if with_bias else None)
                        dy = jax.random.normal(keys[3], (rows, out_features), dtype)
                        m_splits = jnp.asarray(sizes, jnp.int32)

                        def layer(x, w, b):
                            if ragged:
                                return mj.grouped_matmul(x, w, m_splits, b)
                            return mj.grouped_linear(x, m_splits, w, b)

                        def step(x, w, b):
                            y, pullback = jax.vjp(layer, x, w, b)
                            return (y, *pullback(dy))

                        if ragged:  # rhs [G, in, out] in memory; its gradient back to [G, out, in]
                            y, dx, d_rhs, db = jax.jit(step)(x, jnp.swapaxes(w, 1, 2), b)
                            got = (y, dx, jnp.swapaxes(d_rhs, 1, 2), db)
                        else:
                            got = jax.jit(step)(x, w, b)
                        want = loop(x, sizes, w, b, dy)
                        errors.append([relative(g, r) for g, r in zip(got, want) if g is not None])
                        # The empty group's weight gradient is zero.
                        empty_group = np.asarray(got[2][sizes.index(0)], np.float64)
                        errors[-1].append(float(np.abs(empty_group).max()))
                    worst = max(max(e[:-1]) for e in errors)
                    empty = max(e[-1] for e in errors)
                    return (worst < TOLERANCE[dtype] and empty == 0,
                            f"relative errors y/dx/dW/db by run {errors}")

                report.check(f"{'grouped_matmul' if ragged else 'grouped_linear'} sizes={sizes} "
                             f"in={in_features} out={out_features} {jnp.dtype(dtype).name} "
                             f"bias={with_bias}", body)


def shard_map(report: Reporter, seed: int) -> None:
    """Inside jax.shard_map over a mesh of this GPU (the custom calls' results typed with the
    operands' varying axes), weights split over the axis: the loss and gradients of a squared
    sum against the float64 loop."""
    def body():
        from jax.sharding import Mesh
        from jax.sharding import PartitionSpec as P

        sizes = [300, 0, 77, 1000]
        mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
        layer = jax.shard_map(lambda x, s, w, b: mj.grouped_linear(x, s, w, b), mesh=mesh,
                              in_specs=(P("ep"),) * 4, out_specs=P("ep"))
        m_splits = jnp.asarray(sizes, jnp.int32)
        step = jax.jit(lambda x, w, b: jax.vjp(lambda x, w, b: layer(x, m_splits, w, b),
                                               x, w, b))
        errors = []
        for run in range(2):  # fresh inputs: an unwritten output keeps the first run's values
            keys = jax.random.split(jax.random.key(seed + run), 3)
            x = jax.random.normal(keys[0], (sum(sizes), 64), jnp.float32)
            w = jax.random.normal(keys[1], (len(sizes), 128, 64), jnp.float32) / 8
            b = jax.random.normal(keys[2], (len(sizes), 128), jnp.float32)
            y, pullback = step(x, w, b)
            dy = 2 * y
            want = loop(x, sizes, w, b, np.asarray(dy, np.float64))
            errors.append([relative(g, r) for g, r in zip((y, *pullback(dy)), want)])
        return (max(map(max, errors)) < TOLERANCE[jnp.float32],
                f"relative errors y/dx/dW/db by run {errors}")

    report.check("inside shard_map, weights split over the axis", body)


def errors(report: Reporter, seed: int) -> None:
    """Bad group sizes found on the device: the call's output is NaN and the next call raises,
    naming the function whose call it was (grouped_linear's m_splits, grouped_matmul's
    group_sizes)."""
    def bad_sizes_then_next_call(call, words, seed):
        def body():
            keys = jax.random.split(jax.random.key(seed), 2)
            x = jax.random.normal(keys[0], (96, 64), jnp.bfloat16)
            w = jax.random.normal(keys[1], (2, 32, 64), jnp.bfloat16)
            poisoned = np.asarray(call(x, jnp.asarray([100, -4], jnp.int32), w), np.float32)
            try:
                np.asarray(call(x, jnp.asarray([48, 48], jnp.int32), w))
            except jax.errors.JaxRuntimeError as error:
                named = words in str(error)
                return (bool(np.all(np.isnan(poisoned))) and named,
                        f"NaN output {np.all(np.isnan(poisoned))}; next call: {error}")
            return False, "the next call did not raise"
        return body

    report.check("bad sizes: NaN, then the next call raises", bad_sizes_then_next_call(
        jax.jit(mj.grouped_linear), "m_splits[1]=-4 is negative", seed))
    # grouped_matmul with rhs [G, k, n]: the same weights transposed
    ragged = jax.jit(lambda x, sizes, w: mj.grouped_matmul(x, jnp.swapaxes(w, 1, 2), sizes))
    report.check("bad sizes of grouped_matmul: NaN, then its words", bad_sizes_then_next_call(
        ragged, "grouped_matmul: group_sizes[1]=-4 is negative", seed + 1))


def main():
    args = check_parser(__doc__, "jax-grouped", FAMILIES).parse_args()
    report = Reporter(args.results, args.model, args.families)
    seed = int.from_bytes(os.urandom(4), "little")
    report.family("passes", passes, report, seed)
    report.family("ragged-layout", passes, report, seed, True)
    report.family("shard-map", shard_map, report, seed)
    report.family("errors", errors, report, seed)


if __name__ == "__main__":
    main()
