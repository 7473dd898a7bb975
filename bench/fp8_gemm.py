"""The fp8 GEMM alone on one GPU (issue 38's anchors): meshla's Matmul with tensorwise scales
(cuBLASLt) and rowwise scales (meshla's CUTLASS kernel on Hopper) against torch._scaled_mm with
the same scales, and the bf16 GEMM of the same product; x [M, K] @ w [N, K]ᵀ in float8_e4m3fn,
bfloat16 out.

    python3 bench/fp8_gemm.py --commit SHA [--out FILE.json]

CUDA events around 20 back-to-back calls, median of 7; ratios to torch's tensorwise _scaled_mm.
"""

import argparse
import datetime
import statistics

import torch
from collective_matmul import append_run

from meshla import _meshla

SHAPES = ((8192, 8192, 14336), (16384, 8192, 14336), (8192, 14336, 8192), (4096, 4096, 4096))


def time_ms(fn, calls: int = 20, reps: int = 7) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / calls)
    return statistics.median(times)


def variants(m: int, k: int, n: int) -> dict:
    e4m3 = torch.float8_e4m3fn
    x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    xq, wq = x.to(e4m3), w.to(e4m3)
    xb, wb = x.bfloat16(), w.bfloat16()
    one = torch.ones(1, device="cuda")
    row_scales, column_scales = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
    d = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    matmul = _meshla.Matmul(torch.cuda.current_device())

    def meshla(scaling, a_scale, b_scale):
        return lambda: matmul.run(xq, wq, d, None, True, scaling, a_scale, b_scale,
                                  torch.cuda.current_stream().cuda_stream)

    return {
        "bf16 x @ w.t()": lambda: xb @ wb.t(),
        "torch _scaled_mm tensorwise": lambda: torch._scaled_mm(
            xq, wq.t(), one.reshape(()), one.reshape(()), out_dtype=torch.bfloat16),
        "torch _scaled_mm rowwise": lambda: torch._scaled_mm(
            xq, wq.t(), row_scales, column_scales, out_dtype=torch.bfloat16),
        "meshla tensorwise": meshla("tensorwise", one, one),
        "meshla rowwise": meshla("rowwise", row_scales.reshape(-1), column_scales.reshape(-1)),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", help="JSON file to append this run to")
    args = parser.parse_args()
    rows = []
    for m, k, n in SHAPES:
        times = {name: time_ms(fn) for name, fn in variants(m, k, n).items()}
        base = times["torch _scaled_mm tensorwise"]
        rows += [{"m": m, "k": k, "n": n, "variant": name, "time_ms": t, "ratio": t / base}
                 for name, t in times.items()]
        print(f"M={m} K={k} N={n}: " + ", ".join(
            f"{name} {t:.3f} ms ({t / base:.2f})" for name, t in times.items()), flush=True)
    if args.out:
        run = {"device": torch.cuda.get_device_name(), "commit": args.commit,
               "torch": torch.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "rows": rows}
        append_run(args.out, run)


if __name__ == "__main__":
    main()
