"""CPU tests of the fp8 tensor-parallel layers (ColumnParallelLinear / RowParallelLinear with
fp8="tensorwise" or "rowwise") on two gloo ranks: a column-parallel layer followed by a
row-parallel one, with and without sequence parallelism, its output and every parameter's and
the input's gradient against float64 autograd over the unsharded layers, within what fp8 rounding
allows. The CUDA path is checked by tests/gpu/check_collective_matmul.py's fp8-layers family."""

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import meshla.torch as mt

HIDDEN, INNER, TOKENS = 64, 128, 32


def rounding_bound(*mantissa_bits: int) -> float:
    """Twice the RMS relative error of one product of operands rounded to these mantissa widths:
    each rounding errs by up to 2^-(p+1) relative, uniformly, so by 2^-(p+1)/sqrt(3) in RMS, and
    independent errors add in quadrature. A Frobenius-norm error averages over many elements, so
    it stays near the RMS; a wrong product (a missing sum, a transposed weight, a scale applied
    to another rank's rows, which are 10x larger here) errs by ~1 or more."""
    return 2 * math.sqrt(sum(4.0 ** -(p + 1) for p in mantissa_bits)) / math.sqrt(3)


# Every checked value is two fp8 GEMMs deep (the output, and each gradient): twice one's bound.
FORWARD_BOUND = 2 * rounding_bound(3, 3)  # e4m3 x e4m3
GRADIENT_BOUND = 2 * rounding_bound(2, 3)  # e5m2 gradients x e4m3


def relative_error(got, want) -> float:
    return float((got.double() - want).norm() / want.norm())


