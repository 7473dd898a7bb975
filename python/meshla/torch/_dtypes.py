"""The torch dtypes by meshla's own (one table for every pillar; which of them an op takes is
the extension's rule, checked there), and tensors as the extension's checks see them."""

import torch
from torch._subclasses.fake_tensor import is_fake

from meshla import _meshla

DTYPES = {
    torch.float32: _meshla.DType.float32,
    torch.float64: _meshla.DType.float64,
    torch.float16: _meshla.DType.float16,
    torch.bfloat16: _meshla.DType.bfloat16,
    torch.complex64: _meshla.DType.complex64,
    torch.complex128: _meshla.DType.complex128,
    torch.int32: _meshla.DType.int32,
    torch.int64: _meshla.DType.int64,
    torch.float8_e4m3fn: _meshla.DType.float8_e4m3fn,
    torch.float8_e5m2: _meshla.DType.float8_e5m2,
}


def dtype_of(name: str, t: torch.Tensor):
    """``t``'s dtype as meshla's, or a ValueError naming the argument."""
    dtype = DTYPES.get(t.dtype)
    if dtype is None:
        raise ValueError(f"{name}.dtype={t.dtype} is not one meshla takes")
    return dtype


def device_of(name: str, t: torch.Tensor) -> int:
    """Where ``t`` is as the extension counts: its CUDA ordinal, or -1 for the CPU."""
    if t.device.type == "cuda":
        return t.device.index
    if t.device.type == "cpu":
        return -1
    raise ValueError(f"{name} is on {t.device}; meshla takes CUDA or CPU tensors")


def meta(name: str, t: torch.Tensor | None, device: int | None = None):
    """``t``'s metadata for the extension's checks (meshla's ArrayMeta): shape, strides, dtype,
    device (``device`` where given: a meta tensor's is the one it stands in for), and its address
    where it has data (not a fake or meta tensor's)."""
    if t is None:
        return None
    abstract = t.device.type == "meta" or is_fake(t)
    if device is None:
        device = device_of(name, t)
    if abstract:  # sizes may be symbolic under torch.compile: the check takes them as they are
        return _meshla.ArrayMeta([int(d) for d in t.shape], [int(d) for d in t.stride()],
                                 dtype_of(name, t), device, 0, name)
    return _meshla.ArrayMeta(t.shape, t.stride(), dtype_of(name, t), device, t.data_ptr(), name)
