"""PyTorch front end of meshla: collective matmul (below) and the tensor-parallel layers over it
(:mod:`meshla.torch.parallel_linear`: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`),
grouped GEMM for Mixture-of-Experts
(:mod:`meshla.torch.grouped`: :class:`GroupedLinear`, :func:`grouped_linear`) and distributed
dense solvers over the GPUs of one process (:mod:`meshla.torch.linalg`).

A :class:`TPGroup` names the tensor-parallel group an op runs over. Build one from a
torch.distributed process group of any backend (:func:`group_from_process_group`), from an mpi4py
communicator (:func:`group_from_mpi`), or, for one process driving several GPUs from threads, one
per device (:func:`local_groups`).

On CUDA tensors the ops run meshla's plans on the current CUDA stream, so they can be captured in
a CUDA graph once each shape has run eagerly. On CPU tensors they run a reference implementation
(torch.distributed collective + matmul) over the group's process group, so the same code runs on a
machine without GPUs.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import operator
import sys
import threading
import weakref
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

import meshla
from meshla import _meshla
from meshla.torch import _library
from meshla.torch._dtypes import DTYPE_NAMES
from meshla.torch._main_grad import added_to_main_grad, weight_grad_into_main_grad

__all__ = [
    "ColumnParallelLinear",
    "GroupedLinear",
    "RowParallelLinear",
    "TPGroup",
    "Tuning",
    "all_gather_matmul",
    "check_device_errors",
    "column_parallel_matmul",
    "group_from_mpi",
    "group_from_process_group",
    "grouped_linear",
    "linalg",
    "local_groups",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "packed_group_stride",
]


@dataclass(frozen=True)
class Tuning:
    """How a collective matmul communicates and overlaps: ``backend`` ("auto": "symmetric" where
    every pair of GPUs is linked by NVLink and the shape allows it, else "nccl"; "nccl";
    "symmetric": copy engines into peer-mapped buffers, one host with CUDA peer access,
    "cublasmp": cuBLASMp's own overlap, see :func:`meshla.backend_unavailable_reason`),
    ``algorithm`` ("auto", "sequential", "pipelined", "ring"), ``chunks`` (pipeline depth, 0: the
    default), ``comm_sms`` (SMs the overlapped GEMMs leave to NCCL, -1: default) and ``comm_ctas``
    (thread blocks NCCL may use for the transfers, 0: NCCL's choice)."""

    algorithm: _meshla.Algorithm = _meshla.Algorithm.auto
    chunks: int = 0
    comm_sms: int = -1
    comm_ctas: int = 0
    backend: _meshla.Backend = _meshla.Backend.auto

    @staticmethod
    def of(algorithm="auto", chunks: int = 0, comm_sms: int = -1, comm_ctas: int = 0,
           backend="auto") -> Tuning:
        # Uncached while torch.compile traces, which warns at every lru_cache call it meets (the
        # Tuning becomes a constant of the graph anyway), and for an unhashable argument, which
        # the uncached path then names.
        if not torch.compiler.is_compiling():
            try:
                return _tuning_of(algorithm, chunks, comm_sms, comm_ctas, backend)
            except TypeError:
                pass
        return _tuning_of.__wrapped__(algorithm, chunks, comm_sms, comm_ctas, backend)

    def options(self) -> dict:
        """The op keywords that give this Tuning, e.g. ``matmul_all_reduce(..., **t.options())``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def ints(self) -> list[int]:
        """This Tuning as a torch.ops.meshla op's ``int[] tuning`` (see :meth:`of_ints`)."""
        return [self.algorithm.value, self.chunks, self.comm_sms, self.comm_ctas,
                self.backend.value]

    @staticmethod
    def of_ints(values) -> Tuning:
        return _tuning_of_ints(tuple(values))


# Every call builds its Tuning (a frozen dataclass takes 1 to 2 us to make): once per distinct set
# of arguments, each of its own type, so that 1.0 is refused whether or not 1 came first.
@functools.lru_cache(maxsize=1024, typed=True)
def _tuning_of(algorithm, chunks, comm_sms, comm_ctas, backend) -> Tuning:
    # One spelling per choice, so "ring" and Algorithm.ring share a plan; plain ints for the
    # numbers, as the ops' int[] tuning has them (numpy integers included).
    return Tuning(_choice(_meshla.Algorithm, "algorithm", algorithm),
                  _integer("chunks", chunks), _integer("comm_sms", comm_sms),
                  _integer("comm_ctas", comm_ctas), _choice(_meshla.Backend, "backend", backend))


def _integer(argument: str, value) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{argument}={value!r} is not an integer") from None


# Every op call converts its int[] tuning back: built once per distinct list, not per call.
@functools.lru_cache(maxsize=None)
def _tuning_of_ints(values: tuple) -> Tuning:
    if len(values) != 5:
        raise ValueError(f"tuning={list(values)} must be 5 ints: algorithm, chunks, comm_sms, "
                         "comm_ctas, backend (Tuning.ints())")
    algorithm, chunks, comm_sms, comm_ctas, backend = values
    return Tuning(_meshla.Algorithm(algorithm), chunks, comm_sms, comm_ctas,
                  _meshla.Backend(backend))


# Every TPGroup by its key, which the torch.ops.meshla ops take in its place (an op's arguments
# are tensors and numbers); a group is dropped from here when its last user lets it go.
_GROUPS: weakref.WeakValueDictionary[int, TPGroup] = weakref.WeakValueDictionary()
_GROUP_KEYS = itertools.count()
_GROUPS_LOCK = threading.Lock()  # for free-threaded Python: next() on a count is not atomic


@atexit.register
def _quiet_leaks_after_compile():
    """torch.compile's caches (guards, graphs) hold meshla's types and functions, and the plans of
    the groups that compiled code ran on, until after the extension is torn down, where nanobind
    would report them as leaks of the bindings (its switch for this exists for PyTorch's case).
    Programs that compiled nothing keep the warnings, so the bindings' own leaks still show."""
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    if counters is not None and counters["stats"]["unique_graphs"]:
        _meshla.set_leak_warnings(False)


def _group_of(key: int) -> TPGroup:
    group = _GROUPS.get(key)
    if group is None:
        raise ValueError(f"TPGroup {key} no longer exists: keep the group alive while ops (or "
                         "graphs compiled with them) that use it run")
    return group


@dataclass(eq=False)
class TPGroup:
    """A tensor-parallel group.

    ``comm`` is the NCCL communicator for CUDA tensors (None where the group has no GPU);
    ``process_group`` the torch.distributed group used by the CPU reference path (None for groups
    made by :func:`local_groups` or :func:`group_from_mpi`); ``device`` the communicator's GPU,
    or the CPU; ``key`` names the group in the torch.ops.meshla ops.
    """

    rank: int
    size: int
    comm: _meshla.Communicator | None = None
    process_group: Any = None
    device: torch.device = field(init=False)
    key: int = field(init=False)
    # Plans by (op, dtype, m, n, k, trans_b, bias, return_gathered, Tuning), and all-gathers by
    # ("all_gather", dtype, rows, cols). The nccl and symmetric plans of a group keep their buffers
    # and cuBLASLt workspace in one workspace sized by the largest shape, so a plan per shape
    # costs its GEMMs' tuning, not device memory.
    _plans: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        # Plain attributes, which torch.compile reads as constants.
        self.device = (torch.device("cpu") if self.comm is None
                       else torch.device("cuda", self.comm.device))
        with _GROUPS_LOCK:
            self.key = next(_GROUP_KEYS)
            _GROUPS[self.key] = self
        if self.comm is not None:
            meshla._release_communicators_no_more_at_exit()

    # A group is a handle to this process's communicators: copies of what holds one (a layer
    # deep-copied for an EMA or a reference model) run in the same group.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError("a TPGroup cannot be pickled: its communicators belong to this process; "
                        "make the group again where the object is unpickled")

    def plan(self, op, dtype, m, n, k, trans_b, bias, return_gathered, tuning: Tuning):
        if self.comm is None:
            raise ValueError(
                f"{op.name}: this TPGroup has no CUDA communicator (it was built for CPU tensors)"
            )
        return self._cached(
            (op, dtype, m, n, k, trans_b, bias, return_gathered, tuning),
            lambda: _meshla.CollectiveMatmul(
                self.comm, op, DTYPE_NAMES[dtype], m, n, k, tuning.algorithm,
                backend=tuning.backend, trans_b=trans_b, bias=bias, return_gathered=return_gathered,
                chunks=tuning.chunks, comm_sms=tuning.comm_sms, comm_ctas=tuning.comm_ctas,
            ))

    def all_gather_plan(self, dtype, rows, cols):
        """The group's all-gather of [rows, cols] per rank (for a backward that gathers rows
        again), in the order of its collective matmuls."""
        return self._cached(("all_gather", dtype, rows, cols),
                            lambda: _meshla.AllGather(self.comm, DTYPE_NAMES[dtype], rows, cols))

    def _cached(self, key, make):
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
        return plan


def _cuda_device(device) -> int | None:
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"device={device} is neither a CUDA device nor the CPU")
    return device.index if device.index is not None else torch.cuda.current_device()


