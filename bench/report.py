"""Renders benchmark JSON as Markdown tables and PNG charts.

    python3 bench/report.py bench/results/FILE.json > bench/results/FILE.md
    python3 bench/report.py --png bench/results/FILE.json ...   # FILE.png beside each

Tables (collective-matmul JSON of bench/collective_matmul.py): one per tp, for each op and M the
time of each variant in ms, with its ratio as the run defines it (its "ratio_to": the faster
layout of the GEMM alone; runs before that field, max(GEMM alone, collective alone)) and, for
meshla's algorithms, the speedup over meshla's sequential algorithm.

Charts (needs matplotlib), by what the file holds:
- collective matmul (bench/collective_matmul.py, bench/jax_collective_matmul.py): each op's ratio
  (as the run defines it) against M, a line per variant, from the file's last run;
- dense solvers (bench/dense_solver.py): TFLOP/s against n, a line per engine (the same flop
  count as meshla's over each engine's time, the best tile at each n), a panel per routine,
  dtype and GPU count;
- grouped GEMM (bench/grouped_linear.py): TFLOP/s of each implementation, bars per shape and pass.
"""

import argparse
import json
import os

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
    layout = f", weights {run['layout']}" if "layout" in run else ""
    lines = [f"### tp={run['tp']}: {run['device']} x{run['tp']}, {run['date']}, commit "
             f"{run['commit']}, torch {run['torch']}, NCCL {run['nccl']}, {run['dtype']}{layout}",
             "",
             f"ms per call (ratio to {run.get('ratio_to', 'max(gemm, collective)')}); meshla "
             "algorithms also show their speedup over meshla_sequential.",
             "",
             "| op | M | N | K | " + " | ".join(COLUMNS) + " |",
             "|---|---|---|---|" + "---|" * len(COLUMNS)]
    cases = {}
    for row in run["rows"]:
        key = (row["op"], row["m"], row["n"], row["k"])
        cases.setdefault(key, {})[row["variant"]] = row
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


def _figure(panels: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if panels == 0:
        raise SystemExit("report: nothing to chart in this file (no rows with times)")
    columns = min(panels, 3)
    rows = (panels + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 4 * rows), squeeze=False)
    for extra in axes.flat[panels:]:
        extra.set_visible(False)
    return figure, list(axes.flat)


def _title(meta: dict) -> str:
    gpus = meta.get("device_count") or meta.get("tp") or meta.get("gpus")
    return (f"{meta.get('device', '?')}{f' x{gpus}' if gpus else ''}, {meta.get('date', '?')[:10]},"
            f" commit {meta.get('commit', '?')}")


def collective_chart(run: dict):
    bar = run.get("ratio_to", "gemm")  # the variant every ratio is over: not a line of its own
    rows = [r for r in run["rows"] if r.get("ratio") is not None and r["variant"] not in
            ("gemm", bar) and "m" in r]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    figure, axes = _figure(len(ops))
    for ax, op in zip(axes, ops):
        variants = list(dict.fromkeys(r["variant"] for r in rows if r["op"] == op))
        for variant in variants:
            points = sorted((r["m"], r["ratio"]) for r in rows
                            if r["op"] == op and r["variant"] == variant)
            style = "-o" if variant.startswith(("meshla", "torch_meshla")) else "--."
            ax.plot(*zip(*points), style, label=variant)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        # The run says what its ratio is to ("ratio_to"); before that field, the torch
        # benchmark's was to max(GEMM alone, collective alone), the JAX one's to the GEMM alone
        # and its training step's to XLA's faster step.
        base = ("XLA's faster step" if op.startswith("mlp_train_step")
                else "the fastest GEMM alone" if run.get("ratio_to", "").startswith("gemm")
                else "the fp8 GEMM alone" if run.get("ratio_to") == "fp8_gemm"
                else "the GEMM alone" if "jax" in run else "max(GEMM, collective)")
        ax.set(title=op, xlabel="M (rows)", ylabel=f"time / {base}")
        ax.legend(fontsize=7)
    return figure


def solver_chart(run: dict):
    rows = [r for r in run["rows"] if r.get("meshla_tflops") and r.get("meshla_s")]
    panels = list(dict.fromkeys((r["op"], r.get("dtype"), r["gpus"]) for r in rows))
    figure, axes = _figure(len(panels))
    engines = {"meshla": "meshla_s", "cuSolverMg": "cusolvermg_s", "jax, one GPU": "jax_1gpu_s",
               "JAXMg": "jaxmg_s"}
    for ax, (op, dtype, gpus) in zip(axes, panels):
        mine = [r for r in rows if (r["op"], r.get("dtype"), r["gpus"]) == (op, dtype, gpus)]
        for engine, key in engines.items():
            best = {}  # n -> the engine's best TFLOP/s over the tiles tried
            for r in mine:
                if r.get(key):
                    rate = r["meshla_tflops"] * r["meshla_s"] / r[key]
                    best[r["n"]] = max(best.get(r["n"], 0.0), rate)
            points = sorted(best.items())
            if points:
                ax.plot(*zip(*points), "-o" if engine == "meshla" else "--.", label=engine)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{op} {dtype or ''} on {gpus} GPU(s)", xlabel="n", ylabel="TFLOP/s")
        ax.legend(fontsize=7)
    return figure


def grouped_chart(data: dict):
    rows = data["rows"]
    implementations = [key[:-len("_tflops")] for key in rows[0] if key.endswith("_tflops")]
    figure, axes = _figure(1)
    ax = axes[0]
    width = 0.8 / len(implementations)
    labels = [f"{r['shape']}, {r['routing']}, {r['pass']}" for r in rows]
    for i, name in enumerate(implementations):
        ax.bar([x + i * width for x in range(len(rows))], [r[f"{name}_tflops"] for r in rows],
               width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))], labels, rotation=75,
                  fontsize=7, ha="right")
    ax.set(ylabel="TFLOP/s")
    ax.legend(fontsize=7)
    figure.set_size_inches(max(8, 0.45 * len(rows)), 6)
    return figure


def chart(path: str) -> str:
    """Writes the chart of one JSON file beside it; returns the PNG's path."""
    with open(path) as f:
        data = json.load(f)
    if "runs" in data:  # collective matmul: its last run
        run = data["runs"][-1]
        figure, meta = collective_chart(run), run
    elif "meta" in data:  # grouped GEMM: shapes and passes
        figure, meta = grouped_chart(data), data["meta"]
    else:
        figure, meta = solver_chart(data), data
    figure.suptitle(_title(meta))
    figure.tight_layout()
    png = os.path.splitext(path)[0] + ".png"
    figure.savefig(png, dpi=110)
    return png


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--png", action="store_true", help="write charts instead of tables")
    parser.add_argument("paths", nargs="+", metavar="FILE.json")
    args = parser.parse_args()
    for path in args.paths:
        if args.png:
            print(chart(path))
            continue
        with open(path) as f:
            runs = json.load(f)["runs"]
        for run in sorted(runs, key=lambda r: r["tp"]):
            print(render(run))
            print()


if __name__ == "__main__":
    main()
