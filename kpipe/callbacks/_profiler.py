"""`InputProfiler`: how much of each training step waits for the next batch.

NOTE [ How InputProfiler measures input wait ]

In Keras 3's TensorFlow trainer, `fit()` does not fetch batches in Python. Each step calls
`model.train_function(iterator)` with a `tf.distribute` iterator, and the `get_next()` runs
*inside* the compiled step function, fused with the forward and backward pass:

    fit loop (Python)                       train_function (tf.function)
    -----------------                       ----------------------------
    on_train_batch_begin ------------->     iterator.get_next()   <- input wait hides here
    train_function(iterator) -------->      strategy.run(train_step, batch)
    on_train_batch_end   <-------------     return logs

So timing between `on_train_batch_begin` and `on_train_batch_end` measures wait + compute
as one number, and timing between batches measures nothing (the wait is not there).

`InputProfiler` therefore replaces `model.train_function` for the duration of `fit()` with
a thin wrapper that does the `next(iterator)` itself, in Python, timed with
`time.perf_counter()`, and hands the fetched batch to Keras's own train function as a
one-element list. Keras's train function accepts any Python iterable of batches (that is
how `train_on_batch` feeds it): for a non-`tf.data` iterator it runs the same compiled
`one_step_on_data` (same `tf.function`, same `jit_compile`, same `strategy.run` and
cross-replica reduction) on the batch it is given. (Before Keras 3.7 the train function
takes iterators only; `kpipe._compat.train_step_on_batches` then builds that one-step
function the way Keras does.) Hence:

* input wait  = time blocked in `next(iterator)`: the moment the step asks for data until
  the batch is on the replicas' devices. This is exactly what the compiled step would
  have waited for; with `tf.data`, `ProcessLoader` or a plain `PyDataset` alike, because
  all three reach `fit()` as a `tf.data` pipeline whose background prefetch keeps
  running while the model computes.
* step time   = wall time from the first measured step's start to the last one's end in
  the epoch (callback time between steps included), so `input_wait_share` is the share of
  training wall time during which the step was blocked on input.

Under `MirroredStrategy` / `MultiWorkerMirroredStrategy` the batch is a `PerReplica` value;
it is passed through unchanged and `strategy.run` distributes it as before. The wrapper is
removed in `on_train_end` (and a stale wrapper left by a failed `fit()` is a pass-through
and is unwrapped by the next `InputProfiler`).

The fetch itself is `next(iterator)` for a plain `tf.data` iterator (one eager op) and,
for a `tf.distribute` iterator (`MirroredStrategy`, multi-worker), one call of a
`tf.function` wrapping `get_next` -- eagerly, a distributed `get_next` dispatches an op
per replica plus the `PerReplica` assembly, about a millisecond for two replicas.

What it costs: the wrapper's bookkeeping is 6-15 us per step (a few `perf_counter()`
calls, the batch size read from static shapes, a few additions; measured on 2 busy
cores), and fetching outside the compiled step was not slower than inside it (on a 1 ms
MLP step, `fit()` with the profiler was 1-13% *faster* than without, median over
back-to-back pairs; on a 50 ms CNN step the difference stayed within run-to-run noise).
That is under 0.1% of a 20 ms step. `scripts/bench_profiler.py` measures it on your
machine. What it changes: with
`steps_per_execution=k > 1`, the k steps run as k calls of the compiled step instead of
one `tf.while_loop`. What it does not see: validation steps (only training is measured);
on a GPU, TensorFlow may return from a step before the device finishes it, so time blocked
on input can overlap device work and the share is then an upper bound on device idle
time from input (compare with `nvidia-smi`, as `scripts/gpu_check.sh` does).
"""

import os
import sys
import time
import warnings

import keras

from kpipe import _compat

_KEYS = ("input_wait_share", "steps_per_sec", "samples_per_sec")
_GET_NEXT = None  # tf.function(lambda it: it.get_next()), made on first use