def group_from_process_group(group=None, device=None, timeout_s: float = 300.0) -> TPGroup:
    """The TPGroup of a torch.distributed process group (the default group if None).

    Collective over ``group``. Its rank 0 makes the NCCL unique id and broadcasts it through the
    group itself, whatever its backend (gloo, nccl, mpi). ``device`` is this rank's GPU (default:
    the current one); pass ``"cpu"``, or run without GPUs, for a CPU-only group.
    """
    if not dist.is_initialized():
        raise ValueError("group_from_process_group: torch.distributed is not initialized")
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    size = dist.get_world_size(group)
    cuda_device = _cuda_device(device)
    if cuda_device is None:
        return TPGroup(rank=rank, size=size, process_group=group)
    unique = _exchange_unique_id(group)
    comm = _meshla.Communicator(unique, rank, size, cuda_device, timeout_s=timeout_s)
    return TPGroup(rank=rank, size=size, comm=comm, process_group=group)


def _exchange_unique_id(group) -> bytes:
    """A unique id made on the group's rank 0 and broadcast over the group (any backend)."""
    payload = [_meshla.unique_id() if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(payload, group_src=0, group=group)
    return payload[0]


def group_from_mpi(mpi_comm, device=None, timeout_s: float = 300.0) -> TPGroup:
    """The TPGroup of an mpi4py communicator; the unique id travels by ``mpi_comm.bcast``."""
    rank = mpi_comm.Get_rank()
    size = mpi_comm.Get_size()
    cuda_device = _cuda_device(device)
    if cuda_device is None:
        raise ValueError("group_from_mpi: needs a CUDA device; use a gloo process group on CPU")
    unique = mpi_comm.bcast(_meshla.unique_id() if rank == 0 else None, root=0)
    comm = _meshla.Communicator(unique, rank, size, cuda_device, timeout_s=timeout_s)
    return TPGroup(rank=rank, size=size, comm=comm)


def local_groups(devices, timeout_s: float = 300.0) -> list[TPGroup]:
    """One TPGroup per device for a group driven by this process, each used from its own thread."""
    devices = [_cuda_device(d) if not isinstance(d, int) else d for d in devices]
    comms = _meshla.Communicator.create_local(devices, timeout_s=timeout_s)
    return [TPGroup(rank=c.rank, size=c.size, comm=c) for c in comms]


def _choice(enum, argument: str, name):
    if isinstance(name, enum):
        return name
    # An attribute that is a member (alone, the lookup took "__doc__" for one). Not by
    # __members__: torch.compile traces this, and Dynamo reads that as the property itself.
    member = getattr(enum, name, None) if isinstance(name, str) else None
    if not isinstance(member, enum):
        names = ", ".join(value.name for value in enum)
        raise ValueError(f"{argument}={name!r} is not one of {names}")
    return member


def _shape(t) -> str:
    return str(list(t.shape))


def _check_operands(op: str, a, b, bias, trans_b: bool, group: TPGroup):
    if not isinstance(group, TPGroup):
        raise ValueError(f"{op}: group must be a meshla.torch.TPGroup, got {type(group).__name__}")
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            shape = _shape(t) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{op}: {name} must be a 2-D tensor, got {shape}")
    if a.dtype not in DTYPE_NAMES:
        raise ValueError(f"{op}: a.dtype={a.dtype} is not supported; use bfloat16, float16 or float32")
    for name, t in (("b", b), ("bias", bias)):
        if t is not None and (t.dtype != a.dtype or t.device != a.device):
            raise ValueError(
                f"{op}: {name} is {t.dtype} on {t.device} but a is {a.dtype} on {a.device}"
            )
    k_b = b.shape[1] if trans_b else b.shape[0]
    if k_b != a.shape[1]:
        layout = "[n, k]" if trans_b else "[k, n]"
        raise ValueError(
            f"{op}: b.shape={_shape(b)} ({layout}) does not match a.shape={_shape(a)}: "
            f"the contraction needs k={a.shape[1]}"
        )
    n = _n_of(b, trans_b)
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise ValueError(f"{op}: bias.shape={_shape(bias)} but expected [{n}]")
    if a.device.type == "cuda" and a.device != group.device:
        raise ValueError(f"{op}: a is on {a.device} but the group's communicator uses {group.device}")
    if a.device.type == "cpu" and group.process_group is None:
        raise ValueError(f"{op}: CPU tensors need a TPGroup with a torch.distributed process group")


def _output(op: str, name: str, given, shape, like):
    """The caller's preallocated output ``name``, checked, or a fresh one."""
    if given is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if tuple(given.shape) != tuple(shape) or given.dtype != like.dtype or given.device != like.device:
        raise ValueError(
            f"{op}: {name} has shape {_shape(given)}, {given.dtype} on {given.device}; expected "
            f"{list(shape)}, {like.dtype} on {like.device}"
        )
    if not given.is_contiguous():
        raise ValueError(f"{op}: {name} with shape {_shape(given)} must be contiguous")
    return given


def _bytes_spanned(t) -> tuple[int, int]:
    """[first, last) bytes that ``t`` may touch (nothing for an empty tensor)."""
    if t.numel() == 0:
        return 0, 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _refuse_aliases(op: str, inputs: dict, outputs: dict):
    """The CPU path keeps the CUDA plans' rule (collective/validation.cpp): no output shares memory
    with an input or with another output (the reference would compute from, or deliver into,
    memory that another of its outputs overwrites)."""
    def overlap(x, y):
        (x0, x1), (y0, y1) = _bytes_spanned(x), _bytes_spanned(y)
        return x0 < y1 and y0 < x1
    given = {name: t for name, t in outputs.items() if t is not None}
    for output_name, output in given.items():
        for input_name, tensor in inputs.items():
            if tensor is not None and overlap(output, tensor):
                raise ValueError(f"{op}: {output_name} shares memory with the input "
                                 f"{input_name}; outputs must not alias inputs")
    if len(given) == 2 and overlap(*given.values()):
        raise ValueError(f"{op}: out and gathered share memory; outputs must not alias")


def _deliver(op: str, name: str, result, out):
    """The CPU path's result, copied into the caller's ``out`` where one was given."""
    if out is None:
        return result.contiguous()
    return _output(op, name, out, tuple(result.shape), result).copy_(result)


def _run(op, group, a, b, bias, out, gathered, m, n, k, trans_b, tuning, given=()):
    """Executes the plan into ``out`` (and ``gathered``); ``given`` are those of them the caller
    passed (out=, gathered_out=)."""
    plan = group.plan(op, a.dtype, m, n, k, trans_b, bias is not None, gathered is not None,
                      tuning)
    capsule = _library.capsule
    plan.execute(capsule(a.contiguous()), capsule(b.contiguous()),
                 capsule(None if bias is None else bias.contiguous()), capsule(out),
                 capsule(gathered), _library.current_stream(a.get_device()))
    # The plan writes through DLPack, which autograd does not see: a caller's output that a
    # backward saved must read as changed, as after torch's own out= ops, or that backward would
    # use the new contents without a word.
    for written in given:
        if written is not None:
            torch.autograd.graph.increment_version(written)


def _summed_over_ranks(a, b, bias, trans_b: bool, group: TPGroup):
    """The CPU path's sum over ranks of a @ b, in float32, the bias added once."""
    total = _reference_product(a, b, bias, trans_b, group.rank == 0)
    dist.all_reduce(total, group=group.process_group)
    return total


def _reference_product(a, b, bias, trans_b: bool, add_bias: bool):
    b = b.t() if trans_b else b
    with torch.autocast(a.device.type, enabled=False):  # in float32, also under autocast
        product = a.float() @ b.float()
    if bias is not None and add_bias:
        product += bias.float()
    return product


def _autocast(a, b, bias, *outputs):
    """The operands as torch.autocast would give them to a matmul: its dtype where it is on for
    their device (e.g. bf16 activations beside fp32 weights); float64 and calls with outputs
    given (as torch leaves ``out=`` calls) unchanged."""
    if not isinstance(a, torch.Tensor):
        return a, b, bias
    device_type = a.device.type
    if (device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type)
            or any(given is not None for given in outputs)):
        return a, b, bias
    dtype = torch.get_autocast_dtype(device_type)
    castable = (torch.float32, torch.float16, torch.bfloat16)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in castable else t
                 for t in (a, b, bias))


