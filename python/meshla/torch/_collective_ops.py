"""The collective matmuls' internal path, which the public functions (meshla.torch.collective) and
the backwards (meshla.torch._collective_autograd) call: one call's checks and config (the
extension's describe_call: every shape, dtype and tuning rule, on CPU and CUDA alike), its outputs,
the torch.ops.meshla ops with their fakes, and the group's plans on CUDA tensors or the references
on CPU ones.

The ops take the group by its key and the Tuning as ints. A call goes through its op only where
something needs to see it (meshla.torch._library.needs_the_op); otherwise it runs the op's work
(the *_into functions) on the group and Tuning themselves, as do calls with outputs given (an op
that fills an output given needs a schema of its own), where torch.compile breaks its graph on CUDA
tensors.
"""

from __future__ import annotations

import torch

from meshla import _meshla
from meshla.torch import _library, _reference
from meshla.torch._dtypes import DTYPES, meta
from meshla.torch._group import TPGroup, group_of
from meshla._tuning import Tuning

OPS = _meshla.CollectiveOp


def place_of(op: str, a, group: TPGroup) -> int:
    """Where a call on ``a`` runs, as describe_call counts: the group's GPU for CUDA tensors, -1 for
    CPU tensors (the reference over the group's process group); meta tensors stand in for the
    group's own."""
    if a.device.type == "meta":
        return -1 if group.comm is None else group.comm.device
    if a.device.type == "cpu":
        if group.process_group is None:
            raise ValueError(f"{op}: CPU tensors need a TPGroup with a torch.distributed process "
                             "group")
        return -1
    if group.comm is None:
        raise ValueError(f"{op}: a is on {a.device} but this TPGroup has no CUDA communicator (it "
                         "was built for CPU tensors)")
    return group.comm.device


def describe(op, a, b, bias, group: TPGroup, trans_b: bool, tuning: Tuning, out=None,
             gathered=None, return_gathered: bool = False, caller: str | None = None,
             scales=None, out_dtype=None) -> _meshla.CollectiveMatmulConfig:
    """The call's config, checked by the extension (describe_call) on the tensors' metadata. Its
    errors begin with ``caller``'s name in place of the op's where a public function other than
    the op checks its operands by the op's rules. A float8 call's ``scales`` are (a_scale,
    b_scale) and ``out_dtype`` its product's torch dtype."""
    place = place_of(caller or op.name, a, group)

    def of(name, t):  # a meta tensor stands in for one where the call runs
        return meta(name, t, place if t is not None and t.device.type == "meta" else None)

    try:
        # A 0-d scale as [1]: the extension reads an array without data and dimensions (a fake
        # tensor's) as absent.
        a_scale, b_scale = (None if t is None else t.reshape(1) if t.dim() == 0 else t
                            for t in (scales or (None, None)))
        return _meshla.describe_call(
            op, of("a", a), of("b", b), of("bias", bias), of("out", out),
            of("gathered", gathered), trans_b, return_gathered, group.size, place,
            tuning.algorithm, tuning.chunks, tuning.comm_sms, tuning.comm_ctas, tuning.backend,
            a_scale=of("a_scale", a_scale), b_scale=of("b_scale", b_scale),
            out_dtype=None if out_dtype is None else DTYPES[out_dtype])
    except (ValueError, NotImplementedError) as error:
        prefix = f"{op.name}: "
        if caller is None or not str(error).startswith(prefix):
            raise
        raise type(error)(f"{caller}: {str(error)[len(prefix):]}") from None


def _made(given, shape, like):
    """The output the caller gave (describe_call checked it), or a fresh one of ``shape``."""
    return given if given is not None else like.new_empty(shape)


def _planned(op, a, b, bias, group: TPGroup, trans_b: bool, tuning: Tuning, out=None,
             gathered=None, return_gathered: bool = False):
    """(config, the group's plan for it, the product's shape) for a call on CUDA tensors. One into
    fresh outputs is remembered by its operands' metadata, which alone decide describe_call's
    answer, so the same call again skips it (the plan's execute checks the tensors against its
    config in any case); outputs given are checked every time, their addresses too."""
    def described():
        config = describe(op, a, b, bias, group, trans_b, tuning, out, gathered,
                          return_gathered)
        return config, group.plan(config), config.product_shape(group.size)

    if out is not None or gathered is not None:
        return described()
    key = (op, trans_b, return_gathered, tuning, metadata(a), metadata(b), metadata(bias))
    return group.remembered_call(key, described)