class _TimedTrainFunction:
    """Stands in for `model.train_function`; times `next(iterator)` for the profiler."""

    def __init__(self, original, profiler):
        import tensorflow as tf

        self.original = original
        self.profiler = profiler
        self._tf = tf
        # Keras's train function on a list of batches (built for Keras < 3.7: kpipe/_compat.py).
        self._on_batches = _compat.train_step_on_batches(profiler.model, original)

    def _fetch(self, iterator):
        """`next(iterator)`; a `tf.distribute` iterator's `get_next` runs as one graph call."""
        global _GET_NEXT
        tf = self._tf
        if isinstance(iterator, tf.distribute.DistributedIterator):
            if _GET_NEXT is None:  # one tf.function for all fits: traced once per input spec
                _GET_NEXT = tf.function(lambda it: it.get_next(), reduce_retracing=True)
            try:
                return _GET_NEXT(iterator)
            except tf.errors.OutOfRangeError:
                raise StopIteration from None
        return next(iterator)

    def __call__(self, iterator):
        profiler = self.profiler
        if not profiler._active or isinstance(iterator, (list, tuple)):
            return self.original(iterator)
        if profiler._input_kind is None:
            profiler._input_kind = _describe_input(sys._getframe(1))
        k = max(1, int(getattr(profiler.model, "steps_per_execution", 1) or 1))
        start = time.perf_counter()
        batches, wait_s = [], 0.0
        for _ in range(k):
            t0 = time.perf_counter()
            try:
                batch = self._fetch(iterator)
            except StopIteration:
                break
            wait_s += time.perf_counter() - t0
            batches.append(batch)
        if not batches:
            raise StopIteration
        logs = self._on_batches(batches)
        profiler._record(start, time.perf_counter(), wait_s, batches)
        return logs


