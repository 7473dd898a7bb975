"""PyTorch front end of meshla: collective matmul (:mod:`meshla.torch.collective`) and the
tensor-parallel layers over it
(:mod:`meshla.torch.parallel_linear`: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`),
grouped GEMM for Mixture-of-Experts
(:mod:`meshla.torch.grouped`: :class:`GroupedLinear`, :func:`grouped_linear`,
:func:`grouped_matmul`) and distributed
dense solvers over the GPUs of one process (:mod:`meshla.torch.linalg`).

A :class:`TPGroup` names the tensor-parallel group an op runs over. Build one from a
torch.distributed process group of any backend (:func:`group_from_process_group`), from an mpi4py
communicator (:func:`group_from_mpi`), or, for one process driving several GPUs from threads, one
per device (:func:`local_groups`).

On CUDA tensors the ops run meshla's plans on the current CUDA stream, so they can be captured in
a CUDA graph once each shape has run eagerly. On CPU tensors they run a reference implementation
(torch.distributed collective + matmul) over the group's process group, so the same code runs on a
machine without GPUs.
"""

from meshla.torch._group import (
    TPGroup,
    group_from_mpi,
    group_from_process_group,
    local_groups,
)
from meshla._tuning import Tuning
from meshla.torch.collective import (
    all_gather_matmul,
    all_gather_scaled_matmul,
    column_parallel_matmul,
    matmul_all_reduce,
    matmul_reduce_scatter,
    scaled_matmul_all_reduce,
    scaled_matmul_reduce_scatter,
)
from meshla.torch.grouped import (
    GroupedLinear,
    check_device_errors,
    grouped_linear,
    grouped_matmul,
    packed_group_stride,
)
from meshla.torch import linalg
from meshla.torch.parallel_linear import ColumnParallelLinear, RowParallelLinear

__all__ = [
    "ColumnParallelLinear",
    "GroupedLinear",
    "RowParallelLinear",
    "TPGroup",
    "Tuning",
    "all_gather_matmul",
    "all_gather_scaled_matmul",
    "check_device_errors",
    "column_parallel_matmul",
    "group_from_mpi",
    "group_from_process_group",
    "grouped_linear",
    "grouped_matmul",
    "linalg",
    "local_groups",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "packed_group_stride",
    "scaled_matmul_all_reduce",
    "scaled_matmul_reduce_scatter",
]
