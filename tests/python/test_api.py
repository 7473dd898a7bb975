"""Argument checks of the Python API and the extension, and the unique-id exchange."""

import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import meshla
import meshla.torch as mt
from meshla.torch._group import _exchange_unique_id


def test_bad_shapes_name_the_arguments(world1):
    a = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"b.shape=\[6, 5\] \(\[k, n\]\) does not match "
                                         r"a.shape=\[4, 8\]: the contraction needs k=8"):
        mt.all_gather_matmul(a, torch.randn(6, 5), world1)
    with pytest.raises(ValueError, match=r"b.shape=\[8, 5\] \(\[n, k\]\)"):
        mt.matmul_all_reduce(a, torch.randn(8, 5), world1, trans_b=True)
    with pytest.raises(ValueError, match=r"bias.shape=\[4\] but expected \[5\]"):
        mt.matmul_reduce_scatter(a, torch.randn(8, 5), world1, bias=torch.randn(4))
    with pytest.raises(ValueError, match=r"a must be a 2-D array, got \[4, 8, 1\]"):
        mt.matmul_all_reduce(a[..., None], torch.randn(8, 5), world1)
    with pytest.raises(ValueError, match=r"a.dtype=float64 is not supported"):
        mt.all_gather_matmul(a.double(), torch.randn(8, 5).double(), world1)
    with pytest.raises(ValueError, match=r"b.dtype=float16 but a.dtype=float32"):
        mt.all_gather_matmul(a, torch.randn(8, 5).half(), world1)
    with pytest.raises(ValueError, match=r"algorithm='fastest' is not one of"):
        mt.all_gather_matmul(a, torch.randn(8, 5), world1, algorithm="fastest")
    with pytest.raises(ValueError, match=r"group must be a meshla.torch.TPGroup"):
        mt.all_gather_matmul(a, torch.randn(8, 5), None)
    with pytest.raises(ValueError, match=r"a gathered output is given but return_gathered=False"):
        mt.all_gather_matmul(a, torch.randn(8, 5), world1, gathered_out=torch.empty(4, 8))
    with pytest.raises(ValueError,
                       match=r"matmul_all_reduce: out.shape=\[4, 4\] but expected \[4, 5\]"):
        mt.matmul_all_reduce(a, torch.randn(8, 5), world1, out=torch.empty(4, 4))


def test_cpu_refuses_what_cuda_refuses(world1):
    """The CPU reference runs the extension's checks (describe_call) before it computes: a tuning
    request that the CUDA plans refuse is refused here too, in the same words."""
    a, b = torch.randn(4, 8), torch.randn(5, 8)
    refusals = [
        (dict(chunks=-1), ValueError, "matmul_all_reduce: chunks=-1 is negative"),
        (dict(comm_ctas=-5), ValueError, r"comm_ctas=-5 must be 0 \(NCCL's choice\) or more"),
        (dict(comm_sms=-2), ValueError, r"comm_sms=-2 must be -1 \(default\) or at least 0"),
        (dict(backend="symmetric", algorithm="sequential"), NotImplementedError, "symmetric"),
        (dict(backend="cublasmp"), NotImplementedError, "backend=cublasmp supports bfloat16"),
    ]
    for options, error, words in refusals:
        with pytest.raises(error, match=words):
            mt.matmul_all_reduce(a, b, world1, trans_b=True, **options)
    with pytest.raises(ValueError, match=r"a is on cpu but"):  # a CPU tensor on a CUDA plan
        meshla._meshla.describe_call(
            meshla._meshla.CollectiveOp.matmul_all_reduce, _meta(a), _meta(b), None, None, None,
            True, False, 1, 0, meshla.Algorithm.auto, 0, -1, 0, meshla.Backend.auto)


def _meta(t):
    from meshla.torch._dtypes import meta
    return meta("t", t)


def test_check_device_errors_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    mt.check_device_errors()  # no grouped call ran on a GPU: nothing to report


