"""The process solvers' engines with one process per GPU, one run (issue 39's engine choice):

    torchrun --nproc-per-node=P bench/process_solver.py --commit SHA --out FILE.json \
        [--sizes 16384,32768,49152] [--dtypes float64,float32]

For each dtype and n, on the same row blocks of A = h(i + j) + n I (a Hankel matrix made
diagonally dominant, so positive definite; h(k) = sin(0.618 k)) and one right-hand side of ones:
meshla.torch.linalg.cho_solve_shard and lu_solve_shard with engine="cusolvermg" (where every
process sees every GPU, the group's first rank solves over all of them through CUDA IPC:
meshla's Cholesky and cuSolverMg's LU on cuSolverMg's layout) and engine="cusolvermp"
(cuSOLVERMp over the ranks' GPUs, what "auto" takes), then on rank 0 alone
torch.linalg.cholesky + cholesky_solve of the whole A (one GPU's time). Times are the median of
``--repeats`` calls from the ranks' barrier to the last rank's return; each solve's relative
residual ||A x - b|| / (||A|| ||x||) is checked. Rows are printed as they come and the JSON (with
device, date, commit) written after each n."""

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from meshla.torch import linalg as torch_linalg

DTYPES = {"float64": torch.float64, "float32": torch.float32}


def hankel_rows(row0, rows, n, dtype, device):
    """Rows [row0, row0 + rows) of h(i + j) + n I."""
    i = row0 + torch.arange(rows, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return torch.sin(0.6180339887 * (i + j).to(dtype)) + n * (i == j)


def relative_residual(a_block, x_block, b_block, group_size):
    """||A x - b|| / (||A||_F ||x||) of the whole system from every rank's blocks."""
    x = [torch.empty_like(x_block) for _ in range(group_size)]
    dist.all_gather(x, x_block.contiguous())
    x = torch.cat(x)
    parts = torch.stack([torch.linalg.norm(a_block @ x - b_block) ** 2,
                         torch.linalg.norm(a_block) ** 2]).double()
    dist.all_reduce(parts)
    return float(parts[0].sqrt() / (parts[1].sqrt() * torch.linalg.norm(x.double())))


def timed(solve, repeats, together=True):
    """(median seconds, the last result) of ``repeats`` calls after a first that builds what the
    engine keeps (communicator, plans); ``together``: from the ranks' barrier to the slowest
    rank's return, else this rank's own time."""
    times, result = [], None
    for _ in range(repeats + 1):
        if together:
            dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = solve()
        torch.cuda.synchronize()
        elapsed = torch.tensor([time.perf_counter() - start], device="cuda")
        if together:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return statistics.median(times[1:]), result


def measure(n, dtype, repeats, rank, size, device):
    """One row: each engine on this rank's blocks, then one GPU's torch solve on rank 0."""
    rows = n // size
    a = hankel_rows(rank * rows, rows, n, dtype, device)
    b = torch.ones(rows, 1, dtype=dtype, device=device)
    row = {"dtype": str(dtype)[6:], "n": n, "gpus": size}
    for routine in (torch_linalg.cho_solve_shard, torch_linalg.lu_solve_shard):
        for engine in ("cusolvermg", "cusolvermp"):
            try:
                seconds, solved = timed(
                    lambda routine=routine, engine=engine: routine(a, b, engine=engine), repeats)
                result = {"seconds": seconds, "residual": relative_residual(a, solved.x, b, size)}
            except Exception as error:  # raised on every rank alike: recorded, the run goes on
                result = {"error": f"{type(error).__name__}: {error}"[:400]}
            row.setdefault(routine.__name__, {})[engine] = result
    a = b = None  # their memory for rank 0's whole A
    if rank == 0:
        whole = hankel_rows(0, n, n, dtype, device)
        ones = torch.ones(n, 1, dtype=dtype, device=device)
        seconds, _ = timed(lambda: torch.cholesky_solve(ones, torch.linalg.cholesky(whole)),
                           repeats, together=False)
        row["one_gpu_torch"] = {"seconds": seconds}
    torch.cuda.empty_cache()
    dist.barrier()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", default="16384,32768,49152")
    parser.add_argument("--dtypes", default="float64,float32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local)
    run = {"device": torch.cuda.get_device_name(device), "device_count": size,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": args.commit, "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())),
           "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE",
                                                  "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                  "NVSHMEM_DISABLE_NVLS")},
           "rows": []}
    for dtype_name in args.dtypes.split(","):
        for n in (int(v) for v in args.sizes.split(",")):
            row = measure(n, DTYPES[dtype_name], args.repeats, rank, size, device)
            if rank == 0:
                print(json.dumps(row), flush=True)
                run["rows"].append(row)
                with open(args.out, "w") as out:
                    json.dump({"runs": [run]}, out, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
