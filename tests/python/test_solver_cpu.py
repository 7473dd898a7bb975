"""The dense solvers' front ends on CPU devices: the JAX functions on a mesh of 4 host devices
(the reference path the GPU handlers share their API with), the torch functions on CPU row
blocks, the layout query, and the argument checks. Against numpy in float64."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import numpy as np
import pytest
import torch

from meshla import _meshla
from meshla.torch import linalg as torch_linalg

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_platforms", "cpu")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshla.jax import linalg  # noqa: E402


def spd(n, dtype, seed):
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((n, n))
    if np.issubdtype(dtype, np.complexfloating):
        m = m + 1j * rng.standard_normal((n, n))
    return (m @ m.conj().T / n + np.eye(n)).astype(dtype)


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 host devices (XLA_FLAGS set before jax was imported elsewhere)")
    return Mesh(np.array(devices[:4]), ("x",))


def put(array, mesh):
    return jax.device_put(array, NamedSharding(mesh, P("x", None) if array.ndim == 2 else P("x")))


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_jax_cho_solve_matches_numpy(mesh, dtype):
    n = 24
    a = spd(n, dtype, 1)
    b = np.random.default_rng(2).standard_normal((n, 3)).astype(dtype)
    x, logdet, info = jax.jit(lambda a, b: linalg.cho_solve(
        a, b, mesh, return_logdet=True, return_info=True))(put(a, mesh), put(b, mesh))
    assert int(info) == 0
    residual = np.linalg.norm(a @ np.asarray(x) - b) / (np.linalg.norm(a) * np.linalg.norm(x))
    assert residual < 1e-13
    assert abs(float(logdet) - np.linalg.slogdet(a)[1]) < 1e-10
    assert x.sharding.spec == P("x", None)


def test_jax_cho_solve_vector_rhs_and_not_spd(mesh):
    n = 16
    a = spd(n, np.float64, 3)
    b = np.arange(n, dtype=np.float64)
    x = linalg.cho_solve(put(a, mesh), put(b, mesh), mesh)
    assert x.shape == (n,)
    np.testing.assert_allclose(a @ np.asarray(x), b, atol=1e-10)
    bad = a.copy()
    bad[3, 3] = -5.0
    x, info = linalg.cho_solve(put(bad, mesh), put(b, mesh), mesh, return_info=True)
    assert int(info) > 0 and np.isnan(np.asarray(x)).all()


def test_jax_cho_solve_overwrite_a_returns_the_working_buffer(mesh):
    n = 32
    a = spd(n, np.float64, 7)
    b = np.ones((n, 1))
    x, overwritten = jax.jit(lambda a, b: linalg.cho_solve(a, b, mesh, overwrite_a=True),
                             donate_argnums=0)(put(a, mesh), put(b, mesh))
    assert overwritten.shape == (n, n) and overwritten.sharding.spec == P("x", None)
    np.testing.assert_allclose(a @ np.asarray(x), b, atol=1e-10)
    with pytest.raises(ValueError, match="overwrite_a needs n/GPUs = 20/4"):
        linalg.cho_solve(put(spd(20, np.float64, 8), mesh), put(np.ones((20, 1)), mesh), mesh,
                         tile=2, overwrite_a=True)


def test_jax_inverse_and_eigh(mesh):
    n = 20
    a = spd(n, np.float64, 4)
    inverse = linalg.cholesky_inverse(put(a, mesh), mesh)
    assert np.linalg.norm(a @ np.asarray(inverse) - np.eye(n)) < 1e-12
    values, vectors = linalg.eigh(put(a, mesh), mesh)
    v = np.asarray(vectors)
    assert np.all(np.diff(np.asarray(values)) >= 0)
    assert np.linalg.norm(a @ v - v * np.asarray(values)) / np.linalg.norm(a) < 1e-12
    only = linalg.eigh(put(a, mesh), mesh, eigvals_only=True)
    np.testing.assert_allclose(np.asarray(only), np.linalg.eigvalsh(a), rtol=1e-12)


def test_jax_shard_forms_inside_shard_map(mesh):
    n = 16
    a = spd(n, np.float64, 5)
    b = np.ones((n, 2))

    def body(a_block, b_block):
        solved = linalg.cho_solve_shard(a_block, b_block, mesh=mesh)
        return solved.x, solved.logdet

    x, logdet = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x", None), P("x", None)),
                                      out_specs=(P("x", None), P()), check_vma=False))(
        put(a, mesh), put(b, mesh))
    np.testing.assert_allclose(np.asarray(x), np.linalg.solve(a, b), rtol=1e-10)
    assert abs(float(logdet) - np.linalg.slogdet(a)[1]) < 1e-10


def test_jax_argument_errors(mesh):
    with pytest.raises(ValueError, match="axis='y' is not an axis"):
        linalg.cho_solve(jnp.eye(8), jnp.ones((8, 1)), mesh, "y")
    with pytest.raises(ValueError, match="dtype int32 is not float32, float64, complex64 or "
                                         "complex128"):
        linalg.eigh(put(np.eye(8, dtype=np.int32), mesh), mesh)
    with pytest.raises(ValueError, match=r"cho_solve: b is \[8, 1\] float64; expected \[16\] or "
                                         r"\[16, nrhs\] float64: a's rows and dtype"):
        linalg.cho_solve(put(np.eye(16), mesh), put(np.ones((8, 1)), mesh), mesh)
    # The engines, in meshla.torch's words: cuSOLVERMp runs on GPUs, one in each process.
    with pytest.raises(ValueError, match=r"cho_solve: engine='lapack'; expected one of "
                                         r"\('auto', 'cusolvermg', 'cusolvermp'\)"):
        linalg.cho_solve(put(np.eye(16), mesh), put(np.ones((16, 1)), mesh), mesh,
                         engine="lapack")
    # "auto" on CPU devices is cuSolverMg's path (here its reference), the same as asking for it.
    assert linalg._engine("cho_solve", "auto", mesh, "x", 60.0) == "cusolvermg"
    spd_16 = spd(16, np.float64, 3)
    np.testing.assert_array_equal(
        np.asarray(linalg.cho_solve(put(spd_16, mesh), put(np.ones((16, 1)), mesh), mesh,
                                    engine="cusolvermg")),
        np.asarray(linalg.cho_solve(put(spd_16, mesh), put(np.ones((16, 1)), mesh), mesh)))
    with pytest.raises(ValueError, match="cho_solve: engine='cusolvermp' runs on GPU devices; "
                                         "the mesh has cpu devices"):
        linalg.cho_solve(put(np.eye(16), mesh), put(np.ones((16, 1)), mesh), mesh,
                         engine="cusolvermp")
    with pytest.raises(ValueError, match="lu_solve: engine='cusolvermp' runs on GPU devices; "
                                         "the mesh has cpu devices"):
        linalg.lu_solve(put(np.eye(16), mesh), put(np.ones((16, 1)), mesh), mesh,
                        engine="cusolvermp")


def general(n, dtype, seed):
    """A non-symmetric, well-conditioned matrix (a shifted Gaussian one)."""
    rng = np.random.default_rng(seed)
    m = rng.standard_normal((n, n))
    if np.issubdtype(dtype, np.complexfloating):
        m = m + 1j * rng.standard_normal((n, n))
    return (m + 3 * np.sqrt(n) * np.eye(n)).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.complex128])
def test_jax_lu_solve_matches_numpy_and_nans_a_singular_matrix(mesh, dtype):
    n = 24
    a = general(n, dtype, 11)
    b = np.random.default_rng(12).standard_normal((n, 3)).astype(dtype)
    x, info = jax.jit(lambda a, b: linalg.lu_solve(a, b, mesh, return_info=True))(
        put(a, mesh), put(b, mesh))
    assert int(info) == 0 and x.sharding.spec == P("x", None)
    x = np.asarray(x)
    assert np.linalg.norm(a @ x - b) / (np.linalg.norm(a) * np.linalg.norm(x)) < 1e-14
    singular = a.copy()
    singular[:, 5] = 0  # an exactly zero pivot, whatever the pivoting
    x, info = linalg.lu_solve(put(singular, mesh), put(b[:, 0], mesh), mesh, return_info=True)
    assert x.shape == (n,) and int(info) > 0 and np.isnan(np.asarray(x)).all()


def test_jax_lu_solve_shard_form_and_its_refusals(mesh):
    n = 16
    a, b = general(n, np.float64, 13), np.ones((n, 2))

    def body(a_block, b_block):
        solved = linalg.lu_solve_shard(a_block, b_block, mesh=mesh)
        return solved.x, solved.info

    x, info = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x", None), P("x", None)),
                                    out_specs=(P("x", None), P()), check_vma=False))(
        put(a, mesh), put(b, mesh))
    np.testing.assert_allclose(np.asarray(x), np.linalg.solve(a, b), rtol=1e-12)
    assert int(info) == 0
    with pytest.raises(NotImplementedError, match="lu_solve: overwrite_a on 4 GPUs"):
        linalg.lu_solve(put(a, mesh), put(b, mesh), mesh, overwrite_a=True)
    with pytest.raises(ValueError, match="lu_solve: nrhs=257 right-hand sides"):
        linalg.lu_solve(put(a, mesh), put(np.ones((n, 257)), mesh), mesh)
    with pytest.raises(ValueError, match=r"lu_solve: b is \[8, 1\] float64; expected "):
        linalg.lu_solve(put(a, mesh), put(np.ones((8, 1)), mesh), mesh)


def test_torch_lu_solve_on_cpu_row_blocks():
    n = 18
    a = torch.from_numpy(general(n, np.complex128, 14))
    b = torch.randn(n, 2, dtype=torch.complex128)
    solved = torch_linalg.lu_solve(list(a.split(6)), list(b.split(6)))
    x = torch.cat(solved.x)
    assert solved.info == 0 and len(solved.x) == 3
    assert torch.linalg.norm(a @ x - b) / (torch.linalg.norm(a) * torch.linalg.norm(x)) < 1e-14
    singular = a.clone()
    singular[:, 4] = 0
    with pytest.raises(torch.linalg.LinAlgError, match="lu_solve: a is singular"):
        torch_linalg.lu_solve(list(singular.split(6)), list(b.split(6)))
    failed = torch_linalg.lu_solve(list(singular.split(6)), list(b.split(6)), check_errors=False)
    assert failed.info > 0 and all(torch.isnan(block).all() for block in failed.x)
    with pytest.raises(NotImplementedError, match="lu_solve: overwrite_a on 3 GPUs"):
        torch_linalg.lu_solve(list(a.split(6)), list(b.split(6)), overwrite_a=True)


def tall(m, n, dtype, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, n))
    if np.issubdtype(dtype, np.complexfloating):
        a = a + 1j * rng.standard_normal((m, n))
    return a.astype(dtype)


def check_qr(a, q, r, tolerance):
    """A = Q R, Q's columns orthonormal, R upper triangular."""
    n = a.shape[1]
    assert np.linalg.norm(q @ r - a) / np.linalg.norm(a) < tolerance
    assert np.linalg.norm(q.conj().T @ q - np.eye(n)) < tolerance * n
    assert np.array_equal(r, np.triu(r))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex128])