def _worker(rank: int, size: int, recipe: str, sequence_parallel: bool):
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        group = mt.group_from_process_group(device="cpu")
        torch.manual_seed(0)  # every rank draws the same whole layers and inputs
        up = torch.nn.Linear(HIDDEN, INNER, dtype=torch.float64)
        down = torch.nn.Linear(INNER, HIDDEN, dtype=torch.float64)
        # The last rank's rows 10x larger: a tensorwise scale that is not the group's (a gathered
        # block read with its owner's scale, or another rank's) misreads them by 10x.
        last = slice((size - 1) * TOKENS // size, None)
        x = torch.randn(TOKENS, HIDDEN, dtype=torch.float64)
        grad_y = torch.randn(TOKENS, HIDDEN, dtype=torch.float64)
        x[last] *= 10
        grad_y[last] *= 10
        x64 = x.clone().requires_grad_()
        (down(torch.relu(up(x64))) * grad_y).sum().backward()

        options = dict(sequence_parallel=sequence_parallel, fp8=recipe)
        col = mt.ColumnParallelLinear.from_linear(copy.deepcopy(up).float(), group, **options)
        row = mt.RowParallelLinear.from_linear(copy.deepcopy(down).float(), group, **options)
        rows = slice(rank * TOKENS // size, (rank + 1) * TOKENS // size)
        x_mine = (x[rows] if sequence_parallel else x).float().requires_grad_()
        y = row(torch.relu(col(x_mine)))
        y_want = down(torch.relu(up(x))).detach()
        grad_mine = grad_y[rows] if sequence_parallel else grad_y
        assert y.dtype == torch.float32
        # Two fp8 GEMMs in a row: the second's input carries the first's error.
        assert relative_error(y, y_want[rows] if sequence_parallel else y_want) < FORWARD_BOUND
        (y * grad_mine.float()).sum().backward()

        inner = slice(rank * INNER // size, (rank + 1) * INNER // size)
        wants = {"x": (x_mine.grad, x64.grad[rows] if sequence_parallel else x64.grad),
                 "up.weight": (col.weight.grad, up.weight.grad[inner]),
                 "up.bias": (col.bias.grad, up.bias.grad[inner]),
                 "down.weight": (row.weight.grad, down.weight.grad[:, inner]),
                 "down.bias": (row.bias.grad, down.bias.grad)}
        for name, (got, want) in wants.items():
            error = relative_error(got, want)
            # Biases' gradients are sums of the 16-bit gradient, not fp8 products.
            bound = 1e-5 if name == "down.bias" else GRADIENT_BOUND
            assert error < bound, f"{recipe} sp={sequence_parallel} {name}: {error:.3e}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_mlp_matches_float64_within_fp8_rounding(gloo_env, recipe, sequence_parallel):
    mp.spawn(_worker, args=(2, recipe, sequence_parallel), nprocs=2, join=True)


def test_fp8_layer_errors_name_the_argument(world1):
    with pytest.raises(ValueError, match="fp8='e4m3' is not one of None, 'tensorwise', 'rowwise'"):
        mt.ColumnParallelLinear(16, 16, world1, fp8="e4m3", device="cpu")
    with pytest.raises(ValueError, match="recompute_gathered=True applies to 16-bit layers"):
        mt.ColumnParallelLinear(16, 16, world1, sequence_parallel=True, recompute_gathered=True,
                                fp8="rowwise", device="cpu")
    layer = mt.RowParallelLinear(16, 16, world1, fp8="tensorwise", device="cpu")
    with pytest.raises(ValueError, match=r"x.dtype=torch.float64 but the weight is torch.float32"):
        layer(torch.randn(4, 16, dtype=torch.float64))
    assert "fp8='tensorwise'" in repr(layer)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_layers_compile_whole(world1, recipe):
    """torch.compile(fullgraph=True) traces the fp8 layers' forward and backward (their
    quantization, the scaled collective ops and the local fp8 GEMM op) and computes what eager
    mode does."""
    torch.manual_seed(0)
    col = mt.ColumnParallelLinear(32, 64, world1, sequence_parallel=True, fp8=recipe,
                                  device="cpu")
    row = mt.RowParallelLinear(64, 32, world1, sequence_parallel=True, fp8=recipe, device="cpu")

    def mlp(x):
        return row(torch.relu(col(x)))

    x = torch.randn(16, 32)
    results = []
    for run in (mlp, torch.compile(mlp, backend="aot_eager", fullgraph=True)):
        xi = x.clone().requires_grad_()
        for p in (*col.parameters(), *row.parameters()):
            p.grad = None
        y = run(xi)
        y.square().sum().backward()
        results.append([y, xi.grad, col.weight.grad, row.weight.grad, col.bias.grad])
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scales", ["tensor", "rows", "columns"])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantized_rounds_within_fp8_and_keeps_zero_groups(dtype, scales, fp8):
    """The layers' cast: every value within the float8 dtype's rounding of its scale, nothing
    past its largest, an all-zero row or column (and a tiny float16 tensor) as exact as any
    other; the transposed bytes are q's transpose."""
    from meshla.torch._float8 import quantized

    t = (torch.randn(64, 128, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    t[3] = 0
    t[:, 5] = 0
    q, q_t, scale = quantized(t, fp8, scales, transposed=True)
    count = {"tensor": 1, "rows": 64, "columns": 128}[scales]
    assert q.dtype == q_t.dtype == fp8 and q.is_contiguous() and q_t.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (count,)
    assert torch.equal(q_t.float(), q.float().t())
    shaped = scale.reshape(-1, 1) if scales == "rows" else scale
    back = q.float() * shaped
    mantissa = 3 if fp8 == torch.float8_e4m3fn else 2
    # half an ulp of the largest binade relative to each group's amax (the product is rounded
    # once to float32, then to the float8 dtype)
    magnitude = t.float().abs()
    amax = (magnitude.amax() if scales == "tensor" else
            magnitude.amax(dim=1, keepdim=True) if scales == "rows" else magnitude.amax(dim=0))
    assert ((back - t.float()).abs() <= amax * 2.0 ** -(mantissa + 1)).all()
    assert torch.equal(back[3], torch.zeros(128)) and torch.equal(back[:, 5], torch.zeros(64))
    assert q.float().abs().max() <= torch.finfo(fp8).max
    only_t = quantized(t, fp8, scales, q=False, transposed=True)
    assert only_t[0] is None and torch.equal(only_t[1].float(), q_t.float())
    tiny = torch.full((4, 8), 1e-5, dtype=dtype)
    q, _, scale = quantized(tiny, fp8, scales)
    back = q.float() * (scale.reshape(-1, 1) if scales == "rows" else scale)
    assert torch.allclose(back, tiny.float(), rtol=2.0 ** -mantissa)


def _frozen_input_worker(rank: int, size: int):
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        group = mt.group_from_process_group(device="cpu")
        for recipe in ("tensorwise", "rowwise"):
            for sp in (False, True):
                grads = []
                for x_trains in (True, False):
                    torch.manual_seed(0)
                    col = mt.ColumnParallelLinear(32, 64, group, sequence_parallel=sp, fp8=recipe,
                                                  device="cpu")
                    row = mt.RowParallelLinear(64, 32, group, sequence_parallel=sp, fp8=recipe,
                                               device="cpu")
                    torch.manual_seed(1 + rank if sp else 1)
                    x = torch.randn(16, 32).requires_grad_(x_trains)
                    row(torch.relu(col(x))).square().sum().backward()
                    grads.append([p.grad for p in (*col.parameters(), *row.parameters())])
                for with_x, without_x in zip(*grads):
                    assert torch.equal(with_x, without_x), (recipe, sp)
    finally:
        dist.destroy_process_group()


def test_weight_gradients_do_not_depend_on_the_input_training(gloo_env):
    """A frozen input (no input gradient asked for) skips the casts only that gradient needs;
    every weight's and bias's gradient stays exactly what it is when the input trains."""
    mp.spawn(_frozen_input_worker, args=(2,), nprocs=2, join=True)
