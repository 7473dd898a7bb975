"""Timeline of one meshla collective matmul on every stream, to see where an overlap is lost.

  torchrun --nproc-per-node=TP bench/profile_collective_matmul.py --op all_gather_matmul \\
      --tokens 8192 --backend symmetric --trace-dir DIR

Each rank writes a Chrome trace of `--calls` calls (after warm-up) to DIR/rank<R>.json, and rank 0
prints its GPU activity of the last call: kernel or copy, stream, start and duration in us. The
shapes are bench/collective_matmul.py's (a Llama-70B MLP in bf16).
"""

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import json  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

HIDDEN, INTERMEDIATE = 8192, 28672


def gpu_events(path: str) -> list[dict]:
    with open(path) as f:
        trace = json.load(f)
    return sorted((e for e in trace["traceEvents"]
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])


def print_last_call(events: list[dict], calls: int):
    # Calls run back to back; split them at the GEMMs' count, which is the same for each call.
    gemm = [e for e in events if e["cat"] == "kernel" and "sum_slots" not in e["name"]]
    per_call = len(gemm) // calls
    # The last call's pushes may start a little before its first GEMM.
    start = (gemm[-per_call]["ts"] if per_call else events[0]["ts"]) - 20
    print(f"{'start_us':>9} {'dur_us':>8} {'stream':>6}  activity")
    for e in events:
        if e["ts"] < start:
            continue
        name = e["name"] if e["cat"] != "kernel" else e["name"][:70]
        print(f"{e['ts'] - start:9.1f} {e['dur']:8.1f} {e['tid']!s:>6}  {name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="all_gather_matmul")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--backend", default="symmetric")
    parser.add_argument("--algorithm", default="ring")
    parser.add_argument("--chunks", type=int, default=0)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--trace-dir", required=True)
    args = parser.parse_args()
    import meshla.torch as mt

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    tp = dist.get_world_size()
    group = mt.group_from_process_group(device=device)
    m = args.tokens
    if args.op == "all_gather_matmul":
        a = torch.randn(m // tp, HIDDEN, device=device, dtype=torch.bfloat16)
        b = torch.randn(HIDDEN, INTERMEDIATE // tp, device=device, dtype=torch.bfloat16)
    else:
        a = torch.randn(m, INTERMEDIATE // tp, device=device, dtype=torch.bfloat16)
        b = torch.randn(INTERMEDIATE // tp, HIDDEN, device=device, dtype=torch.bfloat16)
    op = getattr(mt, args.op)

    def call():
        return op(a, b, group, backend=args.backend, algorithm=args.algorithm, chunks=args.chunks)

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.calls):
            call()
        torch.cuda.synchronize()
    os.makedirs(args.trace_dir, exist_ok=True)
    path = os.path.join(args.trace_dir, f"rank{dist.get_rank()}.json")
    prof.export_chrome_trace(path)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"{args.op} M={m} tp={tp} backend={args.backend} algorithm={args.algorithm}")
        print_last_call(gpu_events(path), args.calls)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
