"""meshla: multi-GPU linear algebra for PyTorch and JAX.

The native extension ``_meshla`` holds the communicator and the plans; framework glue lives in
``meshla.torch``. Importing meshla needs no GPU: on a machine without one, the torch functions
run their reference path on CPU tensors.
"""

from meshla._meshla import Algorithm, CollectiveMatmul, CollectiveOp, Communicator, unique_id

__all__ = ["Algorithm", "CollectiveMatmul", "CollectiveOp", "Communicator", "unique_id"]
