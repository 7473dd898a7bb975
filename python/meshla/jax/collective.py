"""Collective matmul for tensor parallelism in JAX: all-gather→GEMM, GEMM→reduce-scatter and
GEMM→all-reduce, the communication overlapped with the GEMM.

The plain functions take per-shard arrays inside ``jax.shard_map``, the tensor-parallel group
named by its mesh axis (``axis_name=``); the ``*_global`` forms take global arrays sharded over a
mesh. Arguments and meanings are meshla.torch's: ``bias``, ``trans_b`` (weights as [out, in], the
layout models keep), ``return_gathered``, and the tuning (``backend``, ``algorithm``, ``chunks``,
``comm_sms``, ``comm_ctas``; see :class:`meshla.torch.Tuning`). Every shape, dtype and tuning
rule is the extension's (describe_call), checked when the call is traced: bad input raises
``ValueError`` there, naming the argument and the shapes, with the same words as meshla.torch.

On GPUs each call is one XLA FFI custom call per device. Its prepare stage builds the plan
(collectively, the first time a shape runs) and its execute stage only enqueues it on XLA's
stream, so XLA may capture it in a command buffer. The communicators are made when a call on a
(mesh, axis) is first traced (see ``meshla/jax/_groups.py``): one process driving every GPU of a
group, or one process per GPU under ``jax.distributed.initialize()``. A peer that never arrives
while a plan is built ends the call with an error after ``timeout_s``; a run enqueued eagerly
that a peer never joins ends the process after ``timeout_s`` with a message naming the op (the
group's watchdog, as in meshla.torch). Runs inside XLA's command buffers are CUDA graph replays,
which the watchdog does not see: there a missing peer leaves the GPUs waiting, as in a torch
graph's replay.

On CPU devices the same functions run a ``jax.numpy`` reference (lax collectives and matmuls in
float32; column_parallel_matmul's forward is XLA's local GEMM everywhere), so a program written
for GPUs runs unchanged on a machine without them.

Differentiable (``jax.grad``, ``jax.checkpoint``): each op's backward is its conjugate collective
(all-gather→GEMM's input gradient is a GEMM→reduce-scatter and the other way round), run by
meshla on GPUs like the forward. Cotangents follow shard_map's varying-axes types (its default
``check_vma=True``): the gradient of an input replicated over an axis is summed over it, as
JAX's own differentiation of the reference sums it.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as jax_config
from jax._src.lax.parallel import all_gather_invariant
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshla import _meshla
from meshla._tuning import Tuning
from meshla.jax import _groups
from meshla.jax._dtypes import DTYPES, dtype_of
from meshla.jax._ffi import register_targets
from meshla.jax._vma import as_varying, typed, varying_axes

__all__ = [
    "all_gather_matmul",
    "all_gather_matmul_global",
    "all_gather_scaled_matmul",
    "column_parallel_matmul",
    "column_parallel_matmul_global",
    "matmul_all_reduce",
    "matmul_all_reduce_global",
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_global",
    "scaled_matmul_all_reduce",
    "scaled_matmul_reduce_scatter",
]

DEFAULT_TIMEOUT_S = 300.0
"""How long the GPUs of a group wait for each other (making the group, building a plan)."""

_Op = _meshla.CollectiveOp


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call as traced: hashable, custom_vjp's non-differentiable argument."""

    op: _meshla.CollectiveOp
    axis: str
    tp: int
    group: int | None  # the registered groups' number on GPUs; None on CPU (the reference)
    trans_b: bool
    return_gathered: bool
    tuning: Tuning
    out_shape: tuple[int, int]
    gathered_shape: tuple[int, int] | None
    # The varying mesh axes of a, b and bias (shard_map's types), which their cotangents take.
    varying: tuple[frozenset, frozenset, frozenset]
    # The product's dtype (a's, or a float8 call's out_dtype) and a float8 call's scaling
    # ("none" otherwise).
    out_dtype: jnp.dtype = None
    scaling: str = "none"
    # fp8 training (a 16-bit call with fp8=...): the recipe its operands are cast with.
    fp8: str | None = None
    # all_gather_matmul: b's gradient gathers a again instead of keeping the gathered rows.
    recompute_gathered: bool = False


def _check_array(op: str, name: str, x) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{op}: {name} must be an array, got {type(x).__name__}")


def _meta(op: str, name: str, x, device: int):
    if x is None:
        return None
    _check_array(op, name, x)
    shape = [int(d) for d in x.shape]
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]  # JAX arrays are row-major
    return _meshla.ArrayMeta(shape, strides, dtype_of(f"{op}: {name}", x), device, 0,
                             f"{op}: {name}")


def _describe(op, a, b, bias, *, axis: str, tp: int, group: int | None, trans_b: bool,
              return_gathered: bool, tuning: Tuning, scales=(None, None),
              out_dtype=None) -> _Call:
    """The call checked by the extension (the rules meshla.torch applies, in the same words);
    ``scales`` and ``out_dtype`` for a float8 call."""
    device = -1 if group is None else 0
    name = op.name
    out = None
    if out_dtype is not None:
        try:
            out_dtype = jnp.dtype(out_dtype)
        except TypeError:
            pass
        out = DTYPES.get(out_dtype)
        if out is None:
            raise ValueError(f"{name}: out_dtype={getattr(out_dtype, 'name', out_dtype)} is not "
                             "a dtype meshla takes (a float8 product is bfloat16, float16 or "
                             "float32)")
    metas = [_meta(name, arg, x, device) for arg, x in
             (("a", a), ("b", b), ("bias", bias), ("a_scale", scales[0]), ("b_scale", scales[1]))]
    config = _meshla.describe_call(op, *metas[:3], None, None, trans_b, return_gathered, tp,
                                   device, tuning.algorithm, tuning.chunks, tuning.comm_sms,
                                   tuning.comm_ctas, tuning.backend, a_scale=metas[3],
                                   b_scale=metas[4], out_dtype=out)
    return _Call(op=op, axis=axis, tp=tp, group=group, trans_b=trans_b,
                 return_gathered=return_gathered, tuning=tuning,
                 out_shape=tuple(config.product_shape(tp)),
                 gathered_shape=(config.m, config.k) if return_gathered else None,
                 varying=tuple(frozenset() if isinstance(x, jax.ShapeDtypeStruct)
                               else varying_axes(x) for x in (a, b, bias)),
                 out_dtype=jnp.dtype(a.dtype if out_dtype is None else out_dtype),
                 scaling=config.scaling)


def _mesh_of(op: str, mesh: Mesh | None, axis: str) -> Mesh:
    """The concrete mesh of the call: ``mesh``, or the one jax.set_mesh made current."""
    if mesh is None:
        from jax._src.mesh import get_concrete_mesh

        mesh = get_concrete_mesh()
        if mesh is None or mesh.empty:
            raise ValueError(f"{op}: no mesh; pass mesh= (the mesh of the enclosing "
                             "jax.shard_map) or make one current with jax.set_mesh")
    if not isinstance(mesh, Mesh):
        raise ValueError(f"{op}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"{op}: axis_name={axis!r} is not an axis of the mesh "
                         f"{tuple(mesh.axis_names)}")
    return mesh


def _check_inside_shard_map(op: str, mesh: Mesh, axis: str) -> None:
    abstract = jax.sharding.get_abstract_mesh()
    manual = dict(zip(abstract.axis_names, abstract.axis_types)).get(axis)
    if manual != jax.sharding.AxisType.Manual:
        raise ValueError(f"{op}: call it inside jax.shard_map over axis {axis!r} on per-shard "
                         f"arrays (or use {op}_global on global arrays)")
    if abstract.shape[axis] != mesh.shape[axis]:
        raise ValueError(f"{op}: axis {axis!r} has {abstract.shape[axis]} devices in the "
                         f"enclosing shard_map but {mesh.shape[axis]} in mesh=")


