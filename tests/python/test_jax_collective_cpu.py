"""meshla.jax's collective matmuls on CPU devices: the reference path the GPU handlers share their
API with, on a 2 × 2 (data × tensor) mesh of host devices. Products and gradients against plain
jax.numpy on the global arrays (float64 in numpy for the products), and every argument check."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import meshla.jax as mj  # noqa: E402
from jax._src.lax.parallel import all_gather_invariant  # noqa: E402

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 host devices (XLA_FLAGS set before jax was imported elsewhere)")
    return Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "tp"))


def random(shape, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def close(actual, expected, dtype):
    expected = np.asarray(expected, np.float64)
    error = np.abs(np.asarray(actual, np.float64) - expected).max() / np.abs(expected).max()
    assert error < TOLERANCE[dtype], error


def weight(k, n, trans_b, dtype, seed):
    """b as [k, n], or as [n, k] with trans_b; and the [k, n] the product multiplies by."""
    b = random((n, k) if trans_b else (k, n), dtype, seed)
    return b, (b.T if trans_b else b)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("trans_b", [False, True])
def test_global_forms_match_the_product(mesh, dtype, trans_b):
    m, k, n = 16, 12, 8
    a = random((m, k), dtype, 1)
    b, rhs = weight(k, n, trans_b, dtype, 2)
    bias = random((n,), dtype, 3)
    expected = np.asarray(a, np.float64) @ np.asarray(rhs, np.float64) + np.asarray(bias,
                                                                                    np.float64)
    out, gathered = jax.jit(lambda a, b, bias: mj.all_gather_matmul_global(
        a, b, mesh=mesh, axis_name="tp", bias=bias, trans_b=trans_b, return_gathered=True))(
            a, b, bias)
    close(out, expected, dtype)
    assert out.dtype == dtype and out.sharding.spec == P(None, "tp")
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(a))
    for function, spec in ((mj.matmul_reduce_scatter_global, P("tp", None)),
                           (mj.matmul_all_reduce_global, P(None, None)),
                           (mj.column_parallel_matmul_global, P(None, "tp"))):
        out = function(a, b, mesh=mesh, axis_name="tp", bias=bias, trans_b=trans_b)
        close(out, expected, dtype)
        assert out.sharding.spec == spec
    # column_parallel_matmul_global's gradients: a's summed over the shards of b's columns
    grads = jax.grad(lambda a, b, bias: jnp.sum(mj.column_parallel_matmul_global(
        a, b, mesh=mesh, axis_name="tp", bias=bias, trans_b=trans_b).astype(jnp.float32) ** 2),
        argnums=(0, 1, 2))(a, b, bias)
    want = jax.grad(lambda a, b, bias: jnp.sum(
        (jnp.matmul(a, b.T if trans_b else b, preferred_element_type=jnp.float32)
         + bias.astype(jnp.float32)) ** 2), argnums=(0, 1, 2))(a, b, bias)
    for got, expected_grad in zip(grads, want):
        close(got, expected_grad, dtype)


def sharded(mesh, function, in_specs, out_specs):
    return jax.jit(jax.shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def put(mesh, array, spec):
    return jax.device_put(array, NamedSharding(mesh, spec))


@pytest.mark.parametrize("trans_b", [False, True])
def test_sequence_parallel_mlp_gradients_match_jax(mesh, trans_b):
    """A sequence-parallel MLP (all-gather→GEMM, GEMM→reduce-scatter) with the batch over 'data':
    its loss and every gradient against jax.grad of the same model in plain jax.numpy."""
    dtype = jnp.float32
    tokens, hidden, ffn = 16, 8, 12
    x = random((2, tokens, hidden), dtype, 4)  # [data, tokens, hidden]
    w1, w1_kn = weight(hidden, ffn, trans_b, dtype, 5)
    w2, w2_kn = weight(ffn, hidden, trans_b, dtype, 6)
    b1, b2 = random((ffn,), dtype, 7), random((hidden,), dtype, 8)

    def plain(x, w1_kn, w2_kn, b1, b2):
        return jnp.sum(jnp.tanh(jnp.tanh(x @ w1_kn + b1) @ w2_kn + b2) ** 2)

    def shard_loss(x, w1, w2, b1, b2):
        h = mj.all_gather_matmul(x[0], w1, axis_name="tp", mesh=mesh, bias=b1, trans_b=trans_b)
        y = mj.matmul_reduce_scatter(jnp.tanh(h), w2, axis_name="tp", mesh=mesh, bias=b2,
                                     trans_b=trans_b)
        return jax.lax.psum(jnp.sum(jnp.tanh(y) ** 2), ("data", "tp"))

    column = P("tp", None) if trans_b else P(None, "tp")
    row = P(None, "tp") if trans_b else P("tp", None)
    specs = (P("data", "tp", None), column, row, P("tp"), P())
    loss_and_grads = sharded(mesh, jax.value_and_grad(shard_loss, argnums=(0, 1, 2, 3, 4)),
                             specs, (P(), specs))
    args = [put(mesh, v, s) for v, s in zip((x, w1, w2, b1, b2), specs)]
    loss, grads = loss_and_grads(*args)
    expected = jax.grad(plain, argnums=(0, 1, 2, 3, 4))(x, w1_kn, w2_kn, b1, b2)
    np.testing.assert_allclose(loss, plain(x, w1_kn, w2_kn, b1, b2), rtol=1e-5)
    transposed = (lambda g: g.T) if trans_b else (lambda g: g)
    for got, want in zip(grads, (expected[0], transposed(expected[1]), transposed(expected[2]),
                                 expected[3], expected[4])):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_all_reduce_and_gathered_rows_gradients(mesh):
    """matmul_all_reduce's gradients, and a's gradient through the gathered rows returned by
    all_gather_matmul (used beside the product), under jax.checkpoint."""
    dtype = jnp.float32
    m, k, n = 8, 6, 4
    a = random((m, k), dtype, 9)
    b = random((k, n), dtype, 10)
    c = random((n, k), dtype, 11)
    bias = random((k,), dtype, 12)

    def plain(a, b, c, bias):
        return jnp.sum(jnp.sin(a @ b) @ c + bias) + jnp.sum(a ** 3)

    @jax.checkpoint
    def shard_loss(a, b, c, bias):
        h, rows = mj.all_gather_matmul(a, b, axis_name="tp", mesh=mesh, return_gathered=True)
        out = mj.matmul_all_reduce(jnp.sin(h), c, axis_name="tp", mesh=mesh, bias=bias)
        return jnp.sum(out) + jnp.sum(rows ** 3)

    specs = (P("tp", None), P(None, "tp"), P("tp", None), P())
    grads = sharded(mesh, jax.grad(shard_loss, argnums=(0, 1, 2, 3)), specs, specs)(
        *[put(mesh, v, s) for v, s in zip((a, b, c, bias), specs)])
    for got, want in zip(grads, jax.grad(plain, argnums=(0, 1, 2, 3))(a, b, c, bias)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_tensor_axis_of_one(mesh):
    one = Mesh(np.array(jax.devices("cpu")[:1]), ("tp",))
    a, b = random((4, 3), jnp.float32, 13), random((3, 5), jnp.float32, 14)
    for function in (mj.all_gather_matmul_global, mj.matmul_reduce_scatter_global,
                     mj.matmul_all_reduce_global):
        close(function(a, b, mesh=one, axis_name="tp"), np.asarray(a) @ np.asarray(b),
              jnp.float32)


def shard_call(on: Mesh, function, *arrays, specs=None, **options):
    """``function`` traced inside shard_map over ``on`` (``options`` may name another mesh)."""
    specs = specs or (P("tp", None),) * len(arrays)
    return sharded(on, lambda *xs: function(*xs, **options), specs, P())(
        *[put(on, x, s) for x, s in zip(arrays, specs)])


def test_bad_input_is_named(mesh):
    a = jnp.ones((8, 6), jnp.float32)
    b = jnp.ones((5, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"all_gather_matmul: b.shape=\[5, 4\] \(\[k, n\]\) "
                                         r"does not match a.shape=\[4, 6\]"):
        shard_call(mesh, mj.all_gather_matmul, a, b, specs=(P("tp", None), P()),
                   axis_name="tp", mesh=mesh)
    with pytest.raises(ValueError, match="a.dtype=int32 is not supported"):
        shard_call(mesh, mj.matmul_all_reduce, jnp.ones((8, 6), jnp.int32),
                   jnp.ones((6, 4), jnp.int32), axis_name="tp", mesh=mesh)
    # float8 operands need scales, which these ops do not take: refused in meshla.torch's words.
    with pytest.raises(ValueError, match="matmul_all_reduce: a_scale is missing: a float8 product "
                                         "needs a_scale and b_scale"):
        shard_call(mesh, mj.matmul_all_reduce, jnp.ones((8, 6), jnp.float8_e4m3fn),
                   jnp.ones((12, 4), jnp.float8_e4m3fn), axis_name="tp", mesh=mesh)
    with pytest.raises(ValueError, match=r"bias.dtype=float16 but a.dtype=float32"):
        shard_call(mesh, lambda a, b, bias: mj.matmul_all_reduce(
            a, b, bias=bias, axis_name="tp", mesh=mesh), a, jnp.ones((6, 4), jnp.float32),
                   jnp.ones((4,), jnp.float16), specs=(P("tp", None), P("tp", None), P()))
    # A 0-d bias would read as no bias in the extension (and broadcast in the reference).
    with pytest.raises(ValueError, match=r"matmul_all_reduce: bias.shape=\[\]: meshla takes "
                                         "arrays of 1 to 4 dimensions"):
        shard_call(mesh, lambda a, b, bias: mj.matmul_all_reduce(
            a, b, bias=bias, axis_name="tp", mesh=mesh), a, jnp.ones((6, 4), jnp.float32),
                   jnp.float32(5), specs=(P("tp", None), P("tp", None), P()))
    with pytest.raises(ValueError, match=r"matmul_reduce_scatter: a.shape\[0\]=3 is not "
                                         "divisible by tp_size=2"):
        shard_call(mesh, mj.matmul_reduce_scatter, jnp.ones((6, 6), jnp.float32),
                   jnp.ones((6, 4), jnp.float32), specs=(P("tp", None), P()), axis_name="tp",
                   mesh=mesh)
    with pytest.raises(ValueError, match=r"axis_name='model' is not an axis of the mesh "
                                         r"\('data', 'tp'\)"):
        shard_call(mesh, mj.matmul_all_reduce, a, jnp.ones((6, 4), jnp.float32),
                   axis_name="model", mesh=mesh)
    with pytest.raises(ValueError, match="no mesh; pass mesh="):
        shard_call(mesh, mj.matmul_all_reduce, a, jnp.ones((6, 4), jnp.float32),
                   axis_name="tp")
    with pytest.raises(ValueError, match="call it inside jax.shard_map over axis 'tp'"):
        mj.matmul_all_reduce(a, jnp.ones((6, 4), jnp.float32), axis_name="tp", mesh=mesh)
    with pytest.raises(ValueError, match="algorithm='spiral' is not one of"):
        shard_call(mesh, mj.all_gather_matmul, a, jnp.ones((6, 4), jnp.float32),
                   specs=(P("tp", None), P()), axis_name="tp", mesh=mesh, algorithm="spiral")


def test_gradient_needs_checked_types(mesh):
    a, b = random((8, 6), jnp.float32, 15), random((6, 4), jnp.float32, 16)

    def loss(a, b):
        return jnp.sum(mj.matmul_all_reduce(a, b, axis_name="tp", mesh=mesh))

    unchecked = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(None, "tp"),
                                                                            P("tp", None)),
                                      out_specs=P(None, "tp"), check_vma=False))
    with pytest.raises(NotImplementedError, match="check_vma=True"):
        unchecked(put(mesh, a, P(None, "tp")), put(mesh, b, P("tp", None)))


def traced_on_gpus(mesh, monkeypatch, shard_loss, x_spec):
    """The GPU path as far as it goes without GPUs: an MLP's loss gradients traced with the
    handlers' custom calls in place of the reference (same types), without lowering them.
    Returns the shard_map body's equations and its custom calls (target, output shapes)."""
    from meshla.jax import collective

    monkeypatch.setattr(collective, "_reference", lambda call, *operands: collective._on_gpus(
        collective.dataclasses.replace(call, group=7), *operands))
    x, w1, w2 = (random(shape, jnp.bfloat16, seed)
                 for seed, shape in enumerate(((2, 16, 8), (12, 8), (8, 12))))
    b2 = random((8,), jnp.bfloat16, 3)
    specs = (x_spec, P("tp", None), P(None, "tp"), P())
    traced = jax.make_jaxpr(jax.shard_map(jax.grad(shard_loss, argnums=(0, 1, 2, 3)), mesh=mesh,
                                          in_specs=specs, out_specs=specs))(x, w1, w2, b2)
    inner = traced.eqns[0].params["jaxpr"].eqns
    return inner, [(e.params["target_name"], [tuple(v.aval.shape) for v in e.outvars])
                   for e in inner if e.primitive.name == "ffi_call"]


