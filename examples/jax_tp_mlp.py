"""A tensor-parallel MLP trained with optax under jax.jit: meshla.jax's collective matmuls
against plain jax.numpy on sharded arrays (XLA inserts the collectives), the same losses step by
step.

  python3 examples/jax_tp_mlp.py                 # every GPU on the tensor axis
  python3 examples/jax_tp_mlp.py --data 2        # a data × tensor mesh
  python3 examples/jax_tp_mlp.py --dtype bfloat16 --fp8 tensorwise   # meshla's matmuls in fp8
  python3 examples/jax_tp_mlp.py --no-sequence-parallel   # tokens the same on every tp device
  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
      python3 examples/jax_tp_mlp.py --data 2    # without GPUs (meshla's reference path)

Each block is x + W₂ gelu(W₁ x + b₁) + b₂ with the weights as [out, in]: W₁'s rows (the
hidden features) and W₂'s columns are split over the tensor axis, the tokens of x over it too
(sequence parallelism) and the batch over the data axis. meshla runs the first matmul as an
all-gather→GEMM and the second as a GEMM→reduce-scatter; their backward as the conjugates.
Without sequence parallelism every tensor-axis device holds all the tokens: the first matmul is
column_parallel_matmul (a local GEMM; its input's gradient a GEMM→all-reduce) and the second a
GEMM→all-reduce.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshla.jax as mj


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=int, default=1, help="devices on the data axis")
    parser.add_argument("--batch", type=int, default=4, help="sequences a data-axis device")
    parser.add_argument("--tokens", type=int, default=512, help="tokens a sequence")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--fp8", choices=("tensorwise", "rowwise"), default=None,
                        help="meshla's matmuls in float8 (the losses then agree within 2%%, "
                        "fp8's rounding, not to float32's precision)")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                        help="every tensor-axis device holds all the tokens")
    return parser.parse_args()


def init_params(key, blocks: int, hidden: int, ffn: int, dtype):
    params = []
    for block_key in jax.random.split(key, blocks):
        k1, k2 = jax.random.split(block_key)
        params.append({
            "w1": (jax.random.normal(k1, (ffn, hidden)) / np.sqrt(hidden)).astype(dtype),
            "b1": jnp.zeros((ffn,), dtype),
            "w2": (jax.random.normal(k2, (hidden, ffn)) / np.sqrt(ffn)).astype(dtype),
            "b2": jnp.zeros((hidden,), dtype),
        })
    return params


# Where each parameter lives: W₁ and b₁ split by output features, W₂ by input features.
PARAM_SPECS = {"w1": P("tp", None), "b1": P("tp"), "w2": P(None, "tp"), "b2": P()}


def data_spec(sequence_parallel: bool = True) -> P:
    """[batch, tokens, hidden]: batch over data, tokens over tp with sequence parallelism."""
    return P("data", "tp" if sequence_parallel else None, None)


def plain_loss(params, x, target):
    """The model on global arrays: XLA shards the matmuls from the arrays' shardings."""
    for block in params:
        h = jax.nn.gelu(x @ block["w1"].T + block["b1"])
        x = x + h @ block["w2"].T + block["b2"]
    return jnp.mean((x.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)


def meshla_loss(mesh: Mesh, fp8=None, sequence_parallel: bool = True):
    """The model inside shard_map on each device's shards, its matmuls meshla's (in float8 with
    ``fp8``). The MLP works token by token, and the reduce-scatter hands each device back the
    rows the all-gather took from it, so each block needs no reordering. Without sequence
    parallelism x, and so the loss, is the same on every tensor-axis device."""
    options = dict(axis_name="tp", mesh=mesh, trans_b=True, fp8=fp8)
    first = mj.all_gather_matmul if sequence_parallel else mj.column_parallel_matmul
    second = mj.matmul_reduce_scatter if sequence_parallel else mj.matmul_all_reduce
    summed = ("data", "tp") if sequence_parallel else ("data",)

    def local_loss(params, x, target):
        for block in params:
            rows = x.reshape(-1, x.shape[-1])  # this device's tokens of its sequences
            h = first(rows, block["w1"], bias=block["b1"], **options)
            y = second(jax.nn.gelu(h), block["w2"], bias=block["b2"], **options)
            x = x + y.reshape(x.shape)
        squared = jnp.sum((x.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)
        count = x.size * np.prod([mesh.shape[axis] for axis in summed])
        return jax.lax.psum(squared, summed) / count

    return local_loss


def sharded_meshla_loss(mesh: Mesh, blocks: int, fp8=None, sequence_parallel: bool = True):
    """meshla_loss on global arrays: the parameters and batches sharded as PARAM_SPECS and
    data_spec say."""
    data = data_spec(sequence_parallel)
    return jax.shard_map(meshla_loss(mesh, fp8, sequence_parallel), mesh=mesh,
                         in_specs=([PARAM_SPECS] * blocks, data, data), out_specs=P())


def training_step(loss):
    """One jitted AdamW step: (params, state, x, target) -> (params, state, loss)."""
    optimizer = optax.adamw(1e-3)

    @jax.jit
    def step(params, state, x, target):
        value, grads = jax.value_and_grad(loss)(params, x, target)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step, optimizer.init


def sharded_inputs(mesh: Mesh, blocks: int, batch: int, tokens: int, hidden: int, ffn: int,
                   dtype, sequence_parallel: bool = True):
    """The parameters and three (x, target) batches, placed on the mesh."""
    params = init_params(jax.random.key(0), blocks, hidden, ffn, dtype)
    param_shardings = [{name: NamedSharding(mesh, spec) for name, spec in PARAM_SPECS.items()}
                       for _ in params]
    params = jax.device_put(params, param_shardings)
    data_sharding = NamedSharding(mesh, data_spec(sequence_parallel))
    shape = (batch * mesh.shape["data"], tokens, hidden)
    batches = [tuple(jax.device_put(jax.random.normal(key, shape, dtype), data_sharding)
                     for key in jax.random.split(jax.random.key(seed)))
               for seed in range(1, 4)]
    return params, batches


def train(loss, params, batches, steps: int):
    step, init = training_step(loss)
    state = init(params)
    losses = []
    for i in range(steps):
        x, target = batches[i % len(batches)]
        params, state, value = step(params, state, x, target)
        losses.append(float(value))
    return losses


def main():
    args = parse_args()
    devices = jax.devices()
    if len(devices) % args.data:
        raise SystemExit(f"--data {args.data} does not divide the {len(devices)} devices")
    mesh = Mesh(np.array(devices).reshape(args.data, -1), ("data", "tp"))
    params, batches = sharded_inputs(mesh, args.blocks, args.batch, args.tokens, args.hidden,
                                     args.ffn, jnp.dtype(args.dtype), args.sequence_parallel)
    meshla_losses = train(sharded_meshla_loss(mesh, args.blocks, args.fp8,
                                              args.sequence_parallel), params, batches,
                          args.steps)
    plain_losses = train(plain_loss, params, batches, args.steps)
    fp8 = f", meshla in fp8 ({args.fp8})" if args.fp8 else ""
    form = "sequence parallel" if args.sequence_parallel else "no sequence parallelism"
    print(f"mesh {dict(mesh.shape)} on {devices[0].platform}, {args.dtype}{fp8}, {form}")
    print(f"{'step':>4} {'meshla':>12} {'jnp':>12} {'relative':>10}")
    worst = 0.0
    for i, (ours, theirs) in enumerate(zip(meshla_losses, plain_losses)):
        relative = abs(ours - theirs) / abs(theirs)
        worst = max(worst, relative)
        print(f"{i:>4} {ours:>12.6f} {theirs:>12.6f} {relative:>10.2e}")
    tolerance = 1e-4 if args.dtype == "float32" and not args.fp8 else 2e-2
    if not worst < tolerance:
        raise SystemExit(f"the losses differ by {worst:.2e} (tolerance {tolerance:.0e})")
    print(f"{'losses within fp8 rounding' if args.fp8 else 'same losses step by step'} (largest "
          f"relative difference {worst:.2e})")


if __name__ == "__main__":
    main()
