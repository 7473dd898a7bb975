"""GPU checks of meshla.jax.linalg with one process per GPU under jax.distributed (the script
launches them), one JSON line per check and process: every routine on a mesh whose devices span
processes (cho_solve and log det and lu_solve on cuSolverMg's gathered path, also on cuSOLVERMp
with engine="cusolvermp", which engine="auto" takes; cholesky_inverse, eigh, and the QR family on
a tall and on a square A), in float32, float64,
complex64 and complex128, against numpy in float64 on every process, from inputs every process
draws alike; a non-positive-definite and a singular matrix give NaN and info > 0 (on cuSOLVERMp
too).

  python tests/gpu/check_solver_jax_processes.py --processes 2 --results FILE
"""

import argparse
import os
import sys

from processes import add_arguments, launch
from reporting import Reporter, check_parser

FAMILIES = ("routines",)
parser = check_parser(__doc__, "solver-jax-processes", FAMILIES)
add_arguments(parser)
# The script's own dry run: host devices and gloo's collectives instead of GPUs.
parser.add_argument("--cpu", action="store_true", help=argparse.SUPPRESS)
args = parser.parse_args()
if args.processes and args.process_id is None:
    sys.exit(launch(__file__, args.processes))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

if args.cpu:
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")
if args.process_id is not None:
    jax.distributed.initialize(args.coordinator, num_processes=args.processes,
                               process_id=args.process_id,
                               local_device_ids=None if args.cpu else [args.process_id])

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from matrices import (DTYPES, random_conditioned, random_general, random_spd,  # noqa: E402
                      tolerance)
from meshla.jax import linalg  # noqa: E402


def put(value, mesh, spec):
    """``value`` (the same on every process) as a global array laid out by ``spec``."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda index: value[index])


def fetch(array) -> np.ndarray:
    """A global array's whole value on this process, in float64 (complex128)."""
    whole = (np.asarray(array.addressable_shards[0].data) if array.is_fully_replicated
             else np.asarray(multihost_utils.process_allgather(array, tiled=True)))
    return whole.astype(np.complex128 if np.iscomplexobj(whole) else np.float64)


def relative(residual, scale) -> float:
    return float(np.linalg.norm(residual) / scale)


