"""CPU tests of meshla.jax.grouped_linear: the reference path against a float64 loop, its
gradients, jit, bad group sizes, and errors in meshla.torch's words. The GPU handlers are checked
by tests/gpu/check_jax_grouped.py."""

import os
import re

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import meshla.jax as mj  # noqa: E402
import meshla.torch as mt  # noqa: E402


def loop_reference(x, sizes, weight, bias):
    """y and the gradients of sum(y * dy) for x, weight and bias, in float64."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    y = np.zeros((x.shape[0], weight.shape[1]))
    for g in range(len(sizes)):
        rows = slice(starts[g], starts[g + 1])
        y[rows] = x[rows] @ weight[g].T + (0 if bias is None else np.asarray(bias[g], np.float64))
    return y


def gradients(x, sizes, weight, bias, dy):
    x, weight, dy = (np.asarray(a, np.float64) for a in (x, weight, dy))
    starts = np.concatenate([[0], np.cumsum(sizes)])
    dx, dweight = np.zeros_like(x), np.zeros_like(weight)
    dbias = np.zeros((len(sizes), weight.shape[1]))
    for g in range(len(sizes)):
        rows = slice(starts[g], starts[g + 1])
        dx[rows] = dy[rows] @ weight[g]
        dweight[g] = dy[rows].T @ x[rows]
        dbias[g] = dy[rows].sum(0)
    return dx, dweight, (dbias if bias is not None else None)


def operands(sizes, in_features=6, out_features=3, seed=0, bias=True, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (sum(sizes), in_features), dtype)
    weight = jax.random.normal(keys[1], (len(sizes), out_features, in_features), dtype)
    b = jax.random.normal(keys[2], (len(sizes), out_features), dtype) if bias else None
    return x, jnp.asarray(sizes, jnp.int32), weight, b


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("jit", [False, True])
def test_matches_a_float64_loop_with_gradients(bias, jit):
    sizes = [5, 0, 7, 1]
    x, m_splits, weight, b = operands(sizes, bias=bias, seed=1 + bias)
    call = jax.jit(mj.grouped_linear) if jit else mj.grouped_linear
    y = call(x, m_splits, weight, b)
    np.testing.assert_allclose(y, loop_reference(x, sizes, weight, b), rtol=1e-5, atol=1e-5)
    dy = jax.random.normal(jax.random.key(7), y.shape)

    def loss(x, weight, b):
        return jnp.sum(mj.grouped_linear(x, m_splits, weight, b) * dy)

    got = jax.grad(loss, argnums=(0, 1, 2) if bias else (0, 1))(x, weight, b)
    want = gradients(x, sizes, weight, b, dy)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[1][1]))  # the empty group's weight gradient is zero


def test_int64_sizes_and_checkpoint():
    sizes = [3, 3]
    x, m_splits, weight, _ = operands(sizes, bias=False)
    with jax.enable_x64(True):
        y64 = mj.grouped_linear(x, jnp.asarray(sizes, jnp.int64), weight)
    np.testing.assert_allclose(y64, mj.grouped_linear(x, m_splits, weight), rtol=1e-6)
    grad = jax.grad(jax.checkpoint(lambda x: jnp.sum(mj.grouped_linear(x, m_splits, weight))))(x)
    np.testing.assert_allclose(grad, gradients(x, sizes, weight, None, np.ones((6, 3)))[0],
                               rtol=1e-5, atol=1e-5)


def test_bad_sizes_raise_eagerly_and_poison_under_jit():
    x, _, weight, _ = operands([3, 3], bias=False)
    with pytest.raises(ValueError, match=r"m_splits\[1\]=-1 is negative"):
        mj.grouped_linear(x, jnp.asarray([7, -1], jnp.int32), weight)
    with pytest.raises(ValueError, match="sums to 5 but the input has 6 rows"):
        mj.grouped_linear(x, jnp.asarray([2, 3], jnp.int32), weight)
    y = jax.jit(mj.grouped_linear)(x, jnp.asarray([2, 3], jnp.int32), weight)
    assert np.all(np.isnan(y))


def message(call) -> str:
    with pytest.raises(ValueError) as error:
        call()
    return str(error.value)


@pytest.mark.parametrize("case", ["float64", "weight shape", "sizes dtype"])
def test_errors_are_meshla_torchs(case):
    """The same bad call refused by both front ends in the same words (dtype names aside)."""
    x, w = np.random.randn(6, 4).astype(np.float32), np.random.randn(2, 3, 4).astype(np.float32)
    sizes = np.array([3, 3], np.int64)
    if case == "float64":
        x, w = x.astype(np.float64), w.astype(np.float64)
    if case == "weight shape":
        w = np.random.randn(2, 3, 5).astype(np.float32)
    if case == "sizes dtype":
        sizes = sizes.astype(np.float32)
    with jax.enable_x64(case == "float64"):
        from_jax = message(lambda: mj.grouped_linear(jnp.asarray(x), jnp.asarray(sizes),
                                                     jnp.asarray(w)))
    from_torch = message(lambda: mt.grouped_linear(torch.from_numpy(x), torch.from_numpy(sizes),
                                                   torch.from_numpy(w)))
    assert re.sub(r"torch\.", "", from_torch) == from_jax
    assert from_jax.startswith("grouped_linear forward: ")


def test_mismatched_dtypes_are_named():
    x, m_splits, weight, _ = operands([3, 3], bias=False)
    with pytest.raises(ValueError, match="grouped_linear: x is float32 but the weights are "
                                         "bfloat16; they must match"):
        mj.grouped_linear(x, m_splits, weight.astype(jnp.bfloat16))


def test_the_moe_example_trains_like_ragged_dot():
    """examples/jax_moe.py on the CPU: meshla's losses are jax.lax.ragged_dot's step by step (the
    example exits non-zero where they differ)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("optax")
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "jax_moe.py")
    done = subprocess.run([sys.executable, example, "--steps", "3", "--tokens", "128",
                           "--hidden", "32", "--ffn", "64"], env=dict(os.environ,
                                                                      JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "same losses step by step" in done.stdout


@pytest.mark.parametrize("experts_split", [True, False])
def test_inside_shard_map(experts_split):
    """Expert parallelism: each device's rows through its own experts (weights split over the
    axis), or through experts every device holds (their gradients summed over the axis, as JAX's
    own differentiation of the same model sums them)."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 host devices (XLA_FLAGS set before jax was imported elsewhere)")
    mesh = Mesh(np.array(jax.devices()[:2]), ("ep",))
    sizes = [10, 0, 30, 24]
    x, m_splits, weight, b = operands(sizes * 2 if experts_split else sizes, seed=3)
    x = jnp.concatenate([x, x[::-1]]) if not experts_split else x
    specs = (P("ep"), P("ep"), P("ep"), P("ep")) if experts_split else (P("ep"), P(), P(), P())

    def model(layer):
        return jax.shard_map(lambda x, s, w, b: layer(x, s, w, b), mesh=mesh, in_specs=specs,
                             out_specs=P("ep"))

    def reference_layer(x, s, w, b):
        groups = jnp.repeat(jnp.arange(w.shape[0]), s, total_repeat_length=x.shape[0])
        return jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), s) + b[groups]

    def loss(layer):
        return lambda x, w, b: jnp.sum(model(layer)(x, m_splits, w, b) ** 2)

    got = jax.jit(jax.value_and_grad(loss(mj.grouped_linear), argnums=(0, 1, 2)))(x, weight, b)
    want = jax.value_and_grad(loss(reference_layer), argnums=(0, 1, 2))(x, weight, b)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def ragged_operands(sizes, k=6, n=3, seed=0, bias=True):
    """lhs, group sizes, rhs [G, k, n] (ragged_dot's layout) and a bias."""
    keys = jax.random.split(jax.random.key(seed), 3)
    # float32 whatever jax_enable_x64 says (other test files turn it on)
    lhs = jax.random.normal(keys[0], (sum(sizes), k), jnp.float32)
    rhs = jax.random.normal(keys[1], (len(sizes), k, n), jnp.float32)
    b = jax.random.normal(keys[2], (len(sizes), n), jnp.float32) if bias else None
    return lhs, jnp.asarray(sizes, jnp.int32), rhs, b


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("jit", [False, True])
def test_grouped_matmul_is_ragged_dot_with_gradients(bias, jit):
    sizes = [4, 0, 6, 2]
    lhs, group_sizes, rhs, b = ragged_operands(sizes, bias=bias, seed=3 + bias)
    call = jax.jit(mj.grouped_matmul) if jit else mj.grouped_matmul
    out = call(lhs, rhs, group_sizes, b)
    weight = jnp.swapaxes(rhs, 1, 2)  # the same product as a linear layer's [G, n, k] weights
    np.testing.assert_allclose(out, loop_reference(lhs, sizes, weight, b), rtol=1e-5, atol=1e-5)
    d_out = jax.random.normal(jax.random.key(9), out.shape, jnp.float32)

    def loss(lhs, rhs, b):
        return jnp.sum(mj.grouped_matmul(lhs, rhs, group_sizes, b) * d_out)

    got = jax.grad(loss, argnums=(0, 1, 2) if bias else (0, 1))(lhs, rhs, b)
    d_lhs, d_weight, d_bias = gradients(lhs, sizes, weight, b, d_out)
    np.testing.assert_allclose(got[0], d_lhs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], np.swapaxes(d_weight, 1, 2), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[1][1]))  # the empty group's gradient is zero
    if bias:
        np.testing.assert_allclose(got[2], d_bias, rtol=1e-5, atol=1e-5)


def test_grouped_matmul_with_transpose_rhs_is_grouped_linear():
    lhs, group_sizes, rhs, b = ragged_operands([3, 5], seed=5)
    weight = jnp.swapaxes(rhs, 1, 2)
    np.testing.assert_array_equal(
        mj.grouped_matmul(lhs, weight, group_sizes, b, transpose_rhs=True),
        mj.grouped_linear(lhs, group_sizes, weight, b))


@pytest.mark.parametrize("case,words", [
    ("rhs shape", "grouped_matmul forward: rhs.shape=[3, 6, 3] must be [G, in, out] = [2, 6, 3]"),
    ("sizes dtype", "grouped_matmul forward: group_sizes is float32, expected int64 or int32"),
    ("bias shape", "grouped_matmul forward: bias.shape=[2, 4] must be [G, out] = [2, 3]"),
    ("dtypes", "grouped_matmul: lhs is float32 but rhs is bfloat16; they must match"),
    ("negative size", "grouped_matmul: group_sizes[1]=-1 is negative"),
    ("sizes sum", "grouped_matmul: group_sizes sums to 5 but the input has 6 rows"),
])
def test_grouped_matmul_errors_name_its_arguments(case, words):
    lhs, group_sizes, rhs, b = ragged_operands([3, 3])
    if case == "rhs shape":
        rhs = jnp.zeros((3, 6, 3), jnp.float32)
    if case == "sizes dtype":
        group_sizes = group_sizes.astype(jnp.float32)
    if case == "bias shape":
        b = jnp.zeros((2, 4), jnp.float32)
    if case == "dtypes":
        rhs = rhs.astype(jnp.bfloat16)
    if case in ("negative size", "sizes sum"):
        sizes = [7, -1] if case == "negative size" else [2, 3]
        group_sizes = jnp.asarray(sizes, group_sizes.dtype)
    from_jax = message(lambda: mj.grouped_matmul(lhs, rhs, group_sizes, b))
    assert from_jax.startswith(words)
    # meshla.torch's grouped_matmul, the same call: the same words (dtype names aside)
    def as_torch(a):  # numpy has no bfloat16: through float32
        if a.dtype == jnp.bfloat16:
            return torch.from_numpy(np.array(a.astype(jnp.float32))).bfloat16()
        return torch.from_numpy(np.array(a))

    from_torch = message(lambda: mt.grouped_matmul(*map(as_torch, (lhs, rhs, group_sizes, b))))
    assert re.sub(r"torch\.", "", from_torch) == from_jax


def test_sixteen_bit_features_that_tma_cannot_read_run():
    """Not multiples of 8: refused before issue 41, now run (padded on GPUs), here too."""
    lhs, group_sizes, rhs, b = (None if a is None else a.astype(jnp.bfloat16)
                                for a in ragged_operands([3, 3], k=6, n=3, seed=11))
    out = mj.grouped_matmul(lhs, rhs, group_sizes.astype(jnp.int32), b)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               loop_reference(lhs, [3, 3], jnp.swapaxes(rhs, 1, 2), b),
                               rtol=1e-2, atol=1e-2)
