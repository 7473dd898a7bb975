"""Tensor-parallel groups (:class:`TPGroup`) and the ways to make one."""

from __future__ import annotations

import atexit
import itertools
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import meshla
from meshla import _meshla
from meshla.torch._dtypes import DTYPES

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


def group_of(key: int) -> TPGroup:
    group = _GROUPS.get(key)
    if group is None:
        raise ValueError(f"TPGroup {key} no longer exists: keep the group alive while ops (or "
                         "graphs compiled with them) that use it run")
    return group


_MAX_CALLS = 1024
_UNSEEN = object()


@dataclass(eq=False)
class TPGroup:
    """A tensor-parallel group.

    ``rank`` and ``size`` are this rank's place in the group and the group's size (tp);
    ``comm`` is the NCCL communicator for CUDA tensors (None where the group has no GPU);
    ``process_group`` the torch.distributed group used by the CPU reference path (None for groups
    made by :func:`local_groups` or :func:`group_from_mpi`); ``device`` the communicator's GPU,
    or the CPU; ``key`` names the group in the torch.ops.meshla ops.

    Make one with :func:`group_from_process_group`, :func:`group_from_mpi` or
    :func:`local_groups`; the constructor takes ``rank``, ``size``, ``comm`` and
    ``process_group`` and checks nothing. A copy (``copy.copy``, ``copy.deepcopy``) is the group
    itself; pickling raises ``TypeError``, since its communicators belong to this process. Keep
    the group alive while ops, or graphs compiled with them, use it: a torch.ops.meshla op whose
    group was let go of raises ``ValueError``.
    """

    rank: int
    size: int
    comm: _meshla.Communicator | None = None
    process_group: Any = None
    device: torch.device = field(init=False)
    key: int = field(init=False)
    # The group's plans by config (meshla's core cache, CollectivePlans); None for a group of CPU
    # tensors. The nccl and symmetric plans of a group keep their buffers and cuBLASLt workspace in
    # one workspace sized by the largest shape, so a plan per shape costs its GEMMs' tuning, not
    # device memory.
    _plans: _meshla.CollectivePlans | None = field(init=False, repr=False)
    # Calls seen on CUDA tensors, by their operands' metadata (see remembered_call).
    _calls: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self):
        # Plain attributes, which torch.compile reads as constants.
        self.device = (torch.device("cpu") if self.comm is None
                       else torch.device("cuda", self.comm.device))
        self._plans = None if self.comm is None else _meshla.CollectivePlans(self.comm)
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

    def plan(self, config: _meshla.CollectiveMatmulConfig) -> _meshla.CollectiveMatmul:
        """The group's plan for ``config`` (describe_call's), built on first use; valid until the
        group's plans are cleared.

        Building a plan is collective: every rank asks for the same configs in the same order.
        Ranks that ask for different ones raise ``ValueError`` naming the fields that differ, a
        backend that cannot run on every rank ``NotImplementedError``, and a rank that never asks
        leaves the others a ``TimeoutError`` after the group's ``timeout_s``. A group without a
        CUDA communicator raises ``ValueError``."""
        if self._plans is None:
            raise ValueError(f"{config.op.name}: this TPGroup has no CUDA communicator (it was "
                             "built for CPU tensors)")
        return self._plans.matmul(config)

    def remembered_call(self, key, described):
        """What ``described()`` gave for the call that ``key`` names (its op, options and every
        operand's metadata), computed on the first such call. A model's calls repeat a few shapes,
        and describing one costs about 20 us of host time; a shape per call (no two alike) is
        forgotten in batches of _MAX_CALLS. What is remembered may hold the group's plans: it is
        forgotten with them (clear_plans)."""
        hit = self._calls.get(key, _UNSEEN)
        if hit is _UNSEEN:
            hit = described()
            if len(self._calls) >= _MAX_CALLS:
                self._calls.clear()
            self._calls[key] = hit
        return hit

    def clear_plans(self) -> None:
        """Lets go of the group's plans (each waits for its last execution) and of the calls
        remembered with them; the next call of each shape builds its plan again, collectively."""
        self._calls.clear()
        if self._plans is not None:
            self._plans.clear()

    def all_gather_plan(self, dtype: torch.dtype, rows: int, cols: int) -> _meshla.AllGather:
        """The group's all-gather of [rows, cols] per rank (for a backward that gathers rows
        again), in the order of its collective matmuls; ``dtype`` is a torch dtype. Only for a
        group with a CUDA communicator. ``rows`` or ``cols`` below 1, or a dtype other than
        bfloat16, float16 or float32, raise ``ValueError``."""
        return self._plans.all_gather(DTYPES[dtype], rows, cols)


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
    the current one); pass ``"cpu"``, or run without GPUs, for a CPU-only group. ``timeout_s`` is
    how long the group's GPUs wait for each other: making the communicator, building a plan, and
    meshla's watchdog, which ends the process when an eager run has not finished that long after
    it was enqueued (a peer that died or never made its matching call).

    Returns the :class:`TPGroup`, with ``rank`` and ``size`` those of ``group``; a CPU-only group
    has no communicator (and ``timeout_s`` is unused). Raises ``ValueError`` when
    torch.distributed is not initialized, for a ``device`` that is neither a CUDA device nor the
    CPU or a CUDA ordinal out of range, and for a ``timeout_s`` that is not positive or exceeds
    30 days; ``TimeoutError`` when the group's ranks do not all make the communicator within
    ``timeout_s``; ``RuntimeError`` for an NCCL or CUDA failure, naming the call.
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
    """The TPGroup of an mpi4py communicator; the unique id travels by ``mpi_comm.bcast``.

    Collective over ``mpi_comm``, whose rank and size the group takes. ``device`` is this rank's
    GPU (default: the current one); ``timeout_s`` as in :func:`group_from_process_group`.
    Returns a :class:`TPGroup` without a torch.distributed process group, so it runs CUDA
    tensors only. Raises ``ValueError`` where there is no CUDA device (``device="cpu"``, or no
    GPU visible), and otherwise the errors of :func:`group_from_process_group`'s communicator
    (``ValueError``, ``TimeoutError``, ``RuntimeError``).
    """
    rank = mpi_comm.Get_rank()
    size = mpi_comm.Get_size()
    cuda_device = _cuda_device(device)
    if cuda_device is None:
        raise ValueError("group_from_mpi: needs a CUDA device; use a gloo process group on CPU")
    unique = mpi_comm.bcast(_meshla.unique_id() if rank == 0 else None, root=0)
    comm = _meshla.Communicator(unique, rank, size, cuda_device, timeout_s=timeout_s)
    return TPGroup(rank=rank, size=size, comm=comm)


def local_groups(devices, timeout_s: float = 300.0) -> list[TPGroup]:
    """One TPGroup per device for a group driven by this process, each used from its own thread.

    ``devices`` are CUDA ordinals (or CUDA devices), in rank order; ``timeout_s`` as in
    :func:`group_from_process_group`. Returns the list of groups, rank ``i`` on ``devices[i]``.
    They have no torch.distributed process group, so they run CUDA tensors only, and each rank's
    ops must be called from a thread of its own (a collective waits for every rank's matching
    call). Raises ``ValueError`` for an empty list, a device listed twice, a CUDA ordinal out of
    range or a bad ``timeout_s``, ``RuntimeError`` for an NCCL or CUDA failure.
    """
    devices = [_cuda_device(d) if not isinstance(d, int) else d for d in devices]
    comms = _meshla.Communicator.create_local(devices, timeout_s=timeout_s)
    return [TPGroup(rank=c.rank, size=c.size, comm=c) for c in comms]
