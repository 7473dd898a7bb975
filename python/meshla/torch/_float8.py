"""FP8 training of the tensor-parallel layers (``ColumnParallelLinear`` and ``RowParallelLinear``
with ``fp8="tensorwise"`` or ``"rowwise"``): dynamic scaling, as torchao's Float8 recipes do it.
Each GEMM's operands are cast to float8 with scales from this step's amax (activations and
weights to float8_e4m3fn, gradients to float8_e5m2, whose range gradients need), and each GEMM
gets its product in the layer's dtype.

The forward and the input gradient are meshla's scaled collective matmuls, the same collectives as
the 16-bit layers' (all-gather <-> reduce-scatter, all-reduce <-> none); the weight gradient is a
local fp8 GEMM (meshla's Matmul). An fp8 GEMM contracts along the rows of both operands, so the
backward's operands are the forward's transposed: tensorwise, the forward's fp8 bytes transposed
under the same scale; rowwise, quantized again along the new contraction from the 16-bit tensors
(the layer keeps its 16-bit input, and the column-parallel sequence-parallel layer gathers it
again, as recompute_gathered does).

Tensorwise: one scale per operand; an operand that is all-gathered takes the group's largest amax
(every rank's rows share one scale; a one-float all-gather). Rowwise: one scale per row of each
operand.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from meshla import _meshla
from meshla.torch import _collective_ops as ops
from meshla.torch import _library
from meshla.torch._main_grad import added_to_main_grad, main_grad_of, overwrites_main_grad

RECIPES = ("tensorwise", "rowwise")
FORWARD_DTYPE = torch.float8_e4m3fn  # activations and weights
GRADIENT_DTYPE = torch.float8_e5m2

# The collective of each forward (None: a local GEMM) and of its input gradient.
CONJUGATE = {
    None: ops.OPS.matmul_all_reduce,
    ops.OPS.all_gather_matmul: ops.OPS.matmul_reduce_scatter,
    ops.OPS.matmul_all_reduce: None,
    ops.OPS.matmul_reduce_scatter: ops.OPS.all_gather_matmul,
}

_matmuls: dict[int, _meshla.Matmul] = {}  # one per device, made on first use


def quantized(t, dtype, scales: str, group=None, *, q: bool = True, transposed: bool = False):
    """``t`` [rows, cols] cast to the float8 ``dtype``: ``(q, q_transposed, scale)``, ``t ≈ q *
    scale``. ``scales``: "tensor" (one float32 scale, [1]; the largest amax of ``group``'s ranks
    where given), "rows" (one per row, [rows]) or "columns" (one per column, [cols]: tᵀ's rowwise
    scales). q is t's layout ([rows, cols]) unless ``q=False`` (None), q_transposed tᵀ's ([cols,
    rows]) where ``transposed``, else None; both contiguous, the largest magnitude of each group
    of values just below the dtype's largest.

    On plain CUDA tensors, eager, meshla's kernels: two passes over t (its amax, then the cast,
    both layouts written at once). Elsewhere (CPU, and traced by torch.compile, which fuses them
    with their neighbours) the same in torch's ops: the product t * multiplier is rounded once to
    float32, then to the float8 dtype, in both."""
    kernels = t.numel() > 0 and not _library.needs_the_op((t,))
    stream = _library.current_stream(t.get_device()) if kernels else None
    if kernels and (t.stride(1) != 1 or t.stride(0) < t.shape[1]):
        t = t.contiguous()  # the kernels read rows of unit stride (a view's transpose is not)
    if kernels:
        amax = torch.empty(t.shape[0] if scales == "rows" else t.shape[1] if scales == "columns"
                           else 1, dtype=torch.float32, device=t.device)
        _meshla.float8_amax(t, scales, amax, stream)
    else:
        low, high = (t.aminmax() if scales == "tensor"
                     else t.aminmax(dim=1 if scales == "rows" else 0))
        amax = torch.maximum(high.abs(), low.abs()).float().reshape(-1)
    if scales == "tensor" and group is not None and group.size > 1:
        amax = ops.all_gather(amax.reshape(1, 1), group).amax().reshape(1)
    # Rounded to below largest / amax, so that no product rounds past the dtype's largest; an
    # all-zero group gets float32's largest multiplier, which keeps its zeros zero.
    largest = torch.finfo(dtype).max * (1 - 2.0 ** -8)
    multiplier = (largest / amax).clamp(max=torch.finfo(torch.float32).max)
    if kernels:
        out = t.new_empty(t.shape, dtype=dtype) if q else None
        out_transposed = t.new_empty((t.shape[1], t.shape[0]), dtype=dtype) if transposed else None
        _meshla.float8_cast(t, scales, multiplier, out, out_transposed, stream)
    else:
        cast = (t.float() * (multiplier.reshape(-1, 1) if scales == "rows" else multiplier)
                ).to(dtype)
        out = cast.contiguous() if q else None
        out_transposed = cast.t().contiguous() if transposed else None
    return out, out_transposed, multiplier.reciprocal()


@_library.op("scaled_mm(Tensor a, Tensor a_scale, Tensor b, Tensor b_scale, bool rowwise, "
             "ScalarType out_dtype) -> Tensor")
def local_scaled_mm(a, a_scale, b, b_scale, rowwise: bool, out_dtype):
    """``a [m, k] @ b [n, k]ᵀ`` of float8 operands and their scales, in ``out_dtype``, on this
    rank: meshla's Matmul on CUDA, a float32 product of the dequantized operands on CPU."""
    if a.device.type == "cpu":
        return (ops.dequantized(a, a_scale, rowwise)
                @ ops.dequantized(b, b_scale, rowwise).t()).to(out_dtype)
    device = a.get_device()
    if device not in _matmuls:
        _matmuls[device] = _meshla.Matmul(device)
    out = a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)
    _matmuls[device].run(a, b, out, None, True, "rowwise" if rowwise else "tensorwise", a_scale,
                         b_scale, _library.current_stream(device),
                         _library.workspace(_meshla.matmul_workspace_bytes, a.device))
    return out


