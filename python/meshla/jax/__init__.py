"""JAX front end of meshla: collective matmuls for tensor parallelism, 16-bit and float8
(:mod:`meshla.jax.collective`, also importable from here), the grouped GEMM of Mixture-of-Experts
layers (:func:`grouped_linear`; :func:`grouped_matmul`, ``jax.lax.ragged_dot``'s form;
:mod:`meshla.jax.grouped`) and distributed dense solvers over the
GPUs of a mesh (:mod:`meshla.jax.linalg`).

Bad arguments raise ``ValueError`` when a call is traced, and what cannot run here
``NotImplementedError``; failures inside a GPU's custom call surface as
``jax.errors.JaxRuntimeError``. Each module's notes give the details."""

from meshla.jax import collective, grouped, linalg
from meshla.jax.collective import (
    all_gather_matmul,
    all_gather_matmul_global,
    all_gather_scaled_matmul,
    column_parallel_matmul,
    column_parallel_matmul_global,
    matmul_all_reduce,
    matmul_all_reduce_global,
    matmul_reduce_scatter,
    matmul_reduce_scatter_global,
    scaled_matmul_all_reduce,
    scaled_matmul_reduce_scatter,
)
from meshla.jax.grouped import grouped_linear, grouped_matmul

__all__ = [
    "all_gather_matmul",
    "all_gather_matmul_global",
    "all_gather_scaled_matmul",
    "collective",
    "column_parallel_matmul",
    "column_parallel_matmul_global",
    "grouped",
    "grouped_linear",
    "grouped_matmul",
    "linalg",
    "matmul_all_reduce",
    "matmul_all_reduce_global",
    "matmul_reduce_scatter",
    "matmul_reduce_scatter_global",
    "scaled_matmul_all_reduce",
    "scaled_matmul_reduce_scatter",
]