def test_gpu_custom_calls_trace_with_the_reference_types(mesh, monkeypatch):
    """The sequence-parallel MLP: the conjugates in the backward."""
    def shard_loss(x, w1, w2, b2):
        h = mj.all_gather_matmul(x[0], w1, axis_name="tp", mesh=mesh, trans_b=True)
        y = mj.matmul_reduce_scatter(h, w2, axis_name="tp", mesh=mesh, bias=b2, trans_b=True)
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32)), ("data", "tp"))

    _, calls = traced_on_gpus(mesh, monkeypatch, shard_loss, P("data", "tp", None))
    assert calls == [("meshla_all_gather_matmul", [(16, 6), (16, 8)]),
                     ("meshla_matmul_reduce_scatter", [(8, 8)]),
                     ("meshla_all_gather_matmul", [(16, 6), (16, 8)]),
                     ("meshla_matmul_reduce_scatter", [(8, 8)])], calls


def test_column_parallel_gradient_traces_one_all_reduce_call(mesh, monkeypatch):
    """Without sequence parallelism: the column layer's forward is XLA's local GEMM, its input's
    gradient one meshla all-reduce (no psum of XLA's), beside the row layer's forward
    all-reduce."""
    def shard_loss(x, w1, w2, b2):
        h = mj.column_parallel_matmul(x[0], w1, axis_name="tp", mesh=mesh, trans_b=True)
        y = mj.matmul_all_reduce(h, w2, axis_name="tp", mesh=mesh, bias=b2, trans_b=True)
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32)), "data")

    inner, calls = traced_on_gpus(mesh, monkeypatch, shard_loss, P("data", None, None))
    assert calls == [("meshla_matmul_all_reduce", [(16, 8)]),
                     ("meshla_matmul_all_reduce", [(16, 8)])], calls
    assert not [e for e in inner  # psum, psum_invariant: an XLA all-reduce over the axis
                if e.primitive.name.startswith("psum") and "tp" in e.params["axes"]]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_column_parallel_traces_meshla_calls_only(mesh, monkeypatch, recipe):
    """The fp8 MLP without sequence parallelism on the GPU path (every call traced with a group
    number, as on GPUs, without lowering): local products on meshla's fp8 GEMM, x's gradient one
    scaled all-reduce, no psum over the tensor axis."""
    from meshla.jax import collective

    traced = collective._traced_call
    monkeypatch.setattr(collective, "_traced_call", lambda *args, **options: (
        collective.dataclasses.replace(traced(*args, **options), group=7)))
    x, w1, w2 = (random(shape, jnp.bfloat16, seed)
                 for seed, shape in enumerate(((2, 32, 32), (64, 32), (32, 64))))

    def shard_loss(x, w1, w2):
        options = dict(axis_name="tp", mesh=mesh, trans_b=True, fp8=recipe)
        h = mj.column_parallel_matmul(x[0], w1, **options)
        y = mj.matmul_all_reduce(h, w2, **options)
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32)), "data")

    specs = (P("data", None, None), P("tp", None), P(None, "tp"))
    jaxpr = jax.make_jaxpr(jax.shard_map(jax.grad(shard_loss, argnums=(0, 1, 2)), mesh=mesh,
                                         in_specs=specs, out_specs=specs))(x, w1, w2)
    inner = jaxpr.eqns[0].params["jaxpr"].eqns
    calls = [e.params["target_name"] for e in inner if e.primitive.name == "ffi_call"]
    local, summed = "meshla_scaled_matmul", "meshla_matmul_all_reduce"
    # forward: the column's product, the row's all-reduce; backward: the row's two local
    # products, the column's x gradient (all-reduced) and w1 gradient
    assert calls == [local, summed, local, local, summed, local], calls
    assert not [e for e in inner
                if e.primitive.name.startswith("psum") and "tp" in e.params["axes"]]


