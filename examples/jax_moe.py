"""A Mixture-of-Experts layer trained with optax under jax.jit: meshla.jax.grouped_linear against
jax.lax.ragged_dot, the same losses step by step.

  python3 examples/jax_moe.py                    # the default device (a GPU where there is one)
  JAX_PLATFORMS=cpu python3 examples/jax_moe.py  # without GPUs (meshla's reference path)

Each layer is x + Σₖ gate_k · W_down[e_k] gelu(W_up[e_k] x), the top-k experts e_k of each token
chosen by a linear router: tokens are sorted by expert, each expert's rows go through its own
weights in two grouped matmuls (the group sizes counted on the device: nothing waits for them on
the host), and the rows are put back in token order, weighted by their gates. The experts'
weights are stacks of linear weights, [experts, out, in]: meshla's layout; ragged_dot takes them
transposed ([experts, in, out]), so its model multiplies by the transposes.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import meshla.jax as mj


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512, help="features of each expert's MLP")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    return parser.parse_args()


def init_params(key, layers: int, hidden: int, ffn: int, experts: int, dtype):
    params = []
    for layer_key in jax.random.split(key, layers):
        k1, k2, k3 = jax.random.split(layer_key, 3)
        params.append({
            "router": (jax.random.normal(k1, (experts, hidden)) / np.sqrt(hidden)).astype(dtype),
            "up": (jax.random.normal(k2, (experts, ffn, hidden)) / np.sqrt(hidden)).astype(dtype),
            "down": (jax.random.normal(k3, (experts, hidden, ffn)) / np.sqrt(ffn)).astype(dtype),
        })
    return params


def meshla_experts(rows, group_sizes, up, down):
    return mj.grouped_linear(jax.nn.gelu(mj.grouped_linear(rows, group_sizes, up)), group_sizes,
                             down)


def ragged_dot_experts(rows, group_sizes, up, down):
    hidden = jax.nn.gelu(jax.lax.ragged_dot(rows, jnp.swapaxes(up, 1, 2), group_sizes))
    return jax.lax.ragged_dot(hidden, jnp.swapaxes(down, 1, 2), group_sizes)


def moe_loss(experts_fn, top_k: int):
    """The model's loss with its experts computed by ``experts_fn(rows, group_sizes, up, down)``
    on rows sorted by expert."""
    def loss(params, x, target):
        tokens = x.shape[0]
        for layer in params:
            num_experts = layer["router"].shape[0]
            logits = (x @ layer["router"].T).astype(jnp.float32)
            gates, chosen = jax.lax.top_k(jax.nn.softmax(logits), top_k)  # [tokens, k]
            gates = gates / jnp.sum(gates, axis=1, keepdims=True)
            expert_of_row = chosen.reshape(-1)  # token t's k choices are rows t*k .. t*k+k-1
            order = jnp.argsort(expert_of_row, stable=True)
            rows = x[order // top_k]
            group_sizes = jnp.bincount(expert_of_row, length=num_experts).astype(jnp.int32)
            out = experts_fn(rows, group_sizes, layer["up"], layer["down"])
            unsorted = jnp.zeros_like(out).at[order].set(out).reshape(tokens, top_k, -1)
            x = x + jnp.sum(unsorted * gates[..., None].astype(out.dtype), axis=1)
        return jnp.mean((x.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)

    return loss


def train(loss, params, batches, steps: int):
    optimizer = optax.adamw(1e-3)

    @jax.jit
    def step(params, state, x, target):
        value, grads = jax.value_and_grad(loss)(params, x, target)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state = optimizer.init(params)
    losses = []
    for i in range(steps):
        x, target = batches[i % len(batches)]
        params, state, value = step(params, state, x, target)
        losses.append(float(value))
    return losses


def main():
    args = parse_args()
    dtype = jnp.dtype(args.dtype)
    params = init_params(jax.random.key(0), args.layers, args.hidden, args.ffn, args.experts,
                         dtype)
    batches = [tuple(jax.random.normal(key, (args.tokens, args.hidden), dtype)
                     for key in jax.random.split(jax.random.key(seed)))
               for seed in range(1, 4)]
    meshla_losses = train(moe_loss(meshla_experts, args.top_k), params, batches, args.steps)
    ragged_losses = train(moe_loss(ragged_dot_experts, args.top_k), params, batches, args.steps)
    device = jax.devices()[0]
    print(f"{args.experts} experts, top-{args.top_k}, {args.tokens} tokens x {args.hidden} on "
          f"{device.platform} ({device.device_kind}), {args.dtype}")
    print(f"{'step':>4} {'meshla':>12} {'ragged_dot':>12} {'relative':>10}")
    worst = 0.0
    for i, (ours, theirs) in enumerate(zip(meshla_losses, ragged_losses)):
        relative = abs(ours - theirs) / abs(theirs)
        worst = max(worst, relative)
        print(f"{i:>4} {ours:>12.6f} {theirs:>12.6f} {relative:>10.2e}")
    tolerance = 1e-4 if args.dtype == "float32" else 2e-2
    if not worst < tolerance:
        raise SystemExit(f"the losses differ by {worst:.2e} (tolerance {tolerance:.0e})")
    print(f"same losses step by step (largest relative difference {worst:.2e})")


if __name__ == "__main__":
    main()
