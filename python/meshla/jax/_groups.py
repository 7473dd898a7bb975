"""The tensor-parallel groups of meshla.jax's collective matmuls.

A mesh axis gives one group per position on the mesh's other axes (a data × tensor mesh: one
tensor-parallel group per data index). The first call traced on a (mesh, axis) makes every group
that holds a GPU of this process and registers each GPU's communicator with the extension under
one number, the attribute that tells the XLA handlers which group they are in. A group driven by
this process alone gets its communicators from one call (Communicator.create_local); a group with
one GPU in each of several processes gets its NCCL id through jax.distributed's key-value store.

Making a group is collective: every process of the mesh must trace the call (as SPMD programs
do). A trace on some processes only (``jax.make_jaxpr`` or ``.lower()`` on process 0, say) waits
for the others until ``timeout_s`` and fails.
"""

from __future__ import annotations

import hashlib
import itertools
import threading

import jax
import numpy as np
from jax.sharding import Mesh

from meshla import _meshla

_lock = threading.Lock()
_numbers: dict[tuple, int] = {}
_attempts: dict[tuple, int] = {}  # per (mesh, axis): each attempt shares its NCCL ids anew
_next_number = itertools.count()


def axis_groups(mesh: Mesh, axis: str) -> np.ndarray:
    """The devices of every group along ``axis``: [groups, mesh.shape[axis]], each row in the
    order of the axis (a group's ranks)."""
    names = list(mesh.axis_names)
    order = [names.index(name) for name in names if name != axis] + [names.index(axis)]
    return np.transpose(mesh.devices, order).reshape(-1, mesh.shape[axis])


def group_number(mesh: Mesh, axis: str, timeout_s: float, kind: str = "group") -> int:
    """The number under which the groups of ``axis`` of ``mesh`` are registered, making them on
    first use (every process of the mesh traces the same calls, so each makes its part).
    ``kind`` "group": the collective matmuls' communicators (register_jax_group); "solver": a
    cuSOLVERMp solver per GPU of groups with one GPU in each process (register_jax_process_solver,
    on a communicator of its own)."""
    # A solver group's communicator carries its timeout (the watchdog's, inside every solve):
    # another timeout_s makes another group.
    key = (mesh.devices.shape, tuple(int(d.id) for d in mesh.devices.flat),
           tuple(mesh.axis_names), axis, kind, *((timeout_s,) if kind == "solver" else ()))
    with _lock:
        number = _numbers.get(key)
        if number is None:
            # Neither a number nor a key-value key is reused, so what a failed attempt left (a
            # group half registered, an NCCL id stored) cannot clash with the next attempt's.
            attempt = _attempts.get(key, 0)
            _attempts[key] = attempt + 1
            number = next(_next_number)
            for devices in axis_groups(mesh, axis):
                _make_group(number, devices, f"{key!r}, attempt {attempt}", timeout_s, kind)
            _numbers[key] = number
    return number


def _make_group(number: int, devices: np.ndarray, mesh_key: str, timeout_s: float,
                kind: str) -> None:
    here = jax.process_index()
    local = [d for d in devices if d.process_index == here]
    if not local:
        return
    if kind == "solver":  # one GPU in each process (the callers check it from the mesh)
        rank = list(devices).index(local[0])
        unique_id = (_meshla.unique_id() if len(devices) == 1 else _shared_unique_id(
            f"{mesh_key}/{[int(d.id) for d in devices]}", rank, timeout_s))
        _meshla.register_jax_process_solver(number, _meshla.Communicator(
            unique_id, rank, len(devices), local[0].local_hardware_id, timeout_s))
        return
    if len(local) == len(devices):
        comms = _meshla.Communicator.create_local([d.local_hardware_id for d in devices],
                                                  timeout_s)
    elif len(local) == 1:
        rank = list(devices).index(local[0])
        unique_id = _shared_unique_id(f"{mesh_key}/{[int(d.id) for d in devices]}", rank,
                                      timeout_s)
        comms = [_meshla.Communicator(unique_id, rank, len(devices), local[0].local_hardware_id,
                                      timeout_s)]
    else:
        raise NotImplementedError(
            f"meshla.jax: the group of devices {[int(d.id) for d in devices]} spans processes "
            f"with {len(local)} of its GPUs in this one; a group is driven by one process, or by "
            "one process per GPU")
    for comm in comms:
        _meshla.register_jax_group(number, comm)


_answers: dict[str, bool] = {}
_answers_lock = threading.Lock()  # not _lock: the waits below would hold up group_number


def agreed_everywhere(question: str, answer: bool, processes: list[int], timeout_s: float) -> bool:
    """Whether every one of ``processes`` answers ``question`` yes: this process's answer goes to
    jax.distributed's key-value store, the others' are read there (waiting up to ``timeout_s``
    for each; a process that answers no waits for none). Asked once per question in a
    process's life, the agreed answer kept; collective like making a group (every process of
    the mesh traces the same calls)."""
    with _answers_lock:
        if question not in _answers:
            client = _client()
            key = "meshla/jax/answer/" + hashlib.sha256(question.encode()).hexdigest()
            # Overwritable: an earlier attempt that timed out waiting for a peer set it already.
            client.key_value_set(f"{key}/{jax.process_index()}", "1" if answer else "0",
                                 allow_overwrite=True)
            _answers[question] = answer and all(
                client.blocking_key_value_get(f"{key}/{process}", int(timeout_s * 1000)) == "1"
                for process in processes)
        return _answers[question]


def _client():
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise ValueError(
            "meshla.jax: a group of devices spans processes, but jax.distributed is not "
            "initialized; call jax.distributed.initialize() first")
    return client


def _shared_unique_id(group_key: str, rank: int, timeout_s: float) -> bytes:
    """The group's NCCL id: made by its rank 0, passed to the others by jax.distributed."""
    client = _client()
    key = "meshla/jax/group/" + hashlib.sha256(group_key.encode()).hexdigest()
    if rank == 0:
        unique_id = _meshla.unique_id()
        client.key_value_set(key, unique_id.hex())
        return unique_id
    return bytes.fromhex(client.blocking_key_value_get(key, int(timeout_s * 1000)))
