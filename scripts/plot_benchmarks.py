"""The docs' benchmark figures, drawn from the benchmarks' own `--json` output.

Reads what `scripts/bench_loaders.py --json`, `scripts/bench_feed.py --json` and
`scripts/bench_ray.py --json` wrote and draws one PNG per benchmark, each captioned with the
command that made its numbers and the machine named by `--machine`:

  loaders.png  samples/s of every loader (and the ceiling: bare processes that hand nothing
               over) as a multiple of the serial loop, by workload and worker count; one or
               more bench_loaders JSON files (e.g. one per `--workers`), their rows side by side.
  feed.png     fit() steps/s of each input as a multiple of in-memory tf.data, per batch size.
  ray.png      samples/s (or steps/s) of Ray actors against local process workers, per row.

Regenerate the committed figures (the commands and the machine: docs/bench/README.md):

    python scripts/plot_benchmarks.py --loaders docs/bench/loaders.json docs/bench/loaders_w4.json \\
        --feed docs/bench/feed.json --ray docs/bench/ray.json --out-dir docs/bench \\
        --machine "2-core AMD EPYC VM, shared"

A figure whose JSON is not given is not drawn. Needs matplotlib (`pip install -e ".[plot]"`).
"""

import argparse
import json
import os
import sys

LOADER_ORDER = ["serial", "keras-threads", "keras-mp", "tf.data", "torch", "grain-dataloader", "grain-dataset",
                "kpipe", "kpipe-ahead", "kpipe-samples", "kpipe-threads", "ceiling"]
WORKLOAD_NAMES = {
    "a": "a: NumPy augmentation", "b": "b: HDF5 224x224", "b-direct": "b-direct: read_direct",
    "b-stack": "b-stack: np.stack", "c": "c: 5 ms I/O per sample", "s": "s: small samples", "blas": "blas",
}


def _load(path):
    with open(path) as f:
        return json.load(f)


def _caption(fig, script, argvs, machine):
    commands = "; ".join(f"python scripts/{script} " + " ".join(a) for a in argvs if a is not None)
    text = (commands or f"scripts/{script}") + (f"\n{machine}" if machine else "")
    fig.text(0.01, 0.005, text, fontsize=6.5, va="bottom", ha="left", color="0.35", wrap=True)


def loader_groups(results):
    """(group label, {loader: multiple of serial}) per workload and worker count, in order."""
    groups = []
    for result in results:
        workers = next((r["workers"] for r in result["rows"] if r["loader"] == "kpipe"), None)
        by_workload = {}
        for row in result["rows"]:
            by_workload.setdefault(row["workload"], []).append(row)
        for workload, rows in by_workload.items():
            serial = next((r["samples_per_s"] for r in rows if r["loader"] == "serial"), None)
            if not serial:
                continue
            name, _, count = workload.partition("@")
            label = f"{WORKLOAD_NAMES.get(name, name)}\nworkers={count or workers}"
            if label not in (g[0] for g in groups):  # (every run has a c@16 group: the first counts)
                groups.append((label, {r["loader"]: r["samples_per_s"] / serial for r in rows}))
    return sorted(groups, key=lambda g: (g[0].split("\n")[0], int(g[0].rsplit("=", 1)[1])))


def plot_loaders(results, argvs, out, machine, plt):
    groups = loader_groups(results)
    loaders = [name for name in LOADER_ORDER if any(name in g for _, g in groups)]
    loaders += sorted({name for _, g in groups for name in g} - set(loaders))
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / max(1, len(loaders))
    for k, loader in enumerate(loaders):
        xs = [i + (k - (len(loaders) - 1) / 2) * width for i, (_, g) in enumerate(groups) if loader in g]
        ys = [g[loader] for _, g in groups if loader in g]
        style = {"color": "0.6", "hatch": "//", "edgecolor": "0.3"} if loader == "ceiling" else {}
        ax.bar(xs, ys, width, label=loader, **style)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=8)
    ax.set_ylabel("samples/s, multiple of the serial loop")
    ax.set_title("Loaders vs peers vs the ceiling (higher is better)")
    ax.legend(fontsize=7, ncol=4)
    _caption(fig, "bench_loaders.py", argvs, machine)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return groups


def plot_feed(result, argv, out, machine, plt):
    rows = result["rows"]
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    names = list(dict.fromkeys(r["row"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.8 / max(1, len(sizes))
    for k, size in enumerate(sizes):
        values = {r["row"]: r["vs_tfdata"] for r in rows if r["size"] == size}
        ax.barh([i + (k - (len(sizes) - 1) / 2) * width for i in range(len(names))],
                [values.get(n, 0.0) for n in names], width, label=f"{size} batches")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("fit() steps/s, multiple of in-memory tf.data (higher is better)")
    ax.set_title("The hand-over into fit(): kpipe's feed vs tf.data")
    ax.legend(fontsize=8)
    _caption(fig, "bench_feed.py", [argv], machine)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def ray_bars(result):
    """(label, best rate, unit, multiple of process workers) per arm of bench_ray's table."""
    return [(f"({row['row']}) {row['arm']}", row["best"], row["unit"], row.get("x process"))
            for row in result["table"]]


def plot_ray(result, argv, out, machine, plt):
    bars = ray_bars(result)
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.5 * max(1, len(bars))))
    ax.barh(range(len(bars)), [b[1] for b in bars], color=["C1" if "ray" in b[0] else "C0" for b in bars])
    for i, (_, value, unit, multiple) in enumerate(bars):
        ax.text(value, i, f" {value:,.0f} {unit}" + (f" = {multiple:.2f}x" if multiple is not None else ""),
                va="center", fontsize=8)
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.35 * max([b[1] for b in bars] or [1]))
    ax.set_xlabel("best rate (higher is better); multiples of the same row's process workers")
    ax.set_title("Ray actors vs local process workers")
    _caption(fig, "bench_ray.py", [argv], machine)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loaders", nargs="*", default=[], metavar="JSON", help="bench_loaders.py --json files")
    parser.add_argument("--feed", metavar="JSON", help="a bench_feed.py --json file")
    parser.add_argument("--ray", metavar="JSON", help="a bench_ray.py --json file")
    parser.add_argument("--ray-argv", default=None, help="the bench_ray.py arguments that made --ray (its JSON does not record them)")
    parser.add_argument("--out-dir", default="docs/bench", help="where the PNGs go. Defaults to docs/bench")
    parser.add_argument("--machine", default="", help="the machine that ran the benchmarks, for the captions")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(args.out_dir, exist_ok=True)
    written = []
    if args.loaders:
        results = [_load(p) for p in args.loaders]
        groups = plot_loaders(results, [r.get("argv") for r in results], os.path.join(args.out_dir, "loaders.png"),
                              args.machine, plt)
        written.append("loaders.png")
        for label, values in groups:
            print(label.replace("\n", " "), " ".join(f"{k}={v:.2f}x" for k, v in values.items()))
    if args.feed:
        plot_feed(_load(args.feed), _load(args.feed).get("argv"), os.path.join(args.out_dir, "feed.png"), args.machine, plt)
        written.append("feed.png")
    if args.ray:
        ray_argv = args.ray_argv.split() if args.ray_argv is not None else None
        plot_ray(_load(args.ray), ray_argv, os.path.join(args.out_dir, "ray.png"), args.machine, plt)
        written.append("ray.png")
    print("wrote", ", ".join(os.path.join(args.out_dir, w) for w in written) or "nothing (no JSON given)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
