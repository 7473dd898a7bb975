"""Grouped GEMM for Mixture-of-Experts on PyTorch.

Group ``g`` of a grouped linear applies ``weight[g]`` (``[out, in]``, a ``torch.nn.Linear`` weight)
to its own contiguous slice of ``m_splits[g]`` rows of ``x``. ``m_splits`` is an int64 (or int32)
tensor on the same device as ``x``: it is read only by the GPU, so no call waits for the device
and every call can be captured in a CUDA graph.

Ops (``torch.ops.meshla.*``, with fake implementations for ``torch.compile``; they carry no
autograd of their own: :func:`grouped_linear` and :class:`GroupedLinear` differentiate through
them):

- ``grouped_mm(x, m_splits, weight, bias, in_out=False)``: ``y_g = x_g @ weight[g].T (+ bias[g])``
  (``x_g @ weight[g]`` with ``in_out``: weights ``[G, in, out]``, torch._grouped_mm's layout)
- ``grouped_mm_dgrad(dy, m_splits, weight, in_out=False)``: ``dx_g = dy_g @ weight[g]`` (``@
  weight[g].T`` with ``in_out``)
- ``grouped_mm_wgrad(x, dy, m_splits, group_stride, in_out=False)``: every ``dW_g = dy_g.T @ x_g``
  (``x_g.T @ dy_g`` with ``in_out``) in one packed flat buffer, group ``g`` at element
  ``g * group_stride``
- ``grouped_mm_wgrad_accumulate_(x, dy, m_splits, main_grads)``: ``main_grads[g] += dy_g.T @ x_g``
  for a list of G fp32 ``[out, in]`` tensors, each anywhere (a framework's gradient buffer)
- ``grouped_bias_grad(dy, m_splits, num_groups, in_out=False)``: ``db_g`` = the sum of dy_g's rows

Errors that need ``m_splits`` (a negative size, sizes not summing to the rows of ``x``) are found
on the device: the failing call fills its outputs with NaN and the next grouped call on that device
raises ``ValueError``; :func:`check_device_errors` waits and raises at once.

CPU tensors run a per-group torch reference, so code and tests run without a GPU. The extension
checks both paths' calls by the same rules (shapes, dtypes, alignment, and on the CPU the group
sizes at once), so a call the GPU would refuse is refused on the CPU, in the same words.
"""

import atexit
import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from meshla import _meshla
from meshla._grouped import RAGGED_NAMES
from meshla.torch._dtypes import DTYPES, meta
from meshla.torch._library import capsule, current_stream, op, workspace
from meshla.torch._main_grad import added_to_main_grad, main_grad_buffer, overwrites_main_grad

__all__ = ["GroupedLinear", "check_device_errors", "grouped_linear", "grouped_matmul",
           "packed_group_stride"]

_PASS = _meshla.GroupedPass
_LAYOUT = _meshla.WeightLayout

# One GroupedMatmul per CUDA device index: it holds the host-mapped record that the device-side
# checks of m_splits write into.
_engines: dict[int, _meshla.GroupedMatmul] = {}
# Freed before the interpreter tears the extension down.
atexit.register(_engines.clear)


def _engine(index: int) -> _meshla.GroupedMatmul:
    engine = _engines.get(index)
    if engine is None:
        engine = _engines[index] = _meshla.GroupedMatmul(index)
    return engine


# Workspace bytes per (device index, pass, dtype, accumulate, groups and every operand's shape):
# see _run.
_workspace_sizes: dict[tuple, int] = {}
# At most this many: the key holds the rows, which an MoE layer's token count may change every
# step; the cache is emptied when it is full (a size costs a check and a query to recompute).
_WORKSPACE_SIZES_KEPT = 256


def _layout(in_out: bool):
    return _LAYOUT.in_out if in_out else _LAYOUT.out_in


def _named(name: str, layout) -> str:
    """How the core's checks name an operand: grouped_matmul's words for the in_out layout."""
    return RAGGED_NAMES.get(name, name) if layout == _LAYOUT.in_out else name


def _metas(tensors: dict, layout) -> dict:
    return {name: t if isinstance(t, _meshla.ArrayMeta) else meta(_named(name, layout), t)
            for name, t in tensors.items()}