def test_jax_tall_qr_and_least_squares_match_numpy(mesh, dtype):
    m, n = 64, 12  # 16 rows a device
    a = tall(m, n, dtype, 21)
    b = tall(m, 3, dtype, 22)
    tolerance = 1e-5 if dtype == np.float32 else 1e-13
    q, r = jax.jit(lambda a: linalg.qr(a, mesh))(put(a, mesh))
    assert q.sharding.spec == P("x", None) and r.shape == (n, n)
    check_qr(a, np.asarray(q), np.asarray(r), tolerance)
    x, info = jax.jit(lambda a, b: linalg.least_squares(a, b, mesh, return_info=True))(
        put(a, mesh), put(b, mesh))
    expected = np.linalg.lstsq(a.astype(np.complex128), b.astype(np.complex128), rcond=None)[0]
    assert int(info) == 0 and x.shape == (n, 3)
    assert np.linalg.norm(np.asarray(x) - expected) / np.linalg.norm(expected) < 100 * tolerance
    vector = linalg.least_squares(put(a, mesh), put(b[:, 0], mesh), mesh)
    assert vector.shape == (n,)
    assert (np.linalg.norm(np.asarray(vector) - expected[:, 0]) / np.linalg.norm(expected[:, 0])
            < 100 * tolerance)


def check_svd_and_polar(a, u, s, vh, unitary, hermitian, tolerance):
    """U diag(s) Vᴴ = A with U's columns orthonormal and numpy's s; numpy's polar factors."""
    n = a.shape[1]
    assert np.abs(s - np.linalg.svd(a, compute_uv=False)).max() < tolerance * s[0]
    assert np.linalg.norm((u * s) @ vh - a) < tolerance * np.linalg.norm(a)
    assert np.linalg.norm(u.conj().T @ u - np.eye(n)) < tolerance * n
    want_u, want_h = numpy_polar(a)
    assert np.linalg.norm(unitary - want_u) < tolerance * np.linalg.norm(want_u)
    assert np.linalg.norm(hermitian - want_h) < tolerance * np.linalg.norm(want_h)


