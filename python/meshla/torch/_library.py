"""What meshla's torch modules share: the ``torch.ops.meshla`` library and DLPack capsules.

The ops are defined on a torch.library.Library rather than with torch.library.custom_op, whose
Python layers cost about 10 us more host time per call (one H100 host: 36 against 45 us for the
grouped dgrad op, where torch's grouped_mm takes 21), which shows beside the 150 us GPU time of a
small MoE layer; an autograd kernel on the op would cost another 11 us, so autograd lives in
autograd.Functions that call the ops. Being ops, they are opaque to torch.compile, which traces
the Python around them (checks, autocast, autograd) into its graphs.
"""

import torch
from torch.utils.dlpack import to_dlpack

_LIBRARY = torch.library.Library("meshla", "FRAGMENT")


def op(schema: str):
    """Defines ``torch.ops.meshla.<name>`` from ``schema``; the decorated function is its kernel on
    every device (it branches on CPU and CUDA itself)."""
    def define(fn):
        name = schema.split("(", 1)[0]
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        return fn
    return define


def capsule(t):
    """``t`` as a DLPack capsule for the extension, None as None."""
    return None if t is None else to_dlpack(t)


def current_stream(index: int) -> int:
    """The current CUDA stream of device ``index`` as the extension takes it, its raw handle: every
    call pays this on the host, and ``torch.cuda.current_stream(device).cuda_stream``, which builds
    a Stream object, took 3 to 7 us of it on an H100 host."""
    return torch._C._cuda_getCurrentRawStream(index)