class Checks:
    def __init__(self, report: Reporter, mesh: Mesh, rng):
        self.report, self.mesh, self.rng = report, mesh, rng
        self.rank = jax.process_index()

    def run(self, name, body):
        self.report.check(name, body, rank=self.rank)

    def rows(self, value):
        return put(value, self.mesh, P("x", None))

    def routines(self, dtype):
        mesh, g = self.mesh, self.mesh.shape["x"]
        n = 128 * g
        tol = tolerance(dtype, n)
        label = f"processes={g} n={n} {np.dtype(dtype).name}"
        a = random_spd(n, dtype, self.rng)
        b = random_general(n, dtype, self.rng, columns=3)
        a64, b64 = a.astype(np.complex128), b.astype(np.complex128)

        def cho_solve(engine="cusolvermg", tile=0):
            x, logdet, info = (fetch(v) for v in jax.jit(lambda a, b: linalg.cho_solve(
                a, b, mesh, tile=tile, return_logdet=True, return_info=True, engine=engine))(
                    self.rows(a), self.rows(b)))
            residual = relative(a64 @ x - b64, np.linalg.norm(a64, 2) * np.linalg.norm(x))
            logdet_error = abs(float(logdet.real) - np.linalg.slogdet(a64)[1])
            return int(info) == 0 and residual < tol and logdet_error < tol * n, (
                f"residual {residual:.2e}, log det error {logdet_error:.2e} (tol {tol:.1e})")

        def lu_solve(engine="cusolvermg", tile=0):
            general = random_general(n, dtype, self.rng)
            x, info = (fetch(v) for v in jax.jit(lambda a, b: linalg.lu_solve(
                a, b, mesh, tile=tile, return_info=True, engine=engine))(
                    self.rows(general), self.rows(b)))
            g64 = general.astype(np.complex128)
            residual = relative(g64 @ x - b64, np.linalg.norm(g64, 2) * np.linalg.norm(x))
            return int(info) == 0 and residual < tol, f"residual {residual:.2e}"

        def inverse_and_eigh():
            inverse, info = (fetch(v) for v in jax.jit(lambda a: linalg.cholesky_inverse(
                a, mesh, return_info=True))(self.rows(a)))
            residual = relative(a64 @ inverse - np.eye(n),
                                np.linalg.norm(a64, 2) * np.linalg.norm(inverse, 2))
            values, vectors, eig_info = (fetch(v) for v in jax.jit(lambda a: linalg.eigh(
                a, mesh, return_info=True))(self.rows(a)))
            values = values.real
            eig_residual = relative(a64 @ vectors - vectors * values, np.linalg.norm(a64, 2))
            orthogonality = relative(vectors.conj().T @ vectors - np.eye(n), 1.0)
            value_error = float(np.abs(values - np.linalg.eigvalsh(a64)).max()
                                / np.abs(values).max())
            ok = (int(info) == 0 and int(eig_info) == 0 and residual < tol
                  and eig_residual < tol and orthogonality < tol * n ** 0.5 and value_error < tol)
            return ok, (f"inverse residual {residual:.2e}, eigh residual {eig_residual:.2e}, "
                        f"orthogonality {orthogonality:.2e}, eigenvalues {value_error:.2e}")

        def failures(engine="cusolvermg"):
            # -A is not positive definite; a zero column makes A singular.
            x, info = jax.jit(lambda a, b: linalg.cho_solve(a, b, mesh, return_info=True,
                                                            engine=engine))(
                self.rows(-a), self.rows(b))
            singular = random_general(n, dtype, self.rng, singular_column=n // 3)
            y, lu_info = jax.jit(lambda a, b: linalg.lu_solve(a, b, mesh, return_info=True,
                                                              engine=engine))(
                self.rows(singular), self.rows(b))
            # Every fetch is a collective: all of them on every process, then the comparisons.
            info, x, lu_info, y = (fetch(v) for v in (info, x, lu_info, y))
            ok = int(info) > 0 and np.isnan(x).all() and int(lu_info) > 0 and np.isnan(y).all()
            return ok, f"cho_solve info {int(info)}, lu_solve info {int(lu_info)}"

        def qr_family(square: bool):
            m, k = (n, n) if square else (4 * n, n // 4)
            tall_tol = tolerance(dtype, m)
            matrix = (random_conditioned(n, dtype, self.rng) if square
                      else random_general(m, dtype, self.rng, columns=k))
            rhs = random_general(m, dtype, self.rng, columns=2)
            m64, r64 = matrix.astype(np.complex128), rhs.astype(np.complex128)
            scale = np.linalg.norm(m64)
            q, r = jax.jit(lambda a: linalg.qr(a, mesh))(self.rows(matrix))
            q, r = fetch(q), fetch(r)
            x = fetch(jax.jit(lambda a, b: linalg.least_squares(a, b, mesh))(
                self.rows(matrix), self.rows(rhs)))
            u, s, vh = (fetch(f) for f in jax.jit(lambda a: linalg.svd(a, mesh))(
                self.rows(matrix)))
            unitary, hermitian = (fetch(f) for f in jax.jit(lambda a: linalg.polar(a, mesh))(
                self.rows(matrix)))
            errors = {
                "A - QR": relative(q @ r - m64, scale),
                "QᴴQ - I": relative(q.conj().T @ q - np.eye(k), k ** 0.5),
                "normal equations": relative(m64.conj().T @ (m64 @ x - r64),
                                             np.linalg.norm(m64, 2) ** 2 * np.linalg.norm(x)),
                "A - USVᴴ": relative(u * s.real @ vh - m64, scale),
                "values": float(np.abs(s.real - np.linalg.svd(m64, compute_uv=False)).max()
                                / np.abs(s).max()),
                "A - UH": relative(unitary @ hermitian - m64, scale),
                "UᴴU - I": relative(unitary.conj().T @ unitary - np.eye(k), k ** 0.5),
            }
            return max(errors.values()) < tall_tol, (
                f"[{m}, {k}]: " + ", ".join(f"{name} {e:.2e}" for name, e in errors.items())
                + f" (tol {tall_tol:.1e})")

        def auto_engine():
            # "auto" takes cuSOLVERMp here (one GPU a process, installed): its custom calls.
            lowered = [jax.jit(lambda a, b: solve(a, b, mesh)).lower(
                self.rows(a), self.rows(b)).as_text() for solve in (linalg.cho_solve,
                                                                     linalg.lu_solve)]
            targets = ("meshla_process_cholesky_solve", "meshla_process_lu_solve")
            found = [target in text for target, text in zip(targets, lowered)]
            return all(found), f"{dict(zip(targets, found))} in the lowered calls"

        self.run(f"{label} cho_solve and log det", cho_solve)
        if not args.cpu:  # cuSOLVERMp over the processes' GPUs: its own tile, and 48 (padded)
            self.run(f"{label} engine=auto is cuSOLVERMp", auto_engine)
            self.run(f"{label} cho_solve and log det, engine=cusolvermp",
                     lambda: cho_solve("cusolvermp"))
            self.run(f"{label} cho_solve and log det, engine=cusolvermp, tile=48",
                     lambda: cho_solve("cusolvermp", 48))
            self.run(f"{label} lu_solve, engine=cusolvermp", lambda: lu_solve("cusolvermp"))
            self.run(f"{label} lu_solve, engine=cusolvermp, tile=48",
                     lambda: lu_solve("cusolvermp", 48))
            self.run(f"{label} not positive definite, singular: NaN and info > 0, "
                     "engine=cusolvermp", lambda: failures("cusolvermp"))
        self.run(f"{label} lu_solve", lu_solve)
        self.run(f"{label} cholesky_inverse and eigh", inverse_and_eigh)
        self.run(f"{label} not positive definite, singular: NaN and info > 0", failures)
        self.run(f"{label} qr, least_squares, svd and polar (tall)", lambda: qr_family(False))
        self.run(f"{label} qr, least_squares, svd and polar (square)", lambda: qr_family(True))


def main():
    report = Reporter(args.results, args.model, args.families)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    mesh = Mesh(np.array(jax.devices()), ("x",))
    print(f"process {jax.process_index()} of {jax.process_count()}: {mesh.devices.size} "
          f"devices ({jax.devices()[0].device_kind})", flush=True)
    checks = Checks(report, mesh, np.random.default_rng(seed))
    for dtype in DTYPES:
        report.family("routines", checks.routines, dtype)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