def test_tall_qr_of_one_block_is_its_own(mesh):
    """On one device the QR is the block's (no second stage), in both frameworks, and svd and
    polar build on it."""
    a = tall(48, 12, np.float64, 27)
    one = Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
    for routine in (linalg.qr, linalg.svd, linalg.polar):
        qrs = [line.split("=")[0].split()[0] for line in
               str(jax.make_jaxpr(lambda a: routine(a, one))(a)).splitlines() if " qr[" in line]
        # the block's QR, and no QR of the stacked R factors ([12, 12]; QDWH's are [24, 12])
        assert sum(q.endswith("f64[48,12]") for q in qrs) == 1, qrs
        assert not any(q.endswith("f64[12,12]") for q in qrs), qrs
    q, r = jax.jit(lambda a: linalg.qr(a, one))(put(a, one))
    check_qr(a, np.asarray(q), np.asarray(r), 1e-13)
    np.testing.assert_allclose(np.asarray(r), np.linalg.qr(a)[1], rtol=1e-12, atol=1e-12)
    u, s, vh = jax.jit(lambda a: linalg.svd(a, one))(put(a, one))
    unitary, hermitian = jax.jit(lambda a: linalg.polar(a, one))(put(a, one))
    check_svd_and_polar(a, *map(np.asarray, (u, s, vh, unitary, hermitian)), 1e-12)
    factors = torch_linalg.qr([torch.from_numpy(a)])
    check_qr(a, factors.q[0].numpy(), factors.r.numpy(), 1e-13)
    decomposed = torch_linalg.svd([torch.from_numpy(a)])
    polar = torch_linalg.polar([torch.from_numpy(a)])
    check_svd_and_polar(a, decomposed.u[0].numpy(), decomposed.s.numpy(), decomposed.vh.numpy(),
                        polar.u[0].numpy(), polar.h.numpy(), 1e-12)
    # qr_shard in a world of one process (gloo): the block's QR, no collective after the checks
    import socket

    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        alone = torch_linalg.qr_shard(torch.from_numpy(a))
        decomposed = torch_linalg.svd_shard(torch.from_numpy(a))
        polar = torch_linalg.polar_shard(torch.from_numpy(a))
    finally:
        dist.destroy_process_group()
    check_qr(a, alone.q.numpy(), alone.r.numpy(), 1e-13)
    check_svd_and_polar(a, decomposed.u.numpy(), decomposed.s.numpy(), decomposed.vh.numpy(),
                        polar.u.numpy(), polar.h.numpy(), 1e-12)


def numpy_polar(a):
    u, s, vh = np.linalg.svd(a, full_matrices=False)
    return u @ vh, (vh.conj().T * s) @ vh


@pytest.mark.parametrize("dtype", [np.float32, np.complex128])
def test_jax_tall_svd_and_polar_match_numpy(mesh, dtype):
    m, n = 64, 12
    a = tall(m, n, dtype, 31)
    tolerance = 1e-5 if dtype == np.float32 else 1e-13
    u, s, vh = jax.jit(lambda a: linalg.svd(a, mesh))(put(a, mesh))
    assert u.sharding.spec == P("x", None) and s.shape == (n,) and vh.shape == (n, n)
    u, s, vh = np.asarray(u), np.asarray(s), np.asarray(vh)
    expected = np.linalg.svd(a.astype(np.complex128), compute_uv=False)
    assert np.abs(s - expected).max() / expected.max() < tolerance
    assert np.linalg.norm((u * s) @ vh - a) / np.linalg.norm(a) < 10 * tolerance
    assert np.linalg.norm(u.conj().T @ u - np.eye(n)) < tolerance * n
    values = linalg.svd(put(a, mesh), mesh, compute_uv=False)
    assert np.abs(np.asarray(values) - expected).max() / expected.max() < tolerance
    unitary, hermitian = jax.jit(lambda a: linalg.polar(a, mesh))(put(a, mesh))
    want_u, want_h = numpy_polar(a.astype(np.complex128))
    assert np.linalg.norm(np.asarray(unitary) - want_u) / np.linalg.norm(want_u) < 10 * tolerance
    assert np.linalg.norm(np.asarray(hermitian) - want_h) / np.linalg.norm(want_h) < 10 * tolerance
    with pytest.raises(NotImplementedError, match="polar: a is \\[64, 80\\], wider than tall"):
        linalg.polar(put(tall(64, 80, dtype, 32), mesh), mesh)


_TALL_ACROSS_PROCESSES = """
import sys
import numpy as np
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_x64", True)
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from meshla.jax import linalg
mesh = Mesh(np.array(jax.devices()), ("x",))  # 2 processes x 2 host devices
a = np.random.default_rng(41).standard_normal((64, 6))
b = np.random.default_rng(42).standard_normal((64, 2))
rows = NamedSharding(mesh, P("x", None))
ga, gb = (jax.make_array_from_callback(x.shape, rows, lambda index, x=x: x[index]) for x in (a, b))
q, r = jax.jit(lambda a: linalg.qr(a, mesh))(ga)
x = jax.jit(lambda a, b: linalg.least_squares(a, b, mesh))(ga, gb)
s = jax.jit(lambda a: linalg.svd(a, mesh, compute_uv=False))(ga)
spd = a[:8].T @ a[:8] + np.eye(6)
spd = np.kron(np.eye(2), spd)[:8, :8] + np.eye(8)  # 8 x 8, positive definite
gs, gr = (jax.make_array_from_callback(x.shape, rows, lambda index, x=x: x[index])
          for x in (spd, b[:8]))
solved = jax.jit(lambda a, b: linalg.cho_solve(a, b, mesh))(gs, gr)
solved_rows = sorted(solved.addressable_shards, key=lambda shard: shard.index[0].start)
start = solved_rows[0].index[0].start
solved_rows = np.concatenate([np.asarray(shard.data) for shard in solved_rows])
want = np.linalg.solve(spd, b[:8])[start:start + len(solved_rows)]
# What every process answers (here, process 0 alone says yes), then the kept answer.
from meshla.jax._groups import agreed_everywhere
some = agreed_everywhere("only process 0", jax.process_index() == 0, [0, 1], 60.0)
every = agreed_everywhere("every process", True, [0, 1], 60.0)
kept = agreed_everywhere("only process 0", True, [0, 1], 60.0)
disagreement = float(some is not False) + float(every is not True) + float(kept is not False)
mine = sorted(q.addressable_shards, key=lambda shard: shard.index[0].start)
first = mine[0].index[0].start
q_rows = np.concatenate([np.asarray(shard.data) for shard in mine])
r = np.asarray(r.addressable_shards[0].data)
print(np.abs(q_rows @ r - a[first:first + len(q_rows)]).max(),
      np.abs(np.asarray(x.addressable_shards[0].data)
             - np.linalg.lstsq(a, b, rcond=None)[0]).max(),
      np.abs(np.asarray(s.addressable_shards[0].data) - np.linalg.svd(a, compute_uv=False)).max(),
      np.abs(solved_rows - want).max(), disagreement)
jax.distributed.shutdown()
"""


