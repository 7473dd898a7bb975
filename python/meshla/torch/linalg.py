"""Distributed dense solvers for PyTorch. Over the GPUs of one process, the matrix is a list of
row blocks, one per GPU (``a_shards[p]`` holds rows ``[p*n/P, (p+1)*n/P)`` of A on its device),
as :mod:`meshla.jax.linalg` takes a row-sharded array; cuSolverMg runs over all of them from the
calling thread (see ``include/meshla/dense_solver.hpp`` for the layout). With one process per GPU,
the ``*_shard`` forms take this rank's row block and a torch.distributed group: the Cholesky and
LU solves run on cuSOLVERMp over the ranks' GPUs where it is installed (``engine``); otherwise,
and for the other routines, the group's first rank drives every GPU through CUDA IPC, on copies
of the other ranks' blocks that it owns (so each GPU holds its blocks twice, and the first rank's
process opens a context on every GPU).

Calls wait for each device's current stream (their inputs) and return when the outputs are
written. A matrix that is not positive definite (a singular one for the LU solve, or an
eigensolver that does not converge) raises ``torch.linalg.LinAlgError``, or, with
``check_errors=False``, gives NaN outputs and ``info > 0``. On CPU tensors the functions run a
torch.linalg reference.
"""

from __future__ import annotations

import atexit
import pickle
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

import meshla
from meshla import _meshla
from meshla.torch import _library, _square
from meshla.torch._dtypes import DTYPES, dtype_of
from meshla._solver_engines import cusolvermp_installed, cusolvermp_takes, engine_misfit
from meshla.torch._group import _exchange_unique_id

__all__ = [
    "CholeskySolve",
    "Eigh",
    "LeastSquares",
    "LuSolve",
    "Polar",
    "QR",
    "SVD",
    "cho_solve",
    "cho_solve_shard",
    "cholesky_inverse",
    "cholesky_inverse_shard",
    "eigh",
    "eigh_shard",
    "least_squares",
    "least_squares_shard",
    "lu_solve",
    "lu_solve_shard",
    "polar",
    "polar_shard",
    "qr",
    "qr_shard",
    "svd",
    "svd_shard",
]



class CholeskySolve(NamedTuple):
    """What :func:`cho_solve` and :func:`cho_solve_shard` return: ``x``, the row blocks of X, one
    per shard, each shaped and placed like its block of B (from :func:`cho_solve_shard`, this
    rank's block alone, a tensor); ``logdet``, log det A as a Python float; ``info``, 0 on
    success and > 0 where A is not positive definite (with ``check_errors=False``; ``x`` and
    ``logdet`` are NaN then). A plain named tuple: making one checks nothing."""

    x: list[torch.Tensor]
    logdet: float
    info: int


class LuSolve(NamedTuple):
    """What :func:`lu_solve` and :func:`lu_solve_shard` return: ``x``, the row blocks of X, as
    :class:`CholeskySolve`'s; ``info``, 0 on success and > 0 where A is singular (a zero pivot;
    with ``check_errors=False``, ``x`` is NaN then). A plain named tuple: making one checks
    nothing."""

    x: list[torch.Tensor]
    info: int


class QR(NamedTuple):
    """What :func:`qr` and :func:`qr_shard` return: ``q``, the row blocks of Q, one per shard on
    its device (from :func:`qr_shard`, this rank's block alone, a tensor), orthonormal columns;
    ``r``, R [n, n], upper triangular, on the first shard's device (from :func:`qr_shard`, on
    every rank's): A = Q R. A plain named tuple: making one checks nothing."""

    q: list[torch.Tensor]
    r: torch.Tensor


class SVD(NamedTuple):
    """What :func:`svd` and :func:`svd_shard` return: ``u``, the row blocks of U as :class:`QR`'s
    ``q`` (None without ``compute_uv``); ``s``, the n singular values in descending order, and
    ``vh``, Vᴴ [n, n] (None without ``compute_uv``), on the first shard's device (from
    :func:`svd_shard`, on every rank's): A = U diag(s) Vᴴ. A plain named tuple: making one
    checks nothing."""

    u: list[torch.Tensor] | None
    s: torch.Tensor
    vh: torch.Tensor | None


class Polar(NamedTuple):
    """What :func:`polar` and :func:`polar_shard` return: ``u``, the row blocks of the unitary
    polar factor as :class:`QR`'s ``q``; ``h``, the Hermitian positive semi-definite factor
    [n, n] as :class:`QR`'s ``r``: A = U H. A plain named tuple: making one checks nothing."""

    u: list[torch.Tensor]
    h: torch.Tensor


class LeastSquares(NamedTuple):
    """What :func:`least_squares` and :func:`least_squares_shard` return: ``x``, X [n, nrhs] on
    the first shard's device (from :func:`least_squares_shard`, on every rank's); ``info``, 0,
    or i > 0 where R's i-th diagonal element is exactly zero (A rank-deficient, a zero column
    say, as LAPACK's gels reports; a numerically rank-deficient A is not detected); with
    ``check_errors=False`` X is NaN then. A plain named tuple: making one checks nothing."""

    x: torch.Tensor
    info: int


class Eigh(NamedTuple):
    """What :func:`eigh` and :func:`eigh_shard` return: ``eigenvalues``, all n in ascending order,
    of A's real dtype, on the first shard's device (from :func:`eigh_shard`, on this rank's);
    ``eigenvectors``, the row blocks of V, one per shard (from :func:`eigh_shard`, this rank's
    block alone), or None with ``eigvals_only``; ``info``, 0 on success and > 0 where the
    eigensolver did not converge (with ``check_errors=False``; the outputs are NaN then). A plain
    named tuple: making one checks nothing."""

    eigenvalues: torch.Tensor  # on the first shard's device
    eigenvectors: list[torch.Tensor] | None
    info: int


_solvers: dict[tuple[int, ...], _meshla.DenseSolver] = {}  # keyed by the CUDA ordinals, in order
_solvers_lock = threading.Lock()
# cuSolverMg's handles go before the interpreter tears down the modules (and torch's CUDA state).
atexit.register(_solvers.clear)


def _solver(devices: tuple[int, ...]) -> _meshla.DenseSolver:
    with _solvers_lock:
        if devices not in _solvers:
            _solvers[devices] = _meshla.DenseSolver(list(devices))
        return _solvers[devices]


def _check_shards(name: str, a_shards: Sequence[torch.Tensor]) -> tuple[int, torch.dtype]:
    if len(a_shards) == 0:
        raise ValueError(f"{name}: a_shards is empty")
    dtype = a_shards[0].dtype
    n = a_shards[0].shape[-1]
    for p, shard in enumerate(a_shards):
        if shard.ndim != 2 or shard.shape[1] != n or shard.dtype != dtype:
            raise ValueError(
                f"{name}: a_shards[{p}] has shape {tuple(shard.shape)} and dtype {shard.dtype}; "
                f"expected [n/P, {n}] {dtype} like a_shards[0] {tuple(a_shards[0].shape)}")
    if sum(shard.shape[0] for shard in a_shards) != n:
        raise ValueError(f"{name}: the row blocks hold "
                         f"{[shard.shape[0] for shard in a_shards]} rows of a {n} x {n} matrix")
    return n, dtype


