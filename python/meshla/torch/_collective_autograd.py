"""Autograd of the collective matmuls. Each op's backward is its conjugate, as in Megatron-LM's
tensor and sequence parallelism: all-gather <-> reduce-scatter, all-reduce <-> nothing. The products
with b are collective matmuls again (the internal path, meshla.torch._collective_ops), on the
forward's backend with meshla's default algorithm (the forward's algorithm and chunks were chosen
for other shapes); the weight gradients are local GEMMs on the rows the backward has."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from meshla.torch import _collective_ops as ops
from meshla.torch._main_grad import added_to_main_grad, weight_grad_into_main_grad
from meshla._tuning import Tuning


def local_product(a, b, bias, trans_b: bool):
    """``a @ b (+ bias)`` on this rank (column_parallel_matmul's forward)."""
    return torch.nn.functional.linear(a, b if trans_b else b.t(), bias)


def _weight_grad(rows, grad, trans_b: bool):
    """b's gradient for ``product = rows @ b`` (b [k, n]) or ``rows @ bᵀ`` (b [n, k])."""
    return grad.t() @ rows if trans_b else rows.t() @ grad


def fused_wgrad(name: str, weight, b, fuse: bool) -> bool:
    """Whether the backward adds b's gradient to weight.main_grad (fuse_wgrad_accumulation): where
    asked and the weight trains. The call's b must then be the weight itself, not autocast's copy,
    which has no main_grad."""
    if not fuse or not weight.requires_grad:
        return False
    if b is not weight:
        raise ValueError(f"{name}(fuse_wgrad_accumulation=True): b is {weight.dtype} but the call "
                         f"computes in {b.dtype} (torch.autocast): give b in the compute dtype, "
                         "whose main_grad is accumulated")
    if torch.compiler.is_compiling():
        raise NotImplementedError(f"{name}(fuse_wgrad_accumulation=True) runs eagerly only: "
                                  "torch.compile cannot trace its backward's write to b.main_grad")
    return True


def _b_grad(ctx, name: str, rows, grad):
    """b's gradient, or with fuse_wgrad_accumulation its addition to b.main_grad and what autograd
    gets in its place (see meshla.torch._main_grad)."""
    if ctx.fused_weight is None:
        return _weight_grad(rows, grad, ctx.trans_b)
    weight_grad_into_main_grad(name, ctx.fused_weight, rows, grad, ctx.trans_b)
    return added_to_main_grad(ctx.fused_weight)


def _keep_fused_weight(ctx, b, fused: bool):
    """The weight whose main_grad the backward adds to: the object itself, which has the
    attribute, not the saved tensors' unpacked b (a detached copy under activation checkpointing
    or offloading)."""
    ctx.fused_weight = b if fused else None


def _backward_tuning(ctx) -> Tuning:
    """The backward's collective matmuls: the forward's backend, the rest meshla's defaults."""
    return Tuning.of(backend=ctx.backend, cached=not torch.compiler.is_compiling())


class AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, group, trans_b, tuning, return_gathered, recompute_gathered,
                fused_wgrad):
        # b's gradient needs the gathered rows: kept, or this rank's kept and gathered again.
        keep = ctx.needs_input_grad[1] and not recompute_gathered
        gather = return_gathered or keep
        product, gathered = ops.all_gather_matmul(a, b, bias, group, trans_b, gather, tuning)
        ctx.save_for_backward(gathered if keep else a if ctx.needs_input_grad[1] else None, b)
        ctx.group, ctx.trans_b, ctx.backend = group, trans_b, tuning.backend
        ctx.recompute_gathered = recompute_gathered
        _keep_fused_weight(ctx, b, fused_wgrad)
        if not return_gathered:
            return product
        ctx.mark_non_differentiable(gathered)
        return product, gathered

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, *_gathered_grad):
        rows, b = ctx.saved_tensors
        needs_a, needs_b, needs_bias = ctx.needs_input_grad[:3]
        grad_a = grad_b = grad_bias = None
        if needs_a:  # grad @ bᵀ, its rows summed over the ranks and scattered back
            grad_a = ops.matmul_reduce_scatter(grad, b, None, ctx.group, not ctx.trans_b,
                                               _backward_tuning(ctx))
        if needs_b:
            gathered = ops.all_gather(rows, ctx.group) if ctx.recompute_gathered else rows
            grad_b = _b_grad(ctx, "all_gather_matmul", gathered, grad)
        if needs_bias:
            grad_bias = grad.sum(0)
        return grad_a, grad_b, grad_bias, None, None, None, None, None, None


class MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, group, trans_b, tuning, fused_wgrad):
        # Each operand only for the other's gradient.
        needs_a, needs_b = ctx.needs_input_grad[:2]
        ctx.save_for_backward(a if needs_b else None, b if needs_a else None)
        ctx.group, ctx.trans_b, ctx.backend = group, trans_b, tuning.backend
        _keep_fused_weight(ctx, b, fused_wgrad)
        return ops.matmul_reduce_scatter(a, b, bias, group, trans_b, tuning)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        needs_a, needs_b, needs_bias = ctx.needs_input_grad[:3]
        # One all-gather of the output's gradient serves all three: fused with a's gradient (its
        # product with bᵀ) where a needs one, a plain all-gather where only b or bias does.
        needs_rows = needs_b or needs_bias
        grad_a = gathered = None
        if needs_a:
            grad_a, gathered = ops.all_gather_matmul(grad, b, None, ctx.group, not ctx.trans_b,
                                                     needs_rows, _backward_tuning(ctx))
        elif needs_rows:
            gathered = ops.all_gather(grad, ctx.group)
        grad_b = _b_grad(ctx, "matmul_reduce_scatter", a, gathered) if needs_b else None
        grad_bias = gathered.sum(0) if needs_bias else None
        return grad_a, grad_b, grad_bias, None, None, None, None


class MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, group, trans_b, tuning, fused_wgrad):
        # Each operand only for the other's gradient.
        needs_a, needs_b = ctx.needs_input_grad[:2]
        ctx.save_for_backward(a if needs_b else None, b if needs_a else None)
        ctx.trans_b = trans_b
        _keep_fused_weight(ctx, b, fused_wgrad)
        return ops.matmul_all_reduce(a, b, bias, group, trans_b, tuning)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        needs_a, needs_b, needs_bias = ctx.needs_input_grad[:3]
        grad_a = (grad @ b if ctx.trans_b else grad @ b.t()) if needs_a else None
        grad_b = _b_grad(ctx, "matmul_all_reduce", a, grad) if needs_b else None
        grad_bias = grad.sum(0) if needs_bias else None
        return grad_a, grad_b, grad_bias, None, None, None, None


class ColumnParallelMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, group, trans_b, tuning, fused_wgrad):
        needs_a, needs_b = ctx.needs_input_grad[:2]
        ctx.save_for_backward(a if needs_b else None, b if needs_a else None)
        ctx.group, ctx.trans_b, ctx.tuning = group, trans_b, tuning
        _keep_fused_weight(ctx, b, fused_wgrad)
        return local_product(a, b, bias, trans_b)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        needs_a, needs_b, needs_bias = ctx.needs_input_grad[:3]
        grad_a = (ops.matmul_all_reduce(grad, b, None, ctx.group, not ctx.trans_b, ctx.tuning)
                  if needs_a else None)
        grad_b = _b_grad(ctx, "column_parallel_matmul", a, grad) if needs_b else None
        grad_bias = grad.sum(0) if needs_bias else None
        return grad_a, grad_b, grad_bias, None, None, None, None