def _prepare(op: str, a, b, bias, trans_b: bool, group: TPGroup, algorithm, chunks, comm_sms,
             comm_ctas, backend, *outputs):
    """A call's operands as it runs them (see _autocast), checked, and its Tuning."""
    a, b, bias = _autocast(a, b, bias, *outputs)
    _check_operands(op, a, b, bias, trans_b, group)
    return a, b, bias, Tuning.of(algorithm, chunks, comm_sms, comm_ctas, backend)


def _wants_grad(op: str, tensors, tuning: Tuning, **outputs) -> bool:
    """Whether the op runs under autograd; the outputs given and backend=cublasmp are refused
    there, as torch refuses ``out=`` on differentiable calls."""
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors):
        return False
    for name, given in outputs.items():
        if given is not None:
            raise NotImplementedError(
                f"{op}: {name}= does not support autograd, but an input requires grad; leave it "
                "out or call under torch.no_grad()")
    if tuning.backend == _meshla.Backend.cublasmp:
        raise NotImplementedError(
            f"{op}: backend=cublasmp runs no backward here (it cannot return the gathered rows "
            "that the collective matmuls' backward needs); use backend='nccl' or 'symmetric', or "
            "call under torch.no_grad()")
    return True


def all_gather_matmul(a, b, group: TPGroup, *, bias=None, trans_b: bool = False,
                      return_gathered: bool = False, out=None, gathered_out=None,
                      algorithm="auto", chunks: int = 0, comm_sms: int = -1, comm_ctas: int = 0,
                      backend="auto", recompute_gathered: bool = False,
                      fuse_wgrad_accumulation: bool = False):
    """``all_gather(a) @ b (+ bias)`` with a row-sharded ``a`` of shape [m/tp, k] on every rank.

    ``b`` is [k, n], or [n, k] with ``trans_b`` (a torch.nn.Linear weight). Returns the [m, n]
    product, and with ``return_gathered`` also the gathered [m, k] ``a``.
    ``out`` and ``gathered_out`` are optional preallocated outputs.

    ``backend``, ``algorithm``, ``chunks``, ``comm_sms`` and ``comm_ctas`` choose how the data
    moves and how it overlaps the GEMM (see :class:`Tuning`); the defaults are meshla's measured
    choices.

    Differentiable in ``a``, ``b`` and ``bias`` (a column-parallel layer with sequence
    parallelism): ``a``'s gradient is the reduce-scatter of the product's gradient times ``b``ᵀ
    (a :func:`matmul_reduce_scatter`), ``b``'s and ``bias``'s are this rank's own. ``b``'s
    gradient needs the gathered ``a`` (which carries no gradient itself): kept from the forward,
    or with ``recompute_gathered`` gathered again in the backward (one more all-gather there,
    for tp times less memory kept; also where ``return_gathered`` gives the caller the gathered
    rows, which the backward does not hold on to). Every rank of the group must run the
    backward, as it runs the forward, with the same inputs requiring grad and the same
    ``recompute_gathered``. Under torch.autocast the operands are cast to its dtype as for a
    matmul, unless outputs are given. ``fuse_wgrad_accumulation`` adds ``b``'s gradient to
    ``b.main_grad`` instead (see :func:`column_parallel_matmul`).
    """
    op = _meshla.CollectiveOp.all_gather_matmul
    weight = b
    a, b, bias, tuning = _prepare(op.name, a, b, bias, trans_b, group, algorithm, chunks,
                                  comm_sms, comm_ctas, backend, out, gathered_out)
    if gathered_out is not None and not return_gathered:
        raise ValueError(f"{op.name}: gathered_out is given but return_gathered=False")
    if _wants_grad(op.name, (a, b, bias), tuning, out=out, gathered_out=gathered_out):
        return _AllGatherMatmul.apply(a, b, bias, group, trans_b, tuning, return_gathered,
                                      recompute_gathered,
                                      _fused_wgrad(op.name, weight, b, fuse_wgrad_accumulation))
    product, gathered = _all_gather_matmul(a, b, bias, group, trans_b, return_gathered, tuning,
                                           out, gathered_out)
    return (product, gathered) if return_gathered else product