def _traced_call(op, a, b, bias, *, axis_name: str, mesh: Mesh | None, trans_b: bool,
                 return_gathered: bool, tuning: Tuning, timeout_s: float, scales=(None, None),
                 out_dtype=None) -> _Call:
    name = op.name
    if not isinstance(axis_name, str):
        raise ValueError(f"{name}: axis_name must be the name of a mesh axis, got {axis_name!r}")
    mesh = _mesh_of(name, mesh, axis_name)
    _check_inside_shard_map(name, mesh, axis_name)
    on_gpu = mesh.devices.flat[0].platform == "gpu"
    call = _describe(op, a, b, bias, axis=axis_name, tp=mesh.shape[axis_name], group=None,
                     trans_b=trans_b, return_gathered=return_gathered, tuning=tuning,
                     scales=scales, out_dtype=out_dtype)
    if not on_gpu:
        return call
    register_targets()
    return dataclasses.replace(call, group=_groups.group_number(mesh, axis_name, timeout_s))


# The forward of one call: the extension's handler on GPUs, the reference on CPUs.

def _dot(x, y):
    return jnp.matmul(x, y, preferred_element_type=jnp.float32)


def _dequantized(x, scale, rowwise: bool):
    """A float8 operand as float32 times its scales (one, or one per row)."""
    return x.astype(jnp.float32) * (scale.reshape(-1, 1) if rowwise else scale.reshape(()))


def _reference(call: _Call, a, b, bias, scales=(None, None)):
    scaled = call.scaling != "none"
    rowwise = call.scaling == "rowwise"
    if scaled:  # b is [n, k] (trans_b), its scales one per row of it
        b = _dequantized(b, scales[1], rowwise)
    rhs = b.T if call.trans_b else b
    gathered = None
    if call.op == _Op.all_gather_matmul:
        # The gathered rows are the same on every rank: invariant over the axis (JAX's public
        # all_gather types them as varying), so that their cotangent is this rank's own.
        rows = all_gather_invariant(a, call.axis, tiled=True)
        gathered = rows if call.return_gathered else None
        if scaled:  # rowwise, each row with its own scale; tensorwise, one for them all
            rows = _dequantized(rows, all_gather_invariant(scales[0], call.axis, tiled=True)
                                if rowwise else scales[0], rowwise)
        product = _dot(rows, rhs)
    else:
        if scaled:
            a = _dequantized(a, scales[0], rowwise)
        if call.op == _Op.matmul_reduce_scatter:
            product = jax.lax.psum_scatter(_dot(a, rhs), call.axis, scatter_dimension=0,
                                           tiled=True)
        else:
            product = jax.lax.psum(_dot(a, rhs), call.axis)
    if bias is not None:
        product = product + bias.astype(jnp.float32)
    return product.astype(call.out_dtype), gathered


def _out_varying(call: _Call, a, b, bias, scales=(None, None)) -> frozenset:
    """The product's type, as the reference's collectives give it: the reduce-scatter's varies
    over the axis; the all-gather's rows do not (its product varies over it where b or the bias
    do), nor does the all-reduce's sum (where the bias does). A float8 call's scales vary the
    product as their operands do."""
    a_varying = varying_axes(a) | varying_axes(scales[0])
    b_varying = varying_axes(b) | varying_axes(scales[1])
    if call.op == _Op.matmul_reduce_scatter:
        return a_varying | b_varying | varying_axes(bias) | {call.axis}
    if call.op == _Op.all_gather_matmul:
        return (a_varying - {call.axis}) | b_varying | varying_axes(bias)
    return (a_varying | b_varying) - {call.axis} | varying_axes(bias)


_TARGETS = {
    _Op.all_gather_matmul: "meshla_all_gather_matmul",
    _Op.matmul_reduce_scatter: "meshla_matmul_reduce_scatter",
    _Op.matmul_all_reduce: "meshla_matmul_all_reduce",
}


def _on_gpus(call: _Call, a, b, bias, scales=(None, None)):
    # One custom call takes operands of one type: each varies over every axis any of them does.
    # Absent ones are empty (the scales of a 16-bit call).
    operands = (a, b, jnp.zeros((0,), call.out_dtype) if bias is None else bias,
                *(jnp.zeros((0,), jnp.float32) if s is None else s for s in scales))
    varying = frozenset().union(*map(varying_axes, operands))
    operands = [as_varying(x, varying) for x in operands]
    results = [typed(call.out_shape, call.out_dtype, _out_varying(call, a, b, bias, scales))]
    if call.op == _Op.all_gather_matmul:
        # A zero-size gathered output tells the handler not to return the rows.
        results.append(typed(call.gathered_shape or (0,), a.dtype, varying_axes(a) - {call.axis}))
    tuning = call.tuning
    outputs = jax.ffi.ffi_call(_TARGETS[call.op], results)(
        *operands, group=call.group, trans_b=call.trans_b, algorithm=tuning.algorithm.value,
        backend=tuning.backend.value, chunks=tuning.chunks, comm_sms=tuning.comm_sms,
        comm_ctas=tuning.comm_ctas)
    gathered = outputs[1] if call.return_gathered else None
    return outputs[0], gathered


def _forward(call: _Call, a, b, bias, scales=(None, None)):
    return (_reference if call.group is None else _on_gpus)(call, a, b, bias, scales)


# Differentiation: each op's backward runs its conjugate collective.

def _conjugate(call: _Call, op, a, b, *, trans_b: bool, return_gathered: bool = False):
    """The backward's collective matmul on the forward's group and backend (the rest of the
    tuning meshla's defaults, as in meshla.torch)."""
    derived = _describe(op, a, b, None, axis=call.axis, tp=call.tp, group=call.group,
                        trans_b=trans_b, return_gathered=return_gathered,
                        tuning=Tuning.of(backend=call.tuning.backend))
    return _forward(derived, a, b, None)


def _cotangent(ct, primal_varying: frozenset, dtype):
    """``ct``, this rank's contribution, as the cotangent of an input of ``primal_varying`` type:
    summed over the axes it varies over and the input does not (where JAX's differentiation of
    the reference sums it), marked varying where the input is."""
    extra = tuple(sorted(varying_axes(ct) - primal_varying))
    if extra:
        ct = jax.lax.psum(ct, extra)
    return as_varying(ct, primal_varying).astype(dtype)


def _weight_grad(call: _Call, rows, grad, dtype):
    """b's gradient from the rows b multiplied and the product's gradient: rowsᵀ grad, or its
    transpose for b as [n, k]."""
    product = _dot(grad.T, rows) if call.trans_b else _dot(rows.T, grad)
    return _cotangent(product, call.varying[1], dtype)


def _bias_grad(call: _Call, grad, bias):
    if bias is None:
        return None
    return _cotangent(jnp.sum(grad.astype(jnp.float32), axis=0), call.varying[2], bias.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _collective(call: _Call, a, b, bias):
    return _forward(call, a, b, bias)


def _collective_fwd(call: _Call, a, b, bias):
    if call.op == _Op.all_gather_matmul and call.recompute_gathered:
        # Only this rank's rows kept (a is a residual anyway); the backward gathers them again.
        out, rows = _forward(call, a, b, bias)
        return (out, rows), (a, b, bias, None)
    if call.op == _Op.all_gather_matmul:
        # b's gradient needs the gathered rows: the forward always returns them, an [m, k]
        # residual (recompute_gathered, above, keeps a alone instead).
        out, rows = _forward(dataclasses.replace(call, return_gathered=True,
                                                 gathered_shape=(call.out_shape[0], a.shape[1])),
                             a, b, bias)
        return (out, rows if call.return_gathered else None), (a, b, bias, rows)
    return _forward(call, a, b, bias), (a, b, bias, None)


def _own_rows(call: _Call, full, rows: int):
    return jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(call.axis) * rows, rows)