def _check_call(grouped_pass, m_splits, accumulate=False, layout=_LAYOUT.out_in, **tensors):
    """The extension's checks of one pass on the tensors' metadata (GroupedMatmul.run's own, for
    CPU tensors too): the reference path refuses what the CUDA path would, in the same words."""
    _meshla.check_grouped_call(grouped_pass, meta(_named("m_splits", layout), m_splits),
                               accumulate=accumulate, weight_layout=layout,
                               **_metas(tensors, layout))


_RANKS = {"x": 2, "dy": 2, "weight": 3}


def _check_ranks(grouped_pass, m_splits, layout=_LAYOUT.out_in, **operands):
    """The ops read their operands' sizes to make their outputs before the extension checks the
    call: operands of the wrong rank are sent to those checks first, which refuse them (ranks come
    before outputs there) in their words."""
    if m_splits.dim() != 1 or any(t.dim() != _RANKS[name] for name, t in operands.items()):
        _check_call(grouped_pass, m_splits, layout=layout, **operands)


def _cpu_groups(m_splits, rows, layout):
    """(start, size) of each group, after the device-side check's rules on the sizes (in the
    words of ``layout``'s function)."""
    sizes = m_splits.tolist()
    _meshla.check_group_sizes(sizes, rows, weight_layout=layout)
    return list(zip(itertools.accumulate(sizes, initial=0), sizes))


@torch.compiler.assume_constant_result
def packed_group_stride(out_features: int, in_features: int, dtype: torch.dtype) -> int:
    """Elements between the groups of a packed ``[G, out, in]`` buffer whose groups each start
    on a 256-byte boundary. Raises ``ValueError`` for sizes below 1 or a dtype meshla does not
    take."""
    if dtype not in DTYPES:
        raise ValueError(f"packed_group_stride: dtype {dtype} is not one meshla takes")
    return _meshla.packed_group_stride(out_features, in_features, DTYPES[dtype])


def check_device_errors(device=None) -> None:
    """Waits for every stream of ``device`` (a delayed weight gradient may run on a side stream)
    and raises the error that a grouped call's device-side check of ``m_splits`` recorded there,
    if any. Call it before an optimizer step to keep NaN from a bad ``m_splits`` out of the
    weights: otherwise the error surfaces at the next grouped call. Without a GPU (and no
    ``device`` named) no grouped call ran on one, and there is nothing to check."""
    if device is None and not torch.cuda.is_available():
        return
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else (
        torch.device(device))
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(index)
    _engine(index).check_device_errors(current_stream(index))


def _run(grouped_pass, m_splits, lead, accumulate=False, layout=_LAYOUT.out_in, **tensors):
    """Runs one pass on the current stream of ``lead``'s device with a workspace from the caching
    allocator, so concurrent calls on different streams never share one. Sizing the workspace
    is host work every call would repeat: the size is kept per device, pass, accumulate and the
    operands' shapes and dtypes (it grows with the rows when features run padded), and sizing a
    new key checks the call (run() checks every call, but the size is needed before it)."""
    index = lead.get_device()
    key = (index, grouped_pass, accumulate, layout, m_splits.shape[0],
           *((name, t.dtype, *t.shape) for name, t in tensors.items() if t is not None))
    size = _workspace_sizes.get(key)
    if size is None:
        if len(_workspace_sizes) >= _WORKSPACE_SIZES_KEPT:  # token counts that keep changing
            _workspace_sizes.clear()
        size = _workspace_sizes[key] = _engine(index).workspace_bytes(
            grouped_pass, meta(_named("m_splits", layout), m_splits), accumulate=accumulate,
            weight_layout=layout,
            **_metas({name: t for name, t in tensors.items() if t is not None}, layout))
    _engine(index).run(grouped_pass, capsule(m_splits), capsule(workspace(size, lead.device)),
                       current_stream(index), accumulate=accumulate, weight_layout=layout,
                       **{name: capsule(t) for name, t in tensors.items()})


def _as_out_in(weight, in_out: bool):
    """Group g's weight as an [out, in] matrix (a view)."""
    return weight.transpose(-1, -2) if in_out else weight


@op("grouped_mm(Tensor x, Tensor m_splits, Tensor weight, Tensor? bias, bool in_out=False) "
    "-> Tensor")