@torch.library.register_fake("meshla::scaled_mm")
def _(a, a_scale, b, b_scale, rowwise, out_dtype):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


class Float8Linear(torch.autograd.Function):
    """``x @ weightᵀ (+ bias)`` of one tensor-parallel layer in float8: ``forward_op`` is the
    forward's collective (None: a local GEMM), the input gradient runs its CONJUGATE."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, forward_op, recipe, tuning, name, fused_wgrad,
                grad_enabled):
        rowwise = recipe == "rowwise"
        scales = "rows" if rowwise else "tensor"
        gathers = forward_op == ops.OPS.all_gather_matmul
        # What the backward will need: nothing where the caller's grad mode is off (inside
        # forward it always is; needs_input_grad says only what requires grad).
        needs_x, needs_w = (ctx.needs_input_grad[:2] if grad_enabled else (False, False))
        # Tensorwise, the backward's GEMMs take these bytes transposed (the input's where this
        # rank's rows are all of them), written in the same pass as the forward's.
        x_q, x_t, x_scale = quantized(x, FORWARD_DTYPE, scales, group if gathers else None,
                                      transposed=needs_w and not rowwise and not gathers)
        w_q, w_t, w_scale = quantized(weight, FORWARD_DTYPE, scales,
                                      transposed=needs_x and not rowwise)
        # A float32 product takes no bias in its GEMM (fp8 GEMMs into float32 have none).
        fused_bias = bias if x.dtype != torch.float32 else None
        keep_gathered = gathers and needs_w and not rowwise
        gathered = None
        if forward_op is None:
            y = local_scaled_mm(x_q, x_scale, w_q, w_scale, rowwise, x.dtype)
            fused_bias = None
        else:
            y, gathered = ops.scaled(forward_op, x_q, w_q, x_scale, w_scale, fused_bias, group,
                                     x.dtype, keep_gathered, tuning)
        if bias is not None and fused_bias is None:
            y.add_(bias)
        # The backward's operands: tensorwise the fp8 bytes (transposed, or the gathered ones
        # where the forward gathered them), rowwise the 16-bit tensors, cast again along the
        # backward's contractions.
        if rowwise:
            ctx.save_for_backward(x, weight, None, None, None, None)
        else:
            ctx.save_for_backward(None, None, gathered if keep_gathered else x_t, x_scale, w_t,
                                  w_scale)
        ctx.group, ctx.forward_op, ctx.rowwise, ctx.tuning = group, forward_op, rowwise, tuning
        ctx.name, ctx.dtype = name, x.dtype
        ctx.fused_weight = weight if fused_wgrad else None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, x_fp8, x_scale, w_t, w_scale = ctx.saved_tensors
        group, rowwise, dtype = ctx.group, ctx.rowwise, ctx.dtype
        scales = "rows" if rowwise else "tensor"
        grad_op = CONJUGATE[ctx.forward_op]
        gathers_grad = grad_op == ops.OPS.all_gather_matmul
        needs_x, needs_w, needs_bias = ctx.needs_input_grad[:3]
        grad = grad.contiguous()
        g_q = g_t = g_scale = grad_x = grad_w = grad_bias = g_gathered = None
        # The input's gradient multiplies grad as it is; tensorwise, the weight's takes grad's
        # transpose from the same pass where grad is not gathered (rowwise, it casts grad along
        # its other axis).
        g_transposed = needs_w and not rowwise and not gathers_grad
        if needs_x or g_transposed:
            g_q, g_t, g_scale = quantized(grad, GRADIENT_DTYPE, scales,
                                          group if gathers_grad else None, q=needs_x,
                                          transposed=g_transposed)
        if needs_x:  # grad @ weight: the weight transposed as b
            if rowwise:
                _, w_t, w_scale = quantized(weight, FORWARD_DTYPE, "columns", q=False,
                                            transposed=True)
            if grad_op is None:
                grad_x = local_scaled_mm(g_q, g_scale, w_t, w_scale, rowwise, dtype)
            else:
                keep = gathers_grad and needs_w and not rowwise
                grad_x, g_gathered = ops.scaled(grad_op, g_q, w_t, g_scale, w_scale, None,
                                                group, dtype, keep, ctx.tuning)
        if needs_w:  # gradᵀ @ x over every row of the product
            grad_w = _weight_grad(ctx, grad, g_t, g_scale, g_gathered, x, x_fp8, x_scale)
        if needs_bias:
            # A reduce-scatter's product has this rank's rows only: the sum over every rank's.
            grad_bias = (ops.all_gather(grad.float().sum(0, keepdim=True), group).sum(0)
                         .to(dtype) if gathers_grad else grad.sum(0))
        return grad_x, grad_w, grad_bias, None, None, None, None, None, None, None


def _weight_grad(ctx, grad, g_t, g_scale, g_gathered, x, x_fp8, x_scale):
    """The weight's gradient ``Gᵀ @ X`` over the product's rows (G the gradient, gathered where the
    forward reduce-scattered; X the input, gathered where the forward all-gathered), or with
    fuse_wgrad_accumulation its addition to weight.main_grad and what autograd gets instead.
    Tensorwise, g_t is Gᵀ's bytes where G was not gathered, and x_fp8 Xᵀ's bytes, or X's as
    gathered by the forward's all-gather."""
    group, rowwise = ctx.group, ctx.rowwise
    gathers_x = ctx.forward_op == ops.OPS.all_gather_matmul
    gathers_grad = ctx.forward_op == ops.OPS.matmul_reduce_scatter
    if rowwise:
        full_grad = ops.all_gather(grad, group) if gathers_grad else grad
        _, gt_q, gt_scale = quantized(full_grad, GRADIENT_DTYPE, "columns", q=False,
                                      transposed=True)
        full_x = ops.all_gather(x, group) if gathers_x else x
        _, xt_q, xt_scale = quantized(full_x, FORWARD_DTYPE, "columns", q=False, transposed=True)
    else:
        if g_gathered is not None:
            gt_q, gt_scale = g_gathered.t().contiguous(), g_scale
        elif gathers_grad:  # no input gradient was asked for: grad is gathered here
            _, gt_q, gt_scale = quantized(ops.all_gather(grad, group), GRADIENT_DTYPE, "tensor",
                                          q=False, transposed=True)
        else:
            gt_q, gt_scale = g_t, g_scale
        xt_q, xt_scale = (x_fp8.t().contiguous() if gathers_x else x_fp8), x_scale
    if ctx.fused_weight is None:
        return local_scaled_mm(gt_q, gt_scale, xt_q, xt_scale, rowwise, ctx.dtype)
    main_grad = main_grad_of(ctx.name, ctx.fused_weight)
    product = local_scaled_mm(gt_q, gt_scale, xt_q, xt_scale, rowwise, main_grad.dtype)
    if overwrites_main_grad(ctx.fused_weight):
        main_grad.copy_(product)
    else:
        main_grad.add_(product)
    return added_to_main_grad(ctx.fused_weight)
