"""Grouped GEMM benchmark on one GPU: meshla against torch's grouped_mm, a per-expert torch.matmul
loop and one dense GEMM of the same total size, in the same run.

  python bench/grouped_linear.py --commit SHA --out results.json

TFLOP/s of forward (y = x W_gᵀ), dgrad (dx = dy W_g) and wgrad (dW_g = dy_gᵀ x_g) for each shape
and routing. Timings: CUDA events around `--iters` back-to-back calls after a warm-up; the median
of `--repeats` such runs, taken in turns with the peers' in a rotating order (time_ms). The table
is printed last; JSON carries device, date and commit.
"""

import argparse
import datetime
import json
import statistics

import torch

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


def time_ms(fns: dict, iters: int, repeats: int) -> dict:
    """Median ms per call of each of `fns`. The functions take turns (one run of `iters` calls each,
    `repeats` rounds), so a drift of the GPU's clocks during the measurement falls on all of them
    alike instead of on whichever ran last, and each round starts one function later than the
    round before, so that none always follows the same one (a dense GEMM leaves the GPU hot and
    its clocks lower for what runs next). A function that raises is recorded by its error."""
    runs, errors = {label: [] for label in fns}, {}
    for label, fn in fns.items():
        try:
            fn()
        except Exception as error:  # a peer that refuses a shape is recorded, not fatal
            errors[label] = str(error).splitlines()[0][:160]
    torch.cuda.synchronize()
    labels = list(fns)
    for round_index in range(repeats):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            fn = fns[label]
            if label in errors:
                continue
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            stop.record()
            stop.synchronize()
            runs[label].append(start.elapsed_time(stop) / iters)
    return {label: statistics.median(r) for label, r in runs.items() if r}, errors


def torch_grouped_mm():
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def bench_shape(name, groups, k, n, tokens, skewed, args):
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
        times, errors = time_ms(fns, args.iters, args.repeats)
        if "meshla" in errors:
            raise RuntimeError(f"meshla {pass_name} on {name}: {errors['meshla']}")
        for label, ms in times.items():
            row[f"{label}_ms"] = ms
            row[f"{label}_tflops"] = flop / ms / 1e9
        for label, error in errors.items():
            row[f"{label}_error"] = error
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows):
    lines = ["| shape | routing | pass | meshla TFLOP/s | torch grouped_mm | loop | dense | "
             "meshla/dense | meshla/grouped_mm |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ours = r["meshla_tflops"]
        gmm = r.get("torch grouped_mm_tflops")
        gmm_text = f"{gmm:.0f}" if gmm else r.get("torch grouped_mm_error", "-")
        ratio_text = f"{ours / gmm:.2f}" if gmm else "-"
        lines.append(
            f"| {r['shape']} | {r['routing']} | {r['pass']} | {ours:.0f} | {gmm_text} | "
            f"{r['torch loop_tflops']:.0f} | {r['dense_tflops']:.0f} | "
            f"{ours / r['dense_tflops']:.2f} | {ratio_text} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    rows = []
    for shape in SHAPES:
        for skewed in (False, True):
            rows += bench_shape(*shape, skewed, args)
    meta = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "commit": args.commit, "torch": torch.__version__, "dtype": "bfloat16",
            "iters": args.iters, "repeats": args.repeats}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(json.dumps(meta))
    print(table(rows))


if __name__ == "__main__":
    main()
