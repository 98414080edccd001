#!/usr/bin/env python3
"""All-reduce (MultiWorkerMirroredStrategy) against parameter servers on local workers, side by side.

Trains the same MLP (FEATURES -> 256 -> 256 -> 10 classes, Adam 1e-3) on the same synthetic
task with the same global batch (samples per optimizer update) for the same number of
updates, twice, each under `kpipe.distribute.launch` on 127.0.0.1:

  mwms  `--workers` processes, kpipe's MultiWorkerMirroredStrategy and Keras `fit()`: each
        step all-reduces the gradients of `batch / workers` samples per worker.
  ps    a chief, `--workers` workers and `--ps` parameter servers, `kpipe.distribute.ps_fit`:
        each step is one worker's batch of `batch` samples, applied asynchronously.

Reports updates/s and samples/s over the epochs after the first (tracing and start-up
excluded), the last epoch's training loss, and the loss on a held-out set.

    python scripts/bench_ps.py                          # 2 workers, 1 ps, batch 256
    python scripts/bench_ps.py --workers 2 --steps 200 --epochs 4 --json ps.json
"""

import argparse
import io
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

FEATURES = 32
CLASSES = 10


def _data(n, seed):
    import numpy as np

    rng = np.random.RandomState(seed)
    x = rng.randn(n, FEATURES).astype("float32")
    w = np.random.RandomState(123).randn(FEATURES, CLASSES).astype("float32")
    y = np.argmax(x @ w + 0.5 * rng.randn(n, CLASSES), axis=1).astype("int32")
    return x, y


def _model(keras):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(CLASSES)])
    model.compile(keras.optimizers.Adam(1e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _timer(keras, times):
    class EpochTimes(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            times.append([time.perf_counter()])

        def on_epoch_end(self, epoch, logs=None):
            times[-1].append(time.perf_counter())

    return EpochTimes()


def child(args) -> int:
    """One task of a run: trains and (on the chief / worker 0) writes the figures."""
    import keras
    import tensorflow as tf

    import kpipe.distribute as kd

    strategy = kd.auto_strategy()  # ps mode: workers and ps tasks serve here, never return
    info = kd.cluster_info()
    x, y = _data(20000, seed=1)
    x_val, y_val = _data(4096, seed=2)
    with strategy.scope():
        model = _model(keras)
    times = []
    common = dict(epochs=args.epochs, steps_per_epoch=args.steps, verbose=0,
                  validation_data=(x_val, y_val), callbacks=[_timer(keras, times)])
    if args.child == "ps":
        def dataset_fn(ctx):
            return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(20000).batch(
                args.batch, drop_remainder=True)

        history = kd.ps_fit(model, dataset_fn, **common)
        workers = len(info.cluster["worker"])
    else:
        workers = info.num_workers
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(20000, seed=0).repeat() \
            .batch(args.batch, drop_remainder=True)  # global batch, split over the workers
        history = model.fit(dataset, **common)
    later = times[1:] or times
    seconds = sum(end - start for start, end in later)
    updates = args.steps * len(later)
    if info.is_chief:
        with open(args.out, "w") as f:
            json.dump({"updates_per_s": updates / seconds,
                       "samples_per_s": updates * args.batch / seconds,
                       "loss": history.history["loss"][-1],
                       "val_loss": history.history["val_loss"][-1],
                       "workers": workers}, f)
    return 0


def run(kind, args) -> dict:
    from kpipe.distribute import launch

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--child", kind, "--out", out,
                   "--steps", str(args.steps), "--epochs", str(args.epochs),
                   "--batch", str(args.batch)]
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               "TF_CPP_MIN_LOG_LEVEL": "3"}
        log = io.StringIO()
        extra = {"ps": args.ps} if kind == "ps" else {}
        result = launch(command, workers=args.workers, env=env, output=log,
                        timeout_s=args.timeout, warn_open_ports=False, **extra)
        if result.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(log.getvalue()[-4000:])
            raise SystemExit(f"bench_ps: the {kind} run failed with status {result.returncode}")
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="workers in both runs. Default: 2")
    parser.add_argument("--ps", type=int, default=1, help="ps tasks of the ps run. Default: 1")
    parser.add_argument("--batch", type=int, default=256,
                        help="global batch: samples per optimizer update. Default: 256")
    parser.add_argument("--steps", type=int, default=150, help="updates per epoch. Default: 150")
    parser.add_argument("--epochs", type=int, default=3,
                        help="epochs; the first is not timed. Default: 3")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run. Default: 600")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument("--child", choices=("mwms", "ps"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.workers < 1 or args.ps < 1 or args.batch % args.workers:
        parser.error(f"need --workers >= 1, --ps >= 1 and --batch divisible by --workers. "
                     f"Received: workers={args.workers}, ps={args.ps}, batch={args.batch}.")
    results = {kind: run(kind, args) for kind in ("mwms", "ps")}
    print(f"{args.workers} local workers, global batch {args.batch}, {args.steps} updates x "
          f"{args.epochs} epochs (first not timed), {os.cpu_count()} CPU cores")
    print(f"{'':6} {'updates/s':>10} {'samples/s':>10} {'loss':>8} {'val_loss':>9}")
    for kind, label in (("mwms", "MWMS"), ("ps", f"PS({args.ps})")):
        r = results[kind]
        print(f"{label:6} {r['updates_per_s']:10.1f} {r['samples_per_s']:10.0f} "
              f"{r['loss']:8.4f} {r['val_loss']:9.4f}")
    ratio = results["ps"]["updates_per_s"] / results["mwms"]["updates_per_s"]
    print(f"PS / MWMS updates per second: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