def _collective_bwd(call: _Call, residuals, cotangents):
    if not jax_config._check_vma.value:
        raise NotImplementedError(
            f"{call.op.name}: its gradient needs jax.shard_map's check_vma=True (the default): "
            "without the varying-axes types, which cotangents to sum over the axis is unknown")
    a, b, bias, rows = residuals
    grad, gathered_grad = cotangents
    if call.op == _Op.all_gather_matmul and call.recompute_gathered:
        rows = all_gather_invariant(a, call.axis, tiled=True)  # XLA's all-gather
    if call.op == _Op.all_gather_matmul:
        if call.axis in varying_axes(grad):
            # Each rank's product used its own b: the gathered rows' gradient (grad bᵀ) is summed
            # over the ranks, and each keeps its own rows.
            grad_a, _ = _conjugate(call, _Op.matmul_reduce_scatter, grad, b,
                                   trans_b=not call.trans_b)
        else:  # the same product on every rank (b replicated over the axis): nothing to sum
            grad_a = _dot(_own_rows(call, grad, a.shape[0]), b if call.trans_b else b.T)
        if gathered_grad is not None:  # the rows returned to the caller, who used them
            grad_a = grad_a + _own_rows(call, gathered_grad, a.shape[0])
        grad_b = _weight_grad(call, rows, grad, b.dtype)
    elif call.op == _Op.matmul_reduce_scatter:
        # The output's rows were scattered: their gradient is gathered back, fused with a's. Both
        # are this rank's contributions (varying over the axis, whatever a and b are), so that
        # an a or b the same on every rank gets them summed, as every rank's product was.
        grad_a, grad_rows = _conjugate(call, _Op.all_gather_matmul, grad, b,
                                       trans_b=not call.trans_b, return_gathered=True)
        grad_a = as_varying(grad_a, frozenset({call.axis}))
        grad_b = _weight_grad(call, a, as_varying(grad_rows, frozenset({call.axis})), b.dtype)
    else:
        # The sum's gradient: the output's, summed over the axis where a bias made it vary over
        # it; every rank's product then has it as its own contribution (as above).
        summed = jax.lax.psum(grad, call.axis) if call.axis in varying_axes(grad) else grad
        summed = as_varying(summed, frozenset({call.axis}))
        grad_a = _dot(summed, b if call.trans_b else b.T)
        grad_b = _weight_grad(call, a, summed, b.dtype)
    grad_a = _cotangent(grad_a, call.varying[0], a.dtype)
    return grad_a, grad_b, _bias_grad(call, grad, bias)


_collective.defvjp(_collective_fwd, _collective_bwd)


# The public functions.

def _run(op, a, b, bias, axis_name, mesh, trans_b, return_gathered, tuning, timeout_s,
         fp8=None, recompute_gathered=False):
    # Before the call is traced (on GPUs that makes the groups); a bad recipe is _check_fp8_call's.
    if recompute_gathered and fp8 in _RECIPES:  # meshla.torch's layer's words
        raise ValueError(f"{op.name}: recompute_gathered=True applies to 16-bit calls; an fp8 "
                         "call keeps its gathered fp8 rows (tensorwise) or gathers its input "
                         "again (rowwise) anyway")
    call = _traced_call(op, a, b, bias, axis_name=axis_name, mesh=mesh, trans_b=trans_b,
                        return_gathered=return_gathered, tuning=tuning, timeout_s=timeout_s)
    if fp8 is None:
        return _collective(dataclasses.replace(call, recompute_gathered=recompute_gathered),
                           a, b, bias)
    _check_fp8_call(call, a, b, bias, fp8)
    return _fp8_collective(dataclasses.replace(call, fp8=fp8), a, b, bias), None


def all_gather_matmul(a, b, *, axis_name: str, mesh: Mesh | None = None, bias=None,
                      trans_b: bool = False, return_gathered: bool = False, algorithm="auto",
                      chunks: int = 0, comm_sms: int = -1, comm_ctas: int = 0, backend="auto",
                      timeout_s: float = DEFAULT_TIMEOUT_S, fp8: str | None = None,
                      recompute_gathered: bool = False):
    """Inside ``jax.shard_map``: ``all_gather(a) @ b (+ bias)`` for this shard's rows ``a``
    ([m/tp, k]) over ``axis_name``. ``b`` is [k, n], or [n, k] with ``trans_b``; ``bias`` [n].
    Returns the [m, n] product, and with ``return_gathered`` also the gathered [m, k] ``a``.
    ``mesh`` is the shard_map's (default: the one jax.set_mesh made current). ``timeout_s`` is
    how long the GPUs of a group wait for each other: the first call traced on a (mesh, axis)
    makes its groups with it, and later calls share them (and that timeout).

    ``algorithm``, ``chunks``, ``comm_sms``, ``comm_ctas`` and ``backend`` tune it as in
    meshla.torch (:class:`meshla.torch.Tuning`).

    ``fp8="tensorwise"`` or ``"rowwise"`` computes it in float8 for training, as meshla.torch's
    ``fp8=`` layers do: ``a`` and ``b`` (16-bit, or float32; ``b`` as [n, k], ``trans_b=True``)
    are cast to float8_e4m3fn in the call with scales from their amax (tensorwise one each, the
    gathered ``a``'s the axis's largest; rowwise one per row), the product's gradient to
    float8_e5m2 in the backward; the product and gradients keep ``a``'s dtype. Not with
    ``return_gathered``. The scaled ops' rules apply (sizes multiples of 16, rowwise row blocks
    multiples of 4).

    A column-parallel layer with sequence parallelism: ``a``'s gradient is the reduce-scatter of
    the product's gradient times ``b``ᵀ (a :func:`matmul_reduce_scatter`). ``b``'s gradient
    needs the gathered ``a``: kept from the forward, or with ``recompute_gathered=True`` (16-bit
    calls) gathered again in the backward (one more all-gather there, for tp times less memory
    kept), as in meshla.torch.

    Errors are the module's: ``ValueError`` at trace time for bad shapes, dtypes or tuning, an
    ``axis_name`` that is not a mesh axis, no mesh, a call outside ``jax.shard_map`` over
    ``axis_name`` or a shard_map whose axis size differs from ``mesh``'s; on GPUs,
    ``NotImplementedError`` for a meshla built without XLA's FFI headers or a group with several
    GPUs in each of several processes, and ``ValueError`` for a group across processes without
    ``jax.distributed``; ``NotImplementedError`` when differentiated under ``check_vma=False``.
    Making a group waits at most ``timeout_s`` for its other processes, then fails. A failure
    inside the custom call, a GPU that never arrives to build the shape's plan within
    ``timeout_s`` included, surfaces as ``jax.errors.JaxRuntimeError``."""
    tuning = Tuning.of(algorithm, chunks, comm_sms, comm_ctas, backend)
    out, gathered = _run(_Op.all_gather_matmul, a, b, bias, axis_name, mesh, trans_b,
                         return_gathered, tuning, timeout_s, fp8, recompute_gathered)
    return (out, gathered) if return_gathered else out


