"""Collective matmuls on a group of one rank against torch's GEMM of the same shape.

    python3 bench/one_rank.py --commit SHA [--out bench/results/FILE.json]

A model written for tensor parallelism also runs with tp=1 (on one GPU, or to debug), where each
collective is the identity and the call should cost what torch.mm does. For each shape and each
op (backend "auto", bf16, through the public functions as a model calls them; with
column_parallel_matmul, whose forward is a local GEMM after its checks), this times `calls`
calls queued back to back and reports, per call, the time until the device is done (the median of
`reps` repetitions) and the host's time to enqueue it. Small shapes measure the host's cost per
call; large ones the device's. The first call of each shape builds its plan outside the timing.
"""

import argparse
import datetime
import json
import statistics
import time

import torch

import meshla.torch as mt

SHAPES = ((128, 256, 128), (1024, 4096, 4096), (8192, 8192, 7168))


def per_call_us(fn, calls: int, reps: int) -> tuple[float, float]:
    """(median device-done time, median enqueue time) per call, in us."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    done, enqueued = [], []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        queued = time.perf_counter()
        torch.cuda.synchronize()
        end = time.perf_counter()
        done.append((end - start) / calls * 1e6)
        enqueued.append((queued - start) / calls * 1e6)
    return statistics.median(done), statistics.median(enqueued)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", help="JSON file to append this run to")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    torch.cuda.set_device(0)
    (group,) = mt.local_groups([0])
    rows = []
    for m, k, n in SHAPES:
        torch.manual_seed(0)
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        expected = (a.float() @ b.float())
        variants = {
            "torch.mm": lambda: torch.mm(a, b),
            "all_gather_matmul": lambda: mt.all_gather_matmul(a, b, group),
            "matmul_reduce_scatter": lambda: mt.matmul_reduce_scatter(a, b, group),
            "matmul_all_reduce": lambda: mt.matmul_all_reduce(a, b, group),
            # The column-parallel layer's forward: a local GEMM after the checks of its backward.
            "column_parallel_matmul": lambda: mt.column_parallel_matmul(a, b, group),
        }
        for name, fn in variants.items():
            error = ((fn().float() - expected).norm() / expected.norm()).item()
            if error > 2e-2:
                raise SystemExit(f"{name} at m={m}, k={k}, n={n}: relative error {error:.2e}")
            done, enqueued = per_call_us(fn, args.calls, args.reps)
            rows.append({"op": name, "m": m, "k": k, "n": n, "us_per_call": done,
                         "enqueue_us_per_call": enqueued})

    run = {"device": torch.cuda.get_device_name(), "commit": args.commit,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "dtype": "bfloat16", "calls": args.calls,
           "reps": args.reps, "rows": rows}
    print(f"### tp=1: {run['device']}, {run['date']}, commit {run['commit']}, "
          f"torch {run['torch']}, bf16\n")
    print("us per call until the device is done (host enqueue time per call); ratio to torch.mm\n")
    print("| m | k | n | " + " | ".join(variants) + " |")
    print("|---|---|---|" + "---|" * len(variants))
    for m, k, n in SHAPES:
        shape_rows = {r["op"]: r for r in rows if (r["m"], r["k"], r["n"]) == (m, k, n)}
        base = shape_rows["torch.mm"]["us_per_call"]
        cells = [f"{r['us_per_call']:.1f} ({r['enqueue_us_per_call']:.1f}) "
                 f"{r['us_per_call'] / base:.2f}x" for r in shape_rows.values()]
        print(f"| {m} | {k} | {n} | " + " | ".join(cells) + " |")
    if args.out:
        try:
            with open(args.out) as f:
                runs = json.load(f)
        except FileNotFoundError:
            runs = []
        runs.append(run)
        with open(args.out, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
