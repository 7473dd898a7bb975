"""Grouped GEMM in JAX on one GPU: meshla.jax.grouped_linear and grouped_matmul against
jax.lax.ragged_dot, a per-group loop, one dense GEMM of the same total size, and meshla.torch's
grouped_linear at the same shapes, in one run.

  python bench/jax_grouped.py --commit SHA --out results.json

TFLOP/s of forward (y = x W_gᵀ), dgrad (dx = dy W_g) and wgrad (dW_g = dy_gᵀ x_g) for
bench/grouped_linear.py's shapes and routings (DeepSeek-V3's experts over 8 and 32,
Qwen3-30B-A3B's up_proj; uniform and skewed), and 1000 -> 1001 features (padded) beside
1008 -> 1008. JAX's passes are jitted functions of their own (meshla's through jax.vjp of
grouped_linear, and of grouped_matmul and ragged_dot with their rhs [G, in, out]; the loop slices
each group's rows at sizes fixed when traced, as a per-expert loop does), timed as `calls`
back-to-back calls after a warm-up, the median of `reps`; torch's with CUDA events the same way
(bench/fp8_gemm.py's time_ms). Runs are appended to --out's "runs".
"""

import argparse
import datetime
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from collective_matmul import append_run  # noqa: E402
from fp8_gemm import time_ms as torch_time_ms  # noqa: E402
from grouped_linear import SHAPES, routing  # noqa: E402

import meshla.jax as mj  # noqa: E402
import meshla.torch as mt  # noqa: E402


# Issue 41's unaligned example (16-bit features that are not multiples of 8 run on padded
# copies) beside the next aligned size.
UNALIGNED = [("8 x 1000 -> 1001 (padded)", 8, 1000, 1001, 65536),
             ("8 x 1008 -> 1008 (aligned)", 8, 1008, 1008, 65536)]


def jax_ms(fn, args, calls: int, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def jax_passes(grouped, x, w, dy):
    """(forward, dgrad, wgrad) of ``grouped(x, w)`` as jitted functions of (x, w, dy)."""
    forward = jax.jit(lambda x, w, dy: grouped(x, w))
    dgrad = jax.jit(lambda x, w, dy: jax.vjp(lambda x: grouped(x, w), x)[1](dy)[0])
    wgrad = jax.jit(lambda x, w, dy: jax.vjp(lambda w: grouped(x, w), w)[1](dy)[0])
    return {"forward": forward, "dgrad": dgrad, "wgrad": wgrad}


def bench_shape(name, groups, k, n, tokens, skewed, args) -> list[dict]:
    sizes = routing(groups, tokens, skewed)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (tokens, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (groups, n, k)) / k**0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (tokens, n), jnp.bfloat16)
    m_splits = jnp.asarray(sizes, jnp.int32)
    w_t = jnp.swapaxes(w, 1, 2)  # ragged_dot's rhs, [G, in, out]
    starts = [sum(sizes[:g]) for g in range(groups + 1)]

    def per_group_loop(x, w):
        return jnp.concatenate([x[starts[g]:starts[g + 1]] @ w[g].T for g in range(groups)])

    variants = {
        "meshla.jax": (jax_passes(lambda x, w: mj.grouped_linear(x, m_splits, w), x, w, dy),
                       (x, w, dy)),
        "meshla.jax grouped_matmul": (
            jax_passes(lambda x, w_t: mj.grouped_matmul(x, w_t, m_splits), x, w_t, dy),
            (x, w_t, dy)),
        "per-group loop": (jax_passes(per_group_loop, x, w, dy), (x, w, dy)),
        "jax.lax.ragged_dot": (jax_passes(lambda x, w_t: jax.lax.ragged_dot(x, w_t, m_splits),
                                          x, w_t, dy), (x, w_t, dy)),
        "dense GEMM": (jax_passes(lambda x, w0: x @ w0.T, x, w[0], dy), (x, w[0], dy)),
    }
    flops = 2.0 * tokens * k * n
    rows = []

    def record(pass_name, variant, ms, error=None):
        row = {"shape": name, "routing": "skewed" if skewed else "uniform", "pass": pass_name,
               "variant": variant, "ms": ms, "tflops": flops / ms / 1e9 if ms else None}
        if error:
            row["error"] = error
        rows.append(row)
        speed = f"{ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s" if ms else f"failed: {error}"
        print(f"{name:<26} {row['routing']:<8} {pass_name:<8} {variant:<26} {speed}", flush=True)

    for variant, (passes, operands) in variants.items():
        for pass_name, fn in passes.items():
            # A peer that cannot run a shape (ragged_dot's backward lowers to a dense GEMM over
            # every group's columns and runs out of memory at 32 experts) is a result, not a stop.
            try:
                record(pass_name, variant, jax_ms(fn, operands, args.calls, args.reps))
            except jax.errors.JaxRuntimeError as e:
                record(pass_name, variant, None, str(e).splitlines()[0][:160])
    # meshla.torch at the same shape, for the within-3% target.
    tx = torch.from_dlpack(x).contiguous()
    tw, tdy = torch.from_dlpack(w).contiguous(), torch.from_dlpack(dy).contiguous()
    splits = torch.tensor(sizes, dtype=torch.int64, device=tx.device)
    grouped = mt.grouped
    torch_passes = {
        "forward": lambda: grouped._grouped_mm(tx, splits, tw, None),
        "dgrad": lambda: grouped._grouped_mm_dgrad(tdy, splits, tw),
        "wgrad": lambda: grouped._weight_grad(tx, tdy, splits, groups, tx.dtype),
    }
    for pass_name, fn in torch_passes.items():
        record(pass_name, "meshla.torch", torch_time_ms(fn, args.calls, args.reps))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", help="JSON file to append this run to")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", metavar="TEXT",
                        help="only the shapes whose name contains one of these")
    args = parser.parse_args()
    rows = []
    for shape in SHAPES + UNALIGNED:
        if args.shapes and not any(text in shape[0] for text in args.shapes):
            continue
        for skewed in (False, True):
            rows += bench_shape(*shape, skewed, args)
    if args.out:
        run = {"device": jax.devices()[0].device_kind, "commit": args.commit,
               "jax": jax.__version__, "torch": torch.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "calls": args.calls, "reps": args.reps, "rows": rows}
        append_run(args.out, run)


if __name__ == "__main__":
    main()
