"""JAXMg 1.4.1 (cuSOLVERMp 0.9.1) beside meshla, one process per GPU under jax.distributed, as
JAXMg runs (issue 39's peer):

  python3 bench/jaxmg_peer.py --processes 2 --commit SHA --out FILE.json

The parent starts --processes ranks (rank r sees GPU r: local_device_ids), each a jax.distributed
process of one GPU; every rank runs every case, rank 0 writes the rows. JAXMg: potrs, lu_solve,
syevd, least_squares, qr, gesvd and polar of an n x n matrix (--sizes) row-sharded over the ranks
(P("x", None)), tile --tile, inputs kept (donate=False), one right-hand side; meshla's routine
for each in the same processes beside it (cho_solve, lu_solve and eigh gather A on every device
and solve it there, cuSolverMg driving one process's GPUs; qr, least_squares, svd and polar run
the tall-skinny QR, whose stacked factors are as large as A when square); with --engines
meshla-cusolvermp, in a run of its own, cho_solve and lu_solve on meshla's cuSOLVERMp 0.8 engine
at its own tiles. Also qr,
least_squares, svd and polar of the tall shapes (--tall m:n) in both. meshla's one-process
solvers are timed by bench/dense_solver.py in the same job. Matrices are
bench/dense_solver.py's: h(i + j) + n·I (SPD; symmetric for syevd), h(i + 2j) + n·I for the
general routines, generated on the GPUs. A time is the median of --repeats jitted calls after a
warm-up, each blocked on; a row notes a case that raised (out of memory, say) instead of ending
the run. Rank 0 rewrites --out after every case, so a run cut short keeps what it measured.
Nothing waits forever: each rank prints the case it starts (stderr), and a rank still in one
case (or in jax.distributed's start) after --case-timeout seconds prints every thread's Python
stack and exits; the parent kills every rank after --deadline seconds.
Needs JAXMg's stack importable (PYTHONPATH) and NCCL >= 2.29 ahead of torch's (LD_PRELOAD): see
.probe/kit_stage.sh.
"""

import argparse
import datetime
import faulthandler
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", default="16384,32768")
    parser.add_argument("--tall", default="262144:1024")
    parser.add_argument("--tile", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engines", default="jaxmg,meshla",
                        help="of jaxmg, meshla, meshla-cusolvermp (meshla's cho_solve and "
                        "lu_solve on its cuSOLVERMp 0.8 engine: a run of its own, without JAXMg's "
                        "stack, whose cuSOLVERMp 0.9.1 has the same library name)")
    parser.add_argument("--case-timeout", type=float, default=300,
                        help="seconds a rank may spend in one case before it dumps its stacks "
                        "and exits")
    parser.add_argument("--deadline", type=float, default=1800,
                        help="seconds after which the parent kills every rank")
    parser.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    return parser.parse_args()


ENGINES = ("jaxmg", "meshla", "meshla-cusolvermp")