def matmul_reduce_scatter(a, b, *, axis_name: str, mesh: Mesh | None = None, bias=None,
                          trans_b: bool = False, algorithm="auto", chunks: int = 0,
                          comm_sms: int = -1, comm_ctas: int = 0, backend="auto",
                          timeout_s: float = DEFAULT_TIMEOUT_S, fp8: str | None = None):
    """Inside ``jax.shard_map``: this shard's [m/tp, n] row block of ``sum over axis_name(a @ b)
    (+ bias)``, ``a`` [m, k/tp] and ``b`` [k/tp, n] (or [n, k/tp] with ``trans_b``) the slices
    of a row-parallel layer. The bias is added once, not once per rank.

    ``bias`` is [n]; m must be divisible by tp. ``mesh``, ``timeout_s``, the tuning and ``fp8``
    as in :func:`all_gather_matmul`. Returns the [m/tp, n] block.

    Its gradient all-gathers the product's gradient, fused with ``a``'s gradient in an
    :func:`all_gather_matmul`.

    Raises as :func:`all_gather_matmul` does (``ValueError`` at trace time, an m that tp does
    not divide included; ``NotImplementedError``; ``jax.errors.JaxRuntimeError`` from the custom
    call)."""
    tuning = Tuning.of(algorithm, chunks, comm_sms, comm_ctas, backend)
    out, _ = _run(_Op.matmul_reduce_scatter, a, b, bias, axis_name, mesh, trans_b, False, tuning,
                  timeout_s, fp8)
    return out


def matmul_all_reduce(a, b, *, axis_name: str, mesh: Mesh | None = None, bias=None,
                      trans_b: bool = False, algorithm="auto", chunks: int = 0,
                      comm_sms: int = -1, comm_ctas: int = 0, backend="auto",
                      timeout_s: float = DEFAULT_TIMEOUT_S, fp8: str | None = None):
    """Inside ``jax.shard_map``: ``sum over axis_name(a @ b) (+ bias)``, [m, n] on every shard,
    ``a`` [m, k/tp] and ``b`` [k/tp, n] (or [n, k/tp] with ``trans_b``). The bias, [n], is
    added once. ``mesh``, ``timeout_s``, the tuning and ``fp8`` as in :func:`all_gather_matmul`.
    Returns the [m, n] sum.

    Differentiable, as the module describes. Raises as :func:`all_gather_matmul` does
    (``ValueError`` at trace time, ``NotImplementedError``, ``jax.errors.JaxRuntimeError`` from
    the custom call).
    """
    tuning = Tuning.of(algorithm, chunks, comm_sms, comm_ctas, backend)
    out, _ = _run(_Op.matmul_all_reduce, a, b, bias, axis_name, mesh, trans_b, False, tuning,
                  timeout_s, fp8)
    return out


# FP8 training (fp8="tensorwise" | "rowwise" on the 16-bit ops): meshla.torch's fp8 layers'
# recipes. The operands are cast to float8 in the call (a and b to e4m3, the product's gradient
# to e5m2) with scales from their amax (an all-gathered operand's, tensorwise, the axis's
# largest), the forward and a's gradient are the scaled collective matmuls, b's gradient a local
# fp8 product (on GPUs meshla's fp8 GEMM, the FFI handler meshla_scaled_matmul).

_RECIPES = ("tensorwise", "rowwise")
_E4M3, _E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _check_fp8_call(call: _Call, a, b, bias, fp8) -> None:
    """The fp8 recipe's own rules, then the scaled ops' (the extension's, on float8 stand-ins of
    the operands and their scales) of the forward and of a's gradient, and the GEMM's of the
    backward's local fp8 products (fp8 calls are for training), so that a bad call fails where
    it is traced, in its own op's words."""
    name = call.op.name
    if fp8 not in _RECIPES:
        raise ValueError(f"{name}: fp8={fp8!r} is not one of None, 'tensorwise', 'rowwise'")
    if call.return_gathered:
        raise NotImplementedError(f"{name}: return_gathered returns the 16-bit rows, which an fp8 "
                                  "call does not gather (it moves their float8 casts)")
    rowwise = fp8 == "rowwise"

    def describe(op, a_shape, b_shape, a_dtype, tuning, bias=None, return_gathered=False):
        scales = [jax.ShapeDtypeStruct((rows if rowwise else 1,), jnp.float32)
                  for rows in (a_shape[0], b_shape[0])]
        _describe(op, jax.ShapeDtypeStruct(a_shape, a_dtype), jax.ShapeDtypeStruct(b_shape, _E4M3),
                  bias, axis=call.axis, tp=call.tp, group=None, trans_b=call.trans_b,
                  return_gathered=return_gathered, tuning=tuning, scales=scales,
                  out_dtype=a.dtype)

    describe(call.op, a.shape, b.shape, _E4M3, call.tuning,
             bias if a.dtype != jnp.float32 else None)
    # a's gradient: the product's gradient times b ([n, k] transposed: [k, n]), through the
    # conjugate collective (the all-reduce's is local).
    k, backward = b.shape[1], Tuning.of(backend=call.tuning.backend)  # as _fp8_bwd runs it
    if call.op == _Op.all_gather_matmul:
        describe(_Op.matmul_reduce_scatter, call.out_shape, (k, call.out_shape[1]), _E5M2,
                 backward)
    elif call.op == _Op.matmul_reduce_scatter:
        describe(_Op.all_gather_matmul, call.out_shape, (k, call.out_shape[1]), _E5M2, backward,
                 return_gathered=not rowwise)

    def local(m, n, contracted, out_dtype, what):
        """A local fp8 product of the backward: the product's gradient (e5m2) times e4m3."""
        try:
            _meshla.check_scaled_matmul(DTYPES[np.dtype(_E5M2)], DTYPES[np.dtype(_E4M3)],
                                        DTYPES[np.dtype(out_dtype)], m, n, contracted, rowwise)
        except (ValueError, NotImplementedError) as e:
            raise type(e)(f"{name}: {what}: {e}") from None

    n = b.shape[0]
    rows = call.out_shape[0] if call.op == _Op.all_gather_matmul else a.shape[0]
    local(n, k, rows, jnp.float32, f"b's gradient, a float8 [{n}, {rows}] @ [{k}, {rows}]ᵀ")
    if call.op != _Op.matmul_reduce_scatter:
        local(a.shape[0], k, n, a.dtype,
              f"a's gradient, a float8 [{a.shape[0]}, {n}] @ [{k}, {n}]ᵀ")


def _quantized(x, dtype, rowwise: bool, axis: str | None = None):
    """``x`` [rows, cols] as ``(q, scale)``, ``x ≈ q * scale``: q in the float8 ``dtype``, its
    largest magnitude just below the dtype's largest; ``scale`` float32, one per row ([rows]) or
    one ([1]; over ``axis``, the largest amax of its devices). As meshla.torch's layers cast (an
    all-zero row keeps a finite multiplier, so its zeros stay zeros)."""
    magnitude = jnp.abs(x).astype(jnp.float32)
    amax = jnp.max(magnitude, axis=1) if rowwise else jnp.max(magnitude).reshape(1)
    if axis is not None and not rowwise:
        amax = jax.lax.pmax(amax, axis)
    largest = float(jnp.finfo(dtype).max) * (1 - 2.0 ** -8)
    multiplier = jnp.minimum(largest / amax, jnp.finfo(jnp.float32).max)
    q = (x.astype(jnp.float32) * (multiplier[:, None] if rowwise else multiplier)).astype(dtype)
    return q, 1 / multiplier


