"""What meshla's torch modules share: the ``torch.ops.meshla`` library and DLPack capsules.

The ops are defined on a torch.library.Library rather than with torch.library.custom_op, whose
Python layers cost about 10 us more host time per call (one H100 host: 36 against 45 us for the
grouped dgrad op, where torch's grouped_mm takes 21), which shows beside the 150 us GPU time of a
small MoE layer; an autograd kernel on the op would cost another 11 us, so autograd lives in
autograd.Functions that call the ops. Being ops, they are opaque to torch.compile, which traces
the Python around them (checks, autocast, autograd) into its graphs.

meshla's functions call an op only where something needs to see it (:func:`needs_the_op`), and
otherwise do its work themselves (see :func:`op`): the dispatcher's round trip into Python and
back cost about 18 us of a collective matmul's 70 us on the host.
"""

import functools

import torch
from torch.utils._device import DeviceContext
from torch.utils.dlpack import to_dlpack

_LIBRARY = torch.library.Library("meshla", "FRAGMENT")

# Tensors an op's kernel may be handed without the dispatcher: torch's own types, not subclasses
# (FakeTensor, FunctionalTensor, DTensor), which need the op to dispatch on.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _plain_cuda(arg) -> bool:
    if isinstance(arg, torch.Tensor):
        return type(arg) in _PLAIN_TENSORS and arg.is_cuda
    if isinstance(arg, (list, tuple)):
        return all(map(_plain_cuda, arg))  # map: a generator costs its frames on every call
    return True


def needs_the_op(args) -> bool:
    """Whether a call must go through the dispatcher: while torch.compile, torch.export or
    torch.jit.trace traces (they record the op; the tracer would record the kernel's empty outputs
    instead), under functorch transforms (vmap, functionalize: their tensors wrap others and have
    no data of their own), under a dispatch mode (FakeTensorMode, FlopCounterMode) or a torch
    function mode (which would see the torch calls inside the kernel instead of the op; a default
    device's excepted, see _watching_function_mode), under a profiler started from Python
    (torch.profiler, emit_nvtx: the trace names the op), and on tensors other than plain CUDA ones
    (subclasses, meta tensors for the op's fake, CPU tensors, kept on one path)."""
    return (torch.compiler.is_compiling() or torch._C._get_tracing_state() is not None
            or torch._C._are_functorch_transforms_active()
            or torch._C._len_torch_dispatch_stack() > 0
            or (torch._C._is_torch_function_mode_enabled() and _watching_function_mode())
            or torch.autograd.profiler._is_profiler_enabled
            or not all(map(_plain_cuda, args)))


def _watching_function_mode() -> bool:
    """Whether a torch function mode other than a default device's is on. torch.device(...) as
    a context and torch.set_default_device are modes too, which only fill in the device of
    factory calls (the kernels name theirs): a program that sets one keeps the direct calls."""
    return not all(isinstance(mode, DeviceContext)
                   for mode in torch.overrides._get_current_function_mode_stack())


def define(schema: str):
    """Defines ``torch.ops.meshla.<name>`` from ``schema`` with the decorated function as its
    kernel on every device (it branches on CPU and CUDA itself), and returns the op. Its callers
    call it only where ``needs_the_op``, and otherwise do its work themselves (see :func:`op`)."""
    def decorate(kernel):
        name = schema.split("(", 1)[0]
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
        return getattr(torch.ops.meshla, name)
    return decorate


def op(schema: str):
    """:func:`define`, for ops whose arguments are their callers' own: returns the function that
    meshla calls the op by, which runs the op where something needs to see it, else the kernel
    directly, which is all the op would run. (The collective matmuls, whose ops take the group by
    its key and the Tuning as ints, skip that encoding too: they choose themselves.)"""
    def decorate(kernel):
        the_op = define(schema)(kernel)

        @functools.wraps(kernel)
        def call(*args):
            return the_op(*args) if needs_the_op(args) else kernel(*args)
        return call
    return decorate


def capsule(t):
    """``t`` as a DLPack capsule for the extension, None as None."""
    return None if t is None else to_dlpack(t)


def workspace(nbytes: int, device) -> torch.Tensor:
    """``nbytes`` of the device's memory for the extension: int64 words (DLPack hands it no uint8;
    the caching allocator's blocks start on 512-byte boundaries), stream-ordered, so that calls on
    other streams do not share one."""
    return torch.empty(-(-nbytes // 8), dtype=torch.int64, device=device)


def current_stream(index: int) -> int:
    """The current CUDA stream of device ``index`` as the extension takes it, its raw handle: every
    call pays this on the host, and ``torch.cuda.current_stream(device).cuda_stream``, which builds
    a Stream object, took 3 to 7 us of it on an H100 host."""
    return torch._C._cuda_getCurrentRawStream(index)
