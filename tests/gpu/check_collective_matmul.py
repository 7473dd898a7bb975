"""GPU correctness checks of collective matmul, one JSON line per check and rank.

Two process models:
  torchrun --nproc-per-node=N tests/gpu/check_collective_matmul.py --results FILE
      one process per GPU; bootstrapped over a gloo process group (no NCCL bootstrap needed);
      with 4 ranks, also tp=2 groups inside the 4 ranks, both groups running at once.
  python tests/gpu/check_collective_matmul.py --threads --results FILE
      one process driving every visible GPU, one thread per GPU (Communicator.create_local; with
      4 GPUs also two tp=2 groups of the same process).
  torchrun --nproc-per-node=N tests/gpu/check_collective_matmul.py --cublasmp --results FILE
      the cuBLASMp backend alone, on the world group: cuBLASMp 0.7 starts NVSHMEM over the first
      group it meets, so one process serves one cuBLASMp group.

Every check draws fresh random inputs, poisons the outputs with NaN, runs the op and compares with
a float64 reference computed from the same (rounded) inputs: ||out - ref|| / ||ref|| under a
per-dtype threshold. tests/gpu/run.sh runs every model and prints "N passed, N failed".
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import ctypes
import faulthandler
import functools
import gc
import itertools
import os
import random
import subprocess
import sys
import threading
import time
import traceback
import weakref

import torch
import torch.distributed as dist

import meshla
import meshla.torch as mt
from meshla.torch import _collective_ops as collective_ops
from meshla.torch._dtypes import DTYPES
from reporting import Reporter, check_parser, relative_error

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
# Which of (a, b, bias) need gradients in the reduce-scatter's autograd cases with frozen inputs.
FROZEN_RS = ((False, True, True), (True, False, False), (False, False, True))
OPS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
# (backend, algorithm, comm_ctas): every NCCL algorithm, the NCCL ring on its own communicator
# limited to 8 thread blocks, the symmetric backend, and meshla's own choice.
SETTINGS = [("nccl", "sequential", 0), ("nccl", "pipelined", 0), ("nccl", "ring", 0),
            ("nccl", "ring", 8), ("symmetric", "ring", 0), ("auto", "auto", 0)]


class Problem:
    """One op's full inputs, identical on every rank of the group (same seed), and its slices."""

    def __init__(self, op, group, dtype, m, n, k, seed, trans_b, bias):
        device = group.device
        gen = torch.Generator(device=device).manual_seed(seed)
        tp, r = group.size, group.rank
        # Full problem: x [m, k_total] @ w [k_total, n]; AG shards x's rows, RS/AR shard k.
        k_total = k if op == "all_gather_matmul" else k * tp
        x = torch.randn(m, k_total, generator=gen, device=device).to(dtype)
        w = (torch.randn(k_total, n, generator=gen, device=device) / k_total**0.5).to(dtype)
        b = torch.randn(n, generator=gen, device=device).to(dtype) if bias else None
        block = m // tp
        if op == "all_gather_matmul":
            self.a, self.w_local = x[r * block:(r + 1) * block].contiguous(), w
        else:
            self.a, self.w_local = x[:, r * k:(r + 1) * k].contiguous(), w[r * k:(r + 1) * k]
        self.b = self.w_local.t().contiguous() if trans_b else self.w_local.contiguous()
        self.bias = b
        ref = x.double() @ w.double()
        if b is not None:
            ref += b.double()
        self.ref = ref[r * block:(r + 1) * block] if op == "matmul_reduce_scatter" else ref
        self.x = x
        out_rows = block if op == "matmul_reduce_scatter" else m
        self.out = torch.full((out_rows, n), float("nan"), dtype=dtype, device=device)
        self.gathered = torch.full((m, k), float("nan"), dtype=dtype, device=device)


def run_op(op, problem, group, algorithm, trans_b, chunks=0, comm_ctas=0, backend="auto"):
    kwargs = dict(bias=problem.bias, trans_b=trans_b, algorithm=algorithm, chunks=chunks,
                  comm_ctas=comm_ctas, backend=backend, out=problem.out)
    if op == "all_gather_matmul":
        return mt.all_gather_matmul(problem.a, problem.b, group, return_gathered=True,
                                    gathered_out=problem.gathered, **kwargs)
    return getattr(mt, op)(problem.a, problem.b, group, **kwargs)


def plan_of(group, op, dtype, m, n, k, trans_b, bias, return_gathered, tuning=None):
    """The group's plan for a call of these shapes (built now, collectively, if it is new)."""
    t = tuning or mt.Tuning.of()
    config = meshla._meshla.CollectiveMatmulConfig(
        op, DTYPES[dtype], m, n, k, trans_b, bias, return_gathered, t.algorithm, t.backend,
        t.chunks, t.comm_sms, t.comm_ctas)
    return group.plan(config)


def expected_auto_backend(group):
    """What backend="auto" must pick on this group: "symmetric" from two ranks up where peer
    transfers are on and every pair of this process's visible GPUs is linked by NVLink, as NVML
    says when asked here directly (ctypes, not meshla's code); "nccl" where no pair is or peer
    transfers are off; None (not asserted) on a mixed topology, where it depends on the group's
    GPUs, which a rank of another process does not know."""
    if group.size < 2 or os.environ.get("NCCL_P2P_DISABLE") == "1":
        return "nccl"
    linked = visible_gpu_pairs_on_nvlink()
    return "symmetric" if all(linked) else "nccl" if not any(linked) else None


