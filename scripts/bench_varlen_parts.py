"""Where a variable-length pass's CPU goes, per sample: the dataset's own `__getitem__`,
the padding, and the hand-over between processes -- and so the most any loader doing the
dataset's work could gain over the peers of `scripts/bench_varlen.py`.

Serial parts (this process, one pass in the bucketed order, CPU time of this process per
sample; best of `--repeats` passes):
    dataset            `ds[j]` alone, every sample of the pass
    dataset + pad      the same samples padded by hand into one reused buffer (what the
                       bare-processes row's workers do)
    kpipe batches      kpipe's own batch building (`SampleBatches[(pass, b, seed)]`, the
                       code a worker runs: buckets' plan, padding into the batch)
Then the rows of `bench_varlen.py` (kpipe, bare processes, tf.data, torch and Grain when
importable), passes interleaved, CPU per sample of this process and its children: a row's
CPU beyond `dataset` is its loader's cost (hand-over, copies, threads).

The cap: a loader must at least run the dataset, so on a machine whose cores it keeps busy
it can be at most `peer CPU per sample / dataset CPU per sample` times faster than a peer
(`cap vs <peer>`, printed per peer); kpipe's share of that is `kpipe/peer by CPU` over it.
Run: `python scripts/bench_varlen_parts.py [--workloads audio] [--workers 2] [--epochs 3]
[--smoke] [--json out.json]`.

Measured (issue 46's third session, 2 workers, the 2-core machine shared, load average
4-7; `--epochs 4` with torch 2.13 and grain 0.2.18 for audio, `--epochs 3` without them
for text), CPU us per sample:

            dataset  +hand pad  kpipe batches | kpipe (main+workers)  bare   tf.data  torch  grain
    audio     883      1063        952        | 1149 (66 + 1083)      1240   1667     1825   1716
    text      45.8     52.3        56.0       | 63.3 (7.4 + 55.8)     56.3   245

Audio: the dataset's own `__getitem__` (a 1-10 s waveform drawn and scaled) is 883 us of
kpipe's 1149; kpipe's padding (the copy of ~350 KB into the slot: the floor for a loader
that does not own the sample's memory) adds 69 (8%), less than the hand-written loop; in
worker processes every row pays ~100-200 more than serially (bare processes too: caches
shared with the other worker and the machine's other load). So by CPU per sample kpipe is
1.49x Grain, 1.59x PyTorch, 1.45x tf.data, against a cap (peer CPU / the dataset's alone)
of 1.94x, 2.07x, 1.89x: a loader with no cost of its own at all would be at most ~1.9x the
best peer here, and kpipe is ~77% of the way. By samples/s the same run gave kpipe 748,
Grain 589, PyTorch 687 (1.09x the best): on a crowded machine the wall clock measures the
share of the cores a row won, and it moved 2x between runs.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_varlen  # noqa: E402
import kpipe  # noqa: E402
from kpipe import _samples  # noqa: E402


def _cpu_per_sample(fn, samples, repeats):
    """Best CPU microseconds per sample of `fn()` over `repeats` calls."""
    best = None
    for _ in range(repeats):
        start = time.process_time()
        fn()
        used = (time.process_time() - start) / samples * 1e6
        best = used if best is None else min(best, used)
    return best


def serial_parts(spec, seed, repeats):
    """`{part: CPU us per sample}` of one pass in the bucketed order (module docstring)."""
    ds = spec["make"]()
    batches = _samples.for_loader(ds, spec["batch"], shuffle=True, seed=seed, drop_remainder=False, has_hooks=False,
                                  options={"buckets": kpipe.Buckets(spec["boundaries"]), "lengths": ds.lengths})
    plan = [batches.samples((0, b, seed)).tolist() for b in range(len(batches))]
    n = sum(len(p) for p in plan)
    dtype = ds[0][0].dtype
    buffer = np.empty(spec["batch"] * int(ds.lengths.max()), dtype)

    def dataset():
        for p in plan:
            for j in p:
                ds[j]

    def dataset_and_pad():
        for p in plan:
            rows = [ds[j] for j in p]
            longest = max(len(x) for x, _ in rows)
            x = buffer[:len(rows) * longest].reshape(len(rows), longest)
            y = np.empty(len(rows), np.int32)
            for r, (row, label) in enumerate(rows):
                x[r, :len(row)] = row
                x[r, len(row):] = 0
                y[r] = label

    def kpipe_batches():
        for b in range(len(batches)):
            batches[(0, b, seed)]

    return {"dataset": _cpu_per_sample(dataset, n, repeats), "dataset + pad": _cpu_per_sample(dataset_and_pad, n, repeats),
            "kpipe batches": _cpu_per_sample(kpipe_batches, n, repeats)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="few, small samples (a check that it runs)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3, help="passes per row, the first a warm-up (>= 2)")
    parser.add_argument("--repeats", type=int, default=3, help="serial passes per part (the best is kept)")
    parser.add_argument("--workloads", default="audio")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args(argv)
    if args.workers < 1 or args.epochs < 2 or args.repeats < 1:
        parser.error(f"--workers and --repeats must be >= 1, --epochs >= 2. Received: --workers {args.workers} "
                     f"--epochs {args.epochs} --repeats {args.repeats}")
    specs = bench_varlen.workloads(args.smoke)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not names or any(w not in specs for w in names):
        parser.error(f"--workloads takes a comma-separated subset of {', '.join(specs)}. Received: {args.workloads!r}")
    print(f"bench_varlen_parts: {args.workers} workers, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    out = {}
    for name in names:
        spec = specs[name]
        parts = serial_parts(spec, args.seed, args.repeats)
        result = bench_varlen.measure(name, spec, args.workers, args.epochs, args.seed)
        rows = {r["row"]: r for r in result["rows"]}
        dataset = parts["dataset"]
        print(f"\n{name}: serial CPU us per sample (best of {args.repeats}), load {os.getloadavg()[0]:.1f}")
        for part, us in parts.items():
            print(f"  {part:16s} {us:9.1f}   {us / dataset:5.2f}x the dataset's")
        print(f"  rows ({args.workers} workers, median of {args.epochs - 1} passes): samples/s, CPU us per sample "
              "(main + workers), beyond the dataset's own")
        caps = {}
        for row, r in rows.items():
            print(f"  {row:36s} {r['median_samples_per_s']:9.1f}/s {r['cpu_us_per_sample']:9.1f} "
                  f"({r['main_cpu_us_per_sample']:.1f} + {r['workers_cpu_us_per_sample']:.1f}) "
                  f"{r['cpu_us_per_sample'] - dataset:+9.1f}")
        for row, r in rows.items():
            if row in ("kpipe", "bare processes"):
                continue
            caps[row] = {"cap_by_cpu": r["cpu_us_per_sample"] / dataset,
                         "kpipe_by_cpu": r["cpu_us_per_sample"] / rows["kpipe"]["cpu_us_per_sample"],
                         "kpipe_by_rate": rows["kpipe"]["median_samples_per_s"] / r["median_samples_per_s"]}
            c = caps[row]
            print(f"  cap vs {row}: {c['cap_by_cpu']:.2f}x (its CPU per sample / the dataset's); kpipe reaches "
                  f"{c['kpipe_by_cpu']:.2f}x by CPU, {c['kpipe_by_rate']:.2f}x by samples/s")
        out[name] = {"serial_us_per_sample": parts, "rows": result["rows"], "caps": caps}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
