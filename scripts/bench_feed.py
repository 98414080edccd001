#!/usr/bin/env python3
"""How fast `fit()` can *take* batches: kpipe's loaders against an in-memory tf.data
pipeline, side by side in one run (issue #13, part 5).

The model's step costs almost nothing (a Dense layer on a 4x4 corner of each image, cast
to float32), so steps/s measures the hand-over of batches into `fit()`, not the model.
The batches are uint8 images held in memory (`--distinct` distinct batches, served
round-robin for `--steps` steps per epoch), labels int64:

  1.5 MB   128 x 64 x 64 x 3
  9.6 MB   64 x 224 x 224 x 3

Rows (each one `fit(epochs=1 + --epochs)`; the best epoch after the first counts, the
"steps/s" table):

  tf.data              tf.data.Dataset.from_tensor_slices(...).batch(...).prefetch(AUTOTUNE)
                       (the 1.00 reference)
  PyDataset            a plain keras.utils.PyDataset returning views of the arrays
  kpipe                kpipe.ProcessLoader(dataset, workers=--workers) (kpipe's feed: a
                       thread converts batches to tensors ahead of the step, Keras >= 3.7)
  kpipe from_generator the same loader handed over as before the feed: Keras's adapter
                       and tf.data.Dataset.from_generator (the "before" of the feed)
  kpipe.as_dataset     the same loader's .as_dataset()
  kpipe auto           kpipe.ProcessLoader(dataset, workers="auto")
  keras-mp             the PyDataset with workers=--workers, use_multiprocessing=True

Then, on the same warm model and input, what users see of whole calls (the "whole calls"
table): one more `fit(epochs=--epochs)` timed from the call to its return (start-up,
epoch ends and all), as steps/s; and `--calls` further `fit(epochs=1)` calls, each timed
from the call to the end of its first step (`on_train_batch_end`: the start-up every
`fit()`/`evaluate()` pays, probes and stream start included), the median reported.

Then a per-batch breakdown of the kpipe paths -- `fit(loader)` through the feed and
through `from_generator`, and `fit(loader.as_dataset())` -- from `time.perf_counter`
wrappers: time in the loader per batch (`_stream_next`), of it the wait for the worker's
message (`_pump`), building the batch's arrays over the shared slot (`get` minus
`_pump`), submitting the next task (`submit`) and the loader's own bookkeeping; Keras's
`_standardize_batch`; the feed's tensor conversion (`to_tensor`); on the feed path, the
main thread's wait for the next ready batch (`Feed.__next__`). The loader, the
standardization and the conversion run in a thread (tf.data's or the feed's) and overlap
the training step; "rest" is the step minus the feed's `next` (feed path) or minus the
loader and standardization (other paths): TensorFlow's part, and Keras's.

On the JAX and PyTorch backends (`--backend jax|torch`, issue 47) the rows are that
backend's usual input (NumPy arrays given to fit(); a torch DataLoader), a plain PyDataset,
on JAX kpipe read in the trainer's own thread as before its JAX feed ("kpipe in-thread"),
and kpipe through its feed at each `--worker-counts` count. Every row runs once per round,
`--rounds` rounds interleaved (a change in the machine's load falls on all rows alike); a
row's figure is its best epoch after the first of each call over the rounds, and the
median of the rounds' bests beside it; "CPU ms/step" is the CPU time of the whole process
tree (this process, kpipe's fork server and workers) per step of a call, least of the
rounds, and "trainer" this process's part of it (the rest is the workers'). On JAX a
per-batch breakdown follows (the trainer's next(), the loader, Keras's
standardization, the conversion for JAX).

    python scripts/bench_feed.py                       # both sizes, all rows
    python scripts/bench_feed.py --sizes 1.5MB --epochs 6 --json feed.json
    python scripts/bench_feed.py --small               # a smoke test, not a measurement
    python scripts/bench_feed.py --backend jax --sizes 1.5MB --steps 256 --rounds 5 --worker-counts 1,2,4
"""