@functools.cache
def visible_gpu_pairs_on_nvlink():
    """For each pair of this process's GPUs, whether NVML reports NVLink between them (asked once:
    the checks ask for every auto case)."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    assert nvml.nvmlInit_v2() == 0
    handles = []
    for device in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(device)
        bus_id = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0".encode()
        handle = ctypes.c_void_p()
        assert nvml.nvmlDeviceGetHandleByPciBusId_v2(bus_id, ctypes.byref(handle)) == 0, bus_id
        handles.append(handle)
    linked = []
    for first, second in itertools.combinations(handles, 2):
        status = ctypes.c_int(-1)
        nvlink = 2  # NVML_P2P_CAPS_INDEX_NVLINK; status 0 is NVML_P2P_STATUS_OK
        assert nvml.nvmlDeviceGetP2PStatus(first, second, nvlink, ctypes.byref(status)) == 0
        linked.append(status.value == 0)
    return tuple(linked)


def chunks_for(op, backend, algorithm):
    """Uneven NCCL chunks (200 rows per rank, 3 chunks); four symmetric rounds of 50 rows."""
    if backend == "symmetric":
        return 0 if op == "all_gather_matmul" else 4
    return 3 if algorithm in ("pipelined", "ring") else 0


def check_symmetric_refused(group, reporter, name, op, dtype, seed):
    """With peer transfers disabled, asking for the symmetric backend is a clear error."""
    try:
        p = Problem(op, group, dtype, 64 * group.size, 64, 64, seed, False, False)
        run_op(op, p, group, "ring", False, backend="symmetric")
        ok, detail = False, "no error although NCCL_P2P_DISABLE=1"
    except NotImplementedError as e:
        ok, detail = "NCCL_P2P_DISABLE" in str(e), f"refused: {e}"
    reporter.record(name + "/refused", group.rank, ok, detail)


def check_correctness(group, reporter, label, seed_base, dtypes=(torch.bfloat16, torch.float32)):
    """Every op x backend x algorithm x dtype, with uneven chunking, bias and trans_b variants."""
    case = 0
    for dtype in dtypes:
        for op in OPS:
            for backend, algorithm, comm_ctas in SETTINGS:
                case += 1
                trans_b = case % 2 == 0
                bias = case % 3 != 0
                m, n, k = 200 * group.size, 384, 256
                chunks = chunks_for(op, backend, algorithm)
                name = (f"{label}/{op}/{backend}/{algorithm}/{str(dtype)[6:]}"
                        f"/trans_b={int(trans_b)}/bias={int(bias)}/comm_ctas={comm_ctas}")
                if backend == "symmetric" and os.environ.get("NCCL_P2P_DISABLE") == "1":
                    check_symmetric_refused(group, reporter, name, op, dtype, seed_base + case)
                    continue
                try:
                    p = Problem(op, group, dtype, m, n, k, seed_base + case, trans_b, bias)
                    result = run_op(op, p, group, algorithm, trans_b, chunks, comm_ctas, backend)
                    out = result[0] if op == "all_gather_matmul" else result
                    torch.cuda.synchronize(group.device)
                    err = relative_error(out, p.ref)
                    ok = err < TOLERANCE[dtype]
                    detail = f"rel_err={err:.2e}"
                    if op == "all_gather_matmul":
                        ok = ok and torch.equal(result[1], p.x)
                        detail += f" gathered_exact={torch.equal(result[1], p.x)}"
                    if backend == "auto":
                        want = expected_auto_backend(group)
                        picked = plan_of(group, getattr(meshla.CollectiveOp, op), dtype, m, n,
                                         k, trans_b, bias,
                                         op == "all_gather_matmul").config.backend.name
                        ok = ok and want in (picked, None)
                        detail += f" picked={picked} expected={want}"
                except Exception as e:  # a check that raises is a failed check, not a crash
                    ok, detail = False, f"{type(e).__name__}: {e}"
                reporter.record(name, group.rank, ok, detail)


# fp8 products into float32 keep what Hopper's fp8 accumulator keeps (13 fraction bits).
FP8_TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 4 * 2.0**-13}


def check_fp8(group, reporter, label, seed_base):
    """The float8 ops (all_gather_scaled_matmul, scaled_matmul_reduce_scatter,
    scaled_matmul_all_reduce) x tensorwise and rowwise scales x the nccl algorithms that take
    fp8, the symmetric backend (two rounds for the reductions; not where peer transfers are off,
    whose refusal the correctness family checks) and auto x bfloat16 and float32 outputs,
    against a float64 product of the dequantized operands of every rank (each rank draws every
    rank's inputs from their seeds). The ops make their outputs,
    so each case runs twice on fresh inputs: an output left unwritten keeps the first run's
    values and fails the second."""
    fp8 = torch.float8_e4m3fn
    tp, r, dev = group.size, group.rank, group.device
    rows, n, k = 256, 384, 256
    ops = {"all_gather_matmul": mt.all_gather_scaled_matmul,
           "matmul_reduce_scatter": mt.scaled_matmul_reduce_scatter,
           "matmul_all_reduce": mt.scaled_matmul_all_reduce}

    def draw(seed, rank, a_rows, rowwise):
        gen = torch.Generator(device=dev).manual_seed(seed * 16 + rank)
        a = (torch.randn(a_rows, k, generator=gen, device=dev) * 2).to(fp8)
        b = (torch.randn(n, k, generator=gen, device=dev) * 2).to(fp8)
        a_scale = torch.rand(a_rows if rowwise else 1, generator=gen, device=dev) + 0.5
        b_scale = torch.rand(n if rowwise else 1, generator=gen, device=dev) / k**0.5 + 0.01
        return a, b, a_scale, b_scale

    def dequantized(t, scale):
        return t.double() * (scale.double().reshape(-1, 1) if scale.numel() > 1
                             else scale.double())

    settings = (("nccl", "sequential"), ("nccl", "pipelined"), ("nccl", "auto"),
                ("symmetric", "ring"), ("auto", "auto"))
    case = 0
    for op, call in ops.items():
        gathers = op == "all_gather_matmul"
        for rowwise in (False, True):
            for backend, algorithm in settings:
                if backend == "symmetric" and os.environ.get("NCCL_P2P_DISABLE") == "1":
                    continue
                chunks = 2 if backend == "symmetric" and not gathers else 0
                for out_dtype in (torch.bfloat16, torch.float32):
                    case += 1
                    bias_wanted = out_dtype == torch.bfloat16  # fp8 into float32 takes none
                    name = (f"{label}/fp8/{op}/{'rowwise' if rowwise else 'tensorwise'}/"
                            f"{backend}/{algorithm}/{str(out_dtype)[6:]}/bias={int(bias_wanted)}")
                    try:
                        errors = []
                        for run in range(2):
                            seed = seed_base + 10 * case + run
                            a_rows = rows if gathers else rows * tp
                            inputs = [draw(seed, q, a_rows, rowwise) for q in range(tp)]
                            if gathers and not rowwise:  # one scale for the whole gathered a
                                inputs = [(a, b, inputs[0][2], sb) for a, b, _, sb in inputs]
                            bias = (torch.randn(n, device=dev,
                                                generator=torch.Generator(device=dev)
                                                .manual_seed(seed)).to(out_dtype)
                                    if bias_wanted else None)
                            mine = inputs[r]
                            got = call(*mine, group, bias=bias, out_dtype=out_dtype,
                                       algorithm=algorithm, chunks=chunks, backend=backend)
                            if gathers:
                                want = torch.cat([dequantized(a, sa) for a, _, sa, _ in inputs])
                                want = want @ dequantized(mine[1], mine[3]).T
                            else:
                                want = sum(dequantized(a, sa) @ dequantized(b, sb).T
                                           for a, b, sa, sb in inputs)
                            if bias is not None:
                                want = want + bias.double()
                            if op == "matmul_reduce_scatter":
                                want = want[r * rows:(r + 1) * rows]
                            torch.cuda.synchronize(dev)
                            errors.append(relative_error(got, want))
                        ok = max(errors) < FP8_TOLERANCE[out_dtype] and got.dtype == out_dtype
                        detail = f"rel_err by run {[f'{e:.2e}' for e in errors]}"
                    except Exception as e:  # a check that raises is a failed check
                        ok, detail = False, f"{type(e).__name__}: {e}"
                    reporter.record(name, group.rank, ok, detail)

    check_fp8_layers(group, reporter, label, seed_base + 5_000)


def fp8_rounding_bound(*mantissa_bits: int) -> float:
    """Twice the RMS relative error of one product of operands rounded to these mantissa widths
    (each rounding errs by up to 2^-(p+1), uniformly: 2^-(p+1)/sqrt(3) in RMS; independent errors
    add in quadrature). A Frobenius-norm error stays near the RMS; a wrong product errs by ~1."""
    return 2 * sum(4.0 ** -(p + 1) for p in mantissa_bits) ** 0.5 / 3 ** 0.5


def check_fp8_layers(group, reporter, label, seed_base):
    """ColumnParallelLinear -> ReLU -> RowParallelLinear with fp8="tensorwise" and "rowwise",
    with and without sequence parallelism, bfloat16 parameters: the output and the input's, the
    weights' and the biases' gradients against float64 autograd over the unsharded layers drawn
    identically on every rank (the last rank's rows of x and of y's gradient 10x larger, so that
    a scale applied to another rank's rows fails), within twice fp8 rounding's RMS bound per fp8
    stage (e4m3 forward, e5m2 gradients); one case adds the weights' gradients to a float32
    main_grad (fuse_wgrad_accumulation), checked as the buffer's start plus the gradient. Each
    case runs twice on fresh inputs. Two cases run the pair compiled into CUDA graphs
    (torch.compile's mode="reduce-overhead"; where one thread drives the group, as check_layers
    does), checked on a replay: two steps on other inputs first, their gradients dropped."""
    tp, r, dev = group.size, group.rank, group.device
    hidden, inner, tokens = 256, 512, 128 * tp
    forward_bound = 2 * fp8_rounding_bound(3, 3)  # two fp8 GEMMs deep, as the gradients
    gradient_bound = 2 * fp8_rounding_bound(2, 3)
    cases = [(recipe, sp, False, None) for recipe in ("tensorwise", "rowwise")
             for sp in (False, True)]
    cases.append(("tensorwise", True, True, None))
    if threading.current_thread() is threading.main_thread():
        cases += [(recipe, True, False, "reduce-overhead") for recipe in ("tensorwise", "rowwise")]
    for index, (recipe, sp, fused, mode) in enumerate(cases):
        name = (f"{label}/fp8-layers/{recipe}/sp={int(sp)}/fused_wgrad={int(fused)}"
                + (f"/compiled={mode}" if mode else ""))
        try:
            errors = {}
            for run in range(2):
                gen = torch.Generator(device=dev).manual_seed(seed_base + 10 * index + run)
                up = torch.nn.Linear(hidden, inner, device=dev, dtype=torch.float64)
                down = torch.nn.Linear(inner, hidden, device=dev, dtype=torch.float64)
                with torch.no_grad():
                    for p in (*up.parameters(), *down.parameters()):
                        p.copy_(torch.randn(p.shape, generator=gen, device=dev,
                                            dtype=torch.float64) / hidden ** 0.5)
                        p.copy_(p.bfloat16().double())  # the layers' own bfloat16 values
                x = torch.randn(tokens, hidden, generator=gen, device=dev, dtype=torch.float64)
                grad_y = torch.randn(tokens, hidden, generator=gen, device=dev,
                                     dtype=torch.float64)
                # The last rank's rows 10x larger: a tensorwise scale that is not the group's
                # misreads them (or the others) by 10x.
                x[(tp - 1) * tokens // tp:] *= 10
                grad_y[(tp - 1) * tokens // tp:] *= 10
                x = x.bfloat16().double().requires_grad_()
                y_want = down(torch.relu(up(x)))
                (y_want * grad_y).sum().backward()
                options = dict(sequence_parallel=sp, fp8=recipe, fuse_wgrad_accumulation=fused)
                col = mt.ColumnParallelLinear.from_linear(copy.deepcopy(up).bfloat16(), group,
                                                          **options)
                row = mt.RowParallelLinear.from_linear(copy.deepcopy(down).bfloat16(), group,
                                                       **options)
                starts = {}
                for layer in (col, row) if fused else ():
                    start = torch.randn(layer.weight.shape, generator=gen, device=dev)
                    layer.weight.main_grad = start.clone()
                    starts[layer] = start
                rows = slice(r * tokens // tp, (r + 1) * tokens // tp) if sp else slice(None)
                x_mine = x.detach()[rows].bfloat16().requires_grad_()

                def mlp(x):
                    return row(torch.relu(col(x)))

                if mode is not None:
                    torch._dynamo.reset()  # each case's closure would count as a recompile
                step = mlp if mode is None else torch.compile(mlp, fullgraph=True, mode=mode)
                # Recorded, then replayed below. Each step drops the last one's gradients, as a
                # training loop's zero_grad does: accumulating into a gradient that is a CUDA
                # graph's output reads memory the next replay has overwritten (torch refuses).
                for _ in range(2 if mode else 0):
                    torch.compiler.cudagraph_mark_step_begin()
                    other = torch.randn_like(x_mine).requires_grad_()
                    step(other).float().sum().backward()
                    for parameter in (*col.parameters(), *row.parameters()):
                        parameter.grad = None
                torch.compiler.cudagraph_mark_step_begin()
                y = step(x_mine)
                (y.double() * grad_y[rows]).sum().backward()
                shard = slice(r * inner // tp, (r + 1) * inner // tp)

                def weight_grad(layer):
                    if not fused:
                        return layer.weight.grad
                    return layer.weight.main_grad.double() - starts[layer].double()

                pairs = {"y": (y, y_want.detach()[rows], forward_bound),
                         "x": (x_mine.grad, x.grad[rows], gradient_bound),
                         "up.weight": (weight_grad(col), up.weight.grad[shard], gradient_bound),
                         "up.bias": (col.bias.grad, up.bias.grad[shard], gradient_bound),
                         "down.weight": (weight_grad(row), down.weight.grad[:, shard],
                                         gradient_bound),
                         # a sum of the bfloat16 gradient: bfloat16 rounding only
                         "down.bias": (row.bias.grad, down.bias.grad, 2.0 ** -7)}
                for key, (got, want, bound) in pairs.items():
                    error = relative_error(got, want)
                    errors[key] = max(errors.get(key, 0.0), error / bound)
            ok = max(errors.values()) < 1
            detail = "error / bound: " + ", ".join(f"{k} {v:.2f}" for k, v in errors.items())
        except Exception as e:  # a check that raises is a failed check
            ok, detail = False, f"{type(e).__name__}: {e}"
        reporter.record(name, group.rank, ok, detail)


def check_autograd(group, reporter, label, seed_base):
    """Every op's gradients (a, b, bias; bf16, fp32, and fp32 under a bf16 torch.autocast; each
    backend; b as [k, n] and [n, k]; all_gather_matmul keeping its gathered rows for b's gradient
    and gathering them again; the reduce-scatter with frozen inputs) against float64 autograd over
    the whole tensor-parallel computation, drawn identically on every rank: all-gather's backward
    reduce-scatters, reduce-scatter's all-gathers, all-reduce's passes the gradient on, the
    column-parallel matmul's all-reduces it (see meshla.torch's docstrings)."""
    tp, r = group.size, group.rank
    device = group.device
    settings = itertools.product(("bfloat16", "float32", "autocast"), ("nccl", "symmetric"),
                                 (False, True))
    for case, (precision, backend, trans_b) in enumerate(settings):
        name = f"{label}/autograd/{backend}/{precision}/trans_b={int(trans_b)}"
        # Under autocast the fp32 operands are cast to bf16: drawn as bf16 values, exactly.
        dtype = torch.float32 if precision == "float32" else torch.bfloat16
        leaf_dtype = torch.float32 if precision == "autocast" else dtype
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast")
        try:
            gen = torch.Generator(device=device).manual_seed(seed_base + case)
            m, k, n = 128 * tp, 64 * tp, 96
            rows = slice(r * m // tp, (r + 1) * m // tp)
            cols = slice(r * k // tp, (r + 1) * k // tp)

            def draw(*shape, scale=1.0):  # rounded to dtype, so the reference sees the same
                t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float64)
                return (t * scale).to(dtype).double()

            x, w, bias = draw(m, k), draw(k, n, scale=k**-0.5), draw(n)
            w_cols = [draw(k, n, scale=k**-0.5) for _ in range(tp)]
            bias_cols = [draw(n) for _ in range(tp)]
            g_ag, g_rs = [draw(m, n) for _ in range(tp)], [draw(m // tp, n) for _ in range(tp)]
            g_ar = draw(m, n)

            def as_b(t):  # b as the op takes it: [k, n], or [n, k] with trans_b
                return t.t() if trans_b else t

            def leaf(t):
                return t.to(leaf_dtype).contiguous().requires_grad_()

            def worst_error(got, want):
                return max(relative_error(g, w) for g, w in zip(got, want))

            # all_gather_matmul: rank s holds rows s of x and column shard s of the weight; the
            # loss sums every rank's.
            xs = x.clone().requires_grad_()
            wr, br = w_cols[r].clone().requires_grad_(), bias_cols[r].clone().requires_grad_()
            shards = [(wr, br) if s == r else (w_cols[s], bias_cols[s]) for s in range(tp)]
            loss = sum(((xs @ wc + bc) * g).sum() for (wc, bc), g in zip(shards, g_ag))
            dx, dw, dbias = torch.autograd.grad(loss, [xs, wr, br])
            worst, dtypes = 0.0, set()
            for recompute in (False, True):  # b's gradient from kept or re-gathered rows
                mine = [leaf(x[rows]), leaf(as_b(w_cols[r])), leaf(bias_cols[r])]
                with autocast:
                    y = mt.all_gather_matmul(*mine[:2], group, bias=mine[2], trans_b=trans_b,
                                             backend=backend, recompute_gathered=recompute)
                got = torch.autograd.grad((y.double() * g_ag[r]).sum(), mine)
                worst = max(worst, worst_error(got, [dx[rows], as_b(dw), dbias]))
                # The products in dtype, the gradients in the leaves' (fp32 under autocast).
                dtypes |= {y.dtype} | {g.dtype for g in got}
            # column_parallel_matmul: the whole x on every rank; its gradient all-reduced.
            mine = [leaf(x), leaf(as_b(w_cols[r])), leaf(bias_cols[r])]
            with autocast:
                y = mt.column_parallel_matmul(*mine[:2], group, bias=mine[2], trans_b=trans_b,
                                              backend=backend)
            got = torch.autograd.grad((y.double() * g_ag[r]).sum(), mine)
            worst = max(worst, worst_error(got, [dx, as_b(dw), dbias]))
            dtypes |= {y.dtype} | {g.dtype for g in got}
            # matmul_reduce_scatter and matmul_all_reduce: rank s holds column shard s of x and
            # row shard s of the weight; the bias is whole. The reduce-scatter's loss sums every
            # rank's rows; the all-reduce's is the same on every rank.
            for run in (mt.matmul_reduce_scatter, mt.matmul_all_reduce):
                all_reduce = run is mt.matmul_all_reduce
                inputs = [t.clone().requires_grad_() for t in (x, w, bias)]
                out = inputs[0] @ inputs[1] + inputs[2]
                loss = ((out * g_ar).sum() if all_reduce else
                        sum((out[s * m // tp:(s + 1) * m // tp] * g).sum()
                            for s, g in enumerate(g_rs)))
                dx, dw, dbias = torch.autograd.grad(loss, inputs)
                mine = [leaf(x[:, cols]), leaf(as_b(w[cols])), leaf(bias)]
                with autocast:
                    z = run(*mine[:2], group, bias=mine[2], trans_b=trans_b, backend=backend)
                mine_loss = (z.double() * (g_ar if all_reduce else g_rs[r])).sum()
                got = torch.autograd.grad(mine_loss, mine)
                worst = max(worst, worst_error(got, [dx[:, cols], as_b(dw[cols]), dbias]))
                dtypes |= {z.dtype} | {g.dtype for g in got}
                # Some inputs frozen: the reduce-scatter's backward all-gathers plainly (a
                # frozen) or keeps no gathered rows (only a trains).
                wanted = [dx[:, cols], as_b(dw[cols]), dbias]
                for needs in () if all_reduce else FROZEN_RS:
                    inputs = [leaf(t) if need else t.to(leaf_dtype)
                              for t, need in zip((x[:, cols], as_b(w[cols]), bias), needs)]
                    with autocast:
                        z = run(*inputs[:2], group, bias=inputs[2], trans_b=trans_b,
                                backend=backend)
                    trained = [t for t in inputs if t.requires_grad]
                    got = torch.autograd.grad((z.double() * g_rs[r]).sum(), trained)
                    worst = max(worst, worst_error(got, [e for e, need in zip(wanted, needs)
                                                         if need]))
            torch.cuda.synchronize(device)
            ok = worst < TOLERANCE[dtype] and dtypes == {dtype, leaf_dtype}
            detail = f"worst gradient rel_err={worst:.2e} dtypes={sorted(map(str, dtypes))}"
        except Exception as e:  # a check that raises is a failed check, not a crash
            ok, detail = False, f"{type(e).__name__}: {e}"
        reporter.record(name, r, ok, detail)


class MlpProblem:
    """A float64 torch.nn.Linear pair (fc1: hidden -> ffn, fc2: ffn -> hidden) with gelu between,
    its input x [s, b, h] and the loss weights g, all rounded to `dtype` and identical on every
    rank; the reference gradients `want` of (y * g).sum() for x, fc1's and fc2's weight and bias;
    and this rank's shard of each parameter (fc1's rows, fc2's columns, fc2's bias whole)."""

    def __init__(self, group, dtype, seed):
        tp, r, device = group.size, group.rank, group.device
        seq, batch, hidden, ffn = 32 * tp, 4, 128, 96 * tp
        self.own_seq = slice(r * seq // tp, (r + 1) * seq // tp)
        own_ffn = slice(r * ffn // tp, (r + 1) * ffn // tp)
        self.shards = (lambda t: t[own_ffn], lambda t: t[own_ffn], lambda t: t[:, own_ffn],
                       lambda t: t)
        gen = torch.Generator(device=device).manual_seed(seed)

        def draw(*shape, scale=1.0):  # rounded to dtype, so the reference sees the same
            t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float64)
            return (t * scale).to(dtype).double()

        self.fc1 = torch.nn.Linear(hidden, ffn, device=device, dtype=torch.float64)
        self.fc2 = torch.nn.Linear(ffn, hidden, device=device, dtype=torch.float64)
        with torch.no_grad():
            for layer in (self.fc1, self.fc2):
                layer.weight.copy_(draw(*layer.weight.shape, scale=layer.in_features**-0.5))
                layer.bias.copy_(draw(*layer.bias.shape))
        self.x, self.g = draw(seq, batch, hidden), draw(seq, batch, hidden)
        x_ref = self.x.clone().requires_grad_()
        self.y_ref = self.fc2(torch.nn.functional.gelu(self.fc1(x_ref)))
        params_ref = [self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias]
        self.want = torch.autograd.grad((self.y_ref * self.g).sum(), [x_ref, *params_ref])

    def layers(self, group, dtype, sp, recompute=False, **options):
        """This rank's ColumnParallelLinear and RowParallelLinear of the pair, in `dtype`."""
        column = mt.ColumnParallelLinear.from_linear(
            copy.deepcopy(self.fc1).to(dtype), group, sequence_parallel=sp,
            recompute_gathered=recompute, **options)
        row = mt.RowParallelLinear.from_linear(copy.deepcopy(self.fc2).to(dtype), group,
                                               sequence_parallel=sp, **options)
        return column, row