def _check_call(op, a_shards, nrhs: int, tile: int, overwrite_a: bool) -> None:
    """The extension's checks of the call (dtype, right-hand sides, tile, overwrite_a), the same
    on CPU and CUDA shards."""
    n = a_shards[0].shape[-1]
    _meshla.solver_call(op, n, dtype_of(f"{op.name}: a", a_shards[0]), nrhs, len(a_shards), tile,
                        overwrite_a)


def _check_rhs(name: str, a_shards: Sequence[torch.Tensor],
               b_shards: Sequence[torch.Tensor]) -> int:
    """Checks B's row blocks against A's; returns nrhs."""
    if len(b_shards) != len(a_shards):
        raise ValueError(f"{name}: {len(b_shards)} b_shards for {len(a_shards)} a_shards")
    for p, (a, b) in enumerate(zip(a_shards, b_shards)):
        _check_rhs_block(name, f"b_shards[{p}]", a, b)
        if b.shape[1] != b_shards[0].shape[1]:
            raise ValueError(f"{name}: b_shards[{p}] has {b.shape[1]} columns, b_shards[0] "
                             f"{b_shards[0].shape[1]}: every block has the same right-hand sides")
    return b_shards[0].shape[1]


def _check_rhs_block(name: str, label: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """One block of B against A's: 2-D with A's rows and dtype (the extension's words, as
    meshla.jax's), on A's device."""
    a_dtype = dtype_of(f"{name}: a", a)
    _meshla.rhs_block(name, label, list(b.shape), dtype_of(f"{name}: {label}", b), a.shape[0],
                      a_dtype)
    if b.device != a.device:
        raise ValueError(f"{name}: {label} is on {b.device}; expected a's device, {a.device}")


def _on_cpu(shards: Sequence[torch.Tensor]) -> bool:
    return all(shard.device.type == "cpu" for shard in shards)


def _devices(name: str, shards: Sequence[torch.Tensor]) -> tuple[int, ...]:
    if not all(shard.device.type == "cuda" for shard in shards):
        raise ValueError(f"{name}: shards are on {[str(s.device) for s in shards]}; all on CUDA "
                         "devices (one each) or all on the CPU")
    return tuple(shard.device.index for shard in shards)


def _workspaces(solver, op, n, dtype, nrhs, tile, overwrite_a, devices, cholesky="meshla"):
    return [
        _library.workspace(solver.workspace_bytes(op, n, DTYPES[dtype], nrhs, tile, overwrite_a,
                                                  p, cholesky=cholesky), device)
        for p, device in enumerate(devices)
    ]


def _streams(devices) -> list[int]:
    return [torch.cuda.current_stream(device).cuda_stream for device in devices]


def _raise_if_failed(name: str, info: int, check_errors: bool, what: str) -> None:
    if info > 0 and check_errors:
        raise torch.linalg.LinAlgError(f"{name}: {what} (info={info}, in the solver's row "
                                       "order); pass check_errors=False to get NaN outputs "
                                       "instead")


def cho_solve(a_shards: Sequence[torch.Tensor], b_shards: Sequence[torch.Tensor], *,
              tile: int = 0, overwrite_a: bool = False,
              check_errors: bool = True) -> CholeskySolve:
    """Row blocks of X = A⁻¹ B (B's row blocks [n/P, nrhs], nrhs <= 256) and log det A.
    ``overwrite_a`` lets the solver factor in A's own buffers (they hold garbage afterwards).

    ``a_shards`` are the P row blocks [n/P, n] of a symmetric (Hermitian) positive-definite A,
    float32, float64, complex64 or complex128, one per CUDA device (or all on the CPU), n
    divisible by P; ``b_shards`` the row blocks of B, each on its A block's device, of its rows
    and dtype. ``tile`` is the block-cyclic tile (0: meshla's choice). Returns a
    :class:`CholeskySolve`.

    Raises ``ValueError`` for an empty ``a_shards``, blocks that are not 2-D, differ in dtype or
    width, do not make up n rows or do not divide n evenly, B blocks that do not match A's, an
    unsupported dtype, nrhs outside 1 to 256, a negative ``tile``, ``overwrite_a`` where n/P is
    not a multiple of the tile, shards on CPU and CUDA together, two on one GPU or more than 16;
    ``NotImplementedError`` where the GPUs cannot access each other's memory; ``RuntimeError``
    for a CUDA or cuSOLVER failure; ``torch.linalg.LinAlgError`` where A is not positive
    definite, unless ``check_errors=False`` (then X and log det A are NaN and info > 0)."""
    n, dtype = _check_shards("cho_solve", a_shards)
    nrhs = _check_rhs("cho_solve", a_shards, b_shards)
    _check_call(_meshla.SolverOp.cholesky_solve, a_shards, nrhs, tile, overwrite_a)
    if _on_cpu(a_shards):
        factor, status = torch.linalg.cholesky_ex(torch.cat(list(a_shards)))
        info = int(status)
        _raise_if_failed("cho_solve", info, check_errors, "a is not positive definite")
        x = torch.cholesky_solve(torch.cat(list(b_shards)), factor)
        logdet = float(2.0 * torch.log(torch.diagonal(factor).real).sum())
        if info > 0:
            x.fill_(float("nan"))
            logdet = float("nan")
        return CholeskySolve(list(x.split([a.shape[0] for a in a_shards])), logdet, info)
    devices = _devices("cho_solve", a_shards)
    x = [torch.empty_like(b, memory_format=torch.contiguous_format) for b in b_shards]
    info, logdet = _solve_cuda(_meshla.SolverOp.cholesky_solve, devices, n, dtype, nrhs,
                               a_shards, b_shards, x, tile, overwrite_a)
    _raise_if_failed("cho_solve", info, check_errors, "a is not positive definite")
    return CholeskySolve(x, logdet, info)


def _solve_cuda(op, devices, n, dtype, nrhs, a_shards, b_shards, x, tile, overwrite_a):
    """One right-hand-side solve (cho_solve, lu_solve) on the DenseSolver: (info, logdet)."""
    solver = _solver(devices)
    none = [None] * len(devices)
    info, logdet, _, _ = solver.run(
        op, n, DTYPES[dtype], nrhs, tile, overwrite_a, [a.contiguous() for a in a_shards],
        [b.contiguous() for b in b_shards], x, none, none,
        _workspaces(solver, op, n, dtype, nrhs, tile, overwrite_a, devices), _streams(devices))
    return info, logdet


def lu_solve(a_shards: Sequence[torch.Tensor], b_shards: Sequence[torch.Tensor], *,
             tile: int = 0, overwrite_a: bool = False, check_errors: bool = True) -> LuSolve:
    """Row blocks of X = A⁻¹ B for a general A (LU with partial pivoting, as
    ``torch.linalg.solve``); B's row blocks [n/P, nrhs], nrhs <= 256.

    ``a_shards``, ``b_shards``, ``tile`` and ``check_errors`` as in :func:`cho_solve`, A need not
    be symmetric. ``overwrite_a`` lets the solver factor in A's buffer on one GPU; on several it
    needs A's columns, which it gathers from every GPU into a workspace of its own (A twice in
    memory). Returns a :class:`LuSolve`. Raises as :func:`cho_solve` does (``ValueError``, a
    ``tile`` above 512 on several GPUs included; ``NotImplementedError`` for ``overwrite_a`` on
    several GPUs among them), and
    ``torch.linalg.LinAlgError`` where A is singular, unless ``check_errors=False`` (then X is
    NaN and info > 0)."""
    n, dtype = _check_shards("lu_solve", a_shards)
    nrhs = _check_rhs("lu_solve", a_shards, b_shards)
    _check_call(_meshla.SolverOp.lu_solve, a_shards, nrhs, tile, overwrite_a)
    if _on_cpu(a_shards):
        factors, pivots, status = torch.linalg.lu_factor_ex(torch.cat(list(a_shards)))
        info = int(status)
        _raise_if_failed("lu_solve", info, check_errors, "a is singular")
        x = torch.linalg.lu_solve(factors, pivots, torch.cat(list(b_shards)))
        if info > 0:
            x.fill_(float("nan"))
        return LuSolve(list(x.split([a.shape[0] for a in a_shards])), info)
    devices = _devices("lu_solve", a_shards)
    x = [torch.empty_like(b, memory_format=torch.contiguous_format) for b in b_shards]
    info, _ = _solve_cuda(_meshla.SolverOp.lu_solve, devices, n, dtype, nrhs, a_shards,
                          b_shards, x, tile, overwrite_a)
    _raise_if_failed("lu_solve", info, check_errors, "a is singular")
    return LuSolve(x, info)


def _check_tall_shards(name: str, a_shards: Sequence[torch.Tensor],
                       b_shards: Sequence[torch.Tensor] | None = None) -> tuple[int, int, int]:
    """The blocks' shapes (2-D, one shape and dtype: equal rows), B's blocks against them, then
    the extension's rules of a tall-skinny QR call (as meshla.jax's). Returns (m, n, nrhs)."""
    if len(a_shards) == 0:
        raise ValueError(f"{name}: a_shards is empty")
    first = a_shards[0]
    for p, shard in enumerate(a_shards):
        if shard.ndim != 2 or shard.shape != first.shape or shard.dtype != first.dtype:
            raise ValueError(
                f"{name}: a_shards[{p}] has shape {tuple(shard.shape)} and dtype {shard.dtype}; "
                f"expected equal row blocks [m/P, n] of one dtype (a_shards[0] is "
                f"{tuple(first.shape)} {first.dtype})")
    nrhs = 0 if b_shards is None else _check_rhs(name, a_shards, b_shards)
    m, n = first.shape[0] * len(a_shards), first.shape[1]
    _meshla.tall_qr_call(name, m, n, dtype_of(f"{name}: a", first), len(a_shards), nrhs)
    return m, n, nrhs


def _per_block(work, *blocks: Sequence[torch.Tensor]) -> list:
    """``[work(*args) for args in zip(*blocks)]``, each call on its first argument's device and
    that device's current stream, from a thread of its own where the blocks lie on several GPUs:
    torch's geqrf returns to the host only when its GPU is done with it (425 of its 454 ms at
    [262144, 4096] float64, NOTES 100), so from one thread the GPUs would take turns."""
    calls = list(zip(*blocks))
    devices = [args[0].device for args in calls]
    # Threads do not inherit functorch transforms, torch function and dispatch modes or saved
    # tensor hooks (thread-local): where any is on, or a block is not a plain CUDA tensor, one
    # thread runs them all.
    if (len(set(devices)) == 1 or _library.needs_the_op([t for args in calls for t in args])
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None):
        return [work(*args) for args in calls]
    grad_enabled = torch.is_grad_enabled()  # thread-local, as the current device and stream
    streams = [torch.cuda.current_stream(device) for device in devices]

    def on_its_device(args, stream):
        with torch.cuda.device(stream.device), torch.cuda.stream(stream), \
                torch.set_grad_enabled(grad_enabled):
            return work(*args)

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(on_its_device, calls, streams))


