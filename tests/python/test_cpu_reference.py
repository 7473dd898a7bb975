"""The CPU path: every op on CPU tensors over a gloo group, against one process's float64 product.

Runs 2 and 4 ranks as processes, like a tensor-parallel job on a machine without GPUs.
"""

import itertools

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


def _draw_problem(seed, size):
    """Every rank's inputs and its loss weights, as one process draws them (float32)."""
    gen = torch.Generator().manual_seed(seed)
    m, k, n = 4 * size, 6 * size, 5
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return {
        "x": randn(m, k),                                      # AG: the whole input
        "w_cols": [randn(k, n) for _ in range(size)],          # AG: each rank's column shard
        "bias_cols": [randn(n) for _ in range(size)],
        "w": randn(k, n), "bias": randn(n),                    # RS and AR: the whole weight
        "g_ag": [randn(m, n) for _ in range(size)],            # each rank's loss weights
        "g_rs": [randn(m // size, n) for _ in range(size)],
        "g_ar": randn(m, n),                                    # AR: the same loss on every rank
        "m": m, "k": k,
    }


# Which of (a, b, bias) need gradients in the reduce-scatter cases with frozen inputs.
FROZEN_RS = ((False, True, True), (True, False, False), (False, False, True))


def _grads(loss, inputs):
    return [g.detach() for g in torch.autograd.grad(loss, inputs)]


def _grad_worker(rank, size, seed, results):
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        group = mt.group_from_process_group(device="cpu")
        p = _draw_problem(seed, size)
        m, k = p["m"], p["k"]
        rows = slice(rank * m // size, (rank + 1) * m // size)
        cols = slice(rank * k // size, (rank + 1) * k // size)
        leaf = lambda t: t.clone().requires_grad_()  # noqa: E731
        for trans_b in (False, True):
            as_b = lambda w: w.t().contiguous() if trans_b else w  # [n, k]  # noqa: E731
            got = {}
            for recompute in (False, True):  # b's gradient from kept or re-gathered rows
                x, w = leaf(p["x"][rows]), leaf(as_b(p["w_cols"][rank]))
                bias = leaf(p["bias_cols"][rank])
                y = mt.all_gather_matmul(x, w, group, bias=bias, trans_b=trans_b,
                                         recompute_gathered=recompute)
                # The rows kept for b's gradient: all of them, or this rank's only.
                got[("kept", recompute)] = tuple(y.grad_fn.saved_tensors[0].shape)
                got[("ag", recompute)] = _grads((y * p["g_ag"][rank]).sum(), [x, w, bias])

            # Column-parallel without sequence parallelism: the whole x on every rank.
            x, w = leaf(p["x"]), leaf(as_b(p["w_cols"][rank]))
            bias = leaf(p["bias_cols"][rank])
            y = mt.column_parallel_matmul(x, w, group, bias=bias, trans_b=trans_b)
            got["cp"] = _grads((y * p["g_ag"][rank]).sum(), [x, w, bias])

            a, w, bias = leaf(p["x"][:, cols]), leaf(as_b(p["w"][cols])), leaf(p["bias"])
            z = mt.matmul_reduce_scatter(a, w, group, bias=bias, trans_b=trans_b)
            got["rs"] = _grads((z * p["g_rs"][rank]).sum(), [a, w, bias])
            # Some inputs frozen: the output's gradient all-gathered plainly (a frozen), or not
            # kept (only a trains).
            for needs in FROZEN_RS:
                tensors = [p["x"][:, cols], as_b(p["w"][cols]), p["bias"]]
                inputs = [t.clone().requires_grad_(need) for t, need in zip(tensors, needs)]
                z = mt.matmul_reduce_scatter(inputs[0], inputs[1], group, bias=inputs[2],
                                             trans_b=trans_b)
                grads = iter(_grads((z * p["g_rs"][rank]).sum(),
                                    [t for t in inputs if t.requires_grad]))
                got[("rs", needs)] = [next(grads) if need else None for need in needs]

            a, w, bias = leaf(p["x"][:, cols]), leaf(as_b(p["w"][cols])), leaf(p["bias"])
            z = mt.matmul_all_reduce(a, w, group, bias=bias, trans_b=trans_b)
            got["ar"] = _grads((z * p["g_ar"]).sum(), [a, w, bias])
            results[(rank, trans_b)] = got
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 4])
def test_gradients_are_those_of_the_whole_computation(gloo_env, size):
    """Each rank's float32 gradients against one process's float64 autograd over the whole
    tensor-parallel computation: all-gather's backward reduce-scatters, reduce-scatter's
    all-gathers (so the weight's and the bias's gradients are complete), all-reduce's passes its
    gradient on, and the column-parallel matmul's all-reduces its input gradient."""
    results = mp.Manager().dict()
    seed = torch.randint(0, 2**31, ()).item()
    mp.spawn(_grad_worker, args=(size, seed, results), nprocs=size, join=True)
    p = _draw_problem(seed, size)
    m, k = p["m"], p["k"]
    leaf = lambda t: t.double().requires_grad_()  # noqa: E731

    # AG: every rank's column shard of y = x @ W + bias; the loss sums every rank's.
    x = leaf(p["x"])
    ws, biases = [leaf(w) for w in p["w_cols"]], [leaf(b) for b in p["bias_cols"]]
    loss = sum(((x @ w + b) * g.double()).sum() for w, b, g in zip(ws, biases, p["g_ag"]))
    ag = _grads(loss, [x, *ws, *biases])
    # RS and AR: the whole row-parallel product; RS's loss sums every rank's rows.
    a, w, bias = leaf(p["x"]), leaf(p["w"]), leaf(p["bias"])
    out = a @ w + bias
    loss = sum((out[r * m // size:(r + 1) * m // size] * p["g_rs"][r].double()).sum()
               for r in range(size))
    rs = _grads(loss, [a, w, bias])
    ar = _grads(((a @ w + bias) * p["g_ar"].double()).sum(), [a, w, bias])

    for rank, trans_b in itertools.product(range(size), (False, True)):
        as_b = lambda g: g.t() if trans_b else g  # noqa: E731
        rows = slice(rank * m // size, (rank + 1) * m // size)
        cols = slice(rank * k // size, (rank + 1) * k // size)
        got = results[(rank, trans_b)]
        want = {
            ("ag", False): [ag[0][rows], as_b(ag[1 + rank]), ag[1 + size + rank]],
            ("ag", True): [ag[0][rows], as_b(ag[1 + rank]), ag[1 + size + rank]],
            "cp": [ag[0], as_b(ag[1 + rank]), ag[1 + size + rank]],
            "rs": [rs[0][:, cols], as_b(rs[1][cols]), rs[2]],
            **{("rs", needs): [e if need else None for e, need in
                               zip([rs[0][:, cols], as_b(rs[1][cols]), rs[2]], needs)]
               for needs in FROZEN_RS},
            "ar": [ar[0][:, cols], as_b(ar[1][cols]), ar[2]],
        }
        assert got[("kept", False)] == (m, k) and got[("kept", True)] == (m // size, k)
        for op, expected in want.items():
            for name, g, e in zip(("a", "b", "bias"), got[op], expected):
                case = (op, name, rank, trans_b, seed)
                if e is None:  # a frozen input
                    assert g is None, case
                    continue
                assert g.shape == e.shape, case
                assert _rel(g.double(), e) < 1e-5, (*case, _rel(g.double(), e))


def test_outputs_may_not_alias_inputs_or_each_other(world1):
    """As on CUDA (collective/validation.cpp): the reference refuses an output that shares memory
    with an input or with the other output, which it would overwrite before delivering."""
    a, b = torch.randn(4, 6), torch.randn(6, 6)
    buffer = torch.empty(4, 6)
    with pytest.raises(ValueError, match="all_gather_matmul: out and gathered share memory"):
        mt.all_gather_matmul(a, b, world1, return_gathered=True, out=buffer,
                             gathered_out=buffer)
    with pytest.raises(ValueError, match="matmul_all_reduce: out shares memory with the input a"):
        mt.matmul_all_reduce(a, torch.randn(6, 6), world1, out=a)
    with pytest.raises(ValueError, match="matmul_reduce_scatter: out shares memory with the input "
                                         "b"):
        square = torch.randn(4, 4)
        mt.matmul_reduce_scatter(a[:, :4], square, world1, out=square)
    out, gathered = mt.all_gather_matmul(a, b, world1, return_gathered=True,
                                         out=torch.empty(4, 6), gathered_out=torch.empty(4, 6))
    torch.testing.assert_close(out, a @ b)
    torch.testing.assert_close(gathered, a)