def _grouped_mm(x, m_splits, weight, bias, in_out=False):
    layout = _layout(in_out)
    _check_ranks(_PASS.forward, m_splits, layout, x=x, weight=weight)
    y = x.new_empty(x.shape[0], _as_out_in(weight, in_out).shape[1])
    if x.device.type == "cpu":
        _check_call(_PASS.forward, m_splits, layout=layout, x=x, weight=weight, bias=bias, y=y)
        for g, (start, size) in enumerate(_cpu_groups(m_splits, x.shape[0], layout)):
            rows = x[start:start + size] @ _as_out_in(weight, in_out)[g].T
            y[start:start + size] = rows if bias is None else rows + bias[g]
        return y
    _run(_PASS.forward, m_splits, x, layout=layout, x=x, weight=weight, bias=bias, y=y)
    return y


@torch.library.register_fake("meshla::grouped_mm")
def _(x, m_splits, weight, bias, in_out=False):
    return x.new_empty(x.shape[0], _as_out_in(weight, in_out).shape[1])


@op("grouped_mm_dgrad(Tensor dy, Tensor m_splits, Tensor weight, bool in_out=False) -> Tensor")
def _grouped_mm_dgrad(dy, m_splits, weight, in_out=False):
    layout = _layout(in_out)
    _check_ranks(_PASS.dgrad, m_splits, layout, dy=dy, weight=weight)
    dx = dy.new_empty(dy.shape[0], _as_out_in(weight, in_out).shape[2])
    if dy.device.type == "cpu":
        _check_call(_PASS.dgrad, m_splits, layout=layout, dy=dy, weight=weight, dx=dx)
        for g, (start, size) in enumerate(_cpu_groups(m_splits, dy.shape[0], layout)):
            dx[start:start + size] = dy[start:start + size] @ _as_out_in(weight, in_out)[g]
        return dx
    _run(_PASS.dgrad, m_splits, dy, layout=layout, dy=dy, weight=weight, dx=dx)
    return dx


@torch.library.register_fake("meshla::grouped_mm_dgrad")
def _(dy, m_splits, weight, in_out=False):
    return dy.new_empty(dy.shape[0], _as_out_in(weight, in_out).shape[2])


def _packed(flat, num_groups, rows, columns, group_stride):
    return flat.as_strided((num_groups, rows, columns), (group_stride, columns, 1))


@op("grouped_mm_wgrad(Tensor x, Tensor dy, Tensor m_splits, SymInt group_stride, "
    "bool in_out=False) -> Tensor")
def _grouped_mm_wgrad(x, dy, m_splits, group_stride, in_out=False):
    """Every dW_g into one packed buffer: [out, in] matrices, or [in, out] with ``in_out``."""
    layout = _layout(in_out)
    _check_ranks(_PASS.wgrad, m_splits, layout, x=x, dy=dy)
    num_groups, out_features, in_features = m_splits.shape[0], dy.shape[1], x.shape[1]
    flat = x.new_empty(num_groups * group_stride)
    dweight = (_packed(flat, num_groups, in_features, out_features, group_stride) if in_out else
               _packed(flat, num_groups, out_features, in_features, group_stride))
    if x.device.type == "cpu":
        _check_call(_PASS.wgrad, m_splits, layout=layout, x=x, dy=dy, dweight=dweight)
        for g, (start, size) in enumerate(_cpu_groups(m_splits, x.shape[0], layout)):
            _as_out_in(dweight, in_out)[g] = dy[start:start + size].T @ x[start:start + size]
        return flat
    _run(_PASS.wgrad, m_splits, x, layout=layout, x=x, dy=dy, dweight=dweight)
    return flat


@torch.library.register_fake("meshla::grouped_mm_wgrad")
def _(x, dy, m_splits, group_stride, in_out=False):
    return x.new_empty(m_splits.shape[0] * group_stride)


def _check_main_grads(main_grads, m_splits, x, dy):
    shape = (dy.shape[1], x.shape[1])
    if len(main_grads) != m_splits.shape[0]:
        raise ValueError(f"grouped_linear wgrad: {len(main_grads)} main_grads for "
                         f"{m_splits.shape[0]} groups")
    for g, grad in enumerate(main_grads):
        if (grad.dtype != torch.float32 or tuple(grad.shape) != shape or not grad.is_contiguous()
                or grad.device != x.device or (grad.is_cuda and grad.data_ptr() % 16)):
            raise ValueError(
                f"grouped_linear wgrad: main_grads[{g}] is {grad.dtype} {list(grad.shape)} on "
                f"{grad.device} (contiguous: {grad.is_contiguous()}, address % 16 = "
                f"{grad.data_ptr() % 16}); expected a contiguous float32 {list(shape)} on "
                f"{x.device} starting on a 16-byte boundary")


