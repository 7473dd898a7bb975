"""Collective matmul for tensor parallelism: the public functions. On CUDA tensors they run
meshla's plans on the current CUDA stream, so they can be captured in a CUDA graph once each shape
has run eagerly; on CPU tensors a reference (torch.distributed collective + matmul) over the
group's process group, so the same code runs on a machine without GPUs. Every shape, dtype and
tuning rule is the extension's (describe_call), on both."""

from __future__ import annotations

import torch

from meshla import _meshla
from meshla.torch import _collective_autograd as autograd
from meshla.torch import _collective_ops as ops
from meshla.torch._dtypes import DTYPES
from meshla.torch._group import TPGroup
from meshla._tuning import Tuning

__all__ = ["all_gather_matmul", "all_gather_scaled_matmul", "column_parallel_matmul",
           "matmul_all_reduce", "matmul_reduce_scatter", "scaled_matmul_all_reduce",
           "scaled_matmul_reduce_scatter"]


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


def _prepare(op: str, a, b, bias, group: TPGroup, algorithm, chunks, comm_sms, comm_ctas,
             backend, *outputs):
    """A call's operands as it runs them (see _autocast) and its Tuning. The rules of shapes,
    dtypes and tuning are the extension's, applied where the call runs (describe_call); here only
    what is the framework's: the group's type, tensors where tensors go."""
    if not isinstance(group, TPGroup):
        raise ValueError(f"{op}: group must be a meshla.torch.TPGroup, got {type(group).__name__}")
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    a, b, bias = _autocast(a, b, bias, *outputs)
    return a, b, bias, Tuning.of(algorithm, chunks, comm_sms, comm_ctas, backend,
                                  cached=not torch.compiler.is_compiling())


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

    ``b`` is [k, n], or [n, k] with ``trans_b`` (a torch.nn.Linear weight); ``bias`` is [n];
    ``group`` is the :class:`TPGroup` of the ranks (tp of them) that share the call. Returns the
    [m, n] product in ``a``'s dtype, and with ``return_gathered`` the tuple (product, gathered
    [m, k] ``a``). ``out`` and ``gathered_out`` are optional preallocated outputs of those shapes,
    contiguous, in ``a``'s dtype and on its device, sharing no memory with the inputs.

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

    Errors, the same for every collective matmul: ``ValueError``, naming the argument and the
    shapes, for a ``group`` that is not a :class:`TPGroup`, an ``a`` or ``b`` that is not a
    tensor, shapes, dtypes (bfloat16, float16 or float32, the same for all), devices or outputs
    that do not fit the call, bad tuning, CPU tensors on a group without a process group, or CUDA
    tensors on a group without a communicator. ``NotImplementedError`` for what this build or
    machine cannot run (a backend for which :func:`meshla.backend_unavailable_reason` gives a
    reason, ``backend="symmetric"`` without peer access, a combination the backend does not
    take), and under autograd (grad mode on, an input requiring grad) for outputs given or
    ``backend="cublasmp"``. CUDA, NCCL and cuBLAS failures raise ``RuntimeError`` naming the call.
    On CUDA tensors the first call of a shape builds its plan with every rank: ranks that pass
    different shapes raise ``ValueError`` naming both, and a rank that never calls leaves the
    others a ``TimeoutError`` after the group's ``timeout_s``. A later eager run that a peer never
    joins ends the process ``timeout_s`` after it was enqueued (meshla's watchdog, naming the op).
    """
    op = _meshla.CollectiveOp.all_gather_matmul
    weight = b
    a, b, bias, tuning = _prepare(op.name, a, b, bias, group, algorithm, chunks,
                                  comm_sms, comm_ctas, backend, out, gathered_out)
    if _wants_grad(op.name, (a, b, bias), tuning, out=out, gathered_out=gathered_out):
        return autograd.AllGatherMatmul.apply(a, b, bias, group, trans_b, tuning, return_gathered,
                                      recompute_gathered,
                                      autograd.fused_wgrad(op.name, weight, b,
                                                           fuse_wgrad_accumulation))
    product, gathered = ops.all_gather_matmul(a, b, bias, group, trans_b, return_gathered,
                                              tuning, out, gathered_out)
    return (product, gathered) if return_gathered else product


def matmul_reduce_scatter(a, b, group: TPGroup, *, bias=None, trans_b: bool = False, out=None,
                          algorithm="auto", chunks: int = 0, comm_sms: int = -1,
                          comm_ctas: int = 0, backend="auto",
                          fuse_wgrad_accumulation: bool = False):
    """This rank's [m/tp, n] row block of ``sum over ranks(a @ b) (+ bias)``.

    ``a`` is [m, k_local] and ``b`` [k_local, n] (or [n, k_local] with ``trans_b``): the slices of
    a row-parallel linear layer; m must be divisible by the group's size. ``bias`` [n] is added
    once, not once per rank. Returns the [m/tp, n] block in ``a``'s dtype; ``out``, the group and
    the tuning as in :func:`all_gather_matmul`.

    Differentiable in ``a``, ``b`` and ``bias`` (a row-parallel layer with sequence parallelism):
    the output's gradient is all-gathered (fused with ``a``'s gradient in an
    :func:`all_gather_matmul` where ``a`` needs one, a plain all-gather otherwise), so ``b``'s
    gradient is complete, and so is ``bias``'s: summed over
    every rank's rows, on every rank (do not all-reduce it again, unlike Megatron-LM's
    sequence-parallel bias, whose partial sums it all-reduces later). Every rank of the group must
    run the backward, as it runs the forward, with the same inputs requiring grad.
    ``fuse_wgrad_accumulation`` as in :func:`column_parallel_matmul`.

    Raises as :func:`all_gather_matmul` does (``ValueError``, ``NotImplementedError``,
    ``RuntimeError``, ``TimeoutError`` while a plan is built, the watchdog after); an m that the
    group's size does not divide is a ``ValueError``.
    """
    op = _meshla.CollectiveOp.matmul_reduce_scatter
    weight = b
    a, b, bias, tuning = _prepare(op.name, a, b, bias, group, algorithm, chunks,
                                  comm_sms, comm_ctas, backend, out)
    if _wants_grad(op.name, (a, b, bias), tuning, out=out):
        return autograd.MatmulReduceScatter.apply(
            a, b, bias, group, trans_b, tuning,
            autograd.fused_wgrad(op.name, weight, b, fuse_wgrad_accumulation))
    return ops.matmul_reduce_scatter(a, b, bias, group, trans_b, tuning, out)


def matmul_all_reduce(a, b, group: TPGroup, *, bias=None, trans_b: bool = False, out=None,
                      algorithm="auto", chunks: int = 0, comm_sms: int = -1, comm_ctas: int = 0,
                      backend="auto", fuse_wgrad_accumulation: bool = False):
    """``sum over ranks(a @ b) (+ bias)``, the whole [m, n] result on every rank.

    ``a`` is [m, k_local] and ``b`` [k_local, n] (or [n, k_local] with ``trans_b``), this rank's
    slices of the contraction; ``bias`` [n] is added once. Returns the [m, n] sum in ``a``'s
    dtype; ``out``, the group and the tuning as in :func:`all_gather_matmul`.

    Differentiable in ``a``, ``b`` and ``bias`` (a row-parallel layer without sequence
    parallelism): the result is the same on every rank, so each rank's loss is taken as the same
    function of it and its gradient is used as it is, with no communication (as Megatron-LM's
    row-parallel layer does). ``fuse_wgrad_accumulation`` as in :func:`column_parallel_matmul`.

    Raises as :func:`all_gather_matmul` does (``ValueError``, ``NotImplementedError``,
    ``RuntimeError``, ``TimeoutError`` while a plan is built, the watchdog after).
    """
    op = _meshla.CollectiveOp.matmul_all_reduce
    weight = b
    a, b, bias, tuning = _prepare(op.name, a, b, bias, group, algorithm, chunks,
                                  comm_sms, comm_ctas, backend, out)
    if _wants_grad(op.name, (a, b, bias), tuning, out=out):
        return autograd.MatmulAllReduce.apply(a, b, bias, group, trans_b, tuning,
                                      autograd.fused_wgrad(op.name, weight, b,
                                                           fuse_wgrad_accumulation))
    return ops.matmul_all_reduce(a, b, bias, group, trans_b, tuning, out)


def column_parallel_matmul(a, b, group: TPGroup, *, bias=None, trans_b: bool = False,
                           algorithm="auto", chunks: int = 0, comm_sms: int = -1,
                           comm_ctas: int = 0, backend="auto",
                           fuse_wgrad_accumulation: bool = False):
    """``a @ b (+ bias)`` for a column-parallel layer without sequence parallelism: ``a`` [m, k]
    is the same on every rank, ``b`` this rank's [k, n] column slice ([n, k] with ``trans_b``).

    ``bias`` is [n]. Returns the [m, n] product (this rank's output columns). The forward is a
    local GEMM. Differentiable in ``a``, ``b`` and ``bias``: ``a``'s gradient is
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

    Errors: ``ValueError`` for a ``group`` that is not a :class:`TPGroup`, an ``a`` or ``b`` that
    is not a tensor, an ``algorithm`` or ``backend`` that is not one of the choices, or a tuning
    number that is not an integer; for operands that do not fit, as :func:`matmul_all_reduce`
    words it (shapes, dtypes, devices); and, where ``a`` requires grad, for a tuning that the
    backward's all-reduce refuses, at the call (eager; under torch.compile, torch's GEMM raises
    its own error while tracing, and the backward's all-reduce checks its tuning when it runs).
    ``NotImplementedError`` for ``backend="cublasmp"`` under autograd. With
    ``fuse_wgrad_accumulation``: ``ValueError`` where torch.autocast would cast ``b``, or where
    the backward finds no ``main_grad`` of a dtype, shape and device as above;
    ``NotImplementedError`` under torch.compile.
    """
    name = "column_parallel_matmul"
    weight = b
    a, b, bias, tuning = _prepare(name, a, b, bias, group, algorithm, chunks,
                                  comm_sms, comm_ctas, backend)
    wants_grad = _wants_grad(name, (a, b, bias), tuning)
    if not torch.compiler.is_compiling():  # traced, the local GEMM's fake raises torch's words
        grad_of_a = wants_grad and a.requires_grad
        key = (name, trans_b, tuning, grad_of_a, ops.metadata(a), ops.metadata(b),
               ops.metadata(bias))
        group.remembered_call(key, lambda: _check_column_parallel(
            name, a, b, bias, group, trans_b, tuning, grad_of_a))
    if wants_grad:
        return autograd.ColumnParallelMatmul.apply(a, b, bias, group, trans_b, tuning,
                                           autograd.fused_wgrad(name, weight, b,
                                                                fuse_wgrad_accumulation))
    return autograd.local_product(a, b, bias, trans_b)


def _check_column_parallel(name, a, b, bias, group, trans_b, tuning, grad_of_a):
    """The forward is a local GEMM, whose operands follow a matmul_all_reduce's rules; a's
    gradient is a matmul_all_reduce of the output's gradient and b, checked now with the call's
    tuning. The extension's rules and words, under the caller's name."""
    ops.describe(ops.OPS.matmul_all_reduce, a, b, bias, group, trans_b, Tuning.of(), caller=name)
    if grad_of_a:
        n = b.shape[0] if trans_b else b.shape[1]
        ops.describe(ops.OPS.matmul_all_reduce, a.new_empty((a.shape[0], n), device="meta"), b,
                     None, group, not trans_b, tuning, caller=name)


def _scaled(op, a, b, a_scale, b_scale, group, bias, out_dtype, return_gathered, algorithm,
            chunks, comm_sms, comm_ctas, backend):
    """The three float8 ops' common path (torch.ops.meshla.scaled_collective_matmul, with a fake
    for torch.compile): no autocast (fp8 operands are cast by their owner), no backward yet."""
    if not isinstance(group, TPGroup):
        raise ValueError(f"{op.name}: group must be a meshla.torch.TPGroup, got "
                         f"{type(group).__name__}")
    for name, t in (("a", a), ("b", b), ("a_scale", a_scale), ("b_scale", b_scale)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{op.name}: {name} must be a tensor, got {type(t).__name__}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (a, b, a_scale, b_scale, bias)):
        raise NotImplementedError(f"{op.name}: the float8 ops have no backward yet; call them "
                                  "under torch.no_grad(), or train through ColumnParallelLinear "
                                  "and RowParallelLinear with fp8=")
    if out_dtype not in DTYPES:  # the extension says which of its dtypes a product takes
        raise ValueError(f"{op.name}: out_dtype={out_dtype} is not a torch dtype meshla takes "
                         "(a float8 product is bfloat16, float16 or float32)")
    tuning = Tuning.of(algorithm, chunks, comm_sms, comm_ctas, backend,
                       cached=not torch.compiler.is_compiling())
    return ops.scaled(op, a, b, a_scale, b_scale, bias, group, out_dtype, return_gathered,
                      tuning)


def all_gather_scaled_matmul(a, b, a_scale, b_scale, group: TPGroup, *, bias=None,
                             out_dtype=torch.bfloat16, return_gathered: bool = False,
                             algorithm="auto", chunks: int = 0, comm_sms: int = -1,
                             comm_ctas: int = 0, backend="auto"):
    """``all_gather(a) @ b.T`` in float8 with its scales: :func:`all_gather_matmul`'s op on
    ``torch._scaled_mm``'s operands.

    ``a`` is this rank's [m/tp, k] rows and ``b`` [n, k] (a linear layer's weight, the one order
    fp8 GEMMs take), ``float8_e4m3fn`` or ``float8_e5m2`` (not both e5m2). ``a_scale`` and
    ``b_scale`` are float32 on the same device: one value each (tensorwise; ``a_scale`` is then
    the scale of the whole gathered ``a``, the same on every rank, as torch's fused op takes
    it), or one per row of ``a`` ([m/tp] or [m/tp, 1]) and one per output column ([n] or
    [1, n]) (rowwise, gathered with the rows):
    ``out[i, j] = a_scale[i] * b_scale[j] * sum_k a[i, k] * b[j, k] (+ bias[j])``. The fp8 rows
    (and, rowwise, their scales) are what travels. Returns the [m, n] product in ``out_dtype``
    (bfloat16, float16 or float32; rowwise bfloat16 or float32), ``bias`` [n] in that dtype, and
    with ``return_gathered`` also the gathered [m, k] fp8 ``a`` (tensorwise only).

    Runs on backends ``symmetric`` (``auto``'s choice over NVLink) and ``nccl``; the algorithms
    and tuning as in :func:`all_gather_matmul`. No backward yet (NotImplementedError when an
    input requires grad under grad mode). Errors as :func:`all_gather_matmul`'s, and
    ``ValueError`` for a missing or misshapen scale, ``NotImplementedError`` for e5m2 x e5m2 and
    what fp8 GEMMs cannot take. On CPU tensors a float32 reference on the dequantized operands.
    """
    product, gathered = _scaled(_meshla.CollectiveOp.all_gather_matmul, a, b, a_scale, b_scale,
                                group, bias, out_dtype, return_gathered, algorithm, chunks,
                                comm_sms, comm_ctas, backend)
    return (product, gathered) if return_gathered else product


def scaled_matmul_reduce_scatter(a, b, a_scale, b_scale, group: TPGroup, *, bias=None,
                                 out_dtype=torch.bfloat16, algorithm="auto", chunks: int = 0,
                                 comm_sms: int = -1, comm_ctas: int = 0, backend="auto"):
    """This rank's [m/tp, n] rows of ``sum over ranks(a @ b.T)`` in float8 with its scales:
    :func:`matmul_reduce_scatter` on ``torch._scaled_mm``'s operands. ``a`` is [m, k_local],
    ``b`` [n, k_local]; scales as in :func:`all_gather_scaled_matmul` (rowwise: one per row of
    ``a``, [m]). The partial products are summed in ``out_dtype``, never in fp8; ``bias`` is
    added once. ``backend="nccl"`` refuses ``algorithm="ring"`` (its GEMMs add the partial sums,
    which fp8 GEMMs do not take); the symmetric backend's ring sums them apart."""
    product, _ = _scaled(_meshla.CollectiveOp.matmul_reduce_scatter, a, b, a_scale, b_scale,
                         group, bias, out_dtype, False, algorithm, chunks, comm_sms, comm_ctas,
                         backend)
    return product


def scaled_matmul_all_reduce(a, b, a_scale, b_scale, group: TPGroup, *, bias=None,
                             out_dtype=torch.bfloat16, algorithm="auto", chunks: int = 0,
                             comm_sms: int = -1, comm_ctas: int = 0, backend="auto"):
    """``sum over ranks(a @ b.T)`` [m, n] in float8 with its scales: :func:`matmul_all_reduce`
    on ``torch._scaled_mm``'s operands, as :func:`scaled_matmul_reduce_scatter` but every rank
    gets every row."""
    product, _ = _scaled(_meshla.CollectiveOp.matmul_all_reduce, a, b, a_scale, b_scale, group,
                         bias, out_dtype, False, algorithm, chunks, comm_sms, comm_ctas, backend)
    return product
