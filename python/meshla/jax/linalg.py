"""Distributed dense solvers for JAX: Cholesky solve (with log-determinant), inverse of a
symmetric (Hermitian) positive-definite matrix, the eigen-decomposition, and the LU solve of a
general matrix, over every GPU of a mesh axis.

The matrix is sharded by rows over ``axis`` of ``mesh`` (``PartitionSpec(axis, None)``), the way
JAX lays out a large array; right-hand sides likewise. On GPUs each call is one XLA FFI custom
call per device: the calls of one solve meet inside meshla, and the first GPU's thread runs
cuSolverMg over all of them (one process driving several GPUs). The row blocks are used as
cuSolverMg's block-cyclic layout after a renumbering inside each GPU, so no matrix moves between
GPUs and the extra memory is a few tile panels (see ``src/solver/block_cyclic.hpp``). The LU
solve is the exception: a general A's columns are what cuSolverMg factors, so each GPU reads its
columns from the others' row blocks into a working copy (A twice in memory, once over NVLink).

Memory: the custom call declares that it writes into ``a`` (an output aliased to it), so XLA
hands it a copy of ``a``: each GPU holds its row block twice (input and working copy) and a few
tile panels more. XLA reuses a donated buffer only for an output of the jitted function, so
to solve in A's own memory, donate ``a`` and return the overwritten buffer
(``cho_solve(..., overwrite_a=True)``; ``cholesky_inverse`` writes A⁻¹ over A, so donating ``a``
is enough where nothing is padded). When n / GPUs is not a multiple of the tile, the solver pads
and works in XLA scratch instead of the copy.

Errors inside jit cannot raise: a matrix that is not positive definite (a singular one for the
LU solve, or an eigensolver that does not converge) gives NaN outputs and ``info > 0`` (returned
with ``return_info=True``).
Bad shapes, dtypes or meshes raise at trace time or as ``XlaRuntimeError``. A GPU whose handler
never arrives ends the call on the others after ``timeout_s`` with an error, and one whose own
preparation fails (its workspace, say) ends it at once with that error. The solve itself is not
cut short: the other GPUs' buffers are in use until it ends, so they wait for it (saying so on
stderr once ``timeout_s`` has passed).

Every function also has a ``*_shard`` form for use inside ``jax.shard_map`` over the same mesh.
On CPU devices the same functions run a reference (gather the rows, solve with ``jax.numpy``), so
code written for GPUs runs unchanged on a development machine. So do meshes whose devices span
processes (jax.distributed, one process per GPU, one host or several): cho_solve and lu_solve
run on cuSOLVERMp over the processes' GPUs where it is installed (``engine``); otherwise, and for
the other routines, each device gathers A's rows and solves alone, at one GPU's speed and with A
whole in each GPU's memory, since cuSolverMg drives the GPUs of one process.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshla import _meshla
from meshla._solver_engines import cusolvermp_installed, cusolvermp_takes, engine_misfit
from meshla.jax._dtypes import dtype_of
from meshla.jax._ffi import register_targets
from meshla.jax._groups import agreed_everywhere, axis_groups, group_number

__all__ = [
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
    "CholeskySolve",
    "LuSolve",
    "Polar",
    "QR",
    "SVD",
    "Eigh",
]

DEFAULT_TIMEOUT_S = 3600.0
"""How long the GPUs of one call wait for each other and for the solver (a 200k fp64 eigensolve
takes minutes)."""

class CholeskySolve(NamedTuple):
    """What :func:`cho_solve_shard` returns: ``x``, this device's rows of X; ``logdet``, log det A,
    a scalar of A's real dtype, the same on every device; ``info``, an int32 scalar, 0 on success
    and > 0 where A is not positive definite (``x`` and ``logdet`` are NaN then);
    ``overwritten_a``, the buffer the solver worked in (garbage; a zero-size placeholder where it
    padded, and on CPU devices the unchanged row block of A). A plain named tuple: making one
    checks nothing."""

    x: jax.Array
    logdet: jax.Array
    info: jax.Array
    overwritten_a: jax.Array  # A's buffer after the solver worked in it: garbage (see cho_solve)


class LuSolve(NamedTuple):
    """What :func:`lu_solve_shard` returns: ``x``, this device's rows of X; ``info``, an int32
    scalar, 0 on success and > 0 where A is singular (a zero pivot; ``x`` is NaN then);
    ``overwritten_a``, the buffer the solver worked in (as :class:`CholeskySolve`'s: garbage,
    a zero-size placeholder where the solver worked in scratch, A's unchanged row block on CPU
    devices). A plain named tuple: making one checks nothing."""

    x: jax.Array
    info: jax.Array
    overwritten_a: jax.Array


class QR(NamedTuple):
    """What :func:`qr_shard` returns: ``q``, this device's rows of Q ([m/P, n], orthonormal
    columns), and ``r``, R ([n, n], upper triangular, the same on every device): A = Q R. A plain
    named tuple: making one checks nothing."""

    q: jax.Array
    r: jax.Array


class SVD(NamedTuple):
    """What :func:`svd_shard` returns: ``u``, this device's rows of U ([m/P, n], orthonormal
    columns; None without ``compute_uv``), ``s``, the n singular values in descending order (A's
    real dtype), and ``vh``, Vᴴ ([n, n]; None without ``compute_uv``), both the same on every
    device: A = U diag(s) Vᴴ. A plain named tuple: making one checks nothing."""

    u: jax.Array | None
    s: jax.Array
    vh: jax.Array | None


class Polar(NamedTuple):
    """What :func:`polar_shard` returns: ``u``, this device's rows of the unitary polar factor
    ([m/P, n], orthonormal columns), and ``h``, the Hermitian positive semi-definite factor
    ([n, n], the same on every device): A = U H. A plain named tuple: making one checks
    nothing."""

    u: jax.Array
    h: jax.Array


class Eigh(NamedTuple):
    """What :func:`eigh_shard` returns: ``eigenvalues``, all n in ascending order, of A's real
    dtype, the same on every device; ``eigenvectors``, this device's rows of V, or None with
    ``eigvals_only``; ``info``, an int32 scalar, 0 on success and > 0 where the eigensolver did
    not converge (the outputs are NaN then). A plain named tuple: making one checks nothing."""

    eigenvalues: jax.Array
    eigenvectors: jax.Array | None
    info: jax.Array


def _axis_of(mesh: Mesh, axis: str | None) -> str:
    if axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(
                f"mesh has axes {mesh.axis_names}; name the one the rows are sharded over (axis=)"
            )
        return mesh.axis_names[0]
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh {mesh.axis_names}")
    return axis


def _cusolvermg_runs(mesh: Mesh) -> bool:
    """Whether cuSolverMg solves the call: the mesh's devices are GPUs of this one process. On
    CPU devices, and on a mesh whose devices span processes (jax.distributed, one process per
    GPU), every device gathers A's rows and solves it alone with jax.numpy: a device's own speed
    and memory for the whole of A (cuSolverMg drives the GPUs of one process)."""
    return all(d.platform == "gpu" and d.process_index == jax.process_index()
               for d in mesh.devices.flat)


def _mesh_groups(mesh: Mesh, axis: str) -> tuple[np.ndarray, int]:
    """CUDA ordinals of every group of GPUs that solves together (see axis_groups), group after
    group."""
    devices = axis_groups(mesh, axis).reshape(-1)
    return np.array([d.local_hardware_id for d in devices], np.int64), mesh.shape[axis]


def _check_matrix(a_block: jax.Array, name: str) -> None:
    if a_block.ndim != 2:
        raise ValueError(f"{name}: a has shape {a_block.shape}; expected a row block [n/P, n]")


def _check_rhs_block(name: str, a_block, b_block, vector_ok: bool = False) -> None:
    """B (or its row block) against A's: 2-D (or 1-D where ``vector_ok``), A's rows and dtype;
    the extension's words, as meshla.torch's."""
    a_dtype = dtype_of(f"{name}: a", a_block)
    _meshla.rhs_block(name, "b", list(b_block.shape), dtype_of(f"{name}: b", b_block),
                      a_block.shape[0], a_dtype, vector_ok)


def _first_zero_info(diagonal) -> jax.Array:
    """info as LAPACK reports a zero pivot: 1 + the index of the first exact zero, else 0."""
    zero = diagonal == 0
    return jnp.where(zero.any(), jnp.argmax(zero) + 1, 0).astype(jnp.int32)


def _real_dtype(dtype) -> np.dtype:
    return jnp.finfo(dtype).dtype


def _ffi_attributes(mesh: Mesh, axis: str, tile: int, timeout_s: float) -> dict:
    devices, group_size = _mesh_groups(mesh, axis)
    return dict(
        devices=devices,
        group_size=np.int64(group_size),
        tile=np.int64(tile),
        timeout_s=np.float64(timeout_s),
    )


def _layout(op, a, mesh: Mesh, axis: str, tile: int, nrhs: int = 0,
            overwrite_a: bool = False) -> tuple[int, bool]:
    """The extension's checks of the call (dtype, right-hand sides, tile, overwrite_a; the same
    on CPU and GPU meshes) and its (tile, padded). ``a`` is the whole matrix or a row block."""
    return _meshla.solver_call(op, a.shape[-1], dtype_of(f"{op.name}: a", a), nrhs,
                               mesh.shape[axis], tile, overwrite_a)


def _working(a_block: jax.Array, padded: bool):
    """The result XLA aliases to ``a`` so that the solver works in its buffer, or a zero-size
    placeholder when padding makes the solver work in scratch."""
    if padded:
        return jax.ShapeDtypeStruct((0,), a_block.dtype), {}
    return jax.ShapeDtypeStruct(a_block.shape, a_block.dtype), None


def _gather_rows(block: jax.Array, axis: str) -> jax.Array:
    return jax.lax.all_gather(block, axis, tiled=True)


def _own_rows(full: jax.Array, axis: str, rows: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(axis) * rows, rows, axis=0)


def _reference_cholesky(a_full: jax.Array) -> tuple[jax.Array, jax.Array]:
    factor = jnp.linalg.cholesky(a_full)
    info = jnp.isnan(factor).any().astype(jnp.int32)
    return factor, info


def _engine(name: str, engine: str, mesh: Mesh, axis: str, timeout_s: float,
            overwrite_a: bool = False) -> str:
    """``engine`` checked at trace time, in meshla.torch's words, from what every process sees
    alike (the whole mesh), so that all raise or none does before the solvers are made; "auto"
    resolved (meshla._solver_engines): "cusolvermp" where each of the axis's groups is GPUs of
    2 to 16 processes, one each, A is not overwritten and every process of the mesh has
    cuSOLVERMp (agreed through jax.distributed's store, within ``timeout_s``), else
    "cusolvermg"."""
    others = [d.platform for d in mesh.devices.flat if d.platform != "gpu"]
    misfit = engine_misfit(name, engine,
                           f"GPU devices; the mesh has {others[0]} devices" if others else None)
    if misfit is not None:
        raise ValueError(misfit)
    device_groups = axis_groups(mesh, axis)
    groups = [[d.process_index for d in devices] for devices in device_groups]
    one_gpu_a_process = all(len(set(processes)) == len(processes) for processes in groups)
    if engine == "auto":
        fits = (not others and one_gpu_a_process and not overwrite_a
                and all(cusolvermp_takes(len(processes)) for processes in groups))
        return ("cusolvermp" if fits and agreed_everywhere(
            f"cusolvermp installed: {[int(d.id) for d in mesh.devices.flat]}",
            cusolvermp_installed(), sorted({d.process_index for d in mesh.devices.flat}),
            timeout_s) else "cusolvermg")
    if engine == "cusolvermp":
        for devices, processes in zip(device_groups, groups):
            if len(set(processes)) != len(processes):
                raise ValueError(
                    f"{name}: engine='cusolvermp' runs one GPU in each process; the devices "
                    f"{[int(d.id) for d in devices]} of axis {axis!r} are in processes "
                    f"{processes}")
        if overwrite_a:
            raise NotImplementedError(f"{name}: overwrite_a with engine='cusolvermp' is not "
                                      "supported in meshla.jax yet")
    return engine


def _on_process_solvers(target: str, op, a_block, b_block, mesh: Mesh, axis: str, tile: int,
                        timeout_s: float, scalars: tuple) -> tuple:
    """A right-hand-side solve on cuSOLVERMp (engine="cusolvermp"): X, then ``scalars`` (the
    handler's other outputs). The call is checked as the other engine's (its tile is the
    engine's own where 0); the group's solvers are made on the first trace (_groups)."""
    _layout(op, a_block, mesh, axis, tile, nrhs=b_block.shape[1])
    register_targets()
    call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct(b_block.shape, b_block.dtype),
                                     *scalars))
    return call(a_block, b_block, group=np.int64(group_number(mesh, axis, timeout_s, "solver")),
                tile=np.int64(tile))


def cho_solve_shard(a_block, b_block, *, mesh: Mesh, axis: str | None = None, tile: int = 0,
                    timeout_s: float = DEFAULT_TIMEOUT_S, engine: str = "auto") -> CholeskySolve:
    """Inside ``shard_map``: this device's rows of A ([n/P, n]) and of B ([n/P, nrhs]) give its
    rows of X = A⁻¹ B, log det A (the same on every device) and info.

    ``mesh`` is the shard_map's and ``axis`` the mesh axis the rows are sharded over (default:
    the mesh's only axis); A is symmetric (Hermitian) positive definite, float32, float64,
    complex64 or complex128, B of its dtype with 1 to 256 columns. ``tile`` is the block-cyclic
    tile (0: meshla's choice); ``timeout_s`` how long the devices of the call wait for each
    other. Returns a :class:`CholeskySolve`.

    Raises ``ValueError`` at trace time for an ``axis`` not in ``mesh`` (or none named on a mesh
    of several axes), an ``a_block`` that is not 2-D, a ``b_block`` whose rows or dtype differ,
    an unsupported dtype, nrhs outside 1 to 256, an n that the axis's devices do not divide or a
    negative ``tile``; on GPUs, ``NotImplementedError`` for a meshla built without XLA's FFI
    headers. A mesh whose devices span processes runs everywhere (see the module's notes). A
    matrix that is not positive definite raises
    nothing: NaN outputs and info > 0. Failures inside the custom call (a device whose handler
    never arrives within ``timeout_s`` included; see the module's notes) surface as
    ``jax.errors.JaxRuntimeError``.

    ``engine``: "cusolvermp" solves on cuSOLVERMp over the axis's GPUs, one in each process
    (jax.distributed, one host or several; nvidia-cusolvermp-cu13 0.8 installed beside meshla):
    A stays in each GPU. Its solvers are made when the call is first traced, collectively over
    the processes (the NCCL id through jax.distributed's key-value store, within ``timeout_s``).
    ``ValueError`` at trace time for other devices, a process holding several of a group's GPUs
    or cuSOLVERMp missing. A process that dies or never runs the call leaves the others waiting
    in NCCL until meshla's watchdog ends their processes ``timeout_s`` later (its message says
    why). "cusolvermg": cuSolverMg over the GPUs of one process, or, on a mesh whose devices
    span processes, every device solving the gathered A (see the module's notes). "auto" (the
    default): "cusolvermp" where every group of the axis is GPUs of 2 to 16 processes, one each,
    and every process has cuSOLVERMp (agreed at trace time through jax.distributed's key-value
    store), else "cusolvermg". Times in ``docs/guides/solvers.md``."""
    axis = _axis_of(mesh, axis)
    engine = _engine("cho_solve", engine, mesh, axis, timeout_s)
    _check_matrix(a_block, "cho_solve")
    rows, n = a_block.shape
    _check_rhs_block("cho_solve", a_block, b_block)
    if engine == "cusolvermp":
        x, logdet, info = _on_process_solvers(
            "meshla_process_cholesky_solve", _meshla.SolverOp.cholesky_solve, a_block, b_block,
            mesh, axis, tile, timeout_s, (jax.ShapeDtypeStruct((), _real_dtype(a_block.dtype)),
                                          jax.ShapeDtypeStruct((), jnp.int32)))
        return CholeskySolve(x, logdet, info, a_block)
    tile, padded = _layout(_meshla.SolverOp.cholesky_solve, a_block, mesh, axis, tile,
                           nrhs=b_block.shape[1])
    if not _cusolvermg_runs(mesh):
        factor, info = _reference_cholesky(_gather_rows(a_block, axis))
        x = jax.scipy.linalg.cho_solve((factor, True), _gather_rows(b_block, axis))
        logdet = 2.0 * jnp.sum(jnp.log(jnp.real(jnp.diagonal(factor))))
        return CholeskySolve(_own_rows(x, axis, rows), logdet, info, a_block)
    register_targets()
    working, aliases = _working(a_block, padded)
    call = jax.ffi.ffi_call(
        "meshla_cholesky_solve",
        (
            jax.ShapeDtypeStruct(b_block.shape, b_block.dtype),
            jax.ShapeDtypeStruct((), _real_dtype(a_block.dtype)),
            jax.ShapeDtypeStruct((), jnp.int32),
            working,
        ),
        input_output_aliases={0: 3} if aliases is None else aliases,
    )
    x, logdet, info, working = call(a_block, b_block,
                                    **_ffi_attributes(mesh, axis, tile, timeout_s))
    return CholeskySolve(x, logdet, info, working)


def lu_solve_shard(a_block, b_block, *, mesh: Mesh, axis: str | None = None, tile: int = 0,
                   timeout_s: float = DEFAULT_TIMEOUT_S, engine: str = "auto") -> LuSolve:
    """Inside ``shard_map``: this device's rows of a general A ([n/P, n]) and of B ([n/P, nrhs])
    give its rows of X = A⁻¹ B (LU with partial pivoting) and info.

    A is float32, float64, complex64 or complex128 (not necessarily symmetric), B of its dtype
    with 1 to 256 columns; ``mesh``, ``axis``, ``tile`` and ``timeout_s`` as in
    :func:`cho_solve_shard`. Returns a :class:`LuSolve`. Raises as :func:`cho_solve_shard`
    does, and ``ValueError`` for a ``tile`` above 512 on several devices (cuSolverMg's getrf's
    largest); a singular A raises nothing (NaN rows, info > 0). On several GPUs the solver works in
    scratch of its own (the matrix's columns gathered from every GPU); on one it works in A's
    buffer (``overwritten_a``) unless it pads. ``engine`` as in :func:`cho_solve_shard`; with
    "cusolvermp" every process first sends every other the block of its rows in their columns
    (cuSOLVERMp factors A's columns)."""
    axis = _axis_of(mesh, axis)
    engine = _engine("lu_solve", engine, mesh, axis, timeout_s)
    _check_matrix(a_block, "lu_solve")
    rows, n = a_block.shape
    _check_rhs_block("lu_solve", a_block, b_block)
    if engine == "cusolvermp":
        x, info = _on_process_solvers(
            "meshla_process_lu_solve", _meshla.SolverOp.lu_solve, a_block, b_block, mesh, axis,
            tile, timeout_s, (jax.ShapeDtypeStruct((), jnp.int32),))
        return LuSolve(x, info, a_block)
    tile, padded = _layout(_meshla.SolverOp.lu_solve, a_block, mesh, axis, tile,
                           nrhs=b_block.shape[1])
    if not _cusolvermg_runs(mesh):
        lu, pivots = jax.scipy.linalg.lu_factor(_gather_rows(a_block, axis))
        info = _first_zero_info(jnp.diagonal(lu))
        x = jax.scipy.linalg.lu_solve((lu, pivots), _gather_rows(b_block, axis))
        x = jnp.where(info > 0, jnp.nan, x).astype(a_block.dtype)
        return LuSolve(_own_rows(x, axis, rows), info, a_block)
    register_targets()
    working, aliases = _working(a_block, padded or mesh.shape[axis] > 1)
    call = jax.ffi.ffi_call(
        "meshla_lu_solve",
        (jax.ShapeDtypeStruct(b_block.shape, b_block.dtype), jax.ShapeDtypeStruct((), jnp.int32),
         working),
        input_output_aliases={0: 2} if aliases is None else aliases,
    )
    x, info, working = call(a_block, b_block, **_ffi_attributes(mesh, axis, tile, timeout_s))
    return LuSolve(x, info, working)


# The tall-skinny QR (qr, least_squares, svd, polar): a QR of each device's row block, then one
# of their stacked R factors (P of [k, n], k = min(rows, n), on every device); Q's rows are each
# block's Q times its k rows of the second Q. Householder QRs throughout (as stable as one QR of
# A), one all-gather of the R factors, no custom call: XLA's own QR and collectives, so it runs
# wherever the mesh's devices are (one process or jax.distributed, one host or several).
# Products in full precision: XLA's default lets float32 GEMMs round through TF32.

_FULL = jax.lax.Precision.HIGHEST


def _check_tall(name: str, a_block, mesh: Mesh, axis: str, nrhs: int = 0) -> None:
    """The extension's rules of a tall-skinny QR call (dtype, rows split evenly, A at least as
    tall as it is wide), the same words in meshla.torch."""
    if a_block.ndim != 2:
        raise ValueError(f"{name}: a has shape {a_block.shape}; expected a row block [m/P, n]")
    parts = mesh.shape[axis]
    _meshla.tall_qr_call(name, a_block.shape[0] * parts, a_block.shape[1],
                         dtype_of(f"{name}: a", a_block), parts, nrhs)


def _tall_factors(a_block, axis: str, parts: int):
    """(this block's Q [rows, k], this device's k rows of the stacked R factors' Q, R [n, n]),
    k = min(rows, n): each block's R is [k, n]. Where one device holds all of A its block's QR is
    A's, and the second factor is None: the second stage would cost 2 m n² for nothing (NOTES
    87). Where a device's rows are fewer than A's columns (a square A over several devices) the
    stacked factors are as large as A, and their QR is one device's QR of A."""
    q_block, r_block = jnp.linalg.qr(a_block)
    if parts == 1:
        return q_block, None, r_block
    q_stacked, r = jnp.linalg.qr(jax.lax.all_gather(r_block, axis, tiled=True))
    return q_block, _own_rows(q_stacked, axis, r_block.shape[0]), r


def _q_times(q_block, second, right=None):
    """This device's rows of Q (times ``right``, n x n): Q_block (second (right)), the factors
    that are None left out."""
    if second is not None:
        right = second if right is None else jnp.matmul(second, right, precision=_FULL)
    return q_block if right is None else jnp.matmul(q_block, right, precision=_FULL)


def _reflected(a, b):
    """(R, the first n rows of Qᴴ B) of A's Householder QR, Q applied by its reflectors and never
    formed: forming it (orgqr) costs about the QR's own time again (NOTES 97)."""
    h, taus = jnp.linalg.qr(a, mode="raw")  # h: the reflectors, transposed
    n = a.shape[1]
    qtb = jax.lax.linalg.ormqr(h.mT, taus, b, left=True, transpose=True)
    return jnp.triu(h.mT[:n]), qtb[:n]


def _factors_and_projection(a_block, b_block, axis: str, parts: int):
    """(R, Qᴴ B) of the tall-skinny QR, Q never formed (differentiated through the blocks' formed
    Q, as least_squares was before: geqrf has no derivative in jax)."""
    def formed(a_block, b_block):
        q_block, second, r = _tall_factors(a_block, axis, parts)
        part = jnp.matmul(q_block.conj().T, b_block, precision=_FULL)
        if second is not None:
            part = jax.lax.psum(jnp.matmul(second.conj().T, part, precision=_FULL), axis)
        return r, part

    @_differentiated_as(formed)
    def reflected(a_block, b_block):
        # Qᴴ B = (second Q)ᴴ [Q_pᴴ B_p stacked over the devices]
        r_block, qtb_block = _reflected(a_block, b_block)
        return _reflected(jax.lax.all_gather(r_block, axis, tiled=True),
                          jax.lax.all_gather(qtb_block, axis, tiled=True))

    return reflected(a_block, b_block)


def qr_shard(a_block, *, mesh: Mesh, axis: str | None = None) -> QR:
    """Inside ``shard_map``: the reduced QR of a tall A sharded by rows over ``axis``: this
    device's rows of Q and R (the same on every device), A = Q R.

    ``a_block`` is this device's [m/P, n] rows, m >= n, float32, float64, complex64 or
    complex128; ``mesh`` and ``axis`` as in :func:`cho_solve_shard`. Returns a :class:`QR`.
    Raises ``ValueError`` at trace time for an ``axis`` not in ``mesh``, an ``a_block`` that is
    not 2-D or an unsupported dtype, and ``NotImplementedError`` for a wide A (m < n). Runs in
    every process model: it is jax.numpy's QR and one all-gather of R factors (on one device,
    the block's own QR alone). Where a device's rows are fewer than A's columns (a square A,
    say) the gathered factors are as large as A and every device runs one QR of that size."""
    axis = _axis_of(mesh, axis)
    _check_tall("qr", a_block, mesh, axis)
    q_block, second, r = _tall_factors(a_block, axis, mesh.shape[axis])
    return QR(_q_times(q_block, second), r)


def _differentiated_as(differentiable):
    """Makes a fast function's derivative that of ``differentiable`` (the same values, computed
    the way jax can differentiate): QDWH's while loop and geqrf have no reverse-mode rule, while
    the routines they replace were differentiable. Under differentiation the values are
    ``differentiable``'s too, so they match their derivative."""
    def wrap(fast):
        fast = jax.custom_jvp(fast)
        fast.defjvp(lambda primals, tangents: jax.jvp(differentiable, primals, tangents))
        return fast
    return wrap


def _polar_by_svd(r):
    """R = U H from R's SVD by gesvd (SvdAlgorithm.QR: on CUDA jax's default below n = 1024,
    gesvdj, misses float64 values by 1e-13 relative, NOTES 106)."""
    u_r, s, vh = jax.lax.linalg.svd(r, full_matrices=False,
                                    algorithm=jax.lax.linalg.SvdAlgorithm.QR)
    return (jnp.matmul(u_r, vh, precision=_FULL),
            jnp.matmul(vh.conj().T * s.astype(vh.dtype), vh, precision=_FULL))


@_differentiated_as(_polar_by_svd)
def _square_polar(r):
    """(U, H), R = U H for the tall routines' n x n R, by jax's QDWH: GEMM, QR and Cholesky
    iterations, 150 ms at n = 4096 in float64 on an H200 against 2.4 s for the SVD's gesvd
    (NOTES 95). Where QDWH's U is not orthonormal to 10 sqrt(n) eps entrywise, or Uᴴ R is not
    Hermitian to that relative to ||R||_F (which bounds ||R - U H||: R numerically singular,
    zero or not finite), the SVD's answer instead, as meshla.torch._square._accepted decides."""
    u, h = jax.scipy.linalg.polar(r, method="qdwh")
    n = r.shape[0]
    tolerance = 10 * np.sqrt(n) * jnp.finfo(r.dtype).eps
    miss = jnp.max(jnp.abs(jnp.matmul(u.conj().T, u, precision=_FULL) - jnp.eye(n, dtype=r.dtype)))
    product = jnp.matmul(u.conj().T, r, precision=_FULL)
    skew = jnp.linalg.norm(product - product.conj().T) / 2
    converged = (miss <= tolerance) & (skew <= tolerance * jnp.linalg.norm(r))  # NaN: False
    return jax.lax.cond(converged, lambda: (u, h), lambda: _polar_by_svd(r))


def _square_svd(r, compute_uv: bool = True):
    """R's SVD (U, s descending, Vᴴ), or s alone, from its polar decomposition: H = V diag(s) Vᴴ
    and U = U_p V (differentiated as gesvd's)."""
    return (_square_svd_vectors if compute_uv else _square_singular_values)(r)


@_differentiated_as(lambda r: tuple(jnp.linalg.svd(r, full_matrices=False)))
def _square_svd_vectors(r):
    u_p, h = _square_polar(r)
    values, v = jnp.linalg.eigh(h)
    v = v[:, ::-1]
    return jnp.matmul(u_p, v, precision=_FULL), jnp.maximum(values[::-1], 0), v.conj().T


@_differentiated_as(lambda r: jnp.linalg.svd(r, compute_uv=False))
def _square_singular_values(r):
    return jnp.maximum(jnp.linalg.eigvalsh(_square_polar(r)[1])[::-1], 0)


def svd_shard(a_block, *, mesh: Mesh, axis: str | None = None, compute_uv: bool = True) -> SVD:
    """Inside ``shard_map``: the thin SVD of a tall A sharded by rows over ``axis`` (this
    device's [m/P, n] rows, m >= n), from the tall-skinny QR: A = Q R, R = U_R diag(s) Vᴴ on
    every device (R's SVD from its polar decomposition by QDWH), U = Q U_R (this device's rows).
    ``compute_uv=False`` gives the values alone (no Q is formed). Returns an :class:`SVD`.
    Raises as :func:`qr_shard` does."""
    axis = _axis_of(mesh, axis)
    _check_tall("svd", a_block, mesh, axis)
    if not compute_uv:
        r_block = jnp.linalg.qr(a_block, mode="r")
        r = jnp.linalg.qr(jax.lax.all_gather(r_block, axis, tiled=True), mode="r")
        return SVD(None, _square_svd(r, compute_uv=False), None)
    q_block, second, r = _tall_factors(a_block, axis, mesh.shape[axis])
    u_r, s, vh = _square_svd(r)
    return SVD(_q_times(q_block, second, u_r), s, vh)


def polar_shard(a_block, *, mesh: Mesh, axis: str | None = None) -> Polar:
    """Inside ``shard_map``: the polar decomposition A = U H of a tall A sharded by rows over
    ``axis`` (this device's [m/P, n] rows, m >= n): U = Q U_R (this device's rows) and H (the
    same on every device) from the tall-skinny QR, A = Q R, and R's polar decomposition
    R = U_R H by QDWH. Returns a :class:`Polar`. Raises as :func:`qr_shard` does."""
    axis = _axis_of(mesh, axis)
    _check_tall("polar", a_block, mesh, axis)
    q_block, second, r = _tall_factors(a_block, axis, mesh.shape[axis])
    u_r, h = _square_polar(r)
    return Polar(_q_times(q_block, second, u_r), h)


def least_squares_shard(a_block, b_block, *, mesh: Mesh, axis: str | None = None
                        ) -> tuple[jax.Array, jax.Array]:
    """Inside ``shard_map``: X minimizing ||A X - B|| for a tall A of full column rank sharded by
    rows over ``axis`` (this device's [m/P, n] rows, m >= n) and B sharded the same way
    ([m/P, nrhs]). Returns (X [n, nrhs], the same on every device; info, an int32 scalar: 0, or
    i > 0 where R's i-th diagonal element is exactly zero, A rank-deficient (a zero column, say,
    as LAPACK's gels reports; numerical rank deficiency is not detected), with X NaN), from the
    tall-skinny QR: X = R⁻¹ Qᴴ B, Qᴴ B applied by Householder reflectors, no Q formed. Raises
    as :func:`qr_shard` does, and ``ValueError`` for a ``b_block`` whose rows or dtype differ."""
    axis = _axis_of(mesh, axis)
    _check_tall("least_squares", a_block, mesh, axis)  # a's own rules before b's
    _check_rhs_block("least_squares", a_block, b_block)
    _check_tall("least_squares", a_block, mesh, axis, b_block.shape[1])
    r, qtb = _factors_and_projection(a_block, b_block, axis, mesh.shape[axis])
    info = _first_zero_info(jnp.diagonal(r))
    x = jax.scipy.linalg.solve_triangular(r, qtb, lower=False)
    return jnp.where(info > 0, jnp.nan, x).astype(a_block.dtype), info


def cholesky_inverse_shard(a_block, *, mesh: Mesh, axis: str | None = None, tile: int = 0,
                           timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[jax.Array, jax.Array]:
    """Inside ``shard_map``: this device's rows of A⁻¹ for a positive-definite A, and info.

    ``a_block`` is this device's rows of A ([n/P, n]); ``mesh``, ``axis``, ``tile`` and
    ``timeout_s`` as in :func:`cho_solve_shard`. Returns the tuple (rows of A⁻¹, info: an int32
    scalar, 0 on success and > 0 where A is not positive definite, with NaN rows). Raises as
    :func:`cho_solve_shard` does, and ``NotImplementedError`` at trace time for n above 46340
    (padding to the tile included): the inverse runs cusolverDn's potri, whose sizes are
    32-bit."""
    axis = _axis_of(mesh, axis)
    _check_matrix(a_block, "cholesky_inverse")
    rows, n = a_block.shape
    tile, padded = _layout(_meshla.SolverOp.cholesky_inverse, a_block, mesh, axis, tile)
    if not _cusolvermg_runs(mesh):
        factor, info = _reference_cholesky(_gather_rows(a_block, axis))
        inverse = jax.scipy.linalg.cho_solve((factor, True), jnp.eye(n, dtype=a_block.dtype))
        return _own_rows(inverse, axis, rows), info
    register_targets()
    call = jax.ffi.ffi_call(
        "meshla_cholesky_inverse",
        (jax.ShapeDtypeStruct(a_block.shape, a_block.dtype), jax.ShapeDtypeStruct((), jnp.int32)),
        input_output_aliases={} if padded else {0: 0},
    )
    inverse, info = call(a_block, **_ffi_attributes(mesh, axis, tile, timeout_s))
    return inverse, info


def eigh_shard(a_block, *, mesh: Mesh, axis: str | None = None, eigvals_only: bool = False,
               tile: int = 0, timeout_s: float = DEFAULT_TIMEOUT_S) -> Eigh:
    """Inside ``shard_map``: the eigenvalues of A (ascending, the same on every device), this
    device's rows of the eigenvectors V (A V = V diag(w); None with ``eigvals_only``), and info.

    ``a_block`` is this device's rows of a symmetric (Hermitian) A ([n/P, n]); ``mesh``,
    ``axis``, ``tile`` and ``timeout_s`` as in :func:`cho_solve_shard`. Returns an
    :class:`Eigh`. Raises as :func:`cho_solve_shard` does, and ``ValueError`` for a ``tile``
    above 1024 on several devices; an eigensolver that does not converge raises nothing (NaN
    outputs, info > 0)."""
    axis = _axis_of(mesh, axis)
    _check_matrix(a_block, "eigh")
    rows, n = a_block.shape
    op = _meshla.SolverOp.eigvalsh if eigvals_only else _meshla.SolverOp.eigh
    tile, padded = _layout(op, a_block, mesh, axis, tile)
    if not _cusolvermg_runs(mesh):
        a_full = _gather_rows(a_block, axis)
        if eigvals_only:
            values = jnp.linalg.eigvalsh(a_full)
            return Eigh(values, None, jnp.isnan(values).any().astype(jnp.int32))
        values, vectors = jnp.linalg.eigh(a_full)
        return Eigh(values, _own_rows(vectors, axis, rows),
                    jnp.isnan(values).any().astype(jnp.int32))
    register_targets()
    working, aliases = _working(a_block, padded)
    values = jax.ShapeDtypeStruct((n,), _real_dtype(a_block.dtype))
    info = jax.ShapeDtypeStruct((), jnp.int32)
    attributes = _ffi_attributes(mesh, axis, tile, timeout_s)
    if eigvals_only:
        call = jax.ffi.ffi_call("meshla_eigvalsh", (values, info, working),
                                input_output_aliases={0: 2} if aliases is None else aliases)
        w, status, _ = call(a_block, **attributes)
        return Eigh(w, None, status)
    vectors = jax.ShapeDtypeStruct(a_block.shape, a_block.dtype)
    call = jax.ffi.ffi_call("meshla_eigh", (values, vectors, info, working),
                            input_output_aliases={0: 3} if aliases is None else aliases)
    w, v, status, _ = call(a_block, **attributes)
    return Eigh(w, v, status)


def _sharded(function, mesh: Mesh, in_specs, out_specs):
    return jax.shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)


def cho_solve(a, b, mesh: Mesh, axis: str | None = None, *, tile: int = 0,
              return_logdet: bool = False, return_info: bool = False,
              overwrite_a: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
              engine: str = "auto"):
    """X = A⁻¹ B for a symmetric (Hermitian) positive-definite A sharded by rows over ``axis``
    of ``mesh``; B is [n] or [n, nrhs] (nrhs <= 256) sharded the same way. Returns X (sharded
    like B), plus log det A and/or info when asked. Jittable; ``tile`` is the block-cyclic tile
    (0: meshla's choice).

    ``overwrite_a=True`` also returns, last, the buffer the solver worked in (garbage, shaped
    like A). Return it from a function jitted with ``a`` donated and XLA hands the solver A's
    own buffer, so the solve needs no second copy of A (the way to the largest n):
    ``jax.jit(lambda a, b: cho_solve(a, b, mesh, overwrite_a=True), donate_argnums=0)``. It
    needs n / GPUs to be a multiple of the tile (no padding).

    ``axis`` defaults to the mesh's only axis; ``timeout_s`` is how long the devices of the call
    wait for each other. Returns X alone, or the tuple (X, then log det A with
    ``return_logdet``, info with ``return_info``, the worked-in buffer with ``overwrite_a``).
    log det A is a scalar of A's real dtype, info an int32 scalar.

    Raises ``ValueError`` at trace time for an ``a`` that is not 2-D, ``overwrite_a`` where the
    solver would pad, and the checks of :func:`cho_solve_shard` (axis, shapes, dtype, nrhs, n,
    tile); ``NotImplementedError`` on GPUs for a meshla built without XLA's FFI headers. A
    matrix that is not positive definite raises nothing: X
    and log det A are NaN and info > 0. Failures inside the custom call, a device whose handler
    never arrives within ``timeout_s`` included, surface as ``jax.errors.JaxRuntimeError``.
    ``engine`` as in :func:`cho_solve_shard`; ``overwrite_a`` with ``engine="cusolvermp"``
    raises ``NotImplementedError`` ("auto" then takes "cusolvermg")."""
    axis = _axis_of(mesh, axis)
    engine = _engine("cho_solve", engine, mesh, axis, timeout_s, overwrite_a)
    if a.ndim != 2:
        raise ValueError(f"cho_solve: a has shape {a.shape}; expected [n, n]")
    _check_rhs_block("cho_solve", a, b, vector_ok=True)
    vector = b.ndim == 1
    # The working buffer is A's shape, or a zero-size placeholder when the solver pads.
    _, padded = _layout(_meshla.SolverOp.cholesky_solve, a, mesh, axis, tile,
                        nrhs=1 if vector else b.shape[-1], overwrite_a=overwrite_a)
    solve = functools.partial(cho_solve_shard, mesh=mesh, axis=axis, tile=tile,
                              timeout_s=timeout_s, engine=engine)
    x, logdet, info, working = _sharded(
        lambda a_block, b_block: tuple(solve(a_block, b_block)), mesh,
        (P(axis, None), P(axis, None)), (P(axis, None), P(), P(), P(axis) if padded else
                                         P(axis, None)))(a, b[:, None] if vector else b)
    x = x[:, 0] if vector else x
    extra = (((logdet,) if return_logdet else ()) + ((info,) if return_info else ())
             + ((working,) if overwrite_a else ()))
    return (x, *extra) if extra else x


def lu_solve(a, b, mesh: Mesh, axis: str | None = None, *, tile: int = 0,
             return_info: bool = False, overwrite_a: bool = False,
             timeout_s: float = DEFAULT_TIMEOUT_S, engine: str = "auto"):
    """X = A⁻¹ B for a general A (LU with partial pivoting, as ``jnp.linalg.solve``) sharded by
    rows over ``axis`` of ``mesh``; B is [n] or [n, nrhs] (nrhs <= 256) sharded the same way.
    Returns X (sharded like B), or the tuple (X, then info with ``return_info``, the worked-in
    buffer with ``overwrite_a``); info is an int32 scalar, 0 on success and > 0 where A is
    singular (X is NaN then). Jittable; ``axis``, ``tile`` and ``timeout_s`` as in
    :func:`cho_solve`.

    ``overwrite_a`` as in :func:`cho_solve` (donate ``a`` and return the buffer), on one GPU
    only: on several, the solver needs A's columns, which it gathers into scratch of its own
    (A twice in memory).

    Raises ``ValueError`` at trace time for an ``a`` that is not 2-D and the checks of
    :func:`lu_solve_shard`; ``NotImplementedError`` for ``overwrite_a`` on several GPUs or a
    meshla built without XLA's FFI headers;
    ``jax.errors.JaxRuntimeError`` from the custom call. ``engine`` as in :func:`cho_solve`."""
    axis = _axis_of(mesh, axis)
    engine = _engine("lu_solve", engine, mesh, axis, timeout_s, overwrite_a)
    if a.ndim != 2:
        raise ValueError(f"lu_solve: a has shape {a.shape}; expected [n, n]")
    _check_rhs_block("lu_solve", a, b, vector_ok=True)
    vector = b.ndim == 1
    _, padded = _layout(_meshla.SolverOp.lu_solve, a, mesh, axis, tile,
                        nrhs=1 if vector else b.shape[-1], overwrite_a=overwrite_a)
    in_scratch = padded or mesh.shape[axis] > 1  # the placeholder lu_solve_shard returns
    solve = functools.partial(lu_solve_shard, mesh=mesh, axis=axis, tile=tile,
                              timeout_s=timeout_s, engine=engine)
    x, info, working = _sharded(
        lambda a_block, b_block: tuple(solve(a_block, b_block)), mesh,
        (P(axis, None), P(axis, None)),
        (P(axis, None), P(), P(axis) if in_scratch else P(axis, None)))(
            a, b[:, None] if vector else b)
    x = x[:, 0] if vector else x
    extra = ((info,) if return_info else ()) + ((working,) if overwrite_a else ())
    return (x, *extra) if extra else x


def qr(a, mesh: Mesh, axis: str | None = None):
    """The reduced QR of a tall A ([m, n], m >= n) sharded by rows over ``axis`` of
    ``mesh``: returns (Q, sharded like A; R [n, n], replicated), A = Q R, as
    ``jnp.linalg.qr(a)``'s (signs may differ). Jittable. Raises as :func:`qr_shard` does."""
    axis = _axis_of(mesh, axis)
    factor = functools.partial(qr_shard, mesh=mesh, axis=axis)
    return _sharded(lambda block: tuple(factor(block)), mesh, (P(axis, None),),
                    (P(axis, None), P()))(a)


def svd(a, mesh: Mesh, axis: str | None = None, *, compute_uv: bool = True):
    """The thin SVD of a tall A ([m, n], m >= n) sharded by rows over ``axis`` of
    ``mesh``, as ``jnp.linalg.svd(a, full_matrices=False)``: returns (U, sharded like A; s;
    Vᴴ, both replicated), or s alone with ``compute_uv=False``. Jittable. Raises as
    :func:`qr_shard` does."""
    axis = _axis_of(mesh, axis)
    decompose = functools.partial(svd_shard, mesh=mesh, axis=axis, compute_uv=compute_uv)
    if not compute_uv:
        return _sharded(lambda block: decompose(block).s, mesh, (P(axis, None),), P())(a)
    return _sharded(lambda block: tuple(decompose(block)), mesh, (P(axis, None),),
                    (P(axis, None), P(), P()))(a)


def polar(a, mesh: Mesh, axis: str | None = None):
    """The polar decomposition A = U H of a tall A ([m, n], m >= n) sharded by rows over
    ``axis`` of ``mesh``: returns (U, orthonormal columns, sharded like A; H [n, n], Hermitian
    positive semi-definite, replicated), as ``scipy.linalg.polar(a)``. Jittable. Raises as
    :func:`qr_shard` does."""
    axis = _axis_of(mesh, axis)
    decompose = functools.partial(polar_shard, mesh=mesh, axis=axis)
    return _sharded(lambda block: tuple(decompose(block)), mesh, (P(axis, None),),
                    (P(axis, None), P()))(a)


def least_squares(a, b, mesh: Mesh, axis: str | None = None, *, return_info: bool = False):
    """X minimizing ||A X - B|| (as ``jnp.linalg.lstsq``'s solution) for a tall A of full column
    rank ([m, n], m >= n) sharded by rows over ``axis`` of ``mesh``; B is [m] or
    [m, nrhs], sharded the same way. Returns X ([n] or [n, nrhs], replicated), or with
    ``return_info`` the tuple (X, info) as :func:`least_squares_shard`'s. Jittable. Raises as
    :func:`least_squares_shard` does, and ``ValueError`` for an ``a`` that is not 2-D."""
    axis = _axis_of(mesh, axis)
    if a.ndim != 2:
        raise ValueError(f"least_squares: a has shape {a.shape}; expected [m, n]")
    _check_rhs_block("least_squares", a, b, vector_ok=True)
    vector = b.ndim == 1
    solve = functools.partial(least_squares_shard, mesh=mesh, axis=axis)
    x, info = _sharded(solve, mesh, (P(axis, None), P(axis, None)), (P(), P()))(
        a, b[:, None] if vector else b)
    x = x[:, 0] if vector else x
    return (x, info) if return_info else x


def cholesky_inverse(a, mesh: Mesh, axis: str | None = None, *, tile: int = 0,
                     return_info: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S):
    """A⁻¹ of a symmetric (Hermitian) positive-definite A sharded by rows over ``axis`` of
    ``mesh``, sharded the same way.

    ``axis``, ``tile`` and ``timeout_s`` as in :func:`cho_solve`. Returns A⁻¹, or with
    ``return_info`` the tuple (A⁻¹, info), info an int32 scalar, 0 on success and > 0 where A is
    not positive definite (A⁻¹ is NaN then). Raises as :func:`cholesky_inverse_shard` does
    (``ValueError`` at trace time; ``NotImplementedError`` for n above 46340 or a meshla built
    without XLA's FFI headers;
    ``jax.errors.JaxRuntimeError`` from the custom call)."""
    axis = _axis_of(mesh, axis)
    invert = functools.partial(cholesky_inverse_shard, mesh=mesh, axis=axis, tile=tile,
                               timeout_s=timeout_s)
    inverse, info = _sharded(invert, mesh, (P(axis, None),), (P(axis, None), P()))(a)
    return (inverse, info) if return_info else inverse


def eigh(a, mesh: Mesh, axis: str | None = None, *, eigvals_only: bool = False, tile: int = 0,
         return_info: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S):
    """Eigenvalues (ascending, replicated) and eigenvectors (columns of V, sharded by rows like
    ``a``) of a symmetric (Hermitian) A sharded by rows over ``axis`` of ``mesh``, as
    ``jnp.linalg.eigh``; only the eigenvalues with ``eigvals_only``.

    ``axis``, ``tile`` and ``timeout_s`` as in :func:`cho_solve`. Returns the tuple (w, V), or w
    alone with ``eigvals_only``; ``return_info`` appends info, an int32 scalar: 0 on success,
    positive where the eigensolver did not converge (the outputs are NaN then). Raises as
    :func:`eigh_shard` does (``ValueError`` at trace time, a ``tile`` above 1024 on several
    devices included; ``NotImplementedError``; ``jax.errors.JaxRuntimeError`` from the custom
    call)."""
    axis = _axis_of(mesh, axis)
    decompose = functools.partial(eigh_shard, mesh=mesh, axis=axis, eigvals_only=eigvals_only,
                                  tile=tile, timeout_s=timeout_s)
    if eigvals_only:
        def values_only(block):
            result = decompose(block)
            return result.eigenvalues, result.info

        values, info = _sharded(values_only, mesh, (P(axis, None),), (P(), P()))(a)
        return (values, info) if return_info else values
    values, vectors, info = _sharded(lambda block: tuple(decompose(block)), mesh,
                                     (P(axis, None),), (P(), P(axis, None), P()))(a)
    return (values, vectors, info) if return_info else (values, vectors)
