"""What does `kpipe.callbacks.InputProfiler` cost? The same `fit()` with and without it.

For each workload the script runs `fit()` repeatedly, alternating *without* and *with* the
profiler (same process, same model, same in-memory `tf.data` input), and times the steady
state of each run: from the start of step `--warm` to the end of the epoch (graph tracing
and pipeline start-up are left out on both sides). Each rep runs the two arms back to back
(alternating which goes first), so a pair shares the machine's load of the moment; the
table shows the median step time of each arm and the median over pairs of the ratio
with/without, whose excess over 1 is the overhead.

Because the A/B difference is small next to run-to-run noise on a busy machine, the
wrapper's own per-step cost is also measured directly (a no-op train function wrapped vs
unwrapped, many calls) and printed as a share of each workload's step.

Workloads:
  * `tiny`: a 2-layer MLP whose step takes about a millisecond -- the worst case, where a
    fixed per-step cost shows most; it bounds the profiler's absolute cost per step.
  * `cnn`: a small convolutional network on 32x32x3 images, batch 64 -- a step of
    realistic length on a CPU.

Usage:
    python scripts/bench_profiler.py                 # both workloads, one device
    python scripts/bench_profiler.py --devices 2     # MirroredStrategy, 2 logical CPUs
    python scripts/bench_profiler.py --json out.json
"""

import argparse
import json
import os
import statistics
import sys
import time