def test_recompute_gathered_keeps_no_gathered_rows(mesh, monkeypatch):
    """recompute_gathered=True on the GPU path: the forward's custom call returns no gathered
    rows (a zero-size output) and the backward gathers a again (XLA's all-gather) for b's
    gradient."""
    def shard_loss(x, w1, w2, b2):
        h = mj.all_gather_matmul(x[0], w1, axis_name="tp", mesh=mesh, trans_b=True,
                                 recompute_gathered=True)
        y = mj.matmul_reduce_scatter(h, w2, axis_name="tp", mesh=mesh, bias=b2, trans_b=True)
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32)), ("data", "tp"))

    inner, calls = traced_on_gpus(mesh, monkeypatch, shard_loss, P("data", "tp", None))
    assert calls[0] == ("meshla_all_gather_matmul", [(16, 6), (0,)]), calls
    assert [e for e in inner if e.primitive.name.startswith("all_gather")]


def test_group_numbers_tell_meshes_apart(monkeypatch):
    """Each (mesh, axis) gets its own groups: also two meshes over the same devices in the same
    order whose shapes differ (a data=2 × tp=1 mesh beside a tp=2 one)."""
    from meshla.jax import _groups

    made = []
    monkeypatch.setattr(_groups, "_make_group", lambda number, devices, *_: made.append(
        (number, [d.id for d in devices])))
    devices = np.array(jax.devices("cpu")[:2])
    wide = Mesh(devices.reshape(1, 2), ("data", "tp"))
    tall = Mesh(devices.reshape(2, 1), ("data", "tp"))
    numbers = [_groups.group_number(mesh, "tp", 1.0) for mesh in (wide, tall, wide)]
    assert numbers[0] != numbers[1] and numbers[2] == numbers[0]
    assert [groups for _, groups in made] == [[0, 1], [0], [1]]