def check_layers(group, reporter, label, seed_base):
    """An MLP of mt.ColumnParallelLinear, gelu and mt.RowParallelLinear (x [s, b, h], sequence
    first; without sequence parallelism, with it, with it re-gathering x in the backward, and
    that compiled whole by torch.compile, also into CUDA graphs (mode="reduce-overhead", checked
    on a replay)), each layer sharded by from_linear from a torch.nn.Linear: the output and every
    gradient (x, both weights and biases) against that float64 pair, drawn identically on every
    rank."""
    r, device = group.rank, group.device
    # (sequence_parallel, recompute_gathered, torch.compile's mode or None: eager). Compiled only
    # where one thread drives the group: the threads model's threads would each recompile the
    # same code (dynamo caches per process) past its recompile limit.
    modes = ((False, False, None), (True, False, None), (True, True, None),
             (True, True, "default"), (True, True, "reduce-overhead"))
    if threading.current_thread() is not threading.main_thread():
        modes = modes[:3]
    settings = itertools.product((torch.bfloat16, torch.float32), ("nccl", "symmetric"), modes)
    for case, (dtype, backend, (sp, recompute, mode)) in enumerate(settings):
        name = (f"{label}/layers/{backend}/{str(dtype).removeprefix('torch.')}/"
                f"sequence_parallel={int(sp)}/recompute={int(recompute)}/compiled={mode}")
        try:
            p = MlpProblem(group, dtype, seed_base + case)
            column, row = p.layers(group, dtype, sp, recompute, backend=backend)
            rows = p.own_seq if sp else slice(None)
            x_in = p.x[rows].to(dtype).requires_grad_()

            def mlp(x):
                return row(torch.nn.functional.gelu(column(x)))

            if mode is not None:
                torch._dynamo.reset()  # each case's closure would count as a recompile of mlp
            run = mlp if mode is None else torch.compile(mlp, fullgraph=True, mode=mode)
            params = [column.weight, column.bias, row.weight, row.bias]
            # CUDA graphs are recorded on the first calls and replayed after: two steps on
            # other inputs first, so the step checked replays (and stale outputs would show).
            for _ in range(2 if mode == "reduce-overhead" else 0):
                torch.compiler.cudagraph_mark_step_begin()
                other = torch.randn_like(x_in).requires_grad_()
                torch.autograd.grad(run(other).float().sum(), [other, *params])
            torch.compiler.cudagraph_mark_step_begin()
            y = run(x_in)
            got = torch.autograd.grad((y.double() * p.g[rows]).sum(), [x_in, *params])
            torch.cuda.synchronize(device)
            errors = [relative_error(y, p.y_ref[rows].detach()),
                      relative_error(got[0], p.want[0][rows])]
            errors += [relative_error(mine, shard(whole))
                       for shard, mine, whole in zip(p.shards, got[1:], p.want[1:])]
            shapes_ok = y.shape == p.y_ref[rows].shape and all(
                mine.shape == shard(whole).shape
                for shard, mine, whole in zip(p.shards, got[1:], p.want[1:]))
            ok = max(errors) < TOLERANCE[dtype] and shapes_ok
            detail = (f"rel_err y={errors[0]:.2e}, worst gradient={max(errors[1:]):.2e}, "
                      f"shapes_ok={shapes_ok}")
        except Exception as e:  # a check that raises is a failed check, not a crash
            ok, detail = False, f"{type(e).__name__}: {e}"
        reporter.record(name, r, ok, detail)