class InputProfiler(keras.callbacks.Callback):
    """Reports, per epoch, the share of training step time spent waiting for input.

    At the end of each epoch it writes three entries into the epoch `logs`, where
    `History`, `CSVLogger`, `TensorBoard` and the progress bar pick them up:

    * `input_wait_share`: fraction (0-1) of the epoch's training wall time during which the
      step was blocked waiting for the next batch. Near 0: the model is the bottleneck.
      Near 1: the accelerator idles while the input pipeline works.
    * `steps_per_sec`: training steps per second.
    * `samples_per_sec`: samples per second seen by this process (in a multi-worker job,
      by this worker; under `MirroredStrategy`, all local replicas together).

    The first time the share exceeds `warn_above` it warns once, naming the fix for the
    input it sees (`kpipe.ProcessLoader` for a `PyDataset`, more `workers` for a
    `ProcessLoader`, parallel map and prefetch for `tf.data`).

    The measurement times `next(iterator)` where the step fetches its batch (see the NOTE
    at the top of this module); it works with `ProcessLoader`, `tf.data` datasets, plain
    `PyDataset`s and NumPy arrays, with or without a `tf.distribute` strategy, on the
    TensorFlow backend. Validation steps are not measured. The first `skip_steps` steps
    of the first epoch (graph tracing, worker start-up) are left out of the figures unless
    nothing else was measured. Put `InputProfiler` *before* `CSVLogger` / `TensorBoard`
    in the `callbacks` list: Keras hands one `logs` dict to the callbacks in order.

    A profiler instance belongs to one `fit()` at a time; it is not thread-safe.

    Args:
        warn_above: Input-wait share (0-1) above which a one-time warning is issued; `None`
            never warns. Defaults to 0.2.
        skip_steps: Steps at the start of the first epoch left out of the figures.
            Defaults to 1.

    Attributes:
        epochs: One dict per epoch of the last `fit()`: the three logged values plus
            `input_wait_s`, `wall_s` (measured training wall time), `steps`, `samples` and
            `epoch`.

    Raises:
        ValueError: If `warn_above` is not in [0, 1] or `skip_steps` is negative.

    Example:

    ```python
    import numpy as np, keras, kpipe
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    history = model.fit(np.zeros((64, 4)), np.zeros((64, 1)), epochs=2, verbose=0,
                        callbacks=[kpipe.callbacks.InputProfiler(warn_above=None)])
    print(history.history["input_wait_share"], history.history["samples_per_sec"])
    ```
    """

    def __init__(self, warn_above=0.2, *, skip_steps=1):
        super().__init__()
        if warn_above is not None and not (
            isinstance(warn_above, (int, float)) and 0.0 <= warn_above <= 1.0
        ):
            raise ValueError(
                "`warn_above` must be a share between 0 and 1, or None. "
                f"Received: warn_above={warn_above!r}. Use e.g. 0.2 to warn when more "
                "than 20% of step time waits for input, or None to never warn."
            )
        if not isinstance(skip_steps, int) or skip_steps < 0:
            raise ValueError(
                "`skip_steps` must be an int >= 0. "
                f"Received: skip_steps={skip_steps!r}. Use 0 to measure every step."
            )
        self.warn_above = warn_above
        self.skip_steps = skip_steps
        self.epochs = []
        self._active = False
        self._steps_seen = 0
        self._warned = False
        self._input_kind = None
        self._wrapper = None
        self._reset_epoch()

    # -- Keras hooks --------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self.epochs = []
        self._steps_seen = 0
        self._input_kind = None
        if keras.backend.backend() != "tensorflow":
            warnings.warn(
                "InputProfiler measures input wait on the TensorFlow backend only; "
                f"the active Keras backend is {keras.backend.backend()!r}. No input-wait "
                "figures will be logged. Set KERAS_BACKEND=tensorflow to use it.",
                stacklevel=_caller_stacklevel(),
            )
            return
        current = getattr(self.model, "train_function", None)
        if isinstance(current, _TimedTrainFunction):  # left over by a failed fit()
            current = current.original
        if current is None:
            self.model.make_train_function()
            current = self.model.train_function
        self._wrapper = _TimedTrainFunction(current, self)
        self.model.train_function = self._wrapper
        self._active = True

    def on_train_end(self, logs=None):
        self._active = False
        if self._wrapper is not None and self.model.train_function is self._wrapper:
            self.model.train_function = self._wrapper.original
        self._wrapper = None

    def on_epoch_begin(self, epoch, logs=None):
        self._reset_epoch()

    def on_epoch_end(self, epoch, logs=None):
        if not self._active:
            return
        figures = self._epoch_figures()
        if figures is None:
            return
        self.epochs.append(dict(figures, epoch=epoch))
        if logs is not None:
            logs.update({k: figures[k] for k in _KEYS})
        share = figures["input_wait_share"]
        if self.warn_above is not None and not self._warned and share > self.warn_above:
            self._warned = True
            warnings.warn(_advice(figures, self.warn_above, epoch, self._input_kind), stacklevel=_caller_stacklevel())

    # -- bookkeeping ----------------------------------------------------------------------

    def _reset_epoch(self):
        self._wait_s = 0.0
        self._steps = 0
        self._samples = 0
        self._first_start = None
        self._last_end = None
        self._skipped = None  # (start, end, wait_s, steps, samples) of skipped steps

    def _record(self, start, end, wait_s, batches):
        strategy = self.model.distribute_strategy
        samples = sum(_batch_size(b, strategy) for b in batches)
        if self._steps_seen < self.skip_steps:
            self._steps_seen += len(batches)
            s = self._skipped
            self._skipped = (
                (start, end, wait_s, len(batches), samples)
                if s is None
                else (s[0], end, s[2] + wait_s, s[3] + len(batches), s[4] + samples)
            )
            return
        self._steps_seen += len(batches)
        if self._first_start is None:
            self._first_start = start
        self._last_end = end
        self._wait_s += wait_s
        self._steps += len(batches)
        self._samples += samples

    def _epoch_figures(self):
        if self._steps == 0:
            if self._skipped is None:
                return None
            start, end, wait_s, steps, samples = self._skipped
        else:
            start, end = self._first_start, self._last_end
            wait_s, steps, samples = self._wait_s, self._steps, self._samples
        wall_s = max(end - start, 1e-9)
        return {
            "input_wait_share": min(1.0, wait_s / wall_s),
            "steps_per_sec": steps / wall_s,
            "samples_per_sec": samples / wall_s,
            "input_wait_s": wait_s,
            "wall_s": wall_s,
            "steps": steps,
            "samples": samples,
        }


