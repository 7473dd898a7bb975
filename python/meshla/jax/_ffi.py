"""The extension's XLA FFI handlers, registered with JAX for the CUDA platform on first use (the
solvers' and the collective matmuls' alike)."""

from __future__ import annotations

import atexit
import threading

import jax

from meshla import _meshla

_lock = threading.Lock()
_registered = False


def register_targets() -> None:
    """Registers every handler once; their groups, plans and solvers are let go of at exit."""
    global _registered
    with _lock:
        if _registered:
            return
        if not _meshla.with_jax:
            raise NotImplementedError(
                "meshla was built without XLA's FFI headers (jaxlib was not importable when it "
                "was built); install jaxlib and reinstall meshla to run meshla.jax on GPUs"
            )
        # A handler is a capsule, or a dict of capsules by stage (prepare, execute).
        for name, handler in _meshla.jax_ffi_targets().items():
            jax.ffi.register_ffi_target(name, handler, platform="CUDA")
        atexit.register(_meshla.release_jax)
        _registered = True