def test_jax_tall_routines_run_with_one_process_per_device_group():
    """The tall-skinny routines and cho_solve under jax.distributed: two processes of two host
    devices each (gloo's CPU collectives), each process's rows of Q, X, the singular values and
    cho_solve's X against numpy; the same code runs one process per GPU. Also the processes'
    agreement through the key-value store that "auto" asks for (agreed_everywhere)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    ranks = [subprocess.Popen([sys.executable, "-c", _TALL_ACROSS_PROCESSES, address, str(rank)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    outputs = [rank.communicate(timeout=240) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outputs
    for out, _ in outputs:
        errors = [float(v) for v in out.strip().splitlines()[-1].split()]
        assert max(errors) < 1e-12, errors


@pytest.mark.parametrize("shape", [(64, 20), (64, 64)])
def test_jax_qr_family_where_each_device_has_fewer_rows_than_a_has_columns(mesh, shape):
    """A square A (or blocks of 16 rows for 20 columns) over 4 devices: every routine against
    numpy, and least_squares' gradient against jax.numpy's solve of the normal equations."""
    a = tall(*shape, np.complex128, 31)
    b = tall(shape[0], 2, np.complex128, 32)
    q, r = linalg.qr(put(a, mesh), mesh)
    check_qr(a, np.asarray(q), np.asarray(r), 1e-12)
    u, s, vh = linalg.svd(put(a, mesh), mesh)
    reference = np.linalg.svd(a, compute_uv=False)
    assert np.linalg.norm(np.asarray(u) * np.asarray(s) @ np.asarray(vh) - a) < 1e-11
    assert np.allclose(np.asarray(linalg.svd(put(a, mesh), mesh, compute_uv=False)), reference)
    unitary, hermitian = (np.asarray(f) for f in linalg.polar(put(a, mesh), mesh))
    assert np.linalg.norm(unitary @ hermitian - a) < 1e-11
    assert np.linalg.norm(unitary.conj().T @ unitary - np.eye(shape[1])) < 1e-11
    assert np.linalg.norm(hermitian - hermitian.conj().T) < 1e-11
    x = linalg.least_squares(put(a, mesh), put(b, mesh), mesh)
    assert np.allclose(np.asarray(x), np.linalg.lstsq(a, b, rcond=None)[0], atol=1e-10)

    def loss(solve, a):
        return jnp.real(jnp.sum(solve(a) * jnp.asarray(b[:shape[1]])))

    got = jax.grad(loss, argnums=1)(lambda a: linalg.least_squares(a, put(b, mesh), mesh),
                                    put(a, mesh))
    want = jax.grad(loss, argnums=1)(
        lambda a: jnp.linalg.solve(a.conj().T @ a, a.conj().T @ jnp.asarray(b)), jnp.asarray(a))
    assert np.allclose(np.asarray(got), np.asarray(want), atol=1e-9)


def test_jax_cusolvermg_runs_only_on_the_gpus_of_one_process():
    """cuSolverMg drives the GPUs of one process: on a mesh with another process's GPU (or on
    CPU devices) every device solves the gathered A instead."""
    from types import SimpleNamespace

    here = jax.process_index()

    def mesh_of(*devices):
        return SimpleNamespace(devices=np.array(devices, dtype=object))

    def device(platform, process):
        return SimpleNamespace(platform=platform, process_index=process)

    assert linalg._cusolvermg_runs(mesh_of(device("gpu", here), device("gpu", here)))
    assert not linalg._cusolvermg_runs(mesh_of(device("gpu", here), device("gpu", here + 1)))
    assert not linalg._cusolvermg_runs(mesh_of(device("cpu", here)))


def test_jax_tall_qr_refusals_and_rank_deficiency(mesh):
    a = tall(64, 12, np.float64, 23)
    with pytest.raises(NotImplementedError, match=r"qr: a is \[64, 80\], wider than tall; the "
                                                  "QR-based routines take m >= n"):
        linalg.qr(put(tall(64, 80, np.float64, 24), mesh), mesh)
    with pytest.raises(ValueError, match="least_squares: dtype int32 is not float32"):
        linalg.least_squares(put(np.ones((64, 4), np.int32), mesh),
                             put(np.ones((64, 1), np.int32), mesh), mesh)
    with pytest.raises(ValueError, match=r"least_squares: b is \[32, 1\] float64; expected "
                                         r"\[64\] or \[64, nrhs\] float64"):
        linalg.least_squares(put(a, mesh), put(np.ones((32, 1)), mesh), mesh)
    deficient = a.copy()
    deficient[:, 4] = 0  # a zero column: R's fifth diagonal element is exactly zero
    x, info = linalg.least_squares(put(deficient, mesh), put(np.ones((64, 1)), mesh), mesh,
                                   return_info=True)
    assert int(info) == 5 and np.isnan(np.asarray(x)).all()


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_torch_tall_qr_and_least_squares_on_cpu_row_blocks(dtype):
    m, n = 60, 10
    a = torch.from_numpy(tall(m, n, dtype, 25))
    b = torch.from_numpy(tall(m, 2, dtype, 26))
    tolerance = 1e-5 if dtype == np.complex64 else 1e-13
    factors = torch_linalg.qr(list(a.split(20)))
    check_qr(a.numpy(), torch.cat(factors.q).numpy(), factors.r.numpy(), tolerance)
    solved = torch_linalg.least_squares(list(a.split(20)), list(b.split(20)))
    expected = torch.linalg.lstsq(a.to(torch.complex128), b.to(torch.complex128)).solution
    assert solved.info == 0
    assert (torch.linalg.norm(solved.x.to(torch.complex128) - expected)
            / torch.linalg.norm(expected) < 10 * tolerance)
    # Blocks of 6 rows for 10 columns (and a square A in 4 blocks): the stacked factors are as
    # large as A, the answers the same.
    for matrix, rows in ((a, 6), (torch.from_numpy(tall(40, 40, dtype, 27)), 10)):
        factors = torch_linalg.qr(list(matrix.split(rows)))
        check_qr(matrix.numpy(), torch.cat(factors.q).numpy(), factors.r.numpy(), tolerance)
        rhs = torch.from_numpy(tall(matrix.shape[0], 2, dtype, 28))
        solved = torch_linalg.least_squares(list(matrix.split(rows)), list(rhs.split(rows)))
        expected = torch.linalg.lstsq(matrix.to(torch.complex128),
                                      rhs.to(torch.complex128)).solution
        assert (torch.linalg.norm(solved.x.to(torch.complex128) - expected)
                / torch.linalg.norm(expected) < 100 * tolerance)
        decomposed = torch_linalg.svd(list(matrix.split(rows)))
        product = torch.cat(decomposed.u) * decomposed.s.to(dtype=matrix.dtype) @ decomposed.vh
        assert torch.linalg.norm(product - matrix) / torch.linalg.norm(matrix) < 10 * tolerance
        values = torch_linalg.svd(list(matrix.split(rows)), compute_uv=False).s
        assert torch.allclose(values.double(), torch.linalg.svdvals(matrix.to(torch.complex128)),
                              rtol=10 * tolerance, atol=0)
        unitary = torch_linalg.polar(list(matrix.split(rows)))
        u = torch.cat(unitary.u)
        scale = torch.linalg.norm(matrix)
        assert torch.linalg.norm(u @ unitary.h - matrix) / scale < 10 * tolerance
        assert torch.linalg.norm(u.mH @ u - torch.eye(matrix.shape[1])) < 100 * tolerance
    with pytest.raises(NotImplementedError, match=r"qr: a is \[8, 10\], wider than tall"):
        torch_linalg.qr(list(a[:8].split(4)))
    with pytest.raises(ValueError, match=r"qr: a_shards\[2\] has shape \(10, 10\)"):
        torch_linalg.qr(list(a.split(25)))
    with pytest.raises(ValueError, match="least_squares: a_shards is empty"):
        torch_linalg.least_squares([], [])
    deficient = a.clone()
    deficient[:, 3] = 0
    with pytest.raises(torch.linalg.LinAlgError, match="least_squares: a does not have full "
                                                       "column rank"):
        torch_linalg.least_squares(list(deficient.split(20)), list(b.split(20)))
    failed = torch_linalg.least_squares(list(deficient.split(20)), list(b.split(20)),
                                        check_errors=False)
    assert failed.info == 4 and torch.isnan(failed.x).all()
    decomposed = torch_linalg.svd(list(a.split(20)))
    u = torch.cat(decomposed.u)
    reference = torch.linalg.svdvals(a.to(torch.complex128))
    assert (decomposed.s.double() - reference).abs().max() < tolerance * reference.max()
    product = (u * decomposed.s.to(u.dtype)) @ decomposed.vh
    assert torch.linalg.norm(product - a) < 10 * tolerance * torch.linalg.norm(a)
    values = torch_linalg.svd(list(a.split(20)), compute_uv=False)
    assert values.u is None and torch.allclose(values.s, decomposed.s, rtol=10 * tolerance)
    factors = torch_linalg.polar(list(a.split(20)))
    want_u, want_h = numpy_polar(a.numpy().astype(np.complex128))
    polar_u = torch.cat(factors.u).numpy()
    assert np.linalg.norm(polar_u - want_u) < 10 * tolerance * np.linalg.norm(want_u)
    assert np.linalg.norm(factors.h.numpy() - want_h) < 10 * tolerance * np.linalg.norm(want_h)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_torch_cpu_row_blocks(dtype):
    n = 18
    a = torch.from_numpy(spd(n, np.complex128 if dtype.is_complex else np.float64, 6))
    b = torch.randn(n, 2, dtype=torch.float64).to(dtype)
    shards = list(a.split(6))
    solved = torch_linalg.cho_solve(shards, list(b.split(6)))
    x = torch.cat(solved.x)
    assert torch.linalg.norm(a @ x - b) < 1e-10
    assert abs(solved.logdet - float(torch.linalg.slogdet(a)[1])) < 1e-10
    inverse, info = torch_linalg.cholesky_inverse(shards)
    assert info == 0 and torch.linalg.norm(a @ torch.cat(inverse) - torch.eye(n)) < 1e-10
    # overwrite_a: the inverse in A's own blocks, which are returned, as on CUDA.
    own = [s.clone() for s in shards]
    written, info = torch_linalg.cholesky_inverse(own, overwrite_a=True)
    assert info == 0 and all(w is o for w, o in zip(written, own))
    torch.testing.assert_close(torch.cat(own), torch.cat(inverse))
    values, vectors, _ = torch_linalg.eigh(shards)
    v = torch.cat(vectors)
    assert torch.linalg.norm(a @ v - v * values.to(dtype)) < 1e-10


def test_torch_errors():
    a = torch.eye(8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"a_shards\[1\] has shape \(4, 7\)"):
        torch_linalg.eigh([a[:4], a[4:, :7]])
    with pytest.raises(ValueError, match="int64"):
        torch_linalg.eigh([a.long()])
    bad = a.clone()
    bad[5, 5] = -1
    with pytest.raises(torch.linalg.LinAlgError, match="not positive definite"):
        torch_linalg.cho_solve(list(bad.split(4)), list(torch.ones(8, 1).double().split(4)))
    solved = torch_linalg.cho_solve(list(bad.split(4)), list(torch.ones(8, 1).double().split(4)),
                                    check_errors=False)
    assert solved.info > 0 and torch.isnan(torch.cat(solved.x)).all()


def test_solver_call():
    solve, eigh = _meshla.SolverOp.cholesky_solve, _meshla.SolverOp.eigh
    f64 = _meshla.DType.float64

    def call(op, n, parts, tile=0, nrhs=0, dtype=f64, overwrite_a=False):
        return _meshla.solver_call(op, n, dtype, nrhs, parts, tile, overwrite_a)

    assert call(solve, 65536, 4, nrhs=1) == (2048, False)
    assert call(solve, 4000, 4, nrhs=1) == (1000, False)
    assert call(solve, 4 * 3000, 4, nrhs=1) == (1024, True)
    assert call(solve, 48, 4, 5, nrhs=1) == (5, True)
    with pytest.raises(ValueError, match="n=10 rows are not divisible by the 4 GPUs"):
        call(solve, 10, 4, nrhs=1)
    with pytest.raises(ValueError, match="nrhs=300 right-hand sides; cuSolverMg takes 1 to 256"):
        call(solve, 48, 4, nrhs=300)
    with pytest.raises(ValueError, match="overwrite_a needs n/GPUs = 48/4"):
        call(solve, 48, 4, 5, nrhs=1, overwrite_a=True)
    with pytest.raises(ValueError, match="dtype bfloat16 is not float32, float64, complex64"):
        call(eigh, 48, 4, dtype=_meshla.DType.bfloat16)
    # cuSolverMg's syevd refuses tiles over 1024 columns; one GPU runs cusolverDn's, untiled.
    assert call(eigh, 65536, 4) == (1024, False)
    assert call(_meshla.SolverOp.eigvalsh, 4096, 2) == (1024, False)
    with pytest.raises(ValueError, match="eigh: tile=2048 exceeds 1024"):
        call(eigh, 8192, 2, 2048)
    assert call(eigh, 1500, 1) == (1500, False)
    with pytest.raises(NotImplementedError, match="cholesky_inverse: n=46344"):
        call(_meshla.SolverOp.cholesky_inverse, 46344, 4)


def test_cpu_refuses_what_the_gpus_refuse(mesh):
    """The CPU references run the extension's checks first: the same errors as on GPUs."""
    n = 8 * mesh.shape["x"]
    with pytest.raises(ValueError, match="nrhs=300 right-hand sides"):
        linalg.cho_solve(put(np.eye(n), mesh), put(np.ones((n, 300)), mesh), mesh)
    with pytest.raises(ValueError, match="eigh: tile=4096 exceeds 1024"):
        linalg.eigh(put(np.eye(n), mesh), mesh, tile=4096)
    with pytest.raises(ValueError, match="nrhs=300 right-hand sides"):
        torch_linalg.cho_solve([torch.eye(8, dtype=torch.float64)],
                               [torch.ones(8, 300, dtype=torch.float64)])
    with pytest.raises(ValueError, match="eigh: tile=4096 exceeds 1024"):
        torch_linalg.eigh(list(torch.eye(8, dtype=torch.float64).split(4)), tile=4096)