def check_first_use_after_collective(group, reporter, label, seed_base):
    """Rank 0 makes its matching call a second late, while the last rank, right after its own
    call, runs a kernel that this process has not loaded yet (cuBLAS's complex GEMM). Loading it
    waits for the device, whose collective waits for rank 0: where one process drives both ranks
    and the last rank's call had returned before rank 0's was enqueued, the load held a lock of the
    driver that rank 0's enqueue needed, and both hung (the threads model, fused-wgrad's first
    addmm, 2026-11-27). Both products must be right, in either process model."""
    name = f"{label}/first-use-after-collective"
    try:
        p = Problem("matmul_all_reduce", group, torch.bfloat16, 512, 256, 128, seed_base, True,
                    False)
        if group.rank == 0:
            time.sleep(1.0)
        run_op("matmul_all_reduce", p, group, "auto", True)
        gen = torch.Generator(device=group.device).manual_seed(seed_base + 1)
        c = torch.randn(96, 80, generator=gen, device=group.device, dtype=torch.complex64)
        first_use = c @ c.mT if group.rank == group.size - 1 else None
        torch.cuda.synchronize(group.device)
        errors = [relative_error(p.out, p.ref)]
        if first_use is not None:
            reference = c.cdouble() @ c.cdouble().mT
            errors.append(((first_use.cdouble() - reference).norm() / reference.norm()).item())
        ok = max(errors) < TOLERANCE[torch.bfloat16]
        detail = f"all-reduce rel_err={errors[0]:.2e}" + (
            f", complex GEMM rel_err={errors[1]:.2e}" if len(errors) > 1 else "")
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    reporter.record(name, group.rank, ok, detail)


def check_fused_wgrad(group, reporter, label, seed_base):
    """The layers with fuse_wgrad_accumulation: each weight's gradient is added, in float32, to a
    random main_grad already there (without and with sequence parallelism, bf16 and fp32); the
    difference against the float64 reference; the weight without Megatron's mark gets no .grad,
    the one with it the mark set and a placeholder; x's and the biases' gradients as usual. With
    fsdp-overwrite, the column layer's weight is Megatron-FSDP's: its main_grad comes from
    get_main_grad(), full of NaN, and overwrite_main_grad makes the gradient replace it."""
    r = group.rank
    settings = itertools.product((torch.bfloat16, torch.float32), (False, True), (False, True))
    for case, (dtype, sp, overwrite) in enumerate(settings):
        name = (f"{label}/layers/fused-wgrad/{str(dtype).removeprefix('torch.')}/"
                f"sequence_parallel={int(sp)}{'/fsdp-overwrite' if overwrite else ''}")
        try:
            p = MlpProblem(group, dtype, seed_base + case)
            layers = p.layers(group, dtype, sp, fuse_wgrad_accumulation=True)
            gen = torch.Generator(device=group.device).manual_seed(seed_base + 100 + case)
            priors = [torch.randn(layer.weight.shape, generator=gen, device=group.device)
                      for layer in layers]
            for layer, prior in zip(layers, priors):
                layer.weight.main_grad = prior.clone()
            if overwrite:
                fsdp = layers[0].weight
                del fsdp.main_grad
                priors[0] = torch.zeros_like(priors[0])  # what the gradient is compared against
                buffer = torch.full_like(priors[0], float("nan"))
                fsdp.__fsdp_param__, fsdp.overwrite_main_grad = True, True
                fsdp.get_main_grad = lambda: buffer
            layers[1].weight.grad_added_to_main_grad = False
            rows = p.own_seq if sp else slice(None)
            x_in = p.x[rows].to(dtype).requires_grad_()
            y = layers[1](torch.nn.functional.gelu(layers[0](x_in)))
            (y.double() * p.g[rows]).sum().backward()
            torch.cuda.synchronize(group.device)
            errors = [relative_error(layer.weight.main_grad.double() - prior, shard(whole))
                      for layer, prior, shard, whole in zip(layers, priors, p.shards[::2],
                                                            p.want[1::2])]
            errors += [relative_error(x_in.grad, p.want[0][rows]),
                       relative_error(layers[0].bias.grad, p.shards[1](p.want[2])),
                       relative_error(layers[1].bias.grad, p.want[4])]
            marked = layers[1].weight
            grads_ok = (layers[0].weight.grad is None and marked.grad_added_to_main_grad is True
                        and marked.grad is not None and marked.grad.shape == marked.shape)
            if overwrite:
                grads_ok = grads_ok and layers[0].weight.main_grad is buffer
            ok = max(errors) < TOLERANCE[dtype] and grads_ok
            detail = (f"main_grad {'written' if overwrite else 'additions'} rel_err "
                      f"{errors[0]:.2e}, additions {errors[1]:.2e}; x and biases worst "
                      f"{max(errors[2:]):.2e}; .grad, mark and buffer as expected: {grads_ok}")
        except Exception as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        reporter.record(name, r, ok, detail)


# A child's program: the layers' forward and backward on one GPU (a group of one process),
# eager or compiled, then a normal exit.
EXIT_CHILD = """
import torch, meshla.torch as mt
group = mt.local_groups([{device}])[0]
column = mt.ColumnParallelLinear(64, 128, group, sequence_parallel=True, dtype=torch.bfloat16)
row = mt.RowParallelLinear(128, 64, group, sequence_parallel=True, dtype=torch.bfloat16)
def mlp(x):
    return row(torch.nn.functional.gelu(column(x)))
run = torch.compile(mlp, fullgraph=True) if {compiled} else mlp
x = torch.randn(32, 2, 64, device="cuda:{device}", dtype=torch.bfloat16, requires_grad=True)
run(x).sum().backward()
torch.cuda.synchronize()
print("finished", flush=True)
"""


def check_clean_exit(reporter, label, device: int):
    """A program that ran the layers, eager or compiled, exits with status 0 and without
    nanobind's leak report (torch.compile's caches hold meshla's objects past the extension's
    teardown; meshla.torch silences that report only where something was compiled)."""
    for compiled in (False, True):
        name = f"{label}/clean-exit/compiled={int(compiled)}"
        try:
            proc = subprocess.run(
                [sys.executable, "-c", EXIT_CHILD.format(device=device, compiled=compiled)],
                capture_output=True, text=True, timeout=240)
            leaked = [line for line in proc.stderr.splitlines() if "nanobind: leaked" in line]
            ok = proc.returncode == 0 and "finished" in proc.stdout and not leaked
            detail = f"exit {proc.returncode}; leak reports: {leaked[:3]}"
            if proc.returncode != 0:
                detail += f"; stderr's end: {proc.stderr.strip()[-300:]!r}"
        except Exception as e:  # a check that raises is a failed check, not a crash
            ok, detail = False, f"{type(e).__name__}: {e}"
        reporter.record(name, 0, ok, detail)


# The seconds a drop may take to return, and the communicators' aborts to complete once every
# rank has dropped them.
DROP_RETURNS_WITHIN_S = 5
RELEASED_WITHIN_S = 30


def check_drop_order(world, reporter, label, seed):
    """Two groups let go of in opposite orders on different ranks (rank 0 drops its first group
    first, the others their second) are released without waiting for each other: each drop returns
    at once, every abort completes once all ranks have dropped (no release left under way), and
    the world group still computes right. ncclCommAbort waits until the peers have aborted too, so
    ending the communicators on the dropping thread would hang every rank here."""
    name = f"{label}/drop-order"
    try:
        groups = [mt.group_from_process_group(device=world.device) for _ in range(2)]

        def connect(index):
            # NCCL connects the peers of a group at its first collective: after this, an abort
            # waits for them.
            group = groups[index]
            p = Problem("matmul_all_reduce", group, torch.bfloat16, 256, 128, 64, seed + index,
                        False, False)
            run_op("matmul_all_reduce", p, group, "sequential", False, backend="nccl")
            torch.cuda.synchronize(group.device)
            return relative_error(p.out, p.ref)

        worst = max(connect(index) for index in range(2))
        order = (0, 1) if world.rank == 0 else (1, 0)
        durations = []

        def drop():
            for index in order:
                start = time.perf_counter()
                groups[index] = None  # the last reference: its plans and communicators go here
                gc.collect()
                durations.append(time.perf_counter() - start)

        worker = threading.Thread(target=drop, daemon=True)
        worker.start()
        worker.join(RELEASED_WITHIN_S)
        deadline = time.monotonic() + RELEASED_WITHIN_S
        while meshla._meshla.releases_under_way() and time.monotonic() < deadline:
            time.sleep(0.05)
        pending = meshla._meshla.releases_under_way()
        p = Problem("all_gather_matmul", world, torch.bfloat16, 128 * world.size, 96, 64,
                    seed + 2, False, True)
        out, _ = run_op("all_gather_matmul", p, world, "auto", False)
        after = relative_error(out, p.ref)
        ok = (len(durations) == 2 and max(durations) < DROP_RETURNS_WITHIN_S and pending == 0
              and worst < TOLERANCE[torch.bfloat16] and after < TOLERANCE[torch.bfloat16])
        waiting = '' if len(durations) == 2 else f' (still waiting after {RELEASED_WITHIN_S} s)'
        detail = (f"dropped groups {order} in {', '.join(f'{d * 1e3:.1f} ms' for d in durations)}"
                  f"{waiting}; releases under way after that: {pending}; before: worst "
                  f"rel_err={worst:.2e}; the world group after: rel_err={after:.2e}")
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    reporter.record(name, world.rank, ok, detail)


