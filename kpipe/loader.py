"""`kpipe.ProcessLoader`: any PyDataset / Sequence, loaded by worker processes. The facade:
it checks the arguments, offers the `PyDataset` API, and hands the work to the loader's
parts, which `kpipe/_reader.py` coordinates (docs/architecture.md draws them)."""

import operator
import os

import keras

from kpipe import _args, _dataset_api, _keras_hook, _reader, _samples, _stream, _tf_dataset
from kpipe._engine import _ray, _threads

_DEFAULT_TIMEOUT_S = 120.0


class ProcessLoader(keras.utils.PyDataset):
    """Loads the batches of a `PyDataset`/`Sequence` in worker processes.

    Workers are started once and kept for every epoch. Each worker calls
    `dataset[i]` and writes the batch's arrays into a shared-memory slot; the batch
    arrives here as arrays that view that memory (no pickling, no copy). Batches come
    in plan order, at most `max_queue_size` are loaded ahead, and a slot is reused only
    after every array of its batch was garbage collected.

    The loader is itself a `keras.utils.PyDataset`, so `fit`, `evaluate`, `predict` and
    `validation_data` take it unchanged. It draws its own batch order (see `shuffle`), by
    default the one plain Keras would: shuffled in a `fit(shuffle=True)`, in order elsewhere.

    Passes, not Keras epochs: the loader serves a sequence of *passes*, each every batch
    once in that pass's order, and whatever `steps_per_epoch`, `epochs` or `workers`,
    `fit()` consumes that sequence as it is -- the same number of steps as plain Keras,
    each pass whole. A pass ends when its last batch is handed out; the next read starts
    the next pass (`epoch` counts them), and `loader[i]` is always batch `i` of the
    current pass, in the dataset's current state. Reads Keras makes only to learn the
    tensor spec or build the model consume nothing. A `fit(epochs=E)` loads each of
    its `n` batches `E` times: read-ahead continues between epochs and stops at the
    last one the call runs (`evaluate`, `predict` and validation alike). A new `fit()` (or
    `evaluate()`) that starts while a pass is half read starts that pass again, as plain
    Keras restarts at batch 0. `state()`/`restore()` save and resume the exact position
    (`kpipe.callbacks.BackupAndRestore(save_freq=N)` does it for `fit()`). Details: the
    NOTE in `kpipe/_engine/_position.py`.

    Epoch hooks, call for call as plain Keras: the dataset's `on_epoch_begin()` and
    `on_epoch_end()` run in this process only when a consumer calls them, never for a
    pass nobody started. Keras's calls (`fit`, `evaluate`, `predict`, validation, and
    the `on_epoch_end` Keras >= 3.7 makes before the first epoch) reach the dataset as
    they would reach it unwrapped, with one documented deviation: for a finite dataset,
    an epoch that begins or ends inside a pass (`steps_per_epoch` or `steps` other than
    `len`) is not passed on, so a reshuffle can never cut a pass -- the pass goes on in
    the next epoch. An infinite dataset (`num_batches` None) gets every Keras call, at
    Keras's epoch boundaries. A manual loop calls `loader.on_epoch_end()` (and
    `on_epoch_begin()`) itself; `as_dataset()` calls `on_epoch_begin` at the first batch
    of each pass it streams and `on_epoch_end` when it streamed a pass's last batch.
    What a hook changes -- a new order, a new `len()` -- reaches the workers before they
    load anything of the next pass; batches loaded ahead stand if the hook left the
    dataset as it was (it pickles to the same bytes), else they load again. Read-ahead
    into a pass waits for the hooks due before it (a dataset that overrides
    `on_epoch_begin` waits for it at each pass start: `epoch_end_ahead=True` loads the
    next pass ahead from a copy instead).

    Args:
        dataset: Anything with `__getitem__(i)` and `__len__()` (or a `num_batches`
            property, which may be `None` for an infinite dataset used with
            `steps_per_epoch`). `__getitem__` returns a NumPy array, a tuple
            `(x, y)` / `(x, y, sample_weight)`, a dict, or a nesting of these, with
            numeric or bool leaves; shapes may vary between batches. Its
            `on_epoch_begin()`/`on_epoch_end()` run here when a consumer calls them (the
            rule above); the new state -- and new length, if `len()` changed -- reaches
            the workers before the next pass's first batch. It is sent to workers with
            cloudpickle (classes from `__main__` or a notebook work); its NumPy arrays
            of 1 MiB or more are shared, not copied, and read-only in workers.
        workers: Worker processes (or threads with `use_threads=True`). 0 loads
            batches in the calling thread. `"auto"` starts 2 worker processes (1 with
            a single CPU) and, from the measured time per batch in the workers (wall
            and CPU) and the consumer's waits, adds workers while the consumer waits
            and CPUs are free -- more than the CPUs (up to 8 per CPU, 64 at most) when
            batches wait on I/O rather than compute, never more than the CPUs for
            CPU-bound batches -- and retires them when the consumer (the training
            step) no longer waits. The CPUs are those this process may use (affinity
            and cgroup quota). Batches and their randomness do not depend on the
            worker count. Decisions are in `stats()["auto_decisions"]` and logged at
            INFO on the `"kpipe"` logger. Each worker process gets a thread budget
            (`worker_threads`). `kpipe.RayWorkers(n, ...)`: n Ray actors, on other
            hosts too, or `RayWorkers("auto")` sized the same way within what the
            cluster can place (docs/guides/ray.md). Defaults to 2.
        worker_threads: Threads each worker process's native pools may use -- BLAS
            and OpenMP (NumPy's OpenBLAS, MKL, scikit-image...), OpenCV
            (`cv2.setNumThreads`) and TensorFlow's intra/inter-op pools if the dataset
            imports them -- so that workers x threads stay within the CPUs (such
            pools are sized for the whole machine in every process, and N workers
            each spinning a full BLAS pool ran 15x slower than one). None gives each
            worker `max(1, CPUs // workers)` threads (the CPUs of `workers="auto"`:
            affinity and cgroup quota), re-divided when `workers="auto"` changes the
            count. Workers start with `OMP_NUM_THREADS`, `OPENBLAS_NUM_THREADS`,
            `MKL_NUM_THREADS` and the like set to it, so libraries the dataset loads
            later follow it too; TensorFlow's pools can only be set before its first
            op in the worker. This process's pools are never limited; threads
            (`use_threads=True`) and `workers=0` share them, so no budget applies
            there. `stats()["worker_threads"]` and `["worker_thread_pools"]` say
            what each worker got. Defaults to None.
        max_queue_size: Most batches loaded ahead of the consumer; bounds memory to
            about `max_queue_size` batches. The loader starts with two per worker
            (enough to keep every worker busy when batches take similar times) and
            goes deeper, up to this bound, only when workers sat idle while the
            consumer waited for slower batches -- for longer than the shared-memory
            slots of the deeper window cost the workers to set up (they measure
            it); a batch takes a new shared-memory
            slot only for a worker that would idle otherwise, so the slots number
            about the batches in flight plus those you hold. Defaults to
            `max(4, 2 * workers)` (with `workers="auto"`, twice the most workers it
            may run; it also caps that number); with `RayWorkers(n)`, 8 times
            `max(4, 2 * n)`: small, quick batches share actor calls, and the window
            then keeps two calls per actor in flight (batches over 4 MiB or 5 ms of
            work never share one, so they stay at two per actor).
        max_queue_bytes: Also bound the bytes loaded ahead: fewer batches are queued
            when the last batch times the queue length would exceed it (at least one
            batch per worker stays in flight). Defaults to None (batches only).
        shuffle: Permute the batch order every pass, from `(seed, pass)` only: the
            same seed gives the same batches whatever `workers` is. None does as plain Keras:
            shuffled in a `fit(shuffle=True)` (fit's default) reading it as `x`, in order
            elsewhere; True/False win (rules: the NOTE in `kpipe/_order.py`). Defaults to None.
        seed: Seed of the shuffle and of the workers' `random`/`numpy.random`:
            worker processes reseed both before each batch from `(seed, pass,
            position)`, so random augmentation gives the same batch whatever `workers`
            is, also after `restore()` with another worker count (threads and
            `workers=0` share this process's generators and are not reseeded; see
            `kpipe.worker_info()`). None: each `fit()` draws one from Python's `random`
            (`keras.utils.set_random_seed` fixes it), a random one elsewhere. Defaults to None.
        start_method: How workers start. `"forkserver"`: kpipe starts one fresh
            interpreter (no TensorFlow, no re-import of `__main__`) that unpickles the
            dataset once and forks every worker from it in milliseconds, sharing its
            memory copy-on-write. `"spawn"`: one fresh interpreter per worker (~0.2 s
            each). `"fork"`: fork this process, refused once TensorFlow is loaded or
            JAX's runtime runs (workers hang, keras-team/keras#11461). Defaults to
            `"forkserver"` on Linux, else `"spawn"`.
        use_threads: Use `workers` threads instead of processes: for I/O-bound
            `__getitem__` that releases the GIL (file reads, decoding in C). Defaults
            to False.
        timeout: Seconds to wait for one batch before raising `BatchTimeoutError`;
            None (or `float("inf")`) waits as long as it takes. Defaults to 120.
        num_shards: Split each pass's batches into this many shards (one per
            data-parallel worker); the loader loads only shard `shard_index`: positions
            `shard_index, shard_index + num_shards, ...` of the pass's order. Every
            shard has `ceil(n / num_shards)` batches, so every worker runs the same
            number of steps and every batch is used: a shard with none left for the
            last step gets a *pad*, a batch with no rows (what tf.distribute gives a
            replica without data; kpipe's multi-worker strategy weights the step so
            that it equals one process's). Defaults to None: under a multi-worker `TF_CONFIG`, one shard per worker
            (`kpipe.distribute.default_shard()`), else no sharding. Pass 1 to load
            everything in every worker.
        shard_index: This loader's shard, `0 <= shard_index < num_shards`. Defaults
            to None (see `num_shards`).
        epoch_end_ahead: For a dataset with `on_epoch_end`, load the next pass while
            the end of this one is read, instead of waiting at each pass end: once the
            pass's last batch is sent to the workers, the hook runs on a copy of the
            dataset (with this process's `random`/`numpy.random` states restored after
            it) and the workers load the next pass from the copy's state. The real hooks
            still run when the consumer calls them; the batches loaded ahead are kept only if the
            dataset's state then pickles to exactly the copy's bytes (same shared
            arrays, unchanged), else they are loaded again. So the hook runs twice per
            pass: use it only for hooks that change nothing but the dataset (a
            reshuffle, an epoch counter) -- what it prints appears twice. With worker
            processes and Ray actors only. `stats()["ahead"]` counts passes `kept`, `missed` and
            `skipped`; the NOTE in `kpipe/_engine/_ahead.py` has the details.
            Defaults to False.

    Raises:
        ValueError: for invalid arguments or an empty dataset.
        TypeError: if `dataset` has no `__getitem__`/length (a str, a dict, a generator).
        kpipe.LoaderError: if the dataset's `len()` raises.
        kpipe.DatasetPicklingError: if the dataset cannot be sent to workers.

    Its methods may be called from several threads (Keras reads it from tf.data's
    threads); it must not be shared across processes. Workers stop on `close()`, at the
    end of a `with` block, or when the loader is garbage collected -- also after `fit()`
    (Keras's traced graphs hold it only weakly).

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
        worker_threads=None,
        max_queue_size=None,
        max_queue_bytes=None,
        shuffle=None,
        seed=None,
        start_method=None,
        use_threads=False,
        timeout=_DEFAULT_TIMEOUT_S,
        num_shards=None,
        shard_index=None,
        epoch_end_ahead=False,
    ):
        self._reader = None  # (close() and repr() work on a loader whose construction failed)
        if not isinstance(epoch_end_ahead, bool):
            raise TypeError(f"`epoch_end_ahead` must be True or False. Received: epoch_end_ahead={epoch_end_ahead!r}.")
        autoscale, max_queue_size = _args.autoscale_for(workers, max_queue_size, start_method, use_threads)  # "auto"
        workers, remote = _args.check_workers(workers, use_threads, autoscale)  # remote: kpipe.RayWorkers(...) or None
        if max_queue_size is None:  # (Ray actors: room for small batches sharing calls, see kpipe/_engine/_ray.py)
            max_queue_size = max(4, 2 * workers) * (_ray.MAX_PER_CALL if remote is not None else 1)
        max_queue_size = _args.check_int("max_queue_size", max_queue_size, 1, "It bounds the batches loaded ahead; use at least 1.")
        super().__init__(workers=1, use_multiprocessing=False, max_queue_size=max_queue_size)
        if max_queue_bytes is not None:
            max_queue_bytes = _args.check_int("max_queue_bytes", max_queue_bytes, 1, "Use None to bound by batches only.")
        self.max_queue_bytes = max_queue_bytes
        timeout = _args.check_timeout(timeout)
        self.start_method = _args.check_start_method(start_method)
        _args.check_dataset(dataset)
        self.dataset = dataset
        self.worker_threads = _args.check_worker_threads(_threads.check(worker_threads), workers, use_threads)
        self.shuffle = None if shuffle is None else bool(shuffle)  # None: follows fit(shuffle=...)
        self.seed = int.from_bytes(os.urandom(4), "little") if seed is None else _args.check_int("seed", seed, 0, "")
        self.use_threads = bool(use_threads)
        keyed = isinstance(dataset, _samples.SampleBatches)  # from_samples: keys `(pass, batch)`
        self._name = type(dataset.dataset if keyed else dataset).__name__
        num_batches = _dataset_api.num_batches(dataset)
        if num_shards is None and shard_index is None:
            from kpipe.distribute._cluster import default_shard  # (kpipe.distribute imports TensorFlow)

            num_shards, shard_index = default_shard() or (None, None)
        num_shards, shard_index = _args.check_shards(num_shards, shard_index, num_batches, shuffle, seed)
        if shuffle and num_batches is None:
            raise ValueError(
                f"`shuffle=True` needs a finite dataset, but `{self._name}`.num_batches is None "
                "(infinite). Shuffle inside the dataset instead, or give it a length."
            )
        self._reader = _reader.Reader(
            dataset, name=self._name, num_batches=num_batches, workers=workers, worker_threads=self.worker_threads,
            max_queue_size=max_queue_size, max_queue_bytes=max_queue_bytes, shuffle=self.shuffle, seed=self.seed,
            num_shards=num_shards, shard_index=shard_index, start_method=self.start_method, use_threads=self.use_threads,
            timeout=timeout, epoch_end_ahead=epoch_end_ahead, autoscale=autoscale, keyed_by_pass=keyed, remote=remote,
            seed_given=seed is not None)
        _stream.register(self, self._reader)

    @classmethod
    def from_samples(cls, dataset, batch_size, *, shuffle=None, seed=None, drop_remainder=False, **kwargs):
        """A loader of batches of `batch_size` samples of a per-sample `dataset`, each
        sample written by the worker straight into the batch's shared memory.

        For a map-style dataset whose `__getitem__(j)` returns one sample (an array, or a
        tuple/dict of arrays or scalars), as PyTorch and Grain users write it: no batch
        array is built and copied (the NOTE in `kpipe/_samples.py`). Each pass reads every
        sample once, in an order that depends only on `(seed, pass)`; `state()`/`restore()`,
        sharding and epoch hooks work as for a `PyDataset`.

        Args:
            dataset: `__getitem__(j)` and `__len__()` (samples). Its own
                `on_epoch_end`/`on_epoch_begin`, if any, run as the loader's rule says.
            batch_size: Samples per batch.
            shuffle: A new sample order every pass (None: as `ProcessLoader`'s; the order
                `fit(shuffle=True)` asks for is a sample order). Defaults to None.
            seed: As `ProcessLoader`'s, also of the sample order. Defaults to None.
            drop_remainder: Leave out the last `len(dataset) % batch_size` samples of
                each pass instead of a smaller last batch. Defaults to False.
            **kwargs: `padding` (`kpipe.Padding`), `buckets` (`kpipe.Buckets`), `lengths`, `collate`: variable-length
                samples; any `ProcessLoader` argument (a default `max_queue_size` goes deeper for small batches): NOTE in `kpipe/_samples.py`.

        Raises:
            ValueError, TypeError: bad arguments (naming them), or an empty dataset.
            kpipe.BatchStructureError: samples of one batch differ in structure, dtype or shape.

        Example:

        >>> import numpy as np, kpipe
        >>> class Points:
        ...     def __len__(self):
        ...         return 10
        ...     def __getitem__(self, j):
        ...         return np.full(3, j, np.float32), j % 2
        >>> with kpipe.ProcessLoader.from_samples(Points(), 4, workers=1) as loader:
        ...     x, y = loader[2]
        >>> x.shape, y.tolist()
        ((2, 3), [0, 1])
        """
        batches = _samples.for_loader(dataset, batch_size, shuffle=bool(shuffle), seed=seed, drop_remainder=drop_remainder,
                                      has_hooks=_dataset_api.has_hooks(dataset), options=kwargs)
        return cls(batches, shuffle=shuffle, seed=seed, **kwargs)

    @property
    def num_workers(self):
        """Workers loading now (`workers="auto"` changes it)."""
        return self._reader.num_workers

    @property
    def timeout(self):
        """Seconds to wait for one batch (None: no limit); setting it applies to the next waits."""
        return self._reader.timeout

    @timeout.setter
    def timeout(self, value):
        with self._reader.lock:
            self._reader.set_timeout(_args.check_timeout(value))

    # ---------------------------------------------------------------- PyDataset API
    @property
    def num_batches(self):
        """Batches in the current pass (of this shard), or None for an infinite dataset."""
        position = self._reader.position
        return position.length_of(position.head[0])

    def __len__(self):
        n = self.num_batches
        if n is None:
            raise TypeError(f"`{self._name}` is infinite (num_batches is None); use steps_per_epoch.")
        return n

    def __getitem__(self, index):
        """Batch `index` of the current pass, in any order of access (see the class
        docstring on passes); reading its last batch in order ends the pass."""
        index = operator.index(index)
        with self._reader.lock:
            n = self.num_batches
            if index < 0 and n is not None:
                index += n
            if index < 0 or (n is not None and index >= n):
                raise IndexError(f"Batch index {index} is out of range for a loader of {n} batches per pass.")
            return self._reader.read(index)

    def on_epoch_begin(self):
        """Runs the dataset's `on_epoch_begin` now (a manual loop calls it; Keras's calls
        take kpipe's adapter, see the class docstring)."""
        with self._reader.lock:
            self._reader.run_hook("on_epoch_begin")

    def on_epoch_end(self):
        """Runs the dataset's `on_epoch_end` now, once, and ends the current pass if any of
        it was read (a loop that stops early starts the next pass at `loader[0]`). What the
        hook or you changed on the dataset reaches the workers before the next pass (docs/loader-in-depth.md,
        "What the fast paths assume"). Keras's calls take kpipe's adapter (class docstring).
        """
        with self._reader.lock:
            self._reader.epoch_end_by_hand()

    # ------------------------------------------------------------------ extras
    @property
    def num_shards(self):
        """How many shards each pass is split into (1: no sharding)."""
        return self._reader.position.num_shards

    @property
    def shard_index(self):
        """Which shard this loader loads."""
        return self._reader.position.shard_index

    @property
    def epoch(self):
        """Index of the current pass (0 first; incremented when a pass ends)."""
        return self._reader.position.head[0]

    def set_epoch(self, epoch):
        """Jumps to the start of pass `epoch` (its shuffle plan), dropping work in flight."""
        epoch = _args.check_int("epoch", epoch, 0, "")
        with self._reader.lock:
            position = self._reader.position
            if position.head != (epoch, 0):
                self._reader.jump(epoch, 0, position.dataset_length())

    def state(self):
        """Where this loader stands, as a small JSON-serialisable dict.

        `position` is the first batch of pass `pass` not handed out yet by the current
        read (`loader[i]` or one iteration of `as_dataset()`). Under `fit()`, TensorFlow
        reads ahead of training: use `kpipe.callbacks.BackupAndRestore`, which records
        what training consumed. `restore(state)` continues from exactly there.

        Returns:
            `{"format", "pass", "position", "num_batches", "seed", "shuffle",
            "num_shards", "shard_index"}`.
        """
        with self._reader.lock:
            return self._reader.position.state_dict()

    def restore(self, state):
        """Continues from `state` (from `state()`, possibly of another process).

        Work in flight is dropped; the next read starts at the saved position of the
        saved pass, with that pass's order (`shuffle`, `seed`; the next passes' too),
        whatever `workers` was before or is now. A dataset with its own epoch state (e.g.
        an index reshuffled in `on_epoch_end`) must restore that state itself.

        Raises:
            ValueError: a state of another dataset length, sharding, `seed` or
                `shuffle` (when given to this loader), or a malformed one.
        """
        reader = self._reader
        pass_, position, num_batches, order = reader.position.check_state(state, same_length=not reader.stateful, name=self._name)
        with reader.lock:
            reader.jump(pass_, position, num_batches, order)

    def stats(self):
        """Counters since construction: `batches` (handed out), `samples`, `bytes`,
        `loads` (batches loaded by workers), `discards` (loaded or requested, then
        dropped unused), `passes` (passes completed), `wait_s` (time the consumer
        blocked waiting for workers), `pass_start_wait_s` (of that, the waits for the
        first batch of a pass after one this loader completed: for a dataset with
        `on_epoch_end`, what the wait at each pass end costs the consumer -- see
        `epoch_end_ahead`), `first_batch_s` (construction to first batch),
        `restarts`, `workers` (now), `pids`, `queue_depth` (batches the loader now keeps
        in flight, at most `max_queue_size`), `worker_threads` (the thread budget of
        each worker process now; None without worker processes), `worker_thread_pools`
        (per worker taking tasks, as it last reported: `worker`, `pid`, `threads`,
        `pools` -- each library limited, with `library`, `api`, `file` and its
        `threads`, and `max_threads` where a library is built for fewer threads than
        the budget -- and `not_limited`, what stays above the budget and why), and with
        `workers="auto"`: `cpu_limit`,
        `max_workers` and `auto_decisions` (the last 100 changes of the worker count,
        oldest first: `t` seconds since construction, `workers_from`, `workers_to`,
        `reason` and the figures it rests on), and with `epoch_end_ahead=True`: `ahead`
        (passes loaded ahead of `on_epoch_end` and `kept`, `missed` (loaded again) or
        `skipped` (not loaded ahead), `last_reason`, and `off`: why it no longer tries,
        or None)."""
        with self._reader.lock:
            return self._reader.stats_dict()

    def as_dataset(self, *, prefetch=2, device=None, epochs=None):
        """A `tf.data.Dataset` yielding the rest of the current pass per iteration.

        Each iteration of the dataset reads from the first batch not consumed yet to the
        end of that pass (a whole pass, unless the loader was restored mid-pass), so
        iterating it again -- a new Keras epoch, `repeat()` -- reads the next pass. The
        element spec comes from the first batch, with the batch dimension left unknown
        (and inner dimensions unknown where the first two batches differ). For a finite
        loader whose dataset has no epoch hooks the cardinality is declared (Keras then
        knows the steps per epoch); a dataset with `on_epoch_end` may change its length
        between passes, so its cardinality is left unknown. The dataset holds the loader
        (whose workers stop when both are gone or on `close()`).

        Args:
            prefetch: Batches tf.data converts ahead. Defaults to 2.
            device: A device name (`"/gpu:0"`) to copy batches to ahead of their use
                (`tf.data.experimental.prefetch_to_device`, `prefetch` batches deep):
                the step then finds its input on the accelerator. Must be the last
                stage: add nothing after it. Defaults to None (batches stay on the
                host; `fit()` copies them, and under a strategy the strategy does).
            epochs: How many times the dataset will be iterated (`fit(ds, epochs=...)`),
                so that read-ahead stops where the last iteration's pass ends: a dataset
                that logs its loads sees each batch `epochs` times. Iterating it more
                still works: each further iteration loads its own pass. Defaults to None: not known,
                so once an iteration ends the next pass's first `max_queue_size` batches
                load ahead, ready for the next iteration.

        Returns:
            A `tf.data.Dataset`.

        Raises:
            ValueError: `device` names no device TensorFlow has.
        """
        return _tf_dataset.build(self, self._reader, prefetch=prefetch, device=device, epochs=epochs)

    def close(self):
        """Stops the workers and frees shared memory. Idempotent. Batches already
        returned stay valid."""
        if self._reader is not None:
            with self._reader.lock:
                self._reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if self._reader is None:
            return "ProcessLoader(<not built>)"
        mode = "ray" if self._reader.remote else "inline" if self.num_workers == 0 else ("threads" if self.use_threads else self.start_method)
        auto = "auto: " if self._reader.autoscale is not None else ""
        return (
            f"ProcessLoader({self._name}, workers={auto}{self.num_workers} ({mode}), "
            f"max_queue_size={self.max_queue_size}, shuffle={self.shuffle}, batches={self.num_batches})"
        )

    def __reduce__(self):
        raise TypeError(
            "A ProcessLoader owns worker processes and cannot be pickled; pickle its `dataset` "
            "and build a new loader where you need it."
        )


_keras_hook.install()
