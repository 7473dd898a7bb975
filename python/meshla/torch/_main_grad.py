"""Weight gradients accumulated into ``weight.main_grad`` (``fuse_wgrad_accumulation``), as
Megatron-LM's distributed optimizer keeps them: float32 buffers that the backward adds to, instead
of a ``.grad`` in the weight's dtype that would be added to them afterwards."""

from __future__ import annotations

import torch


def main_grad_of(name: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight.main_grad``, checked: float32, the weight's shape, on its device."""
    main_grad = getattr(weight, "main_grad", None)
    if (not isinstance(main_grad, torch.Tensor) or main_grad.dtype != torch.float32
            or main_grad.shape != weight.shape or main_grad.device != weight.device):
        got = ("none" if main_grad is None else
               f"{main_grad.dtype} {list(main_grad.shape)} on {main_grad.device}"
               if isinstance(main_grad, torch.Tensor) else type(main_grad).__name__)
        raise ValueError(f"{name}(fuse_wgrad_accumulation=True): the weight needs a .main_grad, "
                         f"torch.float32 {list(weight.shape)} on {weight.device}, before the "
                         f"backward; it has {got}")
    return main_grad


def accumulate_weight_grad(name: str, weight, rows, grad, trans_b: bool):
    """``weight.main_grad += `` the weight's gradient for ``product = rows @ weight`` (weight
    [k, n]) or ``rows @ weightᵀ`` (weight [n, k]), accumulated in float32 from 16-bit operands:
    one GEMM with a float32 output on CUDA, no 16-bit gradient in between."""
    main_grad = main_grad_of(name, weight)
    left, right = (grad.t(), rows) if trans_b else (rows.t(), grad)
    if main_grad.is_cuda and left.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(main_grad, left, right, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.addmm_(left.float(), right.float())


def added_to_main_grad(weight, placeholder: bool = True):
    """What autograd gets for a weight whose gradient went to its main_grad. Megatron's DDP marks
    its parameters with grad_added_to_main_grad (False before each step) and, when it overlaps the
    gradient reduction, asserts that every backward gives a .grad, which it drops unread once the
    mark is set: a marked weight gets the mark set and, with ``placeholder``, an uninitialized
    gradient of its shape (as TransformerEngine's layers give it); others None."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    return torch.empty_like(weight) if placeholder else None
