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
cores; the per-step record adds about 1-3 us, `StepTimeline.add` timed alone), and fetching outside the compiled step was not slower than inside it (on a 1 ms
MLP step, `fit()` with the profiler was 1-13% *faster* than without, median over
back-to-back pairs; on a 50 ms CNN step the difference stayed within run-to-run noise).
That is under 0.1% of a 20 ms step. With `log_dir`, the per-step TensorBoard values are
buffered and written at the epoch's end (and every 4096 steps, a write whose duration is
left out of the figures), never inside a step. `scripts/bench_profiler.py` measures it on your
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

from kpipe import _compat, _stream
from kpipe.callbacks import _profiler_feed, _summary, _timeline

_TB_BATCH = 4096  # per-step TensorBoard values buffered before a write mid-epoch
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
            profiler._input_kind, profiler._loader_ref = _describe_input(sys._getframe(1))
        k = max(1, int(getattr(profiler.model, "steps_per_execution", 1) or 1))
        depth = profiler._queue_depth()
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
        profiler._record(start, time.perf_counter(), wait_s, batches, depth)
        return logs


class InputProfiler(keras.callbacks.Callback):
    """Measures, per step and per epoch, the share of training time spent waiting for input.

    At the end of each epoch it writes three entries into the epoch `logs`, where
    `History`, `CSVLogger`, `TensorBoard` and the progress bar pick them up:

    * `input_wait_share`: fraction (0-1) of the epoch's training wall time during which the
      step was blocked waiting for the next batch. Near 0: the model is the bottleneck.
      Near 1: the accelerator idles while the input pipeline works.
    * `steps_per_sec`: training steps per second.
    * `samples_per_sec`: samples per second seen by this process (in a multi-worker job,
      by this worker; under `MirroredStrategy`, all local replicas together).

    Every step is recorded too: `profiler.steps` holds per-step wait and compute time (and
    the loader's queue depth for a `ProcessLoader`) as arrays, in bounded memory -- every
    step until `max_records` rows are used, then windows of 2, 4, 8, ... steps (see
    `kpipe/callbacks/_timeline.py`) -- and their sums are the epoch figures. `plot()`
    draws them as a timeline, alone or beside another profiler's (before/after). With
    `log_dir`, per-step `input_wait_ms` and `step_ms` and the epoch's `input_wait_share`
    go to TensorBoard (the `train` run of `log_dir`, beside `keras.callbacks.TensorBoard`'s
    loss curves when both get the same `log_dir`).

    The first time the share exceeds `warn_above` it warns once, saying *when* the steps
    waited -- at the start of the epoch, in periodic spikes, in irregular bursts, or
    steadily -- and the fix for that pattern and the input it sees.

    The measurement times `next(iterator)` where the step fetches its batch (see the NOTE
    at the top of this module); it works with `ProcessLoader`, `tf.data` datasets, plain
    `PyDataset`s and NumPy arrays, with or without a `tf.distribute` strategy, on the
    TensorFlow, JAX and PyTorch backends (on JAX and PyTorch it times the fetches of Keras's
    epoch iterator: `kpipe/callbacks/_profiler_feed.py`). Validation steps are not measured. The first `skip_steps` steps
    of the first epoch (graph tracing, worker start-up) are left out of the figures unless
    nothing else was measured. Put `InputProfiler` *before* `CSVLogger` / `TensorBoard`
    in the `callbacks` list: Keras hands one `logs` dict to the callbacks in order.

    A profiler instance belongs to one `fit()` at a time; it is not thread-safe.

    Args:
        warn_above: Input-wait share (0-1) above which a one-time warning is issued; `None`
            never warns. Defaults to 0.2.
        skip_steps: Steps at the start of the first epoch left out of the figures.
            Defaults to 1.
        log_dir: Directory of a TensorBoard log (as for `keras.callbacks.TensorBoard`);
            scalars go to its `train` subdirectory. `None` writes nothing. Defaults to None.
        max_records: Rows of the per-step record (about 60 bytes each); >= 16.
            Defaults to 10000.

    Attributes:
        epochs: One dict per epoch of the last `fit()`: the three logged values plus
            `input_wait_s`, `wall_s` (measured training wall time), `steps`, `samples`,
            `epoch` and `wait_pattern` (when the steps waited, see above; None if they
            never did).
        steps: The per-step record of the last `fit()`, a `Steps` of NumPy arrays
            (`epoch`, `first_step`, `steps`, `start_s`, `wait_s`, `step_s`, `compute_s`,
            `samples`, `queue_depth`, `counted`, and `window`).

    Raises:
        ValueError: If `warn_above` is not in [0, 1], `skip_steps` is negative or
            `max_records` is below 16.

    Example:

    ```python
    import numpy as np, keras, kpipe
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    profiler = kpipe.callbacks.InputProfiler(warn_above=None)
    history = model.fit(np.zeros((64, 4)), np.zeros((64, 1)), epochs=2, verbose=0,
                        callbacks=[profiler])
    print(history.history["input_wait_share"], profiler.steps.wait_s)
    profiler.plot("timeline.png")  # needs matplotlib: pip install "kpipe[plot]"
    ```
    """

    def __init__(self, warn_above=0.2, *, skip_steps=1, log_dir=None, max_records=10_000):
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
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise ValueError(
                f"`log_dir` must be a directory path or None. Received: log_dir={log_dir!r}."
            )
        self.warn_above = warn_above
        self.skip_steps = skip_steps
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self._timeline = _timeline.StepTimeline(max_records)
        self.epochs = []
        self._active = False
        self._steps_seen = 0
        self._warned = False
        self._input_kind = None
        self._loader_ref = None
        self._wrapper = None
        self._writer = None
        self._tb_pending = []
        self._fit_t0 = time.perf_counter()
        self._reset_epoch()

    @property
    def steps(self):
        return self._timeline.steps()

    # -- Keras hooks --------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self.epochs = []
        self._steps_seen = 0
        self._input_kind = None
        self._loader_ref = None
        self._timeline.clear()
        self._fit_t0 = time.perf_counter()
        if keras.backend.backend() != "tensorflow":
            self._begin_on_other_backend()
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
        if self.log_dir is not None:
            self._open_writer()

    def _begin_on_other_backend(self):
        """JAX / PyTorch: time the fetches of Keras's epoch iterator (NOTE in _profiler_feed.py)."""
        frame = _profiler_feed.fit_frame(self.model)
        if frame is None or not hasattr(frame.f_locals["epoch_iterator"], "_get_iterator"):
            warnings.warn(
                "InputProfiler could not find the epoch iterator of Keras's fit() on the "
                f"{keras.backend.backend()!r} backend (Keras {keras.__version__}); no input-wait "
                "figures will be logged. Use the Keras version in kpipe's README (Tested with).",
                stacklevel=_caller_stacklevel(),
            )
            return
        self._input_kind, self._loader_ref = _describe_input(frame)
        if self.model.train_function is None:
            self.model.make_train_function()
        if isinstance(self.model.train_function, _profiler_feed.StepTimer):  # left by a failed fit()
            self.model.train_function.remove()

        def record(start, end, wait_s, batches):
            self._record(start, end, wait_s, batches, self._queue_depth())

        self._wrapper = _profiler_feed.StepTimer(self.model, frame.f_locals["epoch_iterator"], record)
        self._active = True
        if self.log_dir is not None:
            self._open_writer()

    def on_train_end(self, logs=None):
        self._active = False
        if isinstance(self._wrapper, _profiler_feed.StepTimer):
            self._wrapper.remove()
            self._wrapper = None
        if self._wrapper is not None and self.model.train_function is self._wrapper:
            self.model.train_function = self._wrapper.original
        self._wrapper = None
        self._close_writer()

    def on_epoch_begin(self, epoch, logs=None):
        self._reset_epoch()
        self._epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if not self._active:
            return
        figures = self._epoch_figures()
        self._write_pending()
        if figures is None:
            return
        pattern = self._wait_pattern(epoch)
        self.epochs.append(dict(figures, epoch=epoch, wait_pattern=pattern[0]))
        if logs is not None:
            logs.update({k: figures[k] for k in _KEYS})
        if self._writer is not None:
            self._writer.scalars(epoch, {"input_wait_share": figures["input_wait_share"]})
            self._writer.flush()
        share = figures["input_wait_share"]
        if self.warn_above is not None and not self._warned and share > self.warn_above:
            self._warned = True
            advice = _advice(figures, self.warn_above, epoch, self._input_kind, pattern, self._loader())
            warnings.warn(advice, stacklevel=_caller_stacklevel())

    # -- the picture ------------------------------------------------------------------------

    def plot(self, path=None, *, before=None, labels=None, title=None):
        """Draws the per-step timeline: wait stacked on compute, epochs marked and labelled
        with their input-wait share; beside `before`'s timeline (left) when given.

        Args:
            path: File to write (the format follows its suffix: `.png`, `.svg`, `.pdf`).
                `None` writes nothing. Defaults to None.
            before: Another `InputProfiler` (e.g. of the same model fed without
                `ProcessLoader`) drawn on the left with the same axes. Defaults to None.
            labels: Panel titles, one per timeline (`[before, this]` with `before`).
                Defaults to the input each profiler measured, e.g. "PyDataset" and
                "ProcessLoader(workers=4)".
            title: Figure title. Defaults to "Where each training step's time went".

        Returns:
            The `matplotlib.figure.Figure` (a Jupyter cell shows it as an image).

        Raises:
            ImportError: If matplotlib is not installed (`pip install "kpipe[plot]"`).
            ValueError: If a profiler has recorded no step, or `labels` has the wrong length.
        """
        from kpipe.callbacks import _plot

        profilers = [before, self] if before is not None else [self]
        for p in profilers:
            if not isinstance(p, InputProfiler):
                raise ValueError(
                    f"`before` must be an InputProfiler. Received: before={p!r}."
                )
        return _plot.plot_timelines(
            [p.steps for p in profilers],
            [p.epochs for p in profilers],
            labels=labels if labels is not None else [_describe_kind(p._input_kind) for p in profilers],
            path=path,
            title=title,
        )

    # -- bookkeeping ----------------------------------------------------------------------

    def _reset_epoch(self):
        self._epoch = None
        self._wait_s = 0.0
        self._steps = 0
        self._samples = 0
        self._first_start = None
        self._last_end = None
        self._skipped = None  # (start, end, wait_s, steps, samples) of skipped steps
        self._excluded_s = 0.0  # TensorBoard writes between steps, left out of wall_s
        self._pause_s = 0.0  # the last such write, to leave out of the next step

    def _record(self, start, end, wait_s, batches, depth=None):
        if isinstance(self._wrapper, _profiler_feed.StepTimer):  # JAX / PyTorch
            samples = sum(_profiler_feed.batch_size(b) for b in batches)
        else:
            samples = sum(_batch_size(b, self.model.distribute_strategy) for b in batches)
        n = len(batches)
        epoch = self._epoch if self._epoch is not None else len(self.epochs)
        pause, self._pause_s = self._pause_s, 0.0
        if self._steps_seen < self.skip_steps:
            self._steps_seen += n
            s = self._skipped
            step_s = end - start if s is None else end - s[1]
            self._skipped = (
                (start, end, wait_s, n, samples)
                if s is None
                else (s[0], end, s[2] + wait_s, s[3] + n, s[4] + samples)
            )
            self._timeline.add(epoch=epoch, start_s=start - self._fit_t0, wait_s=wait_s, step_s=step_s,
                               steps=n, samples=samples, depth=depth, counted=False)
            return
        self._steps_seen += n
        if self._first_start is None:
            self._first_start = start
            step_s = end - start
        else:
            step_s = end - self._last_end - pause
            self._excluded_s += pause
        self._last_end = end
        self._wait_s += wait_s
        self._steps += n
        self._samples += samples
        self._timeline.add(epoch=epoch, start_s=start - self._fit_t0, wait_s=wait_s, step_s=step_s,
                           steps=n, samples=samples, depth=depth, counted=True)
        if self._writer is not None:
            self._tb_pending.append((self._tb_step0 + self._steps_seen, wait_s, step_s))
            if len(self._tb_pending) >= _TB_BATCH:
                t0 = time.perf_counter()
                self._write_pending()
                self._pause_s = time.perf_counter() - t0

    def _epoch_figures(self):
        if self._steps == 0:
            if self._skipped is None:
                return None
            start, end, wait_s, steps, samples = self._skipped
            excluded = 0.0
        else:
            start, end = self._first_start, self._last_end
            wait_s, steps, samples = self._wait_s, self._steps, self._samples
            excluded = self._excluded_s
        wall_s = max(end - start - excluded, 1e-9)
        return {
            "input_wait_share": min(1.0, wait_s / wall_s),
            "steps_per_sec": steps / wall_s,
            "samples_per_sec": samples / wall_s,
            "input_wait_s": wait_s,
            "wall_s": wall_s,
            "steps": steps,
            "samples": samples,
        }

    def _wait_pattern(self, epoch):
        """`wait_pattern()` of this epoch's rows (measured ones, or the warm-up if none)."""
        steps = self._timeline.steps()
        rows = steps.epoch == epoch
        if (rows & steps.counted).any():
            rows &= steps.counted
        return _timeline.wait_pattern(steps.wait_s[rows], steps.steps[rows])

    def _loader(self):
        return self._loader_ref() if self._loader_ref is not None else None

    def _queue_depth(self):
        """Batches the `ProcessLoader` feeding this fit has requested and not handed out yet.

        Read from its counters without its lock: `stats()` takes the lock, which the
        loader's stream holds while it waits for a worker, so calling it here would block
        the step on the very wait being measured."""
        loader = self._loader()
        source = _stream.source_of(loader) if loader is not None else None
        if source is None:
            self._loader_ref = None
            return None
        return source.queue_depth()

    # -- TensorBoard ----------------------------------------------------------------------

    def _open_writer(self):
        self._writer = _summary.ScalarWriter(os.path.join(self.log_dir, "train"))
        self._tb_pending = []
        try:  # Keras's TensorBoard counts batches in optimizer iterations: continue them
            self._tb_step0 = int(self.model.optimizer.iterations.numpy())
        except Exception:  # noqa: BLE001 -- not compiled with an optimizer: count from 0
            self._tb_step0 = 0

    def _write_pending(self):
        if self._writer is None:
            return
        for step, wait_s, step_s in self._tb_pending:
            self._writer.scalars(step, {"input_wait_ms": 1e3 * wait_s, "step_ms": 1e3 * step_s})
        self._tb_pending = []

    def _close_writer(self):
        if self._writer is not None:
            self._write_pending()
            self._writer.close()
            self._writer = None


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
    """Best effort: what feeds this `fit()`, read from Keras's fit frame.

    Returns `(kind, loader_ref)`: `kind` is one of `("process_loader", workers)`,
    `("pydataset", workers)`, `("tf.data", None)`, `("arrays", None)`, `("other", None)`
    (for the advice and the plot's labels); `loader_ref` is a weak reference to the
    `ProcessLoader` (for its queue depth) or None. Never raises.
    """
    try:
        epoch_iterator = frame.f_locals.get("epoch_iterator")
        adapter = getattr(epoch_iterator, "data_adapter", None)
        dataset = getattr(adapter, "py_dataset", None)
        if dataset is not None:
            kind = dataset.__class__  # (kpipe's adapter holds a ProcessLoader by weak proxy)
            if kind.__name__ == "ProcessLoader" and "kpipe" in kind.__module__:
                ref = getattr(adapter, "_kpipe_loader", None)
                return ("process_loader", getattr(dataset, "num_workers", None)), ref
            return ("pydataset", getattr(dataset, "workers", None)), None
        if type(adapter).__name__ == "TFDatasetAdapter":
            return ("tf.data", None), None
        if type(adapter).__name__ == "ArrayDataAdapter":
            return ("arrays", None), None
    except Exception:  # noqa: BLE001 -- advice text only; never break training
        pass
    return ("other", None), None


