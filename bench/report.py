"""Renders collective-matmul benchmark JSON (bench/collective_matmul.py) as Markdown tables.

    python3 bench/report.py bench/results/FILE.json > bench/results/FILE.md

One table per tp: for each op and M the time of each variant in ms, with its ratio to the limit
max(GEMM alone, collective alone) and, for meshla's algorithms, the speedup over meshla's
sequential algorithm.
"""

import json
import sys

COLUMNS = ("gemm", "collective", "torch_sequential", "torch_symm_mem", "meshla_sequential",
           "meshla_pipelined", "meshla_ring", "meshla_symmetric", "meshla_auto")


def cell(row) -> str:
    if row is None or row["time_ms"] is None:
        return "n/a"
    text = f"{row['time_ms']:.3f} ({row['ratio']:.2f})"
    if row["variant"].startswith("meshla_") and row["variant"] != "meshla_sequential":
        text += f" {row['speedup_vs_meshla_sequential']:.2f}x"
    return text


def render(run) -> str:
    lines = [f"### tp={run['tp']}: {run['device']} x{run['tp']}, {run['date']}, commit "
             f"{run['commit']}, torch {run['torch']}, NCCL {run['nccl']}, {run['dtype']}",
             "",
             "ms per call (ratio to max(gemm, collective)); meshla algorithms also show their "
             "speedup over meshla_sequential.",
             "",
             "| op | M | N | K | " + " | ".join(COLUMNS) + " |",
             "|---|---|---|---|" + "---|" * len(COLUMNS)]
    cases = {}
    for row in run["rows"]:
        cases.setdefault((row["op"], row["m"], row["n"], row["k"]), {})[row["variant"]] = row
    for (op, m, n, k), variants in cases.items():
        cells = [cell(variants.get(name)) for name in COLUMNS]
        lines.append(f"| {op} | {m} | {n} | {k} | " + " | ".join(cells) + " |")
    extra = sorted({row["variant"] for row in run["rows"]} - set(COLUMNS))
    if extra:
        lines += ["", "Other variants timed in the same run (`_s<comm_sms>_c<chunks>`: swept "
                  "settings; gemm_blocks, gemm_blocks_pushing: the copy-engine all-gather's GEMMs "
                  "alone and during its pushes):", "",
                  "| op | M | " + " | ".join(extra) + " |", "|---|---|" + "---|" * len(extra)]
        for (op, m, _, _), variants in cases.items():
            lines.append(f"| {op} | {m} | " +
                         " | ".join(cell(variants.get(name)) for name in extra) + " |")
    return "\n".join(lines)


def main(paths) -> None:
    for path in paths:
        with open(path) as f:
            runs = json.load(f)["runs"]
        for run in sorted(runs, key=lambda r: r["tp"]):
            print(render(run))
            print()


if __name__ == "__main__":
    main(sys.argv[1:])