import argparse
import contextlib
import functools
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if "--backend" in sys.argv[:-1]:  # Keras picks its backend at import: set it before importing Keras
    os.environ["KERAS_BACKEND"] = sys.argv[sys.argv.index("--backend") + 1]

import numpy as np  # noqa: E402

import keras  # noqa: E402

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:  # (imported by its path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402  (the scripts' option parsing and tables)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kpipe  # noqa: E402

_SIZES = {"1.5MB": (128, 64, 64, 3), "9.6MB": (64, 224, 224, 3)}
_SMALL_SIZES = {"1.5MB": (16, 16, 16, 3), "9.6MB": (8, 32, 32, 3)}
_ROWS = ("tf.data", "PyDataset", "kpipe", "kpipe from_generator", "kpipe.as_dataset", "kpipe auto", "keras-mp")


class Batches(keras.utils.PyDataset):
    """Batch i is batch `i % distinct` of arrays held in memory (views, no copy)."""

    def __init__(self, x, y, steps, **kw):
        super().__init__(**kw)
        self.x, self.y, self.steps = x, y, steps

    def __len__(self):
        return self.steps

    def __getitem__(self, i):
        distinct = self.x.shape[0]
        return self.x[i % distinct], self.y[i % distinct]


def make_data(shape, distinct):
    """`distinct` batches of `shape` uint8 images and int64 labels: (distinct, *shape)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(distinct,) + shape, dtype=np.uint8)
    y = rng.integers(0, 10, size=(distinct, shape[0])).astype("int64")
    return x, y


def make_model(shape):
    """A step that costs ~nothing whatever the batch size: Dense on a 4x4 corner."""
    inputs = keras.Input(shape=shape[1:], dtype="uint8")
    corner = keras.layers.Lambda(lambda t: keras.ops.cast(t[:, :4, :4, :], "float32") * (1 / 255))(inputs)
    outputs = keras.layers.Dense(10)(keras.layers.Flatten()(corner))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class EpochTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = []  # (steps, seconds)

    def on_epoch_begin(self, epoch, logs=None):
        self._t0, self._steps = time.perf_counter(), 0

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append((self._steps, time.perf_counter() - self._t0))


def tfdata_input(x, y, steps):
    import tensorflow as tf

    distinct = x.shape[0]
    flat_x = x.reshape((-1,) + x.shape[2:])
    flat_y = y.reshape(-1)
    ds = tf.data.Dataset.from_tensor_slices((flat_x, flat_y)).batch(x.shape[1])
    repeats = -(-steps // distinct)
    return ds.repeat(repeats).take(steps).prefetch(tf.data.AUTOTUNE)


@contextlib.contextmanager
def make_input(row, x, y, steps, workers):
    """The input `fit()` gets for `row`; closes what it started afterwards."""
    if row == "tf.data":
        yield tfdata_input(x, y, steps), None
    elif row == "PyDataset":
        yield Batches(x, y, steps), None
    elif row == "keras-mp":
        yield Batches(x, y, steps, workers=workers, use_multiprocessing=True, max_queue_size=10), None
    else:
        loader = kpipe.ProcessLoader(Batches(x, y, steps), workers="auto" if row == "kpipe auto" else workers)
        try:
            with without_feed(row == "kpipe from_generator"):
                yield (loader.as_dataset() if row == "kpipe.as_dataset" else loader), loader
        finally:
            loader.close()


@contextlib.contextmanager
def without_feed(active=True):
    """Hands ProcessLoaders to Keras through from_generator, as before kpipe's feed."""
    from keras.src.trainers import data_adapters

    adapter = data_adapters.PyDatasetAdapter
    if not active or not hasattr(adapter, "_kpipe_feed"):
        yield
        return
    original = adapter._kpipe_feed
    adapter._kpipe_feed = lambda self, strategy: None
    try:
        yield
    finally:
        adapter._kpipe_feed = original


