"""Grouped GEMM benchmark on one GPU: meshla against torch's grouped_mm, a per-expert torch.matmul
loop and one dense GEMM of the same total size, in the same run.

  python bench/grouped_linear.py --commit SHA --out results.json

TFLOP/s of forward (y = x W_gᵀ), dgrad (dx = dy W_g) and wgrad (dW_g = dy_gᵀ x_g) for each shape
and routing. Timings: CUDA events around `--measure-ms` of back-to-back calls after `--warmup-ms` of
the same calls, the median of `--repeats` such runs taken in turns with the peers' (time_ms), with
the SM clock (NVML) of each. The table is printed last; JSON carries device, date and commit.
"""

import argparse
import ctypes
import datetime
import json
import math
import statistics
import sys
import time

import torch
from progress import Progress

import meshla.torch as mt
from meshla.torch import grouped

# (name, groups, in_features (K), out_features (N), tokens)
SHAPES = [
    ("deepseek-v3 8 experts", 8, 7168, 2048, 65536),
    ("deepseek-v3 32 experts", 32, 7168, 2048, 65536),
    ("qwen3-30b-a3b up_proj", 128, 2048, 1536, 65536),
    ("16 x 2048 rows", 16, 2048, 768, 32768),
]


def routing(groups: int, tokens: int, skewed: bool, seed: int = 0) -> list[int]:
    """Uniform: equal shares. Skewed: Zipf-like shares (expert i gets ~1/(i+1)^1.2 of the load,
    in a random expert order), so a few experts are large and many small."""
    if not skewed:
        sizes = [tokens // groups] * groups
    else:
        gen = torch.Generator().manual_seed(seed)
        weights = 1.0 / torch.arange(1, groups + 1, dtype=torch.float64) ** 1.2
        weights = weights[torch.randperm(groups, generator=gen)]
        sizes = (weights / weights.sum() * tokens).floor().long().tolist()
    sizes[0] += tokens - sum(sizes)
    return sizes


class Nvml:
    """The GPU's SM clock through NVML (the driver's library): the clock each method runs at."""

    def __init__(self, index: int):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        if self.lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit_v2 failed")
        self.handle = ctypes.c_void_p()
        props = torch.cuda.get_device_properties(index)
        pci_bus_id = (f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:"
                      f"{props.pci_device_id:02x}.0").encode()
        if self.lib.nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id, ctypes.byref(self.handle)) != 0:
            raise OSError(f"no NVML device at {pci_bus_id}")

    def sm_clock_mhz(self):
        """The SM clock now, or None where NVML cannot read it."""
        clock = ctypes.c_uint()
        # 1: NVML_CLOCK_SM
        if self.lib.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(clock)) != 0:
            return None
        return clock.value


def open_nvml():
    """NVML for the current GPU, or None where the driver's library cannot be loaded."""
    try:
        return Nvml(torch.cuda.current_device())
    except (OSError, AttributeError) as error:
        print(f"no SM clocks: NVML unavailable ({error})", file=sys.stderr)
        return None


def calls_for(ms: float, per_call_ms: float) -> int:
    return max(4, math.ceil(ms / per_call_ms))


def enqueue(fn, calls: int):
    for _ in range(calls):
        fn()


