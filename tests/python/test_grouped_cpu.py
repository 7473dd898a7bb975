"""CPU tests of meshla.torch's grouped GEMM: the reference path, autograd wiring, packed and
aligned parameter and gradient storage, delayed weight gradients, main_grad accumulation and
argument errors. The GPU kernels are checked by tests/gpu/check_grouped.py."""

import copy

import pytest
import torch

import meshla.torch as mt


def loop_reference(x, m_splits, weights, biases):
    out, start = [], 0
    for g, size in enumerate(m_splits.tolist()):
        y = x[start:start + size].double() @ weights[g].double().T
        if biases is not None:
            y = y + biases[g].double()
        out.append(y)
        start += size
    return torch.cat(out)


def splits(sizes):
    return torch.tensor(sizes, dtype=torch.int64)


@pytest.mark.parametrize("bias", [True, False])
def test_functional_matches_loop_with_gradients(bias):
    torch.manual_seed(0)
    sizes = [5, 0, 7, 1]
    x = torch.randn(sum(sizes), 6, dtype=torch.float32, requires_grad=True)
    w = torch.randn(4, 3, 6, dtype=torch.float32, requires_grad=True)
    b = torch.randn(4, 3, dtype=torch.float32, requires_grad=True) if bias else None
    y = mt.grouped_linear(x, splits(sizes), w, b)
    ref = loop_reference(x, splits(sizes), w, b)  # in float64
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, w] + ([b] if bias else []), dy)
    ref_grads = torch.autograd.grad(ref, [x, w] + ([b] if bias else []), dy)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(grads[1][1]) == 0  # the empty group's weight gradient is zero


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_matmul_takes_ragged_dots_layout(bias):
    """grouped_matmul: rhs [G, k, n] (torch._grouped_mm's layout) against a loop in float64,
    every gradient, an empty group's rhs gradient zero; transpose_rhs is grouped_linear."""
    torch.manual_seed(1)
    sizes = [5, 0, 7, 1]
    lhs = torch.randn(sum(sizes), 6, requires_grad=True)
    rhs = torch.randn(4, 6, 3, requires_grad=True)
    b = torch.randn(4, 3, requires_grad=True) if bias else None
    out = mt.grouped_matmul(lhs, rhs, splits(sizes), b)
    ref = loop_reference(lhs, splits(sizes), rhs.transpose(1, 2), b)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    d_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [lhs, rhs] + ([b] if bias else []), d_out)
    ref_grads = torch.autograd.grad(ref, [lhs, rhs] + ([b] if bias else []), d_out)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    assert grads[1].shape == rhs.shape and torch.count_nonzero(grads[1][1]) == 0
    linear = mt.grouped_matmul(lhs, rhs.transpose(1, 2).contiguous(), splits(sizes), b,
                               transpose_rhs=True)
    torch.testing.assert_close(linear, out)


def test_grouped_matmul_errors_name_its_operands():
    """The core's checks in grouped_matmul's words (lhs, rhs, group_sizes), as meshla.jax's."""
    lhs, rhs = torch.randn(10, 8), torch.randn(3, 8, 5)
    with pytest.raises(ValueError, match="grouped_matmul: lhs is torch.bfloat16 but rhs is "
                                         "torch.float32; they must match"):
        mt.grouped_matmul(lhs.bfloat16(), rhs, splits([4, 0, 6]))
    with pytest.raises(ValueError, match=r"^grouped_matmul forward: lhs.shape=\[10, 8\] must be "
                                         r"\[rows, in\] = \[10, 7\]"):
        mt.grouped_matmul(lhs, rhs[:, :7], splits([4, 0, 6]))
    with pytest.raises(ValueError, match=r"^grouped_matmul forward: rhs.shape=\[3, 8, 5\] must be "
                                         r"\[G, in, out\] = \[2, 8, 5\]"):
        mt.grouped_matmul(lhs, rhs, splits([4, 0]))
    # Group sizes, in its words too, the bias gradient's included (the sums are layout-free)
    with pytest.raises(ValueError, match=r"^grouped_matmul: group_sizes\[1\]=-1 is negative"):
        mt.grouped_matmul(lhs, rhs, splits([4, -1, 7]))
    with pytest.raises(ValueError, match="^grouped_matmul: group_sizes sums to 9 but the input "
                                         "has 10 rows"):
        torch.ops.meshla.grouped_bias_grad(torch.randn(10, 5), splits([4, 0, 5]), 3, True)


