"""Where the time of one grouped GEMM call goes: every GPU kernel of meshla's passes and of torch's
grouped_mm, with its mean duration over `--calls` calls, beside the call's wall time.

  python bench/profile_grouped.py --shape "qwen3-30b-a3b up_proj" --routing skewed

The shapes and routings are bench/grouped_linear.py's. A wall time above the sum of the kernels
is launch gaps; a kernel other than the GEMM that takes noticeable time is overhead to remove. The
host time is what one call costs the CPU (calls queued behind a sleeping kernel).
`--order` rearranges the skewed routing's experts (same sizes, other order) to see whether the order
in which the persistent kernel meets large and small groups changes its time.
"""

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

from grouped_linear import SHAPES, routing, torch_grouped_mm
import meshla.torch as mt
from meshla.torch import grouped


def profile_pass(label: str, fn, calls: int):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) / calls * 1e6
    # Host time alone: the calls are queued behind a long sleep kernel, so none waits for the GPU.
    torch.cuda._sleep(int(2e9))
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host_us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time / calls
    kernels_us = sum(per_kernel.values())
    print(f"{label}: wall {wall_us:.1f} us per call, kernels {kernels_us:.1f} us, "
          f"host {host_us:.1f} us")
    for name, us in sorted(per_kernel.items(), key=lambda item: -item[1]):
        print(f"    {us:9.1f} us  {name[:110]}")


def ordered(sizes: list[int], order: str) -> list[int]:
    if order == "descending":
        return sorted(sizes, reverse=True)
    if order == "ascending":
        return sorted(sizes)
    if order == "alternating":  # largest, smallest, second largest, second smallest, ...
        by_size = sorted(sizes, reverse=True)
        return [by_size[i // 2] if i % 2 == 0 else by_size[-1 - i // 2] for i in range(len(sizes))]
    return sizes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", action="append", help="a name from grouped_linear.SHAPES "
                        "(repeatable; default: all)")
    parser.add_argument("--routing", choices=["uniform", "skewed", "both"], default="both")
    parser.add_argument("--pass", dest="passes", action="append",
                        choices=["forward", "dgrad", "wgrad"], help="repeatable; default: all")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--order", choices=["random", "descending", "ascending", "alternating"],
                        action="append", help="expert order of the skewed routing (repeatable; "
                        "default: random, bench/grouped_linear.py's)")
    args = parser.parse_args()

    dev, dtype = torch.device("cuda"), torch.bfloat16
    print(torch.cuda.get_device_name(), torch.__version__)
    gmm = torch_grouped_mm()
    routings = [False, True] if args.routing == "both" else [args.routing == "skewed"]
    for name, groups, k, n, tokens in SHAPES:
        if args.shape and name not in args.shape:
            continue
        cases = [(skewed, order) for skewed in routings
                 for order in (args.order or ["random"] if skewed else ["random"])]
        for skewed, order in cases:
            sizes = ordered(routing(groups, tokens, skewed), order)
            m_splits = torch.tensor(sizes, device=dev)
            offsets = torch.cumsum(m_splits, 0).to(torch.int32)
            x = torch.randn(tokens, k, device=dev, dtype=dtype)
            dy = torch.randn(tokens, n, device=dev, dtype=dtype)
            stride = mt.packed_group_stride(n, k, dtype)
            weight = grouped._packed(torch.randn(groups * stride, device=dev, dtype=dtype),
                                     groups, n, k, stride)
            weight_dense = weight.contiguous()
            routing_name = f"skewed, {order} order" if skewed else "uniform"
            print(f"\n## {name}, {routing_name} (largest group {max(sizes)})")
            passes = {
                "forward": (lambda: torch.ops.meshla.grouped_mm(x, m_splits, weight, None),
                            lambda: gmm(x, weight_dense.transpose(-2, -1), offs=offsets)),
                "dgrad": (lambda: torch.ops.meshla.grouped_mm_dgrad(dy, m_splits, weight),
                          lambda: gmm(dy, weight_dense, offs=offsets)),
                "wgrad": (lambda: torch.ops.meshla.grouped_mm_wgrad(x, dy, m_splits, stride),
                          lambda: gmm(dy.t(), x, offs=offsets)),
            }
            for pass_name, (ours, peer) in passes.items():
                if args.passes and pass_name not in args.passes:
                    continue
                profile_pass(f"meshla {pass_name}", ours, args.calls)
                if gmm is not None:
                    profile_pass(f"torch grouped_mm {pass_name}", peer, args.calls)


if __name__ == "__main__":
    main()