def launch(args):
    """Starts the ranks and waits for them; rank 0 writes --out. Each rank leads a process group
    of its own, killed whatever ends the wait (the deadline, an error, SIGINT or SIGTERM), so
    that no rank outlives the run holding its GPU."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{sock.getsockname()[1]}"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the finally
    ranks = []
    try:
        ranks += [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--rank", str(rank),
                                    "--coordinator", coordinator], start_new_session=True)
                  for rank in range(args.processes)]
        end = time.monotonic() + args.deadline
        try:
            codes = [rank.wait(timeout=max(end - time.monotonic(), 0)) for rank in ranks]
        except subprocess.TimeoutExpired:
            print(f"jaxmg_peer: the ranks ran past --deadline {args.deadline:g} s; killing them",
                  file=sys.stderr, flush=True)
            sys.exit(124)
        sys.exit(next((code for code in codes if code != 0), 0))
    finally:
        for rank in ranks:
            if rank.poll() is None:
                os.killpg(rank.pid, signal.SIGKILL)


def run(args):
    faulthandler.dump_traceback_later(args.case_timeout, exit=True)  # the start, too
    import jax
    jax.distributed.initialize(args.coordinator, num_processes=args.processes,
                               process_id=args.rank, local_device_ids=[args.rank])
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from dense_solver import hankel_block
    from meshla.jax import linalg

    engines = args.engines.split(",")
    jaxmg = None
    if "jaxmg" in engines:
        import jaxmg
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows = P("x", None)
    sharding = NamedSharding(mesh, rows)

    def matrix(m, n, column_stride):
        per_rank = m // args.processes

        def block(_):
            return hankel_block(jax.lax.axis_index("x") * per_rank, per_rank, n, jnp.float64,
                                column_stride)

        return jax.jit(jax.shard_map(block, mesh=mesh, in_specs=P("x"), out_specs=rows))(
            jnp.zeros(args.processes))

    def timed(call):
        jax.block_until_ready(call())
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(call())
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    t = args.tile
    spec = dict(mesh=mesh, matrix_specs=rows, donate=False)
    square = {
        "potrs": (1, lambda a, b: jaxmg.potrs(a, b, t, **spec)),
        "lu_solve": (2, lambda a, b: jaxmg.lu_solve(a, b, t, **spec)),
        "syevd": (1, lambda a, b: jaxmg.syevd(a, t, **spec)),
        "least_squares": (2, lambda a, b: jaxmg.least_squares(a, b, t, **spec)),
        "qr": (2, lambda a, b: jaxmg.qr(a, t, **spec)),
        "gesvd": (2, lambda a, b: jaxmg.gesvd(a, t, **spec)),
        "polar": (2, lambda a, b: jaxmg.polar(a, t, **spec)),
    }
    tall_meshla = {
        "qr": lambda a, b: linalg.qr(a, mesh),
        "least_squares": lambda a, b: linalg.least_squares(a, b, mesh),
        "gesvd": lambda a, b: linalg.svd(a, mesh),
        "polar": lambda a, b: linalg.polar(a, mesh),
    }
    square_meshla = {  # cuSolverMg's paths: JAXMg's cuSOLVERMp is not meshla's release
        "potrs": lambda a, b: linalg.cho_solve(a, b, mesh, engine="cusolvermg"),
        "lu_solve": lambda a, b: linalg.lu_solve(a, b, mesh, engine="cusolvermg"),
        "syevd": lambda a, b: linalg.eigh(a, mesh),
        **tall_meshla,
    }
    # meshla's engine over the processes' GPUs at its own tiles (the Cholesky solve's 1024, as
    # JAXMg's; the LU solve's within cuSolverMg's limit).
    square_engine = {
        "potrs": lambda a, b: linalg.cho_solve(a, b, mesh, engine="cusolvermp"),
        "lu_solve": lambda a, b: linalg.lu_solve(a, b, mesh, engine="cusolvermp"),
    }
    cases = []  # the tall shapes, then the square ones from the smallest: a short run says much
    for shape in (s for s in args.tall.split(",") if s):
        m, n = (int(v) for v in shape.split(":"))
        if "meshla" in engines:
            cases += [(op, call, "meshla", m, n, 2) for op, call in tall_meshla.items()]
        if jaxmg is not None:
            cases += [(op, square[op][1], "jaxmg", m, n, 2) for op in tall_meshla]
    for n in sorted(int(v) for v in args.sizes.split(",") if v):
        for op, (stride, engine_call) in square.items():
            if "meshla" in engines:
                cases.append((op, square_meshla[op], "meshla", n, n, stride))
            if "meshla-cusolvermp" in engines and op in square_engine:
                cases.append((op, square_engine[op], "meshla-cusolvermp", n, n, stride))
            if jaxmg is not None:
                cases.append((op, engine_call, "jaxmg", n, n, stride))
    record = {"device": jax.devices()[0].device_kind, "processes": args.processes,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": args.commit, "jax": jax.__version__,
              "jaxmg": getattr(jaxmg, "__version__", None), "rows": []}
    for index, (op, call, engine, m, n, stride) in enumerate(cases):
        print(f"[rank {args.rank}] case {index + 1}/{len(cases)}: {engine} {op} [{m}, {n}]",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(args.case_timeout, exit=True)
        row = {"op": op, "engine": engine, "m": m, "n": n, "dtype": "float64",
               "processes": args.processes, "tile": t if engine == "jaxmg" else None}
        try:
            a = matrix(m, n, stride)
            b = jax.device_put(jnp.ones((m, 1)), sharding)
            jitted = jax.jit(call)
            row["seconds"] = timed(lambda: jitted(a, b))
            leaves = jax.tree_util.tree_leaves(jitted(a, b))
            row["finite"] = all(bool(jnp.isfinite(leaf).all()) for leaf in leaves
                                if jnp.issubdtype(leaf.dtype, jnp.inexact))
        except Exception as error:  # recorded; the other cases still run
            row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        a = b = None  # lets go of their device memory
        record["rows"].append(row)
        if args.rank == 0:
            print(json.dumps(row), flush=True)
            with open(args.out + ".part", "w") as f:  # replaced whole: a kill leaves the last
                json.dump(record, f, indent=1)
            os.replace(args.out + ".part", args.out)
    faulthandler.cancel_dump_traceback_later()
    jax.distributed.shutdown()


if __name__ == "__main__":
    arguments = parse_args()
    asked = set(arguments.engines.split(","))
    if not asked <= set(ENGINES) or {"jaxmg", "meshla-cusolvermp"} <= asked:
        sys.exit(f"jaxmg_peer: --engines {arguments.engines}: a comma-separated subset of "
                 f"{', '.join(ENGINES)}, without both jaxmg and meshla-cusolvermp (one "
                 "cuSOLVERMp library a process)")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    launch(arguments) if arguments.rank < 0 else run(arguments)