def matmul_reduce_scatter(a, b, group: TPGroup, *, bias=None, trans_b: bool = False, out=None,
                          algorithm="auto", chunks: int = 0, comm_sms: int = -1,
                          comm_ctas: int = 0, backend="auto",
                          fuse_wgrad_accumulation: bool = False):
    """This rank's [m/tp, n] row block of ``sum over ranks(a @ b) (+ bias)``.

    ``a`` is [m, k_local] and ``b`` [k_local, n] (or [n, k_local] with ``trans_b``): the slices of
    a row-parallel linear layer. The bias is added once, not once per rank.

    Differentiable in ``a``, ``b`` and ``bias`` (a row-parallel layer with sequence parallelism):
    the output's gradient is all-gathered (fused with ``a``'s gradient in an
    :func:`all_gather_matmul` where ``a`` needs one, a plain all-gather otherwise), so ``b``'s
    gradient is complete, and so is ``bias``'s: summed over
    every rank's rows, on every rank (do not all-reduce it again, unlike Megatron-LM's
    sequence-parallel bias, whose partial sums it all-reduces later). Every rank of the group must
    run the backward, as it runs the forward, with the same inputs requiring grad.
    ``fuse_wgrad_accumulation`` as in :func:`column_parallel_matmul`.
    """
    op = _meshla.CollectiveOp.matmul_reduce_scatter
    weight = b
    a, b, bias, tuning = _prepare(op.name, a, b, bias, trans_b, group, algorithm, chunks,
                                  comm_sms, comm_ctas, backend, out)
    m, k = a.shape
    if m % group.size != 0:
        raise ValueError(f"{op.name}: a.shape[0]={m} is not divisible by tp_size={group.size}")
    if _wants_grad(op.name, (a, b, bias), tuning, out=out):
        return _MatmulReduceScatter.apply(
            a, b, bias, group, trans_b, tuning,
            _fused_wgrad(op.name, weight, b, fuse_wgrad_accumulation))
    return _matmul_reduce_scatter(a, b, bias, group, trans_b, tuning, out)