def _local_scaled(call: _Call, a_q, a_scale, b_q, b_scale, rowwise: bool, dtype):
    """``a [m, k] @ b [n, k]ᵀ`` of float8 operands on this device, in ``dtype``. On GPUs meshla's
    fp8 GEMM (XLA's GEMM rewriter makes none of this: it ran the dequantized operands' product,
    slower than the 16-bit one); on CPUs that product, in float32 (a gradient's scale underflows
    float16)."""
    if call.group is None:
        return _dot(_dequantized(a_q, a_scale, rowwise),
                    _dequantized(b_q, b_scale, rowwise).T).astype(dtype)
    operands = (a_q, b_q, a_scale, b_scale)
    varying = frozenset().union(*map(varying_axes, operands))

    def result(shape, dtype):
        return typed(shape, dtype, varying) if varying else jax.ShapeDtypeStruct(shape, dtype)

    # The call's own workspace (XLA sees it, so calls it runs at once get their own), with room
    # to start at a 256-byte boundary.
    workspace = result(((_meshla.matmul_workspace_bytes + 256) // 4,), jnp.int32)
    out, _ = jax.ffi.ffi_call("meshla_scaled_matmul",
                              (result((a_q.shape[0], b_q.shape[0]), dtype), workspace))(
        *(as_varying(x, varying) for x in operands), rowwise=np.int32(rowwise))
    return out


def _scaled_forward(call: _Call, op, a_q, b_q, bias, scales, return_gathered: bool, tuning,
                    dtype):
    """A scaled collective matmul of float8 operands on ``call``'s group, in ``dtype`` (a
    float32 product's bias added after: fp8 GEMMs into float32 take none)."""
    fused_bias = bias if dtype != jnp.float32 else None
    scaled = _describe(op, a_q, b_q, fused_bias, axis=call.axis, tp=call.tp, group=call.group,
                       trans_b=True, return_gathered=return_gathered, tuning=tuning,
                       scales=scales, out_dtype=dtype)
    out, gathered = _forward(scaled, a_q, b_q, fused_bias, scales)
    if bias is not None and fused_bias is None:
        out = out + bias
    return out, gathered


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_collective(call: _Call, a, b, bias):
    return _fp8_fwd(call, a, b, bias)[0]


def _fp8_fwd(call: _Call, a, b, bias):
    rowwise = call.fp8 == "rowwise"
    gathers = call.op == _Op.all_gather_matmul
    a_q, a_scale = _quantized(a, _E4M3, rowwise, call.axis if gathers else None)
    b_q, b_scale = _quantized(b, _E4M3, rowwise)
    keep = gathers and not rowwise  # b's gradient takes the gathered fp8 rows, tensorwise
    out, rows = _scaled_forward(call, call.op, a_q, b_q, bias, (a_scale, b_scale), keep,
                                call.tuning, a.dtype)
    # Tensorwise, the backward transposes the forward's fp8 bytes; rowwise it casts the 16-bit
    # operands again along their other axis.
    if rowwise:
        return out, (a, b, bias, None, None, None, None)
    return out, (None, None, bias, rows if keep else a_q, a_scale, b_q, b_scale)


def _fp8_bwd(call: _Call, residuals, grad):
    if not jax_config._check_vma.value:
        raise NotImplementedError(
            f"{call.op.name}: its gradient needs jax.shard_map's check_vma=True (the default): "
            "without the varying-axes types, which cotangents to sum over the axis is unknown")
    a, b, bias, a_rows_q, a_scale, b_q, b_scale = residuals
    # A 16-bit call's a, b and product share one dtype.
    rowwise, axis, dtype = call.fp8 == "rowwise", call.axis, call.out_dtype
    tuning = Tuning.of(backend=call.tuning.backend)
    # b transposed, [k, n], as the input gradient's b operand
    bt_q, bt_scale = _quantized(b.T, _E4M3, True) if rowwise else (b_q.T, b_scale)

    def transposed(x, x_q, scale, fp8_dtype):
        """xᵀ as a float8 operand: tensorwise the cast's bytes transposed, rowwise cast again."""
        return _quantized(x.T, fp8_dtype, True) if rowwise else (x_q.T, scale)

    if call.op == _Op.all_gather_matmul:
        g_q, g_scale = _quantized(grad, _E5M2, rowwise)
        if axis in varying_axes(grad):  # each rank's own product: summed, each keeps its rows
            grad_a, _ = _scaled_forward(call, _Op.matmul_reduce_scatter, g_q, bt_q, None,
                                        (g_scale, bt_scale), False, tuning, dtype)
        else:  # the same product on every rank: this rank's rows alone
            rows_here = call.out_shape[0] // call.tp
            own, own_scale = (_own_rows(call, g_q, rows_here),
                              _own_rows(call, g_scale, rows_here) if rowwise else g_scale)
            grad_a = _local_scaled(call, own, own_scale, bt_q, bt_scale, rowwise, dtype)
        rows = all_gather_invariant(a, axis, tiled=True) if rowwise else None
        xt_q, xt_scale = transposed(rows, a_rows_q, a_scale, _E4M3)
        gt_q, gt_scale = transposed(grad, g_q, g_scale, _E5M2)
        product = _local_scaled(call, gt_q, gt_scale, xt_q, xt_scale, rowwise, jnp.float32)
        grad_b = _cotangent(product, call.varying[1], dtype)
    elif call.op == _Op.matmul_reduce_scatter:
        # The product's rows were scattered: their gradient is gathered back with a's gradient
        # (tensorwise, the fp8 rows kept for b's); both are this rank's contributions.
        g_q, g_scale = _quantized(grad, _E5M2, rowwise, axis)
        grad_a, g_rows_q = _scaled_forward(call, _Op.all_gather_matmul, g_q, bt_q, None,
                                           (g_scale, bt_scale), not rowwise, tuning, dtype)
        grad_a = as_varying(grad_a, frozenset({axis}))
        rows = all_gather_invariant(grad, axis, tiled=True) if rowwise else None
        gt_q, gt_scale = transposed(rows, g_rows_q, g_scale, _E5M2)
        at_q, at_scale = transposed(a, a_rows_q, a_scale, _E4M3)
        product = _local_scaled(call, gt_q, gt_scale, at_q, at_scale, rowwise, jnp.float32)
        grad_b = _cotangent(as_varying(product, frozenset({axis})), call.varying[1], dtype)
    else:
        # The sum's gradient (summed over the axis where a bias made it vary), every rank's
        # product's contribution.
        summed = jax.lax.psum(grad, axis) if axis in varying_axes(grad) else grad
        summed = as_varying(summed, frozenset({axis}))
        g_q, g_scale = _quantized(summed, _E5M2, rowwise)
        grad_a = _local_scaled(call, g_q, g_scale, bt_q, bt_scale, rowwise, dtype)
        gt_q, gt_scale = transposed(summed, g_q, g_scale, _E5M2)
        at_q, at_scale = transposed(a, a_rows_q, a_scale, _E4M3)
        product = _local_scaled(call, gt_q, gt_scale, at_q, at_scale, rowwise, jnp.float32)
        grad_b = _cotangent(product, call.varying[1], dtype)
    grad_a = _cotangent(grad_a, call.varying[0], dtype)
    return grad_a, grad_b, _bias_grad(call, grad, bias)


_fp8_collective.defvjp(_fp8_fwd, _fp8_bwd)

# A column-parallel layer without sequence parallelism (meshla.torch's column_parallel_matmul):
# a, the same on every rank, times this rank's column slice of b. The forward is a local
# product; a's gradient, the product's gradient times bᵀ summed over the ranks, is a
# matmul_all_reduce, the conjugate op, where JAX's differentiation of the local product would
# add a separate all-reduce (psum) after the GEMM.

@dataclasses.dataclass(frozen=True)
class _Column:
    """A column_parallel_matmul as traced: custom_vjp's non-differentiable argument."""

    backward: _Call  # a's gradient: matmul_all_reduce(the product's gradient, b)
    trans_b: bool
    varying: tuple[frozenset, frozenset, frozenset]  # the types of a, b and the bias
    dtypes: tuple[jnp.dtype, jnp.dtype]  # a's and b's (their gradients')
    fp8: str | None


def _renamed(name: str, check):
    """``check()``, its errors (the extension's words, under the op whose rules apply) beginning
    with ``name`` instead, as meshla.torch's column_parallel_matmul words them."""
    try:
        return check()
    except (ValueError, NotImplementedError) as error:
        prefix = f"{_Op.matmul_all_reduce.name}: "
        if not str(error).startswith(prefix):
            raise
        raise type(error)(f"{name}: {str(error)[len(prefix):]}") from None


def _check_column_fp8(name: str, a, b, trans_b: bool, fp8) -> None:
    """The fp8 recipe, b's layout, and the float8 GEMMs' rules for the forward's local product
    and b's gradient (a's is the scaled all-reduce, checked as the backward's call)."""
    if fp8 not in _RECIPES:
        raise ValueError(f"{name}: fp8={fp8!r} is not one of None, 'tensorwise', 'rowwise'")
    if not trans_b:  # the float8 ops' words (the extension's GEMM rule)
        raise NotImplementedError(f"{name}: float8 needs b stored [n, k] (trans_b): cuBLASLt's "
                                  "fp8 GEMM reads both operands along k")
    rowwise = fp8 == "rowwise"
    m, k, n = a.shape[0], b.shape[1], b.shape[0]
    for what, operands, rows, cols, contracted in (
            ("the product", (_E4M3, _E4M3, a.dtype), m, n, k),
            ("b's gradient", (_E5M2, _E4M3, jnp.float32), n, k, m)):
        try:
            _meshla.check_scaled_matmul(*(DTYPES[np.dtype(d)] for d in operands), rows, cols,
                                        contracted, rowwise)
        except (ValueError, NotImplementedError) as e:
            raise type(e)(f"{name}: {what}, a float8 [{rows}, {contracted}] @ "
                          f"[{cols}, {contracted}]ᵀ: {e}") from None


def column_parallel_matmul(a, b, *, axis_name: str, mesh: Mesh | None = None, bias=None,
                           trans_b: bool = False, algorithm="auto", chunks: int = 0,
                           comm_sms: int = -1, comm_ctas: int = 0, backend="auto",
                           timeout_s: float = DEFAULT_TIMEOUT_S, fp8: str | None = None):
    """Inside ``jax.shard_map``: ``a @ b (+ bias)`` for a column-parallel layer without sequence
    parallelism: ``a`` [m, k] the same on every shard of ``axis_name``, ``b`` this shard's
    [k, n] column slice ([n, k] with ``trans_b``), ``bias`` its [n]. Returns the [m, n] product
    (this shard's output columns). The forward is a local GEMM.

    Differentiable: ``a``'s gradient, summed over the axis, is the product's gradient times bᵀ
    through :func:`matmul_all_reduce` (the communication overlapped with that GEMM, with
    ``backend``, ``algorithm``, ``chunks``, ``comm_sms`` and ``comm_ctas``); ``b``'s and the
    bias's are this shard's own. The conjugate of :func:`matmul_all_reduce`, as in
    meshla.torch; with sequence parallelism, use :func:`all_gather_matmul`. Where ``a`` varies
    over the axis, or the product's gradient does not, nothing is summed and a's gradient is a
    local GEMM. ``mesh`` and ``timeout_s`` as in :func:`all_gather_matmul`.

    ``fp8="tensorwise"`` or ``"rowwise"`` computes it in float8, as the other ops' ``fp8=``
    (``b`` as [n, k], ``trans_b=True``): the forward and b's gradient local fp8 GEMMs (meshla's
    on GPUs), a's gradient the scaled all-reduce of the product's gradient in float8_e5m2.

    Raises as :func:`matmul_all_reduce` does, in this function's name (the operands follow its
    rules; a's gradient is checked as its call with the tuning); with ``fp8``, ``ValueError``
    for float8 GEMMs their rules refuse and ``NotImplementedError`` without ``trans_b``."""
    name = "column_parallel_matmul"
    tuning = Tuning.of(algorithm, chunks, comm_sms, comm_ctas, backend)
    if not isinstance(axis_name, str):
        raise ValueError(f"{name}: axis_name must be the name of a mesh axis, got {axis_name!r}")
    # The shard_map check in this op's words (the calls traced below are matmul_all_reduce's).
    _check_inside_shard_map(name, _mesh_of(name, mesh, axis_name), axis_name)
    if tuning.backend == _meshla.Backend.cublasmp and trans_b:
        raise NotImplementedError(
            f"{name}: backend=cublasmp runs a's gradient, a GEMM+AllReduce by bᵀ, only for b "
            "stored [k, n] (trans_b=False): cuBLASMp takes that product's b as [n, k] alone; "
            "use backend='nccl' or 'symmetric'")

    def traced(x, y, bias, trans_b, tuning):
        return _traced_call(_Op.matmul_all_reduce, x, y, bias, axis_name=axis_name, mesh=mesh,
                            trans_b=trans_b, return_gathered=False, tuning=tuning,
                            timeout_s=timeout_s)

    forward = _renamed(name, lambda: traced(a, b, bias, trans_b, Tuning.of()))
    n = b.shape[0] if trans_b else b.shape[1]
    grad = jax.ShapeDtypeStruct((a.shape[0], n), a.dtype)
    backward = _renamed(name, lambda: traced(grad, b, None, not trans_b, tuning))
    if fp8 is not None:
        _check_column_fp8(name, a, b, trans_b, fp8)
        # a's gradient: the scaled all-reduce of the e5m2 gradient and bᵀ ([k, n] as [n', k'])
        k = b.shape[1]
        scales = [jax.ShapeDtypeStruct((rows if fp8 == "rowwise" else 1,), jnp.float32)
                  for rows in (a.shape[0], k)]
        _renamed(name, lambda: _describe(
            _Op.matmul_all_reduce, jax.ShapeDtypeStruct(grad.shape, _E5M2),
            jax.ShapeDtypeStruct((k, n), _E4M3), None, axis=axis_name, tp=backward.tp,
            group=None, trans_b=True, return_gathered=False,
            tuning=Tuning.of(backend=tuning.backend), scales=scales, out_dtype=a.dtype))
    column = _Column(backward, trans_b, forward.varying, (a.dtype, b.dtype), fp8)
    return _column_parallel(column, a, b, bias)


def _column_product(column: _Column, a, b, bias):
    """The forward: a's local product with b, and what the backward keeps."""
    if column.fp8 is None:
        # XLA's GEMM in a's dtype, as `a @ b` would run (a float32 output would add a pass over
        # it); float32 at full precision, not TF32, as meshla's GEMMs.
        precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        out = jnp.matmul(a, b.T if column.trans_b else b, precision=precision)
        return (out if bias is None else out + bias), (a, b, bias, None)
    rowwise = column.fp8 == "rowwise"
    a_q, a_scale = _quantized(a, _E4M3, rowwise)
    b_q, b_scale = _quantized(b, _E4M3, rowwise)
    out = _local_scaled(column.backward, a_q, a_scale, b_q, b_scale, rowwise, a.dtype)
    if bias is not None:
        out = out + bias.astype(out.dtype)
    # Tensorwise, the backward transposes the forward's fp8 bytes (the 16-bit operands are let
    # go); rowwise it casts the operands again along their other axis.
    if rowwise:
        return out, (a, b, bias, None)
    return out, (None, None, bias, (a_q, a_scale, b_q, b_scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _column_parallel(column: _Column, a, b, bias):
    return _column_product(column, a, b, bias)[0]


def _column_parallel_fwd(column: _Column, a, b, bias):
    return _column_product(column, a, b, bias)


def _column_parallel_bwd(column: _Column, residuals, grad):
    call = column.backward
    if not jax_config._check_vma.value:
        raise NotImplementedError(
            "column_parallel_matmul: its gradient needs jax.shard_map's check_vma=True (the "
            "default): without the varying-axes types, which cotangents to sum over the axis is "
            "unknown")
    a, b, bias, kept = residuals
    dtype, b_dtype = column.dtypes
    # Every rank's product used the same a and its own columns: a's gradient sums their
    # contributions (the all-reduce), unless a varies over the axis or the gradient does not.
    summed = call.axis in varying_axes(grad) and call.axis not in column.varying[0]
    if column.fp8 is None:
        if summed:
            grad_a, _ = _forward(call, grad, b, None)
        else:
            grad_a = _dot(grad, b if column.trans_b else b.T)
        b_grad = _dot(grad.T, a) if column.trans_b else _dot(a.T, grad)
    else:
        rowwise = column.fp8 == "rowwise"
        g_q, g_scale = _quantized(grad, _E5M2, rowwise)
        if rowwise:  # each operand cast again along its other axis
            bt_q, bt_scale = _quantized(b.T, _E4M3, True)
            at_q, at_scale = _quantized(a.T, _E4M3, True)
            gt_q, gt_scale = _quantized(grad.T, _E5M2, True)
        else:  # the forward's and the gradient's fp8 bytes transposed
            a_q, a_scale, b_q, b_scale = kept
            bt_q, bt_scale, at_q, at_scale = b_q.T, b_scale, a_q.T, a_scale
            gt_q, gt_scale = g_q.T, g_scale
        if summed:
            grad_a, _ = _scaled_forward(call, _Op.matmul_all_reduce, g_q, bt_q, None,
                                        (g_scale, bt_scale), False,
                                        Tuning.of(backend=call.tuning.backend), dtype)
        else:
            grad_a = _local_scaled(call, g_q, g_scale, bt_q, bt_scale, rowwise, dtype)
        b_grad = _local_scaled(call, gt_q, gt_scale, at_q, at_scale, rowwise, jnp.float32)
    grad_a = _cotangent(grad_a, column.varying[0], dtype)
    grad_b = _cotangent(b_grad, column.varying[1], b_dtype)
    grad_bias = None if bias is None else _cotangent(
        jnp.sum(grad.astype(jnp.float32), axis=0), column.varying[2], bias.dtype)
    return grad_a, grad_b, grad_bias


_column_parallel.defvjp(_column_parallel_fwd, _column_parallel_bwd)


# The float8 ops: torch._scaled_mm's operands (b stored [n, k]) with their scales; no backward.

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scaled_collective(call: _Call, a, b, bias, a_scale, b_scale):
    return _forward(call, a, b, bias, (a_scale, b_scale))


def _scaled_fwd(call: _Call, a, b, bias, a_scale, b_scale):
    return _scaled_collective(call, a, b, bias, a_scale, b_scale), None


def _scaled_bwd(call: _Call, _residuals, _cotangents):
    raise NotImplementedError(f"{call.op.name}: the float8 ops have no backward yet; "
                              "differentiate the 16-bit computation, or stop the gradient "
                              "(jax.lax.stop_gradient) before the float8 operands")


_scaled_collective.defvjp(_scaled_fwd, _scaled_bwd)


def _run_scaled(op, a, b, a_scale, b_scale, bias, out_dtype, axis_name, mesh, return_gathered,
                tuning, timeout_s):
    for name, scale in (("a_scale", a_scale), ("b_scale", b_scale)):
        _check_array(op.name, name, scale)
    # The extension checks the scales' shapes as meshla.torch's; a 0-d one (a scalar) as [1].
    scales = tuple(jnp.reshape(s, (1,)) if s.ndim == 0 else s for s in (a_scale, b_scale))
    call = _traced_call(op, a, b, bias, axis_name=axis_name, mesh=mesh, trans_b=True,
                        return_gathered=return_gathered, tuning=tuning, timeout_s=timeout_s,
                        scales=scales, out_dtype=out_dtype)
    return _scaled_collective(call, a, b, bias, *scales)


def all_gather_scaled_matmul(a, b, a_scale, b_scale, *, axis_name: str, mesh: Mesh | None = None,
                             bias=None, out_dtype=jnp.bfloat16, return_gathered: bool = False,
                             algorithm="auto", chunks: int = 0, comm_sms: int = -1,
                             comm_ctas: int = 0, backend="auto",
                             timeout_s: float = DEFAULT_TIMEOUT_S):
    """Inside ``jax.shard_map``: ``all_gather(a) @ bᵀ`` in float8 with its scales,
    :func:`all_gather_matmul` on ``torch._scaled_mm``'s operands (meshla.torch's
    ``all_gather_scaled_matmul``, the same arguments and rules).

    ``a`` is this shard's [m/tp, k] rows and ``b`` [n, k] (a linear layer's weight, the one
    order fp8 GEMMs take), ``float8_e4m3fn`` or ``float8_e5m2`` (not both e5m2). ``a_scale`` and
    ``b_scale`` are float32: one value each (tensorwise; ``a_scale`` is then the whole gathered
    ``a``'s, the same on every shard), or one per row of ``a`` ([m/tp] or [m/tp, 1]) and one per
    output column ([n] or [1, n]) (rowwise, gathered with the rows):
    ``out[i, j] = a_scale[i] * b_scale[j] * sum_k a[i, k] * b[j, k] (+ bias[j])``. The fp8 rows
    (and their scales) are what travels. Returns the [m, n] product in ``out_dtype`` (bfloat16,
    float16 or float32; rowwise bfloat16 or float32; ``bias`` [n] in it, none with float32), and
    with ``return_gathered`` also the gathered [m, k] fp8 ``a`` (tensorwise only).

    ``mesh``, ``timeout_s`` and the tuning as in :func:`all_gather_matmul` (backends
    ``symmetric`` and ``nccl``). Not differentiable: ``jax.grad`` through it raises
    ``NotImplementedError``. Errors as :func:`all_gather_matmul`'s, and ``ValueError`` for a
    missing or misshapen scale or an ``out_dtype`` meshla does not take, ``NotImplementedError``
    for e5m2 x e5m2 and what fp8 GEMMs cannot take. On CPU devices a float32 reference on the
    dequantized operands."""
    tuning = Tuning.of(algorithm, chunks, comm_sms, comm_ctas, backend)
    out, gathered = _run_scaled(_Op.all_gather_matmul, a, b, a_scale, b_scale, bias, out_dtype,
                                axis_name, mesh, return_gathered, tuning, timeout_s)
    return (out, gathered) if return_gathered else out


def scaled_matmul_reduce_scatter(a, b, a_scale, b_scale, *, axis_name: str,
                                 mesh: Mesh | None = None, bias=None, out_dtype=jnp.bfloat16,
                                 algorithm="auto", chunks: int = 0, comm_sms: int = -1,
                                 comm_ctas: int = 0, backend="auto",
                                 timeout_s: float = DEFAULT_TIMEOUT_S):
    """Inside ``jax.shard_map``: this shard's [m/tp, n] rows of ``sum over axis_name(a @ bᵀ)``
    in float8 with its scales (:func:`matmul_reduce_scatter` on :func:`all_gather_scaled_matmul`'s
    operands): ``a`` [m, k/tp], ``b`` [n, k/tp], ``a_scale`` one value or one per row of ``a``
    ([m]), ``b_scale`` one value or [n]. Partial products are summed in ``out_dtype``, never in
    fp8; ``bias`` is added once. Raises as :func:`all_gather_scaled_matmul` does."""
    tuning = Tuning.of(algorithm, chunks, comm_sms, comm_ctas, backend)
    out, _ = _run_scaled(_Op.matmul_reduce_scatter, a, b, a_scale, b_scale, bias, out_dtype,
                         axis_name, mesh, False, tuning, timeout_s)
    return out


def scaled_matmul_all_reduce(a, b, a_scale, b_scale, *, axis_name: str, mesh: Mesh | None = None,
                             bias=None, out_dtype=jnp.bfloat16, algorithm="auto", chunks: int = 0,
                             comm_sms: int = -1, comm_ctas: int = 0, backend="auto",
                             timeout_s: float = DEFAULT_TIMEOUT_S):
    """Inside ``jax.shard_map``: ``sum over axis_name(a @ bᵀ)`` [m, n] in float8 with its scales
    on every shard, as :func:`scaled_matmul_reduce_scatter` but every shard gets every row.
    Raises as :func:`all_gather_scaled_matmul` does."""
    tuning = Tuning.of(algorithm, chunks, comm_sms, comm_ctas, backend)
    out, _ = _run_scaled(_Op.matmul_all_reduce, a, b, a_scale, b_scale, bias, out_dtype,
                         axis_name, mesh, False, tuning, timeout_s)
    return out

def _global(op: str, function, mesh: Mesh, axis: str, arrays, in_specs, out_specs):
    """``function`` on the shards of global ``arrays`` (a, b, bias), laid out over ``mesh`` as
    it needs; first the checks that laying them out needs (the rest are the shard call's)."""
    mesh = _mesh_of(op, mesh, axis)
    for name, x, spec in zip(("a", "b", "bias"), arrays, in_specs):
        if x is None:
            continue
        _check_array(op, name, x)
        if spec and x.ndim != len(spec):  # (P() replicates an array of any rank)
            raise ValueError(f"{op}: {name} must be a {len(spec)}-D array, got {list(x.shape)}")
        for dim, split in enumerate(spec):
            if split is not None and x.shape[dim] % mesh.shape[split]:
                raise ValueError(
                    f"{op}: {name}.shape={list(x.shape)}: dimension {dim} is split over the "
                    f"{mesh.shape[split]} devices of axis {split!r}, which do not divide "
                    f"{x.shape[dim]}")
    placed = [x if x is None else jax.device_put(x, NamedSharding(mesh, spec))
              for x, spec in zip(arrays, in_specs)]
    return jax.shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*placed)


def _weight_spec(axis: str, trans_b: bool, sharded_out: bool) -> P:
    """b's sharding: over its output columns (n) for all-gather→GEMM, its contraction rows (k)
    for the reductions; as [n, k] with ``trans_b``."""
    if sharded_out:
        return P(axis, None) if trans_b else P(None, axis)
    return P(None, axis) if trans_b else P(axis, None)


def all_gather_matmul_global(a, b, *, mesh: Mesh, axis_name: str, bias=None,
                             trans_b: bool = False, return_gathered: bool = False, **tuning):
    """:func:`all_gather_matmul` on global arrays: ``a`` [m, k] sharded by rows over
    ``axis_name``, ``b``'s output columns (and ``bias``) sharded over it. Returns [m, n] sharded
    by columns (and the gathered [m, k], replicated). Arrays laid out otherwise are moved.
    ``mesh`` is required; ``tuning`` takes :func:`all_gather_matmul`'s other keywords
    (``algorithm``, ``chunks``, ``comm_sms``, ``comm_ctas``, ``backend``, ``timeout_s``, ``fp8``,
    ``recompute_gathered``).

    Raises ``ValueError`` for an array of the wrong rank or a dimension that the devices of
    ``axis_name`` do not divide, and otherwise as :func:`all_gather_matmul` does."""
    def shard(a, b, bias):
        return all_gather_matmul(a, b, axis_name=axis_name, mesh=mesh, bias=bias,
                                 trans_b=trans_b, return_gathered=return_gathered, **tuning)

    out_spec = P(None, axis_name)
    return _global("all_gather_matmul", shard, mesh, axis_name, (a, b, bias),
                   (P(axis_name, None), _weight_spec(axis_name, trans_b, True), P(axis_name)),
                   (out_spec, P(None, None)) if return_gathered else out_spec)


def column_parallel_matmul_global(a, b, *, mesh: Mesh, axis_name: str, bias=None,
                                  trans_b: bool = False, **tuning):
    """:func:`column_parallel_matmul` on global arrays: ``a`` [m, k] replicated over
    ``axis_name``, ``b``'s output columns (and ``bias``) sharded over it. Returns [m, n] sharded
    by columns. Arrays laid out otherwise are moved. ``mesh`` is required; ``tuning`` takes
    :func:`column_parallel_matmul`'s other keywords (``algorithm``, ``chunks``, ``comm_sms``,
    ``comm_ctas``, ``backend``, ``timeout_s``, ``fp8``). Raises as
    :func:`all_gather_matmul_global` does."""
    def shard(a, b, bias):
        return column_parallel_matmul(a, b, axis_name=axis_name, mesh=mesh, bias=bias,
                                      trans_b=trans_b, **tuning)

    return _global("column_parallel_matmul", shard, mesh, axis_name, (a, b, bias),
                   (P(), _weight_spec(axis_name, trans_b, True), P(axis_name)),
                   P(None, axis_name))


def _reduction_global(function, a, b, bias, mesh: Mesh, axis_name: str, trans_b: bool,
                      out_spec: P, tuning: dict):
    def shard(a, b, bias):
        return function(a, b, axis_name=axis_name, mesh=mesh, bias=bias, trans_b=trans_b,
                        **tuning)

    return _global(function.__name__, shard, mesh, axis_name, (a, b, bias),
                   (P(None, axis_name), _weight_spec(axis_name, trans_b, False), P()), out_spec)


def matmul_reduce_scatter_global(a, b, *, mesh: Mesh, axis_name: str, bias=None,
                                 trans_b: bool = False, **tuning):
    """:func:`matmul_reduce_scatter` on global arrays: ``a`` [m, k] sharded by columns over
    ``axis_name`` and ``b``'s contraction rows with them; returns ``a @ b (+ bias)`` [m, n]
    sharded by rows. ``bias`` [n] is replicated; ``mesh`` and ``tuning`` as in
    :func:`all_gather_matmul_global`. Raises as :func:`all_gather_matmul_global` does (an array
    of the wrong rank or a dimension the axis does not divide: ``ValueError``), and as
    :func:`matmul_reduce_scatter`."""
    return _reduction_global(matmul_reduce_scatter, a, b, bias, mesh, axis_name, trans_b,
                             P(axis_name, None), tuning)


def matmul_all_reduce_global(a, b, *, mesh: Mesh, axis_name: str, bias=None,
                             trans_b: bool = False, **tuning):
    """:func:`matmul_all_reduce` on global arrays sharded as for
    :func:`matmul_reduce_scatter_global`; returns ``a @ b (+ bias)`` [m, n] replicated.
    ``mesh`` and ``tuning`` as in :func:`all_gather_matmul_global`. Raises as
    :func:`all_gather_matmul_global` does (``ValueError`` for an array of the wrong rank or a
    dimension the axis does not divide), and as :func:`matmul_all_reduce`."""
    return _reduction_global(matmul_all_reduce, a, b, bias, mesh, axis_name, trans_b,
                             P(None, None), tuning)