def test_a_misfit_b_is_refused_in_the_same_words_in_both_frameworks(mesh):
    """B's rule is the extension's: JAX's block and torch's shard name it alike."""
    a = np.eye(16)
    with pytest.raises(ValueError) as jax_error:
        jax.jit(jax.shard_map(lambda a, b: linalg.lu_solve_shard(a, b, mesh=mesh)[0], mesh=mesh,
                              in_specs=(P("x", None), P("x", None)), out_specs=P("x", None)))(
            put(a, mesh), put(np.ones((8, 1), np.float32), mesh))
    with pytest.raises(ValueError) as torch_error:
        torch_linalg.lu_solve(list(torch.from_numpy(a).split(4)),
                              [torch.ones(2, 1, dtype=torch.float32)] * 4)
    expected = "lu_solve: b is [2, 1] float32; expected [4, nrhs] float64: a's rows and dtype"
    assert str(jax_error.value) == expected
    assert str(torch_error.value) == expected.replace(" b is", " b_shards[0] is")
    # A dtype meshla does not take at all is named with the routine too.
    with pytest.raises(ValueError, match=r"^lu_solve: b\.dtype=uint8 is not one meshla takes"):
        linalg.lu_solve(put(a, mesh), put(np.ones((16, 1), np.uint8), mesh), mesh)
    with pytest.raises(ValueError, match=r"^lu_solve: b_shards\[0\]\.dtype=torch\.uint8 is not"):
        torch_linalg.lu_solve(list(torch.from_numpy(a).split(4)),
                              [torch.ones(4, 1, dtype=torch.uint8)] * 4)


