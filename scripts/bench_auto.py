#!/usr/bin/env python3
"""`workers="auto"` against every fixed worker count, side by side in one run (issue #13).

Runs `kpipe.ProcessLoader` on the loader benchmark's workloads (scripts/bench_loaders.py)
with each fixed worker count of `--counts` and with `workers="auto"`, through Keras's
PyDataset adapter as `fit()` reads it, consuming every batch (one read per 4 KiB page).
Samples/s after the first batch, best of `--repeats` runs taken in rounds; "x best" is
the ratio to the best fixed count. For "auto", the workers it ended with and its changes.

  a   64x64x3 uint8 images with NumPy augmentation (CPU-bound), batch 64
  c   5 ms of waiting (I/O) per sample, batch 32
  fit workload a's batches into `model.fit()` of a model whose step uses one CPU core
      (Dense 12288 -> 256 -> 10, TensorFlow limited to one intra-op thread): the workers
      share the machine with training, so the best count is not "all cores". Samples/s
      of the training steps after the first.
  blas small linear algebra per batch (a 160x160 float32 matrix, six `tanh(a @ a.T)`; 60
      batches per epoch, 5 epochs): NumPy's BLAS has a thread pool of its own in every
      worker, so more workers can be slower than one (issue #30). Printed against its
      targets: workers=2 >= 1.3x workers=1, "auto" >= 0.9x the best fixed count, no fixed
      count below 0.8x workers=1 (PASS/MISS lines; nothing asserted).

    python scripts/bench_auto.py                       # a, c, fit and blas, counts 1,2,4,8,16
    python scripts/bench_auto.py --workloads c --epochs c=20 --json auto.json
    python scripts/bench_auto.py --workloads blas --counts 1,2,4
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402  (the scripts' option parsing and tables)
import bench_loaders as bl  # noqa: E402  (its datasets and page-touching consumer)

import kpipe  # noqa: E402  (bench_loaders put the repository first on sys.path)

_WORKLOADS = ("a", "c", "fit", "blas")
_EPOCHS = "a=10,c=10,fit=4,blas=5"


def run(make, workers, epochs):
    """Samples/s after the first batch, and the loader's stats at the end."""
    from keras.src.trainers.data_adapters.py_dataset_adapter import PyDatasetAdapter

    inner = make()
    counts = [0, 0, None, 0]
    t0 = time.perf_counter()
    max_queue = None if workers == "auto" else max(10, 2 * workers)
    loader = kpipe.ProcessLoader(inner, workers=workers, max_queue_size=max_queue)
    try:
        adapter = PyDatasetAdapter(loader, shuffle=False)
        for _ in range(epochs):
            adapter.on_epoch_begin()
            bl.consume(adapter.get_numpy_iterator(), counts)
            adapter.on_epoch_end()
        end = time.perf_counter()
        stats = loader.stats()
    finally:
        loader.close()
    return (counts[1] - counts[3]) / (end - counts[2]), stats