# The device tables of main_grad addresses by (device index, addresses): a framework's gradient
# buffer stays put, so each set is copied to the device once. Never evicted: a captured graph,
# or a kernel still queued on another stream, may read a table long after its last call (a few
# hundred bytes each; one per distinct set of main_grad tensors).
_address_tables: dict[tuple, torch.Tensor] = {}


def _address_table(main_grads, m_splits, x, dy) -> torch.Tensor:
    """The device table of the main_grads' addresses, checked in full (_check_main_grads) when
    the set is new. A set seen before keeps its device and alignment, so a call with it checks
    only dtype, shape and layout again: the full check of 128 tensors took 215 us of host time a
    call, this about 120."""
    addresses = tuple(t.data_ptr() for t in main_grads)
    key = (x.device.index, addresses)
    table = _address_tables.get(key)
    shape = (dy.shape[1], x.shape[1])
    if table is not None and all(t.dtype == torch.float32 and t.shape == shape and
                                 t.is_contiguous() for t in main_grads):
        return table
    _check_main_grads(main_grads, m_splits, x, dy)
    if table is None:
        if torch.cuda.is_current_stream_capturing():
            # A table made here would hold its addresses only once the graph replays.
            raise ValueError("grouped_linear wgrad: these main_grad tensors were never used "
                             "outside a CUDA graph capture; run one step eagerly first (a "
                             "warm-up) so that their addresses reach the device")
        table = _address_tables[key] = torch.tensor(addresses, dtype=torch.int64,
                                                    device=x.device)
    return table


@op("grouped_mm_wgrad_accumulate_(Tensor x, Tensor dy, Tensor m_splits, "
     "Tensor(a!)[] main_grads) -> ()")
def _grouped_mm_wgrad_accumulate(x, dy, m_splits, main_grads):
    _check_ranks(_PASS.wgrad, m_splits, x=x, dy=dy)
    if x.device.type == "cpu":
        # The main_grads first, as the CUDA path's address table does; then the call with that
        # table as its check sees it.
        _check_main_grads(main_grads, m_splits, x, dy)
        addresses = _meshla.ArrayMeta([len(main_grads)], [1], _meshla.DType.int64, -1)
        _check_call(_PASS.wgrad, m_splits, accumulate=True, x=x, dy=dy,
                    dweight_addresses=addresses)
        for g, (start, size) in enumerate(_cpu_groups(m_splits, x.shape[0], _LAYOUT.out_in)):
            main_grads[g] += (dy[start:start + size].T @ x[start:start + size]).float()
        return
    _run(_PASS.wgrad, m_splits, x, x=x, dy=dy,
         dweight_addresses=_address_table(main_grads, m_splits, x, dy), accumulate=True)


@torch.library.register_fake("meshla::grouped_mm_wgrad_accumulate_")
def _(x, dy, m_splits, main_grads):
    return None


@op("grouped_bias_grad(Tensor dy, Tensor m_splits, SymInt num_groups, bool in_out=False) "
    "-> Tensor")
def _grouped_bias_grad(dy, m_splits, num_groups, in_out=False):
    """``in_out``: for grouped_matmul's gradient (its words in errors); the sums are the same."""
    layout = _layout(in_out)
    _check_ranks(_PASS.bias_grad, m_splits, layout, dy=dy)
    dbias = dy.new_empty(num_groups, dy.shape[1])
    if dy.device.type == "cpu":
        _check_call(_PASS.bias_grad, m_splits, layout=layout, dy=dy, dbias=dbias)
        for g, (start, size) in enumerate(_cpu_groups(m_splits, dy.shape[0], layout)):
            dbias[g] = dy[start:start + size].sum(
                0, dtype=torch.promote_types(dy.dtype, torch.float32))
        return dbias
    _run(_PASS.bias_grad, m_splits, dy, layout=layout, dy=dy, dbias=dbias)
    return dbias