def _describe_kind(input_kind):
    """A short label for the plot: what fed the fit."""
    kind, workers = input_kind or ("other", None)
    if kind == "process_loader":
        return f"ProcessLoader(workers={workers})"
    if kind == "pydataset":
        return "PyDataset" if not workers or workers <= 1 else f"PyDataset(workers={workers})"
    return {"tf.data": "tf.data", "arrays": "in-memory arrays"}.get(kind, "input")


def _caller_stacklevel():
    """`warnings.warn` stacklevel of the first frame outside Keras, TensorFlow and kpipe:
    the user's `fit()` (or `kpipe.fit_generator`) call, so the warning points at their code."""
    skip = (os.sep + "keras" + os.sep, os.sep + "tensorflow" + os.sep, os.path.dirname(os.path.dirname(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and any(part in frame.f_code.co_filename for part in skip):
        frame, level = frame.f_back, level + 1
    return level


def _advice(figures, warn_above, epoch, input_kind, pattern=(None, {}), loader=None):
    """The warning's text: how much, *when* (the wait pattern) and the fix for both."""
    kind, workers = input_kind or ("other", None)
    share = figures["input_wait_share"]
    step_ms = 1e3 * figures["wall_s"] / max(figures["steps"], 1)
    head = (
        f"InputProfiler: in epoch {epoch} the training step waited for input "
        f"{share:.0%} of the time ({share * step_ms:.2f} ms of each {step_ms:.2f} ms step; "
        f"warn_above={warn_above:.0%}); the input pipeline, not the model, limits training speed."
    )
    name, detail = pattern
    queue = getattr(loader, "max_queue_size", None)
    if name == _timeline.START:
        when = (
            f"When: at the start of the epoch ({detail['head_share']:.0%} of the wait fell in its "
            "first tenth of steps): the pipeline refills at every epoch start"
            + (", and in the first epoch its workers start up." if epoch == 0 else ".")
        )
        fix = _START_FIX.get(kind, _START_FIX["other"]).format(queue=queue)
    elif name in (_timeline.PERIODIC, _timeline.BURSTS):
        spacing = f"every {detail['every']} steps" if name == _timeline.PERIODIC else "at irregular intervals"
        when = (
            f"When: in spikes {spacing} ({detail['spike_steps']:.0%} of the steps hold most of the "
            "wait), the rest of the steps barely wait: some batches arrive late (a slow worker, "
            "batches of uneven cost), not all."
        )
        fix = _SPIKE_FIX.get(kind, _SPIKE_FIX["other"]).format(queue=queue, workers=workers)
    else:
        when = "When: steadily, through the epoch: the pipeline delivers fewer batches per second than the model takes."
        fix = _steady_fix(kind, workers)
    return f"{head} {when} {fix}"


_START_FIX = {
    "process_loader": (
        "Fix: a ProcessLoader loads the next epoch's first batches ahead unless the dataset has "
        "`on_epoch_end`/`on_epoch_begin` (the next order may depend on them): if those change "
        "nothing but the dataset (a reshuffle, an epoch counter), pass `epoch_end_ahead=True` "
        "(the next pass loads from the hook run on a copy, checked against the real one), or "
        "drop them and pass `shuffle=True, seed=...`, which plans every pass ahead; a larger "
        "`max_queue_size` (now {queue}) has more batches ready when an epoch starts."
    ),
    "pydataset": (
        "Fix: Keras's own loader starts over at every epoch; `kpipe.ProcessLoader(dataset, "
        "workers=N)` keeps its workers and loads the next epoch's first batches ahead."
    ),
    "tf.data": (
        "Fix: a large `shuffle(buffer_size)` refills its buffer at every epoch start (shuffle "
        "file names or indices instead, or use a smaller buffer), and `cache()` fills during the "
        "first epoch; end the pipeline with `.prefetch(tf.data.AUTOTUNE)`."
    ),
    "other": (
        "Fix: keep the loader's workers across epochs and load ahead over the epoch boundary: "
        "`kpipe.ProcessLoader(dataset, workers=N, shuffle=True, seed=0)` does both."
    ),
}
_SPIKE_FIX = {
    "process_loader": (
        "Fix: a deeper queue absorbs late batches: raise `max_queue_size` (now {queue}) above "
        "the spacing of the spikes, within memory; more `workers` (now {workers}) help only if "
        "every batch is slow."
    ),
    "pydataset": (
        "Fix: `kpipe.ProcessLoader(dataset, workers=N, max_queue_size=...)` keeps a queue of "
        "batches loading ahead in processes, which absorbs late ones."
    ),
    "tf.data": (
        "Fix: a deeper `.prefetch(k)` (k above the spacing of the spikes) and "
        "`num_parallel_calls=tf.data.AUTOTUNE` absorb late elements."
    ),
    "other": (
        "Fix: a queue of batches loading ahead absorbs late ones: `kpipe.ProcessLoader(dataset, "
        "workers=N, max_queue_size=...)`, or `.prefetch(k)` in tf.data."
    ),
}


def _steady_fix(kind, workers):
    if kind == "process_loader":
        return (
            f"Fix: give the ProcessLoader more workers (now workers={workers}), up to the "
            "number of CPU cores; `kpipe bench module:factory` measures the best count."
        )
    if kind == "pydataset":
        return (
            "Fix: wrap the dataset in `kpipe.ProcessLoader(dataset, workers=N)` (workers "
            "in processes, batches through shared memory); `kpipe bench module:factory` "
            "finds N."
        )
    if kind == "tf.data":
        return (
            "Fix: map with `num_parallel_calls=tf.data.AUTOTUNE` and end the pipeline with "
            "`.prefetch(tf.data.AUTOTUNE)` (`kpipe.data.pipeline` does both); move "
            "Python/NumPy steps out of `tf.numpy_function` into `kpipe.data.pipeline("
            "py_map_fn=..., workers=N)`, which runs them in processes."
        )
    if kind == "arrays":
        return (
            "The data is already in memory: the step is so short that handing each batch to "
            "it dominates. Fix: a larger `batch_size`, or `steps_per_execution` in compile()."
        )
    return (
        "Fix: feed fit() with `kpipe.ProcessLoader(dataset, workers=N)` for a "
        "PyDataset, or a tf.data pipeline with parallel map and prefetch "
        "(`kpipe.data.pipeline`)."
    )