def test_the_engine_binding_takes_every_argument_the_ops_pass():
    """CPU tensors never reach GroupedMatmul.run (CUDA only), so its keywords are checked here
    against what grouped._run passes it (weight_layout was once missing from them)."""
    signature = mt.grouped._meshla.GroupedMatmul.run.__doc__
    for name in ("grouped_pass", "m_splits", "workspace", "stream", "x", "dy", "weight", "bias",
                 "y", "dx", "dweight", "dbias", "accumulate", "dweight_addresses",
                 "weight_layout"):
        assert f"{name}:" in signature, name


def test_ops_pass_opcheck():
    """Schemas, fake implementations and the mutation annotation agree with the kernels. The
    weight gradient's groups fill 256 bytes exactly: padding between groups is left unwritten,
    and opcheck compares whole outputs."""
    torch.manual_seed(0)
    sizes = splits([5, 0, 7, 4])
    x, dy = torch.randn(16, 8), torch.randn(16, 8)
    stride = mt.packed_group_stride(8, 8, torch.float32)
    assert stride == 64
    w = torch.randn(4, 8, 8)
    main_grads = [torch.zeros(8, 8) for _ in range(4)]
    cases = [
        (torch.ops.meshla.grouped_mm.default, (x, sizes, w, torch.randn(4, 8))),
        (torch.ops.meshla.grouped_mm_dgrad.default, (dy, sizes, w)),
        (torch.ops.meshla.grouped_mm_wgrad.default, (x, dy, sizes, stride)),
        (torch.ops.meshla.grouped_mm_wgrad_accumulate_.default, (x, dy, sizes, main_grads)),
        (torch.ops.meshla.grouped_bias_grad.default, (dy, sizes, 4)),
        (torch.ops.meshla.grouped_mm.default, (x, sizes, w, torch.randn(4, 8), True)),
        (torch.ops.meshla.grouped_mm_dgrad.default, (dy, sizes, w, True)),
        (torch.ops.meshla.grouped_mm_wgrad.default, (x, dy, sizes, stride, True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_grouped_linear_compiles_with_gradients():
    """torch.compile(fullgraph=True) traces the forward and every gradient (x, weight, bias) of
    the functional form and of the module, matching eager."""
    torch.manual_seed(0)
    sizes = splits([5, 0, 7, 4])
    x = torch.randn(16, 6, requires_grad=True)
    w = torch.randn(4, 3, 6, requires_grad=True)
    b = torch.randn(4, 3, requires_grad=True)

    def f(x, w, b):
        return torch.relu(mt.grouped_linear(x, sizes, w, b))

    y = torch.compile(f, fullgraph=True)(x, w, b)
    grads = torch.autograd.grad(y.sum(), [x, w, b])
    y_eager = f(x, w, b)
    torch.testing.assert_close(y, y_eager)
    for got, want in zip(grads, torch.autograd.grad(y_eager.sum(), [x, w, b])):
        torch.testing.assert_close(got, want)

    layer = mt.GroupedLinear(4, 6, 3)
    twin = copy.deepcopy(layer)
    torch.compile(layer, fullgraph=True)(x, sizes).sum().backward()
    twin(x, sizes).sum().backward()
    for got, want in zip(layer.parameters(), twin.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


def test_a_layer_no_call_could_run_is_refused_when_made():
    with pytest.raises(ValueError, match=r"GroupedLinear\(num_groups=2, in_features=8, "
                                         r"out_features=16, dtype=torch.float64\): no call could "
                                         r"run: grouped_linear forward: x is float64; grouped GEMM "
                                         r"takes bfloat16, float16 or float32"):
        mt.GroupedLinear(2, 8, 16, dtype=torch.float64)
    mt.GroupedLinear(2, 1000, 1001, dtype=torch.bfloat16)  # runs padded (issue 41)
    mt.GroupedLinear(2, 8, 16, dtype=torch.bfloat16, device="meta")


def test_packed_group_stride_aligns_groups_to_256_bytes():
    assert mt.packed_group_stride(3, 5, torch.float32) == 64
    assert mt.packed_group_stride(8, 16, torch.bfloat16) == 128
    assert mt.packed_group_stride(2048, 7168, torch.bfloat16) == 2048 * 7168
    with pytest.raises(ValueError, match="out_features=0"):
        mt.packed_group_stride(0, 5, torch.float32)


@pytest.mark.parametrize("out_features,in_features", [(3, 5), (8, 16)])
def test_module_parameters_and_gradients_are_aligned_views_of_one_buffer(out_features, in_features):
    torch.manual_seed(1)
    layer = mt.GroupedLinear(3, in_features, out_features, dtype=torch.float32)
    weights = layer.weights()
    storage = weights[0].untyped_storage().data_ptr()
    for w in weights:
        assert w.untyped_storage().data_ptr() == storage
        assert (w.data_ptr() - storage) % 256 == 0
    sizes = [4, 0, 6]
    x = torch.randn(10, in_features)
    y = layer(x, splits(sizes))
    ref = loop_reference(x, splits(sizes), [w.detach() for w in weights],
                         [b.detach() for b in layer.biases()])
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    grad_storage = weights[0].grad.untyped_storage().data_ptr()
    for w in weights:
        assert w.grad.untyped_storage().data_ptr() == grad_storage
        assert (w.grad.data_ptr() - grad_storage) % 256 == 0
    assert torch.count_nonzero(weights[1].grad) == 0

    # The same gradients from the functional form over a stacked weight.
    stacked = torch.stack([w.detach() for w in weights]).requires_grad_()
    biases = torch.stack([b.detach() for b in layer.biases()]).requires_grad_()
    mt.grouped_linear(x, splits(sizes), stacked, biases).square().sum().backward()
    for g, w in enumerate(weights):
        torch.testing.assert_close(w.grad, stacked.grad[g])
        torch.testing.assert_close(layer.biases()[g].grad, biases.grad[g])


def test_module_repacks_after_dtype_change_and_replaced_data():
    layer = mt.GroupedLinear(2, 8, 8, bias=False, dtype=torch.float32)
    layer.to(torch.bfloat16)
    weights = layer.weights()
    assert weights[0].dtype == torch.bfloat16
    assert weights[0].untyped_storage().data_ptr() == weights[1].untyped_storage().data_ptr()
    new = torch.randn(8, 8, dtype=torch.bfloat16)
    weights[1].data = new.clone()
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    y = layer(x, splits([2, 3]))
    torch.testing.assert_close(y[2:], x[2:] @ new.T)
    assert weights[0].untyped_storage().data_ptr() == weights[1].untyped_storage().data_ptr()


def test_delayed_weight_gradients():
    torch.manual_seed(2)
    layer = mt.GroupedLinear(2, 4, 8, delay_wgrad_compute=True, dtype=torch.float32)
    x = torch.randn(7, 4, dtype=torch.float32, requires_grad=True)
    layer(x, splits([3, 4])).sum().backward()
    assert all(w.grad is None for w in layer.weights())
    assert x.grad is not None and all(b.grad is not None for b in layer.biases())
    layer.backward_dw()
    for g, (start, size) in enumerate([(0, 3), (3, 4)]):
        want = torch.ones(size, 8, dtype=torch.float32).T @ x.detach()[start:start + size]
        torch.testing.assert_close(layer.weights()[g].grad, want)


def test_main_grad_accumulation():
    torch.manual_seed(3)
    layer = mt.GroupedLinear(3, 4, 8, bias=False, fuse_wgrad_accumulation=True)
    # As Megatron's gradient buffer: the parameters in reverse order, at uneven gaps.
    buffer = torch.ones(3 * 40 + 6)
    offsets = [86, 44, 0]
    for g, w in enumerate(layer.weights()):
        w.main_grad = buffer[offsets[g]:offsets[g] + 32].view(8, 4)
    x = torch.randn(6, 4)
    layer(x, splits([2, 0, 4])).sum().backward()
    assert all(w.grad is None for w in layer.weights())
    torch.testing.assert_close(layer.weights()[0].main_grad, 1 + torch.ones(2, 8).T @ x[:2])
    torch.testing.assert_close(layer.weights()[1].main_grad, torch.ones(8, 4))
    torch.testing.assert_close(layer.weights()[2].main_grad, 1 + torch.ones(4, 8).T @ x[2:])
    assert torch.all(buffer[32:44] == 1) and torch.all(buffer[76:86] == 1)  # gaps untouched

    # Megatron's mark: set, with a placeholder .grad for its DDP to drop.
    for w in layer.weights():
        w.grad_added_to_main_grad = False
    layer(x, splits([2, 0, 4])).sum().backward()
    assert all(w.grad_added_to_main_grad and w.grad is not None for w in layer.weights())

    layer.weights()[2].main_grad = torch.zeros(8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"main_grads\[2\] is torch.float64 \[8, 4\]"):
        layer(x, splits([2, 0, 4])).sum().backward()
    del layer.weights()[1].main_grad
    with pytest.raises(ValueError, match="every weight needs a float32 .main_grad"):
        layer(x, splits([2, 0, 4])).sum().backward()

    # A frozen expert's main_grad would be added to all the same: refused.
    layer.weights()[1].main_grad = torch.zeros(8, 4)
    layer.weights()[2].main_grad = torch.zeros(8, 4)
    layer.weights()[1].requires_grad_(False)
    with pytest.raises(ValueError, match=r"some experts are frozen \(requires_grad=False\)"):
        layer(x, splits([2, 0, 4])).sum().backward()


def test_main_grad_of_megatron_fsdp():
    """Megatron-FSDP's parameters: each main_grad is asked of get_main_grad() at the backward, and
    overwrite_main_grad makes the gradient replace that buffer's contents (a NaN there included)
    instead of adding to them; weights without it are added to."""
    torch.manual_seed(4)
    layer = mt.GroupedLinear(3, 4, 8, bias=False, fuse_wgrad_accumulation=True)
    buffers = [torch.full((8, 4), float("nan")), torch.full((8, 4), 2.0), torch.ones(8, 4)]
    for w, buffer, overwrite in zip(layer.weights(), buffers, (True, True, False)):
        w.__fsdp_param__ = True
        w.get_main_grad = lambda buffer=buffer: buffer
        w.overwrite_main_grad = overwrite
    x = torch.randn(6, 4)
    layer(x, splits([2, 0, 4])).sum().backward()
    assert all(w.main_grad is buffer for w, buffer in zip(layer.weights(), buffers))
    torch.testing.assert_close(buffers[0], torch.ones(2, 8).T @ x[:2])
    torch.testing.assert_close(buffers[1], torch.zeros(8, 4))  # an empty group's gradient
    torch.testing.assert_close(buffers[2], 1 + torch.ones(4, 8).T @ x[2:])


def test_argument_errors():
    x = torch.randn(6, 4)
    w = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"m_splits\[1\]=-1 is negative"):
        mt.grouped_linear(x, splits([7, -1]), w)
    with pytest.raises(ValueError, match="sums to 5 but the input has 6 rows"):
        mt.grouped_linear(x, splits([2, 3]), w)
    with pytest.raises(ValueError, match="forward: m_splits is float32, expected int64 or int32"):
        mt.grouped_linear(x, torch.tensor([3.0, 3.0]), w)
    int32_sizes = mt.grouped_linear(x, torch.tensor([2, 4], dtype=torch.int32), w)
    torch.testing.assert_close(int32_sizes, mt.grouped_linear(x, splits([2, 4]), w))
    # The CUDA path's rules and words (the extension checks both): float64 is refused on the CPU
    # too; 16-bit rows that TMA cannot read run there (padded) as here.
    with pytest.raises(ValueError, match="grouped_linear forward: x is float64; grouped GEMM takes "
                                         "bfloat16, float16 or float32"):
        mt.grouped_linear(x.double(), splits([3, 3]), w.double())
    torch.testing.assert_close(mt.grouped_linear(x.bfloat16(), splits([3, 3]), w.bfloat16()),
                               mt.grouped_linear(x, splits([3, 3]), w).bfloat16(),
                               atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match=r"grouped_linear dgrad: weight.shape=\[3, 3, 4\] must be "
                                         r"\[G, out, in\] = \[2, 3, 4\]"):
        torch.ops.meshla.grouped_mm_dgrad(torch.randn(6, 3), splits([3, 3]), torch.randn(3, 3, 4))
    # Operands of the wrong rank reach the same checks before any output is made of their sizes.
    with pytest.raises(ValueError, match=r"grouped_linear wgrad: dy.shape=\[6\] must be 2-D"):
        torch.ops.meshla.grouped_mm_wgrad(x, torch.randn(6), splits([3, 3]), 16)
    with pytest.raises(ValueError, match=r"m_splits.shape=\[\]: meshla takes arrays of 1 to 4"):
        torch.ops.meshla.grouped_bias_grad(torch.randn(6, 3), torch.tensor(6), 1)
    layer = mt.GroupedLinear(2, 4, 3)
    with pytest.raises(ValueError, match=r"x.shape=\[6, 5\] must be \[rows, in_features=4\]"):
        layer(torch.randn(6, 5), splits([3, 3]))
    with pytest.raises(ValueError, match=r"m_splits.shape=\[3\] must be \[num_groups=2\]"):
        layer(x, splits([1, 2, 3]))


@pytest.mark.parametrize("delay", [False, True])
def test_frozen_experts_get_no_gradients(delay):
    torch.manual_seed(4)
    layer = mt.GroupedLinear(3, 4, 8, fuse_wgrad_accumulation=True, delay_wgrad_compute=delay)
    for p in layer.parameters():
        p.requires_grad_(False)  # no main_grad either: nothing may be accumulated
    x = torch.randn(6, 4, requires_grad=True)
    layer(x, splits([2, 0, 4])).sum().backward()
    assert x.grad is not None
    assert layer._delayed.pending == []
    assert all(p.grad is None for p in layer.parameters())

    # One expert trains: only it gets a gradient, here through .grad (no fused accumulation).
    layer = mt.GroupedLinear(2, 4, 8, delay_wgrad_compute=delay, dtype=torch.float32)
    layer.weights()[0].requires_grad_(False)
    layer.biases()[1].requires_grad_(False)
    x = torch.randn(7, 4, dtype=torch.float32)
    layer(x, splits([3, 4])).sum().backward()
    layer.backward_dw()
    assert layer.weights()[0].grad is None and layer.biases()[1].grad is None
    torch.testing.assert_close(layer.weights()[1].grad,
                               torch.ones(4, 8, dtype=torch.float32).T @ x[3:])
    torch.testing.assert_close(layer.biases()[0].grad, torch.full((8,), 3.0, dtype=torch.float32))


def test_double_backward_raises():
    x = torch.randn(5, 4, dtype=torch.float32, requires_grad=True)
    w = torch.randn(2, 3, 4, dtype=torch.float32, requires_grad=True)
    (dx,) = torch.autograd.grad(mt.grouped_linear(x, splits([2, 3]), w).sum(), x,
                                create_graph=True)
    with pytest.raises(RuntimeError):
        dx.sum().backward()


def test_empty_batch_backward():
    # An expert-parallel rank that got no tokens: every group empty.
    layer = mt.GroupedLinear(2, 8, 16, dtype=torch.float32)
    x = torch.randn(0, 8, dtype=torch.float32, requires_grad=True)
    layer(x, splits([0, 0])).sum().backward()
    assert x.grad.shape == (0, 8)
    assert all(torch.count_nonzero(w.grad) == 0 for w in layer.weights())
    assert all(torch.count_nonzero(b.grad) == 0 for b in layer.biases())


def test_dtype_mismatch_names_autocast():
    layer = mt.GroupedLinear(2, 4, 8)  # float32 weights
    x = torch.randn(5, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x is torch.bfloat16 but the weights are torch.float32"):
        layer(x, splits([2, 3]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="torch.autocast is on"):
            layer(x, splits([2, 3]))


def _on_gpu_0(t):
    """``t``'s metadata as the CUDA path's check would see it: the same array on cuda:0."""
    from meshla.torch._dtypes import meta
    return meta("t", t, device=0)


@pytest.mark.parametrize("case", ["float64", "weight groups", "bias dtype", "float sizes",
                                  "2-D sizes", "dgrad weight", "wgrad rows"])
def test_cpu_and_cuda_checks_say_the_same(case):
    """Each bad call on CPU tensors raises exactly what GroupedMatmul.run's checks raise for the
    same arrays on a GPU (the same check on their metadata, placed on cuda:0)."""
    from meshla import _meshla
    sizes = splits([3, 3])
    x, w, bias = torch.randn(6, 8), torch.randn(2, 16, 8), torch.randn(2, 16)
    grouped_pass = _meshla.GroupedPass.forward
    if case == "float64":
        x, w, bias = x.double(), w.double(), bias.double()
    elif case == "weight groups":
        w = torch.randn(3, 16, 8)
    elif case == "bias dtype":
        bias = bias.half()
    elif case == "float sizes":
        sizes = sizes.float()
    elif case == "2-D sizes":
        sizes = sizes[None]
    if case == "dgrad weight":
        grouped_pass, dy, w = _meshla.GroupedPass.dgrad, torch.randn(6, 16), torch.randn(2, 8, 8)
        call = lambda: torch.ops.meshla.grouped_mm_dgrad(dy, sizes, w)  # noqa: E731
        operands = dict(dy=dy, weight=w, dx=torch.empty(6, w.shape[2]))
    elif case == "wgrad rows":
        grouped_pass, dy = _meshla.GroupedPass.wgrad, torch.randn(5, 16)
        stride = mt.packed_group_stride(16, 8, torch.float32)
        call = lambda: torch.ops.meshla.grouped_mm_wgrad(x, dy, sizes, stride)  # noqa: E731
        dweight = torch.empty(2 * stride).as_strided((2, 16, 8), (stride, 8, 1))
        operands = dict(x=x, dy=dy, dweight=dweight)
    else:
        call = lambda: torch.ops.meshla.grouped_mm(x, sizes, w, bias)  # noqa: E731
        operands = dict(x=x, weight=w, bias=bias, y=torch.empty(6, w.shape[1], dtype=x.dtype))
    with pytest.raises(ValueError) as on_cpu:
        call()
    with pytest.raises(ValueError) as on_cuda:
        _meshla.check_grouped_call(grouped_pass, _on_gpu_0(sizes), **{
            name: None if t is None else _on_gpu_0(t) for name, t in operands.items()})
    assert str(on_cpu.value) == str(on_cuda.value)
