"""meshla's pillars in JAX, one process driving every device, each against JAX's own way:

    python3 examples/demo_jax.py                  # every GPU
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python3 examples/demo_jax.py              # without GPUs: meshla's reference paths

1. A tensor-parallel MLP block (sequence parallel) inside shard_map: meshla.jax's
   all_gather_matmul and matmul_reduce_scatter against jax.numpy on sharded arrays (XLA inserts
   the collectives).
2. The grouped GEMM of a Mixture-of-Experts layer, forward and backward on one device:
   meshla.jax.grouped_linear against jax.lax.ragged_dot.
3. A distributed Cholesky solve: meshla.jax.linalg.cho_solve over every device against
   jax.scipy.linalg.cho_solve on one.

Every result is checked against float64 (numpy); a line per pillar says what ran where, the
times (median of several jitted runs) and the error.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshla.jax as mj
from meshla.jax import linalg


def time_ms(fn, runs: int) -> float:
    jax.block_until_ready(fn())
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def report(pillar: str, where: str, ours: float, theirs: float, how: str, error: float,
           tolerance: float) -> bool:
    verdict = "OK" if error < tolerance else "FAILED: error above tolerance"
    print(f"[jax] {pillar} on {where}: meshla {ours:.3f} ms, {how} {theirs:.3f} ms "
          f"({theirs / ours:.2f}x); error {error:.1e} vs float64: {verdict}", flush=True)
    return error < tolerance


def round_up(size: int, multiple: int) -> int:
    """Sizes that split evenly over any number of devices (with 16-byte rows on each)."""
    return -(-size // multiple) * multiple


def relative_error(out, reference) -> float:
    out = np.asarray(out, dtype=np.float64)
    return float(np.linalg.norm(out - reference) / np.linalg.norm(reference))


def mlp_block(mesh: Mesh, cpu: bool, where: str, runs: int) -> bool:
    tp = mesh.shape["tp"]
    tokens, hidden = (128 * tp, 256) if cpu else (4096 * tp, 4096)
    inner, dtype = round_up(4 * hidden, 8 * tp), jnp.float32 if cpu else jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (tokens, hidden), dtype)
    w_up = (jax.random.normal(keys[1], (inner, hidden)) / hidden**0.5).astype(dtype)
    w_down = (jax.random.normal(keys[2], (hidden, inner)) / inner**0.5).astype(dtype)
    x, w_up, w_down = (jax.device_put(t, NamedSharding(mesh, spec)) for t, spec in
                       ((x, P("tp", None)), (w_up, P("tp", None)), (w_down, P(None, "tp"))))

    def block(x, up, down):  # this device's rows of x, its slices of the weights ([out, in])
        h = mj.all_gather_matmul(x, up, axis_name="tp", mesh=mesh, trans_b=True)
        return mj.matmul_reduce_scatter(jax.nn.relu(h), down, axis_name="tp", mesh=mesh,
                                        trans_b=True)

    ours = jax.jit(jax.shard_map(block, mesh=mesh, in_specs=(P("tp", None), P("tp", None),
                                                             P(None, "tp")),
                                 out_specs=P("tp", None)))
    theirs = jax.jit(lambda x, up, down: jax.nn.relu(x @ up.T) @ down.T,
                     out_shardings=NamedSharding(mesh, P("tp", None)))
    x64, up64, down64 = (np.asarray(t, dtype=np.float64) for t in (x, w_up, w_down))
    reference = np.maximum(x64 @ up64.T, 0) @ down64.T
    error = max(relative_error(ours(x, w_up, w_down), reference),
                relative_error(theirs(x, w_up, w_down), reference))
    return report(f"tensor-parallel MLP block, {tokens} tokens x {hidden}, tp={tp}, "
                  f"{jnp.dtype(dtype).name}", where,
                  time_ms(lambda: ours(x, w_up, w_down), runs),
                  time_ms(lambda: theirs(x, w_up, w_down), runs), "XLA's sharded matmuls",
                  error, 1e-2 if dtype == jnp.bfloat16 else 1e-5)


def solve(mesh: Mesh, cpu: bool, where: str, runs: int) -> bool:
    n = round_up(512 if cpu else 16384, mesh.devices.size)
    with jax.enable_x64():
        # Made on the first device in float64 (a GPU makes A in a fraction of a second).
        keys = jax.random.split(jax.random.key(1))
        m = jax.random.normal(keys[0], (n, n), jnp.float64) / n**0.5
        a_one = m @ m.T + jnp.eye(n, dtype=jnp.float64)  # positive definite
        b_one = jax.random.normal(keys[1], (n, 1), jnp.float64)
        rows = NamedSharding(mesh, P("tp", None))
        a, b = jax.device_put(a_one, rows), jax.device_put(b_one, rows)
        ours = jax.jit(lambda a, b: linalg.cho_solve(a, b, mesh))
        theirs = jax.jit(lambda a, b: jax.scipy.linalg.cho_solve(
            jax.scipy.linalg.cho_factor(a, lower=True), b))
        x = jax.device_put(ours(a, b), a_one.sharding)
        error = float(jnp.linalg.norm(a_one @ x - b_one) / jnp.linalg.norm(b_one))
        return report(f"Cholesky solve, n={n}, float64, A split over the devices", where,
                      time_ms(lambda: ours(a, b), runs), time_ms(lambda: theirs(a_one, b_one),
                                                                 runs),
                      "jax.scipy.linalg on one device", error, 1e-8)


def moe_layer(cpu: bool, where: str, runs: int) -> bool:
    experts, hidden, ffn, tokens = (4, 64, 128, 512) if cpu else (8, 4096, 2048, 32768)
    dtype = jnp.float32 if cpu else jnp.bfloat16
    sizes = np.full(experts, tokens // experts)
    sizes[0], sizes[-1] = sizes[0] + tokens // (2 * experts), sizes[-1] - tokens // (2 * experts)
    keys = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(keys[0], (tokens, hidden), dtype)
    w = (jax.random.normal(keys[1], (experts, ffn, hidden)) / hidden**0.5).astype(dtype)
    m_splits = jnp.asarray(sizes, jnp.int32)

    def forward_backward(layer):  # the layer's output and the gradients of its sum
        return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(layer(x, w).astype(jnp.float32)),
                                          argnums=(0, 1)))

    ours = forward_backward(lambda x, w: mj.grouped_linear(x, m_splits, w))
    # JAX's own grouped GEMM, its rhs [G, in, out]: the weights transposed once, outside the timing.
    w_t = jnp.swapaxes(w, 1, 2)
    theirs = forward_backward(lambda x, w_t: jax.lax.ragged_dot(x, w_t, m_splits))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    reference = np.concatenate([x64[starts[g]:starts[g + 1]] @ w64[g].T for g in range(experts)])
    error = relative_error(mj.grouped_linear(x, m_splits, w), reference)
    return report(f"MoE grouped GEMM forward + backward, {experts} experts, {tokens} tokens, "
                  f"{hidden} -> {ffn}, {jnp.dtype(dtype).name}", where,
                  time_ms(lambda: ours(x, w), runs), time_ms(lambda: theirs(x, w_t), runs),
                  "jax.lax.ragged_dot", error, 1e-2 if dtype == jnp.bfloat16 else 1e-5)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    devices = jax.devices()
    cpu = devices[0].platform == "cpu"
    where = (f"{len(devices)} CPU device(s) (meshla's reference paths, for correctness, not "
             "speed)" if cpu else f"{len(devices)}x {devices[0].device_kind}")
    mesh = Mesh(np.array(devices), ("tp",))
    one = ("1 CPU device (meshla's reference path, for correctness, not speed)" if cpu
           else f"1x {devices[0].device_kind}")
    results = [mlp_block(mesh, cpu, where, args.runs), moe_layer(cpu, one, args.runs)]
    results.append(solve(mesh, cpu, where, args.runs))
    print("[jax] demo:", "OK" if all(results) else "FAILED")
    raise SystemExit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