def _blocks_factors(a_shards: Sequence[torch.Tensor]):
    """(each block's Q, each block's k = min(rows, n) rows of the stacked R factors' Q on its
    device, R) of the row blocks. One block's QR is A's, and its second factor None: the second
    stage would cost 2 m n² for nothing (NOTES 87)."""
    local = _per_block(torch.linalg.qr, a_shards)
    q_blocks = [q_block for q_block, _ in local]
    if len(local) == 1:
        return q_blocks, [None], local[0][1]
    q_stacked, r = _stacked_qr([r_block for _, r_block in local])
    k = local[0][1].shape[0]  # each block's R is [min(rows, n), n]
    return q_blocks, [q_stacked[p * k:(p + 1) * k].to(q_block.device)
                      for p, q_block in enumerate(q_blocks)], r


def _q_times(q_block: torch.Tensor, second: torch.Tensor | None,
             right: torch.Tensor | None = None) -> torch.Tensor:
    """A block's rows of Q (times ``right``, n x n, moved to the block's device): Q_block
    (second (right)), the factors that are None left out."""
    if right is not None:
        right = right.to(q_block.device)
    if second is not None:
        right = second if right is None else second @ right
    return q_block if right is None else q_block @ right


def _stacked_qr(r_blocks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The QR of the blocks' R factors stacked, on the first one's device."""
    device = r_blocks[0].device
    return torch.linalg.qr(torch.cat([r.to(device) for r in r_blocks]))


def _reflected(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, the first n rows of Qᴴ B) of A's Householder QR, Q applied by its reflectors and never
    formed: forming it (orgqr) costs about the QR's own time again (NOTES 97)."""
    reflectors, tau = torch.geqrf(a)
    n = a.shape[1]
    qtb = torch.ormqr(reflectors, tau, b, left=True, transpose=True)
    return reflectors[:n].triu(), qtb[:n]


def _solved_by_r(name: str, r: torch.Tensor, qtb: torch.Tensor,
                 check_errors: bool) -> LeastSquares:
    """X = R⁻¹ Qᴴ B; info names R's first zero diagonal element (NaN X)."""
    zero = (torch.diagonal(r) == 0).nonzero()
    info = int(zero[0, 0]) + 1 if len(zero) else 0
    if info and check_errors:
        raise torch.linalg.LinAlgError(
            f"{name}: a does not have full column rank (R's diagonal element {info} is zero); "
            "pass check_errors=False to get NaN instead")
    x = torch.linalg.solve_triangular(r, qtb, upper=True)
    return LeastSquares(torch.full_like(x, float("nan")) if info else x, info)


def qr(a_shards: Sequence[torch.Tensor]) -> QR:
    """The reduced QR of a tall or square A (m >= n) given as equal row blocks ([m/P, n] each,
    one per device or all on the CPU), as ``torch.linalg.qr``'s (signs may differ): A = Q R.
    Where a block's rows are fewer than A's columns the stacked R factors are as large as A and
    the first device runs one QR of that size.

    Returns a :class:`QR`. Raises ``ValueError`` for an empty ``a_shards``, blocks that differ in
    shape or dtype, or an unsupported dtype, and ``NotImplementedError`` for a wide A (m < n)."""
    _check_tall_shards("qr", a_shards)
    q_blocks, seconds, r = _blocks_factors(a_shards)
    return QR([_q_times(q, second) for q, second in zip(q_blocks, seconds)], r)


def svd(a_shards: Sequence[torch.Tensor], *, compute_uv: bool = True) -> SVD:
    """The thin SVD of a tall A given as in :func:`qr`, as ``torch.linalg.svd(a,
    full_matrices=False)``: from the tall-skinny QR, A = Q R and R = U_R diag(s) Vᴴ (R's SVD by
    QDWH, see meshla.torch._square), U = Q U_R. ``compute_uv=False`` gives the values alone (no Q
    is formed). Returns an :class:`SVD`. Raises as :func:`qr` does."""
    _check_tall_shards("svd", a_shards)
    if not compute_uv:
        _, r = _stacked_qr([r_block for _, r_block in
                            _per_block(lambda block: torch.linalg.qr(block, mode="r"), a_shards)])
        return SVD(None, _square.svd(r, compute_uv=False), None)
    q_blocks, seconds, r = _blocks_factors(a_shards)
    u_r, s, vh = _square.svd(r)
    return SVD([_q_times(q, second, u_r) for q, second in zip(q_blocks, seconds)], s, vh)


def polar(a_shards: Sequence[torch.Tensor]) -> Polar:
    """The polar decomposition A = U H of a tall A given as in :func:`qr` (as
    ``scipy.linalg.polar``): U = Q U_R and H from the tall-skinny QR, A = Q R, and R's polar
    decomposition R = U_R H (by QDWH, see meshla.torch._square). Returns a :class:`Polar`. Raises
    as :func:`qr` does."""
    _check_tall_shards("polar", a_shards)
    q_blocks, seconds, r = _blocks_factors(a_shards)
    u_r, h = _square.polar(r)
    return Polar([_q_times(q, second, u_r) for q, second in zip(q_blocks, seconds)], h)


def least_squares(a_shards: Sequence[torch.Tensor], b_shards: Sequence[torch.Tensor], *,
                  check_errors: bool = True) -> LeastSquares:
    """X minimizing ||A X - B|| (as ``torch.linalg.lstsq``'s solution) for a tall A of full
    column rank given as in :func:`qr`, and B's row blocks ([m/P, nrhs], each on its A block's
    device). X = R⁻¹ Qᴴ B from the tall-skinny QR, Qᴴ B applied by Householder reflectors, no Q
    formed (under autograd each block's Q is formed: torch does not differentiate geqrf).
    Returns a :class:`LeastSquares`. Raises as :func:`qr` does, ``ValueError`` for B blocks that
    do not match A's, and ``torch.linalg.LinAlgError`` where R has a zero diagonal element (A
    rank-deficient), unless ``check_errors=False`` (X NaN, info > 0)."""
    _check_tall_shards("least_squares", a_shards, b_shards)
    device = a_shards[0].device
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*a_shards, *b_shards)):
        # torch has no derivative for geqrf: under autograd each block's Q is formed
        q_blocks, seconds, r = _blocks_factors(a_shards)
        parts = [q.mH @ b if second is None else second.mH @ (q.mH @ b)
                 for q, second, b in zip(q_blocks, seconds, b_shards)]
        qtb = sum(part.to(device) for part in parts)  # (Q_p second_p)ᴴ B_p summed
        return _solved_by_r("least_squares", r, qtb, check_errors)
    blocks = _per_block(_reflected, a_shards, b_shards)
    r, qtb = _reflected(*(torch.cat([part.to(device) for part in parts])
                          for parts in zip(*blocks)))
    return _solved_by_r("least_squares", r, qtb, check_errors)