@contextlib.contextmanager
def capturing(graph, stream):
    """Captures what runs inside on `stream` into `graph`. Not torch.cuda.graph: its entry empties
    the caching allocator of every device, and cudaFree waits for a device whose collective waits
    on a peer's part, which another thread of this process (the threads model runs two groups at
    once) cannot enqueue while cudaFree holds CUDA's lock: a deadlock (seen on 4 H100s). The
    capture is thread_local: the other GPUs' threads keep working meanwhile."""
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()


def capture(group, ops):
    """Captures `ops` (callables) in one CUDA graph on a side stream of the group's device."""
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(group.device)
    stream.wait_stream(torch.cuda.current_stream(group.device))
    with capturing(graph, stream):
        for op in ops:
            op()
    torch.cuda.current_stream(group.device).wait_stream(stream)
    return graph


def refill(problem, fresh):
    """Copies a fresh problem's inputs into a captured one and poisons its outputs."""
    problem.a.copy_(fresh.a)
    problem.b.copy_(fresh.b)
    problem.bias.copy_(fresh.bias)
    problem.out.fill_(float("nan"))
    problem.gathered.fill_(float("nan"))


def worst_over_replays(group, graph, problems, fresh, replays, gathered=True):
    """Replays `graph` `replays` times, each time after copying fresh inputs (`fresh(replay)`: op
    -> Problem) into the captured `problems` (op -> Problem); the worst relative error of any
    output after any replay. With `gathered`, all_gather_matmul's gathered output must equal the
    full input exactly after every replay (infinite error otherwise)."""
    worst = 0.0
    for replay in range(replays):
        new = fresh(replay)
        for op, problem in problems.items():
            refill(problem, new[op])
        graph.replay()
        torch.cuda.synchronize(group.device)
        worst = max([worst] + [relative_error(problem.out, new[op].ref)
                               for op, problem in problems.items()])
        if gathered and "all_gather_matmul" in problems and not torch.equal(
                problems["all_gather_matmul"].gathered, new["all_gather_matmul"].x):
            worst = float("inf")
    return worst


def holders(comm):
    return meshla._meshla.communicator_holders(comm)


def wait_until(condition, within_s):
    """Polls `condition` until it holds or `within_s` seconds have passed; whether it holds."""
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def check_graph_outlives_group(world, reporter, label, seed_base, replays=20):
    """A CUDA graph holds the plans whose runs it captured, and through them their communicator
    and memory: with the group and its plans let go of before the graph (one op per backend, and
    the all-gather of recompute_gathered's backward), every replay still computes right; once the
    graph goes, so do the plans, on threads of their own (the communicator's holders fall back to
    this check's handle alone) within RELEASED_WITHIN_S. Without the graph's hold, the plans
    would go with the group (holders back to one before the replays)."""
    name = f"{label}/graph-outlives-group"
    try:
        dtype, m, n, k = torch.bfloat16, 128 * world.size, 256, 192
        backends = dict(zip(OPS, ("symmetric", "nccl", "symmetric")))
        group = mt.group_from_process_group(device=world.device)
        comm = group.comm
        alone = 1  # this check's own handle: the group's plan cache holds a copy while it lives

        def fresh(replay):
            return {op: Problem(op, world, dtype, m, n, k, seed_base + 10 * replay + i, False, True)
                    for i, op in enumerate(OPS)}

        problems, gathered = fresh(0), []

        def run_all_ops():
            for op, backend in backends.items():
                run_op(op, problems[op], group, "ring", False, backend=backend)
            gathered[:] = [torch.ops.meshla.all_gather(problems["all_gather_matmul"].a, group.key)]

        run_all_ops()  # eager first: builds the plans outside capture
        torch.cuda.synchronize(world.device)
        graph = capture(world, [run_all_ops])
        group = run_all_ops = None  # the group, its plans (held by the group), all let go of
        gc.collect()
        held = holders(comm)
        worst, rows_exact = 0.0, True
        for replay in range(1, replays + 1):
            new = fresh(replay)
            for op, problem in problems.items():
                refill(problem, new[op])
            gathered[0].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize(world.device)
            worst = max([worst] + [relative_error(problems[op].out, new[op].ref) for op in OPS])
            rows_exact = rows_exact and torch.equal(gathered[0], new["all_gather_matmul"].x)
        graph = None
        gc.collect()
        released = wait_until(lambda: holders(comm) == alone, RELEASED_WITHIN_S)
        ok = worst < TOLERANCE[dtype] and rows_exact and held > alone and released
        detail = (f"worst rel_err over {replays} replays after the group went={worst:.2e}, "
                  f"gathered rows exact={rows_exact}; communicator holders: {alone} alone, "
                  f"{held} while the graph held the plans, {holders(comm)} after it went")
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    reporter.record(name, world.rank, ok, detail)


def check_workspace_outlives_plans(world, reporter, label, seed_base):
    """Rank 0 lets go of all its plans of a group (as a graph that held them last would, at a
    moment of its own), then every rank runs a smaller shape on the symmetric backend (nccl where
    the ranks do not map each other's memory): the group's workspace is kept by its communicator,
    so no rank grows it (a symmetric growth is collective) and the result is right. Were it made
    again on rank 0 alone, rank 0 would wait in a growth that its peers never join, until the
    group's timeout (30 s here)."""
    name = f"{label}/workspace-outlives-plans"
    backend = "nccl" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "symmetric"
    try:
        dtype, n, k = torch.bfloat16, 512, 256
        group = mt.group_from_process_group(device=world.device, timeout_s=30.0)
        errors = []
        for index, m in enumerate((1024 * world.size, 128 * world.size)):
            if index == 1 and world.rank == 0:
                group.clear_plans()  # rank 0's plans go; the other ranks keep theirs
                gc.collect()
            p = Problem("matmul_all_reduce", world, dtype, m, n, k, seed_base + index, False, True)
            run_op("matmul_all_reduce", p, group, "ring", False, backend=backend)
            torch.cuda.synchronize(world.device)
            errors.append(relative_error(p.out, p.ref))
        ok = max(errors) < TOLERANCE[dtype]
        detail = (f"{backend}: rel_err before and after rank 0 let go of its plans: "
                  f"{errors[0]:.2e}, {errors[1]:.2e}")
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    reporter.record(name, world.rank, ok, detail)


