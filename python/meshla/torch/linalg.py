"""Distributed dense solvers for PyTorch, over the GPUs of one process: the matrix is a list of
row blocks, one per GPU (``a_shards[p]`` holds rows ``[p*n/P, (p+1)*n/P)`` of A on its device),
as :mod:`meshla.jax.linalg` takes a row-sharded array. cuSolverMg runs over all of them from the
calling thread; see ``include/meshla/dense_solver.hpp`` for the layout.

Calls wait for each device's current stream (their inputs) and return when the outputs are
written. A matrix that is not positive definite (or an eigensolver that does not converge)
raises ``torch.linalg.LinAlgError``, or, with ``check_errors=False``, gives NaN outputs and
``info > 0``. On CPU tensors the functions run a torch.linalg reference.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch

from meshla import _meshla

__all__ = ["CholeskySolve", "Eigh", "cho_solve", "cholesky_inverse", "eigh"]

_DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.complex64: "complex64",
    torch.complex128: "complex128",
}


class CholeskySolve(NamedTuple):
    x: list[torch.Tensor]
    logdet: float
    info: int


class Eigh(NamedTuple):
    eigenvalues: torch.Tensor  # on the first shard's device
    eigenvectors: list[torch.Tensor] | None
    info: int


_solvers: dict[tuple[int, ...], _meshla.DenseSolver] = {}  # keyed by the CUDA ordinals, in order
_solvers_lock = threading.Lock()


def _solver(devices: tuple[int, ...]) -> _meshla.DenseSolver:
    with _solvers_lock:
        if devices not in _solvers:
            _solvers[devices] = _meshla.DenseSolver(list(devices))
        return _solvers[devices]


def _check_shards(name: str, a_shards: Sequence[torch.Tensor]) -> tuple[int, torch.dtype]:
    if len(a_shards) == 0:
        raise ValueError(f"{name}: a_shards is empty")
    dtype = a_shards[0].dtype
    if dtype not in _DTYPES:
        raise ValueError(f"{name}: a is {dtype}; the solvers take float32, float64, complex64 "
                         "or complex128")
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


def _on_cpu(shards: Sequence[torch.Tensor]) -> bool:
    return all(shard.device.type == "cpu" for shard in shards)


def _devices(name: str, shards: Sequence[torch.Tensor]) -> tuple[int, ...]:
    if not all(shard.device.type == "cuda" for shard in shards):
        raise ValueError(f"{name}: shards are on {[str(s.device) for s in shards]}; all on CUDA "
                         "devices (one each) or all on the CPU")
    return tuple(shard.device.index for shard in shards)


def _workspaces(solver, op, n, dtype, nrhs, tile, overwrite_a, devices):
    # int64 words: the caching allocator's blocks start on 512-byte boundaries.
    return [
        torch.empty(-(-solver.workspace_bytes(op, n, _DTYPES[dtype], nrhs, tile, overwrite_a, p)
                      // 8), dtype=torch.int64, device=device)
        for p, device in enumerate(devices)
    ]


def _streams(devices) -> list[int]:
    return [torch.cuda.current_stream(device).cuda_stream for device in devices]


def _raise_if_failed(name: str, info: int, check_errors: bool, what: str) -> None:
    if info > 0 and check_errors:
        raise torch.linalg.LinAlgError(f"{name}: {what} (cuSolverMg info={info}); pass "
                                       "check_errors=False to get NaN outputs instead")


def cho_solve(a_shards: Sequence[torch.Tensor], b_shards: Sequence[torch.Tensor], *,
              tile: int = 0, overwrite_a: bool = False,
              check_errors: bool = True) -> CholeskySolve:
    """Row blocks of X = A⁻¹ B (B's row blocks [n/P, nrhs], nrhs <= 256) and log det A.
    ``overwrite_a`` lets the solver factor in A's own buffers (they hold garbage afterwards)."""
    n, dtype = _check_shards("cho_solve", a_shards)
    if len(b_shards) != len(a_shards):
        raise ValueError(f"cho_solve: {len(b_shards)} b_shards for {len(a_shards)} a_shards")
    for p, (a, b) in enumerate(zip(a_shards, b_shards)):
        if b.ndim != 2 or b.shape[0] != a.shape[0] or b.dtype != dtype or b.device != a.device:
            raise ValueError(f"cho_solve: b_shards[{p}] is {tuple(b.shape)} {b.dtype} on "
                             f"{b.device}; expected [{a.shape[0]}, nrhs] {dtype} on {a.device}")
    nrhs = b_shards[0].shape[1]
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
    solver = _solver(devices)
    a_list = [a.contiguous() for a in a_shards]
    x = [torch.empty_like(b) for b in b_shards]
    info, logdet, _, _ = solver.run(
        _meshla.SolverOp.cholesky_solve, n, _DTYPES[dtype], nrhs, tile, overwrite_a, a_list,
        [b.contiguous() for b in b_shards], x, [None] * len(devices), [None] * len(devices),
        _workspaces(solver, _meshla.SolverOp.cholesky_solve, n, dtype, nrhs, tile, overwrite_a,
                    devices),
        _streams(devices))
    _raise_if_failed("cho_solve", info, check_errors, "a is not positive definite")
    return CholeskySolve(x, logdet, info)


def cholesky_inverse(a_shards: Sequence[torch.Tensor], *, tile: int = 0,
                     overwrite_a: bool = False,
                     check_errors: bool = True) -> tuple[list[torch.Tensor], int]:
    """Row blocks of A⁻¹ for a positive-definite A, and info. With ``overwrite_a`` the inverse
    is written over ``a_shards`` (and those are returned)."""
    n, dtype = _check_shards("cholesky_inverse", a_shards)
    if _on_cpu(a_shards):
        factor, status = torch.linalg.cholesky_ex(torch.cat(list(a_shards)))
        info = int(status)
        _raise_if_failed("cholesky_inverse", info, check_errors, "a is not positive definite")
        inverse = torch.cholesky_inverse(factor)
        if info > 0:
            inverse.fill_(float("nan"))
        return list(inverse.split([a.shape[0] for a in a_shards])), info
    devices = _devices("cholesky_inverse", a_shards)
    solver = _solver(devices)
    if overwrite_a and not all(a.is_contiguous() for a in a_shards):
        raise ValueError("cholesky_inverse: overwrite_a needs contiguous a_shards")
    a_list = [a.contiguous() for a in a_shards]
    out = a_list if overwrite_a else [torch.empty_like(a) for a in a_list]
    none = [None] * len(devices)
    info, _, _, _ = solver.run(
        _meshla.SolverOp.cholesky_inverse, n, _DTYPES[dtype], 0, tile, overwrite_a, a_list, none,
        out, none, none,
        _workspaces(solver, _meshla.SolverOp.cholesky_inverse, n, dtype, 0, tile, overwrite_a,
                    devices),
        _streams(devices))
    _raise_if_failed("cholesky_inverse", info, check_errors, "a is not positive definite")
    return out, info


def eigh(a_shards: Sequence[torch.Tensor], *, eigvals_only: bool = False, tile: int = 0,
         overwrite_a: bool = False, check_errors: bool = True) -> Eigh:
    """Eigenvalues (ascending) and row blocks of the eigenvectors (columns of V, A V = V diag(w))
    of a symmetric (Hermitian) A, as ``torch.linalg.eigh``."""
    n, dtype = _check_shards("eigh", a_shards)
    real = torch.empty((), dtype=dtype).real.dtype
    if _on_cpu(a_shards):
        a_full = torch.cat(list(a_shards))
        if eigvals_only:
            return Eigh(torch.linalg.eigvalsh(a_full), None, 0)
        values, vectors = torch.linalg.eigh(a_full)
        return Eigh(values, list(vectors.split([a.shape[0] for a in a_shards])), 0)
    devices = _devices("eigh", a_shards)
    solver = _solver(devices)
    op = _meshla.SolverOp.eigvalsh if eigvals_only else _meshla.SolverOp.eigh
    a_list = [a.contiguous() for a in a_shards]
    vectors = None if eigvals_only else [torch.empty_like(a) for a in a_list]
    none = [None] * len(devices)
    values = [torch.empty(n, dtype=real, device=devices[0])] + none[1:]
    info, _, _, _ = solver.run(
        op, n, _DTYPES[dtype], 0, tile, overwrite_a, a_list, none,
        none if vectors is None else vectors, values, none,
        _workspaces(solver, op, n, dtype, 0, tile, overwrite_a, devices), _streams(devices))
    _raise_if_failed("eigh", info, check_errors, "the eigensolver did not converge")
    return Eigh(values[0], vectors, info)