@pytest.mark.parametrize("fp8", [None, "tensorwise"])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_the_mlp_example_trains_like_jnp(fp8, sequence_parallel):
    """examples/jax_tp_mlp.py on 4 host devices (2 × 2): meshla's losses are jnp's step by step,
    or within 2% with its matmuls in fp8 (the example exits non-zero where they differ), with
    sequence parallelism and without (column_parallel_matmul, matmul_all_reduce)."""
    import subprocess
    import sys

    pytest.importorskip("optax")
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "jax_tp_mlp.py")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    extra = (["--dtype", "bfloat16", "--fp8", fp8] if fp8 else []) + (
        [] if sequence_parallel else ["--no-sequence-parallel"])
    done = subprocess.run([sys.executable, example, "--data", "2", "--steps", "4", "--tokens",
                           "32", "--hidden", "64", "--ffn", "128", *extra], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("losses within fp8 rounding" if fp8 else "same losses step by step") in done.stdout


_SHARE_ID = """
import sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from meshla.jax import _groups
print(_groups._shared_unique_id("a group", int(sys.argv[2]), 60.0).hex())
jax.distributed.shutdown()
"""


def test_a_group_across_processes_shares_one_nccl_id():
    """One GPU per process: the group's rank 0 makes the NCCL id and the other ranks read it from
    jax.distributed's key-value store (two CPU processes here; making the communicator needs
    GPUs)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    ranks = [subprocess.Popen([sys.executable, "-c", _SHARE_ID, address, str(rank)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outputs
    ids = [out.strip().splitlines()[-1] for out, _ in outputs]
    assert ids[0] == ids[1] and len(bytes.fromhex(ids[0])) == 128


_REFERENCES = {
    "all_gather_matmul": lambda a, b, bias: (
        all_gather_invariant(a, "tp", tiled=True) @ b + (0 if bias is None else bias)),
    "matmul_reduce_scatter": lambda a, b, bias: (
        jax.lax.psum_scatter(a @ b, "tp", scatter_dimension=0, tiled=True)
        + (0 if bias is None else bias)),
    "matmul_all_reduce": lambda a, b, bias: (
        jax.lax.psum(a @ b, "tp") + (0 if bias is None else bias)),
    "column_parallel_matmul": lambda a, b, bias: a @ b + (0 if bias is None else bias),
}
_VARYING = ((), ("tp",), ("data", "tp"))


def as_varying(x, axes, scale):
    """``x`` as each rank's own copy over ``axes``, scaled by its index there (so that which
    cotangents are summed over which axis shows); ``x`` itself where ``axes`` is empty."""
    if not axes:
        return x
    x = jax.lax.pcast(x, axes, to="varying")
    for axis in axes:
        x = x * (1 + scale * (1 + jax.lax.axis_index(axis)).astype(jnp.float32))
    return x


def assert_same_gradients(mesh, ours, reference, arrays, varies):
    """The gradients of a scalar loss of ``ours(*operands)`` and of ``reference(*operands)``
    agree, operand i made varying over ``varies[i]`` (None: passed as None) inside shard_map."""
    def loss(product):
        def of(*operands):
            operands = [None if axes is None else as_varying(x, axes, 0.1 * (i + 1))
                        for i, (x, axes) in enumerate(zip(operands, varies))]
            y = product(*operands)
            y = jnp.sum(jnp.sin(y) * jnp.arange(y.size).reshape(y.shape))
            missing = tuple(sorted({"data", "tp"} - jax.typeof(y).mat.varying))
            return jax.lax.psum(jax.lax.pcast(y, missing, to="varying") if missing else y,
                                ("data", "tp"))
        return of

    count = len(arrays)
    grads = [jax.jit(jax.shard_map(jax.grad(loss(product), argnums=tuple(range(count))),
                                   mesh=mesh, in_specs=(P(),) * count,
                                   out_specs=(P(),) * count))(*arrays)
             for product in (ours, reference)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", list(_REFERENCES))
@pytest.mark.parametrize("a_varies", _VARYING)
@pytest.mark.parametrize("b_varies", _VARYING[:2])
@pytest.mark.parametrize("bias_varies", (None, *_VARYING[:2]))
def test_gradients_match_jax_for_every_varying_type(mesh, op, a_varies, b_varies, bias_varies):
    """Each op's gradients against JAX's own differentiation of the lax reference, for operands
    replicated or varying over the axes (each rank scales its copy differently, so that which
    cotangents are summed over which axis shows)."""
    m, k, n = 8, 6, 4
    trans_b = len(a_varies) % 2 == 1  # both layouts, over the cases
    arrays = (random((m, k), jnp.float32, 20), random((n, k) if trans_b else (k, n),
                                                      jnp.float32, 21),
              random((n,), jnp.float32, 22))

    def ours(a, b, bias):
        return getattr(mj, op)(a, b, axis_name="tp", mesh=mesh, bias=bias, trans_b=trans_b)

    def reference(a, b, bias):
        return _REFERENCES[op](a, b.T if trans_b else b, bias)

    assert_same_gradients(mesh, ours, reference, arrays, (a_varies, b_varies, bias_varies))


def test_global_forms_name_the_array_their_mesh_cannot_split(mesh):
    with pytest.raises(ValueError, match=r"all_gather_matmul: a.shape=\[5, 4\]: dimension 0 is "
                                         r"split over the 2 devices of axis 'tp', which do not "
                                         "divide 5"):
        mj.all_gather_matmul_global(jnp.ones((5, 4)), jnp.ones((4, 2)), mesh=mesh,
                                    axis_name="tp")
    with pytest.raises(ValueError, match=r"matmul_all_reduce: b must be a 2-D array, got \[4\]"):
        mj.matmul_all_reduce_global(jnp.ones((4, 4)), jnp.ones((4,)), mesh=mesh, axis_name="tp")
    with pytest.raises(ValueError, match=r"matmul_reduce_scatter: a.dtype=int8 is not one"):
        shard_call(mesh, mj.matmul_reduce_scatter, jnp.ones((8, 6), jnp.int8),
                   jnp.ones((6, 4), jnp.int8), specs=(P("tp", None), P()), axis_name="tp",
                   mesh=mesh)


def fp8_operands(rows, k, n, rowwise, seed):
    """float8_e4m3fn a [rows, k] and b [n, k] with float32 scales (one, or one per row)."""
    a = random((rows, k), jnp.float32, seed).astype(jnp.float8_e4m3fn)
    b = random((n, k), jnp.float32, seed + 1).astype(jnp.float8_e4m3fn)
    rng = np.random.default_rng(seed + 2)
    a_scale = jnp.asarray(rng.uniform(0.5, 1.5, rows if rowwise else 1), jnp.float32)
    b_scale = jnp.asarray(rng.uniform(0.5, 1.5, n if rowwise else 1), jnp.float32)
    return a, b, a_scale, b_scale


def dequantized64(x, scale):
    x, scale = np.asarray(x, np.float64), np.asarray(scale, np.float64)
    return x * (scale.reshape(-1, 1) if scale.size > 1 else scale.reshape(()))


@pytest.mark.parametrize("rowwise", [False, True])
def test_scaled_ops_match_the_dequantized_product(mesh, rowwise):
    """The three float8 ops inside shard_map over 'tp' (2 devices): all-gather of the rows (and,
    rowwise, their scales), the reductions of each shard's own scaled product, against float64
    products of the dequantized operands; bfloat16 out with a bias, float32 out without."""
    rows, k, n = 8, 32, 16
    a, b, a_scale, b_scale = fp8_operands(rows, k, n, rowwise, 20)
    bias = random((n,), jnp.bfloat16, 23)
    whole = dequantized64(a, a_scale) @ dequantized64(b, b_scale).T
    scale_spec = P("tp") if rowwise else P()

    def gather(a, b, a_scale, b_scale, bias):
        return mj.all_gather_scaled_matmul(a, b, a_scale, b_scale, axis_name="tp", mesh=mesh,
                                           bias=bias)

    got = sharded(mesh, gather, (P("tp", None), P(), scale_spec, P(), P()), P())(
        a, b, a_scale, b_scale, bias)
    assert got.dtype == jnp.bfloat16 and got.shape == (rows, n)
    close(got, whole + np.asarray(bias, np.float64), jnp.bfloat16)

    # The reductions: k split over 'tp', each shard's own rows of a_scale (rowwise: all of a's,
    # here in torch._scaled_mm's shapes, [m, 1] and [1, n]).
    if rowwise:
        a_scale, b_scale = a_scale.reshape(-1, 1), b_scale.reshape(1, -1)

    def reduce(a, b, a_scale, b_scale):
        scatter = mj.scaled_matmul_reduce_scatter(a, b, a_scale, b_scale, axis_name="tp",
                                                  mesh=mesh, out_dtype=jnp.float32)
        return scatter, mj.scaled_matmul_all_reduce(a, b, a_scale, b_scale, axis_name="tp",
                                                    mesh=mesh, out_dtype=jnp.float32)

    scattered, summed = sharded(mesh, reduce, (P(None, "tp"), P(None, "tp"), P(), P()),
                                (P("tp", None), P()))(a, b, a_scale, b_scale)
    assert summed.dtype == jnp.float32
    close(summed, whole, jnp.float32)
    close(scattered, whole, jnp.float32)


def test_scaled_ops_errors_are_named(mesh):
    a, b, a_scale, b_scale = fp8_operands(8, 32, 16, False, 30)
    specs = (P("tp", None), P(), P(), P())

    def call(function, *arrays, **options):
        return shard_call(mesh, lambda *xs: function(*xs, axis_name="tp", mesh=mesh, **options),
                          *arrays, specs=specs)

    with pytest.raises(ValueError, match=r"all_gather_matmul: a_scale.shape=\[1\] and "
                                         r"b_scale.shape=\[3\]: tensorwise scales"):
        call(mj.all_gather_scaled_matmul, a, b, a_scale, jnp.ones(3, jnp.float32))
    with pytest.raises(ValueError, match=r"a_scale.shape=\[2, 2\] but expected 4 contiguous "
                                         r"values \(one per row of a\)"):
        call(mj.all_gather_scaled_matmul, a, b, jnp.ones((2, 2), jnp.float32),
             jnp.ones(16, jnp.float32))
    with pytest.raises(ValueError, match="a_scale.dtype=float16 but scales are float32"):
        call(mj.all_gather_scaled_matmul, a, b, a_scale.astype(jnp.float16), b_scale)
    with pytest.raises(NotImplementedError, match="no float8_e5m2 x float8_e5m2 GEMM"):
        call(mj.all_gather_scaled_matmul, a.astype(jnp.float8_e5m2), b.astype(jnp.float8_e5m2),
             a_scale, b_scale)
    with pytest.raises(ValueError, match="out_dtype=int8 is not a dtype meshla takes"):
        call(mj.all_gather_scaled_matmul, a, b, a_scale, b_scale, out_dtype=jnp.int8)
    with pytest.raises(ValueError, match="a float8 product's d is bfloat16, float16 or float32, "
                                         "not int32"):
        call(mj.all_gather_scaled_matmul, a, b, a_scale, b_scale, out_dtype=jnp.int32)
    with pytest.raises(ValueError, match="all_gather_matmul: a_scale must be an array"):
        shard_call(mesh, lambda a, b: mj.all_gather_scaled_matmul(
            a, b, None, b_scale, axis_name="tp", mesh=mesh), a, b, specs=specs[:2])

    def loss(a32):
        out = mj.all_gather_scaled_matmul(a32.astype(jnp.float8_e4m3fn), b, a_scale, b_scale,
                                          axis_name="tp", mesh=mesh)
        return out.astype(jnp.float32).sum()

    with pytest.raises(NotImplementedError, match="the float8 ops have no backward yet"):
        sharded(mesh, jax.grad(loss), (P("tp", None),), P("tp", None))(a.astype(jnp.float32))


@pytest.mark.parametrize("return_gathered", [False, True])
@pytest.mark.parametrize("a_varies", _VARYING)
@pytest.mark.parametrize("b_varies", _VARYING[:2])
def test_recompute_gathered_gradients_match_jax(mesh, return_gathered, a_varies, b_varies):
    """all_gather_matmul with recompute_gathered=True: the same gradients as JAX's
    differentiation of the reference, for a and b replicated or varying over the axes, both
    layouts, with a bias, and the gathered rows used by the caller (return_gathered)."""
    m, k, n = 8, 6, 4
    trans_b = len(a_varies) % 2 == 1  # both layouts, over the cases
    arrays = (random((m, k), jnp.float32, 23),
              random((n, k) if trans_b else (k, n), jnp.float32, 24), random((n,), jnp.float32, 25))

    def ours(a, b, bias):
        out = mj.all_gather_matmul(a, b, axis_name="tp", mesh=mesh, bias=bias, trans_b=trans_b,
                                   return_gathered=return_gathered, recompute_gathered=True)
        return out[0] + jnp.sum(out[1] ** 2) if return_gathered else out

    def reference(a, b, bias):
        rows = all_gather_invariant(a, "tp", tiled=True)
        y = rows @ (b.T if trans_b else b) + bias
        return y + jnp.sum(rows ** 2) if return_gathered else y

    assert_same_gradients(mesh, ours, reference, arrays, (a_varies, b_varies, ()))
    a, b = arrays[0].astype(jnp.bfloat16), random((n, k), jnp.bfloat16, 26)
    with pytest.raises(ValueError, match="all_gather_matmul: recompute_gathered=True applies to "
                                         "16-bit calls"):
        shard_call(mesh, lambda a, b: mj.all_gather_matmul(
            a, b, axis_name="tp", mesh=mesh, trans_b=True, fp8="tensorwise",
            recompute_gathered=True), a, b, specs=(P("tp", None), P()))


def fp8_bound(*mantissa_bits: int) -> float:
    """Twice the RMS relative error of one product of operands rounded to these mantissa widths
    (uniform rounding errors of 2^-(p+1) at most, in quadrature), times two: every value checked
    below is two fp8 products deep. meshla.torch's fp8 layer tests derive theirs the same way."""
    return 2 * 2 * sum(4.0 ** -(p + 1) for p in mantissa_bits) ** 0.5 / 3 ** 0.5


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fp8_training_matches_the_model_within_fp8_rounding(mesh, recipe, sequence_parallel):
    """An MLP in fp8 (fp8=recipe): sequence parallel, all-gather→GEMM then GEMM→reduce-scatter;
    without, column_parallel_matmul (a local GEMM, its input's gradient all-reduced) then
    GEMM→all-reduce. Its output and every gradient against
    jax.grad of the plain float32 model, within fp8 rounding's bound (the last shard's rows 10x
    larger, so that a scale applied to another shard's rows fails)."""
    tokens, hidden, inner = 32, 64, 128
    x = np.array(random((tokens, hidden), jnp.float32, 40))
    x[tokens // 2:] *= 10
    x = jnp.asarray(x)
    up = random((inner, hidden), jnp.float32, 41) / hidden ** 0.5
    down = random((hidden, inner), jnp.float32, 42) / inner ** 0.5
    bias = random((hidden,), jnp.float32, 43)
    target = random((tokens, hidden), jnp.float32, 44)

    def loss_of(y, target):
        return jnp.sum((y - target) ** 2)

    def model(x, up, down, bias):
        return jax.nn.relu(x @ up.T) @ down.T + bias

    def sharded_loss(x, up, down, bias, target):
        options = dict(axis_name="tp", mesh=mesh, trans_b=True, fp8=recipe)
        if sequence_parallel:
            h = mj.all_gather_matmul(x, up, **options)
            y = mj.matmul_reduce_scatter(jax.nn.relu(h), down, bias=bias, **options)
        else:
            h = mj.column_parallel_matmul(x, up, **options)
            y = mj.matmul_all_reduce(jax.nn.relu(h), down, bias=bias, **options)
        # The data axis replicates: the loss counts each token once over the tensor axis.
        return jax.lax.psum(loss_of(y, target), "tp") / (2 if not sequence_parallel else 1), y

    rows = P("tp", None) if sequence_parallel else P()
    specs = (rows, P("tp", None), P(None, "tp"), P(), rows)
    grad_fn = sharded(mesh, jax.value_and_grad(sharded_loss, argnums=(0, 1, 2, 3), has_aux=True),
                      specs, ((P(), rows), specs[:4]))
    (_, y), grads = grad_fn(x, up, down, bias, target)
    want_y = model(x, up, down, bias)
    want = jax.grad(lambda *p: loss_of(model(*p), target), argnums=(0, 1, 2, 3))(
        x, up, down, bias)
    forward, gradient = fp8_bound(3, 3), fp8_bound(2, 3)

    def error(got, expected):
        got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
        return np.linalg.norm(got - expected) / np.linalg.norm(expected)

    assert error(y, want_y) < forward
    for name, got, expected in zip(("x", "up", "down", "bias"), grads, want):
        assert error(got, expected) < gradient, (name, error(got, expected), gradient)


def test_fp8_training_errors_are_named(mesh):
    a, w = random((8, 32), jnp.bfloat16, 50), random((16, 32), jnp.bfloat16, 51)
    specs = (P("tp", None), P())

    def call(**options):
        return shard_call(mesh, lambda a, w: mj.all_gather_matmul(
            a, w, axis_name="tp", mesh=mesh, **options), a, w, specs=specs)

    with pytest.raises(ValueError, match="all_gather_matmul: fp8='e4m3' is not one of None, "
                                         "'tensorwise', 'rowwise'"):
        call(trans_b=True, fp8="e4m3")
    with pytest.raises(NotImplementedError, match="return_gathered returns the 16-bit rows"):
        call(trans_b=True, fp8="tensorwise", return_gathered=True)
    with pytest.raises(NotImplementedError, match=r"float8 needs b stored \[n, k\] \(trans_b\)"):
        shard_call(mesh, lambda a, w: mj.all_gather_matmul(
            a, w, axis_name="tp", mesh=mesh, fp8="tensorwise"), a, w.T, specs=specs)
    with pytest.raises(ValueError, match="rows must start 16 bytes apart: k=24"):
        shard_call(mesh, lambda a, w: mj.all_gather_matmul(
            a, w, axis_name="tp", mesh=mesh, trans_b=True, fp8="tensorwise"),
            a[:, :24], w[:, :24], specs=specs)


def test_column_parallel_errors_are_named(mesh):
    """column_parallel_matmul's operands follow matmul_all_reduce's rules, in its own name; a's
    gradient (an all-reduce with the call's tuning) and fp8's GEMMs are checked when traced."""
    a, w = random((8, 32), jnp.bfloat16, 52), random((16, 32), jnp.bfloat16, 53)
    specs = (P(), P("tp", None))

    def call(a, w, **options):  # w as [n, k] with trans_b, else [k, n]: n split over tp
        w_spec = P("tp", None) if options.get("trans_b") else P(None, "tp")
        return shard_call(mesh, lambda a, w: mj.column_parallel_matmul(
            a, w, axis_name="tp", mesh=mesh, **options), a, w, specs=(P(), w_spec))

    with pytest.raises(ValueError, match=r"^column_parallel_matmul: .*shape"):
        call(a, w[:, :24], trans_b=True)
    with pytest.raises(ValueError, match=r"^column_parallel_matmul: .*float16"):
        call(a, w.astype(jnp.float16), trans_b=True)
    with pytest.raises(ValueError, match="column_parallel_matmul: fp8='e4m3' is not one of"):
        call(a, w, trans_b=True, fp8="e4m3")
    with pytest.raises(NotImplementedError, match=r"column_parallel_matmul: float8 needs b "
                                                  r"stored \[n, k\] \(trans_b\)"):
        call(a, w.T, fp8="tensorwise")
    with pytest.raises(ValueError, match=r"column_parallel_matmul: the product, a float8 "
                                         r"\[8, 24\] @ \[8, 24\]ᵀ"):
        call(a[:, :24], w[:, :24], trans_b=True, fp8="tensorwise")
    with pytest.raises(ValueError, match="axis_name"):
        shard_call(mesh, lambda a, w: mj.column_parallel_matmul(a, w, axis_name=3, mesh=mesh),
                   a, w, specs=specs)
    with pytest.raises(ValueError, match="fp8='bogus' is not one of"):  # the recipe first
        call(a, w.T, fp8="bogus")
    with pytest.raises(NotImplementedError, match=r"backend=cublasmp runs a's gradient"):
        call(a, w, trans_b=True, backend="cublasmp")
    with pytest.raises(ValueError, match=r"^column_parallel_matmul: call it inside "
                                         r"jax.shard_map over axis 'tp' on per-shard arrays "
                                         r"\(or use column_parallel_matmul_global on global "
                                         r"arrays\)$"):
        mj.column_parallel_matmul(a, w, axis_name="tp", mesh=mesh, trans_b=True)


# (rowwise fp8 products are bfloat16 or float32, not float16)
@pytest.mark.parametrize("dtype, recipe", [(jnp.bfloat16, "tensorwise"),
                                           (jnp.bfloat16, "rowwise"),
                                           (jnp.float16, "tensorwise")])
def test_fp8_gradients_follow_the_16_bit_ones(mesh, dtype, recipe):
    """fp8 gradients against the same call's 16-bit ones: an all-gather whose weight is the same
    on every device (its output's gradient too: each device keeps its own rows of it) and an
    all-reduce whose loss is scaled down (a float16 gradient's scale underflows float16 itself),
    within fp8 rounding's bound."""
    x = np.array(random((16, 32), jnp.float32, 60))
    x[8:] *= 10
    x, w = jnp.asarray(x, dtype), random((32, 32), dtype, 61)
    r = random((16, 32), jnp.float32, 64)  # the product's gradient, different on every row

    def gather_loss(x, w, fp8):
        y = mj.all_gather_matmul(x, w, axis_name="tp", mesh=mesh, trans_b=True, fp8=fp8)
        return jnp.sum(y.astype(jnp.float32) * r)

    def reduce_loss(x, w, fp8):  # gradients of about 1e-4: their fp8 scale, 2e-9, not a float16
        y = mj.matmul_all_reduce(x, w, axis_name="tp", mesh=mesh, trans_b=True, fp8=fp8)
        return 1e-4 * jnp.sum(y.astype(jnp.float32) * r) / 2

    for loss, specs in ((gather_loss, (P("tp", None), P())),
                        (reduce_loss, (P(None, "tp"), P(None, "tp")))):
        grads = [sharded(mesh, jax.grad(lambda x, w: loss(x, w, fp8), argnums=(0, 1)), specs,
                         specs)(x, w) for fp8 in (None, recipe)]
        for name, want, got in zip(("x", "w"), *grads):
            want, got = np.asarray(want, np.float64), np.asarray(got, np.float64)
            error = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert error < fp8_bound(2, 3), (loss.__name__, name, error)


def test_fp8_training_checks_its_gradient_when_traced(mesh):
    """The backward's scaled call is checked with the forward's: 8 output columns a device make
    the reduce-scatter of a's gradient contract over 8, which fp8 GEMMs do not take."""
    a, w = random((8, 32), jnp.bfloat16, 62), random((16, 32), jnp.bfloat16, 63)
    with pytest.raises(ValueError, match="matmul_reduce_scatter: float8 rows must start 16 "
                                         "bytes apart: k=8"):
        shard_call(mesh, lambda a, w: mj.all_gather_matmul(
            a, w, axis_name="tp", mesh=mesh, trans_b=True, fp8="tensorwise"), a, w,
            specs=(P("tp", None), P("tp", None)))


def test_fp8_training_checks_its_local_products_when_traced(mesh):
    """The backward's local fp8 products are checked with the forward: 24 gathered rows make b's
    gradient contract over 24, which fp8 GEMMs do not take (the collective calls take them)."""
    a, w = random((24, 32), jnp.bfloat16, 64), random((16, 32), jnp.bfloat16, 65)
    with pytest.raises(ValueError, match=r"all_gather_matmul: b's gradient, a float8 \[16, 24\] "
                                         r"@ \[32, 24\]ᵀ: matmul: float8 rows must start 16 "
                                         "bytes apart: k=24"):
        shard_call(mesh, lambda a, w: mj.all_gather_matmul(
            a, w, axis_name="tp", mesh=mesh, trans_b=True, fp8="tensorwise"), a, w,
            specs=(P("tp", None), P()))