def check_teardown_during_capture(world, reporter, label, seed_base):
    """A group and its plans (both backends), let go of by this thread while another thread
    captures a CUDA graph of its own (thread_local, as one thread per GPU does): nothing of the
    teardown may synchronise the device (cublasLtDestroy did, and invalidated every capture under
    way), so the other capture ends without error and its graph replays right. The group must be
    gone by then (a weak reference), and its communicator's abort done. A graph that held the
    plans last lets go of them on a thread of its own, when CUDA calls it back (seen deferred
    until the captures under way end)."""
    name = f"{label}/teardown-during-capture"
    try:
        dtype, m, n, k = torch.bfloat16, 128 * world.size, 256, 192
        group = mt.group_from_process_group(device=world.device)
        for index, backend in enumerate(("nccl", "symmetric")):
            p = Problem("matmul_all_reduce", world, dtype, m, n, k, seed_base + index, False,
                        True)
            run_op("matmul_all_reduce", p, group, "ring", False, backend=backend)
        torch.cuda.synchronize(world.device)
        gen = torch.Generator(device=world.device).manual_seed(seed_base + 2)
        x = torch.randn(512, 512, generator=gen, device=world.device) / 512**0.5
        began, torn_down, outcome = threading.Event(), threading.Event(), {}

        def capture_meanwhile():
            try:
                torch.cuda.set_device(world.device)
                graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(world.device)
                with torch.cuda.stream(stream):
                    x @ x  # this thread's cuBLAS handle and workspace, made outside the capture
                torch.cuda.synchronize(world.device)
                with capturing(graph, stream):
                    y = x @ x
                    began.set()
                    torn_down.wait(RELEASED_WITHIN_S)
                    y = y @ x
                outcome.update(graph=graph, y=y)
            except Exception as e:
                outcome["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
                began.set()

        other = threading.Thread(target=capture_meanwhile)
        other.start()
        began.wait(RELEASED_WITHIN_S)
        gone = weakref.ref(group)
        del group  # its plans here, its communicator and workspace on threads of their own
        gc.collect()
        aborted = gone() is None and wait_until(
            lambda: meshla._meshla.releases_under_way() == 0, RELEASED_WITHIN_S)
        torn_down.set()
        other.join(RELEASED_WITHIN_S)
        err = float("inf")
        if "graph" in outcome:
            outcome["y"].fill_(float("nan"))
            outcome["graph"].replay()
            torch.cuda.synchronize(world.device)
            err = relative_error(outcome["y"], x.double() @ x.double() @ x.double())
        # TF32 or not, a stale or missing result would be far off.
        ok = aborted and err < TOLERANCE[torch.bfloat16]
        detail = (f"group gone and its releases done meanwhile: {aborted}; the other thread's "
                  f"capture: "
                  f"{outcome.get('error', f'ended, replay rel_err={err:.2e}')}")
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    reporter.record(name, world.rank, ok, detail)


def check_graph_replay(group, reporter, label, seed_base, replays=20):
    """Capture each op once per backend, replay with new inputs copied into the captured
    buffers."""
    for index, (op, backend) in enumerate((op, b) for op in OPS for b in ("nccl", "symmetric")):
        name = f"{label}/graph/{op}/{backend}/ring/bfloat16"
        try:
            dtype, m, n, k = torch.bfloat16, 256 * group.size, 512, 256
            p = Problem(op, group, dtype, m, n, k, seed_base + 1000 * index, False, True)
            run = lambda: run_op(op, p, group, "ring", False, backend=backend)  # noqa: E731
            run()  # eager first: builds the plan outside capture
            torch.cuda.synchronize(group.device)
            graph = capture(group, [run])
            worst = worst_over_replays(
                group, graph, {op: p},
                lambda replay: {op: Problem(op, group, dtype, m, n, k,
                                            seed_base + 1000 * index + replay + 1, False, True)},
                replays)
            ok = worst < TOLERANCE[dtype]
            detail = f"worst rel_err over {replays} replays={worst:.2e}"
        except Exception as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        reporter.record(name, group.rank, ok, detail)


def check_graph_two_streams(group, reporter, label, seed_base, replays=20):
    """One plan run twice in one CUDA graph, the second run on a stream forked inside the capture
    (two micro-batches of one layer): the plan orders its runs within the capture, so both
    results are right after every replay."""
    for index, (op, backend) in enumerate((op, b) for op in OPS for b in ("nccl", "symmetric")):
        name = f"{label}/graph-two-streams/{op}/{backend}/ring/bfloat16"
        try:
            dtype, m, n, k = torch.bfloat16, 128 * group.size, 256, 192
            seeds = [seed_base + 1000 * index, seed_base + 1000 * index + 500]
            problems = [Problem(op, group, dtype, m, n, k, s, False, True) for s in seeds]
            for p in problems:  # eager first: builds the plan outside capture
                run_op(op, p, group, "ring", False, backend=backend)
            torch.cuda.synchronize(group.device)
            graph = torch.cuda.CUDAGraph()
            main = torch.cuda.Stream(group.device)
            side = torch.cuda.Stream(group.device)
            main.wait_stream(torch.cuda.current_stream(group.device))
            with capturing(graph, main):
                side.wait_stream(main)
                run_op(op, problems[0], group, "ring", False, backend=backend)
                with torch.cuda.stream(side):
                    run_op(op, problems[1], group, "ring", False, backend=backend)
                main.wait_stream(side)
            torch.cuda.current_stream(group.device).wait_stream(main)
            worst = 0.0
            for replay in range(replays):
                fresh = [Problem(op, group, dtype, m, n, k, s + replay + 1, False, True)
                         for s in seeds]
                for p, new in zip(problems, fresh):
                    refill(p, new)
                graph.replay()
                torch.cuda.synchronize(group.device)
                worst = max([worst] + [relative_error(p.out, new.ref)
                                       for p, new in zip(problems, fresh)])
            ok = worst < TOLERANCE[dtype]
            detail = f"worst rel_err of both runs over {replays} replays={worst:.2e}"
        except Exception as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        reporter.record(name, group.rank, ok, detail)


def check_graph_sequence(group, reporter, label, seed_base, replays=100):
    """The three ops on the symmetric backend captured in one graph, replayed with new inputs:
    every result right after every replay (no stale flag or buffer between ops or replays)."""
    name = f"{label}/graph-sequence/symmetric/bfloat16"
    try:
        dtype, m, n, k = torch.bfloat16, 128 * group.size, 256, 192
        problems = {op: Problem(op, group, dtype, m, n, k, seed_base + i, False, True)
                    for i, op in enumerate(OPS)}
        runs = [lambda op=op: run_op(op, problems[op], group, "ring", False, backend="symmetric")
                for op in OPS]
        for run in runs:
            run()
        torch.cuda.synchronize(group.device)
        graph = capture(group, runs)
        worst = worst_over_replays(
            group, graph, problems,
            lambda replay: {op: Problem(op, group, dtype, m, n, k,
                                        seed_base + 100 * (replay + 1) + i, False, True)
                            for i, op in enumerate(OPS)},
            replays)
        ok = worst < TOLERANCE[dtype]
        detail = f"worst rel_err over {replays} replays of 3 ops={worst:.2e}"
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    reporter.record(name, group.rank, ok, detail)


STRESS_SHAPES = ((64, 128, 64), (128, 256, 128), (200, 384, 256))  # (rows per rank, n, k)
# The world group of the process model runs the full 2000-call stress; the other groups run a
# shorter one, since the thread model's Python threads share one interpreter lock and the whole
# model must fit the launcher's time limit (it ran past 250 s with 2000 calls per group).
THREADS_STRESS_CALLS = 300


# Stress calls enqueued back to back before their results are read: plans of both backends then
# queue on one stream, sharing the group's workspace, with no host synchronisation between them.
STRESS_WINDOW = 8


def check_stress(group, reporter, label, seed, calls):
    """`calls` calls with op, backend, algorithm and shape drawn at random (the same draws on
    every rank), each checked against its reference, STRESS_WINDOW of them enqueued before any is
    read: no hang, no stale data between plans or between back-to-back runs."""
    name = f"{label}/stress/{calls}"
    draw = random.Random(seed)
    worst, failures, detail = 0.0, 0, ""
    pending = []

    def read_pending():
        nonlocal worst, failures, detail
        for call, what, out, ref in pending:
            err = relative_error(out, ref)
            worst = max(worst, err)
            if not err < TOLERANCE[torch.bfloat16]:
                failures += 1
                detail = detail or f"call {call}: {what} rel_err={err:.2e}"
        pending.clear()

    try:
        for call in range(calls):
            op = draw.choice(OPS)
            backend = draw.choice(("nccl", "symmetric"))
            algorithm = "ring" if backend == "symmetric" else draw.choice(
                ("sequential", "pipelined", "ring"))
            rows, n, k = draw.choice(STRESS_SHAPES)
            chunks = draw.choice((1, 2)) if backend == "symmetric" and op != OPS[0] else 0
            p = Problem(op, group, torch.bfloat16, rows * group.size, n, k, seed + call,
                        call % 2 == 0, call % 3 == 0)
            result = run_op(op, p, group, algorithm, call % 2 == 0, chunks, 0, backend)
            out = result[0] if op == "all_gather_matmul" else result
            pending.append((call, f"{op}/{backend}/{algorithm}", out, p.ref))
            if len(pending) == STRESS_WINDOW:
                read_pending()
        read_pending()
        ok = failures == 0
        detail = f"{failures} wrong of {calls}; worst rel_err={worst:.2e} {detail}".strip()
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    reporter.record(name, group.rank, ok, detail)


def check_argument_errors(group, reporter, label):
    """Bad input on CUDA tensors raises ValueError naming the shapes, before any communication."""
    name = f"{label}/errors"
    a = torch.randn(8, 16, device=group.device, dtype=torch.bfloat16)
    try:
        mt.all_gather_matmul(a, torch.randn(12, 4, device=group.device, dtype=torch.bfloat16),
                             group)
        ok, detail = False, "no error for mismatched k"
    except ValueError as e:
        ok, detail = "b.shape=[12, 4]" in str(e) and "a.shape=[8, 16]" in str(e), str(e)
    reporter.record(name, group.rank, ok, detail)


def check_out_written_seen_by_autograd(group, reporter, label, seed):
    """A caller's out= that a backward saved, written again by a later call, makes that backward
    refuse (as after torch's own out= ops) instead of computing from the new contents."""
    name = f"{label}/out-version"
    gen = torch.Generator(device=group.device).manual_seed(seed)
    ok, details = True, []
    for op in OPS:
        tp = group.size
        m, k, n = 16 * tp, 32, 24
        a_rows = m // tp if op == "all_gather_matmul" else m
        a, a2 = (torch.randn(a_rows, k, device=group.device, generator=gen) for _ in range(2))
        b = torch.randn(k, n, device=group.device, generator=gen)
        out_rows = m // tp if op == "matmul_reduce_scatter" else m
        out = torch.empty(out_rows, n, device=group.device)
        call = getattr(mt, op)
        weight = torch.randn(out_rows, n, device=group.device, requires_grad=True)
        loss = (call(a, b, group, out=out) * weight).sum()  # saves out for weight's gradient
        call(a2, b, group, out=out)
        try:
            loss.backward()
            refused = "backward ran on overwritten data"
        except RuntimeError as error:
            refused = "modified by an inplace operation" in str(error)
            refused = refused or f"another error: {error}"
        ok = ok and refused is True
        details.append(f"{op}: {'refused' if refused is True else refused}")
    reporter.record(name, group.rank, ok, "; ".join(details))


class _FunctionsSeen(torch.overrides.TorchFunctionMode):
    """The names of the torch functions and ops called under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _op_calls_counted(op: str):
    """Counts the calls of meshla.torch's torch.ops.meshla.<op> (the module's name for it) while
    it is active: a list whose length is the count."""
    attribute = f"_{op}_op"
    the_op = getattr(collective_ops, attribute)
    calls = []

    def counted(*args):
        calls.append(None)
        return the_op(*args)
    setattr(collective_ops, attribute, counted)
    try:
        yield calls
    finally:
        setattr(collective_ops, attribute, the_op)


def check_observed_calls(group, reporter, label, seed_base):
    """A plain eager call does an op's work without the op; under the profiler, a dispatch mode
    (FlopCounterMode) and a torch function mode the same call goes through its torch.ops.meshla
    op, which the profile and the function mode name. Each way gets the reference's result on
    inputs of its own (so that no output can hold another way's result)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    ways = {"eager": contextlib.nullcontext,
            "profiled": lambda: profile(activities=[ProfilerActivity.CPU]),
            "flop-counted": lambda: FlopCounterMode(display=False),
            "function-mode": _FunctionsSeen}
    for index, op in enumerate(OPS):
        name = f"{label}/observed-calls/{op}/bfloat16"
        try:
            errors, named, op_calls = {}, {}, {}
            for way_index, (way, observing) in enumerate(ways.items()):
                p = Problem(op, group, torch.bfloat16, 128 * group.size, 256, 128,
                            seed_base + 10 * index + way_index, False, True)
                with _op_calls_counted(op) as calls, observing() as observer:
                    out = getattr(mt, op)(p.a, p.b, group, bias=p.bias)
                torch.cuda.synchronize(group.device)
                errors[way], op_calls[way] = relative_error(out, p.ref), len(calls)
                if way == "profiled":
                    named[way] = any(event.key == f"meshla::{op}"
                                     for event in observer.key_averages())
                elif way == "function-mode":
                    named[way] = f"meshla.{op}" in observer.names
            ok = (all(named.values())
                  and all(calls == (0 if way == "eager" else 1) for way, calls in op_calls.items())
                  and all(error < TOLERANCE[torch.bfloat16] for error in errors.values()))
            detail = (", ".join(f"{way} names meshla::{op}: {seen}" for way, seen in named.items())
                      + "; op calls " + ", ".join(f"{way} {n}" for way, n in op_calls.items())
                      + "; rel_err "
                      + ", ".join(f"{way} {error:.2e}" for way, error in errors.items()))
        except Exception as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        reporter.record(name, group.rank, ok, detail)


