"""The text workload of scripts/bench_loaders.py (issue 46): token ids of lognormal lengths
around 128 (max 512), each sample tokenized in Python, batch 32, bucketed by length
(boundaries 32..384), measured by scripts/bench_varlen.py's rows side by side:

  kpipe                              ProcessLoader.from_samples(buckets=kpipe.Buckets(...),
                                     lengths=...)                padded in the workers' slots
  bare processes                     the same padding by plain processes into reused
                                     shared-memory buffers, no loader (the target's base)
  tf.data bucket_by_sequence_length  numpy_function map + bucket_by_sequence_length
  torch DataLoader pad_sequence      PyTorch's DataLoader with a pad_sequence collate
  grain                              Grain MapDataset ... batch(batch_fn=pad) + mp_prefetch

Each row's passes are interleaved with the others' (pass e of every row, then e + 1; the
first a warm-up); a row's figure is its median pass: samples/s, and CPU microseconds per
sample of this process and its workers (less disturbed by other processes on the machine).
The audio workload (audio.py) shares this code.
"""

import os
import sys

HELP = "variable-length token ids padded in length buckets (kpipe, bare processes, tf.data, torch, grain)"
NAME = "text"
ROWS = ("kpipe", "bare processes", "tf.data bucket_by_sequence_length", "torch DataLoader pad_sequence", "grain")


def _varlen():
    scripts = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import bench_varlen

    return bench_varlen


def add_arguments(parser, name=NAME):
    parser.add_argument(f"--{name}-epochs", type=int, default=4,
                        help=f"passes per row of the {name} workload, the first a warm-up (>= 2; 2 with --quick). Default: 4")


def run(args, workers, repeats, quick, name=NAME):
    """Runs workload `name`'s rows (`repeats` rounds); returns (rows, skipped): per row its
    best round's median samples/s ("rate"), CPU ms per sample ("cpu_ms", the lowest) and
    padding waste."""
    bench = _varlen()
    epochs = 2 if quick else getattr(args, f"{name}_epochs")
    if epochs < 2:
        raise SystemExit(f"--{name}-epochs must be >= 2 (the first is a warm-up). Received: {epochs}")
    spec = bench.workloads(quick)[name]
    best, skipped = {}, {}
    for _ in range(repeats):
        result = bench.measure(name, spec, workers, epochs, 0)
        bench.report(name, spec, result)
        skipped.update({s["row"]: s["reason"] for s in result["skipped"]})
        for entry in result["rows"]:
            had = best.setdefault(entry["row"], {"rate": 0.0, "cpu_ms": float("inf")})
            had["rate"] = max(had["rate"], entry["median_samples_per_s"])
            had["cpu_ms"] = min(had["cpu_ms"], entry["cpu_us_per_sample"] / 1e3)
            had["padding_waste"] = entry["padding_waste"]
    rows = [{"workload": name, "loader": row, "samples": len(spec["make"]()), "batch": spec["batch"], **best[row]}
            for row in ROWS if row in best]
    return rows, skipped


def print_rows(rows, workers, repeats, name=NAME):
    """Prints workload `name`'s rows and the issue's two ratios (samples/s and CPU per sample)."""
    by = {r["loader"]: r for r in rows if r["workload"] == name}
    if not by:
        return
    print(f"\n{name} workload: workers {workers}, best of {repeats} rounds of the median pass")
    print(f"  {'loader':36s} {'samples/s':>10s} {'CPU ms/sample':>14s} {'waste':>6s}")
    for row, r in by.items():
        print(f"  {row:36s} {r['rate']:10.0f} {r['cpu_ms']:14.4f} {r['padding_waste']:6.2f}")
    bare, kp = by.get("bare processes"), by.get("kpipe")
    if bare and kp:
        print(f"  kpipe / bare processes: {kp['rate'] / bare['rate']:.2f}x samples/s, {bare['cpu_ms'] / kp['cpu_ms']:.2f}x by "
              "CPU per sample (target >= 0.9x)")
    peers = [r for k, r in by.items() if k not in ("kpipe", "bare processes")]
    if kp and peers:
        fast = max(peers, key=lambda r: r["rate"])
        print(f"  kpipe / best peer ({fast['loader']}): {kp['rate'] / fast['rate']:.2f}x samples/s, "
              f"{min(r['cpu_ms'] for r in peers) / kp['cpu_ms']:.2f}x by CPU per sample (target >= 1.5x)")
