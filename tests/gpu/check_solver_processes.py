"""GPU checks of the dense solvers with one process per GPU (meshla.torch.linalg's *_shard forms),
one JSON line per check and rank.

  torchrun --nproc-per-node=N tests/gpu/check_solver_processes.py --results FILE

Each rank holds its row block of a fresh random matrix (the same seed on every rank), the group's
first rank solves over every GPU through CUDA IPC, and every rank checks the gathered answer
against numpy in float64: ||Ax - b|| / (||A|| ||x||) and log det, ||A A⁻¹ - I|| / (||A|| ||A⁻¹||),
||AV - VΛ|| / ||A|| and the eigenvalues, the LU solve of a general matrix, and the tall-skinny
QR, least squares, SVD and polar decomposition (A - QR, QᴴQ - I, the normal equations'
residual, A - USVᴴ and the singular values, A - UH). Also a
non-positive-definite matrix and a singular one (LinAlgError on every rank; NaN and info > 0
without the check), an inverse written over a's own buffers, and a rank whose outputs were
poisoned before the call in the memory the solver's outputs reuse.

The checks above run on engine="cusolvermg" (the first rank's cuSolverMg, or each rank alone).
cho_solve_shard also runs with engine="cusolvermp" (cuSOLVERMp over the ranks' GPUs, the
nvidia-cusolvermp-cu13 0.8 wheel installed beside meshla; without it those checks fail with the
reason): padded and unpadded tiles, overwrite_a, and a non-positive-definite matrix; so does
lu_solve_shard (padded and unpadded tiles, and a singular matrix); engine="auto" takes it.

With --own-gpu each rank sees only its own GPU (a CUDA_VISIBLE_DEVICES of its own, as some
launchers set it): the first rank cannot reach the others' GPUs, and every rank solves the
gathered A alone.
"""

import faulthandler
import os
import random
import sys

# Before CUDA starts (torch starts it on first use): this rank's GPU alone.
if "--own-gpu" in sys.argv:
    _visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    _local = int(os.environ["LOCAL_RANK"])
    os.environ["CUDA_VISIBLE_DEVICES"] = _visible.split(",")[_local] if _visible else str(_local)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from matrices import (TORCH_DTYPES, random_general, random_spd,  # noqa: E402
                      random_symmetric, tolerance)
from meshla.torch import linalg as torch_linalg  # noqa: E402
from reporting import Reporter, check_parser  # noqa: E402


def gathered(block):
    """Every rank's block, stacked in rank order, as float64/complex128 numpy."""
    blocks = [None] * dist.get_world_size()
    dist.all_gather_object(blocks, block.cpu())
    return np.concatenate([b.numpy() for b in blocks]).astype(np.complex128 if block.is_complex()
                                                              else np.float64)


def poison_cache(rows, cols, dtype, device):
    """Fills memory the caching allocator will hand to the next outputs with NaN."""
    junk = torch.full((rows, cols), float("nan"), dtype=dtype, device=device)
    del junk


# The families of checks (``--families``): what tests/gpu/test_gpu_suite.py selects with -k.
FAMILIES = ("routines", "special")


def check(reporter, family, name, rank, fn):
    def run():
        print(f"rank {rank}: {name}", flush=True)  # where a rank that dies (no record) stopped
        try:
            ok, detail = fn()
        except Exception as e:  # a check that raises is a failed check, not a crash
            ok, detail = False, f"{type(e).__name__}: {e}"
        reporter.record(name, rank, ok, detail)

    reporter.family(family, run)