def metadata(t):
    """What describe_call reads of a tensor besides its address, as a key."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())


def _run(plan, a, b, bias, out, gathered, given=()):
    """Executes ``plan`` into ``out`` (and ``gathered``), which _planned described with these
    tensors; ``given`` are those of them the caller passed (out=, gathered_out=)."""
    # Held until the plan has enqueued its work: a copy made here and let go of sooner could hand
    # its memory to the next one.
    a, b = a.contiguous(), b.contiguous()
    bias = None if bias is None else bias.contiguous()
    plan.execute(a.data_ptr(), b.data_ptr(), 0 if bias is None else bias.data_ptr(),
                 out.data_ptr(), 0 if gathered is None else gathered.data_ptr(),
                 _library.current_stream(a.get_device()))
    # The plan writes through raw addresses, which autograd does not see: a caller's output that
    # a backward saved must read as changed, as after torch's own out= ops, or that backward would
    # use the new contents without a word.
    for written in given:
        if written is not None:
            torch.autograd.graph.increment_version(written)


def _refuse_autograd(op: str, *tensors):
    """The ops carry no autograd (the autograd.Functions call them without grad): called directly
    on inputs that require grad, their gradients would be missing, or on CPU wrong."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise NotImplementedError(
            f"torch.ops.meshla.{op} has no autograd: call meshla.torch's function of that name, "
            "its differentiable form, or call the op under torch.no_grad()")


def _all_gather_matmul_into(a, b, bias, group, trans_b, return_gathered, tuning, out,
                            gathered_out):
    """(product, gathered a or None), into the outputs given or fresh ones."""
    if a.device.type == "cpu":
        describe(OPS.all_gather_matmul, a, b, bias, group, trans_b, tuning, out, gathered_out,
                 return_gathered)
        gathered = _reference.gathered_rows(a, group)
        product = _reference.product(gathered, b, bias, trans_b, True).to(a.dtype)
        return (_reference.deliver(product, out),
                _reference.deliver(gathered, gathered_out) if return_gathered else None)
    config, plan, product_shape = _planned(OPS.all_gather_matmul, a, b, bias, group, trans_b,
                                           tuning, out, gathered_out, return_gathered)
    product = _made(out, product_shape, a)
    gathered = _made(gathered_out, (config.m, config.k), a) if return_gathered else None
    _run(plan, a, b, bias, product, gathered, (out, gathered_out))
    return product, gathered


@_library.define("all_gather_matmul(Tensor a, Tensor b, Tensor? bias, int group, "
                 "bool trans_b, bool return_gathered, int[] tuning) -> (Tensor, Tensor)")
def _all_gather_matmul_op(a, b, bias, group, trans_b, return_gathered, tuning):
    _refuse_autograd("all_gather_matmul", a, b, bias)
    # The gathered a is [0, k] where it is not asked for: an op returns tensors.
    product, gathered = _all_gather_matmul_into(a, b, bias, group_of(group), trans_b,
                                                return_gathered, Tuning.of_ints(tuning), None,
                                                None)
    return product, gathered if return_gathered else a.new_empty(0, a.shape[1])


@torch.library.register_fake("meshla::all_gather_matmul")
def _(a, b, bias, group, trans_b, return_gathered, tuning):
    tp_group = group_of(group)
    config = describe(OPS.all_gather_matmul, a, b, bias, tp_group, trans_b,
                      Tuning.of_ints(tuning), return_gathered=return_gathered)
    return (a.new_empty(config.product_shape(tp_group.size)),
            a.new_empty(config.m if return_gathered else 0, config.k))


def all_gather_matmul(a, b, bias, group, trans_b, return_gathered, tuning, out=None,
                      gathered_out=None):
    """(product, gathered a or None): the op where something needs to see it, else its work."""
    if out is None and gathered_out is None and _library.needs_the_op((a, b, bias)):
        product, gathered = _all_gather_matmul_op(a, b, bias, group.key, trans_b,
                                                  return_gathered, tuning.ints())
        return product, gathered if return_gathered else None
    return _all_gather_matmul_into(a, b, bias, group, trans_b, return_gathered, tuning, out,
                                   gathered_out)


def _matmul_reduce_scatter_into(a, b, bias, group, trans_b, tuning, out):
    if a.device.type == "cpu":
        config = describe(OPS.matmul_reduce_scatter, a, b, bias, group, trans_b, tuning, out)
        total = _reference.summed_over_ranks(a, b, bias, trans_b, group)
        rows = config.product_shape(group.size)[0]
        # A copy: a view would keep the whole sum alive (and an op's output must start at
        # offset 0, as its fake does).
        own_rows = total[group.rank * rows:(group.rank + 1) * rows].to(a.dtype, copy=True)
        return _reference.deliver(own_rows, out)
    _, plan, product_shape = _planned(OPS.matmul_reduce_scatter, a, b, bias, group, trans_b,
                                      tuning, out)
    product = _made(out, product_shape, a)
    _run(plan, a, b, bias, product, None, (out,))
    return product


