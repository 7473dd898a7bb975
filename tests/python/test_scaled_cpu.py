"""CPU tests of meshla.torch's float8 collective matmuls (all_gather_scaled_matmul,
scaled_matmul_reduce_scatter, scaled_matmul_all_reduce): the reference path on two gloo ranks
against a float64 product of the dequantized operands of every rank, for tensorwise and rowwise
scales, and their errors. The CUDA plans are checked by tests/gpu/check_collective_matmul.py's
fp8 family."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import meshla.torch as mt

FP8 = torch.float8_e4m3fn


def operands(rank: int, rows: int, k: int, n: int, rowwise: bool):
    """Rank `rank`'s fp8 a [rows, k] and b [n, k] with their float32 scales, from its own seed."""
    gen = torch.Generator().manual_seed(100 + rank)
    a = (torch.randn(rows, k, generator=gen) * 4).to(FP8)
    b = (torch.randn(n, k, generator=gen) * 4).to(FP8)
    a_scale = torch.rand(rows if rowwise else 1, generator=gen) + 0.5
    b_scale = torch.rand(n if rowwise else 1, generator=gen) + 0.5
    return a, b, a_scale, b_scale


def dequantized(t, scale):
    return t.double() * (scale.double().reshape(-1, 1) if scale.numel() > 1 else scale.double())


def _worker(rank: int, size: int, rowwise: bool):
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        group = mt.group_from_process_group(device="cpu")
        rows, k, n = 6, 32, 16
        mine = operands(rank, rows, k, n, rowwise)
        everyone = [operands(r, rows, k, n, rowwise) for r in range(size)]
        bias = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)

        # all-gather: a's rows from every rank, this rank's b; a tensorwise a_scale is the
        # whole gathered a's, the same on every rank.
        if not rowwise:
            mine = (mine[0], mine[1], everyone[0][2], mine[3])
            everyone = [(a, b, everyone[0][2], sb) for a, b, _, sb in everyone]
        gathered = torch.cat([dequantized(a, s) for a, _, s, _ in everyone])
        want = gathered @ dequantized(mine[1], mine[3]).T + bias.double()
        if rowwise:  # the gathered rows would come without their scales: not returned
            got = mt.all_gather_scaled_matmul(*mine, group, bias=bias)
        else:
            got, gathered_a = mt.all_gather_scaled_matmul(*mine, group, bias=bias,
                                                          return_gathered=True)
            assert torch.equal(gathered_a.view(torch.uint8),
                               torch.cat([a for a, _, _, _ in everyone]).view(torch.uint8))
        assert got.dtype == torch.bfloat16 and got.shape == (rows * size, n)
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-1)

        # reductions: each rank's own scales, its own rows
        mine = operands(rank, rows, k, n, rowwise)
        everyone = [operands(r, rows, k, n, rowwise) for r in range(size)]
        # the sum over ranks of each rank's product (a float32 product takes no
        # bias, as fp8 GEMMs into float32 take none; a bfloat16 one adds it once).
        total = sum(dequantized(a, sa) @ dequantized(b, sb).T for a, b, sa, sb in everyone)
        got = mt.scaled_matmul_all_reduce(*mine, group, out_dtype=torch.float32)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), total, rtol=1e-5, atol=1e-4)
        got = mt.scaled_matmul_reduce_scatter(*mine, group, bias=bias)
        block = rows // size
        want = (total + bias.double())[rank * block:(rank + 1) * block]
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-1)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rowwise", [False, True])
def test_reference_on_two_ranks_matches_float64(gloo_env, rowwise):
    mp.spawn(_worker, args=(2, rowwise), nprocs=2, join=True)


def test_errors_name_the_scales_and_what_fp8_cannot_take(world1):
    a, b, a_scale, b_scale = operands(0, 4, 32, 16, rowwise=False)
    with pytest.raises(ValueError, match=r"matmul_all_reduce: a_scale.shape=\[1\] and "
                                         r"b_scale.shape=\[3\]: tensorwise scales"):
        mt.scaled_matmul_all_reduce(a, b, a_scale, torch.ones(3), world1)
    with pytest.raises(ValueError, match="a_scale.dtype=float64 but scales are float32"):
        mt.scaled_matmul_all_reduce(a, b, a_scale.double(), b_scale, world1)
    with pytest.raises(NotImplementedError,
                       match="algorithm=ring on backend=nccl adds each rank's partial sum"):
        mt.scaled_matmul_reduce_scatter(a, b, a_scale, b_scale, world1, algorithm="ring",
                                        backend="nccl")
    with pytest.raises(ValueError, match="bias.dtype=float32 but out_dtype=bfloat16"):
        mt.scaled_matmul_all_reduce(a, b, a_scale, b_scale, world1, bias=torch.zeros(16))
    with pytest.raises(NotImplementedError, match="have no backward yet"):
        mt.scaled_matmul_all_reduce(a, b, a_scale.requires_grad_(), b_scale, world1)


def test_out_dtype_must_be_a_dtype_meshla_takes(world1):
    a, b, a_scale, b_scale = operands(0, 4, 32, 16, rowwise=False)
    with pytest.raises(ValueError, match="out_dtype=None is not a torch dtype meshla takes"):
        mt.scaled_matmul_all_reduce(a, b, a_scale, b_scale, world1, out_dtype=None)
    with pytest.raises(ValueError, match="a float8 product's d is bfloat16, float16 or float32, "
                                         "not int32"):
        mt.scaled_matmul_all_reduce(a, b, a_scale, b_scale, world1, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="b_scale must be a tensor, got NoneType"):
        mt.scaled_matmul_all_reduce(a, b, torch.ones(4), None, world1)


def _opcheck_worker(rank: int, size: int):
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        group = mt.group_from_process_group(device="cpu")
        tuning = mt.Tuning.of(algorithm="pipelined", chunks=2).ints()
        the_op = torch.ops.meshla.scaled_collective_matmul.default
        for rowwise in (False, True):
            # 16 rows: every pipelined GEMM starts at a multiple of 4 rows, as rowwise scales need
            a, b, a_scale, b_scale = operands(rank, 16, 32, 16, rowwise)
            a_scale = a_scale if rowwise else torch.ones(())  # a 0-d scale, as torch's are
            for op in range(3):
                bias = torch.randn(16).to(torch.bfloat16) if op != 1 else None
                # Not opcheck's schema test: it compares inputs with allclose, which CPU float8
                # tensors do not take.
                torch.library.opcheck(the_op, (a, b, a_scale, b_scale, bias, op, group.key,
                                               torch.bfloat16, op == 0 and not rowwise, tuning),
                                      test_utils=("test_faketensor",
                                                  "test_autograd_registration"))
    finally:
        dist.destroy_process_group()


def test_the_op_and_its_fake_agree(gloo_env):
    """torch.ops.meshla.scaled_collective_matmul's schema and fake agree with its kernel (the CPU
    path) on both ranks of a group of 2, for each op and scaling."""
    mp.spawn(_opcheck_worker, args=(2,), nprocs=2, join=True)


def test_compiles_whole(world1):
    a, b, a_scale, b_scale = operands(0, 4, 32, 16, rowwise=True)

    def f(a, b, a_scale, b_scale):
        return mt.scaled_matmul_all_reduce(a, b, a_scale, b_scale, world1).float().sum()

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(
        a, b, a_scale, b_scale), f(a, b, a_scale, b_scale))