@torch.library.register_fake("meshla::grouped_bias_grad")
def _(dy, m_splits, num_groups, in_out=False):
    return dy.new_empty(num_groups, dy.shape[1])


def _weight_grad(x, dy, m_splits, num_groups, dtype, in_out=False):
    """All dW_g in one packed buffer from the caching allocator, as a [G, out, in] view (with
    ``in_out``, [G, in, out]) whose groups start on 256-byte boundaries."""
    rows, columns = (x.shape[1], dy.shape[1]) if in_out else (dy.shape[1], x.shape[1])
    stride = packed_group_stride(rows, columns, dtype)
    flat = _grouped_mm_wgrad(x, dy, m_splits, stride, in_out)
    return _packed(flat, num_groups, rows, columns, stride)


def _forward_saving_inputs(ctx, x, m_splits, weight, bias, in_out=False):
    """The forward op of both autograd Functions below, keeping what their backward needs."""
    ctx.save_for_backward(x, m_splits, weight)
    ctx.has_bias, ctx.in_out = bias is not None, in_out
    return _grouped_mm(x, m_splits, weight, bias, in_out)


class _GroupedMatmulFunction(torch.autograd.Function):
    """Autograd of :func:`grouped_linear` and :func:`grouped_matmul`."""

    @staticmethod
    def forward(ctx, x, m_splits, weight, bias, in_out):
        return _forward_saving_inputs(ctx, x, m_splits, weight, bias, in_out)

    @staticmethod
    @once_differentiable  # the backward ops have no autograd: a double backward raises
    def backward(ctx, dy):
        x, m_splits, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dweight = dbias = None
        if ctx.needs_input_grad[0]:
            dx = _grouped_mm_dgrad(dy, m_splits, weight, ctx.in_out)
        if ctx.needs_input_grad[2]:
            dweight = _weight_grad(x, dy, m_splits, weight.shape[0], weight.dtype, ctx.in_out)
        if ctx.has_bias and ctx.needs_input_grad[3]:
            dbias = _grouped_bias_grad(dy, m_splits, weight.shape[0], ctx.in_out)
        return dx, None, dweight, dbias, None


def _check_same_dtype(where, x, weight, x_name="x", weights_are="the weights are"):
    """The kernels take one dtype for x and the weights. Under torch.autocast the usual mismatch
    is bf16 activations beside fp32 weights: autocast does not cast these ops' inputs."""
    if x.dtype != weight.dtype:
        hint = (f" (torch.autocast is on, and it does not cast {where}'s inputs: keep the "
                "weights in the activations' dtype)" if torch.is_autocast_enabled(x.device.type)
                else "")
        raise ValueError(f"{where}: {x_name} is {x.dtype} but {weights_are} {weight.dtype}; they "
                         f"must match{hint}")