def matmul_all_reduce(a, b, group: TPGroup, *, bias=None, trans_b: bool = False, out=None,
                      algorithm="auto", chunks: int = 0, comm_sms: int = -1, comm_ctas: int = 0,
                      backend="auto", fuse_wgrad_accumulation: bool = False):
    """``sum over ranks(a @ b) (+ bias)``, the whole [m, n] result on every rank.

    Differentiable in ``a``, ``b`` and ``bias`` (a row-parallel layer without sequence
    parallelism): the result is the same on every rank, so each rank's loss is taken as the same
    function of it and its gradient is used as it is, with no communication (as Megatron-LM's
    row-parallel layer does). ``fuse_wgrad_accumulation`` as in :func:`column_parallel_matmul`.
    """
    op = _meshla.CollectiveOp.matmul_all_reduce
    weight = b
    a, b, bias, tuning = _prepare(op.name, a, b, bias, trans_b, group, algorithm, chunks,
                                  comm_sms, comm_ctas, backend, out)
    if _wants_grad(op.name, (a, b, bias), tuning, out=out):
        return _MatmulAllReduce.apply(a, b, bias, group, trans_b, tuning,
                                      _fused_wgrad(op.name, weight, b, fuse_wgrad_accumulation))
    return _matmul_all_reduce(a, b, bias, group, trans_b, tuning, out)


def column_parallel_matmul(a, b, group: TPGroup, *, bias=None, trans_b: bool = False,
                           algorithm="auto", chunks: int = 0, comm_sms: int = -1,
                           comm_ctas: int = 0, backend="auto",
                           fuse_wgrad_accumulation: bool = False):
    """``a @ b (+ bias)`` for a column-parallel layer without sequence parallelism: ``a`` [m, k]
    is the same on every rank, ``b`` this rank's [k, n] column slice ([n, k] with ``trans_b``).

    The forward is a local GEMM. Differentiable in ``a``, ``b`` and ``bias``: ``a``'s gradient is
    summed over the ranks, its GEMM fused with that all-reduce (a :func:`matmul_all_reduce`, with
    ``backend``, ``algorithm``, ``chunks``, ``comm_sms`` and ``comm_ctas``); ``b``'s and
    ``bias``'s are this rank's own. It is the conjugate of :func:`matmul_all_reduce`, as
    Megatron-LM's column-parallel layer is of its row-parallel one; with sequence parallelism, use
    :func:`all_gather_matmul`. Every rank of the group must run the backward, with the same
    inputs requiring grad.

    ``fuse_wgrad_accumulation``: the backward adds ``b``'s gradient to ``b.main_grad`` (float32 or
    ``b``'s dtype, ``b``'s shape and device, made by the caller, e.g. Megatron-LM's distributed
    optimizer) and gives ``b`` no ``.grad``; a float32 main_grad of 16-bit operands takes one GEMM
    with a float32 output (torch >= 2.10; before, the 16-bit product is added). ``b`` carrying
    Megatron's ``grad_added_to_main_grad`` mark gets it set and a placeholder ``.grad`` that
    Megatron's DDP drops (zeros where ``b`` has ``zero_out_wgrad``, which it adds), as
    TransformerEngine's layers give them. Megatron-FSDP's ``b`` (``__fsdp_param__``) gives its
    main_grad through ``get_main_grad()``, and with ``overwrite_main_grad`` the gradient replaces
    the main_grad's contents instead. A trained ``b`` must be in the compute dtype: under
    torch.autocast it is not cast. Eager only: torch.compile breaks its graph at the call
    (``fullgraph=True`` refuses it).
    """
    name = "column_parallel_matmul"
    weight = b
    a, b, bias, tuning = _prepare(name, a, b, bias, trans_b, group, algorithm, chunks,
                                  comm_sms, comm_ctas, backend)
    if _wants_grad(name, (a, b, bias), tuning):
        return _ColumnParallelMatmul.apply(a, b, bias, group, trans_b, tuning,
                                           _fused_wgrad(name, weight, b, fuse_wgrad_accumulation))
    return _local_product(a, b, bias, trans_b)