class FirstStep(keras.callbacks.Callback):
    """Seconds from `t0` (set just before the call) to the end of the call's first step."""

    def __init__(self):
        super().__init__()
        self.t0, self.first = None, None

    def on_train_batch_end(self, batch, logs=None):
        if self.first is None:
            self.first = time.perf_counter() - self.t0


def whole_calls(model, data, epochs, steps, calls):
    """Steps/s of one whole `fit(epochs=epochs)` call, and the median first-step latency
    (ms) of `calls` `fit(epochs=1)` calls, all on a model and input used before (warm)."""
    t0 = time.perf_counter()
    model.fit(data, epochs=epochs, verbose=0)
    whole = epochs * steps / (time.perf_counter() - t0)
    firsts = []
    for _ in range(calls):
        cb = FirstStep()
        cb.t0 = time.perf_counter()
        model.fit(data, epochs=1, verbose=0, callbacks=[cb])
        firsts.append(cb.first * 1e3)
    firsts.sort()
    return whole, firsts[len(firsts) // 2], firsts


def fit_rate(model, data, epochs):
    """Steps/s of the best epoch after the first (warm-up), and all epochs' rates."""
    timer = EpochTimer()
    model.fit(data, epochs=1 + epochs, verbose=0, callbacks=[timer])
    rates = [steps / seconds for steps, seconds in timer.epochs]
    return max(rates[1:] or rates), rates, timer


class _Clock:
    """Accumulates the wall time of calls to wrapped functions, per name."""

    def __init__(self):
        self.total = {}
        self.calls = {}

    def wrap(self, name, fn):
        total, calls = self.total, self.calls
        total.setdefault(name, 0.0)
        calls.setdefault(name, 0)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total[name] += time.perf_counter() - t0
                calls[name] += 1

        return timed

    def reset(self):
        for k in self.total:
            self.total[k], self.calls[k] = 0.0, 0


def breakdown(model, x, y, steps, epochs, workers, path):
    """Per-batch microseconds of a kpipe path's work (see the docstring); `path` is
    "feed", "from_generator" or "as_dataset"."""
    from keras.src.trainers import data_adapters

    from kpipe import _feed, _stream

    clock = _Clock()
    adapter_cls = data_adapters.PyDatasetAdapter
    patched = [(adapter_cls, "_standardize_batch"), (_feed, "to_tensor"), (_feed.Feed, "__next__")]
    originals = [getattr(owner, name) for owner, name in patched]
    for (owner, name), fn in zip(patched, originals):
        setattr(owner, name, clock.wrap(name, fn))
    loader = kpipe.ProcessLoader(Batches(x, y, steps), workers=workers)
    try:
        reader = _stream.source_of(loader)  # (the loader's parts, as kpipe's own readers reach them)
        reader.stream_next = clock.wrap("loader", reader.stream_next)
        backend = reader.backend
        backend.get = clock.wrap("get", backend.get)
        backend.submit = clock.wrap("submit", backend.submit)
        backend._pump = clock.wrap("pump", backend._pump)
        data = loader.as_dataset() if path == "as_dataset" else loader
        timer = EpochTimer()

        class Reset(keras.callbacks.Callback):  # count the timed epochs only
            def on_epoch_begin(self, epoch, logs=None):
                clock.reset()
                self.batches0 = loader.stats()["batches"]

            def on_epoch_end(self, epoch, logs=None):
                per = {k: v for k, v in clock.total.items()}
                per["batches"] = loader.stats()["batches"] - self.batches0
                epochs_seen.append(per)

        epochs_seen = []
        with without_feed(path == "from_generator"):
            model.fit(data, epochs=1 + epochs, verbose=0, callbacks=[timer, Reset()])
    finally:
        for (owner, name), fn in zip(patched, originals):
            setattr(owner, name, fn)
        loader.close()
    rates = [s / t for s, t in timer.epochs]
    best = max(range(1, len(rates)), key=rates.__getitem__) if len(rates) > 1 else 0
    per, rate = epochs_seen[best], rates[best]
    n = max(1, per["batches"])
    us = {k: 1e6 * per[k] / n for k in ("loader", "get", "submit", "pump", "_standardize_batch", "to_tensor", "__next__")}
    feed = path == "feed"
    main = us["__next__"] if feed else us["loader"] + us["_standardize_batch"]
    return {
        "path": {"feed": "fit(loader)", "from_generator": "fit(loader) from_generator",
                 "as_dataset": "fit(loader.as_dataset())"}[path],
        "steps_per_s": rate,
        "step_us": 1e6 / rate,
        "loader_us": us["loader"],
        "wait_recv_us": us["pump"],
        "arrays_us": us["get"] - us["pump"],
        "submit_us": us["submit"],
        "bookkeeping_us": us["loader"] - us["get"] - us["submit"],
        "standardize_us": us["_standardize_batch"],
        "convert_us": us["to_tensor"],
        "feed_next_us": us["__next__"] if feed else 0.0,
        "rest_us": 1e6 / rate - main,
    }


def by_size(rows, sizes, columns):
    """A table of a line per row name ("input to fit()") and, for each size, `columns`:
    `(key, title, width, fmt)`, "{size}" in a title replaced by the size; "-" where a
    row did not run at a size."""
    head = [("input to fit()", "<20", "")] + [(title.format(size=size), width, fmt) for size in sizes for _, title, width, fmt in columns]
    lines = []
    for name in dict.fromkeys(r["row"] for r in rows):
        line = [name]
        for size in sizes:
            r = next((r for r in rows if r["row"] == name and r["size"] == size), None)
            line += [r[key] if r else None for key, *_ in columns]
        lines.append(line)
    _bench.print_table(head, lines)


def print_table(rows, sizes):
    print()
    by_size(rows, sizes, [("steps_per_s", "{size} steps/s", ">17", ".0f"), ("vs_tfdata", "vs tf.data", ">12", ".2f")])


def print_calls(rows, sizes):
    print("\nWhole calls (warm model and input): one fit(epochs=--epochs) from call to return, and the "
          "median time from a fit(epochs=1) call to the end of its first step")
    by_size(rows, sizes, [("whole_steps_per_s", "{size} whole/s", ">15", ".0f"), ("whole_vs_tfdata", "vs tf.data", ">11", ".2f"),
                          ("first_step_ms", "1st step ms", ">12", ".1f"), ("first_step_vs_tfdata", "vs tf.data", ">11", ".2f")])


def print_breakdown(items):
    cols = [("step_us", "step"), ("loader_us", "in loader"), ("wait_recv_us", "wait+recv"), ("arrays_us", "arrays"),
            ("submit_us", "submit"), ("bookkeeping_us", "bookkeep"), ("standardize_us", "keras std"),
            ("convert_us", "to tensor"), ("feed_next_us", "feed next"), ("rest_us", "rest")]
    print(f"\nPer-batch time of the kpipe paths, microseconds (workers={items[0]['workers']}); the loader, keras std and to tensor run in a thread, beside the step:")
    _bench.print_table([("size", "<7", ""), ("path", "<29", "")] + [(title, ">10", ".0f") for _, title in cols],
                       [[b["size"], b["path"]] + [b[key] for key, _ in cols] for b in items], rule=False)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(_SIZES), help=f"comma-separated subset of {','.join(_SIZES)}. Default: both")
    parser.add_argument("--rows", default=",".join(_ROWS), help=f"comma-separated subset of {','.join(_ROWS)} (tf.data is always run). Default: all")
    parser.add_argument("--epochs", type=int, default=4, help="timed epochs after one warm-up epoch; the best counts. Default: 4")
    parser.add_argument("--steps", type=int, default=64, help="batches per epoch. Default: 64")
    parser.add_argument("--distinct", type=int, default=16, help="distinct batches held in memory, served round-robin. Default: 16")
    parser.add_argument("--workers", type=int, default=2, help="workers of the kpipe and Keras multiprocessing rows. Default: 2")
    parser.add_argument("--worker-counts", metavar="N,N", help="jax/torch: a kpipe row per worker count (e.g. 1,2,4). "
                        "Default: --workers")
    parser.add_argument("--rounds", type=int, default=3, help="jax/torch: interleaved rounds of every row. Default: 3")
    parser.add_argument("--calls", type=int, default=7, help="fit(epochs=1) calls timed to their first step, per row. Default: 7")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the per-batch breakdown of the kpipe paths")
    parser.add_argument("--small", action="store_true", help="tiny batches, 8 steps, 1 timed epoch: a smoke test, not a measurement")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"), default=keras.backend.backend(),
                        help="Keras backend (set before Keras is imported); jax/torch compare kpipe with that "
                             "backend's usual input (NumPy arrays; a torch DataLoader). Default: KERAS_BACKEND's")
    args = parser.parse_args(argv)
    if args.backend != keras.backend.backend():
        parser.error(f"--backend {args.backend}: Keras already runs on {keras.backend.backend()!r}; run the script "
                     f"as `python scripts/bench_feed.py --backend {args.backend}` (or set KERAS_BACKEND)")

    sizes = _bench.parse_names(parser, "--sizes", args.sizes, _SIZES)
    rows = _bench.parse_names(parser, "--rows", args.rows, _ROWS, allow_empty=True)
    rows = ["tf.data"] + [r for r in _ROWS[1:] if r in rows]
    for name in ("epochs", "steps", "distinct", "workers", "calls", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1. Received: {getattr(args, name)}")
    args.counts = _bench.parse_counts(parser, "--worker-counts", args.worker_counts) if args.worker_counts else [args.workers]
    shapes = _SMALL_SIZES if args.small else _SIZES
    epochs, steps = (1, 8) if args.small else (args.epochs, args.steps)
    calls = 2 if args.small else args.calls
    distinct = min(args.distinct, steps)

    if args.backend != "tensorflow":
        return backend_main(args, sizes, shapes, epochs, steps, calls, distinct)
    import tensorflow as tf

    results, parts = [], []
    for size in sizes:
        shape = shapes[size]
        x, y = make_data(shape, distinct)
        model = make_model(shape)
        for row in rows:
            with make_input(row, x, y, steps, args.workers) as (data, loader):
                best, rates, _ = fit_rate(model, data, epochs)
                whole, first, firsts = whole_calls(model, data, epochs, steps, calls)
                extra = {"workers_end": loader.stats()["workers"]} if loader is not None else {}
            results.append({"size": size, "batch_shape": list(shape), "batch_mb": x[0].nbytes / 1e6, "row": row,
                            "steps_per_s": best, "epoch_rates": rates, "whole_steps_per_s": whole,
                            "first_step_ms": first, "first_steps_ms": firsts, **extra})
            print(f"  {size}: {row:<18} {best:8.0f} steps/s best epoch, {whole:8.0f} whole call, first step {first:6.1f} ms", flush=True)
        ref = next(r for r in results if r["size"] == size and r["row"] == "tf.data")
        for r in results:
            if r["size"] == size:
                r["vs_tfdata"] = r["steps_per_s"] / ref["steps_per_s"]
                r["whole_vs_tfdata"] = r["whole_steps_per_s"] / ref["whole_steps_per_s"]
                r["first_step_vs_tfdata"] = r["first_step_ms"] / ref["first_step_ms"]
        if not args.no_breakdown:
            for path in ("from_generator", "feed", "as_dataset"):
                parts.append(dict(breakdown(model, x, y, steps, epochs, args.workers, path), size=size, workers=args.workers))
        del model, x, y

    print(f"\nFeed benchmark: {len(os.sched_getaffinity(0))} CPUs, {steps} steps per epoch, best of 1 warm-up + {epochs} epochs, "
          f"workers={args.workers}, tensorflow {tf.__version__}, keras {keras.__version__}" + (" (--small: smoke test)" if args.small else ""))
    print_table(results, sizes)
    print_calls(results, sizes)
    if parts:
        print_breakdown(parts)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": results, "breakdown": parts, "argv": sys.argv[1:] if argv is None else argv}, f, indent=2)
    return 0


def _backend_rows(backend, counts):
    """The baseline first, then a plain PyDataset, kpipe handed over in Keras's thread (JAX:
    the adapter's own iterator, as before kpipe's JAX feed), and kpipe at each worker count."""
    base = ("torch DataLoader",) if backend == "torch" else ("numpy",)
    before = ("kpipe in-thread",) if backend == "jax" else ()
    return base + ("PyDataset",) + before + tuple(f"kpipe workers={n}" for n in counts)


@contextlib.contextmanager
def without_jax_feed(active=True):
    """Hands ProcessLoaders to Keras's JAX trainer through the adapter's own iterator (read
    in the trainer's thread), as before kpipe's JAX feed (kpipe/_jax_feed.py)."""
    from keras.src.trainers import data_adapters

    adapter = data_adapters.PyDatasetAdapter
    plain = getattr(adapter, "_kpipe_plain_jax_iterator", None)
    if not active or plain is None:
        yield
        return
    fed = adapter.get_jax_iterator
    adapter.get_jax_iterator = plain
    try:
        yield
    finally:
        adapter.get_jax_iterator = fed


@contextlib.contextmanager
def backend_input(row, x, y, steps, workers):
    """The input `fit()` gets for `row` on JAX / PyTorch (the first row is the baseline):
    `steps` batches, batch i = batch `i % distinct`, in order."""
    if row in ("numpy", "torch DataLoader"):
        order = np.arange(steps) % x.shape[0]
        flat_x, flat_y = x[order].reshape((-1,) + x.shape[2:]), y[order].reshape(-1)
        if row == "numpy":
            yield (flat_x, flat_y), {"batch_size": x.shape[1], "shuffle": False}
        else:
            import torch

            data = torch.utils.data.TensorDataset(torch.from_numpy(flat_x), torch.from_numpy(flat_y))
            yield (torch.utils.data.DataLoader(data, batch_size=x.shape[1], shuffle=False),), {}
    elif row == "PyDataset":
        yield (Batches(x, y, steps),), {}
    else:
        count = int(row.rsplit("=", 1)[1]) if "=" in row else workers
        with without_jax_feed(row == "kpipe in-thread"):
            with kpipe.ProcessLoader(Batches(x, y, steps), workers=count) as loader:
                yield (loader,), {}


def jax_breakdown(model, x, y, steps, epochs, workers, fed):
    """Per-batch microseconds of one kpipe path on JAX (the best epoch after the first): the
    trainer's `next()` (its whole wait for a batch), the loader's `stream_next` and, of it,
    the wait for the worker's message (`_pump`) and the arrays over the slot (`get` minus
    `_pump`), Keras's `_standardize_batch`, and the conversion for JAX ("to JAX": Keras's
    leaf conversion, and `jax.device_put` off the CPU; fed: in the feed's thread, beside the
    step; in-thread: Keras's own, not timed, so 0)."""
    from kpipe import _jax_feed, _stream

    clock = _Clock()
    from keras.src.trainers import data_adapters

    adapter_cls = data_adapters.PyDatasetAdapter
    patched = [(adapter_cls, "_standardize_batch"), (_jax_feed._JaxPlacement, "__call__")]
    originals = [getattr(owner, name) for owner, name in patched]
    for (owner, name), fn in zip(patched, originals):
        setattr(owner, name, clock.wrap("to_jax" if name == "__call__" else name, fn))
    loader = kpipe.ProcessLoader(Batches(x, y, steps), workers=workers)
    model.make_train_function(force=True)
    step = model.train_function
    try:
        reader = _stream.source_of(loader)
        reader.stream_next = clock.wrap("loader", reader.stream_next)
        backend = reader.backend
        backend.get = clock.wrap("get", backend.get)
        backend._pump = clock.wrap("pump", backend._pump)
        timer, seen = EpochTimer(), []

        def timed_step(state, iterator):  # the trainer's next(): what the step waits for its batch
            class Timed:
                def __next__(self):
                    t0 = time.perf_counter()
                    try:
                        return next(iterator)
                    finally:
                        clock.total["next"] = clock.total.get("next", 0.0) + time.perf_counter() - t0

            return step(state, Timed())

        model.train_function = timed_step

        class Reset(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                clock.reset()
                clock.total["next"] = 0.0
                self.batches0 = loader.stats()["batches"]

            def on_epoch_end(self, epoch, logs=None):
                seen.append(dict(clock.total, batches=loader.stats()["batches"] - self.batches0))

        with without_jax_feed(not fed):
            model.fit(loader, epochs=1 + epochs, verbose=0, callbacks=[timer, Reset()])
    finally:
        for (owner, name), fn in zip(patched, originals):
            setattr(owner, name, fn)
        model.train_function = None
        loader.close()
    rates = [s / t for s, t in timer.epochs]
    best = max(range(1, len(rates)), key=rates.__getitem__) if len(rates) > 1 else 0
    per, n = seen[best], max(1, seen[best]["batches"])
    us = {k: 1e6 * per.get(k, 0.0) / n for k in ("next", "loader", "get", "pump", "_standardize_batch", "to_jax")}
    return {"path": "kpipe (feed)" if fed else "kpipe in-thread", "steps_per_s": rates[best], "step_us": 1e6 / rates[best],
            "next_us": us["next"], "loader_us": us["loader"], "wait_recv_us": us["pump"],
            "arrays_us": us["get"] - us["pump"], "standardize_us": us["_standardize_batch"], "to_jax_us": us["to_jax"]}


def tree_cpu_seconds():
    """CPU seconds (user + system) used so far by this process (`time.process_time`) and
    every live descendant (the loader's fork server and workers: from /proc, in clock
    ticks); None where there is no /proc."""
    try:
        stats = {}
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                stats[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
    except OSError:
        return None
    children = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    ticks, todo = 0, list(children.get(os.getpid(), ()))
    while todo:
        pid = todo.pop()
        ticks += stats.get(pid, (0, 0))[1]
        todo.extend(children.get(pid, ()))
    return time.process_time() + ticks / os.sysconf("SC_CLK_TCK")


def backend_main(args, sizes, shapes, epochs, steps, calls, distinct):
    """`fit()` steps/s from kpipe against the backend's usual input, side by side in one run:
    `--rounds` rounds, each running every row once (interleaved, so that a change in the
    machine's load falls on all rows alike); a row's figure is its best epoch after the
    first of each call, over the rounds (the median of those per-round bests too)."""
    rows = _backend_rows(args.backend, args.counts)
    rounds = 1 if args.small else args.rounds
    results, parts = [], []
    for size in sizes:
        shape = shapes[size]
        x, y = make_data(shape, distinct)
        model = make_model(shape)
        per_row = {row: {"bests": [], "rates": [], "wholes": [], "cpu": [], "own": []} for row in rows}
        for _ in range(rounds):
            for row in rows:
                with backend_input(row, x, y, steps, args.workers) as (fit_args, fit_kwargs):
                    timer = EpochTimer()
                    cpu0, own0, t0 = tree_cpu_seconds(), time.process_time(), time.perf_counter()
                    model.fit(*fit_args, epochs=1 + epochs, verbose=0, callbacks=[timer], **fit_kwargs)
                    whole = (1 + epochs) * steps / (time.perf_counter() - t0)
                    cpu1, own1 = tree_cpu_seconds(), time.process_time()
                rates = [n / seconds for n, seconds in timer.epochs]
                mine = per_row[row]
                if cpu0 is not None and cpu1 is not None:
                    mine["cpu"].append(1e3 * (cpu1 - cpu0) / ((1 + epochs) * steps))
                    mine["own"].append(1e3 * (own1 - own0) / ((1 + epochs) * steps))
                mine["bests"].append(max(rates[1:] or rates))
                mine["rates"].append(rates)
                mine["wholes"].append(whole)
        for row in rows:
            mine = per_row[row]
            best, median = max(mine["bests"]), sorted(mine["bests"])[len(mine["bests"]) // 2]
            results.append({"size": size, "batch_shape": list(shape), "row": row, "steps_per_s": best,
                            "median_steps_per_s": median, "epoch_rates": mine["rates"][-1], "round_rates": mine["rates"],
                            "whole_steps_per_s": max(mine["wholes"]),
                            "cpu_ms_per_step": min(mine["cpu"]) if mine["cpu"] else None,
                            "trainer_cpu_ms_per_step": min(mine["own"])})
            print(f"  {size}: {row:<18} {best:8.0f} steps/s best epoch, {median:8.0f} median of rounds, "
                  f"{max(mine['wholes']):8.0f} whole call", flush=True)
        ref = next(r for r in results if r["size"] == size and r["row"] == rows[0])
        for r in results:
            if r["size"] == size:
                r["vs_baseline"] = r["steps_per_s"] / ref["steps_per_s"]
                r["median_vs_baseline"] = r["median_steps_per_s"] / ref["median_steps_per_s"]
                r["whole_vs_baseline"] = r["whole_steps_per_s"] / ref["whole_steps_per_s"]
        if args.backend == "jax" and not args.no_breakdown:
            for fed in (False, True):
                parts.append(dict(jax_breakdown(model, x, y, steps, epochs, args.workers, fed), size=size, workers=args.workers))
        del model, x, y
    print(f"\nFeed benchmark on Keras's {args.backend} backend: {len(os.sched_getaffinity(0))} CPUs, {steps} steps per epoch, "
          f"{rounds} interleaved rounds of 1 warm-up + {epochs} epochs per row; best epoch over the rounds (median of the "
          f"rounds' bests), whole call best; workers={args.workers} where not named; keras {keras.__version__}; "
          f"baseline: {rows[0]}" + (" (--small: smoke test)" if args.small else ""))
    print("(CPU ms/step: CPU time of this process, the loader's fork server and workers over a whole call, per "
          "step, least of the rounds: what a step costs the machine, less sensitive to other load than steps/s; "
          "'trainer': of it this process's, least of the rounds)")
    print(f"{'input':<20}" + "".join(f"{s + ' steps/s':>15}{'vs ' + rows[0]:>10}{'median vs':>11}{'whole vs':>10}"
                                     f"{'CPU ms/step':>13}{'trainer':>9}" for s in sizes))
    for row in rows:
        line = f"{row:<20}"
        for size in sizes:
            r = next(r for r in results if r["size"] == size and r["row"] == row)
            cpu = r["cpu_ms_per_step"]
            line += (f"{r['steps_per_s']:>15.0f}{r['vs_baseline']:>10.2f}{r['median_vs_baseline']:>11.2f}"
                     f"{r['whole_vs_baseline']:>10.2f}{'-' if cpu is None else format(cpu, '.2f'):>13}"
                     f"{r['trainer_cpu_ms_per_step']:>9.2f}")
        print(line)
    if parts:
        cols = [("step_us", "step"), ("next_us", "next()"), ("loader_us", "in loader"), ("wait_recv_us", "wait+recv"),
                ("arrays_us", "arrays"), ("standardize_us", "keras std"), ("to_jax_us", "to JAX")]
        print(f"\nPer-batch time of kpipe on JAX, microseconds (workers={args.workers}, best epoch); next() is the "
              "trainer's wait for a batch; in-thread, the loader runs inside it; fed, the loader, keras std and "
              "to JAX run in the feed's thread:")
        _bench.print_table([("size", "<7", ""), ("path", "<17", "")] + [(title, ">11", ".0f") for _, title in cols],
                           [[b["size"], b["path"]] + [b[key] for key, _ in cols] for b in parts], rule=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "rows": results, "breakdown": parts, "rounds": rounds,
                       "argv": sys.argv[1:]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
