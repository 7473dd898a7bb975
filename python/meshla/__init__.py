"""meshla: multi-GPU linear algebra for PyTorch and JAX.

The native extension ``_meshla`` holds the communicator and the plans; framework glue lives in
``meshla.torch`` and ``meshla.jax``. Importing meshla needs no GPU: on a machine without one, the
torch functions run their reference path on CPU tensors.

The names exported here come from the extension. ``Algorithm``, ``Backend`` and ``CollectiveOp``
are the collective matmul's choices (the front ends take them by name, see
:class:`meshla.torch.Tuning`). ``unique_id()`` returns a fresh 128-byte NCCL id, made on a group's
rank 0 and handed to the others. ``Communicator(unique_id, rank, size, device, timeout_s=300.0)``
joins this rank to a group on CUDA device ``device``, and ``Communicator.create_local(devices,
timeout_s=300.0)`` returns one communicator per device for a group that this process drives.
``CollectiveMatmul`` is one plan of a group. Their errors are the extension's: a bad rank, size,
device (out of range, or listed twice), id length or ``timeout_s`` (positive, at most 30 days)
raises ``ValueError``; ranks that do not all join within ``timeout_s`` raise ``TimeoutError``;
an NCCL or CUDA failure raises ``RuntimeError`` naming the call.
"""

import atexit


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

from meshla import _meshla  # noqa: E402
from meshla._meshla import (  # noqa: E402
    Algorithm,
    Backend,
    CollectiveMatmul,
    CollectiveOp,
    Communicator,
    unique_id,
)

def _release_communicators_no_more_at_exit():
    """Makes begin_process_exit the first of the exit handlers (atexit runs the last registered
    first): it waits briefly for the releases under way (communicators being aborted, plans let
    go of by CUDA graphs), and what is let go of after it (by later handlers, then the
    interpreter's teardown) is left to the process's end, since an abort would wait for peers
    that may be waiting for this process. Called again by every group made, so that it stays
    first."""
    atexit.unregister(_meshla.begin_process_exit)
    atexit.register(_meshla.begin_process_exit)


_release_communicators_no_more_at_exit()


def backend_unavailable_reason(backend: str) -> str:
    """Why the collective-matmul ``backend`` cannot run in this process, or ``""`` when it can.

    ``backend`` is the backend's name: "auto", "nccl", "symmetric" or "cublasmp". Returns the
    reason as text, or ``""``. Only "cublasmp" can be missing: it needs a build with
    cuBLASMp's header and, at run time, its library, NVSHMEM and a GPU driver. A name that is not
    one of the four (an enum member included) raises ``ValueError`` listing them. A meshla.torch
    call on an unavailable backend raises ``NotImplementedError`` with this reason when it builds
    its plan.
    """
    try:
        value = Backend.__members__[backend]
    except KeyError:
        raise ValueError(
            f"backend={backend!r}; expected one of {sorted(Backend.__members__)}") from None
    return _meshla.backend_unavailable_reason(value)

__all__ = [
    "Algorithm",
    "Backend",
    "CollectiveMatmul",
    "CollectiveOp",
    "Communicator",
    "backend_unavailable_reason",
    "unique_id",
]