def _local_product(a, b, bias, trans_b: bool):
    return torch.nn.functional.linear(a, b if trans_b else b.t(), bias)


# The collectives are torch.ops.meshla ops, which take the group by its key and the Tuning as
# ints. A call goes through its op only where something needs to see it (see
# meshla.torch._library); otherwise it runs the op's work (the *_into functions) on the group and
# Tuning themselves, as do calls with outputs given (an op that fills an output given needs a
# schema of its own), where torch.compile breaks its graph on CUDA tensors.


def _refuse_autograd(op: str, *tensors):
    """The ops carry no autograd (the autograd.Functions below call them without grad): called
    directly on inputs that require grad, their gradients would be missing, or on CPU wrong."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise NotImplementedError(
            f"torch.ops.meshla.{op} has no autograd: call meshla.torch's function of that name, "
            "its differentiable form, or call the op under torch.no_grad()")


def _all_gather_matmul_into(a, b, bias, group, trans_b, return_gathered, tuning, out,
                            gathered_out):
    """(product, gathered a or None), into the outputs given or fresh ones."""
    op = _meshla.CollectiveOp.all_gather_matmul
    m, k, n = a.shape[0] * group.size, a.shape[1], _n_of(b, trans_b)
    if a.device.type == "cpu":
        _refuse_aliases(op.name, {"a": a, "b": b, "bias": bias},
                        {"out": out, "gathered": gathered_out if return_gathered else None})
        gathered = _all_gather_rows(a, group)
        product = _reference_product(gathered, b, bias, trans_b, True).to(a.dtype)
        return (_deliver(op.name, "out", product, out),
                _deliver(op.name, "gathered_out", gathered, gathered_out) if return_gathered
                else None)
    given = (out, gathered_out)
    out = _output(op.name, "out", out, (m, n), a)
    gathered = _output(op.name, "gathered_out", gathered_out, (m, k), a) if return_gathered else None
    _run(op, group, a, b, bias, out, gathered, m, n, k, trans_b, tuning, given)
    return out, gathered


@_library.define("all_gather_matmul(Tensor a, Tensor b, Tensor? bias, int group, "
                 "bool trans_b, bool return_gathered, int[] tuning) -> (Tensor, Tensor)")
def _all_gather_matmul_op(a, b, bias, group, trans_b, return_gathered, tuning):
    _refuse_autograd("all_gather_matmul", a, b, bias)
    # The gathered a is [0, k] where it is not asked for: an op returns tensors.
    product, gathered = _all_gather_matmul_into(a, b, bias, _group_of(group), trans_b,
                                                return_gathered, Tuning.of_ints(tuning), None,
                                                None)
    return product, gathered if return_gathered else a.new_empty(0, a.shape[1])


@torch.library.register_fake("meshla::all_gather_matmul")
def _(a, b, bias, group, trans_b, return_gathered, tuning):
    m = a.shape[0] * _group_of(group).size
    return a.new_empty(m, _n_of(b, trans_b)), a.new_empty(m if return_gathered else 0, a.shape[1])


def _all_gather_matmul(a, b, bias, group, trans_b, return_gathered, tuning, out=None,
                       gathered_out=None):
    """(product, gathered a or None): the op where something needs to see it, else its work."""
    if out is None and gathered_out is None and _library.needs_the_op((a, b, bias)):
        product, gathered = _all_gather_matmul_op(a, b, bias, group.key, trans_b,
                                                  return_gathered, tuning.ints())
        return product, gathered if return_gathered else None
    return _all_gather_matmul_into(a, b, bias, group, trans_b, return_gathered, tuning, out,
                                   gathered_out)


def _matmul_reduce_scatter_into(a, b, bias, group, trans_b, tuning, out):
    op = _meshla.CollectiveOp.matmul_reduce_scatter
    (m, k), n = a.shape, _n_of(b, trans_b)
    if a.device.type == "cpu":
        _refuse_aliases(op.name, {"a": a, "b": b, "bias": bias}, {"out": out})
        total = _summed_over_ranks(a, b, bias, trans_b, group)
        block = m // group.size
        # A copy: a view would keep the whole sum alive (and an op's output must start at
        # offset 0, as its fake does).
        own_rows = total[group.rank * block:(group.rank + 1) * block].to(a.dtype, copy=True)
        return _deliver(op.name, "out", own_rows, out)
    given = (out,)
    out = _output(op.name, "out", out, (m // group.size, n), a)
    _run(op, group, a, b, bias, out, None, m, n, k, trans_b, tuning, given)
    return out


@_library.define("matmul_reduce_scatter(Tensor a, Tensor b, Tensor? bias, int group, "
                 "bool trans_b, int[] tuning) -> Tensor")
def _matmul_reduce_scatter_op(a, b, bias, group, trans_b, tuning):
    _refuse_autograd("matmul_reduce_scatter", a, b, bias)
    return _matmul_reduce_scatter_into(a, b, bias, _group_of(group), trans_b,
                                       Tuning.of_ints(tuning), None)


@torch.library.register_fake("meshla::matmul_reduce_scatter")
def _(a, b, bias, group, trans_b, tuning):
    return a.new_empty(a.shape[0] // _group_of(group).size, _n_of(b, trans_b))


def _matmul_reduce_scatter(a, b, bias, group, trans_b, tuning, out=None):
    if out is None and _library.needs_the_op((a, b, bias)):
        return _matmul_reduce_scatter_op(a, b, bias, group.key, trans_b, tuning.ints())
    return _matmul_reduce_scatter_into(a, b, bias, group, trans_b, tuning, out)


def _matmul_all_reduce_into(a, b, bias, group, trans_b, tuning, out):
    op = _meshla.CollectiveOp.matmul_all_reduce
    (m, k), n = a.shape, _n_of(b, trans_b)
    if a.device.type == "cpu":
        _refuse_aliases(op.name, {"a": a, "b": b, "bias": bias}, {"out": out})
        total = _summed_over_ranks(a, b, bias, trans_b, group)
        return _deliver(op.name, "out", total.to(a.dtype), out)
    given = (out,)
    out = _output(op.name, "out", out, (m, n), a)
    _run(op, group, a, b, bias, out, None, m, n, k, trans_b, tuning, given)
    return out


@_library.define("matmul_all_reduce(Tensor a, Tensor b, Tensor? bias, int group, "
                 "bool trans_b, int[] tuning) -> Tensor")
def _matmul_all_reduce_op(a, b, bias, group, trans_b, tuning):
    _refuse_autograd("matmul_all_reduce", a, b, bias)
    return _matmul_all_reduce_into(a, b, bias, _group_of(group), trans_b, Tuning.of_ints(tuning),
                                   None)


@torch.library.register_fake("meshla::matmul_all_reduce")
def _(a, b, bias, group, trans_b, tuning):
    return a.new_empty(a.shape[0], _n_of(b, trans_b))


def _matmul_all_reduce(a, b, bias, group, trans_b, tuning, out=None):
    if out is None and _library.needs_the_op((a, b, bias)):
        return _matmul_all_reduce_op(a, b, bias, group.key, trans_b, tuning.ints())
    return _matmul_all_reduce_into(a, b, bias, group, trans_b, tuning, out)


def _all_gather_rows(rows, group: TPGroup):
    """[tp * r, c] from every rank's [r, c] ``rows``, in rank order."""
    if rows.device.type == "cpu":
        parts = [torch.empty_like(rows) for _ in range(group.size)]
        dist.all_gather(parts, rows.contiguous(), group=group.process_group)
        return torch.cat(parts)
    gathered = torch.empty((rows.shape[0] * group.size, rows.shape[1]), dtype=rows.dtype,
                           device=rows.device)
    plan = group.all_gather_plan(rows.dtype, rows.shape[0], rows.shape[1])
    plan.execute(_library.capsule(rows.contiguous()), _library.capsule(gathered),
                 _library.current_stream(rows.get_device()))
    return gathered


