"""How a collective matmul communicates and overlaps (:class:`Tuning`), parsed from the
arguments of the public functions of both front ends (meshla.torch and meshla.jax)."""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, fields

from meshla import _meshla

@dataclass(frozen=True)
class Tuning:
    """How a collective matmul communicates and overlaps: ``backend`` ("auto": "symmetric" where
    every pair of GPUs is linked by NVLink and the shape allows it, else "nccl"; "nccl";
    "symmetric": copy engines into peer-mapped buffers, one host with CUDA peer access,
    "cublasmp": cuBLASMp's own overlap, see :func:`meshla.backend_unavailable_reason`),
    ``algorithm`` ("auto", "sequential", "pipelined", "ring"), ``chunks`` (pipeline depth, 0: the
    default), ``comm_sms`` (SMs the overlapped GEMMs leave to NCCL, -1: default) and ``comm_ctas``
    (thread blocks NCCL may use for the transfers, 0: NCCL's choice).

    The constructor takes the enum members and checks nothing; :meth:`of` makes one from the
    public functions' keywords and checks the names and integers. Ranges are the extension's and
    are checked by the call that uses the Tuning: a negative ``chunks``, a ``comm_sms`` below -1 or
    a negative ``comm_ctas`` raises ``ValueError`` there, a combination a backend does not run
    (``backend="cublasmp"`` with ``algorithm="pipelined"``, say) ``NotImplementedError``."""

    algorithm: _meshla.Algorithm = _meshla.Algorithm.auto
    chunks: int = 0
    comm_sms: int = -1
    comm_ctas: int = 0
    backend: _meshla.Backend = _meshla.Backend.auto

    @staticmethod
    def of(algorithm="auto", chunks: int = 0, comm_sms: int = -1, comm_ctas: int = 0,
           backend="auto", *, cached: bool = True) -> Tuning:
        """The Tuning of a call's keywords: ``algorithm`` and ``backend`` by name ("ring") or as
        ``meshla.Algorithm`` / ``meshla.Backend`` members, the numbers as integers (numpy
        integers too). ``cached=False`` makes a new one instead of taking it from the cache of
        earlier calls. Raises ``ValueError`` naming the argument for a name that is not one of
        the choices or a number that is not an integer."""
        # Uncached where the caller says so (torch.compile warns at every lru_cache call it
        # traces; the Tuning becomes a constant of the graph anyway), and for an unhashable
        # argument, which the uncached path then names.
        if cached:
            try:
                return _tuning_of(algorithm, chunks, comm_sms, comm_ctas, backend)
            except TypeError:
                pass
        return _tuning_of.__wrapped__(algorithm, chunks, comm_sms, comm_ctas, backend)

    def options(self) -> dict:
        """The op keywords that give this Tuning, e.g. ``matmul_all_reduce(..., **t.options())``:
        a dict of its five fields by name, holding the enum members."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def ints(self) -> list[int]:
        """This Tuning as a torch.ops.meshla op's ``int[] tuning`` (see :meth:`of_ints`): the list
        ``[algorithm, chunks, comm_sms, comm_ctas, backend]``, the choices as their enum values."""
        return [self.algorithm.value, self.chunks, self.comm_sms, self.comm_ctas,
                self.backend.value]

    @staticmethod
    def of_ints(values) -> Tuning:
        """The Tuning of a torch.ops.meshla op's ``int[] tuning``, the five integers that
        :meth:`ints` gives. Raises ``ValueError`` for a sequence of another length, or for an
        algorithm or backend value that names no choice."""
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
