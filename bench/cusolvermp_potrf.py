"""cuSOLVERMp potrf on 2-D block-cyclic grids (issue 5: does it scale better than cuSolverMg?).

One process per GPU, the whole world is the grid:
  torchrun --nproc-per-node=P bench/cusolvermp_potrf.py --library /tmp/libcusolvermp_potrf.so \
      --commit SHA --out cusolvermp.json [--sizes 16384 32768 65536] [--block 256 512 1024]
The library is bench/cusolvermp_potrf.cu built against the nvidia-cusolvermp-cu13 wheel
(tests/gpu/job.sh's cusolvermp-bench step builds it). Every grid nprow x npcol with nprow * npcol
= P runs every (n, block); a time is the median of --reps factorizations, taken on the slowest
rank. Rank 0 appends the run to the JSON file at --out and prints a table last.
"""

import os

# Never use NVLink multicast (NVLS): set before NCCL can read the environment.
for _name, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                      "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402
import ctypes  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from datetime import datetime, timezone  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def unique_id(library) -> bytes:
    buffer = ctypes.create_string_buffer(128)
    if library.cusolvermp_unique_id(buffer) != 0:
        raise RuntimeError("ncclGetUniqueId failed")
    return buffer.raw


def _row_text(r):
    head = f"{r['grid']:<5} {r['n']:>6} {r['block']:>5}"
    if r["error"]:
        return f"{head} failed: {r['error']}"
    return f"{head} {r['time_s']:8.3f} {r['tflops']:8.1f} {r['info']}"


def grids(size):
    return [(rows, size // rows) for rows in range(1, size + 1) if size % rows == 0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--library", required=True)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--block", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--grids", nargs="+",
                        help="e.g. 2x2 1x4 (default: every grid of the world)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds one factorization may take before the measurement is "
                             "abandoned (a hung rank aborts its communicator)")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    library = ctypes.CDLL(args.library)
    probe = library.cusolvermp_potrf_seconds
    probe.restype = ctypes.c_int
    rows_out = []
    chosen = ([tuple(int(v) for v in g.split("x")) for g in args.grids] if args.grids
              else grids(size))
    for nprow, npcol in chosen:
        for n in args.sizes:
            for block in args.block:
                box = [unique_id(library) if rank == 0 else None]
                dist.broadcast_object_list(box, src=0)
                seconds = (ctypes.c_double * args.reps)()
                info = ctypes.c_int(-1)
                error = ctypes.create_string_buffer(512)
                failed = probe(box[0], rank, size, local_rank, nprow, npcol, n, block, args.reps,
                               ctypes.c_double(args.timeout), seconds, ctypes.byref(info), error,
                               len(error))
                outcome = [None] * size
                dist.all_gather_object(
                    outcome, (failed, statistics.median(seconds) if not failed else None,
                              info.value, error.value.decode()))
                if rank == 0:
                    errors = [o[3] for o in outcome if o[0]]
                    time_s = None if errors else max(o[1] for o in outcome)
                    rows_out.append({
                        "grid": f"{nprow}x{npcol}", "n": n, "block": block, "time_s": time_s,
                        "tflops": None if time_s is None else n ** 3 / 3 / time_s / 1e12,
                        "info": max(o[2] for o in outcome), "error": errors[0] if errors else None,
                    })
                    print(_row_text(rows_out[-1]), flush=True)  # what is done survives a kill
    if rank == 0:
        run = {"device": torch.cuda.get_device_name(0), "device_count": size,
               "date": datetime.now(timezone.utc).isoformat(), "commit": args.commit,
               "torch": torch.__version__, "op": "cusolverMpPotrf fp64 lower", "reps": args.reps,
               "rows": rows_out}
        runs = []
        if os.path.exists(args.out):
            with open(args.out) as f:
                runs = json.load(f)["runs"]
        with open(args.out, "w") as f:
            json.dump({"runs": runs + [run]}, f, indent=2)
        print(f"{'grid':<5} {'n':>6} {'block':>5} {'time_s':>8} {'TFLOP/s':>8} info")
        for r in rows_out:
            print(_row_text(r))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