@_library.define("matmul_reduce_scatter(Tensor a, Tensor b, Tensor? bias, int group, "
                 "bool trans_b, int[] tuning) -> Tensor")
def _matmul_reduce_scatter_op(a, b, bias, group, trans_b, tuning):
    _refuse_autograd("matmul_reduce_scatter", a, b, bias)
    return _matmul_reduce_scatter_into(a, b, bias, group_of(group), trans_b,
                                       Tuning.of_ints(tuning), None)


def _reduction_fake(op):
    """The fake of a reduction's op: its product, shaped as the extension describes the call."""
    def fake(a, b, bias, group, trans_b, tuning):
        tp_group = group_of(group)
        config = describe(op, a, b, bias, tp_group, trans_b, Tuning.of_ints(tuning))
        return a.new_empty(config.product_shape(tp_group.size))

    return torch.library.register_fake(f"meshla::{op.name}")(fake)


_reduction_fake(OPS.matmul_reduce_scatter)


def matmul_reduce_scatter(a, b, bias, group, trans_b, tuning, out=None):
    if out is None and _library.needs_the_op((a, b, bias)):
        return _matmul_reduce_scatter_op(a, b, bias, group.key, trans_b, tuning.ints())
    return _matmul_reduce_scatter_into(a, b, bias, group, trans_b, tuning, out)


def _matmul_all_reduce_into(a, b, bias, group, trans_b, tuning, out):
    if a.device.type == "cpu":
        describe(OPS.matmul_all_reduce, a, b, bias, group, trans_b, tuning, out)
        total = _reference.summed_over_ranks(a, b, bias, trans_b, group)
        return _reference.deliver(total.to(a.dtype), out)
    _, plan, product_shape = _planned(OPS.matmul_all_reduce, a, b, bias, group, trans_b, tuning,
                                      out)
    product = _made(out, product_shape, a)
    _run(plan, a, b, bias, product, None, (out,))
    return product


@_library.define("matmul_all_reduce(Tensor a, Tensor b, Tensor? bias, int group, "
                 "bool trans_b, int[] tuning) -> Tensor")
def _matmul_all_reduce_op(a, b, bias, group, trans_b, tuning):
    _refuse_autograd("matmul_all_reduce", a, b, bias)
    return _matmul_all_reduce_into(a, b, bias, group_of(group), trans_b, Tuning.of_ints(tuning),
                                   None)


_reduction_fake(OPS.matmul_all_reduce)


def matmul_all_reduce(a, b, bias, group, trans_b, tuning, out=None):
    if out is None and _library.needs_the_op((a, b, bias)):
        return _matmul_all_reduce_op(a, b, bias, group.key, trans_b, tuning.ints())
    return _matmul_all_reduce_into(a, b, bias, group, trans_b, tuning, out)


def _all_gather_rows(rows, group: TPGroup):
    """[tp * r, c] from every rank's [r, c] ``rows``, in rank order."""
    if rows.device.type == "cpu":
        return _reference.gathered_rows(rows, group)
    gathered = rows.new_empty(rows.shape[0] * group.size, rows.shape[1])
    plan = group.all_gather_plan(rows.dtype, rows.shape[0], rows.shape[1])
    plan.execute(_library.capsule(rows.contiguous()), _library.capsule(gathered),
                 _library.current_stream(rows.get_device()))
    return gathered


@_library.define("all_gather(Tensor rows, int group) -> Tensor")
def _all_gather_op(rows, group):
    _refuse_autograd("all_gather", rows)
    return _all_gather_rows(rows, group_of(group))


@torch.library.register_fake("meshla::all_gather")
def _(rows, group):
    return rows.new_empty(rows.shape[0] * group_of(group).size, rows.shape[1])


def all_gather(rows, group: TPGroup):
    """Every rank's rows, gathered (a backward that gathers its forward's rows again)."""
    if _library.needs_the_op((rows,)):
        return _all_gather_op(rows, group.key)
    return _all_gather_rows(rows, group)


def dequantized(t, scale, rowwise: bool):
    """An fp8 operand as float32 times its scales (one, or one per row)."""
    return t.float() * (scale.float().reshape(-1, 1) if rowwise else scale.float().reshape(()))