@_library.define("all_gather(Tensor rows, int group) -> Tensor")
def _all_gather_op(rows, group):
    _refuse_autograd("all_gather", rows)
    return _all_gather_rows(rows, _group_of(group))


@torch.library.register_fake("meshla::all_gather")
def _(rows, group):
    return rows.new_empty(rows.shape[0] * _group_of(group).size, rows.shape[1])


def _all_gather(rows, group: TPGroup):
    if _library.needs_the_op((rows,)):
        return _all_gather_op(rows, group.key)
    return _all_gather_rows(rows, group)


# Autograd. Each op's backward is its conjugate, as in Megatron-LM's tensor and sequence
# parallelism: all-gather <-> reduce-scatter, all-reduce <-> nothing. The products with b are
# collective matmuls again, on the forward's backend with meshla's default algorithm (the
# forward's algorithm and chunks were chosen for other shapes); the weight gradients are local
# GEMMs on the rows the backward has.


def _weight_grad(rows, grad, trans_b: bool):
    """b's gradient for ``product = rows @ b`` (b [k, n]) or ``rows @ bᵀ`` (b [n, k])."""
    return grad.t() @ rows if trans_b else rows.t() @ grad


def _fused_wgrad(name: str, weight, b, fuse: bool) -> bool:
    """Whether the backward adds b's gradient to weight.main_grad (fuse_wgrad_accumulation): where
    asked and the weight trains. The call's b must then be the weight itself, not autocast's copy,
    which has no main_grad."""
    if not fuse or not weight.requires_grad:
        return False
    if b is not weight:
        raise ValueError(f"{name}(fuse_wgrad_accumulation=True): b is {weight.dtype} but the call "
                         f"computes in {b.dtype} (torch.autocast): give b in the compute dtype, "
                         "whose main_grad is accumulated")
    if torch.compiler.is_compiling():
        raise NotImplementedError(f"{name}(fuse_wgrad_accumulation=True) runs eagerly only: "
                                  "torch.compile cannot trace its backward's write to b.main_grad")
    return True


def _b_grad(ctx, name: str, rows, grad):
    """b's gradient, or with fuse_wgrad_accumulation its addition to b.main_grad and what autograd
    gets in its place (see meshla.torch._main_grad)."""
    if ctx.fused_weight is None:
        return _weight_grad(rows, grad, ctx.trans_b)
    weight_grad_into_main_grad(name, ctx.fused_weight, rows, grad, ctx.trans_b)
    return added_to_main_grad(ctx.fused_weight)


