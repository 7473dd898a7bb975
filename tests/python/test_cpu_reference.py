"""The CPU path: every op on CPU tensors over a gloo group, against one process's float64 product.

Runs 2 and 4 ranks as processes, like a tensor-parallel job on a machine without GPUs.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import meshla.torch as mt


def _worker(rank, size, seed, dtype, results):
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        group = mt.group_from_process_group(device="cpu")
        assert group.comm is None and group.rank == rank and group.size == size
        # Every rank draws the same full problem and takes its slices of it.
        gen = torch.Generator().manual_seed(seed)
        m, k, n = 8 * size, 12 * size, 10
        a_full = torch.randn(m, k, generator=gen, dtype=torch.float64)
        b_full = torch.randn(k, n, generator=gen, dtype=torch.float64)
        bias = torch.randn(n, generator=gen, dtype=torch.float64)
        rows = slice(rank * m // size, (rank + 1) * m // size)
        cols = slice(rank * k // size, (rank + 1) * k // size)
        cast = lambda t: t.to(dtype)  # noqa: E731

        out, gathered = mt.all_gather_matmul(cast(a_full[rows]), cast(b_full), group,
                                             bias=cast(bias), return_gathered=True)
        weight = cast(b_full.t().contiguous())  # [n, k]: torch.nn.Linear layout
        ag_t = mt.all_gather_matmul(cast(a_full[rows]), weight, group, trans_b=True)
        rs = mt.matmul_reduce_scatter(cast(a_full[:, cols]), cast(b_full[cols]), group,
                                      bias=cast(bias))
        ar_out = torch.full((m, n), float("nan"), dtype=dtype)
        ar = mt.matmul_all_reduce(cast(a_full[:, cols]), cast(b_full[cols]), group,
                                  bias=cast(bias), algorithm="pipelined", out=ar_out)
        assert ar is ar_out
        results[rank] = {
            "ag": out.double(), "gathered": gathered.double(), "ag_t": ag_t.double(),
            "rs": rs.double(), "ar": ar.double(),
        }
        # The reference for everything: the whole product in float64 on one rank's inputs.
        a_ref, b_ref, bias_ref = (cast(t).double() for t in (a_full, b_full, bias))
        results[f"ref{rank}"] = {
            "product": a_ref @ b_ref + bias_ref, "plain": a_ref @ b_ref, "a": a_ref, "rows": rows,
        }
    finally:
        dist.destroy_process_group()


def _rel(x, y):
    return ((x - y).norm() / y.norm()).item()


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_every_op_matches_the_full_product(gloo_env, size, dtype, tol):
    results = mp.Manager().dict()
    seed = torch.randint(0, 2**31, ()).item()
    mp.spawn(_worker, args=(size, seed, dtype, results), nprocs=size, join=True)
    for rank in range(size):
        got, ref = results[rank], results[f"ref{rank}"]
        assert _rel(got["ag"], ref["product"]) < tol
        assert torch.equal(got["gathered"], ref["a"])
        assert _rel(got["ag_t"], ref["plain"]) < tol
        assert _rel(got["rs"], ref["product"][ref["rows"]]) < tol
        assert _rel(got["ar"], ref["product"]) < tol
