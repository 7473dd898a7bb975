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


def quantized(t, dtype, rowwise: bool, group=None):
    """``t`` [rows, cols] as ``(q, scale)``, ``t ≈ q * scale``: q contiguous in the float8
    ``dtype``, its largest magnitude just below the dtype's largest; ``scale`` float32, one per
    row ([rows]) or one ([1]; the largest amax of ``group``'s ranks where given)."""
    # Three passes over t: its extremes, its product with the multiplier, the cast.
    low, high = t.aminmax(dim=1, keepdim=True) if rowwise else t.aminmax()
    amax = torch.maximum(high.abs(), low.abs()).float().reshape(-1, 1)
    if not rowwise and group is not None and group.size > 1:
        amax = ops.all_gather(amax, group).amax().reshape(1, 1)
    # The multiplier in t's dtype (float16's range is too narrow for small tensors: float32
    # there), rounded to below largest / amax so that no product rounds past the float8 dtype's
    # largest; the scale is its reciprocal (in float32). An all-zero row gets the dtype's largest
    # multiplier, which keeps its zeros zero.
    work = t.float() if t.dtype == torch.float16 else t
    largest = torch.finfo(dtype).max * (1 - 2.0 ** -8)
    multiplier = (largest / amax).clamp(max=torch.finfo(work.dtype).max).to(work.dtype)
    q = (work * multiplier).to(dtype).contiguous()
    return q, multiplier.float().reciprocal().reshape(-1)


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
    # The call's own workspace (the caching allocator's, stream-ordered, in int64 words): calls
    # on other streams do not share one.
    workspace = torch.empty(_meshla.matmul_workspace_bytes // 8, dtype=torch.int64,
                            device=a.device)
    _matmuls[device].run(a, b, out, None, True, "rowwise" if rowwise else "tensorwise", a_scale,
                         b_scale, _library.current_stream(device), workspace)
    return out


@torch.library.register_fake("meshla::scaled_mm")
def _(a, a_scale, b, b_scale, rowwise, out_dtype):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