def _batch_size(batch, strategy):
    """Number of samples in a (possibly per-replica) batch; 0 if it cannot be told."""
    import tensorflow as tf

    for leaf in tf.nest.flatten(batch):
        if isinstance(leaf, tf.distribute.DistributedValues):
            sizes = [_leading_dim(p) for p in strategy.experimental_local_results(leaf)]
            if sizes and all(s is not None for s in sizes):
                return sum(sizes)
            continue
        size = _leading_dim(leaf)
        if size is not None:
            return size
    return 0


def _leading_dim(value):
    shape = getattr(value, "shape", None)
    if shape is None or len(shape) == 0 or shape[0] is None:
        return None
    return int(shape[0])


def _describe_input(frame):
    """Best effort: what feeds this `fit()`, read from Keras's fit frame, for the advice.

    Returns one of `("process_loader", workers)`, `("pydataset", workers)`,
    `("tf.data", None)`, `("arrays", None)`, `("other", None)`. Never raises.
    """
    try:
        epoch_iterator = frame.f_locals.get("epoch_iterator")
        adapter = getattr(epoch_iterator, "data_adapter", None)
        dataset = getattr(adapter, "py_dataset", None)
        if dataset is not None:
            kind = dataset.__class__  # (kpipe's adapter holds a ProcessLoader by weak proxy)
            if kind.__name__ == "ProcessLoader" and "kpipe" in kind.__module__:
                return ("process_loader", getattr(dataset, "num_workers", None))
            return ("pydataset", getattr(dataset, "workers", None))
        if type(adapter).__name__ == "TFDatasetAdapter":
            return ("tf.data", None)
        if type(adapter).__name__ == "ArrayDataAdapter":
            return ("arrays", None)
    except Exception:  # noqa: BLE001 -- advice text only; never break training
        pass
    return ("other", None)


def _caller_stacklevel():
    """`warnings.warn` stacklevel of the first frame outside Keras, TensorFlow and kpipe:
    the user's `fit()` (or `kpipe.fit_generator`) call, so the warning points at their code."""
    skip = (os.sep + "keras" + os.sep, os.sep + "tensorflow" + os.sep, os.path.dirname(os.path.dirname(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and any(part in frame.f_code.co_filename for part in skip):
        frame, level = frame.f_back, level + 1
    return level


def _advice(figures, warn_above, epoch, input_kind):
    kind, workers = input_kind or ("other", None)
    share = figures["input_wait_share"]
    step_ms = 1e3 * figures["wall_s"] / max(figures["steps"], 1)
    head = (
        f"InputProfiler: in epoch {epoch} the training step waited for input "
        f"{share:.0%} of the time ({share * step_ms:.2f} ms of each {step_ms:.2f} ms step; "
        f"warn_above={warn_above:.0%}); the input pipeline, not the model, limits training speed."
    )
    if kind == "process_loader":
        fix = (
            f"Fix: give the ProcessLoader more workers (now workers={workers}), up to the "
            "number of CPU cores; `kpipe bench module:factory` measures the best count."
        )
    elif kind == "pydataset":
        fix = (
            "Fix: wrap the dataset in `kpipe.ProcessLoader(dataset, workers=N)` (workers "
            "in processes, batches through shared memory); `kpipe bench module:factory` "
            "finds N."
        )
    elif kind == "tf.data":
        fix = (
            "Fix: map with `num_parallel_calls=tf.data.AUTOTUNE` and end the pipeline with "
            "`.prefetch(tf.data.AUTOTUNE)` (`kpipe.data.pipeline` does both); move "
            "Python/NumPy steps out of `tf.numpy_function` into `kpipe.data.pipeline("
            "py_map_fn=..., workers=N)`, which runs them in processes."
        )
    elif kind == "arrays":
        fix = (
            "The data is already in memory: the step is so short that handing each batch to "
            "it dominates. Fix: a larger `batch_size`, or `steps_per_execution` in compile()."
        )
    else:
        fix = (
            "Fix: feed fit() with `kpipe.ProcessLoader(dataset, workers=N)` for a "
            "PyDataset, or a tf.data pipeline with parallel map and prefetch "
            "(`kpipe.data.pipeline`)."
        )
    return f"{head} {fix}"