def cholesky_inverse(a_shards: Sequence[torch.Tensor], *, tile: int = 0,
                     overwrite_a: bool = False,
                     check_errors: bool = True) -> tuple[list[torch.Tensor], int]:
    """Row blocks of A⁻¹ for a positive-definite A, and info. With ``overwrite_a`` the inverse
    is written over ``a_shards``, and those are returned (on CPU tensors too).

    ``a_shards``, ``tile`` and ``check_errors`` as in :func:`cho_solve`. Returns the tuple (row
    blocks of A⁻¹, each like its block of A; info, 0 on success and > 0 where A is not positive
    definite). Raises as :func:`cho_solve` does (``ValueError``, ``NotImplementedError``,
    ``RuntimeError``, ``torch.linalg.LinAlgError`` unless ``check_errors=False``, which gives NaN
    blocks), and also ``ValueError`` for ``overwrite_a`` with non-contiguous CUDA shards and
    ``NotImplementedError`` for n above 46340 (padding to the tile included): the inverse runs
    cusolverDn's potri, whose sizes are 32-bit."""
    n, dtype = _check_shards("cholesky_inverse", a_shards)
    _check_call(_meshla.SolverOp.cholesky_inverse, a_shards, 0, tile, overwrite_a)
    if _on_cpu(a_shards):
        factor, status = torch.linalg.cholesky_ex(torch.cat(list(a_shards)))
        info = int(status)
        _raise_if_failed("cholesky_inverse", info, check_errors, "a is not positive definite")
        inverse = torch.cholesky_inverse(factor)
        if info > 0:
            inverse.fill_(float("nan"))
        blocks = list(inverse.split([a.shape[0] for a in a_shards]))
        if overwrite_a:  # as the CUDA path: the inverse in A's own blocks
            for a, block in zip(a_shards, blocks):
                a.copy_(block)
            blocks = list(a_shards)
        return blocks, info
    devices = _devices("cholesky_inverse", a_shards)
    if overwrite_a and not all(a.is_contiguous() for a in a_shards):
        raise ValueError("cholesky_inverse: overwrite_a needs contiguous a_shards")
    out = list(a_shards) if overwrite_a else [
        torch.empty_like(a, memory_format=torch.contiguous_format) for a in a_shards]
    info = _cholesky_inverse_cuda(devices, n, dtype, a_shards, out, tile, overwrite_a)
    _raise_if_failed("cholesky_inverse", info, check_errors, "a is not positive definite")
    return out, info


def _cholesky_inverse_cuda(devices, n, dtype, a_shards, out, tile, overwrite_a):
    solver = _solver(devices)
    op = _meshla.SolverOp.cholesky_inverse
    none = [None] * len(devices)
    info, _, _, _ = solver.run(
        op, n, DTYPES[dtype], 0, tile, overwrite_a, [a.contiguous() for a in a_shards], none,
        out, none, none, _workspaces(solver, op, n, dtype, 0, tile, overwrite_a, devices),
        _streams(devices))
    return info


def eigh(a_shards: Sequence[torch.Tensor], *, eigvals_only: bool = False, tile: int = 0,
         overwrite_a: bool = False, check_errors: bool = True) -> Eigh:
    """Eigenvalues (ascending) and row blocks of the eigenvectors (columns of V, A V = V diag(w))
    of a symmetric (Hermitian) A, as ``torch.linalg.eigh``.

    ``a_shards``, ``tile``, ``overwrite_a`` and ``check_errors`` as in :func:`cho_solve`; with
    ``eigvals_only`` only the eigenvalues are computed. Returns an :class:`Eigh`. Raises as
    :func:`cho_solve` does (``ValueError``, a ``tile`` above 1024 on several GPUs included;
    ``NotImplementedError``; ``RuntimeError``), and ``torch.linalg.LinAlgError`` where the
    eigensolver does not converge, unless ``check_errors=False`` (then NaN outputs and info > 0).
    On CPU tensors the reference is ``torch.linalg.eigh``: info is 0 and a failure raises
    torch's own error, whatever ``check_errors``."""
    n, dtype = _check_shards("eigh", a_shards)
    _check_call(_meshla.SolverOp.eigvalsh if eigvals_only else _meshla.SolverOp.eigh, a_shards,
                0, tile, overwrite_a)
    real = torch.empty((), dtype=dtype).real.dtype
    if _on_cpu(a_shards):
        a_full = torch.cat(list(a_shards))
        if eigvals_only:
            return Eigh(torch.linalg.eigvalsh(a_full), None, 0)
        values, vectors = torch.linalg.eigh(a_full)
        return Eigh(values, list(vectors.split([a.shape[0] for a in a_shards])), 0)
    devices = _devices("eigh", a_shards)
    vectors = None if eigvals_only else [
        torch.empty_like(a, memory_format=torch.contiguous_format) for a in a_shards]
    values = torch.empty(n, dtype=real, device=devices[0])
    info = _eigh_cuda(devices, n, dtype, a_shards, vectors, values, tile, overwrite_a)
    _raise_if_failed("eigh", info, check_errors, "the eigensolver did not converge")
    return Eigh(values, vectors, info)


