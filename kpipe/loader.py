"""`kpipe.ProcessLoader`: any PyDataset / Sequence, loaded by worker processes."""

import collections
import math
import operator
import os
import threading
import time

import keras
import numpy as np

from kpipe import _keras_hook
from kpipe._engine import _tree
from kpipe._engine._planner import EpochPlanner
from kpipe._engine._pool import InlineBackend, ProcessBackend, ThreadBackend
from kpipe._engine._pydataset_shim import PyDataset as _ShimPyDataset
from kpipe.errors import LoaderClosedError, LoaderError

_DEFAULT_TIMEOUT_S = 120.0


class ProcessLoader(keras.utils.PyDataset):
    """Loads the batches of a `PyDataset`/`Sequence` in worker processes.

    Workers are started once and kept for every epoch. Each worker calls
    `dataset[i]` and writes the batch's arrays into a shared-memory slot; the batch
    arrives here as arrays that view that memory (no pickling, no copy). Batches come
    in plan order, at most `max_queue_size` are loaded ahead, and a slot is reused only
    after every array of its batch was garbage collected.

    The loader is itself a `keras.utils.PyDataset`, so `fit`, `evaluate`, `predict` and
    `validation_data` take it unchanged. It orders its own batches (see `shuffle`):
    Keras's `fit(shuffle=...)` does not reorder a `ProcessLoader`.

    Args:
        dataset: Anything with `__getitem__(i)` and `__len__()` (or a `num_batches`
            property, which may be `None` for an infinite dataset used with
            `steps_per_epoch`). `__getitem__` returns a NumPy array, a tuple
            `(x, y)` / `(x, y, sample_weight)`, a dict, or a nesting of these, with
            numeric or bool leaves; shapes may vary between batches. The dataset's
            `on_epoch_end()` runs in this process and its new state reaches the
            workers before the next epoch's first batch. It is sent to workers with
            cloudpickle (classes from `__main__` or a notebook work); its NumPy arrays
            of 1 MiB or more are shared, not copied, and read-only in workers.
        workers: Worker processes (or threads with `use_threads=True`). 0 loads
            batches in the calling thread. Defaults to 2.
        max_queue_size: Most batches loaded ahead of the consumer; bounds memory to
            about `max_queue_size` batches. The loader starts with two per worker
            (enough to keep every worker busy when batches take similar times) and
            goes deeper, up to this bound, only when a worker sat idle while the
            consumer waited for a slower batch. Defaults to `max(4, 2 * workers)`.
        max_queue_bytes: Also bound the bytes loaded ahead: fewer batches are queued
            when the last batch times the queue length would exceed it (at least one
            batch per worker stays in flight). Defaults to None (batches only).
        shuffle: Permute the batch order every epoch, from `(seed, epoch)` only: the
            same seed gives the same batches whatever `workers` is. Defaults to False.
        seed: Seed of the shuffle and of the workers' `random`/`numpy.random` (each
            worker gets a seed derived from `(seed, worker id)`, see
            `kpipe.worker_info()`). Defaults to None (random).
        start_method: How workers start. `"forkserver"`: kpipe starts one fresh
            interpreter (no TensorFlow, no re-import of `__main__`) that unpickles the
            dataset once and forks every worker from it in milliseconds, sharing its
            memory copy-on-write. `"spawn"`: one fresh interpreter per worker (~0.2 s
            each). `"fork"`: fork this process, refused once TensorFlow is loaded (it
            deadlocks, keras-team/keras#11461). Defaults to `"forkserver"` on Linux,
            else `"spawn"`.
        use_threads: Use `workers` threads instead of processes: for I/O-bound
            `__getitem__` that releases the GIL (file reads, decoding in C). Defaults
            to False.
        timeout: Seconds to wait for one batch before raising `BatchTimeoutError`.
            Defaults to 120.
        num_shards: Split each epoch's batches into this many shards (one per
            data-parallel worker); the loader loads only shard `shard_index`: positions
            `shard_index, shard_index + num_shards, ...` of the epoch's order,
            `n // num_shards` of them, so every worker runs the same number of steps.
            Defaults to None: under a multi-worker `TF_CONFIG`, one shard per worker
            (`kpipe.distribute.default_shard()`), else no sharding. Pass 1 to load
            everything in every worker.
        shard_index: This loader's shard, `0 <= shard_index < num_shards`. Defaults
            to None (see `num_shards`).

    Raises:
        ValueError: for invalid arguments or an empty dataset.
        TypeError: if `dataset` has no `__getitem__`/length.
        kpipe.DatasetPicklingError: if the dataset cannot be sent to workers.

    The loader is not thread-safe for concurrent `__getitem__` calls from several
    threads (Keras calls it from one); it must not be shared across processes.

    Example:

    >>> import numpy as np, kpipe, keras
    >>> class Squares(keras.utils.PyDataset):
    ...     def __len__(self):
    ...         return 4
    ...     def __getitem__(self, i):
    ...         x = np.arange(8, dtype="float32").reshape(4, 2) + i
    ...         return x, x.sum(axis=1)
    >>> with kpipe.ProcessLoader(Squares(), workers=2) as loader:
    ...     x, y = loader[1]
    >>> x.shape, float(y[0])
    ((4, 2), 3.0)
    """

    _kpipe_orders_batches = True  # see kpipe/_keras_hook.py: Keras must not reorder us

    def __init__(
        self,
        dataset,
        *,
        workers=2,
        max_queue_size=None,
        max_queue_bytes=None,
        shuffle=False,
        seed=None,
        start_method=None,
        use_threads=False,
        timeout=_DEFAULT_TIMEOUT_S,
        num_shards=None,
        shard_index=None,
    ):
        workers = _check_int("workers", workers, 0, "Use 0 to load batches in the calling thread.")
        if max_queue_size is None:
            max_queue_size = max(4, 2 * workers)
        max_queue_size = _check_int("max_queue_size", max_queue_size, 1, "It bounds the batches loaded ahead; use at least 1.")
        super().__init__(workers=1, use_multiprocessing=False, max_queue_size=max_queue_size)
        if max_queue_bytes is not None:
            max_queue_bytes = _check_int("max_queue_bytes", max_queue_bytes, 1, "Use None to bound by batches only.")
        self.max_queue_bytes = max_queue_bytes
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"`timeout` must be a positive number of seconds. Received: timeout={timeout!r}.")
        if start_method not in (None, "forkserver", "spawn", "fork"):
            raise ValueError(
                f"Invalid value for argument `start_method`. Received: start_method={start_method!r}. "
                "Expected 'forkserver' (default), 'spawn' or 'fork'; for threads pass use_threads=True."
            )
        self.dataset = dataset
        self.num_workers = workers
        self.shuffle = bool(shuffle)
        self.seed = int.from_bytes(os.urandom(4), "little") if seed is None else _check_int("seed", seed, 0, "")
        self.start_method = start_method or _default_start_method()
        self.use_threads = bool(use_threads)
        self.timeout = float(timeout)
        self._name = type(dataset).__name__
        num_batches = _num_batches(dataset)
        if num_shards is None and shard_index is None:
            from kpipe.distribute._cluster import default_shard

            num_shards, shard_index = default_shard() or (None, None)
        num_shards, shard_index = _check_shards(num_shards, shard_index, num_batches, shuffle, seed)
        if shuffle and num_batches is None:
            raise ValueError(
                f"`shuffle=True` needs a finite dataset, but `{self._name}`.num_batches is None "
                "(infinite). Shuffle inside the dataset instead, or give it a length."
            )
        self._planner = EpochPlanner(num_batches, shuffle=self.shuffle, seed=self.seed, num_shards=num_shards, shard_index=shard_index)
        self._stateful = _overrides(dataset, "on_epoch_end") or _overrides(dataset, "on_epoch_begin")
        self._lock = threading.RLock()
        self._queue = collections.deque()  # (position, seq) in the order they will be asked for
        self._next_dispatch = 0
        self._epoch = 0
        self._backend = None
        self._closed = False
        self._checker = _tree.StructureChecker(self._name)
        # Batches kept in flight: two per worker, grown (up to max_queue_size) when a
        # worker idles behind a slow batch. Fewer slots in flight means less shared
        # memory, and fewer slots to create (and page in) before the first epoch flows.
        self._window = max_queue_size if workers == 0 else min(max_queue_size, 2 * workers)
        self._stats = {"batches": 0, "samples": 0, "bytes": 0, "last_batch_bytes": 0, "wait_s": 0.0, "first_batch_s": None, "restarts": 0}
        self._t_created = time.perf_counter()
        self._start_backend()
        self._fill()

    # ---------------------------------------------------------------- PyDataset API
    @property
    def num_batches(self):
        """Batches per epoch (of this shard), or None for an infinite dataset."""
        return self._planner.length

    def __len__(self):
        n = self._planner.length
        if n is None:
            raise TypeError(f"`{self._name}` is infinite (num_batches is None); use steps_per_epoch.")
        return n

    def __getitem__(self, index):
        """Returns batch `index` of the current epoch's plan."""
        index = operator.index(index)
        n = self._planner.length
        if index < 0 and n is not None:
            index += n
        if index < 0 or (n is not None and index >= n):
            raise IndexError(f"Batch index {index} is out of range for a loader of {n} batches per epoch.")
        with self._lock:
            backend = self._ensure_backend()
            self._seek(index)
            window_full = len(self._queue) >= self._limit() and self._more_to_dispatch()
            _, seq = self._queue.popleft()
            t0 = time.perf_counter()
            try:
                deepen = self._deepen if window_full and self._window < self.max_queue_size else None
                batch, treedef, meta = backend.get(seq, on_starved=deepen)
            except Exception:
                self._after_failure()
                raise
            finally:
                self._stats["wait_s"] += time.perf_counter() - t0
            try:
                self._checker.check(self._planner.index(self._epoch, index), treedef, meta)
                self._account(meta)
            finally:
                self._fill()
            return batch

    def on_epoch_begin(self):
        """Called by Keras when an epoch starts: rewinds to the epoch's first batch."""
        with self._lock:
            if self._stateful and _overrides(self.dataset, "on_epoch_begin"):
                self.dataset.on_epoch_begin()
                self._restart_epoch(resync=True)
            elif self._backend is not None:
                self._seek(0)

    def on_epoch_end(self):
        """Runs the dataset's `on_epoch_end` here, then starts the next epoch's plan."""
        with self._lock:
            if hasattr(self.dataset, "on_epoch_end"):
                self.dataset.on_epoch_end()
            self._epoch += 1
            if self._stateful or self._backend is None or self._planner.length is None:
                self._restart_epoch(resync=self._stateful)
            else:
                self._carry_into_next_epoch()

    # ------------------------------------------------------------------ extras
    @property
    def num_shards(self):
        """How many shards each epoch is split into (1: no sharding)."""
        return self._planner.num_shards

    @property
    def shard_index(self):
        """Which shard this loader loads."""
        return self._planner.shard_index

    @property
    def epoch(self):
        """Index of the current epoch (incremented by `on_epoch_end`)."""
        return self._epoch

    def set_epoch(self, epoch):
        """Jumps to the shuffle plan of `epoch`.

        Call it before `model.fit(..., initial_epoch=epoch)` so that a resumed run sees
        the same shuffled batches as an uninterrupted one (`fit` advances the loader once
        before its first epoch, as it does in every run). Inside a callback, once `fit`
        has started, restore a previously saved `loader.epoch` instead --
        `kpipe.callbacks.BackupAndRestore(loaders=[...])` does this.
        """
        epoch = _check_int("epoch", epoch, 0, "")
        with self._lock:
            if epoch != self._epoch:
                self._epoch = epoch
                self._restart_epoch(resync=False)

    def stats(self):
        """Counters since construction: `batches`, `samples`, `bytes`, `wait_s` (time the
        consumer blocked waiting for workers), `first_batch_s` (construction to first
        batch), `restarts`, `workers`, `pids`, and `queue_depth` (batches the loader
        now keeps in flight, at most `max_queue_size`)."""
        with self._lock:
            out = dict(self._stats)
            out["queue_depth"] = self._limit()
            out["workers"] = self.num_workers
            out["pids"] = list(self._backend.pids) if self._backend is not None else []
            return out

    def as_dataset(self, *, prefetch=2):
        """A `tf.data.Dataset` yielding one epoch of this loader per iteration.

        The element spec comes from the first batch, with the batch dimension left
        unknown. Each complete iteration calls `on_epoch_end()`. Use it to compose with
        tf.data or to feed a `tf.distribute` strategy.

        Args:
            prefetch: Batches tf.data converts ahead. Defaults to 2.

        Returns:
            A `tf.data.Dataset`.
        """
        import tensorflow as tf

        first = self[0]
        treedef, leaves, _ = _tree.flatten(first)
        if "none" in repr(treedef):
            raise LoaderError("as_dataset() cannot express `None` entries of a batch; drop them in __getitem__.")
        specs = [tf.TensorSpec((None,) + a.shape[1:] if a.ndim else (), tf.as_dtype(a.dtype)) for a in leaves]
        signature = _tree.unflatten(treedef, specs)
        if isinstance(signature, list):
            signature = tuple(signature)
        del first, leaves

        def generate():
            n = self.num_batches
            i = 0
            while n is None or i < n:
                batch = self[i]
                yield tuple(batch) if isinstance(batch, list) else batch
                i += 1
            self.on_epoch_end()

        ds = tf.data.Dataset.from_generator(generate, output_signature=signature).prefetch(prefetch)
        if self.num_shards > 1:  # already this worker's share: no second split by tf.data
            from kpipe.distribute import mark_presharded

            ds = mark_presharded(ds)
        return ds

    def close(self):
        """Stops the workers and frees shared memory. Idempotent. Batches already
        returned stay valid."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            if self._backend is not None:
                self._backend.close()
                self._backend = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        mode = "inline" if self.num_workers == 0 else ("threads" if self.use_threads else self.start_method)
        return (
            f"ProcessLoader({self._name}, workers={self.num_workers} ({mode}), "
            f"max_queue_size={self.max_queue_size}, shuffle={self.shuffle}, batches={self.num_batches})"
        )

    def __reduce__(self):
        raise TypeError(
            "A ProcessLoader owns worker processes and cannot be pickled; pickle its `dataset` "
            "and build a new loader where you need it."
        )

    # --------------------------------------------------------------- internals
    def _start_backend(self):
        common = dict(mode="dataset", name=self._name)
        if self.num_workers == 0:
            self._backend = InlineBackend(self.dataset, **common)
        elif self.use_threads:
            self._backend = ThreadBackend(self.dataset, num_workers=self.num_workers, timeout=self.timeout, seed=self.seed, **common)
        else:
            self._backend = ProcessBackend(
                self.dataset,
                num_workers=self.num_workers,
                start_method=self.start_method,
                timeout=self.timeout,
                seed=self.seed,
                keep_idle=self.max_queue_size + self.num_workers,
                **common,
            )

    def _ensure_backend(self):
        if self._closed:
            raise LoaderClosedError(f"This ProcessLoader of `{self._name}` was closed; create a new one.")
        if self._backend is None:  # a fatal failure stopped the previous workers
            self._stats["restarts"] += 1
            self._start_backend()
        return self._backend

    def _after_failure(self):
        if self._backend is not None and self._backend.closed:
            self._backend = None
            self._queue.clear()
            self._next_dispatch = self._queue_head()

    def _queue_head(self):
        return self._queue[0][0] if self._queue else self._next_dispatch

    def _deepen(self):
        """A worker ran out of work while the consumer waits for a slower batch: batch
        times vary, and one more batch in flight per worker keeps every worker busy."""
        self._window = min(self.max_queue_size, self._window + self.num_workers)
        self._fill()

    def _limit(self):
        """Batches to keep in flight now: the window, within max_queue_bytes if set."""
        limit = self._window
        last = self._stats["last_batch_bytes"]
        if self.max_queue_bytes is not None:  # until a batch size is known: one per worker
            limit = max(1, self.num_workers, min(limit, self.max_queue_bytes // last if last else 0))
        return limit

    def _more_to_dispatch(self):
        n = self._planner.length
        # A dataset without on_epoch_end/on_epoch_begin loads the same way every epoch, and
        # the next epoch's plan is known: keep loading into it, so that workers do not
        # idle while the last batches of an epoch drain (up to one epoch ahead).
        return n is None or self._next_dispatch < (n if self._stateful else 2 * n)

    def _key(self, position):
        """The dataset index of `position` in the plan (positions >= n: the next epoch)."""
        n = self._planner.length
        if n is None or position < n:
            return self._planner.index(self._epoch, position)
        return self._planner.index(self._epoch + 1, position - n)

    def _carry_into_next_epoch(self):
        """Starts the next epoch with the batches already loaded for it (finite plans)."""
        n = self._planner.length
        kept = collections.deque()
        for position, seq in self._queue:
            if position >= n:
                kept.append((position - n, seq))
            else:  # the rest of an epoch cut short (steps_per_epoch < len)
                self._backend.discard(seq)
        self._queue = kept
        self._next_dispatch = max(0, self._next_dispatch - n)
        self._fill()

    def _fill(self):
        backend = self._backend
        if backend is None or backend.closed:
            return
        limit = self._limit()
        while len(self._queue) < limit and self._more_to_dispatch():
            self._queue.append((self._next_dispatch, backend.submit(self._key(self._next_dispatch))))
            self._next_dispatch += 1

    def _discard_all(self):
        for _, seq in self._queue:
            self._backend.discard(seq)
        self._queue.clear()

    def _seek(self, index):
        """Makes `index` the head of the queue, reusing in-flight work where possible."""
        queue = self._queue
        if queue and queue[0][0] == index:
            return
        positions = [p for p, _ in queue]
        if index in positions:
            while queue[0][0] != index:
                self._backend.discard(queue.popleft()[1])
            return
        head = self._queue_head()
        if index < head and head - index <= self.max_queue_size:
            # e.g. Keras reads batches 0 and 1 for its tensor spec, then starts the epoch.
            fresh = [(p, self._backend.submit(self._key(p))) for p in range(index, head)]
            queue.extendleft(reversed(fresh))
            return
        self._discard_all()
        self._next_dispatch = index
        self._fill()

    def _restart_epoch(self, resync):
        if self._backend is None:
            self._next_dispatch = 0
            return
        self._discard_all()
        self._next_dispatch = 0
        if resync:
            try:
                self._backend.reset_target(self.dataset)
            except Exception:
                self._after_failure()
                raise
        self._fill()

    def _account(self, meta):
        st = self._stats
        st["batches"] += 1
        if meta and len(meta[0][1]):
            st["samples"] += int(meta[0][1][0])
        nbytes = sum(math.prod(s) * np.dtype(d).itemsize for d, s in meta)
        st["bytes"] += nbytes
        st["last_batch_bytes"] = nbytes
        if st["first_batch_s"] is None:
            st["first_batch_s"] = time.perf_counter() - self._t_created


def _default_start_method():
    return "forkserver" if hasattr(os, "fork") and hasattr(os, "memfd_create") else "spawn"


def _check_int(name, value, minimum, fix):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an integer. Received: {name}={value!r} of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}. Received: {name}={value}. {fix}".rstrip())
    return int(value)


def _num_batches(dataset):
    if not hasattr(dataset, "__getitem__"):
        raise TypeError(
            f"`dataset` must have __getitem__ and __len__ (a keras.utils.PyDataset or Sequence). "
            f"Received: {type(dataset).__name__}. For a Python generator, pass it to model.fit directly."
        )
    try:
        n = dataset.num_batches if hasattr(type(dataset), "num_batches") else len(dataset)
    except (TypeError, NotImplementedError) as exc:
        raise TypeError(
            f"Cannot tell how many batches `{type(dataset).__name__}` has: {exc}. Define __len__ "
            "(or a num_batches property returning None for an infinite dataset)."
        ) from None
    if n is None:
        return None
    n = operator.index(n)
    if n <= 0:
        raise ValueError(
            f"`{type(dataset).__name__}` is empty: it has {n} batches. Check the data path or the "
            "batch size (len() must be the number of batches, not samples)."
        )
    return n


def _check_shards(num_shards, shard_index, num_batches, shuffle, seed):
    if num_shards is None and shard_index is None:
        return 1, 0
    if num_shards is None or shard_index is None:
        raise ValueError(
            f"Pass both `num_shards` and `shard_index` or neither. Received: num_shards={num_shards!r}, "
            f"shard_index={shard_index!r}."
        )
    num_shards = _check_int("num_shards", num_shards, 1, "")
    shard_index = _check_int("shard_index", shard_index, 0, "")
    if shard_index >= num_shards:
        raise ValueError(
            f"`shard_index` must be < num_shards. Received: shard_index={shard_index}, num_shards={num_shards}."
        )
    if num_batches is not None and num_batches < num_shards:
        raise ValueError(
            f"The dataset has {num_batches} batches, fewer than num_shards={num_shards}: some shards "
            "would get none. Use smaller batches or fewer shards."
        )
    if shuffle and seed is None and num_shards > 1:
        raise ValueError(
            "`shuffle=True` across shards needs a `seed`: with a different random order on each "
            "worker, shards would overlap (samples duplicated and dropped). Received: seed=None. "
            "Pass the same seed=... on every worker."
        )
    return num_shards, shard_index


def _overrides(obj, method):
    """True when `obj` defines `method` beyond the no-op of (Keras's or kpipe's) PyDataset."""
    impl = getattr(type(obj), method, None)
    if impl is None:
        return False
    return impl not in (getattr(keras.utils.PyDataset, method, None), getattr(_ShimPyDataset, method, None))


_keras_hook.install()
