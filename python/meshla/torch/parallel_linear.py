"""Tensor-parallel linear layers over meshla's collective matmuls, as Megatron-LM and
TransformerEngine arrange them: a :class:`ColumnParallelLinear` splits the output features over
the ranks of a :class:`~meshla.torch.TPGroup`, a :class:`RowParallelLinear` the input features, so
that a column-parallel layer followed by a row-parallel one (an MLP, attention's projections)
communicates once each way.

Without sequence parallelism the activations are whole on every rank: the column-parallel layer
is a local GEMM whose input gradient is all-reduced in the backward
(:func:`~meshla.torch.column_parallel_matmul`), and the row-parallel layer all-reduces its product
(:func:`~meshla.torch.matmul_all_reduce`). With ``sequence_parallel=True`` the activations outside
the pair are split along their first dimension (the sequence, in Megatron-LM's ``[s, b, h]``
layout): the column-parallel layer all-gathers its input
(:func:`~meshla.torch.all_gather_matmul`) and the row-parallel layer reduce-scatters its product
(:func:`~meshla.torch.matmul_reduce_scatter`). Each collective is fused with its GEMM, except the
backward's re-gather of the column-parallel layer's input under ``recompute_gathered``, a plain
all-gather.
"""

from __future__ import annotations

import math

import torch

