"""GPU checks of the distributed dense solvers (one process driving 1, 2 and 4 GPUs), one JSON
line per check.

  python tests/gpu/check_solver.py --results FILE

JAX (meshla.jax.linalg under jit, row-sharded arrays) and PyTorch (meshla.torch.linalg and the
DenseSolver directly, on NaN-poisoned outputs): Cholesky solve with log-determinant, inverse,
eigh and eigvalsh, the LU solve of a general matrix, and the tall-skinny QR, least squares, SVD
and polar decomposition, in float32, float64, complex64 and complex128, against float64
references with fresh random matrices: ||Ax - b|| / (||A|| ||x||), ||A A⁻¹ - I|| /
(||A|| ||A⁻¹||), ||AV - VΛ|| / ||A||, ||VᴴV - I||, ||A - QR||, ||QᴴQ - I||, the normal
equations' residual, ||A - USVᴴ||, the singular values and ||A - UH||. Also n not a multiple of
the tile, n = 1, an ill-conditioned matrix, a non-positive-definite one and a singular one (NaN
and info > 0), two solves inside one jit, a donated input solved in its own buffers, and two
2-GPU meshes solving at the same time from two threads.
"""

import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPUs

import threading
import traceback

import jax
import numpy as np
import torch

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshla import _meshla  # noqa: E402
from meshla.jax import linalg  # noqa: E402
from matrices import (DTYPES, TORCH_DTYPES, random_conditioned, random_general,  # noqa: E402
                      random_spd, random_symmetric, tolerance)
from meshla.torch import linalg as torch_linalg  # noqa: E402
from meshla.torch._dtypes import DTYPES as MESHLA_DTYPES  # noqa: E402
from reporting import Reporter, check_parser  # noqa: E402

# The double-precision references run on a GPU through torch (cuBLAS and cuSOLVER's one-GPU
# routines, none of meshla's code): on the host, the checks at n = 6144 to 10000 took minutes
# each, and the 4-GPU run never finished.
REFERENCE = "cuda:0"


def double(m):
    """m (numpy or jax) as a float64 or complex128 tensor on the reference GPU."""
    m = np.asarray(m)
    return torch.from_numpy(m.astype(np.complex128 if np.iscomplexobj(m) else np.float64)
                            ).to(REFERENCE)


def spectral_norm(m):
    """‖m‖₂ by 200 steps of power iteration on mᴴm. ‖mv‖ for a unit v never exceeds ‖m‖₂, so
    a residual divided by this is never understated."""
    v = torch.randn(m.shape[1], 1, dtype=m.dtype, device=m.device)
    for _ in range(200):
        v = m.conj().T @ (m @ (v / torch.linalg.norm(v)))
    v = v / torch.linalg.norm(v)
    return float(torch.linalg.norm(m @ v))


def solve_residual(a, x, b):
    a, x, b = double(a), double(x), double(b)
    return float(torch.linalg.norm(a @ x - b)) / (spectral_norm(a) * float(torch.linalg.norm(x)))


def inverse_residual(a, inverse):
    a, inverse = double(a), double(inverse)
    identity = torch.eye(len(a), dtype=a.dtype, device=a.device)
    return float(torch.linalg.norm(a @ inverse - identity)) / (
        spectral_norm(a) * spectral_norm(inverse))


def eigen_residuals(a, values, vectors):
    a, vectors, values = double(a), double(vectors), double(values).real
    identity = torch.eye(len(a), dtype=a.dtype, device=a.device)
    residual = float(torch.linalg.norm(a @ vectors - vectors * values)) / spectral_norm(a)
    orthogonality = float(torch.linalg.norm(vectors.conj().T @ vectors - identity))
    return residual, orthogonality


def log_determinant(a):
    return float(torch.linalg.slogdet(double(a))[1])


def eigenvalues(h):
    return torch.linalg.eigvalsh(double(h)).cpu().numpy()