def scaled_matmul(op, a, b, a_scale, b_scale, bias, group: TPGroup, out_dtype,
                  return_gathered: bool, tuning: Tuning):
    """A float8 collective matmul (b stored [n, k]): (product in ``out_dtype``, gathered a or
    None). On CPU tensors a float32 reference on the dequantized operands; on CUDA tensors the
    group's plan, which moves fp8 rows and reduces in ``out_dtype``."""
    config = describe(op, a, b, bias, group, True, tuning, return_gathered=return_gathered,
                      scales=(a_scale, b_scale), out_dtype=out_dtype)
    rowwise = config.scaling == "rowwise"
    if a.device.type == "cpu":
        b32 = dequantized(b, b_scale, rowwise)
        gathers = op == OPS.all_gather_matmul
        if gathers:
            # Rowwise: each row with its own scale; tensorwise: a_scale is the gathered rows'.
            # fp8 travels as bytes (process groups' all-gathers need not take float8).
            if rowwise:
                a32 = _reference.gathered_rows(dequantized(a, a_scale, True), group)
            else:
                a32 = dequantized(
                    _reference.gathered_rows(a.view(torch.uint8), group).view(a.dtype), a_scale,
                    False)
            product = _reference.product(a32, b32, bias, True, True)
        else:
            product = _reference.summed_over_ranks(dequantized(a, a_scale, rowwise), b32, bias,
                                                   True, group)
            if op == OPS.matmul_reduce_scatter:
                rows = config.product_shape(group.size)[0]
                product = product[group.rank * rows:(group.rank + 1) * rows]
        gathered = (_reference.gathered_rows(a.view(torch.uint8), group).view(a.dtype)
                    if return_gathered else None)
        return product.to(out_dtype, copy=True), gathered
    plan = group.plan(config)
    product = a.new_empty(config.product_shape(group.size), dtype=out_dtype)
    gathered = a.new_empty(config.m, config.k) if return_gathered else None
    # Held until the plan has enqueued its work (see _run).
    a, b, a_scale, b_scale = (t.contiguous() for t in (a, b, a_scale, b_scale))
    bias = None if bias is None else bias.contiguous()
    plan.execute(a.data_ptr(), b.data_ptr(), 0 if bias is None else bias.data_ptr(),
                 product.data_ptr(), 0 if gathered is None else gathered.data_ptr(),
                 _library.current_stream(a.get_device()), a_scale=a_scale.data_ptr(),
                 b_scale=b_scale.data_ptr())
    return product, gathered


# The float8 op takes the collective op by its index here.
_SCALED_OPS = (OPS.all_gather_matmul, OPS.matmul_reduce_scatter, OPS.matmul_all_reduce)


@_library.define("scaled_collective_matmul(Tensor a, Tensor b, Tensor a_scale, Tensor b_scale, "
                 "Tensor? bias, int op, int group, ScalarType out_dtype, bool return_gathered, "
                 "int[] tuning) -> (Tensor, Tensor)")
def _scaled_op(a, b, a_scale, b_scale, bias, op, group, out_dtype, return_gathered, tuning):
    _refuse_autograd("scaled_collective_matmul", a, b, a_scale, b_scale, bias)
    product, gathered = scaled_matmul(_SCALED_OPS[op], a, b, a_scale, b_scale, bias,
                                      group_of(group), out_dtype, return_gathered,
                                      Tuning.of_ints(tuning))
    # The gathered a is [0, k] where it is not asked for: an op returns tensors.
    return product, gathered if return_gathered else a.new_empty(0, a.shape[1])


@torch.library.register_fake("meshla::scaled_collective_matmul")
def _(a, b, a_scale, b_scale, bias, op, group, out_dtype, return_gathered, tuning):
    tp_group = group_of(group)
    config = describe(_SCALED_OPS[op], a, b, bias, tp_group, True, Tuning.of_ints(tuning),
                      return_gathered=return_gathered, scales=(a_scale, b_scale),
                      out_dtype=out_dtype)
    return (a.new_empty(config.product_shape(tp_group.size), dtype=out_dtype),
            a.new_empty(config.m if return_gathered else 0, config.k))


def scaled(op, a, b, a_scale, b_scale, bias, group: TPGroup, out_dtype, return_gathered: bool,
           tuning: Tuning):
    """(product, gathered a or None): torch.ops.meshla.scaled_collective_matmul where something
    needs to see it (torch.compile, fake tensors), else its work."""
    if _library.needs_the_op((a, b, a_scale, b_scale, bias)):
        product, gathered = _scaled_op(a, b, a_scale, b_scale, bias, _SCALED_OPS.index(op),
                                       group.key, out_dtype, return_gathered, tuning.ints())
        return product, gathered if return_gathered else None
    return scaled_matmul(op, a, b, a_scale, b_scale, bias, group, out_dtype, return_gathered,
                         tuning)