def _shard_forms(rank, size, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        n = 12
        a = torch.from_numpy(spd(n, np.float64, 9))
        b = torch.arange(2 * n, dtype=torch.float64).reshape(n, 2)
        rows = slice(rank * n // size, (rank + 1) * n // size)
        solved = torch_linalg.cho_solve_shard(a[rows], b[rows])
        inverse, info = torch_linalg.cholesky_inverse_shard(a[rows])
        own = a[rows].clone()
        written, _ = torch_linalg.cholesky_inverse_shard(own, overwrite_a=True)
        assert written is own and torch.equal(own, inverse)
        eig = torch_linalg.eigh_shard(a[rows])
        lu = torch_linalg.lu_solve_shard(a[rows] + torch.triu(a[rows]), b[rows])  # not symmetric
        tall_a = torch.from_numpy(tall(4 * n, 5, np.float64, 27))
        tall_rows = slice(rank * 2 * n, (rank + 1) * 2 * n)
        factors = torch_linalg.qr_shard(tall_a[tall_rows])
        fit = torch_linalg.least_squares_shard(tall_a[tall_rows], tall_a[tall_rows, :2] + 1)
        try:  # a rank whose b does not fit: the error on every rank, no wait
            torch_linalg.least_squares_shard(tall_a[tall_rows],
                                             torch.ones(3 if rank else 2 * n, 1,
                                                        dtype=torch.float64))
            misfit = None
        except ValueError as error:
            misfit = str(error)
        decomposed = torch_linalg.svd_shard(tall_a[tall_rows])
        values = torch_linalg.svd_shard(tall_a[tall_rows], compute_uv=False).s
        unitary = torch_linalg.polar_shard(tall_a[tall_rows])
        try:  # ranks whose blocks differ: the error on every rank, no wait
            torch_linalg.qr_shard(tall_a[tall_rows, :4] if rank else tall_a[tall_rows])
            disagreement = None
        except ValueError as error:
            disagreement = str(error)
        try:  # ranks whose blocks differ: the error on every rank, no wait
            torch_linalg.cho_solve_shard(a[rows, :8] if rank else a[rows], b[rows])
            shape_error = None
        except ValueError as error:
            shape_error = str(error)
        try:  # a rank whose b has another dtype: the same
            torch_linalg.cho_solve_shard(a[rows], b[rows].float() if rank else b[rows])
            dtype_error = None
        except ValueError as error:
            dtype_error = str(error)
        routine_errors = []
        for routines, args in (((torch_linalg.cho_solve_shard, torch_linalg.lu_solve_shard),
                                (a[rows], b[rows])),
                               ((torch_linalg.qr_shard, torch_linalg.polar_shard),
                                (tall_a[tall_rows],))):
            try:  # ranks that call different routines: the same
                routines[rank](*args)
                routine_errors.append(None)
            except ValueError as error:
                routine_errors.append(str(error))
        engine_errors = []
        for routine, engines in ((torch_linalg.cho_solve_shard, ("cusolvermp", "cusolvermp")),
                                 (torch_linalg.cho_solve_shard, ("auto", "cusolvermp")),
                                 (torch_linalg.lu_solve_shard, ("cusolvermp", "cusolvermp")),
                                 (torch_linalg.cho_solve_shard, ("cusolvermg", "cusolvermg")),
                                 (torch_linalg.lu_solve_shard, ("auto", "cusolvermg"))):
            try:  # cuSOLVERMp on CPU blocks, ranks asking for different engines: on every rank
                routine(a[rows], b[rows], engine=engines[rank])
                engine_errors.append(None)
            except ValueError as error:
                engine_errors.append(str(error))
        # A square A: each rank's 6 rows fewer than its 12 columns.
        square = torch.from_numpy(tall(n, n, np.float64, 29))
        square_factors = torch_linalg.qr_shard(square[rows])
        square_fit = torch_linalg.least_squares_shard(square[rows], b[rows])
        square_polar = torch_linalg.polar_shard(square[rows])
        results[rank] = (solved.x, solved.logdet, inverse, info, eig.eigenvalues, eig.eigenvectors,
                         lu.x, factors.q, factors.r, fit.x, misfit, decomposed.u, decomposed.s,
                         decomposed.vh, values, unitary.u, unitary.h, disagreement,
                         square_factors.q, square_factors.r, square_fit.x, square_polar.u,
                         square_polar.h, shape_error, dtype_error, routine_errors,
                         engine_errors)
    finally:
        dist.destroy_process_group()


def _first_rank_outcomes(rank, size, results):
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        # Each rank offers its own; every rank gets the first rank's, call after call, and the
        # store keeps no key once every rank has read.
        got = [torch_linalg._from_first_rank(dist.group.WORLD, ("ok", call, rank))
               for call in range(3)]
        dist.barrier()
        store = dist.distributed_c10d._get_default_store()
        name = dist.group.WORLD.group_name
        left = [key for call in (1, 2, 3) for key in (f"meshla/first_rank/{name}/{call}",
                                                      f"meshla/first_rank/{name}/{call}/read")
                if store.check([key])]
        results[rank] = (got, left)
    finally:
        dist.destroy_process_group()


def test_first_rank_outcome_reaches_every_rank_through_the_store(gloo_env):
    import torch.multiprocessing as mp

    size = 3
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_first_rank_outcomes, args=(size, results), nprocs=size)
    for rank in range(size):
        got, left = results[rank]
        assert got == [("ok", call, 0) for call in range(3)]
        assert left == []


def test_torch_shard_forms_on_cpu_ranks(gloo_env):
    """One process per rank over gloo: each rank gets its row block of X, A⁻¹ and V."""
    import torch.multiprocessing as mp

    size = 2
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_shard_forms, args=(size, results), nprocs=size)
    n = 12
    a = torch.from_numpy(spd(n, np.float64, 9))
    b = torch.arange(2 * n, dtype=torch.float64).reshape(n, 2)
    x = torch.cat([results[r][0] for r in range(size)])
    assert torch.linalg.norm(a @ x - b) / torch.linalg.norm(b) < 1e-12
    assert abs(results[0][1] - float(torch.linalg.slogdet(a)[1])) < 1e-10
    inverse = torch.cat([results[r][2] for r in range(size)])
    assert torch.linalg.norm(a @ inverse - torch.eye(n)) < 1e-10
    values = results[1][4]
    vectors = torch.cat([results[r][5] for r in range(size)])
    assert torch.allclose(values, torch.linalg.eigvalsh(a), atol=1e-12)
    assert torch.linalg.norm(a @ vectors - vectors * values) < 1e-10
    general_a = torch.cat([a[r * n // size:(r + 1) * n // size]
                           + torch.triu(a[r * n // size:(r + 1) * n // size]) for r in range(size)])
    lu_x = torch.cat([results[r][6] for r in range(size)])
    assert torch.linalg.norm(general_a @ lu_x - b) / torch.linalg.norm(b) < 1e-12
    assert all("cho_solve_shard: rank 1 of the group has a (6, 8)" in results[r][23]
               for r in range(size))
    assert all("cho_solve_shard: b is [6, 2] float32" in results[r][24]
               and "(rank 1 of the group)" in results[r][24] for r in range(size))
    assert all("rank 1 of the group called lu_solve_shard (lu_solve) where rank 0 called "
               "cho_solve_shard (cholesky_solve)" in results[r][25][0] for r in range(size))
    assert all("rank 1 of the group called polar_shard where rank 0 called qr_shard"
               in results[r][25][1] for r in range(size))
    assert all("cho_solve_shard: engine='cusolvermp' runs on CUDA tensors; a is on cpu (rank 0 "
               "of the group)" in results[r][26][0] for r in range(size))
    assert all("rank 1 of the group called cho_solve_shard (cholesky_solve, engine='cusolvermp') "
               "where rank 0 called cho_solve_shard (cholesky_solve)" in results[r][26][1]
               for r in range(size))
    assert all("lu_solve_shard: engine='cusolvermp' runs on CUDA tensors; a is on cpu (rank 0 "
               "of the group)" in results[r][26][2] for r in range(size))
    # cuSolverMg's path asked for by name runs (on CPU blocks, its reference); "auto" and it are
    # two engines to the ranks' agreement.
    assert all(results[r][26][3] is None for r in range(size))
    assert all("rank 1 of the group called lu_solve_shard (lu_solve, engine='cusolvermg') where "
               "rank 0 called lu_solve_shard (lu_solve)" in results[r][26][4] for r in range(size))
    square = torch.from_numpy(tall(n, n, np.float64, 29))
    check_qr(square.numpy(), torch.cat([results[r][18] for r in range(size)]).numpy(),
             results[0][19].numpy(), 1e-13)
    assert all(torch.linalg.norm(results[r][20] - torch.linalg.solve(square, b))
               / torch.linalg.norm(results[r][20]) < 1e-12 for r in range(size))
    polar_u = torch.cat([results[r][21] for r in range(size)])
    assert torch.linalg.norm(polar_u @ results[0][22] - square) / torch.linalg.norm(square) < 1e-13
    tall_a = torch.from_numpy(tall(4 * n, 5, np.float64, 27))
    q = torch.cat([results[r][7] for r in range(size)])
    check_qr(tall_a.numpy(), q.numpy(), results[0][8].numpy(), 1e-13)
    assert torch.equal(results[0][8], results[1][8])
    expected = torch.linalg.lstsq(tall_a, tall_a[:, :2] + 1).solution
    assert all(torch.linalg.norm(results[r][9] - expected) < 1e-12 for r in range(size))
    assert all("least_squares_shard: b is [3, 1] float64; expected [24, nrhs]" in results[r][10]
               and "(rank 1 of the group)" in results[r][10] for r in range(size))
    assert all("qr_shard: rank 1 of the group has a (24, 4)" in results[r][17]
               for r in range(size))
    u = torch.cat([results[r][11] for r in range(size)])
    s, vh = results[0][12], results[0][13]
    assert torch.allclose(s, torch.linalg.svdvals(tall_a), rtol=1e-12)
    assert torch.allclose(results[1][14], s, rtol=1e-12)
    assert torch.linalg.norm((u * s) @ vh - tall_a) < 1e-12 * torch.linalg.norm(tall_a)
    want_u, want_h = numpy_polar(tall_a.numpy())
    polar_u = torch.cat([results[r][15] for r in range(size)]).numpy()
    assert np.linalg.norm(polar_u - want_u) < 1e-12 * np.linalg.norm(want_u)
    assert np.linalg.norm(results[1][16].numpy() - want_h) < 1e-12 * np.linalg.norm(want_h)


def test_tall_svd_and_polar_of_a_graded_matrix_are_backward_stable(mesh):
    """A polynomial fit's Vandermonde matrix (condition far beyond 1/eps, singular values spread
    over the whole range): QDWH's iterate stops short on it and must not be taken (a review found
    ||A - U H|| at 1e5 eps before e86f6f5); the answers stay within a few eps of A."""
    x = np.linspace(0, 1, 512)[:, None]
    a = x ** np.arange(40)
    eps, n = np.finfo(np.float64).eps, a.shape[1]
    unitary, hermitian = jax.jit(lambda a: linalg.polar(a, mesh))(put(a, mesh))
    u, s, vh = jax.jit(lambda a: linalg.svd(a, mesh))(put(a, mesh))
    torch_polar = torch_linalg.polar(list(torch.from_numpy(a).chunk(2)))
    torch_svd = torch_linalg.svd(list(torch.from_numpy(a).chunk(2)))
    for unitary, product in (
            (np.asarray(unitary), np.asarray(unitary) @ np.asarray(hermitian)),
            (np.asarray(u), (np.asarray(u) * np.asarray(s)) @ np.asarray(vh)),
            (torch.cat(torch_polar.u).numpy(), torch.cat(torch_polar.u).numpy()
             @ torch_polar.h.numpy()),
            (torch.cat(torch_svd.u).numpy(), (torch.cat(torch_svd.u).numpy()
                                              * torch_svd.s.numpy()) @ torch_svd.vh.numpy())):
        assert np.linalg.norm(product - a) <= 100 * eps * np.linalg.norm(a)
        assert np.abs(unitary.T @ unitary - np.eye(n)).max() <= 20 * np.sqrt(n) * eps


def test_tall_routines_differentiate_as_before(mesh):
    """least_squares (both frameworks) and JAX's svd and polar run Householder reflectors and
    QDWH, which neither framework differentiates; their gradients are those of the
    differentiable forms they replaced (a review found jax.grad and backward raising), here
    against jax.numpy's and torch's own on the whole matrix."""
    rng = np.random.default_rng(51)
    a, b = rng.standard_normal((64, 6)), rng.standard_normal((64, 2))
    w, c, d = rng.standard_normal(6), rng.standard_normal((64, 6)), rng.standard_normal((6, 6))

    def svd_terms(u, s, vh):  # sign-free: the product and the values
        return jnp.sum(((u * s) @ vh) * c) + jnp.sum(s * w)

    def polar_terms(u, h):
        return jnp.sum(u * c) + jnp.sum(h * d)

    def reference_polar(a):
        u, s, vh = jnp.linalg.svd(a, full_matrices=False)
        return u @ vh, (vh.T * s) @ vh

    cases = {
        "least_squares": (lambda a: jnp.sum(linalg.least_squares(a, b, mesh) ** 2),
                          lambda a: jnp.sum(jnp.linalg.solve(a.T @ a, a.T @ b) ** 2)),
        "svd": (lambda a: svd_terms(*linalg.svd(a, mesh)),
                lambda a: svd_terms(*jnp.linalg.svd(a, full_matrices=False))),
        "singular values": (lambda a: jnp.sum(linalg.svd(a, mesh, compute_uv=False) * w),
                            lambda a: jnp.sum(jnp.linalg.svd(a, compute_uv=False) * w)),
        "polar": (lambda a: polar_terms(*linalg.polar(a, mesh)),
                  lambda a: polar_terms(*reference_polar(a))),
    }
    for name, (ours, reference) in cases.items():
        got = np.asarray(jax.jit(jax.grad(ours))(put(a, mesh)))
        np.testing.assert_allclose(got, jax.grad(reference)(a), atol=1e-12, err_msg=name)
    b_grad = jax.grad(lambda b: jnp.sum(linalg.least_squares(put(a, mesh), b, mesh) ** 2))(
        put(b, mesh))
    np.testing.assert_allclose(
        np.asarray(b_grad),
        jax.grad(lambda b: jnp.sum(jnp.linalg.solve(a.T @ a, a.T @ b) ** 2))(b), atol=1e-12)
    leaves = [torch.from_numpy(block).requires_grad_() for block in np.split(a, 2)]
    targets = [torch.from_numpy(block).requires_grad_() for block in np.split(b, 2)]
    (torch_linalg.least_squares(leaves, targets).x ** 2).sum().backward()
    whole_a = torch.from_numpy(a).requires_grad_()
    whole_b = torch.from_numpy(b).requires_grad_()
    (torch.linalg.lstsq(whole_a, whole_b).solution ** 2).sum().backward()
    torch.testing.assert_close(torch.cat([t.grad for t in leaves]), whole_a.grad)
    torch.testing.assert_close(torch.cat([t.grad for t in targets]), whole_b.grad)