class Checks:
    def __init__(self, report: Reporter):
        self.report = report
        self.rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))

    def run(self, name, body):
        self.report.check(name, body)

    # --- JAX ------------------------------------------------------------------------------
    def jax_routines(self, mesh, n, dtype, tile=0):
        g = mesh.shape["x"]
        label = f"jax g={g} n={n} tile={tile or 'auto'} {np.dtype(dtype).name}"
        rows = NamedSharding(mesh, P("x", None))
        tol = tolerance(dtype, n)
        a = random_spd(n, dtype, self.rng, device=REFERENCE)
        b = self.rng.standard_normal((n, 3)).astype(dtype)

        def solve():
            x, logdet, info = jax.jit(lambda a, b: linalg.cho_solve(
                a, b, mesh, tile=tile, return_logdet=True, return_info=True))(
                jax.device_put(a, rows), jax.device_put(b, rows))
            residual = solve_residual(a, x, b)
            expected = log_determinant(a)
            logdet_error = abs(float(logdet) - expected) / max(1.0, abs(expected))
            ok = int(info) == 0 and residual < tol and logdet_error < 100 * tol
            return ok, f"residual {residual:.2e}, logdet error {logdet_error:.2e} (tol {tol:.1e})"

        def inverse():
            result, info = jax.jit(lambda a: linalg.cholesky_inverse(
                a, mesh, tile=tile, return_info=True))(jax.device_put(a, rows))
            residual = inverse_residual(a, result)
            return int(info) == 0 and residual < tol, f"residual {residual:.2e} (tol {tol:.1e})"

        def eigh():
            h = random_symmetric(n, dtype, self.rng)
            values, vectors, info = jax.jit(lambda a: linalg.eigh(
                a, mesh, tile=tile, return_info=True))(jax.device_put(h, rows))
            residual, orthogonality = eigen_residuals(h, values, vectors)
            reference = eigenvalues(h)
            value_error = np.abs(np.asarray(values) - reference).max() / np.abs(reference).max()
            only = jax.jit(lambda a: linalg.eigh(a, mesh, tile=tile, eigvals_only=True))(
                jax.device_put(h, rows))
            only_error = np.abs(np.asarray(only) - reference).max() / np.abs(reference).max()
            ok = (int(info) == 0 and residual < tol and orthogonality < tol * n ** 0.5
                  and value_error < tol and only_error < tol)
            return ok, (f"residual {residual:.2e}, orthogonality {orthogonality:.2e}, eigenvalues "
                        f"{value_error:.2e}, eigvalsh {only_error:.2e} (tol {tol:.1e})")

        def lu():
            general = random_general(n, dtype, self.rng)
            x, info = jax.jit(lambda a, b: linalg.lu_solve(a, b, mesh, tile=tile,
                                                           return_info=True))(
                jax.device_put(general, rows), jax.device_put(b, rows))
            residual = solve_residual(general, x, b)
            return int(info) == 0 and residual < tol, f"residual {residual:.2e} (tol {tol:.1e})"

        def tall_qr(square: bool):
            # A [4n, n/4] (each device's rows at least the columns) or a square A [n, n] (each
            # device's rows fewer: the stacked factors are as large as A).
            m, k = (n, n) if square else (4 * n, max(n // 4, 1))
            tall_tol = tolerance(dtype, m)
            a = (random_conditioned(n, dtype, self.rng, device=REFERENCE) if square
                 else random_general(m, dtype, self.rng, columns=k))
            rhs = self.rng.standard_normal((m, 2)).astype(dtype)
            q, r = jax.jit(lambda a: linalg.qr(a, mesh))(jax.device_put(a, rows))
            x, info = jax.jit(lambda a, b: linalg.least_squares(a, b, mesh, return_info=True))(
                jax.device_put(a, rows), jax.device_put(rhs, rows))
            a64, q64, r64 = double(a), double(q), double(r)
            factor_error = float(torch.linalg.norm(q64 @ r64 - a64) / torch.linalg.norm(a64))
            orthogonality = float(torch.linalg.norm(
                q64.conj().T @ q64 - torch.eye(k, dtype=q64.dtype, device=q64.device)))
            # The normal equations' residual Aᴴ(AX - B), relative: zero at the minimizer.
            x64, b64 = double(x), double(rhs)
            normal = float(torch.linalg.norm(a64.conj().T @ (a64 @ x64 - b64)) / (
                spectral_norm(a64) ** 2 * float(torch.linalg.norm(x64))))
            # The SVD and the polar factors: A - U S Vᴴ, the values against torch's, A - U H.
            u, s, vh = jax.jit(lambda a: linalg.svd(a, mesh))(jax.device_put(a, rows))
            u64, s64, vh64 = double(u), double(s).real, double(vh)
            svd_error = float(torch.linalg.norm((u64 * s64) @ vh64 - a64)
                              / torch.linalg.norm(a64))
            # gesvd: CUDA's default driver, gesvdj, misses float64 values by 1e-13 (NOTES 106)
            reference = torch.linalg.svdvals(a64, driver="gesvd")
            value_error = float((s64 - reference).abs().max() / reference.max())
            unitary, hermitian = jax.jit(lambda a: linalg.polar(a, mesh))(
                jax.device_put(a, rows))
            u_polar, h_polar = double(unitary), double(hermitian)
            polar_error = max(
                float(torch.linalg.norm(u_polar @ h_polar - a64) / torch.linalg.norm(a64)),
                float(torch.linalg.norm(u_polar.conj().T @ u_polar
                                        - torch.eye(k, dtype=u_polar.dtype, device=u_polar.device))
                      / k ** 0.5),
                float(torch.linalg.norm(h_polar - h_polar.conj().T) / torch.linalg.norm(h_polar)))
            ok = (int(info) == 0 and factor_error < tall_tol
                  and orthogonality < tall_tol * k ** 0.5 and normal < tall_tol
                  and bool(torch.equal(r64, torch.triu(r64))) and svd_error < tall_tol
                  and value_error < tall_tol and polar_error < tall_tol)
            return ok, (f"[{m}, {k}]: A - QR {factor_error:.2e}, orthogonality "
                        f"{orthogonality:.2e}, normal equations {normal:.2e}, A - USVᴴ "
                        f"{svd_error:.2e}, values {value_error:.2e}, polar (A - UH, UᴴU - I, "
                        f"H - Hᴴ) {polar_error:.2e} (tol {tall_tol:.1e})")

        self.run(f"{label} cho_solve", solve)
        self.run(f"{label} cholesky_inverse", inverse)
        self.run(f"{label} eigh", eigh)
        self.run(f"{label} lu_solve", lu)
        self.run(f"{label} qr, least_squares, svd and polar (tall)",
                 functools.partial(tall_qr, False))
        self.run(f"{label} qr, least_squares, svd and polar (square)",
                 functools.partial(tall_qr, True))

    def jax_special(self, mesh):
        g = mesh.shape["x"]
        rows = NamedSharding(mesh, P("x", None))
        n = 128 * g

        def ill_conditioned():
            a = random_spd(n, np.float64, self.rng, condition=1e10, device=REFERENCE)
            b = self.rng.standard_normal((n, 1))
            x = linalg.cho_solve(jax.device_put(a, rows), jax.device_put(b, rows), mesh)
            residual = solve_residual(a, x, b)
            return residual < 1e-12, f"cond 1e10: backward residual {residual:.2e}"

        def not_spd():
            a = random_spd(n, np.float64, self.rng, device=REFERENCE)
            a[n // 2, n // 2] = -10.0
            b = np.ones((n, 1))
            x, info = linalg.cho_solve(jax.device_put(a, rows), jax.device_put(b, rows), mesh,
                                       return_info=True)
            inverse, inverse_info = linalg.cholesky_inverse(jax.device_put(a, rows), mesh,
                                                            return_info=True)
            ok = (int(info) > 0 and np.isnan(np.asarray(x)).all() and int(inverse_info) > 0
                  and np.isnan(np.asarray(inverse)).all())
            return ok, f"info {int(info)}, inverse info {int(inverse_info)}"

        def singular():
            a = random_general(n, np.float64, self.rng, singular_column=n // 3)
            x, info = linalg.lu_solve(jax.device_put(a, rows),
                                      jax.device_put(np.ones((n, 2)), rows), mesh,
                                      return_info=True)
            return int(info) > 0 and np.isnan(np.asarray(x)).all(), f"lu_solve info {int(info)}"

        def twice_in_one_jit():
            a = random_spd(n, np.float64, self.rng, device=REFERENCE)
            b = self.rng.standard_normal((n, 2))

            @jax.jit
            def twice(a, b):
                x = linalg.cho_solve(a, b, mesh)
                return linalg.cho_solve(a, x, mesh)  # A⁻² b

            y = twice(jax.device_put(a, rows), jax.device_put(b, rows))
            y2 = twice(jax.device_put(a, rows), jax.device_put(2 * b, rows))  # repeated calls
            expected = np.linalg.solve(a, np.linalg.solve(a, b))
            error = max(np.linalg.norm(np.asarray(y) - expected),
                        np.linalg.norm(np.asarray(y2) - 2 * expected) / 2
                        ) / np.linalg.norm(expected)
            return error < 1e-10, f"relative error {error:.2e}"

        def donated():
            a = random_spd(n, np.float64, self.rng, device=REFERENCE)
            b = self.rng.standard_normal((n, 1))
            a_device = jax.device_put(a, rows)
            pointers = {s.device: s.data.unsafe_buffer_pointer()
                        for s in a_device.addressable_shards}
            solve = jax.jit(lambda a, b: linalg.cho_solve(a, b, mesh, overwrite_a=True),
                            donate_argnums=0)
            x, overwritten = solve(a_device, jax.device_put(b, rows))
            residual = solve_residual(a, x, b)
            in_place = all(pointers[s.device] == s.data.unsafe_buffer_pointer()
                           for s in overwritten.addressable_shards)
            return residual < 1e-13 and a_device.is_deleted() and in_place, (
                f"residual {residual:.2e}, input donated: {a_device.is_deleted()}, solved in "
                f"A's own buffers: {in_place}")

        self.run(f"jax g={g} ill-conditioned", ill_conditioned)
        self.run(f"jax g={g} not positive definite", not_spd)
        self.run(f"jax g={g} singular (lu_solve)", singular)
        self.run(f"jax g={g} two solves in one jit, called twice", twice_in_one_jit)
        self.run(f"jax g={g} donated input", donated)

    def jax_two_meshes(self, devices):
        meshes = [Mesh(np.array(devices[0:2]), ("x",)), Mesh(np.array(devices[2:4]), ("x",))]
        n = 512
        problems = [(random_spd(n, np.float64, self.rng, device=REFERENCE),
                     self.rng.standard_normal((n, 4))) for _ in meshes]
        errors = [None, None]

        def work(i):
            try:
                mesh = meshes[i]
                rows = NamedSharding(mesh, P("x", None))
                solve = jax.jit(lambda a, b: linalg.cho_solve(a, b, mesh))
                a, b = problems[i]
                worst = 0.0
                for _ in range(5):
                    worst = max(worst, solve_residual(
                        a, solve(jax.device_put(a, rows), jax.device_put(b, rows)), b))
                errors[i] = worst
            except Exception:
                errors[i] = traceback.format_exc(limit=4)

        def both():
            threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            ok = all(isinstance(e, float) and e < 1e-13 for e in errors)
            return ok, f"worst residuals {errors}"

        self.run("jax two 2-GPU meshes at once, 5 solves each", both)

    # --- PyTorch --------------------------------------------------------------------------
    def torch_routines(self, devices, n, dtype):
        g = len(devices)
        label = f"torch g={g} n={n} {np.dtype(dtype).name}"
        tdtype = TORCH_DTYPES[dtype]
        tol = tolerance(dtype, n)
        rows = n // g

        def shards(matrix):
            return [torch.from_numpy(matrix[p * rows:(p + 1) * rows]).to(f"cuda:{d}")
                    for p, d in enumerate(devices)]

        def solve():
            a = random_spd(n, dtype, self.rng, device=REFERENCE)
            b = self.rng.standard_normal((n, 2)).astype(dtype)
            solved = torch_linalg.cho_solve(shards(a), shards(b))
            x = torch.cat([s.cpu() for s in solved.x]).numpy()
            residual = solve_residual(a, x, b)
            return residual < tol, f"residual {residual:.2e} (tol {tol:.1e})"

        def inverse_in_place():
            a = random_spd(n, dtype, self.rng, device=REFERENCE)
            a_shards = shards(a)
            result, info = torch_linalg.cholesky_inverse(a_shards, overwrite_a=True)
            same = all(r.data_ptr() == s.data_ptr() for r, s in zip(result, a_shards))
            residual = inverse_residual(a, torch.cat([r.cpu() for r in result]).numpy())
            return info == 0 and same and residual < tol, (
                f"residual {residual:.2e} (tol {tol:.1e}), written over a: {same}")

        def poisoned_outputs():
            # DenseSolver directly, every output NaN before the call.
            solver = torch_linalg._solver(tuple(devices))
            a = random_spd(n, dtype, self.rng, device=REFERENCE)
            h = random_symmetric(n, dtype, self.rng)
            name = MESHLA_DTYPES[tdtype]
            streams = torch_linalg._streams(devices)
            none = [None] * g
            vectors = [torch.full((rows, n), float("nan"), dtype=tdtype, device=f"cuda:{d}")
                       for d in devices]
            real = torch.empty((), dtype=tdtype).real.dtype
            values = [torch.full((n,), float("nan"), dtype=real, device=f"cuda:{d}")
                      for d in devices]
            op = _meshla.SolverOp.eigh
            workspaces = torch_linalg._workspaces(solver, op, n, tdtype, 0, 0, False, devices)
            info, _, host_values, _ = solver.run(op, n, name, 0, 0, False, shards(h), none,
                                                 vectors, values, none, workspaces, streams)
            v = torch.cat([x.cpu() for x in vectors]).numpy()
            residual, orthogonality = eigen_residuals(h, values[-1].cpu().numpy(), v)
            inverse = [torch.full((rows, n), float("nan"), dtype=tdtype, device=f"cuda:{d}")
                       for d in devices]
            op = _meshla.SolverOp.cholesky_inverse
            workspaces = torch_linalg._workspaces(solver, op, n, tdtype, 0, 0, False, devices)
            inverse_info, _, _, _ = solver.run(op, n, name, 0, 0, False, shards(a), none,
                                               inverse, none, none, workspaces, streams)
            inverse_error = inverse_residual(a, torch.cat([x.cpu() for x in inverse]).numpy())
            ok = (info == 0 and inverse_info == 0 and residual < tol
                  and orthogonality < tol * n ** 0.5 and inverse_error < tol
                  and np.allclose(host_values, values[0].cpu().numpy()))
            return ok, (f"eigh residual {residual:.2e}, orthogonality {orthogonality:.2e}, "
                        f"inverse residual {inverse_error:.2e} (tol {tol:.1e})")

        def factorizations_agree():
            # The same solve with each factorization (meshla's is the default), outputs poisoned.
            solver = torch_linalg._solver(tuple(devices))
            a = random_spd(n, dtype, self.rng, device=REFERENCE)
            b = self.rng.standard_normal((n, 2)).astype(dtype)
            name = MESHLA_DTYPES[tdtype]
            op = _meshla.SolverOp.cholesky_solve
            none = [None] * g
            details, ok = [], True
            for cholesky in ("meshla", "cusolvermg"):
                x = [torch.full((rows, 2), float("nan"), dtype=tdtype, device=f"cuda:{d}")
                     for d in devices]
                workspaces = torch_linalg._workspaces(solver, op, n, tdtype, 2, 0, False,
                                                      devices, cholesky=cholesky)
                info, logdet, _, _ = solver.run(op, n, name, 2, 0, False, shards(a), shards(b),
                                                x, none, none, workspaces,
                                                torch_linalg._streams(devices), cholesky=cholesky)
                residual = solve_residual(a, torch.cat([v.cpu() for v in x]).numpy(), b)
                logdet_error = abs(logdet - log_determinant(a)) / n
                ok = ok and info == 0 and residual < tol and logdet_error < 100 * tol
                details.append(f"{cholesky}: residual {residual:.2e}, logdet error "
                               f"{logdet_error:.2e}")
            return ok, ", ".join(details) + f" (tol {tol:.1e})"

        def lu_poisoned():
            # DenseSolver directly, X NaN before the call; on one GPU in A's own buffer too.
            solver = torch_linalg._solver(tuple(devices))
            general = random_general(n, dtype, self.rng)
            b = self.rng.standard_normal((n, 3)).astype(dtype)
            op = _meshla.SolverOp.lu_solve
            details, ok = [], True
            for overwrite_a in (False, True) if g == 1 else (False,):
                x = [torch.full((rows, 3), float("nan"), dtype=tdtype, device=f"cuda:{d}")
                     for d in devices]
                workspaces = torch_linalg._workspaces(solver, op, n, tdtype, 3, 0, overwrite_a,
                                                      devices)
                info, _, _, _ = solver.run(op, n, MESHLA_DTYPES[tdtype], 3, 0, overwrite_a,
                                           shards(general), shards(b), x, [None] * g,
                                           [None] * g, workspaces, torch_linalg._streams(devices))
                residual = solve_residual(general, torch.cat([v.cpu() for v in x]).numpy(), b)
                ok = ok and info == 0 and residual < tol
                details.append(f"overwrite_a={overwrite_a}: residual {residual:.2e}")
            return ok, ", ".join(details) + f" (tol {tol:.1e})"

        def tall_blocks(square: bool):
            # The one-process torch forms: each block's QR on its GPU, R's gathered on the first;
            # A [4n, n/4], or square [n, n] (blocks with fewer rows than columns).
            m, k = (n, n) if square else (4 * n, max(n // 4, 1))
            tall_tol = tolerance(dtype, m)
            a = (random_conditioned(n, dtype, self.rng, device=REFERENCE) if square
                 else random_general(m, dtype, self.rng, columns=k))
            rhs = random_general(m, dtype, self.rng, columns=2)
            blocks = [torch.from_numpy(a[p * (m // g):(p + 1) * (m // g)]).to(f"cuda:{d}")
                      for p, d in enumerate(devices)]
            rhs_blocks = [torch.from_numpy(rhs[p * (m // g):(p + 1) * (m // g)]).to(f"cuda:{d}")
                          for p, d in enumerate(devices)]
            a64 = double(a)
            factors = torch_linalg.qr(blocks)
            q, r = double(torch.cat([x.cpu() for x in factors.q])), double(factors.r.cpu())
            factor_error = float(torch.linalg.norm(q @ r - a64) / torch.linalg.norm(a64))
            fit = torch_linalg.least_squares(blocks, rhs_blocks)
            x64 = double(fit.x.cpu())
            normal = float(torch.linalg.norm(a64.conj().T @ (a64 @ x64 - double(rhs))) / (
                spectral_norm(a64) ** 2 * float(torch.linalg.norm(x64))))
            decomposed = torch_linalg.svd(blocks)
            u = double(torch.cat([x.cpu() for x in decomposed.u]))
            s64 = double(decomposed.s.cpu()).real
            svd_error = float(torch.linalg.norm((u * s64) @ double(decomposed.vh.cpu()) - a64)
                              / torch.linalg.norm(a64))
            unitary = torch_linalg.polar(blocks)
            u_polar = double(torch.cat([x.cpu() for x in unitary.u]))
            polar_error = float(torch.linalg.norm(u_polar @ double(unitary.h.cpu()) - a64)
                                / torch.linalg.norm(a64))
            values = double(torch_linalg.svd(blocks, compute_uv=False).s.cpu()).real
            reference = torch.linalg.svdvals(a64, driver="gesvd")
            value_error = float(torch.linalg.norm(values - reference)
                                / torch.linalg.norm(reference))
            # Under autograd each block's Q is formed (threads per GPU, as without): the
            # gradient of Re <X, W> against float64 autograd through the normal equations.
            weights = torch.from_numpy(random_general(k, dtype, self.rng, columns=2))
            grads = [block.clone().requires_grad_() for block in blocks]
            (torch_linalg.least_squares(grads, rhs_blocks).x * weights.to(devices[0])).real \
                .sum().backward()
            a_ref = a64.clone().requires_grad_()
            x_ref = torch.linalg.solve(a_ref.conj().T @ a_ref, a_ref.conj().T @ double(rhs))
            (x_ref * double(weights)).real.sum().backward()
            grad = double(torch.cat([x.grad.cpu() for x in grads]))
            grad_error = float(torch.linalg.norm(grad - a_ref.grad) / torch.linalg.norm(a_ref.grad))
            worst = max(factor_error, normal, svd_error, polar_error, value_error, grad_error)
            return fit.info == 0 and worst < tall_tol, (
                f"[{m}, {k}]: A - QR {factor_error:.2e}, normal equations {normal:.2e}, "
                f"A - USVᴴ {svd_error:.2e}, A - UH {polar_error:.2e}, values alone against "
                f"svdvals {value_error:.2e}, least_squares' gradient {grad_error:.2e} "
                f"(tol {tall_tol:.1e})")

        def overwrite_padded():
            # A padded layout works in a workspace of its own: overwrite_a cannot be honoured.
            a = random_spd(n, dtype, self.rng, device=REFERENCE)
            b = self.rng.standard_normal((n, 1)).astype(dtype)
            tile = 5  # does not divide n/GPUs = 192
            try:
                torch_linalg.cho_solve(shards(a), shards(b), tile=tile, overwrite_a=True)
            except ValueError as error:
                return "overwrite_a needs n/GPUs" in str(error), str(error)
            return False, f"overwrite_a accepted with tile={tile}, which pads n/GPUs={rows}"

        self.run(f"{label} cho_solve", solve)
        self.run(f"{label} cho_solve, meshla's and cuSolverMg's factorizations",
                 factorizations_agree)
        self.run(f"{label} overwrite_a refused where the layout pads", overwrite_padded)
        self.run(f"{label} cholesky_inverse over a", inverse_in_place)
        self.run(f"{label} lu_solve on poisoned outputs", lu_poisoned)
        self.run(f"{label} qr, least_squares, svd and polar of row blocks (tall)",
                 functools.partial(tall_blocks, False))
        self.run(f"{label} qr, least_squares, svd and polar of row blocks (square)",
                 functools.partial(tall_blocks, True))
        self.run(f"{label} eigh and inverse on poisoned outputs", poisoned_outputs)

    def torch_large_inverse(self, devices):
        """The inverse past n = 2048, where cuSolverMg's potri went wrong on two GPUs (residual
        0.7 to 3.2, 2026-11-27): whole tiles, several tiles a GPU, padding, and both
        factorizations, on NaN-poisoned outputs."""
        g = len(devices)
        solver = torch_linalg._solver(tuple(devices))
        op = _meshla.SolverOp.cholesky_inverse
        none = [None] * g
        for n, tile, dtype in ((1536 * g, 0, np.float64), (1536 * g, 512, np.complex128),
                               (2500 * g, 256, np.float32)):
            tdtype = TORCH_DTYPES[dtype]
            rows, tol = n // g, tolerance(dtype, n)
            for cholesky in ("meshla", "cusolvermg"):
                def inverse():
                    a = random_spd(n, dtype, self.rng, device=REFERENCE)
                    shards = [torch.from_numpy(a[p * rows:(p + 1) * rows]).to(f"cuda:{d}")
                              for p, d in enumerate(devices)]
                    out = [torch.full((rows, n), float("nan"), dtype=tdtype, device=f"cuda:{d}")
                           for d in devices]
                    workspaces = torch_linalg._workspaces(solver, op, n, tdtype, 0, tile, False,
                                                          devices, cholesky=cholesky)
                    info, _, _, _ = solver.run(op, n, MESHLA_DTYPES[tdtype], 0, tile, False,
                                               shards, none, out, none, none, workspaces,
                                               torch_linalg._streams(devices), cholesky=cholesky)
                    inverse = torch.cat([x.cpu() for x in out]).numpy()
                    residual = inverse_residual(a, inverse)
                    inverse = double(inverse)
                    asymmetry = float(torch.linalg.norm(inverse - inverse.conj().T)
                                      / torch.linalg.norm(inverse))
                    return info == 0 and residual < tol and asymmetry < tol, (
                        f"residual {residual:.2e}, asymmetry {asymmetry:.2e} (tol {tol:.1e})")
                self.run(f"torch g={g} n={n} tile={tile or 'auto'} {np.dtype(dtype).name} "
                         f"cholesky_inverse, {cholesky}'s factorization", inverse)

    def torch_errors(self, devices):
        def wrong_device():
            a = torch.eye(2 * len(devices), dtype=torch.float64)
            shards = [s.to(f"cuda:{devices[0]}") for s in a.split(2)]
            try:
                torch_linalg.eigh(shards)
            except ValueError as error:
                return "a device appears twice" in str(error), str(error)
            return False, "no error for two shards on one GPU"

        self.run(f"torch g={len(devices)} shards on one GPU twice", wrong_device)


# The families of checks (``--families``): what tests/gpu/test_gpu_suite.py selects with -k.
FAMILIES = ("jax", "torch", "large", "special")


def main():
    parser = check_parser(__doc__, "solver", FAMILIES)
    parser.add_argument("--gpu-counts", type=int, nargs="+", default=[1, 2, 4],
                        help="mesh sizes to check (those above the visible GPUs are skipped)")
    args = parser.parse_args()
    report = Reporter(args.results, args.model, args.families)
    checks = Checks(report)
    run = report.family
    devices = jax.devices("gpu")
    print(f"{len(devices)} GPUs: {devices[0].device_kind}", flush=True)

    one = Mesh(np.array(devices[:1]), ("x",))
    run("special", checks.run, "jax g=1 n=1", lambda: (
        lambda x: (abs(float(x[0, 0]) - 0.5) < 1e-15, str(x)))(
        np.asarray(linalg.cho_solve(jnp.full((1, 1), 4.0), jnp.full((1, 1), 2.0), one))))
    for g in args.gpu_counts:
        if g > len(devices):
            print(f"g={g}: skipped, {len(devices)} GPUs", flush=True)
            continue
        mesh = Mesh(np.array(devices[:g]), ("x",))
        hardware = [d.local_hardware_id for d in devices[:g]]
        for dtype in DTYPES:
            run("jax", checks.jax_routines, mesh, 256 * g, dtype)         # one tile per GPU
            run("jax", checks.jax_routines, mesh, 256 * g, dtype, tile=64)  # four tiles per GPU
            run("jax", checks.jax_routines, mesh, 300 * g, dtype)         # padded
            run("jax", checks.jax_routines, mesh, 96 * g, dtype, tile=40)  # explicit tile, padded
            run("torch", checks.torch_routines, hardware, 192 * g, dtype)
        # More than 1024 rows a GPU: on several GPUs the eigensolver's own tile (768) is below
        # Cholesky's (1536), as cuSolverMg's syevd takes no tile over 1024 (one GPU: untiled).
        run("large", checks.jax_routines, mesh, 1536 * g, np.float64)
        run("large", checks.torch_large_inverse, hardware)
        run("special", checks.jax_special, mesh)
        if g > 1:
            run("special", checks.torch_errors, hardware)
    if len(devices) >= 4:
        run("special", checks.jax_two_meshes, devices)


if __name__ == "__main__":
    main()