def _eigh_cuda(devices, n, dtype, a_shards, vectors, values, tile, overwrite_a):
    solver = _solver(devices)
    op = _meshla.SolverOp.eigvalsh if vectors is None else _meshla.SolverOp.eigh
    none = [None] * len(devices)
    info, _, _, _ = solver.run(
        op, n, DTYPES[dtype], 0, tile, overwrite_a, [a.contiguous() for a in a_shards], none,
        none if vectors is None else vectors, [values] + none[1:], none,
        _workspaces(solver, op, n, dtype, 0, tile, overwrite_a, devices), _streams(devices))
    return info


# One process per GPU, cuSolverMg's way (engine="cusolvermg", and "auto" where cuSOLVERMp does
# not run). Every rank hands its row blocks (and the buffers for its outputs) to the group's first
# rank through CUDA IPC; that process drives cuSolverMg over every rank's GPU with the same solver
# as above. The handles travel over the torch.distributed group (any backend but MPI, whose
# key-value store does nothing), the outcome through the default store; their timeouts bound
# every wait.

_ERRORS = {cls.__name__: cls for cls in
           (ValueError, NotImplementedError, RuntimeError, torch.linalg.LinAlgError)}


def _on_first_rank(name, group, tensors, work):
    """Runs ``work(parts)`` on the group's first rank, where ``parts[r]`` is rank r's
    ``tensors`` (CUDA tensors or None) opened through CUDA IPC, and returns its (picklable)
    result on every rank. An exception on the first rank is raised on every rank."""
    group = group if group is not None else dist.group.WORLD
    device = next(t.device for t in tensors if t is not None)
    # The exporter's pending writes must be done before another process reads the memory.
    torch.cuda.current_stream(device).synchronize()
    # The first rank uses its own tensors as they are: a handle it made for them would never be
    # opened, and torch warns at exit of shared tensors never released.
    first = dist.get_rank(group) == 0
    mine = None if first else [None if t is None else reduce_tensor(t) for t in tensors]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    outcome = None
    if first:
        try:
            imported = [[None if r is None else r[0](*r[1]) for r in reduced]
                        for reduced in everyone[1:]]
            # The solver's layout kernels read their peers' memory, and memory opened through
            # CUDA IPC is not readable from the other GPUs (a kernel on GPU 0 reading GPU 1's
            # imported rows faulted, with peer access on). So the solver works on copies this
            # process owns, on each rank's GPU, and the results are copied back: one more copy
            # of each rank's blocks on its GPU.
            staged = [[None if t is None else t.clone() for t in ts] for ts in imported]
            outcome = ("ok", work([list(tensors)] + staged))
            for ts, copies in zip(imported, staged):
                for t, copy in zip(ts, copies):
                    if t is not None:
                        t.copy_(copy)
                        torch.cuda.current_stream(t.device).synchronize()
            del imported, staged  # close the imported memory before the owners may free it
        except Exception as error:  # reaches every rank below
            outcome = ("error", type(error).__name__, str(error))
    outcome = _from_first_rank(group, outcome)
    if outcome[0] == "error":
        raise _ERRORS.get(outcome[1], RuntimeError)(outcome[2])
    return outcome[1]


# Per group (its name, the same on every rank), how many outcomes its first rank has handed out:
# alike on every rank, since every rank makes the same calls on a group in the same order.
_FIRST_RANK_OUTCOMES: dict = {}
_FIRST_RANK_LOCK = threading.Lock()


def _from_first_rank(group, outcome):
    """The group's first rank's (picklable) ``outcome`` on every rank, through torch.distributed's
    default key-value store: the other ranks wait for it on the host, up to the store's timeout.
    A collective (an NCCL group's broadcast) would wait in a kernel spinning on their GPUs while
    the first rank's solver works there, and two processes' contexts take turns on a GPU
    (bench/NOTES.md 113)."""
    size = dist.get_world_size(group)
    if size == 1:
        return outcome
    with _FIRST_RANK_LOCK:
        count = _FIRST_RANK_OUTCOMES[group.group_name] = (
            _FIRST_RANK_OUTCOMES.get(group.group_name, 0) + 1)
    key = f"meshla/first_rank/{group.group_name}/{count}"
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank(group) == 0:
        store.set(key, pickle.dumps(outcome))
        return outcome
    outcome = pickle.loads(store.get(key))
    if store.add(f"{key}/read", 1) == size - 1:  # the last reader tidies up
        store.delete_key(key)
        store.delete_key(f"{key}/read")
    return outcome


def _agreed_call(name: str, op, group, a: torch.Tensor, b: torch.Tensor | None, tile: int,
                 overwrite_a: bool, misfit: str | None = None, engine: str = "auto") -> list:
    """Every rank's (device index, GPU uuid, the first rank's visible GPUs' uuids, whether
    "auto" may take cuSOLVERMp on its side), from one exchange of every rank's routine and
    ``engine``, blocks' shapes, dtypes and places, its GPU and any ``misfit`` (a rank's own
    error): blocks that do not fit, ranks that disagree, and the call's checks raise on every
    rank before anything is copied or waited for."""
    group = group if group is not None else dist.group.WORLD
    misfit = misfit or _rhs_misfit(name, a, b)
    cuda = a.device.type == "cuda"
    uuid = str(torch.cuda.get_device_properties(a.device).uuid) if cuda else None
    seen = ([str(torch.cuda.get_device_properties(d).uuid)
             for d in range(torch.cuda.device_count())] if cuda and dist.get_rank(group) == 0
            else None)
    rhs = None if b is None else (tuple(b.shape), str(b.dtype))
    routine = f"{name} ({op.name})" if engine == "auto" else f"{name} ({op.name}, {engine=})"
    places = _exchanged(name, group, routine, misfit,
                        f"a {tuple(a.shape)} {a.dtype} on {a.device.type} (b {rhs})",
                        (a.device.index, uuid, seen,
                         cuda and cusolvermp_takes(dist.get_world_size(group))
                         and cusolvermp_installed()))
    # Every rank's blocks are alike: the call's checks on stand-ins for them, on every rank.
    parts = len(places)
    a_blocks = [torch.empty(a.shape, dtype=a.dtype, device="meta")] * parts
    _check_shards(name, a_blocks)
    nrhs = 0 if b is None else _check_rhs(
        name, a_blocks, [torch.empty(b.shape, dtype=b.dtype, device="meta")] * parts)
    _check_call(op, a_blocks, nrhs, tile, overwrite_a)
    return places