def _keep_fused_weight(ctx, b, fused_wgrad: bool):
    """The weight whose main_grad the backward adds to: the object itself, which has the
    attribute, not the saved tensors' unpacked b (a detached copy under activation checkpointing
    or offloading)."""
    ctx.fused_weight = b if fused_wgrad else None


def _n_of(b, trans_b: bool) -> int:
    return b.shape[0] if trans_b else b.shape[1]


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, group, trans_b, tuning, return_gathered, recompute_gathered,
                fused_wgrad):
        # b's gradient needs the gathered rows: kept, or this rank's kept and gathered again.
        keep = ctx.needs_input_grad[1] and not recompute_gathered
        gather = return_gathered or keep
        product, gathered = _all_gather_matmul(a, b, bias, group, trans_b, gather, tuning)
        ctx.save_for_backward(gathered if keep else a if ctx.needs_input_grad[1] else None, b)
        ctx.group, ctx.trans_b, ctx.backend = group, trans_b, tuning.backend
        ctx.recompute_gathered = recompute_gathered
        _keep_fused_weight(ctx, b, fused_wgrad)
        if not return_gathered:
            return product
        ctx.mark_non_differentiable(gathered)
        return product, gathered

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, *_gathered_grad):
        rows, b = ctx.saved_tensors
        needs_a, needs_b, needs_bias = ctx.needs_input_grad[:3]
        grad_a = grad_b = grad_bias = None
        if needs_a:  # grad @ bᵀ, its rows summed over the ranks and scattered back
            grad_a = matmul_reduce_scatter(grad, b, ctx.group, trans_b=not ctx.trans_b,
                                           backend=ctx.backend)
        if needs_b:
            gathered = _all_gather(rows, ctx.group) if ctx.recompute_gathered else rows
            grad_b = _b_grad(ctx, "all_gather_matmul", gathered, grad)
        if needs_bias:
            grad_bias = grad.sum(0)
        return grad_a, grad_b, grad_bias, None, None, None, None, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, group, trans_b, tuning, fused_wgrad):
        # Each operand only for the other's gradient.
        needs_a, needs_b = ctx.needs_input_grad[:2]
        ctx.save_for_backward(a if needs_b else None, b if needs_a else None)
        ctx.group, ctx.trans_b, ctx.backend = group, trans_b, tuning.backend
        _keep_fused_weight(ctx, b, fused_wgrad)
        return _matmul_reduce_scatter(a, b, bias, group, trans_b, tuning)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        needs_a, needs_b, needs_bias = ctx.needs_input_grad[:3]
        # One all-gather of the output's gradient serves all three: fused with a's gradient (its
        # product with bᵀ) where a needs one, a plain all-gather where only b or bias does.
        needs_rows = needs_b or needs_bias
        grad_a = gathered = None
        if needs_a:
            result = all_gather_matmul(grad, b, ctx.group, trans_b=not ctx.trans_b,
                                       return_gathered=needs_rows, backend=ctx.backend)
            grad_a, gathered = result if needs_rows else (result, None)
        elif needs_rows:
            gathered = _all_gather(grad, ctx.group)
        grad_b = _b_grad(ctx, "matmul_reduce_scatter", a, gathered) if needs_b else None
        grad_bias = gathered.sum(0) if needs_bias else None
        return grad_a, grad_b, grad_bias, None, None, None, None


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, group, trans_b, tuning, fused_wgrad):
        # Each operand only for the other's gradient.
        needs_a, needs_b = ctx.needs_input_grad[:2]
        ctx.save_for_backward(a if needs_b else None, b if needs_a else None)
        ctx.trans_b = trans_b
        _keep_fused_weight(ctx, b, fused_wgrad)
        return _matmul_all_reduce(a, b, bias, group, trans_b, tuning)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        needs_a, needs_b, needs_bias = ctx.needs_input_grad[:3]
        grad_a = (grad @ b if ctx.trans_b else grad @ b.t()) if needs_a else None
        grad_b = _b_grad(ctx, "matmul_all_reduce", a, grad) if needs_b else None
        grad_bias = grad.sum(0) if needs_bias else None
        return grad_a, grad_b, grad_bias, None, None, None, None


class _ColumnParallelMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, group, trans_b, tuning, fused_wgrad):
        needs_a, needs_b = ctx.needs_input_grad[:2]
        ctx.save_for_backward(a if needs_b else None, b if needs_a else None)
        ctx.group, ctx.trans_b, ctx.tuning = group, trans_b, tuning
        _keep_fused_weight(ctx, b, fused_wgrad)
        return _local_product(a, b, bias, trans_b)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        needs_a, needs_b, needs_bias = ctx.needs_input_grad[:3]
        grad_a = matmul_all_reduce(grad, b, ctx.group, trans_b=not ctx.trans_b,
                                   **ctx.tuning.options()) if needs_a else None
        grad_b = _b_grad(ctx, "column_parallel_matmul", a, grad) if needs_b else None
        grad_bias = grad.sum(0) if needs_bias else None
        return grad_a, grad_b, grad_bias, None, None, None, None


from meshla.torch.grouped import (  # noqa: E402
    GroupedLinear,
    check_device_errors,
    grouped_linear,
    packed_group_stride,
)
from meshla.torch import linalg  # noqa: E402
from meshla.torch.parallel_linear import ColumnParallelLinear, RowParallelLinear  # noqa: E402
