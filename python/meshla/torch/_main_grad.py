"""Weight gradients accumulated into ``weight.main_grad`` (``fuse_wgrad_accumulation``), as
Megatron-LM's distributed optimizer keeps them: buffers, float32 or in the weight's dtype, that the
backward adds to, instead of a ``.grad`` that would be added to them afterwards. Megatron-FSDP's
parameters (marked ``__fsdp_param__``) hand their buffer out through ``get_main_grad()`` and may
ask, with ``overwrite_main_grad``, for the gradient to replace the buffer's contents instead, as
TransformerEngine's layers do for them."""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

# torch.addmm adds 16-bit products to a float32 input in one GEMM from torch 2.10 on (out_dtype;
# 2.8 and 2.9 refuse an input whose dtype differs from the operands').
_ADDMM_INTO_FLOAT32 = TorchVersion(torch.__version__) >= "2.10"


def main_grad_buffer(weight: torch.Tensor):
    """``weight.main_grad``, or None; asked of Megatron-FSDP first."""
    if hasattr(weight, "__fsdp_param__"):
        # Kept as the attribute too, as TransformerEngine keeps it: Megatron-FSDP hands out the
        # buffer of the current step, and code after the backward reads weight.main_grad.
        weight.main_grad = weight.get_main_grad()
    return getattr(weight, "main_grad", None)


def overwrites_main_grad(weight: torch.Tensor) -> bool:
    """Whether the weight's gradient replaces its main_grad's contents instead of adding to
    them."""
    return bool(getattr(weight, "overwrite_main_grad", False))


def main_grad_of(name: str, weight: torch.Tensor) -> torch.Tensor:
    """``weight.main_grad`` (main_grad_buffer), checked: float32 or the weight's dtype, its
    shape, on its device."""
    main_grad = main_grad_buffer(weight)
    if (not isinstance(main_grad, torch.Tensor)
            or main_grad.dtype not in (torch.float32, weight.dtype)
            or main_grad.shape != weight.shape or main_grad.device != weight.device):
        got = ("none" if main_grad is None else
               f"{main_grad.dtype} {list(main_grad.shape)} on {main_grad.device}"
               if isinstance(main_grad, torch.Tensor) else type(main_grad).__name__)
        dtypes = " or ".join(dict.fromkeys(str(t) for t in (torch.float32, weight.dtype)))
        raise ValueError(f"{name}(fuse_wgrad_accumulation=True): the weight needs a .main_grad of "
                         f"{dtypes}, shape {list(weight.shape)}, on {weight.device}, before the "
                         f"backward (Megatron-FSDP's: from get_main_grad()); it has {got}")
    return main_grad


def weight_grad_into_main_grad(name: str, weight, rows, grad, trans_b: bool):
    """``weight.main_grad += `` the weight's gradient for ``product = rows @ weight`` (weight
    [k, n]) or ``rows @ weightᵀ`` (weight [n, k]); ``=`` where the weight has
    ``overwrite_main_grad`` set (whatever the buffer held, NaN included, is not read). A float32
    main_grad of 16-bit operands takes one GEMM with a float32 output on CUDA, no 16-bit gradient
    in between."""
    main_grad = main_grad_of(name, weight)
    beta = 0 if overwrites_main_grad(weight) else 1
    left, right = (grad.t(), rows) if trans_b else (rows.t(), grad)
    if main_grad.dtype == left.dtype:
        main_grad.addmm_(left, right, beta=beta)
    elif main_grad.is_cuda and _ADDMM_INTO_FLOAT32:
        torch.addmm(main_grad, left, right, out_dtype=torch.float32, beta=beta, out=main_grad)
    elif main_grad.is_cuda:  # older torch: the 16-bit product, then its addition or copy
        product = left @ right
        if beta:
            main_grad.add_(product)
        else:
            main_grad.copy_(product)
    else:  # the CPU reference path, in float32
        main_grad.addmm_(left.float(), right.float(), beta=beta)


def added_to_main_grad(weight, placeholder: bool = True):
    """What autograd gets for a weight whose gradient went to its main_grad. Megatron's DDP marks
    its parameters with grad_added_to_main_grad (False before each step) and, when it overlaps the
    gradient reduction, asserts that every backward gives a .grad, which it drops unread once the
    mark is set, unless the weight also has zero_out_wgrad (tied weights), whose .grad it adds: a
    marked weight gets the mark set and, with ``placeholder``, a gradient of its shape,
    uninitialized or, with zero_out_wgrad, zeros (as TransformerEngine's layers give them); others
    None."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if not placeholder:
        return None
    return (torch.zeros_like(weight) if getattr(weight, "zero_out_wgrad", False)
            else torch.empty_like(weight))