def _gathered_unless_reachable(places, a: torch.Tensor, b: torch.Tensor | None, group):
    """(A, B) whole on this rank's device where every rank solves A alone, else None (the
    group's first rank solves over every GPU through CUDA IPC), from _agreed_call's ``places``
    (alike on every rank). Alone: CPU blocks, or GPUs the first rank cannot reach under their
    numbers (ranks on several hosts, or a CUDA_VISIBLE_DEVICES of their own), at one GPU's speed
    with A whole on each."""
    visible = places[0][2] or []
    if a.device.type == "cuda" and all(index < len(visible) and visible[index] == uuid
                                       for index, uuid, *_ in places):
        return None
    return _gathered(a, group), None if b is None else _gathered(b, group)


def _rhs_misfit(name: str, a: torch.Tensor, b: torch.Tensor | None) -> str | None:
    """This rank's error where its B does not fit its A (the words of _check_rhs_block), to be
    raised on every rank by _exchanged; None where it fits or there is no B."""
    if b is None:
        return None
    try:
        _check_rhs_block(name, "b", a, b)
    except ValueError as error:
        return str(error)
    return None


def _exchanged(name: str, group, routine: str, misfit: str | None, blocks: str, extra) -> list:
    """Every rank's ``extra``, from one exchange in which every rank also says which routine it
    called, its own error (``misfit``) and its blocks (``blocks``, described): a rank that
    called another routine, has an error of its own, or blocks unlike rank 0's raises
    ValueError on every rank, before any collective that would wait for it."""
    group = group if group is not None else dist.group.WORLD
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (routine, misfit, blocks, extra), group=group)
    first = everyone[0]
    for rank, (their_routine, their_misfit, their_blocks, _) in enumerate(everyone):
        if their_routine != first[0]:
            raise ValueError(f"{name}: rank {rank} of the group called {their_routine} where "
                             f"rank 0 called {first[0]}")
        if their_misfit is not None:
            raise ValueError(f"{their_misfit} (rank {rank} of the group)")
        if their_blocks != first[2]:
            raise ValueError(f"{name}: rank {rank} of the group has {their_blocks} where rank 0 "
                             f"has {first[2]}")
    return [extra for *_, extra in everyone]


def _gathered(block: torch.Tensor, group) -> torch.Tensor:
    """Every rank's block (one shape on every rank) stacked in rank order on this block's
    device: NCCL's all-gather into one tensor; through the host where the group's backend takes
    no CUDA tensors (gloo); CPU blocks as objects (any backend)."""
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if block.device.type == "cpu":
        blocks = [None] * size
        dist.all_gather_object(blocks, block.contiguous(), group=group)
        return torch.cat(blocks)
    if "nccl" in dist.get_backend(group):
        whole = block.new_empty((size * block.shape[0], *block.shape[1:]))
        dist.all_gather_into_tensor(whole, block.contiguous(), group=group)
        return whole
    host = block.cpu().contiguous()
    blocks = [torch.empty_like(host) for _ in range(size)]
    dist.all_gather(blocks, host, group=group)
    return torch.cat(blocks).to(block.device)


def _own_rows(group, whole: torch.Tensor) -> torch.Tensor:
    """This rank's row block of a whole [n, ...] result, a tensor of its own (a view would keep
    the whole alive)."""
    rows = whole.shape[0] // dist.get_world_size(group)
    return whole[dist.get_rank(group) * rows:(dist.get_rank(group) + 1) * rows].clone()


def _solve_on_first_rank(name, op, a, b, group, tile, overwrite_a):
    """A right-hand-side solve of every rank's blocks, run by the group's first rank
    (_on_first_rank), its checks there: (this rank's X block, (info, logdet))."""
    x = torch.empty_like(b, memory_format=torch.contiguous_format)

    def work(parts):
        a_shards, b_shards, x_shards = (list(role) for role in zip(*parts))
        n, dtype = _check_shards(name, a_shards)
        nrhs = _check_rhs(name, a_shards, b_shards)
        _check_call(op, a_shards, nrhs, tile, overwrite_a)
        return _solve_cuda(op, _devices(name, a_shards), n, dtype, nrhs, a_shards, b_shards,
                           x_shards, tile, overwrite_a)

    return x, _on_first_rank(name, group, [a.contiguous(), b.contiguous(), x], work)


# Each (process group, GPU, timeout)'s cuSOLVERMp solver, with a communicator of its own.
_PROCESS_SOLVERS: dict = {}
# How long a cuSOLVERMp solve's ranks wait for each other by default (meshla.jax.linalg's too):
# the watchdog ends a process whose wait on its peers outlasts it; the largest solves take minutes.
_PROCESS_SOLVER_TIMEOUT_S = 3600.0


def _engine_misfit(name: str, engine: str, a: torch.Tensor) -> str | None:
    """This rank's reason it cannot run ``engine`` (to be raised on every rank), or None."""
    return engine_misfit(name, engine, None if a.device.type == "cuda"
                         else f"CUDA tensors; a is on {a.device.type}")


def _process_solver(group, device: torch.device, timeout_s: float) -> _meshla.ProcessSolver:
    """The group's cuSOLVERMp solver on this rank's GPU, made on the group's first such call
    with ``timeout_s`` (collective: a communicator of its own, its unique id broadcast over the
    group; the timeout is the communicator's, and so the watchdog's inside every solve)."""
    key = (group, device.index, timeout_s)
    solver = _PROCESS_SOLVERS.get(key)
    if solver is None:
        unique = _exchange_unique_id(group)
        comm = _meshla.Communicator(unique, dist.get_rank(group), dist.get_world_size(group),
                                    device.index, timeout_s=timeout_s)
        meshla._release_communicators_no_more_at_exit()
        solver = _PROCESS_SOLVERS[key] = _meshla.ProcessSolver(comm)
    return solver


def _solve_by_processes(op, a, b, group, tile, overwrite_a, timeout_s):
    """A right-hand-side solve on cuSOLVERMp, this rank's part: (X block, info, logdet). The
    ranks agree that each has its solver and memory before any enters the solve's collectives:
    an error on one rank (out of memory, say) is raised on every rank instead of leaving the
    others waiting."""
    n, nrhs = a.shape[1], b.shape[1]
    try:
        solver = _process_solver(group, a.device, timeout_s)
        x = torch.empty_like(b, memory_format=torch.contiguous_format)
        workspace = _library.workspace(
            solver.workspace_bytes(op, n, DTYPES[a.dtype], nrhs, tile, overwrite_a), a.device)
        ready = None
    except Exception as error:  # reaches every rank below
        ready = (type(error).__name__, str(error))
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, ready, group=group)
    for rank, failure in enumerate(everyone):
        if failure is not None:
            # Made on some ranks only, the solver is let go of on all: the next call makes it
            # again on every rank alike.
            _PROCESS_SOLVERS.pop((group, a.device.index, timeout_s), None)
            raise _ERRORS.get(failure[0], RuntimeError)(f"{failure[1]} (rank {rank} of the group)")
    info, logdet = solver.run(op, n, DTYPES[a.dtype], nrhs, tile, overwrite_a, a.contiguous(),
                              b.contiguous(), x, None, workspace,
                              torch.cuda.current_stream(a.device).cuda_stream)
    return x, info, logdet


