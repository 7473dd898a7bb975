"""The JAX dtypes by meshla's own (one table for every pillar; which of them an op takes is the
extension's rule, checked there)."""

import jax.numpy as jnp
import numpy as np

from meshla import _meshla

DTYPES = {
    np.dtype(jnp.float32): _meshla.DType.float32,
    np.dtype(jnp.float64): _meshla.DType.float64,
    np.dtype(jnp.float16): _meshla.DType.float16,
    np.dtype(jnp.bfloat16): _meshla.DType.bfloat16,
    np.dtype(jnp.complex64): _meshla.DType.complex64,
    np.dtype(jnp.complex128): _meshla.DType.complex128,
    np.dtype(jnp.int32): _meshla.DType.int32,
    np.dtype(jnp.int64): _meshla.DType.int64,
    np.dtype(jnp.float8_e4m3fn): _meshla.DType.float8_e4m3fn,
    np.dtype(jnp.float8_e5m2): _meshla.DType.float8_e5m2,
}


def dtype_of(name: str, array) -> "_meshla.DType":
    """``array``'s dtype as meshla's, or a ValueError naming the argument."""
    dtype = DTYPES.get(np.dtype(array.dtype))
    if dtype is None:
        raise ValueError(f"{name}.dtype={array.dtype} is not one meshla takes")
    return dtype
