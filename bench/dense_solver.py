"""Benchmark of the distributed dense solvers (one process, all of its GPUs), one run:

  python bench/dense_solver.py --commit SHA --out results.json [--sizes 8192,16384] [--largest]

For each dtype (float64, float32), GPU count (1, 2, 4) and n: the jitted
``meshla.jax.linalg.cho_solve`` on a row-sharded array (A and one right-hand side; meshla's own
factorization, then cuSolverMg's potrs), beside the time raw cuSolverMg spends in its potrf +
potrs on the same GPUs and tile (measured inside meshla's DenseSolver with cholesky="cusolvermg",
data already in its layout), and ``jax.scipy.linalg.cho_factor`` + ``cho_solve`` on one GPU.
Then ``lu_solve`` (``--lu-sizes``) on 1, 2, 4 GPUs beside ``jnp.linalg.solve`` on one GPU, the
tall-skinny routines (``--tall`` m:n shapes: qr, least_squares, svd, polar on a Gaussian A, in
meshla.jax beside jax's own on one GPU and in meshla.torch beside torch.linalg's), eigh and
the SPD inverse beside ``jnp.linalg.eigh`` / ``jnp.linalg.inv`` on one GPU, and with
``--largest`` the largest float64 n solved on all GPUs (input donated). Matrices are Hankel
matrices h(i + j) plus n·I (diagonally dominant, so positive definite; for the LU solve
h(i + 2j) + n·I, not symmetric), generated on the GPUs row block by row block.
Prints a table last and writes JSON with device, date and commit, after each part (so a run cut
short keeps the parts it finished; each row is also printed as it comes).
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPUs
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # the largest n needs it all

import argparse
import datetime
import functools
import json
import statistics
import time

import jax
import numpy as np
import torch
from progress import Progress

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from meshla import _meshla  # noqa: E402
from meshla.jax import linalg  # noqa: E402
from meshla.jax._dtypes import DTYPES as JAX_DTYPES  # noqa: E402
from meshla.torch import linalg as torch_linalg  # noqa: E402
from meshla.torch._dtypes import DTYPES  # noqa: E402


def hankel_block(row0, rows, n, dtype, column_stride=1):
    """Rows [row0, row0 + rows) of h(i + column_stride j) + n I, h(k) = sin(0.618 k) in [-1, 1]
    (symmetric for column_stride 1)."""
    i = row0 + jnp.arange(rows)[:, None]
    j = jnp.arange(n)[None, :]
    k = (i + column_stride * j).astype(dtype)
    return jnp.sin(jnp.asarray(0.6180339887, dtype) * k) + n * (i == j)


def hankel_block_torch(row0, rows, n, dtype, device):
    """hankel_block in torch, on `device` (no buffer shared with JAX's allocator)."""
    i = row0 + torch.arange(rows, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return torch.sin(0.6180339887 * (i + j).to(dtype)) + n * (i == j)


def make_matrix(mesh, n, dtype, column_stride=1):
    g = mesh.shape["x"]
    rows = n // g

    def block(_):
        return hankel_block(jax.lax.axis_index("x") * rows, rows, n, dtype, column_stride)

    return jax.jit(jax.shard_map(block, mesh=mesh, in_specs=P("x"), out_specs=P("x", None)))(
        jnp.zeros(g))


def timed(function, repeats):
    function()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def raw_cusolvermg_seconds(devices, n, dtype, tile, repeats):
    """cusolverMgPotrf + potrs (DenseSolver's own timer around them), on torch row blocks."""
    tdtype = {jnp.float64: torch.float64, jnp.float32: torch.float32}[dtype]
    g = len(devices)
    rows = n // g
    solver = torch_linalg._solver(tuple(devices))
    op = _meshla.SolverOp.cholesky_solve
    name = DTYPES[tdtype]
    seconds = []
    for _ in range(repeats):
        a = [hankel_block_torch(p * rows, rows, n, tdtype, f"cuda:{d}")
             for p, d in enumerate(devices)]
        b = [torch.ones(rows, 1, dtype=tdtype, device=f"cuda:{d}") for d in devices]
        x = [torch.empty_like(v) for v in b]
        none = [None] * g
        workspaces = torch_linalg._workspaces(solver, op, n, tdtype, 1, tile, True, devices,
                                              cholesky="cusolvermg")
        info, _, _, inside = solver.run(op, n, name, 1, tile, True, a, b, x, none, none,
                                        workspaces, torch_linalg._streams(devices),
                                        cholesky="cusolvermg")
        if info != 0 or not all(bool(torch.isfinite(v).all()) for v in x):
            raise RuntimeError(f"raw cuSolverMg solve failed: info {info}")
        seconds.append(inside)
        a = b = x = workspaces = None  # lets go of their device memory
        torch.cuda.empty_cache()
    return statistics.median(seconds)


def row_residual(x, n, dtype, column_stride=1):
    """max |(A x - 1)_i| / (||A_i|| ||x||) over the first 64 rows, A rebuilt on the host."""
    rows = np.asarray(hankel_block(0, 64, n, dtype, column_stride), np.float64)
    return float(np.abs(rows @ x - 1.0).max() / (np.linalg.norm(rows, axis=1).max()
                                                 * np.linalg.norm(x)))


def potrf_flops(n):
    return n ** 3 / 3.0


def peer_seconds(what: str, measure):
    """A one-GPU peer's time (``measure()``), or None where it fails (out of memory on one GPU),
    said on stdout."""
    try:
        return measure()
    except (jax.errors.JaxRuntimeError, torch.OutOfMemoryError) as error:
        print(f"{what} failed: {str(error)[:200]}", flush=True)
        return None


def fits(devices, n, dtype, gpus) -> bool:
    """Whether A's row blocks fit 3.2 times over on each GPU (A, a working copy, another
    library's copy)."""
    return 3.2 * n * n * np.dtype(dtype).itemsize / gpus <= devices[0].memory_stats()["bytes_limit"]


def bench_cho_solve(devices, sizes, dtypes, repeats, extra_tiles, gpu_counts):
    rows = []
    counts = [g for g in gpu_counts if g <= len(devices)]
    progress = Progress("dense_solver cho_solve", len(dtypes) * len(sizes) * len(counts))
    for dtype in dtypes:
        for n in sizes:
            single_seconds = None
            for g in counts:
                progress.start(f"{np.dtype(dtype).name} n={n} on {g} GPU(s)")
                mesh = Mesh(np.array(devices[:g]), ("x",))
                if not fits(devices, n, dtype, g):  # XLA's working copy, torch's for raw timing
                    continue
                a = make_matrix(mesh, n, dtype)
                b = jax.device_put(jnp.ones((n, 1), dtype), NamedSharding(mesh, P("x", None)))
                if g == 1:
                    single = jax.jit(lambda a, b: jax.scipy.linalg.cho_solve(
                        jax.scipy.linalg.cho_factor(a, lower=True), b))
                    single_seconds = peer_seconds(f"n={n}: one-GPU jax cho_solve",
                                                  lambda: timed(lambda: single(a, b), repeats))
                tiles = [0] + [t for t in extra_tiles if g == len(devices) and t <= n // g]
                for tile in tiles:
                    solve = jax.jit(functools.partial(linalg.cho_solve, mesh=mesh, tile=tile))
                    meshla_s = timed(lambda: solve(a, b), repeats)
                    residual = row_residual(np.asarray(solve(a, b)[:, 0]), n, dtype)
                    tile_used = _meshla.solver_call(_meshla.SolverOp.cholesky_solve, n,
                                                    JAX_DTYPES[np.dtype(dtype)], 1, g, tile)[0]
                    try:
                        raw_s = raw_cusolvermg_seconds(
                            [d.local_hardware_id for d in devices[:g]], n, dtype, tile_used,
                            repeats)
                    except RuntimeError as error:
                        print(f"n={n} gpus={g}: {error}", flush=True)
                        raw_s = None
                    row = {
                        "op": "cho_solve", "dtype": np.dtype(dtype).name, "n": n, "gpus": g,
                        "tile": tile_used, "meshla_s": meshla_s,
                        "residual_first_rows": residual, "cusolvermg_s": raw_s,
                        "jax_1gpu_s": single_seconds,
                        "meshla_tflops": potrf_flops(n) / meshla_s / 1e12,
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                a = b = None  # lets go of their device memory
    return rows


def bench_lu_solve(devices, sizes, dtypes, repeats, gpu_counts):
    """meshla's lu_solve on each GPU count beside jnp.linalg.solve on one GPU (2/3 n³ flops)."""
    rows = []
    counts = [g for g in gpu_counts if g <= len(devices)]
    progress = Progress("dense_solver lu_solve", len(dtypes) * len(sizes) * len(counts))
    for dtype in dtypes:
        for n in sizes:
            single_seconds = None
            for g in counts:
                progress.start(f"{np.dtype(dtype).name} n={n} on {g} GPU(s)")
                mesh = Mesh(np.array(devices[:g]), ("x",))
                if not fits(devices, n, dtype, g):  # the solver's working copy of A
                    continue
                a = make_matrix(mesh, n, dtype, column_stride=2)
                b = jax.device_put(jnp.ones((n, 1), dtype), NamedSharding(mesh, P("x", None)))
                if g == 1:
                    single = jax.jit(jnp.linalg.solve)
                    single_seconds = peer_seconds(f"n={n}: one-GPU jnp.linalg.solve",
                                                  lambda: timed(lambda: single(a, b), repeats))
                solve = jax.jit(functools.partial(linalg.lu_solve, mesh=mesh))
                meshla_s = timed(lambda: solve(a, b), repeats)
                row = {
                    "op": "lu_solve", "dtype": np.dtype(dtype).name, "n": n, "gpus": g,
                    "tile": _meshla.solver_call(_meshla.SolverOp.lu_solve, n,
                                                JAX_DTYPES[np.dtype(dtype)], 1, g, 0)[0],
                    "meshla_s": meshla_s,
                    "residual_first_rows": row_residual(np.asarray(solve(a, b)[:, 0]), n, dtype,
                                                        column_stride=2),
                    "jax_1gpu_s": single_seconds,
                    "meshla_tflops": 2 * potrf_flops(n) / meshla_s / 1e12,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                a = b = None  # lets go of their device memory
    return rows


def timed_torch(function, devices, repeats):
    """timed() for torch calls on `devices`: every one synchronized."""
    def synchronized():
        out = function()
        for d in devices:
            torch.cuda.synchronize(d)
        return out

    return timed(synchronized, repeats)


def bench_tall(devices, shapes, dtypes, repeats, gpu_counts):
    """The tall-skinny routines (qr, least_squares, svd, polar) of an [m, n] Gaussian A on each
    GPU count, in both frameworks: meshla.jax beside jax's own on one GPU (jnp.linalg.qr,
    lstsq, svd, jax.scipy.linalg.polar), meshla.torch (row blocks, one process) beside
    torch.linalg's on one GPU (qr, lstsq, svd; polar as U Vᴴ and V S Vᴴ of the SVD)."""
    rows = []
    counts = [g for g in gpu_counts if g <= len(devices)]
    ours = {"qr": lambda mesh: lambda a, b: linalg.qr(a, mesh),
            "least_squares": lambda mesh: lambda a, b: linalg.least_squares(a, b, mesh),
            "svd": lambda mesh: lambda a, b: linalg.svd(a, mesh),
            "polar": lambda mesh: lambda a, b: linalg.polar(a, mesh)}
    theirs = {"qr": lambda a, b: jnp.linalg.qr(a),
              "least_squares": lambda a, b: jnp.linalg.lstsq(a, b)[0],
              "svd": lambda a, b: jnp.linalg.svd(a, full_matrices=False),
              "polar": lambda a, b: jax.scipy.linalg.polar(a, method="svd")}
    ours_torch = {"qr": lambda a, b: torch_linalg.qr(a),
                  "least_squares": lambda a, b: torch_linalg.least_squares(a, b),
                  "svd": lambda a, b: torch_linalg.svd(a),
                  "polar": lambda a, b: torch_linalg.polar(a)}

    def torch_polar(a):
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        return u @ vh, (vh.mH * s) @ vh

    theirs_torch = {"qr": lambda a, b: torch.linalg.qr(a),
                    "least_squares": lambda a, b: torch.linalg.lstsq(a, b).solution,
                    "svd": lambda a, b: torch.linalg.svd(a, full_matrices=False),
                    "polar": lambda a, b: torch_polar(a)}
    progress = Progress("dense_solver tall", 2 * len(dtypes) * len(shapes) * len(counts))
    for dtype in dtypes:
        tdtype = {jnp.float64: torch.float64, jnp.float32: torch.float32}[dtype]
        for m, n in shapes:
            one_gpu, one_gpu_torch = {}, {}
            for g in counts:
                progress.start(f"jax {np.dtype(dtype).name} [{m}, {n}] on {g} GPU(s)")
                mesh = Mesh(np.array(devices[:g]), ("x",))
                sharding = NamedSharding(mesh, P("x", None))
                a = jax.device_put(jax.random.normal(jax.random.key(m + n), (m, n), dtype),
                                   sharding)
                b = jax.device_put(jnp.ones((m, 1), dtype), sharding)
                for op, make in ours.items():
                    if g == 1:
                        single = jax.jit(theirs[op])
                        one_gpu[op] = peer_seconds(f"[{m}, {n}] one-GPU jax {op}",
                                                   lambda: timed(lambda: single(a, b), repeats))
                    call = jax.jit(make(mesh))
                    row = {"op": op, "framework": "jax", "dtype": np.dtype(dtype).name, "n": n,
                           "m": m, "gpus": g, "meshla_s": timed(lambda: call(a, b), repeats),
                           "jax_1gpu_s": one_gpu.get(op)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                a = b = None  # lets go of their device memory
                progress.start(f"torch {np.dtype(dtype).name} [{m}, {n}] on {g} GPU(s)")
                ids = [d.local_hardware_id for d in devices[:g]]
                generator = torch.Generator().manual_seed(m + n)
                a = [torch.randn(m // g, n, dtype=tdtype, generator=generator).to(f"cuda:{d}")
                     for d in ids]
                b = [torch.ones(m // g, 1, dtype=tdtype, device=f"cuda:{d}") for d in ids]
                for op in ours_torch:
                    if g == 1:
                        one_gpu_torch[op] = peer_seconds(
                            f"[{m}, {n}] one-GPU torch {op}",
                            lambda: timed_torch(lambda: theirs_torch[op](a[0], b[0]), ids,
                                                repeats))
                    row = {"op": op, "framework": "torch", "dtype": np.dtype(dtype).name,
                           "n": n, "m": m, "gpus": g,
                           "meshla_s": timed_torch(lambda: ours_torch[op](a, b), ids, repeats),
                           "torch_1gpu_s": one_gpu_torch.get(op)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                a = b = None
                torch.cuda.empty_cache()
    return rows


def bench_others(devices, n_eigh, n_inverse, repeats):
    rows = []
    g = min(4, len(devices))
    mesh = Mesh(np.array(devices[:g]), ("x",))
    for op, n in (("eigh", n_eigh), ("cholesky_inverse", n_inverse)):
        if n == 0:
            continue
        a = make_matrix(mesh, n, jnp.float64)
        a1 = jax.device_put(a, devices[0])
        if op == "eigh":
            ours = jax.jit(lambda a: linalg.eigh(a, mesh))
            theirs = jax.jit(jnp.linalg.eigh)
        else:
            ours = jax.jit(lambda a: linalg.cholesky_inverse(a, mesh))
            theirs = jax.jit(jnp.linalg.inv)
        row = {"op": op, "dtype": "float64", "n": n, "gpus": g,
               "meshla_s": timed(lambda: ours(a), repeats),
               "jax_1gpu_s": timed(lambda: theirs(a1), repeats)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        a = a1 = None  # lets go of their device memory
    return rows


def largest(devices, sizes):
    """The largest float64 n of `sizes` solved on every GPU, with A donated."""
    mesh = Mesh(np.array(devices), ("x",))
    solved = []
    for n in sizes:
        try:
            a = make_matrix(mesh, n, jnp.float64)
            b = jax.device_put(jnp.ones((n, 1)), NamedSharding(mesh, P("x", None)))
            solve = jax.jit(functools.partial(linalg.cho_solve, mesh=mesh, return_info=True,
                                              overwrite_a=True), donate_argnums=0)
            start = time.perf_counter()
            x, info = solve(a, b)[:2]  # A's buffer, overwritten, goes at once
            x.block_until_ready()
            seconds = time.perf_counter() - start
            row = {"op": "largest", "n": n, "gpus": len(devices), "seconds": seconds,
                   "info": int(info), "a_donated": a.is_deleted(),
                   "residual_first_rows": row_residual(np.asarray(x[:, 0]), n, jnp.float64)}
            print(json.dumps(row), flush=True)
            solved.append(row)
            x = b = None  # lets go of their device memory
        except Exception as error:  # out of memory: the previous n is the answer
            print(json.dumps({"op": "largest", "n": n, "error": str(error)[:300]}), flush=True)
            break
    return solved


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", default="8192,16384,32768,65536")
    parser.add_argument("--dtypes", default="float64,float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lu-sizes", default="16384,32768")
    parser.add_argument("--tall", default="262144:1024,262144:4096",
                        help="m:n shapes of the tall-skinny routines (qr, least_squares, svd, "
                             "polar)")
    parser.add_argument("--eigh-n", type=int, default=8192)
    parser.add_argument("--inverse-n", type=int, default=16384)
    parser.add_argument("--largest", default="")
    parser.add_argument("--gpu-counts", default="1,2,4",
                        help="GPU counts to solve on (fewer leave more memory to the raw "
                             "cuSolverMg timing, which JAX's pool can starve)")
    parser.add_argument("--extra-tiles", default="",
                        help="tiles tried besides the automatic one, on all GPUs")
    args = parser.parse_args()
    devices = jax.devices("gpu")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    dtypes = [{"float64": jnp.float64, "float32": jnp.float32}[d] for d in args.dtypes.split(",")]
    result = {
        "device": devices[0].device_kind, "gpus": len(devices),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit, "jax": jax.__version__,
        "rows": bench_cho_solve(devices, sizes, dtypes, args.repeats,
                                [int(t) for t in args.extra_tiles.split(",") if t],
                                [int(g) for g in args.gpu_counts.split(",")]),
    }
    gpu_counts = [int(g) for g in args.gpu_counts.split(",")]

    def save():  # after every part: a run cut short keeps the parts it finished
        with open(args.out + ".part", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.out + ".part", args.out)

    save()
    result["rows"] += bench_lu_solve(devices, [int(s) for s in args.lu_sizes.split(",") if s],
                                     dtypes, args.repeats, gpu_counts)
    save()
    tall = [tuple(int(v) for v in shape.split(":")) for shape in args.tall.split(",") if shape]
    result["rows"] += bench_tall(devices, tall, dtypes, args.repeats, gpu_counts)
    save()
    result["rows"] += bench_others(devices, args.eigh_n, args.inverse_n, args.repeats)
    save()
    if args.largest:
        result["rows"] += largest(devices, [int(s) for s in args.largest.split(",")])
        save()
    print(f"\n{result['device']} x{len(devices)}, {result['date']}, commit {args.commit}")
    print(f"{'op':<16}{'dtype':<9}{'n':>7}{'gpus':>5}{'tile':>6}{'meshla s':>10}"
          f"{'cuSolverMg s':>13}{'ratio':>7}{'1-GPU peer s':>13}{'speedup':>8}")
    for row in result["rows"]:
        if row["op"] == "largest":
            continue
        raw, single = row.get("cusolvermg_s"), row.get("jax_1gpu_s", row.get("torch_1gpu_s"))
        raw_text = "" if raw is None else f"{raw:.4f}"
        ratio = "" if raw is None else f"{row['meshla_s'] / raw:.2f}"
        single_text = "" if single is None else f"{single:.4f}"
        speedup = "" if single is None else f"{single / row['meshla_s']:.2f}"
        op = f"torch {row['op']}" if row.get("framework") == "torch" else row["op"]
        print(f"{op:<16}{row['dtype']:<9}{row['n']:>7}{row['gpus']:>5}"
              f"{row.get('tile', ''):>6}{row['meshla_s']:>10.4f}{raw_text:>13}{ratio:>7}"
              f"{single_text:>13}{speedup:>8}")


if __name__ == "__main__":
    main()