def main():
    parser = check_parser(__doc__, "solver-processes", FAMILIES)
    parser.add_argument("--own-gpu", action="store_true",
                        help="each rank sees only its own GPU (read before CUDA starts)")
    args = parser.parse_args()
    faulthandler.enable()
    local_rank = 0 if args.own_gpu else int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo")  # the IPC handles travel over gloo
    rank, size = dist.get_rank(), dist.get_world_size()
    reporter = Reporter(args.results, args.model, args.families)
    seed = [random.randrange(2**30) if rank == 0 else None]
    dist.broadcast_object_list(seed, src=0)
    device = torch.device("cuda", local_rank)
    label = f"tp{size}"

    for case, (dtype, n) in enumerate([(np.float64, 1536), (np.float32, 1536),
                                       (np.complex128, 1000), (np.complex64, 1000)]):
        rng = np.random.default_rng(seed[0] + case)
        a = random_spd(n, dtype, rng)
        b = rng.standard_normal((n, 3)).astype(dtype)
        rows = slice(rank * n // size, (rank + 1) * n // size)
        torch_dtype = TORCH_DTYPES[dtype]
        a_block = torch.from_numpy(a[rows]).to(device)
        b_block = torch.from_numpy(b[rows]).to(device)
        tol = tolerance(dtype, n)
        a64 = a.astype(np.complex128 if np.iscomplexobj(a) else np.float64)
        dtype_name = str(torch_dtype)[6:]

        def solve():
            poison_cache(n // size, 3, torch_dtype, device)
            solved = torch_linalg.cho_solve_shard(a_block, b_block, engine="cusolvermg")
            x = gathered(solved.x)
            residual = np.linalg.norm(a64 @ x - b) / (np.linalg.norm(a64) * np.linalg.norm(x))
            logdet_error = abs(solved.logdet - np.linalg.slogdet(a64)[1]) / n
            ok = solved.info == 0 and residual < tol and logdet_error < 100 * tol
            return ok, f"residual {residual:.2e}, logdet error {logdet_error:.2e} (tol {tol:.1e})"

        def inverse():
            poison_cache(n // size, n, torch_dtype, device)
            out, info = torch_linalg.cholesky_inverse_shard(a_block)
            inv = gathered(out)
            residual = np.linalg.norm(a64 @ inv - np.eye(n)) / (
                np.linalg.norm(a64) * np.linalg.norm(inv))
            return info == 0 and residual < tol, f"residual {residual:.2e} (tol {tol:.1e})"

        def eigen():
            symmetric = random_symmetric(n, dtype, np.random.default_rng(seed[0] + 100 + case))
            block = torch.from_numpy(symmetric[rows]).to(device)
            s64 = symmetric.astype(a64.dtype)
            poison_cache(n // size, n, torch_dtype, device)
            result = torch_linalg.eigh_shard(block)
            v = gathered(result.eigenvectors)
            w = result.eigenvalues.cpu().double().numpy()
            scale = np.linalg.norm(s64)
            residual = np.linalg.norm(s64 @ v - v * w) / scale
            value_error = np.abs(w - np.linalg.eigvalsh(s64)).max() / scale
            ok = result.info == 0 and residual < tol and value_error < tol
            return ok, f"residual {residual:.2e}, eigenvalues {value_error:.2e} (tol {tol:.1e})"

        def lu():
            general = random_general(n, dtype, np.random.default_rng(seed[0] + 200 + case))
            block = torch.from_numpy(general[rows]).to(device)
            g64 = general.astype(a64.dtype)
            poison_cache(n // size, 3, torch_dtype, device)
            solved = torch_linalg.lu_solve_shard(block, b_block, engine="cusolvermg")
            x = gathered(solved.x)
            residual = np.linalg.norm(g64 @ x - b) / (np.linalg.norm(g64) * np.linalg.norm(x))
            return solved.info == 0 and residual < tol, f"residual {residual:.2e} (tol {tol:.1e})"

        def tall_qr():
            m, k = 4 * n, n // 8  # each rank's rows at least the columns
            tall_tol = tolerance(dtype, m)
            tall_a = random_general(m, dtype, np.random.default_rng(seed[0] + 300 + case),
                                    columns=k)
            block = torch.from_numpy(tall_a[rank * m // size:(rank + 1) * m // size]).to(device)
            rhs = torch.from_numpy(b.repeat(4, axis=0)[rank * m // size:(rank + 1) * m // size]
                                   ).to(device)
            factors = torch_linalg.qr_shard(block)
            fit = torch_linalg.least_squares_shard(block, rhs)
            q, r = gathered(factors.q), factors.r.cpu().numpy().astype(a64.dtype)
            t64 = tall_a.astype(a64.dtype)
            factor_error = np.linalg.norm(q @ r - t64) / np.linalg.norm(t64)
            orthogonality = np.linalg.norm(q.conj().T @ q - np.eye(k))
            x = fit.x.cpu().numpy().astype(a64.dtype)
            b64 = b.repeat(4, axis=0).astype(a64.dtype)
            normal = np.linalg.norm(t64.conj().T @ (t64 @ x - b64)) / (
                np.linalg.norm(t64, 2) ** 2 * np.linalg.norm(x))
            decomposed = torch_linalg.svd_shard(block)
            u = gathered(decomposed.u)
            s = decomposed.s.cpu().numpy().astype(np.float64)
            vh = decomposed.vh.cpu().numpy().astype(a64.dtype)
            svd_error = np.linalg.norm((u * s) @ vh - t64) / np.linalg.norm(t64)
            reference = np.linalg.svd(t64, compute_uv=False)
            value_error = np.abs(s - reference).max() / reference.max()
            factors = torch_linalg.polar_shard(block)
            u_polar, h_polar = gathered(factors.u), factors.h.cpu().numpy().astype(a64.dtype)
            polar_error = max(np.linalg.norm(u_polar @ h_polar - t64) / np.linalg.norm(t64),
                              np.linalg.norm(u_polar.conj().T @ u_polar - np.eye(k)) / k ** 0.5,
                              np.linalg.norm(h_polar - h_polar.conj().T) / np.linalg.norm(h_polar))
            ok = (fit.info == 0 and factor_error < tall_tol
                  and orthogonality < tall_tol * k ** 0.5 and normal < tall_tol
                  and svd_error < tall_tol and value_error < tall_tol and polar_error < tall_tol)
            return ok, (f"[{m}, {k}]: A - QR {factor_error:.2e}, orthogonality "
                        f"{orthogonality:.2e}, normal equations {normal:.2e}, A - USVᴴ "
                        f"{svd_error:.2e}, values {value_error:.2e}, polar (A - UH, UᴴU - I, "
                        f"H - Hᴴ) {polar_error:.2e} (tol {tall_tol:.1e})")

        def solve_on_cusolvermp():
            # cuSOLVERMp over the ranks' GPUs: meshla's tile, one that pads n/P (768 or 500 rows
            # a rank against 120-column tiles), and overwrite_a with two tiles a rank (no pad).
            details, ok = [], True
            for tile, overwrite_a in ((0, False), (120, False), (n // size // 2, True)):
                poison_cache(n // size, 3, torch_dtype, device)
                own = a_block.clone()
                solved = torch_linalg.cho_solve_shard(own, b_block, tile=tile,
                                                      overwrite_a=overwrite_a,
                                                      engine="cusolvermp")
                x = gathered(solved.x)
                residual = np.linalg.norm(a64 @ x - b) / (np.linalg.norm(a64) * np.linalg.norm(x))
                logdet_error = abs(solved.logdet - np.linalg.slogdet(a64)[1]) / n
                ok = ok and solved.info == 0 and residual < tol and logdet_error < 100 * tol
                details.append(f"tile={tile} overwrite_a={overwrite_a}: residual {residual:.2e}, "
                               f"logdet error {logdet_error:.2e}")
            return ok, "; ".join(details) + f" (tol {tol:.1e})"

        def lu_on_cusolvermp():
            # A's columns sent between the ranks first; a tile that pads n/P too.
            general = random_general(n, dtype, np.random.default_rng(seed[0] + 200 + case))
            g64 = general.astype(np.complex128 if np.iscomplexobj(general) else np.float64)
            block = torch.from_numpy(general[rows]).to(device)
            details, ok = [], True
            for tile in (0, 120):
                poison_cache(n // size, 3, torch_dtype, device)
                solved = torch_linalg.lu_solve_shard(block, b_block, tile=tile,
                                                     engine="cusolvermp")
                x = gathered(solved.x)
                residual = np.linalg.norm(g64 @ x - b) / (np.linalg.norm(g64) * np.linalg.norm(x))
                ok = ok and solved.info == 0 and residual < tol
                details.append(f"tile={tile}: residual {residual:.2e}")
            return ok, "; ".join(details) + f" (tol {tol:.1e})"

        for routine, fn in (("cho_solve_shard", solve),
                            ("lu_solve_shard engine=cusolvermp", lu_on_cusolvermp),
                            ("cho_solve_shard engine=cusolvermp", solve_on_cusolvermp),
                            ("cholesky_inverse_shard", inverse),
                            ("eigh_shard", eigen), ("lu_solve_shard", lu),
                            ("qr, least_squares, svd and polar _shard", tall_qr)):
            check(reporter, "routines", f"{label}/{routine}/{dtype_name}/n={n}", rank, fn)

    def not_spd():
        n = 512
        a = random_spd(n, np.float64, np.random.default_rng(seed[0] + 7))
        a[n - 3, n - 3] = -5.0
        block = torch.from_numpy(a[rank * n // size:(rank + 1) * n // size]).to(device)
        try:
            torch_linalg.cho_solve_shard(block, torch.ones(n // size, 1, dtype=torch.float64,
                                                           device=device), engine="cusolvermg")
            return False, "no error for a non-positive-definite matrix"
        except torch.linalg.LinAlgError as e:
            return "not positive definite" in str(e), f"raised: {e}"

    def not_spd_on_cusolvermp():
        n = 512
        a = random_spd(n, np.float64, np.random.default_rng(seed[0] + 10))
        a[n - 3, n - 3] = -5.0
        block = torch.from_numpy(a[rank * n // size:(rank + 1) * n // size]).to(device)
        ones = torch.ones(n // size, 1, dtype=torch.float64, device=device)
        try:
            torch_linalg.cho_solve_shard(block, ones, engine="cusolvermp")
            return False, "no error for a non-positive-definite matrix"
        except torch.linalg.LinAlgError as e:
            raised = "not positive definite" in str(e)
        failed = torch_linalg.cho_solve_shard(block, ones, check_errors=False, engine="cusolvermp")
        nan = bool(torch.isnan(failed.x).all()) and np.isnan(failed.logdet)
        return raised and failed.info > 0 and nan, f"raised; info {failed.info}, NaN: {nan}"

    def inverse_in_place():
        n = 1024
        a = random_spd(n, np.float64, np.random.default_rng(seed[0] + 8))
        block = torch.from_numpy(a[rank * n // size:(rank + 1) * n // size]).to(device)
        pointer = block.data_ptr()
        out, info = torch_linalg.cholesky_inverse_shard(block, overwrite_a=True)
        inv = gathered(out)
        residual = np.linalg.norm(a @ inv - np.eye(n)) / (np.linalg.norm(a) * np.linalg.norm(inv))
        tol = tolerance(np.float64, n)
        same = out.data_ptr() == pointer
        return info == 0 and same and residual < tol, (
            f"residual {residual:.2e} (tol {tol:.1e}), written over a: {same}")

    def singular(engine="cusolvermg"):
        n = 512
        a = random_general(n, np.float64, np.random.default_rng(seed[0] + 9), singular_column=7)
        block = torch.from_numpy(a[rank * n // size:(rank + 1) * n // size]).to(device)
        ones = torch.ones(n // size, 1, dtype=torch.float64, device=device)
        try:
            torch_linalg.lu_solve_shard(block, ones, engine=engine)
            return False, "no error for a singular matrix"
        except torch.linalg.LinAlgError as e:
            raised = "a is singular" in str(e)
        failed = torch_linalg.lu_solve_shard(block, ones, check_errors=False, engine=engine)
        nan = bool(torch.isnan(failed.x).all())
        return raised and failed.info > 0 and nan, f"raised; info {failed.info}, NaN: {nan}"

    def auto_is_cusolvermp():
        # Every rank sees CUDA tensors and has cuSOLVERMp: "auto" makes the group's cuSOLVERMp
        # solver (a new group's, so that no earlier call made it), and both solves are right.
        group = dist.new_group(list(range(size)))
        n = 512
        a = random_spd(n, np.float64, np.random.default_rng(seed[0] + 11))
        block = torch.from_numpy(a[rank * n // size:(rank + 1) * n // size]).to(device)
        ones = torch.ones(n // size, 1, dtype=torch.float64, device=device)
        x = gathered(torch_linalg.cho_solve_shard(block, ones, group).x)
        made = any(key[0] is group for key in torch_linalg._PROCESS_SOLVERS)
        lu_x = gathered(torch_linalg.lu_solve_shard(block, ones, group).x)
        residuals = [np.linalg.norm(a @ solution - 1.0) / (np.linalg.norm(a)
                                                           * np.linalg.norm(solution))
                     for solution in (x, lu_x)]
        tol = tolerance(np.float64, n)
        return made and max(residuals) < tol, (
            f"cuSOLVERMp solver made: {made}, residuals (cho, lu) {residuals[0]:.2e}, "
            f"{residuals[1]:.2e}")

    check(reporter, "special", f"{label}/cho_solve_shard/auto_is_cusolvermp", rank,
          auto_is_cusolvermp)
    check(reporter, "special", f"{label}/cho_solve_shard/not_spd", rank, not_spd)
    check(reporter, "special", f"{label}/cho_solve_shard/not_spd/cusolvermp", rank,
          not_spd_on_cusolvermp)
    check(reporter, "special", f"{label}/lu_solve_shard/singular", rank, singular)
    check(reporter, "special", f"{label}/lu_solve_shard/singular/cusolvermp", rank,
          lambda: singular("cusolvermp"))
    check(reporter, "special", f"{label}/cholesky_inverse_shard/overwrite_a", rank,
          inverse_in_place)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