def run_fit(make, workers, epochs):
    """Training samples/s of `model.fit(loader)` after its first step, and the stats."""
    import keras

    inner = make()
    max_queue = None if workers == "auto" else max(10, 2 * workers)
    keras.utils.set_random_seed(0)
    x0, _ = inner[0]
    model = keras.Sequential([keras.Input(x0.shape[1:]), keras.layers.Flatten(), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class Clock(keras.callbacks.Callback):
        samples, start = 0, None

        def on_train_batch_end(self, batch, logs=None):
            if self.start is None:
                self.start = time.perf_counter()
            else:
                self.samples += len(x0)

    clock = Clock()
    loader = kpipe.ProcessLoader(inner, workers=workers, max_queue_size=max_queue)
    try:
        model.fit(loader, epochs=epochs, verbose=0, callbacks=[clock])
        end = time.perf_counter()
        stats = loader.stats()
    finally:
        loader.close()
    return clock.samples / (end - clock.start), stats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(_WORKLOADS), help=f"comma-separated subset of {','.join(_WORKLOADS)}. Default: all")
    parser.add_argument("--counts", default="1,2,4,8,16", help="fixed worker counts to compare with. Default: 1,2,4,8,16")
    parser.add_argument("--epochs", default=_EPOCHS, help=f"epochs per run, per workload. Default: {_EPOCHS}")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every count, in rounds; the best counts. Default: 2")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run, counts 1,2 (a smoke test, not a measurement)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)

    workloads = _bench.parse_names(parser, "--workloads", args.workloads, _WORKLOADS)
    counts = [1, 2] if args.quick else _bench.parse_counts(parser, "--counts", args.counts)
    epochs = _bench.parse_epochs(parser, "--epochs", args.epochs, _WORKLOADS)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1. Received: {args.repeats}")
    scale, repeats = (0.125, 1) if args.quick else (1.0, args.repeats)
    if args.quick:
        epochs = dict.fromkeys(_WORKLOADS, 1)
    if "fit" in workloads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)  # the model's step: one core
        tf.config.threading.set_inter_op_parallelism_threads(1)
    makers = {
        "a": lambda: bl.Augment(num_images=int(2048 * scale)),
        "c": lambda: bl.Waits(n=max(8, int(48 * scale))),
        "fit": lambda: bl.Augment(num_images=int(2048 * scale)),
        "blas": lambda: bl.Blas(n=max(8, int(60 * scale))),
    }
    rows = []
    for w in workloads:
        runs = {c: [] for c in counts + ["auto"]}
        ends = []
        for _ in range(repeats):
            for c in counts + ["auto"]:
                rate, stats = (run_fit if w == "fit" else run)(makers[w], c, max(epochs[w], 2 if w == "fit" else 1))
                runs[c].append(rate)
                if c == "auto":
                    ends.append(stats)
                print(f"  {w}: workers={c!s:<5} {rate:10.1f} samples/s" + (f"  (ended with {stats['workers']})" if c == "auto" else ""), flush=True)
        best_fixed = max(max(runs[c]) for c in counts)
        for c in counts + ["auto"]:
            row = {"workload": w, "workers": c, "samples_per_s": max(runs[c]), "samples_per_s_runs": runs[c], "x_best_fixed": max(runs[c]) / best_fixed}
            if c == "auto":
                best = max(range(len(runs[c])), key=runs[c].__getitem__)
                row["workers_end"] = ends[best]["workers"]
                row["cpu_limit"] = ends[best]["cpu_limit"]
                row["auto_decisions"] = ends[best]["auto_decisions"]
            rows.append(row)

    print(f"\nworkers='auto' vs fixed: {len(os.sched_getaffinity(0))} CPUs, epochs {epochs}, best of {repeats} runs in rounds\n")
    lines = []
    for r in rows:
        extra = ""
        if r["workers"] == "auto":
            changes = " ".join(f"{d['workers_from']}->{d['workers_to']}@{d['t']:.1f}s" for d in r["auto_decisions"])
            extra = f"  {r['workers_end']} ({changes or 'none'})"
        lines.append([r["workload"], r["workers"], r["samples_per_s"], r["x_best_fixed"], extra])
    _bench.print_table([("workload", "<10", ""), ("workers", ">9", ""), ("samples/s", ">12", ".1f"), ("x best fixed", ">14", ".2f"),
                        ("  auto: workers at the end (changes)", "", "")], lines, rule=False)
    checks = []
    if "blas" in workloads:
        checks = bl.blas_checks({r["workers"]: r["samples_per_s"] for r in rows if r["workload"] == "blas"})
        print("\nTargets (blas):")
        bl.print_checks(checks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "targets": [{"name": n, "measured": v, "target": t} for n, v, t in checks],
                       "argv": sys.argv[1:] if argv is None else argv}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