def grouped_linear(x: torch.Tensor, m_splits: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y[rows of group g] = x[rows of group g] @ weight[g].T (+ bias[g])``.

    ``x`` is ``[rows, in]``, ``weight`` ``[G, out, in]`` (contiguous rows, any group stride),
    ``bias`` ``[G, out]``, ``m_splits`` int64 or int32 ``[G]`` on x's device summing to ``rows``.
    Differentiable in x, weight and bias (once: the backward is not itself differentiable). The
    weight gradient is computed into one packed buffer whose groups start on 256-byte boundaries
    and handed to autograd as a ``[G, out, in]`` view of it; autograd copies it into the weight's
    own layout where it accumulates the ``.grad`` of a leaf whose strides differ. Returns ``y``,
    ``[rows, out]``.

    Raises ``ValueError`` naming the argument and the shapes, on CPU and CUDA tensors alike, for:
    x and the weights in different dtypes (with a hint when torch.autocast is on, which does not
    cast these inputs), a dtype other than bfloat16, float16 or float32, shapes that do not fit
    together, operands on other devices than ``m_splits``, and 16-bit operands used in place that
    do not start on 16-byte boundaries (TMA's rule, kept on every GPU). On Hopper, 16-bit in or
    out features that are not multiples of 8 run on zero-padded copies in the workspace (slower
    by those copies). Group sizes that are negative or do not sum to ``rows`` raise at once on
    the CPU; on a GPU they are found on the
    device, the call's outputs are filled with NaN, and the next grouped call on that device (or
    :func:`check_device_errors`) raises."""
    _check_same_dtype("grouped_linear", x, weight)
    return _GroupedMatmulFunction.apply(x.contiguous(), m_splits, weight, bias, False)


def grouped_matmul(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor,
                   bias: Optional[torch.Tensor] = None, *,
                   transpose_rhs: bool = False) -> torch.Tensor:
    """``out[rows of group g] = lhs[rows of group g] @ rhs[g] (+ bias[g])``: torch._grouped_mm's
    and jax.lax.ragged_dot's layout (meshla.jax.grouped_matmul's, in its words).

    ``lhs`` is ``[m, k]``, its rows in group order; ``rhs`` ``[G, k, n]`` (contiguous rows), or
    ``[G, n, k]`` with ``transpose_rhs=True`` (a linear layer's weights: then this is
    :func:`grouped_linear`, in its words); ``group_sizes`` int64 or int32 ``[G]`` on lhs's device
    summing to ``m`` (groups may be empty); ``bias`` ``[G, n]``. bfloat16, float16 or float32,
    the same for every operand. Returns ``[m, n]`` in lhs's dtype, accumulated in float32.
    Differentiable in lhs, rhs and bias (once); rhs's gradient comes in one packed buffer as
    :func:`grouped_linear`'s does, zero for an empty group. The same kernels as
    :func:`grouped_linear` (the core swaps the passes' roles: nothing is transposed), and its
    errors, in grouped_matmul's words (lhs, rhs, out, group_sizes), except bad group sizes,
    which are reported in grouped_linear's (m_splits), as in meshla.jax: the device-side check
    that finds them serves both."""
    if transpose_rhs:
        return grouped_linear(lhs, group_sizes, rhs, bias)
    _check_same_dtype("grouped_matmul", lhs, rhs, "lhs", "rhs is")
    return _GroupedMatmulFunction.apply(lhs.contiguous(), group_sizes, rhs, bias, True)


@dataclass(eq=False)
class _DelayedWgrad:
    """Inputs of weight gradients whose computation the module was asked to delay."""

    pending: list = field(default_factory=list)


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, weight, bias, module, *parameters):
        ctx.module = module
        return _forward_saving_inputs(ctx, x, m_splits, weight, bias)

    @staticmethod
    @once_differentiable  # the backward ops have no autograd: a double backward raises
    def backward(ctx, dy):
        x, m_splits, weight = ctx.saved_tensors
        module = ctx.module
        num_groups = weight.shape[0]
        dy = dy.contiguous()
        dx = _grouped_mm_dgrad(dy, m_splits, weight) if ctx.needs_input_grad[0] else None
        # forward's inputs: x, m_splits, weight, bias, module, then the weights and the biases.
        wants_weight = ctx.needs_input_grad[5:5 + num_groups]
        wants_bias = ctx.needs_input_grad[5 + num_groups:]
        weight_grads = [None] * num_groups
        # Frozen experts (requires_grad=False) get no gradient; with fuse_wgrad_accumulation every
        # expert must train or none (_weight_grads).
        if any(wants_weight) and module.delay_wgrad_compute:
            event = torch.cuda.Event() if dy.is_cuda else None
            if event is not None:
                event.record(torch.cuda.current_stream(dy.device))
            module._delayed.pending.append((x, dy, m_splits, event))
        elif any(wants_weight):
            weight_grads = module._weight_grads(x, dy, m_splits)
            if module.fuse_wgrad_accumulation:
                weight_grads = [added_to_main_grad(weight) for weight in module.weights()]
            weight_grads = [grad if wanted else None
                            for grad, wanted in zip(weight_grads, wants_weight)]
        bias_grads = [None] * num_groups
        if ctx.has_bias and any(wants_bias):
            dbias = _grouped_bias_grad(dy, m_splits, num_groups)
            bias_grads = [grad if wanted else None
                          for grad, wanted in zip(dbias.unbind(0), wants_bias)]
        return (dx, None, None, None, None, *weight_grads, *bias_grads)


class GroupedLinear(torch.nn.Module):
    """``num_groups`` linear layers (``weight{g}``: ``[out_features, in_features]``,
    ``bias{g}``: ``[out_features]``), group ``g`` applied to ``m_splits[g]`` consecutive rows.

    The weights live in one buffer, group ``g`` at a 256-byte boundary; their gradients are views
    of one packed buffer from the caching allocator with the same layout.

    - ``fuse_wgrad_accumulation``: each ``weight{g}.main_grad`` (fp32 ``[out, in]``, contiguous,
      allocated by the caller anywhere, e.g. in Megatron's gradient buffer) gets ``+= dW_g`` and no
      ``.grad`` is produced; every weight needs one while any expert trains. A weight that carries
      Megatron's ``grad_added_to_main_grad`` mark gets it set, and an uninitialized placeholder
      ``.grad`` that Megatron's DDP drops (as TransformerEngine's layers do). Megatron-FSDP's
      weights give their main_grad through ``get_main_grad()``; one with ``overwrite_main_grad``
      has it zeroed first, so the gradient replaces its contents.
    - ``delay_wgrad_compute``: backward computes only input and bias gradients; call
      :meth:`backward_dw` later (on any stream) for the weight gradients.

    Calling the layer as ``layer(x, m_splits)`` returns ``[rows, out_features]``. It raises
    ``ValueError`` at construction for sizes below 1 and for a layer no call could run (a dtype
    other than bfloat16, float16 and float32), for an ``x`` that is not ``[rows, in_features]``
    or an ``m_splits`` that is not ``[num_groups]``, for missing main_grads with
    ``fuse_wgrad_accumulation``, and otherwise as :func:`grouped_linear` does.
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = True,
                 *, device=None, dtype=None, fuse_wgrad_accumulation: bool = False,
                 delay_wgrad_compute: bool = False):
        super().__init__()
        if num_groups < 1 or in_features < 1 or out_features < 1:
            raise ValueError(f"GroupedLinear: num_groups={num_groups}, in_features={in_features} "
                             f"and out_features={out_features} must be positive")
        self.num_groups = num_groups
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.delay_wgrad_compute = delay_wgrad_compute
        self._delayed = _DelayedWgrad()
        dtype = dtype or torch.get_default_dtype()
        bound = 1.0 / in_features**0.5
        for g in range(num_groups):
            weight = torch.empty(out_features, in_features, device=device, dtype=dtype)
            torch.nn.init.uniform_(weight, -bound, bound)
            self.register_parameter(f"weight{g}", torch.nn.Parameter(weight))
            if bias:
                self.register_parameter(
                    f"bias{g}", torch.nn.Parameter(torch.empty(
                        out_features, device=device, dtype=dtype).uniform_(-bound, bound)))
        self._pack()
        self._check_every_call_could_run()

    def _check_every_call_could_run(self):
        """The grouped GEMM's rules on a forward of no rows (the extension's: dtype, sizes), so
        that a layer no call could run is refused here rather than at its first call.
        A layer on the meta device is checked when it is materialized and called."""
        weight, bias = self._packed_views()
        if weight.device.type == "meta":
            return
        try:
            _check_call(_PASS.forward, weight.new_zeros(self.num_groups, dtype=torch.int64),
                        x=weight.new_empty(0, self.in_features), weight=weight, bias=bias,
                        y=weight.new_empty(0, self.out_features))
        except ValueError as error:
            raise ValueError(f"GroupedLinear(num_groups={self.num_groups}, in_features="
                             f"{self.in_features}, out_features={self.out_features}, dtype="
                             f"{weight.dtype}): no call could run: {error}") from None

    def weights(self) -> list[torch.nn.Parameter]:
        return [getattr(self, f"weight{g}") for g in range(self.num_groups)]

    def biases(self) -> list[torch.nn.Parameter]:
        return [getattr(self, f"bias{g}") for g in range(self.num_groups)] if self.use_bias else []

    def _pack(self):
        """Moves the weights (and biases) into one buffer each, group g at a 256-byte boundary,
        the parameters becoming views of it. Runs at construction and after .to()/.cuda()/
        .half(), which give every parameter storage of its own."""
        weights = self.weights()
        stride = packed_group_stride(self.out_features, self.in_features, weights[0].dtype)
        with torch.no_grad():
            flat = weights[0].new_empty(self.num_groups * stride)
            packed = _packed(flat, self.num_groups, self.out_features, self.in_features, stride)
            for g, weight in enumerate(weights):
                packed[g].copy_(weight)
                weight.data = packed[g]
            self._weight_flat = flat
            if self.use_bias:
                biases = self.biases()
                stacked = torch.stack([b.detach() for b in biases])
                for g, b in enumerate(biases):
                    b.data = stacked[g]
                self._bias_stacked = stacked

    def _apply(self, fn, *args, **kwargs):
        result = super()._apply(fn, *args, **kwargs)
        self._pack()
        return result

    def _packed_views(self):
        """The [G, out, in] weight and [G, out] bias over the packed buffers, repacking first
        when a parameter no longer lives there (e.g. its .data was replaced)."""
        weights = self.weights()
        stride = packed_group_stride(self.out_features, self.in_features, weights[0].dtype)
        flat = self._weight_flat
        if not torch.compiler.is_compiling():
            size = flat.element_size()
            base = flat.data_ptr()
            moved = any(w.data_ptr() != base + g * stride * size or w.dtype != flat.dtype
                        for g, w in enumerate(weights))
            if self.use_bias:
                biases = self.biases()
                row = self._bias_stacked.stride(0) * self._bias_stacked.element_size()
                bias_base = self._bias_stacked.data_ptr()
                moved = moved or any(b.data_ptr() != bias_base + g * row
                                     for g, b in enumerate(biases))
            if moved:
                self._pack()
                flat = self._weight_flat
        weight = _packed(flat, self.num_groups, self.out_features, self.in_features, stride)
        return weight, (self._bias_stacked if self.use_bias else None)

    def forward(self, x: torch.Tensor, m_splits: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"GroupedLinear: x.shape={list(x.shape)} must be [rows, "
                             f"in_features={self.in_features}]")
        if m_splits.shape != (self.num_groups,):
            raise ValueError(f"GroupedLinear: m_splits.shape={list(m_splits.shape)} must be "
                             f"[num_groups={self.num_groups}]")
        weight, bias = self._packed_views()
        _check_same_dtype("GroupedLinear", x, weight)
        return _GroupedLinearFunction.apply(x.contiguous(), m_splits, weight, bias, self,
                                            *self.weights(), *self.biases())

    def _weight_grads(self, x, dy, m_splits):
        """Weight gradients as views of one packed buffer, or None per weight after
        accumulating into main_grad."""
        if self.fuse_wgrad_accumulation:
            if not all(w.requires_grad for w in self.weights()):
                raise ValueError("GroupedLinear(fuse_wgrad_accumulation=True): some experts are "
                                 "frozen (requires_grad=False) and others not; the fused "
                                 "accumulation adds every expert's gradient to its main_grad, "
                                 "so freeze all of them or none")
            main_grads = [main_grad_buffer(w) for w in self.weights()]
            if any(g is None for g in main_grads):
                raise ValueError("GroupedLinear(fuse_wgrad_accumulation=True): every weight needs "
                                 "a float32 .main_grad of shape [out_features, in_features] "
                                 "(Megatron-FSDP's: from get_main_grad())")
            # Megatron-FSDP's buffers that the gradient replaces: zeroed, then added to.
            overwritten = [g for w, g in zip(self.weights(), main_grads) if overwrites_main_grad(w)]
            if overwritten:
                torch._foreach_zero_(overwritten)
            _grouped_mm_wgrad_accumulate(x, dy, m_splits, main_grads)
            return [None] * self.num_groups
        return list(_weight_grad(x, dy, m_splits, self.num_groups, x.dtype).unbind(0))

    def backward_dw(self) -> None:
        """Computes the weight gradients that backward delayed, on the current stream: it waits
        for the backward that produced them and keeps their inputs alive for the allocator until
        this stream is done with them. Gradients are set (or added to .grad / main_grad)."""
        pending, self._delayed.pending = self._delayed.pending, []
        for x, dy, m_splits, event in pending:
            if event is not None:
                stream = torch.cuda.current_stream(x.device)
                stream.wait_event(event)
                for t in (x, dy, m_splits):
                    t.record_stream(stream)
            grads = self._weight_grads(x, dy, m_splits)
            if self.fuse_wgrad_accumulation:
                for weight in self.weights():
                    added_to_main_grad(weight, placeholder=False)
            for weight, grad in zip(self.weights(), grads):
                if grad is None or not weight.requires_grad:
                    continue
                if weight.grad is None:
                    weight.grad = grad
                else:
                    weight.grad += grad

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.use_bias}")