# Run from a checkout without installing: the repository root goes first on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="tiny,cnn", help="comma-separated: tiny, cnn. Defaults to tiny,cnn.")
    parser.add_argument("--reps", type=int, default=15, help="back-to-back pairs of runs per workload. Defaults to 15.")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (0: 200 for tiny, 25 for cnn).")
    parser.add_argument("--warm", type=int, default=5, help="steps at the start of each run left untimed. Defaults to 5.")
    parser.add_argument("--devices", type=int, default=1, help="logical CPU devices; >1 uses MirroredStrategy. Defaults to 1.")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-' for stdout).")
    args = parser.parse_args(argv)
    for name in ("reps", "devices"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1. Received: {getattr(args, name)}.")
    unknown = set(args.workloads.split(",")) - {"tiny", "cnn"}
    if unknown:
        parser.error(f"--workloads accepts tiny and cnn. Received: {sorted(unknown)}.")
    return args


def _workload(name, keras, tf, steps):
    import numpy as np

    rng = np.random.default_rng(0)
    if name == "tiny":
        batch, steps = 32, steps or 200
        x = rng.normal(size=(batch * steps, 16)).astype("float32")
        y = rng.normal(size=(batch * steps, 1)).astype("float32")
        build = lambda: keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
        loss = "mse"
    else:
        batch, steps = 64, steps or 25
        x = rng.random((batch * steps, 32, 32, 3), dtype="float32")
        y = rng.integers(0, 10, size=(batch * steps,))
        build = lambda: keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                keras.layers.Conv2D(32, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(64, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Flatten(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).prefetch(tf.data.AUTOTUNE)
    return build, loss, data, steps, batch


def _run_workload(name, args, keras, tf, strategy, InputProfiler):
    build, loss, data, steps, batch = _workload(name, keras, tf, args.steps)
    with strategy.scope():
        model = build()
        model.compile(optimizer="sgd", loss=loss)

    class SteadyTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            if step == args.warm:
                self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_epoch_end(self, epoch, logs=None):
            self.per_step_s = (time.perf_counter() - self.t0) / (steps - args.warm)
            self.cpu_per_step_s = (time.process_time() - self.c0) / (steps - args.warm)

    def one_run(profiled):
        timer = SteadyTimer()
        cbs = [InputProfiler(warn_above=None), timer] if profiled else [timer]
        model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=cbs)
        return timer.per_step_s, timer.cpu_per_step_s

    one_run(False), one_run(True)  # trace both paths once
    base, prof, base_cpu, prof_cpu = [], [], [], []
    for rep in range(args.reps):
        order = (False, True) if rep % 2 == 0 else (True, False)
        for profiled in order:
            wall_s, cpu_s = one_run(profiled)
            (prof if profiled else base).append(wall_s)
            (prof_cpu if profiled else base_cpu).append(cpu_s)
    # Each rep runs both arms back to back, so a pair shares the machine's load of the moment:
    # the median of the per-pair ratios is robust to load spikes that hit single runs.
    ratio = statistics.median(q / r for r, q in zip(base, prof))
    b = statistics.median(base)
    return {
        "workload": name,
        "batch": batch,
        "steps_timed": steps - args.warm,
        "reps": args.reps,
        "base_ms": b * 1e3,
        "profiled_ms": statistics.median(prof) * 1e3,
        "ratio": ratio,
        "overhead_us": (ratio - 1.0) * b * 1e6,
        "overhead_pct": 100.0 * (ratio - 1.0),
        "base_fastest_ms": min(base) * 1e3,
        "profiled_fastest_ms": min(prof) * 1e3,
        "base_cpu_ms": statistics.median(base_cpu) * 1e3,
        "profiled_cpu_ms": statistics.median(prof_cpu) * 1e3,
        "base_runs_ms": [v * 1e3 for v in base],
        "profiled_runs_ms": [v * 1e3 for v in prof],
    }


def _bookkeeping_us(tf, keras, InputProfiler, calls=20000):
    """The wrapper's own cost per step, measured directly: it wraps a train function that
    does nothing and fetches from a plain Python iterator, against the same loop unwrapped."""
    import itertools

    from kpipe.callbacks._profiler import _TimedTrainFunction

    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(1)])
    profiler = InputProfiler(warn_above=None)
    profiler.set_model(model)
    profiler._active, profiler._input_kind = True, ("other", None)
    batch = (tf.zeros((32, 16)), tf.zeros((32, 1)))
    noop = lambda batches: None  # noqa: E731
    wrapper = _TimedTrainFunction(noop, profiler)

    def loop(step):
        it = itertools.repeat(batch)
        t0 = time.perf_counter()
        for _ in range(calls):
            step(it)
        return (time.perf_counter() - t0) / calls

    bare = min(loop(lambda it: noop([next(it)])) for _ in range(5))
    wrapped = min(loop(wrapper) for _ in range(5))
    return (wrapped - bare) * 1e6


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    if args.devices > 1:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.devices)
        strategy = tf.distribute.MirroredStrategy()
    else:
        strategy = tf.distribute.get_strategy()
    import keras

    from kpipe.callbacks import InputProfiler

    results = [_run_workload(w, args, keras, tf, strategy, InputProfiler) for w in args.workloads.split(",")]
    bookkeeping_us = _bookkeeping_us(tf, keras, InputProfiler)
    print(f"InputProfiler overhead, {args.devices} device(s), {args.reps} back-to-back pairs of runs per workload")
    print(f"{'workload':<9}{'batch':>6}{'without ms/step':>17}{'with':>8}{'paired ratio':>14}{'overhead':>10}")
    for r in results:
        print(f"{r['workload']:<9}{r['batch']:>6}{r['base_ms']:>17.3f}{r['profiled_ms']:>8.3f}"
              f"{r['ratio']:>14.3f}{r['overhead_pct']:>9.2f}%")
    print("(ms/step: medians; paired ratio: median over pairs of with/without; overhead = ratio - 1)")
    print(f"bookkeeping of the wrapper alone (measured directly): {bookkeeping_us:.1f} us/step = "
          + ", ".join(f"{100 * bookkeeping_us / (r['base_ms'] * 1e3):.2f}% of a {r['workload']} step" for r in results))
    # The profiler adds a fixed cost per step, independent of the model: its bookkeeping plus
    # whatever fetching outside the compiled step costs. The tiny workload, with the shortest
    # step, shows the latter best; a negative difference (faster) counts as zero.
    tiny = next((r for r in results if r["workload"] == "tiny"), None)
    fixed_us = bookkeeping_us + (max(0.0, tiny["overhead_us"]) if tiny else 0.0)
    for r in results:
        if r["workload"] != "tiny":
            print(f"fixed-cost estimate: {fixed_us:.1f} us/step = {100 * fixed_us / (r['base_ms'] * 1e3):.3f}% "
                  f"of a {r['workload']} step ({r['base_ms']:.1f} ms)")
    if args.json:
        text = json.dumps({"devices": args.devices, "bookkeeping_us": bookkeeping_us, "fixed_cost_us": fixed_us,
                           "results": results}, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