def time_ms(fns: dict, warmup_ms: float, measure_ms: float, repeats: int, nvml) -> tuple:
    """Median ms per call of each of `fns`, and the median SM clock (MHz) halfway through its
    timed stretches. A GEMM at full speed draws the GPU's power limit, and the clocks follow the
    power draw within a few tenths of a second, so a short run measures the clocks that the
    function before it left (NOTES 49): each function runs alone for `warmup_ms` before each timed
    stretch of `measure_ms`, so each is measured at the clocks of its own steady state. The
    functions take turns (`repeats` rounds, each starting one function later) so that a drift of
    the machine falls on all alike. A function that raises is recorded by its error."""
    runs = {label: {"ms": [], "mhz": []} for label in fns}
    per_call, errors = {}, {}
    for label, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            per_call[label] = max((time.perf_counter() - start) * 1e3, 1e-3)
        except Exception as error:  # a peer that refuses a shape is recorded, not fatal
            errors[label] = str(error).splitlines()[0][:160]
    labels = [label for label in fns if label not in errors]
    if not labels:
        return {}, errors
    for round_index in range(repeats):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            fn = fns[label]
            enqueue(fn, calls_for(warmup_ms, per_call[label]))
            start, middle, stop = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            calls = calls_for(measure_ms, per_call[label])
            start.record()
            enqueue(fn, calls // 2)
            middle.record()
            enqueue(fn, calls - calls // 2)
            stop.record()
            # The clock halfway through the timed calls: the host may have queued all of them
            # while the warm-up still ran.
            middle.synchronize()
            mhz = nvml.sm_clock_mhz() if nvml else None
            stop.synchronize()
            ms = start.elapsed_time(stop) / calls
            per_call[label] = ms
            runs[label]["ms"].append(ms)
            if mhz is not None:
                runs[label]["mhz"].append(mhz)
    return {label: {key: statistics.median(values) for key, values in run.items() if values}
            for label, run in runs.items() if run["ms"]}, errors


def torch_grouped_mm():
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def bench_shape(name, groups, k, n, tokens, skewed, args, nvml):
    dev, dtype = torch.device("cuda"), torch.bfloat16
    sizes = routing(groups, tokens, skewed)
    m_splits = torch.tensor(sizes, device=dev)
    offsets = torch.cumsum(m_splits, 0).to(torch.int32)
    x = torch.randn(tokens, k, device=dev, dtype=dtype)
    dy = torch.randn(tokens, n, device=dev, dtype=dtype)
    stride = mt.packed_group_stride(n, k, dtype)
    weight = grouped._packed(torch.randn(groups * stride, device=dev, dtype=dtype), groups, n, k,
                             stride)
    weight_dense = weight.contiguous()
    dense_w = torch.randn(n, k, device=dev, dtype=dtype)
    flop = 2.0 * tokens * k * n
    gmm = torch_grouped_mm()
    x_splits, dy_splits = x.split(sizes), dy.split(sizes)

    ours = {
        "forward": lambda: torch.ops.meshla.grouped_mm(x, m_splits, weight, None),
        "dgrad": lambda: torch.ops.meshla.grouped_mm_dgrad(dy, m_splits, weight),
        "wgrad": lambda: torch.ops.meshla.grouped_mm_wgrad(x, dy, m_splits, stride),
    }
    peers = {
        "torch grouped_mm": {
            "forward": lambda: gmm(x, weight_dense.transpose(-2, -1), offs=offsets),
            "dgrad": lambda: gmm(dy, weight_dense, offs=offsets),
            "wgrad": lambda: gmm(dy.t(), x, offs=offsets),
        } if gmm is not None else None,
        "torch loop": {
            "forward": lambda: [xs @ weight_dense[g].T for g, xs in enumerate(x_splits)],
            "dgrad": lambda: [ds @ weight_dense[g] for g, ds in enumerate(dy_splits)],
            "wgrad": lambda: [ds.T @ xs for ds, xs in zip(dy_splits, x_splits)],
        },
        "dense": {
            "forward": lambda: x @ dense_w.T,
            "dgrad": lambda: dy @ dense_w,
            "wgrad": lambda: dy.T @ x,
        },
    }
    rows = []
    for pass_name, fn in ours.items():
        row = {"shape": name, "routing": "skewed" if skewed else "uniform", "pass": pass_name,
               "groups": groups, "k": k, "n": n, "tokens": tokens,
               "largest_group": max(sizes), "empty_groups": sizes.count(0)}
        fns = {"meshla": fn}
        fns.update({peer: peer_fns[pass_name] for peer, peer_fns in peers.items() if peer_fns})
        times, errors = time_ms(fns, args.warmup_ms, args.measure_ms, args.repeats, nvml)
        if "meshla" in errors:
            raise RuntimeError(f"meshla {pass_name} on {name}: {errors['meshla']}")
        for label, measured in times.items():
            row[f"{label}_ms"] = measured["ms"]
            row[f"{label}_tflops"] = flop / measured["ms"] / 1e9
            if "mhz" in measured:
                row[f"{label}_sm_mhz"] = measured["mhz"]
        for label, error in errors.items():
            row[f"{label}_error"] = error
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows):
    lines = ["| shape | routing | pass | meshla TFLOP/s | torch grouped_mm | loop | dense | "
             "meshla/dense | meshla/grouped_mm | SM MHz meshla / grouped_mm |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ours = r["meshla_tflops"]
        gmm = r.get("torch grouped_mm_tflops")
        gmm_text = f"{gmm:.0f}" if gmm else r.get("torch grouped_mm_error", "-")
        ratio_text = f"{ours / gmm:.2f}" if gmm else "-"
        mhz = [r.get(f"{label}_sm_mhz") for label in ("meshla", "torch grouped_mm")]
        mhz_text = " / ".join(f"{m:.0f}" if m is not None else "-" for m in mhz)
        lines.append(
            f"| {r['shape']} | {r['routing']} | {r['pass']} | {ours:.0f} | {gmm_text} | "
            f"{r['torch loop_tflops']:.0f} | {r['dense_tflops']:.0f} | "
            f"{ours / r['dense_tflops']:.2f} | {ratio_text} | {mhz_text} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--warmup-ms", type=float, default=500.0)
    parser.add_argument("--measure-ms", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    nvml = open_nvml()
    rows = []
    progress = Progress("grouped_linear", 2 * len(SHAPES))
    for shape in SHAPES:
        for skewed in (False, True):
            progress.start(f"{shape[0]}, {'skewed' if skewed else 'uniform'} routing")
            rows += bench_shape(*shape, skewed, args, nvml)
    meta = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "commit": args.commit, "torch": torch.__version__, "dtype": "bfloat16",
            "warmup_ms": args.warmup_ms, "measure_ms": args.measure_ms, "repeats": args.repeats}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(json.dumps(meta))
    print(table(rows))


if __name__ == "__main__":
    main()
