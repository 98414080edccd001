"""`pipeline(py_map_fn=...)`: a Python/NumPy step run in kpipe worker processes.

NOTE [ py_map_fn data flow ]
`tf.numpy_function` in `Dataset.map` runs under the GIL: on the NumPy augmentation
workload it delivered 0.62x a serial loop. Here the per-sample function runs in worker
processes instead:

    upstream batches (tf.data, C++ threads)
      -> as_numpy_iterator()                      in a `from_generator` thread
      -> ProcessMapper.imap: batch -> shared memory -> worker applies fn to each sample
                                                   and stacks -> shared memory
      -> yielded back to tf.data, in input order  (prefetch overlaps the next batches)

A whole batch travels per hand-off, so the per-item cost (a socket message and two
copies) is paid once per batch, with its position: `(iteration, index of its first
element)`. With a `seed`, the worker reseeds `random` and `numpy.random` before each
sample from `(seed, iteration, element index)` (`BatchApply`), so a sample's random draws
depend only on where it stands -- not on the worker, the worker count (0 included: then
this process's generators are reseeded, as `fn` draws from them there anyway), the batch
size or the timing. `iteration` counts the iterations of the dataset (a new Keras epoch is
a new one), as a seeded `shuffle(reshuffle_each_iteration=True)` does. Each iteration of the dataset borrows the pool's idle
`ProcessMapper` (or starts one); it is given back when the iteration ends -- also when the
consumer stops early, in which case batches still in flight are discarded -- and closed
instead if it broke (a worker died or timed out). Idle workers are stopped after
`_IDLE_CLOSE_S` without use (tf.data never releases a `from_generator` dataset's Python
state, so garbage collection cannot be relied on), at interpreter exit, or by `close()`.
"""

import threading
import weakref

from kpipe.data._pybatch import BatchApply, flatten, unflatten

# Idle workers are stopped after this long without an iteration. tf.data keeps a
# `from_generator` dataset's Python state alive after the dataset object is gone, so the
# dataset's garbage collection cannot be relied on to stop them.
_IDLE_CLOSE_S = 30.0


def py_map(batched, fn, *, workers, timeout, seed, output_signature, options, declared=False):
    """Returns `batched` with `fn` applied to every sample in worker processes.

    Args:
        batched: A `tf.data.Dataset` of batches.
        fn: The per-sample function (NumPy in, NumPy out).
        workers: Worker processes.
        timeout: Seconds to wait for one batch.
        seed: Seed of every sample's `random`/`numpy.random` (see the NOTE above), or None.
        output_signature: Per-sample `tf.TensorSpec` nest of `fn`'s output.
        options: `tf.data.Options` for the upstream dataset (iterated separately).
        declared: `output_signature` was given by the user: outputs are cast to its
            dtypes instead of having to match them. Defaults to False.
    """
    import tensorflow as tf

    batch_dim = tf.nest.flatten(batched.element_spec)[0].shape[0]
    flat_specs = tf.nest.flatten(output_signature)
    dtypes = [s.dtype.as_numpy_dtype for s in flat_specs]
    batch_signature = tf.nest.map_structure(
        lambda s: tf.TensorSpec((batch_dim,) + tuple(s.shape), s.dtype), output_signature
    )
    apply = BatchApply(fn, dtypes, cast=declared, seed=seed)
    pool = _MapperPool(apply, workers=workers, timeout=timeout, seed=seed)
    upstream = batched.with_options(options)

    def generate():
        iteration = pool.next_iteration()
        mapper = pool.acquire()
        try:
            for out in mapper.imap(_with_positions(upstream.as_numpy_iterator(), iteration)):
                yield out
        finally:
            pool.release(mapper)

    ds = tf.data.Dataset.from_generator(generate, output_signature=batch_signature)
    cardinality = int(batched.cardinality())
    if cardinality >= 0 or cardinality == tf.data.INFINITE_CARDINALITY:
        ds = ds.apply(tf.data.experimental.assert_cardinality(cardinality))
    ds._kpipe_mapper_pool = pool  # keeps the pool as long as the dataset object; for tests
    return ds


def _with_positions(batches, iteration):
    """Yields `(batch, [iteration, first])`, `first` the index of the batch's first element."""
    import numpy as np

    first = 0
    for batch in batches:
        yield batch, np.array([iteration, first], np.int64)
        first += len(flatten(batch)[1][0])


def infer_signature(fn, sample):
    """Calls `fn` once on `sample` (NumPy) and returns the `tf.TensorSpec` nest of its output."""
    import tensorflow as tf

    result = fn(*sample) if isinstance(sample, tuple) else fn(sample)
    structure, leaves = flatten(result)
    specs = []
    for i, leaf in enumerate(leaves):
        if leaf.dtype.kind not in "biufc":
            raise TypeError(
                f"py_map_fn returned output {i} with dtype {leaf.dtype}. Return numeric or bool "
                "NumPy arrays (e.g. encode strings as integer ids)."
            )
        specs.append(tf.TensorSpec(leaf.shape, tf.as_dtype(leaf.dtype)))
    return unflatten(structure, specs)


class _MapperPool:
    """At most one idle `ProcessMapper` for a dataset's iterations; see the NOTE above."""

    def __init__(self, fn, *, workers, timeout, seed):
        self._fn = fn
        self._kwargs = dict(workers=workers, timeout=timeout, seed=seed)
        self._lock = threading.Lock()
        self._idle = []
        self._timer = None
        self._iterations = 0
        self._finalizer = weakref.finalize(self, _close_all, self._idle, self._lock)

    def acquire(self):
        from kpipe._engine.mapper import ProcessMapper

        with self._lock:
            self._cancel_timer()
            if self._idle:
                return self._idle.pop()
        return ProcessMapper(self._fn, **self._kwargs)

    def next_iteration(self):
        """The index of an iteration of the dataset that starts now (0 first)."""
        with self._lock:
            self._iterations += 1
            return self._iterations - 1

    def release(self, mapper):
        if mapper.closed:
            return
        with self._lock:
            if not self._idle and self._finalizer.alive:
                self._idle.append(mapper)
                self._cancel_timer()
                self._timer = threading.Timer(_IDLE_CLOSE_S, _close_all, (self._idle, self._lock))
                self._timer.daemon = True
                self._timer.start()
                return
        mapper.close()

    def _cancel_timer(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self):
        """Stops the idle workers. Idempotent."""
        with self._lock:
            self._cancel_timer()
        self._finalizer()


def _close_all(idle, lock):
    with lock:
        pending = list(idle)
        idle.clear()
    for m in pending:
        m.close()

