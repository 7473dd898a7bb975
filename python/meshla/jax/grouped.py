"""Grouped GEMM for Mixture-of-Experts in JAX: :func:`grouped_linear`, meshla.torch's function of
that name, with its arguments, rules and words, and :func:`grouped_matmul`, ``jax.lax.ragged_dot``'s
semantics and layout.

Group ``g`` applies ``weight[g]`` (``[out, in]``, a linear layer's weight; ``[in, out]`` for
grouped_matmul's rhs, ragged_dot's ``[k, n]``) to its own contiguous slice of ``m_splits[g]`` rows
of ``x``. ``m_splits`` is int32 (``jax.lax.ragged_dot``'s group sizes) or int64, on the device:
nothing waits for it on the host. Both layouts run the same kernels (the core swaps the passes'
roles for ``[in, out]``: meshla/grouped_matmul.hpp's WeightLayout), so nothing is transposed.

On GPUs each pass (the product, and in the backward the input gradient, the weight gradient and
the bias gradient) is one XLA FFI custom call running meshla's grouped kernels (CUTLASS's Hopper
grouped GEMM for bf16 and fp16 on Hopper, meshla's portable kernel for fp32 and on other GPUs),
which only enqueues: XLA may capture it in a command buffer. On CPU devices a ``jax.numpy``
reference runs (``jax.lax.ragged_dot`` and per-group sums, accumulating in float32), so the same
program runs without GPUs.
"""

from __future__ import annotations

import atexit
import functools
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np

from meshla import _meshla
from meshla._grouped import RAGGED_NAMES
from meshla.jax._dtypes import dtype_of
from meshla.jax._ffi import register_targets
from meshla.jax._vma import as_varying, typed, varying_axes

__all__ = ["grouped_linear", "grouped_matmul"]

_PASS = _meshla.GroupedPass
_LAYOUT = _meshla.WeightLayout
# Bytes XLA may leave before the first 256-byte boundary of a workspace it allocates.
_ALIGNMENT_SLACK = 256


def _gpus_present() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _meta(name: str, x, device: int, layout):
    if layout == _LAYOUT.in_out:
        name = RAGGED_NAMES.get(name, name)
    shape = [int(d) for d in x.shape]
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]  # JAX arrays are row-major
    return _meshla.ArrayMeta(shape, strides, dtype_of(name, x), device, 0, name)


def _check(grouped_pass, m_splits, device: int, layout, **arrays) -> None:
    """The extension's checks of one pass (GroupedMatmul.run's own, on the arrays' metadata):
    meshla.torch's rules and words (grouped_matmul's for the in_out layout)."""
    _meshla.check_grouped_call(grouped_pass, _meta("m_splits", m_splits, device, layout),
                               **{name: None if a is None else _meta(name, a, device, layout)
                                  for name, a in arrays.items()}, weight_layout=layout)


_RANKS = {"x": 2, "dy": 2, "weight": 3}


def _check_ranks(grouped_pass, m_splits, device: int, layout, **operands) -> None:
    """Outputs are shaped from the operands' sizes before the pass is checked: operands of the
    wrong rank go to the checks first, which refuse them in their words (as meshla.torch's)."""
    if m_splits.ndim != 1 or any(a.ndim != _RANKS[name] for name, a in operands.items()):
        _check(grouped_pass, m_splits, device, layout, **operands)


# A GroupedMatmul per local GPU, which size the workspaces: XLA allocates a call's when it runs,
# at a size fixed when it is traced, before XLA has chosen the GPU. The largest over the GPUs (the
# size grows with the SM count) fits whichever runs it.
_sizers_lock = threading.Lock()
_sizers: list = []
atexit.register(_sizers.clear)  # before the interpreter tears the extension down


@functools.lru_cache(maxsize=None)
def _workspace_bytes(grouped_pass, layout, arrays: tuple) -> int:
    """The workspace of one pass on ``arrays``, ``(name, shape, dtype)`` of m_splits, the
    operands and the output (it grows with the rows when features run padded)."""
    with _sizers_lock:
        if not _sizers:
            _sizers.extend(_meshla.GroupedMatmul(d.local_hardware_id)
                           for d in jax.local_devices(backend="gpu"))

    def bytes_on(sizer):
        metas = {name: _meta(name, jax.ShapeDtypeStruct(shape, dtype), sizer.device, layout)
                 for name, shape, dtype in arrays}
        return sizer.workspace_bytes(grouped_pass, metas.pop("m_splits"), weight_layout=layout,
                                     **metas)

    return max(map(bytes_on, _sizers))


