"""JAX front end of meshla: distributed dense solvers over the GPUs of a mesh
(:mod:`meshla.jax.linalg`)."""

from meshla.jax import linalg

__all__ = ["linalg"]