def test_autograd_refuses_outputs_given_and_cublasmp(world1):
    weight = torch.randn(8, 5, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"matmul_all_reduce: out= does not support"):
        mt.matmul_all_reduce(torch.randn(4, 8), weight, world1, out=torch.empty(4, 5))
    with pytest.raises(NotImplementedError, match=r"all_gather_matmul: gathered_out= does not"):
        mt.all_gather_matmul(torch.randn(4, 8), weight, world1, return_gathered=True,
                             gathered_out=torch.empty(4, 8))
    with pytest.raises(NotImplementedError, match=r"backend=cublasmp runs no backward"):
        mt.matmul_reduce_scatter(torch.randn(4, 8), weight, world1, backend="cublasmp")
    with torch.no_grad():  # no autograd: the output given is filled
        out = torch.empty(4, 5)
        assert mt.matmul_all_reduce(torch.randn(4, 8), weight, world1, out=out) is out
    assert not mt.matmul_all_reduce(torch.randn(4, 8), weight.detach(), world1).requires_grad


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter",
                                "matmul_all_reduce", "column_parallel_matmul"])
@pytest.mark.parametrize("needs", [(True, False, False), (False, True, False),
                                   (False, False, True)])
def test_gradients_of_the_inputs_that_require_them(world1, op, needs):
    """One rank: each op's gradient is plain matmul's, for whichever inputs require one."""
    tensors = [torch.randn(4, 8), torch.randn(8, 5), torch.randn(5)]
    mine = [t.clone().requires_grad_(need) for t, need in zip(tensors, needs)]
    reference = [t.clone().requires_grad_(need) for t, need in zip(tensors, needs)]
    weights = torch.randn(4, 5)
    out = getattr(mt, op)(mine[0], mine[1], world1, bias=mine[2])
    (out * weights).sum().backward()
    ((reference[0] @ reference[1] + reference[2]) * weights).sum().backward()
    for got, want, need in zip(mine, reference, needs):
        assert (got.grad is None) == (not need)
        if need:
            torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter",
                                "matmul_all_reduce", "column_parallel_matmul"])
def test_autocast_casts_the_operands_as_for_a_matmul(world1, op):
    tensors = [torch.randn(4, 8), torch.randn(8, 5), torch.randn(5)]
    mine = [t.clone().requires_grad_() for t in tensors]
    reference = [t.clone().requires_grad_() for t in tensors]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = getattr(mt, op)(mine[0], mine[1], world1, bias=mine[2])
        want = torch.nn.functional.linear(reference[0], reference[1].t(), reference[2])
    assert out.dtype == want.dtype == torch.bfloat16

    def relative_error(got, expected):  # bf16: rounding differs element by element
        return ((got.float() - expected.float()).norm() / expected.float().norm()).item()

    assert relative_error(out, want) < 1e-2
    weights = torch.randn(4, 5)
    (out.float() * weights).sum().backward()
    (want.float() * weights).sum().backward()
    for got, expected in zip(mine, reference):
        assert got.grad.dtype == torch.float32
        assert relative_error(got.grad, expected.grad) < 1e-2