def _group_of_rows(m_splits, rows: int):
    """Each row's group, and whether the sizes are valid (none negative, summing to ``rows``)."""
    sizes = m_splits.astype(jnp.int32)
    groups = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows), side="right")
    valid = jnp.all(sizes >= 0) & (jnp.sum(sizes) == rows)
    return groups, valid


def _poisoned(out, valid):
    """``out``, or NaN where the group sizes were bad (as the GPU's device-side check leaves it)."""
    return jnp.where(valid, out, jnp.nan).astype(out.dtype)


def _reference(grouped_pass, m_splits, layout, **operands):
    """One pass on the CPU, in float32 (float64 stays float64); the in_out layout's weights as the
    out_in pass's, transposed (the reference may move data)."""
    if layout == _LAYOUT.in_out:
        if "weight" in operands:
            operands = {**operands, "weight": jnp.swapaxes(operands["weight"], 1, 2)}
        out = _reference(grouped_pass, m_splits, _LAYOUT.out_in, **operands)
        return jnp.swapaxes(out, 1, 2) if grouped_pass == _PASS.wgrad else out
    f32 = jnp.promote_types(jnp.float32, next(iter(operands.values())).dtype)
    if grouped_pass == _PASS.forward:
        x, weight, bias = operands["x"], operands["weight"], operands["bias"]
        groups, valid = _group_of_rows(m_splits, x.shape[0])
        y = jax.lax.ragged_dot(x, jnp.swapaxes(weight, 1, 2), m_splits.astype(jnp.int32),
                               preferred_element_type=f32)
        if bias is not None:
            y = y + bias.astype(f32)[jnp.clip(groups, 0, weight.shape[0] - 1)]
        return _poisoned(y.astype(x.dtype), valid)
    dy = operands["dy"]
    groups, valid = _group_of_rows(m_splits, dy.shape[0])
    if grouped_pass == _PASS.dgrad:
        weight = operands["weight"]
        dx = jax.lax.ragged_dot(dy, weight, m_splits.astype(jnp.int32),
                                preferred_element_type=f32)
        return _poisoned(dx.astype(dy.dtype), valid)
    num_groups = m_splits.shape[0]
    # A row of a group past the last (sizes summing to fewer rows) belongs to none.
    member = jax.nn.one_hot(groups, num_groups, dtype=f32)
    if grouped_pass == _PASS.wgrad:
        x = operands["x"]
        dweight = jnp.einsum("rg,ro,ri->goi", member, dy.astype(f32), x.astype(f32))
        return _poisoned(dweight.astype(x.dtype), valid)
    dbias = member.T @ dy.astype(f32)
    return _poisoned(dbias.astype(dy.dtype), valid)


# Each pass's custom call and the name of its output.
_OUTPUTS = {_PASS.forward: "y", _PASS.dgrad: "dx", _PASS.wgrad: "dweight",
            _PASS.bias_grad: "dbias"}
_TARGETS = {_PASS.forward: "meshla_grouped_forward", _PASS.dgrad: "meshla_grouped_dgrad",
            _PASS.wgrad: "meshla_grouped_wgrad", _PASS.bias_grad: "meshla_grouped_bias_grad"}