def _solved_shard(name, op, a, b, group, tile, overwrite_a, check_errors, what, engine,
                  timeout_s, alone):
    """A right-hand-side solve of every rank's blocks, this rank's part: (X block, info, log det
    or None), raising where A failed (``what``) unless ``check_errors=False``. On cuSOLVERMp for
    engine="cusolvermp", and for "auto" where every rank of a group of several can run it
    (meshla._solver_engines); else the first rank drives every GPU, or, where it cannot reach
    them, every rank solves the gathered A alone with ``alone(A, B)``."""
    places = _agreed_call(name, op, group, a, b, tile, overwrite_a,
                          _engine_misfit(name, engine, a), engine)
    one_gpu_each = len({uuid for _, uuid, *_ in places}) == len(places)
    if engine == "cusolvermp" or (engine == "auto" and one_gpu_each
                                  and all(ready for *_, ready in places)):
        x, info, logdet = _solve_by_processes(op, a, b, group, tile, overwrite_a, timeout_s)
    else:
        whole = _gathered_unless_reachable(places, a, b, group)
        if whole is not None:
            result = alone(*whole)
            return _own_rows(group, result.x[0]), result.info, getattr(result, "logdet", None)
        x, (info, logdet) = _solve_on_first_rank(name, op, a, b, group, tile, overwrite_a)
    _raise_if_failed(name, info, check_errors, what)
    return x, info, logdet


def cho_solve_shard(a: torch.Tensor, b: torch.Tensor, group=None, *, tile: int = 0,
                    overwrite_a: bool = False, check_errors: bool = True,
                    engine: str = "auto",
                    timeout_s: float = _PROCESS_SOLVER_TIMEOUT_S) -> CholeskySolve:
    """:func:`cho_solve` with one process per GPU: ``a`` is this rank's row block of A and ``b``
    its row block of B, ranks in the order of ``group`` (a torch.distributed process group of any
    backend; default the world). Collective. Returns a :class:`CholeskySolve` whose ``x`` is
    this rank's row block of X. ``tile``, ``overwrite_a`` and ``check_errors`` as in
    :func:`cho_solve`.

    ``engine``: "cusolvermp" solves on cuSOLVERMp over every rank's GPU, in any process model,
    one host or several (nvidia-cusolvermp-cu13 0.8 installed beside meshla): A stays in each
    rank's GPU, B and X travel whole through the group's communicator (one of meshla's, made on
    the first such call over ``group`` with this ``timeout_s``, collectively). "cusolvermg":
    where every process sees every GPU under the same number (one host, torchrun's default) the
    group's first rank solves over all of them with cuSolverMg through CUDA IPC; otherwise (ranks
    on several hosts, or each with a CUDA_VISIBLE_DEVICES of its own) every rank gathers A and
    solves it alone on its GPU (one GPU's speed, A whole on each). "auto" (the default):
    cuSOLVERMp where the group has 2 to 16 ranks on GPUs of their own, every one with CUDA
    tensors and cuSOLVERMp, else cuSolverMg (on 2x H200, float64 n = 49152: 0.56 s on
    cuSOLVERMp, 1.39 s through CUDA IPC, 0.93 s on one GPU; ``docs/guides/solvers.md``).

    The checks of :func:`cho_solve` run on every rank before any solve, and an error
    (``ValueError``, ``NotImplementedError``, ``RuntimeError`` or ``torch.linalg.LinAlgError``;
    any other as ``RuntimeError``) is raised on every rank; so is a ``ValueError`` where the
    ranks' blocks differ in shape or dtype, where they ask for different engines, or, for
    "cusolvermp", where any rank lacks cuSOLVERMp or passes CPU blocks. A matrix that is not
    positive definite raises ``torch.linalg.LinAlgError`` on every rank unless
    ``check_errors=False``. Where every rank solves alone, a failure of one rank's own solve (out
    of memory, say) raises on that rank only. cuSolverMg's waits are torch.distributed's,
    bounded by the group's timeout and the default key-value store's; inside a cuSOLVERMp solve a
    rank that died or never made its call leaves the others waiting in NCCL until meshla's
    watchdog ends their processes ``timeout_s`` after (an hour by default; the watchdog's
    message says why)."""
    op = _meshla.SolverOp.cholesky_solve
    name = "cho_solve_shard"
    group = group if group is not None else dist.group.WORLD
    x, info, logdet = _solved_shard(
        name, op, a, b, group, tile, overwrite_a, check_errors, "a is not positive definite",
        engine, timeout_s, lambda a, b: cho_solve([a], [b], check_errors=check_errors))
    return CholeskySolve(x, logdet, info)


def lu_solve_shard(a: torch.Tensor, b: torch.Tensor, group=None, *, tile: int = 0,
                   overwrite_a: bool = False, check_errors: bool = True,
                   engine: str = "auto", timeout_s: float = _PROCESS_SOLVER_TIMEOUT_S) -> LuSolve:
    """:func:`lu_solve` with one process per GPU, as :func:`cho_solve_shard` runs
    :func:`cho_solve`: ``a`` and ``b`` are this rank's row blocks; returns a :class:`LuSolve`
    whose ``x`` is this rank's row block of X. Raises as :func:`cho_solve_shard` does, and
    ``torch.linalg.LinAlgError`` on every rank where A is singular unless
    ``check_errors=False``. ``engine`` and ``timeout_s`` as in :func:`cho_solve_shard`: on
    cuSOLVERMp every rank first sends every other the block of its rows in their columns
    (cuSOLVERMp factors A's columns), two more copies of a rank's block in memory."""
    op = _meshla.SolverOp.lu_solve
    name = "lu_solve_shard"
    group = group if group is not None else dist.group.WORLD
    x, info, _ = _solved_shard(
        name, op, a, b, group, tile, overwrite_a, check_errors, "a is singular", engine,
        timeout_s, lambda a, b: lu_solve([a], [b], check_errors=check_errors))
    return LuSolve(x, info)


def _agreed_tall_shard(name: str, a: torch.Tensor, b: torch.Tensor | None,
                       group) -> tuple[int, int]:
    """Every rank's routine, block shape and dtype and its B's fit (so that a rank that calls
    another routine, disagrees, or whose B does not match its A, raises ValueError on every
    rank, before any collective that would wait for it), then the tall QR's rules."""
    group = group if group is not None else dist.group.WORLD
    misfit = (f"{name}: a has shape {tuple(a.shape)}; expected a row block [m/P, n]"
              if a.ndim != 2 else _rhs_misfit(name, a, b))
    nrhs = b.shape[-1] if b is not None and misfit is None else 0
    parts = len(_exchanged(name, group, name, misfit,
                           f"a {tuple(a.shape)} {a.dtype} on {a.device.type} with {nrhs} "
                           "right-hand sides", None))
    m, n = a.shape[0] * parts, a.shape[1]
    _meshla.tall_qr_call(name, m, n, dtype_of(f"{name}: a", a), parts, nrhs)
    return m, n


def _shard_factors(a: torch.Tensor, group):
    """(this rank's block's Q, its k = min(rows, n) rows of the stacked R factors' Q (ranks in
    the group's order), R), the same R on every rank; with one rank, as
    :func:`_blocks_factors`'s one block."""
    q_block, r_block = torch.linalg.qr(a)
    if dist.get_world_size(group) == 1:
        return q_block, None, r_block
    q_stacked, r = _stacked_qr(_gathered(r_block, group).split(r_block.shape[0]))
    k, rank = r_block.shape[0], dist.get_rank(group)  # each rank's R is [min(rows, n), n]
    return q_block, q_stacked[rank * k:(rank + 1) * k], r


