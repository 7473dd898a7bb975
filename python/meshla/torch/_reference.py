"""The collectives' CPU references: torch.distributed collectives over the group's process group
and matmuls in float32, so that code written for meshla runs on a machine without GPUs. Their
arguments were checked by the extension first (describe_call), as on CUDA."""

from __future__ import annotations

import torch
import torch.distributed as dist


def product(a, b, bias, trans_b: bool, add_bias: bool):
    """``a @ b (+ bias)`` in float32, also under autocast."""
    b = b.t() if trans_b else b
    with torch.autocast(a.device.type, enabled=False):
        result = a.float() @ b.float()
    if bias is not None and add_bias:
        result += bias.float()
    return result


def summed_over_ranks(a, b, bias, trans_b: bool, group):
    """The sum over ranks of ``a @ b`` in float32, the bias added once."""
    total = product(a, b, bias, trans_b, group.rank == 0)
    dist.all_reduce(total, group=group.process_group)
    return total


def gathered_rows(rows, group):
    """[tp * r, c] from every rank's [r, c] ``rows``, in rank order."""
    parts = [torch.empty_like(rows) for _ in range(group.size)]
    dist.all_gather(parts, rows.contiguous(), group=group.process_group)
    return torch.cat(parts)


def deliver(result, out):
    """``result`` in the output the caller gave (checked already), or as it is, contiguous."""
    return result.contiguous() if out is None else out.copy_(result)