def check_plans_must_agree(group, reporter, label, seed):
    """Ranks that call with different shapes (the last rank's a has more rows) get a ValueError on
    every rank, naming the rank and both shapes, instead of writes at offsets their peers do not
    expect; the group then still computes correctly."""
    name = f"{label}/plans-must-agree"
    last = group.rank == group.size - 1
    a = torch.randn(16 if last else 8, 24, device=group.device, dtype=torch.bfloat16)
    b = torch.randn(24, 40, device=group.device, dtype=torch.bfloat16)
    expected = f"rank {group.size - 1} has m={16 * group.size} where rank 0 has m={8 * group.size}"
    try:
        mt.all_gather_matmul(a, b, group)
        ok, detail = False, "no error for ranks with different shapes"
    except ValueError as e:
        ok, detail = "built different plans" in str(e) and expected in str(e), str(e)
    p = Problem("all_gather_matmul", group, torch.bfloat16, 8 * group.size, 40, 24, seed, False,
                False)
    out, _ = run_op("all_gather_matmul", p, group, "auto", False)
    err = relative_error(out, p.ref)
    reporter.record(name, group.rank, ok and err < TOLERANCE[torch.bfloat16],
                    f"{detail}; then rel_err={err:.2e}")


def check_shared_workspace(group, reporter, label, seed_base, backend):
    """The nccl and symmetric plans of a group share one workspace. A plan that fits in it
    allocates no buffers; a larger one grows it; a graph captured before the growth still replays
    right on the memory it captured; and the plans' runs, interleaved, are all right. On nccl a
    group of one rank stages nothing (every algorithm is the GEMM in place): no plan grows it."""
    name = f"{label}/{backend}/shared-workspace"
    algorithm = "ring" if backend == "symmetric" else "pipelined"
    dtype, m, n, k, small_rows = torch.bfloat16, 8192, 4096, 256, 128 * group.size
    mib = 2**20
    try:
        def problem(op, rows, seed):
            return Problem(op, group, dtype, rows, n, k, seed, False, True)

        def run(op, p):
            result = run_op(op, p, group, algorithm, False, backend=backend)
            return result[0] if op == "all_gather_matmul" else result

        small = problem("matmul_all_reduce", small_rows, seed_base)
        run("matmul_all_reduce", small)
        torch.cuda.synchronize(group.device)
        graph = capture(group, [lambda: run("matmul_all_reduce", small)])
        big = problem("matmul_all_reduce", m, seed_base + 1)
        torch.cuda.synchronize(group.device)
        free_before = torch.cuda.mem_get_info(group.device)[0]
        plan_of(group, meshla._meshla.CollectiveOp.matmul_all_reduce, dtype, m, n, k, False, True,
                False, mt.Tuning.of(algorithm, backend=backend))
        torch.cuda.synchronize(group.device)  # stream-ordered frees go back to the device here
        grown = (free_before - torch.cuda.mem_get_info(group.device)[0]) / mib
        big_err = relative_error(run("matmul_all_reduce", big), big.ref)
        replayed = worst_over_replays(
            group, graph, {"matmul_all_reduce": small},
            lambda replay: {"matmul_all_reduce": problem("matmul_all_reduce", small_rows,
                                                         seed_base + 10 + replay)}, 5)
        # A reduce-scatter of the same m and n fits: building its plan allocates nothing, where
        # a plan of its own would take its staging of [m, n] (64 MiB; 128 on the symmetric
        # backend: inbox and staged products) and a 32 MiB cuBLASLt workspace.
        torch.cuda.synchronize(group.device)
        free_before = torch.cuda.mem_get_info(group.device)[0]
        plan_of(group, meshla._meshla.CollectiveOp.matmul_reduce_scatter, dtype, m, n, k, False,
                True, False, mt.Tuning.of(algorithm, backend=backend))
        torch.cuda.synchronize(group.device)
        allocated = (free_before - torch.cuda.mem_get_info(group.device)[0]) / mib
        worst = 0.0
        for call in range(6):
            op = OPS[call % 3]
            p = problem(op, small_rows if op == "all_gather_matmul" else m, seed_base + 100 + call)
            worst = max(worst, relative_error(run(op, p), p.ref))
        # The all-reduce's staging of [m, n] is 64 MiB (on symmetric, 128 more of peer memory).
        stages = group.size > 1 or backend == "symmetric"
        ok = (max(big_err, replayed, worst) < TOLERANCE[dtype]
              and (grown >= 60 if stages else grown < 8) and allocated < 8)
        detail = (("" if stages else "one rank on nccl stages nothing: ")
                  + f"an all-reduce plan grew the workspace by {grown:.0f} MiB, "
                  f"rel_err={big_err:.2e}; graph captured before the growth: "
                  f"worst rel_err={replayed:.2e} over 5 replays; a reduce-scatter plan that fits "
                  f"allocated {allocated:.0f} MiB; interleaved runs worst rel_err={worst:.2e}")
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    reporter.record(name, group.rank, ok, detail)


def check_gather_forms(group, reporter, label, seed_base):
    """all_gather_matmul on the symmetric backend in each form of its GEMM, forced through
    MESHLA_GATHER_GEMM (the plan otherwise times both and keeps the faster): per batch (cuBLASLt)
    and one launch (CUTLASS, tiles waiting on the device for their blocks), bf16 and fp16, both
    layouts of b, with and without bias, blocks of whole and partial 128-row tiles; and the one
    launch's fallback to per batch for an input whose start is not 16-byte aligned. One process
    per rank only: the variable is read when a plan is built, and threads share it."""
    case = 0
    try:
        for form in ("per_batch", "one_launch"):
            os.environ["MESHLA_GATHER_GEMM"] = form
            group.clear_plans()  # plans read the variable when they are built
            for dtype, trans_b, (rows, n, k) in itertools.product(
                    (torch.bfloat16, torch.float16), (False, True), ((200, 384, 256),
                                                                     (1024, 768, 512))):
                case += 1
                bias = case % 2 == 1
                name = (f"{label}/gather-form/{form}/{str(dtype)[6:]}/trans_b={int(trans_b)}"
                        f"/bias={int(bias)}/rows={rows}")
                try:
                    p = Problem("all_gather_matmul", group, dtype, rows * group.size, n, k,
                                seed_base + case, trans_b, bias)
                    out, gathered = run_op("all_gather_matmul", p, group, "ring", trans_b,
                                           backend="symmetric")
                    torch.cuda.synchronize(group.device)
                    err = relative_error(out, p.ref)
                    exact = torch.equal(gathered, p.x)
                    ok, detail = err < TOLERANCE[dtype] and exact, (
                        f"rel_err={err:.2e} gathered_exact={exact}")
                except Exception as e:
                    ok, detail = False, f"{type(e).__name__}: {e}"
                reporter.record(name, group.rank, ok, detail)
        name = f"{label}/gather-form/one_launch/unaligned-input"
        try:
            p = Problem("all_gather_matmul", group, torch.bfloat16, 256 * group.size, 384, 256,
                        seed_base + 99, True, True)
            storage = torch.empty(p.a.numel() + 1, dtype=p.a.dtype, device=group.device)
            p.a = storage[1:].view_as(p.a).copy_(p.a)  # 2 bytes past an aligned start
            out, _ = run_op("all_gather_matmul", p, group, "ring", True, backend="symmetric")
            torch.cuda.synchronize(group.device)
            err = relative_error(out, p.ref)
            ok, detail = err < TOLERANCE[torch.bfloat16], f"rel_err={err:.2e}"
        except Exception as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        reporter.record(name, group.rank, ok, detail)
    finally:
        del os.environ["MESHLA_GATHER_GEMM"]
        group.clear_plans()


def run_cublasmp(op, problem, group, algorithm, trans_b):
    return getattr(mt, op)(problem.a, problem.b, group, bias=problem.bias, trans_b=trans_b,
                           algorithm=algorithm, backend="cublasmp", out=problem.out)