def qr_shard(a: torch.Tensor, group=None) -> QR:
    """:func:`qr` with one process per device: ``a`` is this rank's row block ([m/P, n],
    m >= n), ranks in the order of ``group`` (a torch.distributed process group of any backend;
    default the world), on one host or several. Collective. Returns a :class:`QR` of this rank's
    block of Q and R (the same on every rank). Raises as :func:`qr` does, on every rank, and
    ``ValueError`` on every rank where the ranks' blocks differ in shape or dtype."""
    _agreed_tall_shard("qr_shard", a, None, group)
    q_block, second, r = _shard_factors(a, group)
    return QR(_q_times(q_block, second), r)


def svd_shard(a: torch.Tensor, group=None, *, compute_uv: bool = True) -> SVD:
    """:func:`svd` with one process per device, as :func:`qr_shard` runs :func:`qr`: returns an
    :class:`SVD` of this rank's block of U, and s and Vᴴ on every rank. Raises as
    :func:`qr_shard` does."""
    _agreed_tall_shard("svd_shard", a, None, group)
    if not compute_uv:
        r_block = torch.linalg.qr(a, mode="r")[1]
        _, r = _stacked_qr(_gathered(r_block, group).split(r_block.shape[0]))
        return SVD(None, _square.svd(r, compute_uv=False), None)
    q_block, second, r = _shard_factors(a, group)
    u_r, s, vh = _square.svd(r)
    return SVD(_q_times(q_block, second, u_r), s, vh)


def polar_shard(a: torch.Tensor, group=None) -> Polar:
    """:func:`polar` with one process per device, as :func:`qr_shard` runs :func:`qr`: returns a
    :class:`Polar` of this rank's block of U, and H on every rank. Raises as :func:`qr_shard`
    does."""
    _agreed_tall_shard("polar_shard", a, None, group)
    q_block, second, r = _shard_factors(a, group)
    u_r, h = _square.polar(r)
    return Polar(_q_times(q_block, second, u_r), h)


def least_squares_shard(a: torch.Tensor, b: torch.Tensor, group=None, *,
                        check_errors: bool = True) -> LeastSquares:
    """:func:`least_squares` with one process per device, as :func:`qr_shard` runs :func:`qr`:
    ``a`` and ``b`` are this rank's row blocks; returns a :class:`LeastSquares` whose X is on
    every rank. Raises as :func:`least_squares` does, on every rank (a rank whose B does not
    match its A included)."""
    _agreed_tall_shard("least_squares_shard", a, b, group)
    r, qtb = _reflected(*(_gathered(part, group) for part in _reflected(a, b)))
    return _solved_by_r("least_squares_shard", r, qtb, check_errors)


def cholesky_inverse_shard(a: torch.Tensor, group=None, *, tile: int = 0,
                           overwrite_a: bool = False,
                           check_errors: bool = True) -> tuple[torch.Tensor, int]:
    """:func:`cholesky_inverse` with one process per GPU (see :func:`cho_solve_shard`): this
    rank's row block of A⁻¹, and info. ``a`` is this rank's row block of A, ``group``, ``tile``,
    ``overwrite_a`` and ``check_errors`` as in :func:`cho_solve_shard`. Returns the tuple (row
    block, info). Raises as :func:`cho_solve_shard` does, with :func:`cholesky_inverse`'s
    checks; ``overwrite_a`` with a non-contiguous CUDA ``a`` on any rank raises ``ValueError`` on
    every rank."""
    misfit = ("cholesky_inverse_shard: overwrite_a needs a contiguous a"
              if overwrite_a and a.is_cuda and not a.is_contiguous() else None)
    places = _agreed_call("cholesky_inverse_shard", _meshla.SolverOp.cholesky_inverse, group,
                          a, None, tile, overwrite_a, misfit)
    whole = _gathered_unless_reachable(places, a, None, group)
    if whole is not None:
        inverse, info = cholesky_inverse([whole[0]], check_errors=check_errors)
        mine = _own_rows(group, inverse[0])
        return (a.copy_(mine) if overwrite_a else mine), info
    out = a if overwrite_a else torch.empty_like(a, memory_format=torch.contiguous_format)

    def work(parts):
        a_shards, out_shards = (list(role) for role in zip(*parts))
        n, dtype = _check_shards("cholesky_inverse_shard", a_shards)
        _check_call(_meshla.SolverOp.cholesky_inverse, a_shards, 0, tile, overwrite_a)
        return _cholesky_inverse_cuda(_devices("cholesky_inverse_shard", a_shards), n, dtype,
                                      a_shards, out_shards, tile, overwrite_a)

    info = _on_first_rank("cholesky_inverse_shard", group, [a.contiguous(), out], work)
    _raise_if_failed("cholesky_inverse_shard", info, check_errors, "a is not positive definite")
    return out, info


def eigh_shard(a: torch.Tensor, group=None, *, eigvals_only: bool = False, tile: int = 0,
               overwrite_a: bool = False, check_errors: bool = True) -> Eigh:
    """:func:`eigh` with one process per GPU (see :func:`cho_solve_shard`): every rank gets all
    eigenvalues on its device and, unless ``eigvals_only``, its row block of the eigenvectors.
    ``a`` is this rank's row block of A, the other arguments as in :func:`eigh` and
    :func:`cho_solve_shard`. Returns an :class:`Eigh`. Raises as :func:`cho_solve_shard` does,
    with :func:`eigh`'s checks, and ``torch.linalg.LinAlgError`` on every rank where the
    eigensolver does not converge, unless ``check_errors=False``."""
    op = _meshla.SolverOp.eigvalsh if eigvals_only else _meshla.SolverOp.eigh
    whole = _gathered_unless_reachable(
        _agreed_call("eigh_shard", op, group, a, None, tile, overwrite_a), a, None, group)
    if whole is not None:
        result = eigh([whole[0]], eigvals_only=eigvals_only, check_errors=check_errors)
        vectors = None if eigvals_only else _own_rows(group, result.eigenvectors[0])
        return Eigh(result.eigenvalues, vectors, result.info)
    vectors = None if eigvals_only else torch.empty_like(
        a, memory_format=torch.contiguous_format)

    def work(parts):
        a_shards, vector_shards = (list(role) for role in zip(*parts))
        n, dtype = _check_shards("eigh_shard", a_shards)
        _check_call(_meshla.SolverOp.eigvalsh if eigvals_only else _meshla.SolverOp.eigh,
                    a_shards, 0, tile, overwrite_a)
        devices = _devices("eigh_shard", a_shards)
        values = torch.empty(n, dtype=torch.empty((), dtype=dtype).real.dtype,
                             device=devices[0])
        info = _eigh_cuda(devices, n, dtype, a_shards, None if eigvals_only else vector_shards,
                          values, tile, overwrite_a)
        return info, values.cpu()

    info, values = _on_first_rank("eigh_shard", group, [a.contiguous(), vectors], work)
    _raise_if_failed("eigh_shard", info, check_errors, "the eigensolver did not converge")
    return Eigh(values.to(a.device), vectors, info)