def test_autocast_leaves_calls_with_outputs_and_float64_alone(world1):
    a, b = torch.randn(4, 8), torch.randn(8, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = torch.empty(4, 5)  # float32: the call keeps its operands' dtype, as torch's does
        assert mt.matmul_all_reduce(a, b, world1, out=out) is out
        with pytest.raises(ValueError, match=r"a.dtype=float64 is not supported"):
            mt.matmul_all_reduce(a.double(), b.double(), world1)


def test_gathered_rows_carry_no_gradient(world1):
    a = torch.randn(4, 8, requires_grad=True)
    product, gathered = mt.all_gather_matmul(a, torch.randn(8, 5), world1, return_gathered=True)
    assert product.requires_grad and not gathered.requires_grad


def test_tuning_takes_integers_whatever_came_before():
    """A Tuning's numbers are plain ints, as an op's int[] tuning has them: numpy integers are
    taken, and a float is refused even after the equal int made one (the cache tells them apart)."""
    assert mt.Tuning.of(chunks=2) is mt.Tuning.of(chunks=2)
    made = mt.Tuning.of(chunks=np.int64(2), comm_sms=np.int32(8))
    assert made == mt.Tuning.of(chunks=2, comm_sms=8) and type(made.chunks) is int
    for argument, bad in (("chunks", 2.0), ("comm_sms", "8"), ("comm_ctas", [1])):
        with pytest.raises(ValueError, match=rf"{argument}=.* is not an integer"):
            mt.Tuning.of(**{argument: bad})
    with pytest.raises(ValueError, match=r"algorithm=\['ring'\] is not one of"):
        mt.Tuning.of(algorithm=["ring"])
    for not_a_member in ("__doc__", "mro", "name"):  # attributes of the enum, not members
        with pytest.raises(ValueError, match=rf"algorithm='{not_a_member}' is not one of auto"):
            mt.Tuning.of(algorithm=not_a_member)
        with pytest.raises(ValueError, match=rf"backend='{not_a_member}' is not one of"):
            mt.Tuning.of(backend=not_a_member)


def _opcheck_worker(rank, size):
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        group = mt.group_from_process_group(device="cpu")
        a, b, bias = torch.randn(4, 8), torch.randn(8, 5), torch.randn(5)
        tuning = mt.Tuning.of(algorithm="pipelined", chunks=2).ints()
        key = group.key
        ops = torch.ops.meshla
        cases = [
            (ops.all_gather_matmul.default, (a, b, bias, key, False, True, tuning)),
            (ops.all_gather_matmul.default, (a, b.t(), None, key, True, False, tuning)),
            (ops.matmul_reduce_scatter.default, (a, b, bias, key, False, tuning)),
            (ops.matmul_all_reduce.default, (a, b.t(), bias, key, True, tuning)),
            (ops.all_gather.default, (a, key)),
        ]
        for op, args in cases:
            torch.library.opcheck(op, args)
        assert mt.Tuning.of_ints(tuning) == mt.Tuning.of(algorithm="pipelined", chunks=2)
        with pytest.raises(ValueError, match=r"tuning=\[3\] must be 5 ints"):
            ops.matmul_all_reduce(a, b, None, key, False, [3])
        with pytest.raises(NotImplementedError, match=r"torch.ops.meshla.matmul_all_reduce has "
                                                      r"no autograd"):
            ops.matmul_all_reduce(a.requires_grad_(), b, None, key, False, tuning)
    finally:
        dist.destroy_process_group()


def test_collective_ops_pass_opcheck(gloo_env):
    """The torch.ops.meshla collectives' schemas and fake implementations agree with their
    kernels (the CPU path) on every rank of a group of 2, and the ops refuse autograd."""
    mp.spawn(_opcheck_worker, args=(2,), nprocs=2, join=True)


def test_collective_ops_compile_whole(world1):
    """torch.compile(fullgraph=True) traces each op's checks, autocast and autograd around the
    torch.ops.meshla collectives, forward and backward, matching eager."""
    graphs = []

    def recording(gm, inputs):  # dynamo's graph, whose code names the ops it calls
        graphs.append(gm.print_readable(print_output=False))
        return torch._dynamo.backends.debugging.aot_eager(gm, inputs)

    def f(a, b, bias, a_whole):
        y = mt.all_gather_matmul(a, b, world1, bias=bias, recompute_gathered=True)
        z = mt.matmul_reduce_scatter(torch.relu(y), b.t(), world1)
        w = mt.matmul_all_reduce(z, b, world1, algorithm="pipelined")
        return w + mt.column_parallel_matmul(a_whole, b, world1, bias=bias)

    torch.manual_seed(0)
    inputs = [torch.randn(4, 8), torch.randn(8, 5), torch.randn(5), torch.randn(4, 8)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for backend in (recording, "inductor"):
            mine = [t.clone().requires_grad_() for t in inputs]
            twin = [t.clone().requires_grad_() for t in inputs]
            y = torch.compile(f, fullgraph=True, backend=backend)(*mine)
            y_eager = f(*twin)
            torch.testing.assert_close(y, y_eager)
            for got, want in zip(torch.autograd.grad(y.sum(), mine),
                                 torch.autograd.grad(y_eager.sum(), twin)):
                torch.testing.assert_close(got, want)
    # Nothing that Dynamo met in meshla's code warned (it does at lru_cache-wrapped calls).
    about_meshla = [str(w.message) for w in caught if "meshla" in str(w.message)]
    assert not about_meshla, about_meshla
    code = graphs[0]
    for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "all_gather("):
        assert f"torch.ops.meshla.{name}" in code, name


def test_calls_go_through_the_op_where_something_watches():
    """An eager call skips the dispatcher only where nothing needs to see the op: no tracer
    (compile, jit.trace), functorch transform, dispatch or torch function mode or Python-started
    profiler, and plain CUDA tensors (no tensors here, so only the context decides; a CPU tensor
    always takes the op)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode
    from meshla.torch._library import needs_the_op as needs

    assert not needs(())
    assert needs((torch.zeros(1),))
    with FakeTensorMode():
        assert needs(())
    with FlopCounterMode(display=False):
        assert needs(())
    class Passing(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passing():
        assert needs(())
        with torch.device("cpu"):
            assert needs(())
    # A default device is a torch function mode that only fills in factory calls' devices.
    with torch.device("cpu"):
        assert not needs(())
    torch.set_default_device("cpu")
    try:
        assert not needs(())
    finally:
        torch.set_default_device(None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert needs(())
    seen = []
    torch.vmap(lambda x: seen.append(needs(())) or x)(torch.zeros(2, 1))
    with warnings.catch_warnings():  # torch.jit.trace is deprecated in newer torch
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.trace(lambda x: seen.append(needs(())) or x * 2, torch.zeros(1),
                        check_trace=False)
    assert seen and all(seen), seen
    compiled = torch.compile(lambda x: x + 1 if needs(()) else x - 1, backend="eager",
                             fullgraph=True)
    assert compiled(torch.zeros(1)).item() == 1
    assert not needs(())


def _reduce_scatter_uneven(rank, size):
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        group = mt.group_from_process_group(device="cpu")
        with pytest.raises(ValueError, match=r"a.shape\[0\]=5 is not divisible by tp_size=2"):
            mt.matmul_reduce_scatter(torch.randn(5, 4), torch.randn(4, 3), group)
    finally:
        dist.destroy_process_group()


def test_reduce_scatter_rejects_uneven_rows(gloo_env):
    mp.spawn(_reduce_scatter_uneven, args=(2,), nprocs=2, join=True)


def test_extension_errors_map_to_python_exceptions():
    with pytest.raises(ValueError, match="unique_id has 3 bytes, expected 128"):
        meshla.Communicator(b"abc", 0, 1, 0)
    with pytest.raises(ValueError, match="timeout_s=0 must be positive"):
        meshla.Communicator(meshla.unique_id(), 0, 1, 0, timeout_s=0)
    if not torch.cuda.is_available():
        # Without a GPU the failing CUDA call is named in a RuntimeError.
        with pytest.raises(RuntimeError, match=r"cudaGetDeviceCount\(&device_count\) failed"):
            meshla.Communicator(meshla.unique_id(), 0, 1, 0)
    # Rank and size are checked before any CUDA call, so this holds with or without a GPU.
    with pytest.raises(ValueError, match=r"rank=2 is outside \[0, size=2\)"):
        meshla.Communicator(meshla.unique_id(), 2, 2, 0)


def _exchange(rank, size, results):
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        results[rank] = _exchange_unique_id(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def test_unique_id_travels_through_the_process_group(gloo_env):
    results = mp.Manager().dict()
    mp.spawn(_exchange, args=(3, results), nprocs=3, join=True)
    ids = [results[r] for r in range(3)]
    assert len(ids[0]) == 128
    assert ids[0] == ids[1] == ids[2]
    assert meshla.unique_id() != ids[0]  # fresh ids differ


def test_backend_query_names_what_is_missing():
    assert meshla.backend_unavailable_reason("nccl") == ""
    assert meshla.backend_unavailable_reason("symmetric") == ""
    reason = meshla.backend_unavailable_reason("cublasmp")
    if not torch.cuda.is_available():
        # libcublasmp needs the GPU driver, or the build left cuBLASMp out: either is named.
        assert "libcuda" in reason or "MESHLA_WITH_CUBLASMP" in reason, reason
    with pytest.raises(ValueError, match="backend='cublas'; expected one of"):
        meshla.backend_unavailable_reason("cublas")


def test_column_parallel_matmul_checks_its_operands_in_the_cores_words(world1):
    """Its forward is a local GEMM: operands that do not fit are refused as matmul_all_reduce
    words it, under column_parallel_matmul's name; the backward's tuning is checked at the call
    where a's gradient will need it."""
    a, b = torch.randn(4, 8), torch.randn(8, 5)
    cases = [
        ((a, torch.randn(7, 5)), {}, r"column_parallel_matmul: b.shape=\[7, 5\] \(\[k, n\]\) does "
                                     r"not match a.shape=\[4, 8\]: the contraction needs k=8"),
        ((a, b.double()), {}, r"column_parallel_matmul: b.dtype=float64 but a.dtype=float32"),
        ((a, b), {"bias": torch.randn(4)}, r"column_parallel_matmul: bias.shape=\[4\] but "
                                           r"expected \[5\]"),
        ((a, torch.randn(5, 8)), {"trans_b": False}, r"contraction needs k=8"),
        ((a.clone().requires_grad_(), b), {"chunks": -1},
         r"column_parallel_matmul: chunks=-1 is negative"),
    ]
    for args, options, words in cases:
        with pytest.raises(ValueError, match=words):
            mt.column_parallel_matmul(*args, world1, **options)
    with pytest.raises(NotImplementedError, match=r"column_parallel_matmul: backend=symmetric runs "
                                                  r"algorithm=ring only"):
        mt.column_parallel_matmul(a.clone().requires_grad_(), b, world1, backend="symmetric",
                                  algorithm="sequential")
    # b as [n, k]; without a gradient of a, the all-reduce's tuning is never used.
    assert mt.column_parallel_matmul(a, torch.randn(5, 8), world1, trans_b=True).shape == (4, 5)
    assert mt.column_parallel_matmul(a, b, world1, chunks=-1).shape == (4, 5)


def test_float8_operands_are_refused_in_the_cores_words(world1):
    """float8 operands need their scales (the scaled ops take them): refused without, in the
    same words as meshla.jax's (tests/python/test_jax_collective_cpu.py)."""
    a, b = torch.ones(8, 16).to(torch.float8_e4m3fn), torch.ones(16, 16).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="matmul_all_reduce: a_scale is missing: a float8 product "
                                         "needs a_scale and b_scale"):
        mt.matmul_all_reduce(a, b, world1)


def test_remembered_calls_cache_any_answer_and_go_with_the_plans():
    """A call is described once per group, None answers included (column_parallel_matmul's
    checks), and forgotten when the group's plans are let go of: what it remembers may hold them."""
    group = mt.TPGroup(rank=0, size=1)
    described = []

    def describe():
        described.append(1)

    for _ in range(3):
        assert group.remembered_call(("key",), describe) is None
    assert len(described) == 1
    group.clear_plans()
    group.remembered_call(("key",), describe)
    assert len(described) == 2