class Float8Linear(torch.autograd.Function):
    """``x @ weightᵀ (+ bias)`` of one tensor-parallel layer in float8: ``forward_op`` is the
    forward's collective (None: a local GEMM), the input gradient runs its CONJUGATE."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, forward_op, recipe, tuning, name, fused_wgrad):
        rowwise = recipe == "rowwise"
        gathers = forward_op == ops.OPS.all_gather_matmul
        x_q, x_scale = quantized(x, FORWARD_DTYPE, rowwise, group if gathers else None)
        w_q, w_scale = quantized(weight, FORWARD_DTYPE, rowwise)
        # A float32 product takes no bias in its GEMM (fp8 GEMMs into float32 have none).
        fused_bias = bias if x.dtype != torch.float32 else None
        keep_gathered = gathers and ctx.needs_input_grad[1] and not rowwise
        gathered = None
        if forward_op is None:
            y = local_scaled_mm(x_q, x_scale, w_q, w_scale, rowwise, x.dtype)
            fused_bias = None
        else:
            y, gathered = ops.scaled(forward_op, x_q, w_q, x_scale, w_scale, fused_bias, group,
                                     x.dtype, keep_gathered, tuning)
        if bias is not None and fused_bias is None:
            y.add_(bias)
        # The backward's operands: tensorwise the fp8 bytes (the gathered ones where the forward
        # gathered them), rowwise the 16-bit tensors, quantized again along other rows.
        if rowwise:
            ctx.save_for_backward(x, weight, None, None, None, None)
        else:
            ctx.save_for_backward(None, None, gathered if keep_gathered else x_q, x_scale, w_q,
                                  w_scale)
        ctx.group, ctx.forward_op, ctx.rowwise, ctx.tuning = group, forward_op, rowwise, tuning
        ctx.name, ctx.dtype = name, x.dtype
        ctx.fused_weight = weight if fused_wgrad else None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, x_q, x_scale, w_q, w_scale = ctx.saved_tensors
        group, rowwise, dtype = ctx.group, ctx.rowwise, ctx.dtype
        grad_op = CONJUGATE[ctx.forward_op]
        gathers_grad = grad_op == ops.OPS.all_gather_matmul
        needs_x, needs_w, needs_bias = ctx.needs_input_grad[:3]
        grad = grad.contiguous()
        g_q = g_scale = grad_x = grad_w = grad_bias = g_gathered = None
        # The input's gradient multiplies grad as it is; the weight's, tensorwise, reuses it
        # where grad is not gathered (rowwise, it casts grad along its other axis).
        if needs_x or (not rowwise and not gathers_grad):
            g_q, g_scale = quantized(grad, GRADIENT_DTYPE, rowwise,
                                     group if gathers_grad else None)
        if needs_x:  # grad @ weight: the weight transposed as b
            wt_q, wt_scale = (quantized(weight.t(), FORWARD_DTYPE, True) if rowwise
                              else (w_q.t().contiguous(), w_scale))
            if grad_op is None:
                grad_x = local_scaled_mm(g_q, g_scale, wt_q, wt_scale, rowwise, dtype)
            else:
                keep = gathers_grad and needs_w and not rowwise
                grad_x, g_gathered = ops.scaled(grad_op, g_q, wt_q, g_scale, wt_scale, None,
                                                group, dtype, keep, ctx.tuning)
        if needs_w:  # gradᵀ @ x over every row of the product
            grad_w = _weight_grad(ctx, grad, g_q, g_scale, g_gathered, x, x_q, x_scale)
        if needs_bias:
            # A reduce-scatter's product has this rank's rows only: the sum over every rank's.
            grad_bias = (ops.all_gather(grad.float().sum(0, keepdim=True), group).sum(0)
                         .to(dtype) if gathers_grad else grad.sum(0))
        return grad_x, grad_w, grad_bias, None, None, None, None, None, None


def _weight_grad(ctx, grad, g_q, g_scale, g_gathered, x, x_q, x_scale):
    """The weight's gradient ``Gᵀ @ X`` over the product's rows (G the gradient, gathered where the
    forward reduce-scattered; X the input, gathered where the forward all-gathered), or with
    fuse_wgrad_accumulation its addition to weight.main_grad and what autograd gets instead."""
    group, rowwise = ctx.group, ctx.rowwise
    gathers_x = ctx.forward_op == ops.OPS.all_gather_matmul
    gathers_grad = ctx.forward_op == ops.OPS.matmul_reduce_scatter
    if rowwise:
        full_grad = ops.all_gather(grad, group) if gathers_grad else grad
        gt_q, gt_scale = quantized(full_grad.t(), GRADIENT_DTYPE, True)
        full_x = ops.all_gather(x, group) if gathers_x else x
        xt_q, xt_scale = quantized(full_x.t(), FORWARD_DTYPE, True)
    else:
        if gathers_grad and g_gathered is None:  # no input gradient was asked for
            g_q, g_scale = quantized(ops.all_gather(grad, group), GRADIENT_DTYPE, False)
        gt_q, gt_scale = (g_gathered if g_gathered is not None else g_q).t().contiguous(), g_scale
        xt_q, xt_scale = x_q.t().contiguous(), x_scale
    if ctx.fused_weight is None:
        return local_scaled_mm(gt_q, gt_scale, xt_q, xt_scale, rowwise, ctx.dtype)
    main_grad = main_grad_of(ctx.name, ctx.fused_weight)
    product = local_scaled_mm(gt_q, gt_scale, xt_q, xt_scale, rowwise, main_grad.dtype)
    if overwrites_main_grad(ctx.fused_weight):
        main_grad.copy_(product)
    else:
        main_grad.add_(product)
    return added_to_main_grad(ctx.fused_weight)
