"""Where the time of meshla's collective matmul goes, call by call, on every rank.

  torchrun --nproc-per-node=TP bench/profile_collective_matmul.py \\
      --cases all_gather_matmul:8192 matmul_all_reduce:8192:4 --backend symmetric

Each case is OP:M[:CHUNKS] on bench/collective_matmul.py's shapes (a Llama-70B MLP in bf16). For
`--calls` calls queued back to back, every rank measures:
  host_us   the host's time to enqueue one call
  gpu_ms    time per call between CUDA events, as the benchmark measures it
and, from a profile of the same calls:
  period    time between the first GEMMs of consecutive calls
  gemms     GEMM kernel time per call; `wait` is the time inside a call between one GEMM's end
            and the next one's start, `between` from a call's last GEMM to the next call's first
  alone     the same GEMM shapes with no communication (meshla on a one-GPU group, so the same
            tuned kernels), and torch.matmul of the whole product
  per-GEMM  mean duration and mean wait before it, by position in the call (rank 0)
Rank 0 prints every rank's line; `--trace-dir` keeps each rank's Chrome trace of each case.
"""

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

HIDDEN, INTERMEDIATE = 8192, 28672
NOT_GEMMS = ("sum_slots", "add_bias", "nccl")


def traced(fn, calls: int, path: str) -> list[dict]:
    """GPU activities of `calls` back-to-back calls of fn, by start time."""
    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    gpu = ("kernel", "gpu_memcpy", "gpu_memset")
    return sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in gpu),
                  key=lambda e: e["ts"])


def gemm_kernels(events: list[dict]) -> list[dict]:
    """The GEMMs, on whichever streams they ran; where two overlap, `wait` goes negative."""
    return [e for e in events
            if e["cat"] == "kernel" and not any(s in e["name"] for s in NOT_GEMMS)]


def call_stats(events: list[dict], calls: int) -> dict:
    gemms = gemm_kernels(events)
    per_call = len(gemms) // calls
    split = [gemms[i * per_call:(i + 1) * per_call] for i in range(calls)]
    # The first call starts from idle GPUs; the steady state is the rest.
    steady = range(1, calls)
    def end(e):
        return e["ts"] + e["dur"]

    waits = [[c[j]["ts"] - end(c[j - 1]) for j in range(1, per_call)] for c in split]
    copies = [e for e in events if e["cat"] == "gpu_memcpy"]
    return {
        "gemms_per_call": per_call,
        "period_ms": statistics.mean(split[i][0]["ts"] - split[i - 1][0]["ts"]
                                     for i in steady) / 1e3,
        "gemm_ms": statistics.mean(sum(e["dur"] for e in split[i]) for i in steady) / 1e3,
        "wait_ms": statistics.mean(sum(waits[i]) for i in steady) / 1e3,
        "between_ms": statistics.mean(split[i][0]["ts"] - end(split[i - 1][-1])
                                      for i in steady) / 1e3,
        "gemm_us_by_position": [round(statistics.mean(split[i][j]["dur"] for i in steady), 1)
                                for j in range(per_call)],
        "wait_us_by_position": [0.0] + [round(statistics.mean(waits[i][j - 1] for i in steady), 1)
                                        for j in range(1, per_call)],
        "copy_us_mean": round(statistics.mean(e["dur"] for e in copies), 1) if copies else None,
        "copies_per_call": len(copies) / calls,
    }


def gemm_kernel_ms(fn, calls: int, path: str) -> float:
    """Mean GEMM kernel time of one call of fn, from a profile."""
    gemms = gemm_kernels(traced(fn, calls, path))
    return sum(e["dur"] for e in gemms) / calls / 1e3


def host_and_gpu(fn, calls: int) -> tuple[float, float]:
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host_us = (time.perf_counter() - t0) / calls * 1e6
    end.record()
    end.synchronize()
    return host_us, start.elapsed_time(end) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["all_gather_matmul:8192"],
                        help="OP:M[:CHUNKS], e.g. matmul_all_reduce:8192:4")
    parser.add_argument("--backend", default="symmetric")
    parser.add_argument("--algorithm", default="ring")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--trace-dir", default=None)
    args = parser.parse_args()
    import meshla.torch as mt

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, tp = dist.get_rank(), dist.get_world_size()
    group = mt.group_from_process_group(device=device)
    alone_group = mt.local_groups([local_rank])[0]
    trace_dir = args.trace_dir or tempfile.mkdtemp()
    os.makedirs(trace_dir, exist_ok=True)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16).mul_(0.02)

    for case in args.cases:
        op, m, *rest = case.split(":")
        m, chunks = int(m), int(rest[0]) if rest else 0
        if op == "all_gather_matmul":
            k, n, a_rows = HIDDEN, INTERMEDIATE // tp, m // tp
        else:
            k, n, a_rows = INTERMEDIATE // tp, HIDDEN, m
        a, b = randn(a_rows, k), randn(k, n)
        full_a = randn(m, k)
        full_out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
        meshla_op = getattr(mt, op)

        def call():
            return meshla_op(a, b, group, backend=args.backend, algorithm=args.algorithm,
                             chunks=chunks)

        for _ in range(5):
            call()
        host_us, gpu_ms = host_and_gpu(call, args.calls)
        stats = call_stats(traced(call, args.calls, f"{trace_dir}/{op}_{m}_rank{rank}.json"),
                           args.calls)
        # The same GEMMs alone: meshla's tuned kernel on a one-GPU group, one per block of
        # rows that the call multiplies (all_gather_matmul batches some blocks, so count blocks,
        # not kernels).
        blocks = tp if op == "all_gather_matmul" else stats["gemms_per_call"]
        rows = m // blocks
        block = randn(rows, k)
        alone = lambda: mt.all_gather_matmul(block, b, alone_group, backend="nccl",  # noqa: E731
                                             algorithm="sequential")
        for _ in range(3):
            alone()
        alone_ms = gemm_kernel_ms(alone, args.calls, f"{trace_dir}/alone_rank{rank}.json")
        torch_alone_ms = gemm_kernel_ms(lambda: torch.matmul(full_a, b, out=full_out), args.calls,
                                        f"{trace_dir}/torch_rank{rank}.json")
        stats.update(rank=rank, host_us=round(host_us, 1), gpu_ms=round(gpu_ms, 3),
                     alone_ms=round(alone_ms * blocks, 3),
                     torch_gemm_ms=round(torch_alone_ms, 3), alone_rows=rows)
        everyone = [None] * tp
        dist.all_gather_object(everyone, stats)
        if rank == 0:
            print(f"\n{op} M={m} tp={tp} backend={args.backend} chunks={chunks}: "
                  f"{stats['gemms_per_call']} GEMM kernels, {blocks} blocks of {rows} rows "
                  "per call")
            print("rank host_us gpu_ms period_ms gemm_ms wait_ms between_ms alone_ms torch_gemm_ms "
                  "copies/call copy_us")
            for s in everyone:
                print(f"{s['rank']:4d} {s['host_us']:7.1f} {s['gpu_ms']:6.3f} "
                      f"{s['period_ms']:9.3f} "
                      f"{s['gemm_ms']:7.3f} {s['wait_ms']:7.3f} {s['between_ms']:10.3f} "
                      f"{s['alone_ms']:8.3f} {s['torch_gemm_ms']:13.3f} "
                      f"{s['copies_per_call']:11.1f} {s['copy_us_mean']}")
            print("rank 0 GEMM us by position:", stats["gemm_us_by_position"])
            print("rank 0 wait us before each: ", stats["wait_us_by_position"])
        a = b = full_a = full_out = block = None  # lets go of their device memory
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
