"""meshla: multi-GPU linear algebra for PyTorch and JAX.

The native extension ``_meshla`` holds the communicator and the plans; framework glue lives in
``meshla.torch``. Importing meshla needs no GPU: on a machine without one, the torch functions
run their reference path on CPU tensors.
"""


def _load_wheel_nccl():
    # PyTorch and JAX load NCCL from the nvidia-nccl wheel. One process can hold only one
    # libnccl.so.2, so when that wheel is installed meshla binds to the same copy, whichever of
    # the packages is imported first.
    import ctypes
    import pathlib

    try:
        import nvidia.nccl
    except ImportError:
        return
    for root in nvidia.nccl.__path__:
        library = pathlib.Path(root) / "lib" / "libnccl.so.2"
        if library.exists():
            ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
            return


_load_wheel_nccl()

from meshla._meshla import Algorithm, CollectiveMatmul, CollectiveOp, Communicator, unique_id  # noqa: E402

__all__ = ["Algorithm", "CollectiveMatmul", "CollectiveOp", "Communicator", "unique_id"]