def _on_gpu(grouped_pass, m_splits, out_shape, lead, layout, named, operands):
    """The pass's custom call; ``named`` holds the metadata of every array it checks (m_splits,
    the given operands and the output), from which its workspace is sized."""
    workspace = _workspace_bytes(grouped_pass, layout, named) + _ALIGNMENT_SLACK
    # Inside shard_map (experts split over a mesh axis) one custom call takes operands of one
    # type, and its results vary over every axis an operand does, as the reference's would.
    arrays = (m_splits, *operands)
    varying = frozenset().union(*map(varying_axes, arrays))
    arrays = [as_varying(a, varying) for a in arrays]

    def result(shape, dtype):
        return typed(shape, dtype, varying) if varying else jax.ShapeDtypeStruct(shape, dtype)

    results = (result(out_shape, lead.dtype), result(((workspace + 3) // 4,), jnp.int32))
    # The weight_layout attribute is the core's WeightLayout (the bias gradient's names the
    # function in its group-size errors).
    out, _ = jax.ffi.ffi_call(_TARGETS[grouped_pass], results)(
        *arrays, weight_layout=np.int32(layout.value))
    return out


def _pass(grouped_pass, m_splits, out_shape, lead, layout, **operands):
    """One pass: checked now (its output's shape included), run by the extension on GPUs and by
    the reference on CPUs."""
    gpus = _gpus_present()
    output = {_OUTPUTS[grouped_pass]: jax.ShapeDtypeStruct(out_shape, lead.dtype)}
    _check(grouped_pass, m_splits, 0 if gpus else -1, layout, **operands, **output)
    named = tuple((name, tuple(a.shape), jnp.dtype(a.dtype).name)
                  for name, a in {"m_splits": m_splits, **operands, **output}.items()
                  if a is not None)

    def reference(m_splits, *arrays):
        return _reference(grouped_pass, m_splits, layout, **_named(operands, arrays))

    if not gpus:
        return reference(m_splits, *operands.values())
    register_targets()
    # An absent bias is a zero-size operand of the custom call.
    arrays = [jnp.zeros((0,), lead.dtype) if a is None else a for a in operands.values()]
    return jax.lax.platform_dependent(
        m_splits, *arrays, cpu=lambda m, *a: reference(m, *_absent_as_none(operands, a)),
        cuda=lambda m, *a: _on_gpu(grouped_pass, m, out_shape, lead, layout, named, a))


def _named(operands: dict, arrays) -> dict:
    return dict(zip(operands, arrays))


def _absent_as_none(operands: dict, arrays):
    return [None if given is None else a for given, a in zip(operands.values(), arrays)]


def _out_features(weight, layout) -> int:
    return weight.shape[2 if layout == _LAYOUT.in_out else 1]


def _forward(x, m_splits, weight, bias, layout):
    _check_ranks(_PASS.forward, m_splits, 0 if _gpus_present() else -1, layout, x=x,
                 weight=weight)
    return _pass(_PASS.forward, m_splits, (x.shape[0], _out_features(weight, layout)), x, layout,
                 x=x, weight=weight, bias=bias)


def _check_concrete_sizes(x, m_splits, weight, bias, layout) -> None:
    """An eager call's group sizes on the CPU, checked before anything runs (as meshla.torch's CPU
    path does, in the device-side check's words), after the shapes they are checked against.
    Sizes on a GPU are read there only, as in meshla.torch: nothing waits for them."""
    if isinstance(m_splits, jax.core.Tracer):
        return
    if isinstance(m_splits, jax.Array) and any(d.platform != "cpu" for d in m_splits.devices()):
        return
    device = 0 if _gpus_present() else -1
    _check_ranks(_PASS.forward, m_splits, device, layout, x=x, weight=weight)
    _check(_PASS.forward, m_splits, device, layout, x=x, weight=weight, bias=bias,
           y=jax.ShapeDtypeStruct((x.shape[0], _out_features(weight, layout)), x.dtype))
    _meshla.check_group_sizes(np.asarray(m_splits).tolist(), x.shape[0], weight_layout=layout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped(x, m_splits, weight, bias, layout):
    return _forward(x, m_splits, weight, bias, layout)


def _grouped_fwd(x, m_splits, weight, bias, layout):
    return _forward(x, m_splits, weight, bias, layout), (x, m_splits, weight, bias)


def _cotangent(ct, primal):
    """``ct`` as the cotangent of ``primal`` inside shard_map: summed over the axes it varies
    over and the primal does not (a weight the same on every device, used by each with its own
    rows: JAX's differentiation of the reference sums the same way)."""
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    return (jax.lax.psum(ct, extra) if extra else ct).astype(primal.dtype)


def _grouped_bwd(layout, residuals, dy):
    x, m_splits, weight, bias = residuals
    num_groups, out_features = weight.shape[0], _out_features(weight, layout)
    dx = _pass(_PASS.dgrad, m_splits, x.shape, dy, layout, dy=dy, weight=weight)
    dweight = _pass(_PASS.wgrad, m_splits, weight.shape, x, layout, x=x, dy=dy)
    dbias = None
    if bias is not None:
        dbias = _cotangent(_pass(_PASS.bias_grad, m_splits, (num_groups, out_features), dy,
                                 layout, dy=dy), bias)
    # Group sizes are integers: their cotangent is float0.
    return (_cotangent(dx, x), np.zeros(m_splits.shape, jax.dtypes.float0),
            _cotangent(dweight, weight), dbias)


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _checked_call(function: str, names, x, sizes, weight, bias, layout):
    """Both public functions' framework checks (arrays; one dtype, in words as meshla.torch's),
    then the core's checks of an eager call's sizes, then the call. ``names``: x's, the sizes',
    the weights' and how a dtype mismatch names the weights ("the weights are")."""
    x_name, sizes_name, weight_name, weights_are = names
    for name, a in ((x_name, x), (sizes_name, sizes), (weight_name, weight)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise ValueError(f"{function}: {name} must be an array, got {type(a).__name__}")
    if x.dtype != weight.dtype:
        raise ValueError(f"{function}: {x_name} is {x.dtype} but {weights_are} {weight.dtype}; "
                         "they must match")
    _check_concrete_sizes(x, sizes, weight, bias, layout)
    return _grouped(x, sizes, weight, bias, layout)


def grouped_linear(x, m_splits, weight, bias=None):
    """``y[rows of group g] = x[rows of group g] @ weight[g].T (+ bias[g])``.

    ``x`` is ``[rows, in]``, ``weight`` ``[G, out, in]``, ``bias`` ``[G, out]``, ``m_splits``
    int32 or int64 ``[G]`` summing to ``rows`` (groups may be empty). bfloat16, float16 or float32,
    the same for x, the weights and the bias. Differentiable in x, weight and bias
    (``jax.grad``, ``jax.checkpoint``): the input gradient is the grouped product with the
    weights, the weight gradient the per-group ``dyᵀ x`` (zero for an empty group), the bias
    gradient the per-group sum of ``dy``. Returns ``y``, ``[rows, out]``, in x's dtype.

    Raises ``ValueError`` when traced, naming the argument and the shapes in meshla.torch's
    words, for: x and the weights in different dtypes, a dtype other than bfloat16, float16 or
    float32, and shapes that do not fit together (on CPUs too, so that a program refused on a
    GPU is refused everywhere). On Hopper, 16-bit in or out features that are not multiples of 8
    (rows TMA cannot read) run on zero-padded copies in the workspace. Group sizes that are
    negative or do not sum to ``rows`` raise ``ValueError`` at once in an eager call on the CPU;
    under ``jax.jit``, and on a GPU, the call's outputs are NaN, and on a GPU the next grouped
    call that its handler runs on that GPU fails with ``jax.errors.JaxRuntimeError`` in the same
    words (the sizes are read on the device only).
    Inside an XLA command buffer a replay does not run the handler, so there the NaN may be all
    that shows until a call outside one.
    """
    return _checked_call("grouped_linear", ("x", "m_splits", "weight", "the weights are"), x,
                         m_splits, weight, bias, _LAYOUT.out_in)


def grouped_matmul(lhs, rhs, group_sizes, bias=None, *, transpose_rhs=False):
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes)`` (+ ``bias[g]`` on the rows of group ``g``).

    ``lhs`` is ``[m, k]``, its rows in group order; ``rhs`` ``[G, k, n]`` (ragged_dot's layout),
    or ``[G, n, k]`` with ``transpose_rhs=True`` (a linear layer's weights: then this is
    :func:`grouped_linear`, in its words); ``group_sizes`` int32 or int64 ``[G]`` on the device,
    summing to ``m`` (groups may be empty); ``bias`` ``[G, n]``. bfloat16, float16 or float32, the
    same for every operand. Returns ``[m, n]`` in lhs's dtype, accumulated in float32.

    Differentiable in lhs, rhs and bias through meshla's passes (``jax.grad``,
    ``jax.checkpoint``): the gradient of rhs is the per-group ``lhs_gᵀ d_out_g``, zero for an
    empty group. The checks, the rules on group sizes (NaN outputs and a later call's error under
    ``jax.jit``) and the padded runs of 16-bit feature sizes that are not multiples of 8 are
    :func:`grouped_linear`'s, in grouped_matmul's words (lhs, rhs, out, group_sizes), except bad
    group sizes, which are reported in grouped_linear's (m_splits), as in meshla.torch: the
    device-side check that finds them serves both.
    """
    if transpose_rhs:
        return grouped_linear(lhs, group_sizes, rhs, bias)
    return _checked_call("grouped_matmul", ("lhs", "group_sizes", "rhs", "rhs is"), lhs,
                         group_sizes, rhs, bias, _LAYOUT.in_out)