def check_cublasmp(group, reporter, label, seed_base, replays=20, stress_calls=300):
    """The cuBLASMp backend: every op x dtype x layout x bias x algorithm against the reference,
    graph replays of each op and of the three in one graph, shapes drawn at random, and the
    configurations it refuses."""
    reason = meshla.backend_unavailable_reason("cublasmp")
    if reason:
        reporter.record(f"{label}/cublasmp/available", group.rank, False, reason)
        return
    case = 0
    for dtype in (torch.bfloat16, torch.float16):
        for op in OPS:
            for trans_b in (True, False) if op != "matmul_all_reduce" else (True,):
                for algorithm, rows in itertools.product(("auto", "sequential"), (256, 200)):
                    case += 1
                    bias = case % 2 == 1
                    m, n, k = rows * group.size, 384, 256
                    name = (f"{label}/{op}/cublasmp/{algorithm}/{str(dtype)[6:]}"
                            f"/trans_b={int(trans_b)}/bias={int(bias)}/m={m}")
                    try:
                        p = Problem(op, group, dtype, m, n, k, seed_base + case, trans_b, bias)
                        out = run_cublasmp(op, p, group, algorithm, trans_b)
                        torch.cuda.synchronize(group.device)
                        err = relative_error(out, p.ref)
                        ok, detail = err < TOLERANCE[dtype], f"rel_err={err:.2e}"
                    except Exception as e:
                        ok, detail = False, f"{type(e).__name__}: {e}"
                    reporter.record(name, group.rank, ok, detail)

    dtype, m, n, k = torch.bfloat16, 256 * group.size, 512, 256
    problems = {}
    for index, op in enumerate(OPS):
        name = f"{label}/graph/{op}/cublasmp/auto/bfloat16"
        try:
            p = problems[op] = Problem(op, group, dtype, m, n, k, seed_base + 1000 * index, True,
                                       True)
            run = lambda op=op, p=p: run_cublasmp(op, p, group, "auto", True)  # noqa: E731
            run()  # eager first: the plan and its warm-up stay outside the capture
            torch.cuda.synchronize(group.device)
            graph = capture(group, [run])
            worst = worst_over_replays(
                group, graph, {op: p},
                lambda replay: {op: Problem(op, group, dtype, m, n, k,
                                            seed_base + 1000 * index + replay + 1, True, True)},
                replays, gathered=False)
            ok = worst < TOLERANCE[dtype]
            detail = f"worst rel_err over {replays} replays={worst:.2e}"
        except Exception as e:
            ok, detail = False, f"{type(e).__name__}: {e}"
        reporter.record(name, group.rank, ok, detail)

    name = f"{label}/graph-sequence/cublasmp/bfloat16"
    try:
        runs = [lambda op=op: run_cublasmp(op, problems[op], group, "auto", True) for op in OPS]
        graph = capture(group, runs)
        worst = worst_over_replays(
            group, graph, problems,
            lambda replay: {op: Problem(op, group, dtype, m, n, k,
                                        seed_base + 100 * (replay + 1) + i, True, True)
                            for i, op in enumerate(OPS)},
            100, gathered=False)
        ok = worst < TOLERANCE[dtype]
        detail = f"worst rel_err over 100 replays of 3 ops={worst:.2e}"
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    reporter.record(name, group.rank, ok, detail)

    name = f"{label}/stress/cublasmp/{stress_calls}"
    draw = random.Random(seed_base + 5)
    worst, failures, detail = 0.0, 0, ""
    try:
        for call in range(stress_calls):
            op = draw.choice(OPS)
            trans_b = op == "matmul_all_reduce" or draw.random() < 0.5
            rows, n_s, k_s = draw.choice(STRESS_SHAPES)
            p = Problem(op, group, torch.bfloat16, rows * group.size, n_s, k_s, seed_base + call,
                        trans_b, call % 3 == 0)
            err = relative_error(run_cublasmp(op, p, group, draw.choice(("auto", "sequential")),
                                              trans_b), p.ref)
            worst = max(worst, err)
            if not err < TOLERANCE[torch.bfloat16]:
                failures += 1
                detail = detail or f"call {call}: {op} rel_err={err:.2e}"
        ok = failures == 0
        detail = f"{failures} wrong of {stress_calls}; worst rel_err={worst:.2e} {detail}".strip()
    except Exception as e:
        ok, detail = False, f"{type(e).__name__}: {e}"
    reporter.record(name, group.rank, ok, detail)

    refusals = (("matmul_all_reduce", torch.bfloat16, False, "auto", "trans_b=True"),
                ("matmul_all_reduce", torch.bfloat16, True, "ring", "without NVLink multicast"),
                ("all_gather_matmul", torch.float32, True, "auto", "supports bfloat16 and float16"))
    for op, dtype, trans_b, algorithm, expected in refusals:
        name = (f"{label}/{op}/cublasmp/refused/{algorithm}/{str(dtype)[6:]}"
                f"/trans_b={int(trans_b)}")
        try:
            p = Problem(op, group, dtype, 64 * group.size, 64, 64, seed_base, trans_b, False)
            run_cublasmp(op, p, group, algorithm, trans_b)
            ok, detail = False, "no error"
        except NotImplementedError as e:
            ok, detail = expected in str(e), f"refused: {e}"
        reporter.record(name, group.rank, ok, detail)


def check_cublasmp_refused_in_threads(group, reporter, label):
    """One process driving several GPUs cannot use cuBLASMp 0.7 (NVSHMEM: one process per rank):
    a clear error on every thread, not a hang."""
    name = f"{label}/all_gather_matmul/cublasmp/refused/threads"
    try:
        p = Problem("all_gather_matmul", group, torch.bfloat16, 64 * group.size, 64, 64, 1, True,
                    False)
        run_cublasmp("all_gather_matmul", p, group, "auto", True)
        ok, detail = False, "no error"
    except NotImplementedError as e:
        reason = meshla.backend_unavailable_reason("cublasmp")
        ok = ("one process per GPU" in str(e)) if not reason else (reason in str(e))
        detail = f"refused: {e}"
    reporter.record(name, group.rank, ok, detail)


# The families of checks (``--families``): what tests/gpu/test_gpu_suite.py selects with -k.
FAMILIES = ("correctness", "fp8", "autograd", "layers", "graphs", "stress", "errors", "lifetime",
            "cublasmp")


def run_all(group, reporter, label, seed_base, quick, stress_calls=2000):
    torch.cuda.set_device(group.device)
    run = reporter.family
    if quick:
        run("correctness", check_correctness, group, reporter, label, seed_base,
            dtypes=(torch.bfloat16,))
        return
    if group.size > 1:  # first, while cuBLAS's complex GEMM is not loaded in this process
        run("correctness", check_first_use_after_collective, group, reporter, label,
            seed_base + 39_000)
    run("correctness", check_correctness, group, reporter, label, seed_base)
    run("fp8", check_fp8, group, reporter, label, seed_base + 30_000)
    run("autograd", check_autograd, group, reporter, label, seed_base + 40_000)
    run("layers", check_layers, group, reporter, label, seed_base + 45_000)
    run("layers", check_fused_wgrad, group, reporter, label, seed_base + 47_000)
    run("graphs", check_graph_replay, group, reporter, label, seed_base + 50_000)
    run("graphs", check_graph_sequence, group, reporter, label, seed_base + 60_000)
    run("graphs", check_graph_two_streams, group, reporter, label, seed_base + 65_000)
    run("stress", check_stress, group, reporter, label, seed_base + 70_000, stress_calls)
    run("errors", check_argument_errors, group, reporter, label)
    run("autograd", check_out_written_seen_by_autograd, group, reporter, label,
        seed_base + 80_000)
    if group.size > 1:  # a group of one has no rank to disagree with
        run("errors", check_plans_must_agree, group, reporter, label, seed_base + 90_000)
    for index, backend in enumerate(("nccl", "symmetric")):
        run("lifetime", check_shared_workspace, group, reporter, label,
            seed_base + 95_000 + 100 * index, backend)


def main_processes(args, reporter):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo")  # the unique id travels over gloo: no NCCL bootstrap
    rank, size = dist.get_rank(), dist.get_world_size()
    seed = [random.randrange(2**30) if rank == 0 else None]
    dist.broadcast_object_list(seed, src=0)
    device = torch.device("cuda", local_rank)
    world = mt.group_from_process_group(device=device)
    run, label = reporter.family, f"tp{size}"
    if args.cublasmp:
        torch.cuda.set_device(device)
        run("cublasmp", check_cublasmp, world, reporter, label, seed[0])
        dist.barrier()
        dist.destroy_process_group()
        return
    run_all(world, reporter, label, seed[0], args.quick)
    if not args.quick:
        run("correctness", check_gather_forms, world, reporter, label, seed[0] + 80_000)
    if size == 1 and not args.quick:
        run("lifetime", check_clean_exit, reporter, label, local_rank)
    if not args.quick:
        # Here, not in run_all: the profiler is the process's, and the threads model's threads
        # would each start one at once (kineto then crashed the process).
        run("autograd", check_observed_calls, world, reporter, label, seed[0] + 85_000)
        run("graphs", check_graph_outlives_group, world, reporter, label, seed[0] + 57_000)
        run("graphs", check_teardown_during_capture, world, reporter, label, seed[0] + 58_000)
    if size >= 2:
        run("lifetime", check_drop_order, world, reporter, label, seed[0] + 88_000)
        run("lifetime", check_workspace_outlives_plans, world, reporter, label, seed[0] + 89_000)
    if size == 4 and not args.quick:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        sub = mt.group_from_process_group(pairs[rank // 2], device=device)
        # Both pairs run their checks at the same time, on their own communicators.
        run_all(sub, reporter, f"tp2-in-4/pair{rank // 2}", seed[0] + 7, args.quick,
                stress_calls=THREADS_STRESS_CALLS)
    dist.barrier()
    dist.destroy_process_group()


def main_threads(args, reporter):
    devices = list(range(torch.cuda.device_count()))
    groups = mt.local_groups(devices)
    # With 4 GPUs, also two tp=2 groups of this one process, run at the same time as each other.
    pairs = mt.local_groups([0, 1]) + mt.local_groups([2, 3]) if len(devices) == 4 else []
    seed = random.randrange(2**30)
    errors = []

    def work(index):
        try:
            run_all(groups[index], reporter, f"threads-tp{len(devices)}", seed, args.quick,
                    stress_calls=THREADS_STRESS_CALLS)
            reporter.family("cublasmp", check_cublasmp_refused_in_threads, groups[index],
                            reporter, f"threads-tp{len(devices)}")
            if pairs and not args.quick:
                run_all(pairs[index], reporter, f"threads-tp2-in-4/pair{index // 2}", seed + 7,
                        False, stress_calls=THREADS_STRESS_CALLS)
        except Exception:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for error in errors:
        reporter.record("threads/driver", -1, False, error)


# After the last check, the seconds a process has to exit.
EXIT_WITHIN_S = 60
# The checks' own limit, a little under the launcher's (tests/gpu/run.sh): a model that hangs
# prints every thread's stack before it is killed.
CHECKS_WITHIN_S = float(os.environ.get("MESHLA_LAUNCH_TIMEOUT", "300")) - 20


def exit_within(seconds: float):
    """Ends the process if it has not exited `seconds` from now, printing every thread's Python
    stack first: where its exit (atexit handlers, the destruction of plans, groups and compiled
    code) waits. On 2 H200s at 69e4667, processes-tp2's ranks wrote their last result 40 s in, then
    did not exit until their launcher's 300 s limit; this says where that time goes."""
    print(f"checks done; exiting (a stack dump follows if not gone within {seconds:.0f} s)",
          flush=True)
    atexit.register(lambda: print("interpreter exit: atexit handlers start", flush=True))
    faulthandler.dump_traceback_later(seconds, exit=True)


if __name__ == "__main__":
    parser = check_parser(__doc__, None, FAMILIES)
    parser.add_argument("--threads", action="store_true", help="one process, a thread per GPU")
    parser.add_argument("--quick", action="store_true", help="bf16 correctness only")
    parser.add_argument("--cublasmp", action="store_true", help="the cuBLASMp backend alone")
    args = parser.parse_args()
    model = args.model or ("threads" if args.threads else "processes")
    reporter = Reporter(args.results, model, args.families)
    faulthandler.dump_traceback_later(CHECKS_WITHIN_S, exit=True)
    (main_threads if args.threads else main_processes)(args, reporter)
    exit_within(EXIT_WITHIN_S)