from meshla.torch import _collective_ops as ops
from meshla.torch._collective_autograd import fused_wgrad
from meshla.torch._float8 import RECIPES, Float8Linear
from meshla.torch._group import TPGroup
from meshla._tuning import Tuning
from meshla.torch.collective import (
    all_gather_matmul,
    column_parallel_matmul,
    matmul_all_reduce,
    matmul_reduce_scatter,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


def _mark_tensor_parallel(parameter: torch.nn.Parameter, dim: int):
    """Megatron-LM's marks of a parameter split over the tensor-parallel group along ``dim`` (as
    its set_tensor_model_parallel_attributes sets them): without them its gradient clipping,
    parameter norm and zero count take every rank's shard for a copy of rank 0's and count only
    that one."""
    parameter.tensor_model_parallel = True
    parameter.partition_dim = dim
    parameter.partition_stride = 1


class _ParallelLinear(torch.nn.Module):
    """What the two layers share: the whole layer's shape, this rank's shard of its weight
    (``[out_features, in_features]``, torch.nn.Linear's layout) split along ``_split_dim``, the
    initialisation and the loading of a whole layer's parameters."""

    _split_dim: int  # of the whole weight: 0 splits the output features, 1 the input features

    def __init__(self, in_features: int, out_features: int, group: TPGroup, bias: bool,
                 sequence_parallel: bool, fuse_wgrad_accumulation: bool, fp8, device, dtype,
                 tuning: dict):
        super().__init__()
        name = type(self).__name__
        if fp8 is not None and fp8 not in RECIPES:
            raise ValueError(f"{name}: fp8={fp8!r} is not one of None, 'tensorwise', 'rowwise'")
        if not isinstance(group, TPGroup):
            raise ValueError(f"{name}: group must be a meshla.torch.TPGroup, got "
                             f"{type(group).__name__}")
        if in_features < 1 or out_features < 1:
            raise ValueError(f"{name}: in_features={in_features} and out_features={out_features} "
                             "must be positive")
        split_name, split = (("out_features", out_features),
                             ("in_features", in_features))[self._split_dim]
        if split % group.size != 0:
            raise ValueError(f"{name}: {split_name}={split} is not divisible by "
                             f"tp_size={group.size}")
        self.in_features = in_features
        self.out_features = out_features
        self.group = group
        self.sequence_parallel = sequence_parallel
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.fp8 = fp8
        self.tuning = Tuning.of(**tuning)
        shape = [out_features, in_features]
        shape[self._split_dim] //= group.size
        device = _device_of(name, device, group)
        self.weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        _mark_tensor_parallel(self.weight, self._split_dim)
        if bias:  # a column-parallel layer's is split with its outputs, a row-parallel one's whole
            self.bias = torch.nn.Parameter(torch.empty(shape[0], device=device, dtype=dtype))
            if self._split_dim == 0:
                _mark_tensor_parallel(self.bias, 0)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self, generator: torch.Generator | None = None):
        """Draws the whole layer's parameters as ``torch.nn.Linear(in_features, out_features)``
        does (the same calls, in this layer's dtype, on its device), from ``generator`` or the
        device's default one, and keeps this rank's shard. Every rank must start from the same
        generator state (e.g. ``torch.manual_seed(seed)`` on each, as Megatron-LM assumes for its
        master weights): then the shards make the layer that torch.nn.Linear would have drawn,
        whatever the group's size. Draws the whole weight once, on the layer's device. Returns
        nothing."""
        weight = torch.empty(self.out_features, self.in_features, device=self.weight.device,
                             dtype=self.weight.dtype)
        torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
        bias = None
        if self.bias is not None:
            bound = 1.0 / math.sqrt(self.in_features)
            bias = torch.empty(self.out_features, device=weight.device, dtype=weight.dtype)
            torch.nn.init.uniform_(bias, -bound, bound, generator=generator)
        self._load_shard(weight, bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group: TPGroup, **options):
        """This rank's shard of ``linear`` (e.g. a pretrained layer, on any device), on the
        group's device in ``linear``'s dtype, with and without a bias as ``linear``;
        ``options`` as the constructor's other keywords. Returns the new layer. Raises
        ``ValueError`` where ``linear`` is not a torch.nn.Linear or ``options`` name ``device``,
        ``dtype`` or ``bias`` (they come from ``linear`` and the group), and the constructor's
        errors."""
        name = cls.__name__
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"{name}.from_linear: linear must be a torch.nn.Linear, got "
                             f"{type(linear).__name__}")
        for taken in ("device", "dtype", "bias"):
            if taken in options:
                raise ValueError(f"{name}.from_linear: {taken}= comes from linear (and device "
                                 "from the group); convert linear first")
        layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None,
                    device="meta", dtype=linear.weight.dtype, **options)
        layer.to_empty(device=group.device)
        layer._load_shard(linear.weight.detach(),
                          None if linear.bias is None else linear.bias.detach())
        return layer

    def _load_shard(self, weight, bias):
        """Copies this rank's shard of the whole layer's ``weight`` and ``bias``."""
        rank, size = self.group.rank, self.group.size
        with torch.no_grad():
            self.weight.copy_(weight.chunk(size, dim=self._split_dim)[rank])
            if bias is not None:
                self.bias.copy_(bias.chunk(size)[rank] if self._split_dim == 0 else bias)

    def _options(self) -> dict:
        """The keywords of this layer's collective matmuls besides the operands and the group."""
        return dict(self.tuning.options(), trans_b=True, bias=self.bias,
                    fuse_wgrad_accumulation=self.fuse_wgrad_accumulation)

    def _rows(self, x, features: int):
        """``x`` [..., features] as a [rows, features] matrix, checked."""
        least = 2 if self.sequence_parallel else 1
        if not isinstance(x, torch.Tensor) or x.dim() < least or x.shape[-1] != features:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            layout = "[s, ..., {}] (sequence first)" if self.sequence_parallel else "[..., {}]"
            raise ValueError(f"{type(self).__name__}: x must be a tensor {layout.format(features)}"
                             f", got {shape}")
        return x.reshape(-1, features)

    def _float8(self, rows, forward_op):
        """The layer's product in float8 (fp8=...): ``forward_op`` is its collective, None for a
        local GEMM."""
        name = type(self).__name__
        if rows.dtype != self.weight.dtype:
            raise ValueError(f"{name}(fp8={self.fp8!r}): x.dtype={rows.dtype} but the weight is "
                             f"{self.weight.dtype}; the fp8 GEMMs give the product in that dtype")
        fused = fused_wgrad(name, self.weight, self.weight, self.fuse_wgrad_accumulation)
        return Float8Linear.apply(rows, self.weight, self.bias, self.group, forward_op, self.fp8,
                                  self.tuning, name, fused, torch.is_grad_enabled())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp_size={self.group.size}, rank={self.group.rank}, "
                f"sequence_parallel={self.sequence_parallel}"
                + (", fuse_wgrad_accumulation=True" if self.fuse_wgrad_accumulation else "")
                + (f", fp8={self.fp8!r}" if self.fp8 else ""))


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ Wᵀ + b`` with the output features split over the group: this rank holds
    ``weight`` ``[out_features / tp, in_features]`` and ``bias`` ``[out_features / tp]``, and
    gives those output features.

    - ``sequence_parallel=False``: ``x`` ``[..., in_features]`` is the same on every rank; ``y``
      is ``[..., out_features / tp]``. The backward all-reduces ``x``'s gradient, fused with its
      GEMM.
    - ``sequence_parallel=True``: ``x`` ``[s / tp, ..., in_features]`` is this rank's block of the
      first dimension; ``y`` is ``[s, ..., out_features / tp]``, from the all-gathered ``x``. The
      backward reduce-scatters ``x``'s gradient. ``recompute_gathered`` keeps only this rank's
      block for the weight's gradient and gathers it again there (see
      :func:`~meshla.torch.all_gather_matmul`).

    ``backend``, ``algorithm``, ``chunks``, ``comm_sms`` and ``comm_ctas`` tune the collective
    matmuls of the forward and backward (:class:`~meshla.torch.Tuning`).
    ``fuse_wgrad_accumulation`` adds the weight's gradient to ``weight.main_grad`` (made by the
    caller, e.g. Megatron-LM's distributed optimizer) instead of giving a ``.grad``, as
    TransformerEngine's layers do (see :func:`~meshla.torch.column_parallel_matmul`; eager
    only).

    ``fp8="tensorwise"`` or ``"rowwise"`` trains the layer in float8 (torchao's dynamic Float8
    recipes): every step casts x and the weight to float8_e4m3fn and the output's gradient to
    float8_e5m2, with scales from their amax (one per operand, the gathered operand's the group's
    largest; or one per row of each GEMM's operands), and runs the forward and the input gradient
    as the scaled collective matmuls (:func:`~meshla.torch.all_gather_scaled_matmul` and its
    kin: fp8 rows travel, partial sums are added in the layer's dtype), the weight gradient as a
    local fp8 GEMM. x must be in the parameters' dtype (bfloat16; float16 tensorwise only;
    float32), the fp8 GEMMs' sizes multiples of 16 (features per rank, and the tokens, which
    the weight gradient contracts), rowwise row blocks multiples of 4. Not with
    ``recompute_gathered``.

    Parameters are created on the group's device (``device="meta"`` defers them) and drawn by
    :meth:`reset_parameters`; :meth:`from_linear` shards an existing layer instead. Every rank of
    the group must call the layer (and its backward) with the same shapes.

    ``in_features`` and ``out_features`` are the whole layer's, ``out_features`` divisible by the
    group's size; ``group`` is the :class:`~meshla.torch.TPGroup`; ``bias`` whether the layer
    has one; ``device`` and ``dtype`` those of the parameters (default: the group's device and
    torch's default dtype). The constructor raises ``ValueError`` for a ``group`` that is not a
    TPGroup, features below 1 or not divisible as above, ``recompute_gathered`` without
    ``sequence_parallel`` or with ``fp8``, an ``fp8`` other than None, "tensorwise" and
    "rowwise", a ``device`` other than the group's (or ``meta``), or a tuning that
    :class:`~meshla.torch.Tuning` refuses. Calling the layer returns ``y`` as above and raises
    ``ValueError`` for an ``x`` that is not a tensor [..., in_features] (with
    ``sequence_parallel``, at least 2-D), and otherwise the errors of the matmul it runs
    (:func:`~meshla.torch.all_gather_matmul` with ``sequence_parallel``,
    :func:`~meshla.torch.column_parallel_matmul` without).
    """

    _split_dim = 0

    def __init__(self, in_features: int, out_features: int, group: TPGroup, bias: bool = True, *,
                 sequence_parallel: bool = False, recompute_gathered: bool = False,
                 fuse_wgrad_accumulation: bool = False, fp8=None, device=None, dtype=None,
                 algorithm="auto", chunks: int = 0, comm_sms: int = -1, comm_ctas: int = 0,
                 backend="auto"):
        if recompute_gathered and not sequence_parallel:
            raise ValueError("ColumnParallelLinear: recompute_gathered=True needs "
                             "sequence_parallel=True (without it no rows are gathered)")
        if recompute_gathered and fp8 is not None:
            raise ValueError("ColumnParallelLinear: recompute_gathered=True applies to 16-bit "
                             "layers; an fp8 layer keeps its gathered fp8 rows (tensorwise) or "
                             "gathers its input again (rowwise) anyway")
        super().__init__(in_features, out_features, group, bias, sequence_parallel,
                         fuse_wgrad_accumulation, fp8, device, dtype,
                         dict(algorithm=algorithm, chunks=chunks, comm_sms=comm_sms,
                              comm_ctas=comm_ctas, backend=backend))
        self.recompute_gathered = recompute_gathered

    def forward(self, x):
        """``y`` for ``x`` as the class describes; raises as the class describes."""
        rows = self._rows(x, self.in_features)
        options = self._options()
        if self.sequence_parallel:
            if self.fp8:
                y = self._float8(rows, ops.OPS.all_gather_matmul)
            else:
                y = all_gather_matmul(rows, self.weight, self.group,
                                      recompute_gathered=self.recompute_gathered, **options)
            return y.view(x.shape[0] * self.group.size, *x.shape[1:-1], y.shape[1])
        if self.fp8:
            y = self._float8(rows, None)
        else:
            y = column_parallel_matmul(rows, self.weight, self.group, **options)
        return y.view(*x.shape[:-1], y.shape[1])


class RowParallelLinear(_ParallelLinear):
    """``y = x @ Wᵀ + b`` with the input features split over the group: this rank holds
    ``weight`` ``[out_features, in_features / tp]`` and takes ``x`` ``[..., in_features / tp]``
    (a column-parallel layer's output); ``bias`` ``[out_features]`` is whole on every rank and
    added once.

    - ``sequence_parallel=False``: ``y`` ``[..., out_features]``, the sum over the ranks, is the
      same on every rank (an all-reduce fused with the GEMM); its gradient is used as it is.
    - ``sequence_parallel=True``: ``y`` is this rank's block ``[s / tp, ..., out_features]`` of the
      first dimension of the sum (a reduce-scatter; ``s`` must be divisible by tp). The backward
      all-gathers ``y``'s gradient, so the weight's and the bias's gradients are complete: the
      bias's is the same on every rank and must not be all-reduced over the group again (as
      Megatron-LM does for the partial sums of its sequence-parallel biases).

    Tuning, ``fuse_wgrad_accumulation``, ``fp8``, parameters and :meth:`from_linear` as in
    :class:`ColumnParallelLinear`; so are the constructor's arguments and errors, except that
    ``in_features`` must be divisible by the group's size and there is no
    ``recompute_gathered``. Calling the layer returns ``y`` as above and raises ``ValueError``
    for an ``x`` that is not a tensor [..., in_features / tp] (with ``sequence_parallel``, at
    least 2-D, its first dimension divisible by tp), and otherwise the errors of the collective
    matmul it runs (:func:`~meshla.torch.matmul_reduce_scatter` with ``sequence_parallel``,
    :func:`~meshla.torch.matmul_all_reduce` without).
    """

    _split_dim = 1

    def __init__(self, in_features: int, out_features: int, group: TPGroup, bias: bool = True, *,
                 sequence_parallel: bool = False, fuse_wgrad_accumulation: bool = False,
                 fp8=None, device=None, dtype=None, algorithm="auto", chunks: int = 0,
                 comm_sms: int = -1, comm_ctas: int = 0, backend="auto"):
        super().__init__(in_features, out_features, group, bias, sequence_parallel,
                         fuse_wgrad_accumulation, fp8, device, dtype,
                         dict(algorithm=algorithm, chunks=chunks, comm_sms=comm_sms,
                              comm_ctas=comm_ctas, backend=backend))

    def forward(self, x):
        """``y`` for ``x`` as the class describes; raises as the class describes."""
        tp = self.group.size
        rows = self._rows(x, self.in_features // tp)
        options = self._options()
        if self.sequence_parallel:
            if x.shape[0] % tp != 0:
                raise ValueError(f"RowParallelLinear: sequence_parallel scatters x's first "
                                 f"dimension, but x.shape={list(x.shape)} has {x.shape[0]} there, "
                                 f"not divisible by tp_size={tp}")
            if self.fp8:
                y = self._float8(rows, ops.OPS.matmul_reduce_scatter)
            else:
                y = matmul_reduce_scatter(rows, self.weight, self.group, **options)
            return y.view(x.shape[0] // tp, *x.shape[1:-1], self.out_features)
        if self.fp8:
            y = self._float8(rows, ops.OPS.matmul_all_reduce)
        else:
            y = matmul_all_reduce(rows, self.weight, self.group, **options)
        return y.view(*x.shape[:-1], self.out_features)


def _device_of(name: str, device, group: TPGroup) -> torch.device:
    """The device a layer's parameters are made on: the group's, or ``meta`` to defer them."""
    if device is None:
        return group.device
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "meta" and device != group.device:
        raise ValueError(f"{name}: device={device} but the group's communicator uses "
                         f"{group.device}")
    return device
