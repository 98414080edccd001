"""`kpipe.ProcessLoader`: any PyDataset / Sequence, loaded by worker processes."""

import collections
import logging
import math
import operator
import os
import threading
import time
import warnings
import weakref

import keras
import numpy as np

from kpipe import _compat, _keras_hook
from kpipe._engine import _ahead, _autoscale, _threads, _tree
from kpipe._engine import worker_info as _wi
from kpipe._engine._cursor import STATE_FORMAT, PassCursor
from kpipe._engine._planner import EpochPlanner
from kpipe._engine._pool import InlineBackend, ProcessBackend, ThreadBackend
from kpipe._engine._pydataset_shim import PyDataset as _ShimPyDataset
from kpipe.errors import LoaderClosedError, LoaderError

_DEFAULT_TIMEOUT_S = 120.0
_UNSET = object()
_AUTOSCALE_READ_S = 0.02  # workers="auto": counters are read at most this often
_AUTO_DECISIONS_KEPT = 100
_AT_LIMIT = object()  # _stream_next: the stream waits at the read limit (see stream_batches)
_PARK_POLL_S = 0.1
# _maybe_suggest_ahead logs once pass-start waits reach this share of the time since the first batch.
_SUGGEST_AHEAD_SHARE = 0.05
logger = logging.getLogger("kpipe")


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
    NOTE in `kpipe/_engine/_cursor.py`.

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
            (`worker_threads`). Defaults to 2.
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
            may run; it also caps that number).
        max_queue_bytes: Also bound the bytes loaded ahead: fewer batches are queued
            when the last batch times the queue length would exceed it (at least one
            batch per worker stays in flight). Defaults to None (batches only).
        shuffle: Permute the batch order every pass, from `(seed, pass)` only: the
            same seed gives the same batches whatever `workers` is. Defaults to False.
        seed: Seed of the shuffle and of the workers' `random`/`numpy.random`:
            worker processes reseed both before each batch from `(seed, pass,
            position)`, so random augmentation gives the same batch whatever `workers`
            is, also after `restore()` with another worker count (threads and
            `workers=0` share this process's generators and are not reseeded; see
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
        timeout: Seconds to wait for one batch before raising `BatchTimeoutError`;
            None (or `float("inf")`) waits as long as it takes. Defaults to 120.
        num_shards: Split each pass's batches into this many shards (one per
            data-parallel worker); the loader loads only shard `shard_index`: positions
            `shard_index, shard_index + num_shards, ...` of the pass's order,
            `n // num_shards` of them, so every worker runs the same number of steps.
            Defaults to None: under a multi-worker `TF_CONFIG`, one shard per worker
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
            processes only. `stats()["ahead"]` counts passes `kept`, `missed` and
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
        shuffle=False,
        seed=None,
        start_method=None,
        use_threads=False,
        timeout=_DEFAULT_TIMEOUT_S,
        num_shards=None,
        shard_index=None,
        epoch_end_ahead=False,
    ):
        self._autoscaler = None
        if not isinstance(epoch_end_ahead, bool):
            raise TypeError(f"`epoch_end_ahead` must be True or False. Received: epoch_end_ahead={epoch_end_ahead!r}.")
        if isinstance(workers, str) and workers == "auto":
            workers, max_queue_size = self._init_autoscale(max_queue_size, start_method, use_threads)
        workers = _check_int("workers", workers, 0, "Use 0 to load batches in the calling thread, or workers='auto'.")
        if max_queue_size is None:
            max_queue_size = max(4, 2 * workers)
        max_queue_size = _check_int("max_queue_size", max_queue_size, 1, "It bounds the batches loaded ahead; use at least 1.")
        super().__init__(workers=1, use_multiprocessing=False, max_queue_size=max_queue_size)
        if max_queue_bytes is not None:
            max_queue_bytes = _check_int("max_queue_bytes", max_queue_bytes, 1, "Use None to bound by batches only.")
        self.max_queue_bytes = max_queue_bytes
        self.timeout = _check_timeout(timeout)
        if start_method not in (None, "forkserver", "spawn", "fork"):
            raise ValueError(
                f"Invalid value for argument `start_method`. Received: start_method={start_method!r}. "
                "Expected 'forkserver' (default), 'spawn' or 'fork'; for threads pass use_threads=True."
            )
        _check_dataset(dataset)
        self.dataset = dataset
        self.num_workers = workers
        self.worker_threads = _threads.check(worker_threads)
        if self.worker_threads is not None and (workers == 0 or use_threads):
            warnings.warn(
                f"`worker_threads` has no effect with {'workers=0' if workers == 0 else 'use_threads=True'}: batches load "
                f"in this process, whose thread pools kpipe leaves alone. Received: worker_threads={worker_threads}. "
                "Drop it, or use worker processes.", stacklevel=2,
            )
        self.shuffle = bool(shuffle)
        self.seed = int.from_bytes(os.urandom(4), "little") if seed is None else _check_int("seed", seed, 0, "")
        self.start_method = start_method or _default_start_method()
        self.use_threads = bool(use_threads)
        self._name = type(dataset).__name__
        self._stateful = _overrides(dataset, "on_epoch_end") or _overrides(dataset, "on_epoch_begin")
        self._ahead = None  # the next pass's state sent ahead of the hook (_ahead.Ahead)
        self._ahead_stats = None
        if epoch_end_ahead:
            off = None
            if not self._stateful:
                off = f"`{self._name}` has no on_epoch_end/on_epoch_begin: passes load ahead anyway"
            elif workers == 0 or use_threads:
                off = "batches load in this process (workers=0 or use_threads=True): only worker processes load ahead"
            self._ahead_stats = {"kept": 0, "missed": 0, "skipped": 0, "off": off, "last_reason": None}
        self._ahead_tried = None  # the pass whose end was last tried
        self._ahead_fails = 0  # misses and skips in a row
        self._has_begin = _overrides(dataset, "on_epoch_begin")
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
        self._cursor = PassCursor(self._planner.length(num_batches))
        self._dataset_lengths = {0: num_batches}  # the dataset's own len() at each pass
        self._lock = threading.RLock()
        self._queue = collections.OrderedDict()  # key (pass, position) -> _Entry, keys ascending
        self._backend = None
        self._closed = False
        # The consumer may call the dataset's hooks before it reads the head pass (Keras
        # >= 3.7 calls on_epoch_end before the first epoch; a pass end is followed by one):
        # a dataset with hooks loads nothing of that pass ahead until they ran, or until
        # the consumer reads it (see _hook_ran and the class docstring's hook rule).
        self._hooks_due = self._stateful
        # Where read-ahead stops: the key after the last one the consumer will read, when
        # Keras said so (its last epoch; the end of a Keras epoch of an infinite dataset
        # with hooks). None: no limit. Reads past it lift it.
        self._read_limit = None
        self._checker = _tree.StructureChecker(self._name)
        # Batches kept in flight: two per worker, grown (up to max_queue_size) when a
        # worker idles behind a slow batch. Fewer slots in flight means less shared
        # memory, and fewer slots to create (and page in) before the first pass flows
        # (the NOTE in kpipe/_engine/_pool.py: when a batch may take a new slot).
        self._window = max_queue_size if workers == 0 else min(max_queue_size, 2 * workers)
        # Worker-seconds spent idle behind slow batches with the window full since it last
        # deepened, and when (with how many idle) the current such wait began: see _starved.
        self._idle_behind_s = 0.0
        self._idle_since = None
        self._consumer_releases = True  # it drops each batch as it takes the next one
        self._slot_awaited = False  # a batch waits for the consumer to release a slot
        self._releases_seen = 0  # slot releases when it began to wait
        self._stats = {
            "batches": 0, "samples": 0, "bytes": 0, "last_batch_bytes": 0, "wait_s": 0.0,
            "pass_start_wait_s": 0.0, "first_batch_s": None, "restarts": 0, "loads": 0, "discards": 0, "passes": 0,
        }
        self._ahead_suggested = False  # the INFO line of _maybe_suggest_ahead, once
        self._completed_before = None  # the pass that follows the last one completed here
        self._auto_decisions = collections.deque(maxlen=_AUTO_DECISIONS_KEPT)
        self._autoscale_next = 0.0
        self._t_created = time.perf_counter()
        self._start_backend()
        self._fill()

    # ---------------------------------------------------------------- PyDataset API
    @property
    def num_batches(self):
        """Batches in the current pass (of this shard), or None for an infinite dataset."""
        return self._cursor.length_of(self._cursor.head[0])

    def __len__(self):
        n = self.num_batches
        if n is None:
            raise TypeError(f"`{self._name}` is infinite (num_batches is None); use steps_per_epoch.")
        return n

    def __getitem__(self, index):
        """Batch `index` of the current pass, in any order of access (see the class
        docstring on passes); reading its last batch in order ends the pass."""
        index = operator.index(index)
        with self._lock:
            n = self.num_batches
            if index < 0 and n is not None:
                index += n
            if index < 0 or (n is not None and index >= n):
                raise IndexError(f"Batch index {index} is out of range for a loader of {n} batches per pass.")
            key, sequential = self._cursor.direct_key(index)
            batch = self._fetch(key, keep=self._cursor.probing)
            if self._cursor.handed_out_direct(key, sequential):
                self._pass_completed()
            return batch

    def on_epoch_begin(self):
        """Runs the dataset's `on_epoch_begin` now (a manual loop calls it; Keras's calls
        take kpipe's adapter, see the class docstring)."""
        with self._lock:
            self._run_hook("on_epoch_begin")

    def on_epoch_end(self):
        """Runs the dataset's `on_epoch_end` now, once, and ends the current pass if any of
        it was read (a loop that stops early starts the next pass at `loader[0]`); a pass
        read to its last batch ended then. Its new state reaches the workers before they
        load the next pass; batches loaded ahead stand if the hook left the dataset as it
        was (it pickles to the same bytes).

        `fit`/`evaluate`/`predict` do not call this: kpipe's adapter passes Keras's epoch
        calls on by the rule of the class docstring.
        """
        with self._lock:
            if self._cursor.pass_begun():
                self._pass_completed()
            self._run_hook("on_epoch_end")

    # ------------------------------------------------------------------ extras
    @property
    def num_shards(self):
        """How many shards each pass is split into (1: no sharding)."""
        return self._planner.num_shards

    @property
    def shard_index(self):
        """Which shard this loader loads."""
        return self._planner.shard_index

    @property
    def epoch(self):
        """Index of the current pass (0 first; incremented when a pass ends)."""
        return self._cursor.head[0]

    def set_epoch(self, epoch):
        """Jumps to the start of pass `epoch` (its shuffle plan), dropping work in flight."""
        epoch = _check_int("epoch", epoch, 0, "")
        with self._lock:
            if self._cursor.head != (epoch, 0):
                self._jump(epoch, 0, self._dataset_length())

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
        with self._lock:
            return self._state_at(self._cursor.direct_position())

    def restore(self, state):
        """Continues from `state` (from `state()`, possibly of another process).

        Work in flight is dropped; the next read starts at the saved position of the
        saved pass, with that pass's shuffle plan, whatever `workers` was before or is
        now. A dataset with its own epoch state (e.g. an index reshuffled in
        `on_epoch_end`) must restore that state itself.

        Raises:
            ValueError: if the state was saved for another dataset length, seed,
                shuffle setting or sharding, or is malformed.
        """
        pass_, position, num_batches = self._check_state(state)
        with self._lock:
            self._jump(pass_, position, num_batches)

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
        with self._lock:
            out = dict(self._stats)
            out["queue_depth"] = self._limit()
            out["workers"] = self.num_workers
            out["pids"] = list(self._backend.pids) if self._backend is not None else []
            processes = isinstance(self._backend, ProcessBackend) and not self._backend.closed
            out["worker_threads"] = self._backend.worker_threads if processes else None
            out["worker_thread_pools"] = self._backend.thread_pools() if processes else []
            if self._ahead_stats is not None:
                out["ahead"] = dict(self._ahead_stats)
            if self._autoscaler is not None:
                out["cpu_limit"] = self._autoscaler.cpu_limit
                out["max_workers"] = self._autoscaler.max_workers
                out["auto_decisions"] = list(self._auto_decisions)
            return out

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
        import tensorflow as tf

        if device is not None:
            device = _check_device(device)
        if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
            raise ValueError(f"`epochs` must be a positive int (the iterations the dataset will run) or None. Received: epochs={epochs!r}.")
        signature = self._signature()
        ref = weakref.ref(self)
        finite = self.num_batches is not None
        runs = [0]

        def generate():
            if epochs is not None:
                runs[0] += 1
                loader = ref()
                if loader is not None:
                    loader._iteration_begin(epochs - runs[0] + 1)
                del loader
            for batch in stream_batches(ref, hooks="iteration"):
                yield _lists_to_tuples(batch)

        ds = tf.data.Dataset.from_generator(generate, output_signature=signature)
        if finite and not self._stateful and self._cursor.head[1] == 0:
            ds = ds.apply(tf.data.experimental.assert_cardinality(self.num_batches))
        if device is None:
            ds = ds.prefetch(prefetch)
        else:
            ds = ds.apply(tf.data.experimental.prefetch_to_device(device, buffer_size=prefetch))
        if self.num_shards > 1:  # already this worker's share: no second split by tf.data
            from kpipe.distribute import mark_presharded

            ds = mark_presharded(ds)
        _keep_alive(ds, self)
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
        auto = "auto: " if self._autoscaler is not None else ""
        return (
            f"ProcessLoader({self._name}, workers={auto}{self.num_workers} ({mode}), "
            f"max_queue_size={self.max_queue_size}, shuffle={self.shuffle}, batches={self.num_batches})"
        )

    def __reduce__(self):
        raise TypeError(
            "A ProcessLoader owns worker processes and cannot be pickled; pickle its `dataset` "
            "and build a new loader where you need it."
        )

    # ------------------------------------------------- streams (kpipe's Keras adapter)
    def _open_stream(self, hooks=None, consumer=None, confirm=False):
        """A stream over the rest of the head's pass. `hooks`: "keras" (Keras's adapter
        passes its epoch calls on, `consumer` records the stream) or "iteration" (the
        stream's start and end run the dataset's hooks: `as_dataset()`). `confirm`: the
        consumer's epoch end completes the pass (a `tf.data` reader runs ahead of Keras;
        see the NOTE in kpipe/_engine/_cursor.py)."""
        with self._lock:
            stream = self._cursor.open_stream(hooks=hooks, confirm=confirm)
            if consumer is not None and not stream.probe:
                consumer.stream, consumer.consumed, consumer.taken = stream, 0, 0
            return stream

    def _stream_next(self, stream):
        """The next batch of `stream`, or None when its pass has ended."""
        with self._lock:
            if stream.hooks == "iteration" and not stream.began and stream.live:
                stream.began = True
                if self._cursor.at_pass_start(None) and stream.base == self._cursor.head:
                    self._run_hook("on_epoch_begin")
            key = self._cursor.next_key(stream)
            if key is None or (stream.probe and not self._probe_may_load(key)):
                if stream.hooks == "iteration" and not stream.ended and self._cursor.stream_at_pass_end(stream):
                    stream.ended = True
                    self._run_hook("on_epoch_end")
                return None
            if stream.resume is not None and self._read_limit is not None and key >= self._read_limit:
                stream.resume.clear()
                return _AT_LIMIT
            batch = self._fetch(key, keep=stream.probe)
            if self._cursor.handed_out(stream, key):
                if stream.confirm:
                    stream.pending = True  # until the consumer's epoch end took it
                else:
                    self._pass_completed()
            return batch

    def _keras_epoch_begin(self, consumer, *, steps=None, left=None, probe=False):
        """Keras began an epoch of the consumer (kpipe's adapter; `consumer.stream` is the
        stream it reads). Runs the dataset's `on_epoch_begin` unless the epoch starts
        inside a pass of a finite dataset (`steps_per_epoch < len`), and sets where
        read-ahead stops: where the `left` epochs the call runs from this one on end
        (each `steps` long, None: to its pass's end; a Keras epoch also ends where a pass
        does), so nothing loads for an epoch the call will not run. For a dataset with
        hooks, whose next passes may change, only this epoch counts when it is the last,
        and an infinite one's epoch ends there too (the next loads after its hooks). A
        `probe`'s epoch (Keras's symbolic build under a strategy) runs the hook as plain
        Keras does, and sets no limit."""
        with self._lock:
            stream, consumed = consumer.stream, consumer.epoch_start()
            finite = self.num_batches is not None
            if not finite or self._cursor.at_pass_start(stream, consumed):
                self._run_hook("on_epoch_begin", fill=probe)
            if probe:
                return
            start = self._cursor.stream_position(stream, consumed)
            if left is not None and finite and steps is not None and consumer.each_a_call and steps < self.num_batches:
                left = 1  # every epoch a call (validation) that starts the pass again: none reads past its steps
            limit = None
            if left is not None and (left == 1 or not self._stateful):
                limit = start
                for _ in range(left):
                    if not finite:
                        limit = self._cursor.walk(limit, steps) if steps is not None else None
                    elif steps is None:
                        limit = (limit[0] + 1, 0)
                    else:
                        limit = min(self._cursor.walk(limit, steps), (limit[0] + 1, 0))
                    if limit is None:
                        break
                if finite and steps is not None and not _compat.keras_at_least(_compat.KERAS_EPOCH_ITERATOR_RESET):
                    limit = min(limit, (start[0] + 1, 0))  # Keras < 3.7 stops where the pass ends
            elif not finite and steps is not None and self._stateful:
                limit = self._cursor.walk(start, steps)
            self._set_read_limit(limit)
            if stream is not None and stream.resume is not None:
                stream.resume.set()  # a stream waiting at the old limit goes on

    def _iteration_begin(self, left):
        """An `as_dataset(epochs=...)` iteration starts, `left` of them (this one included)
        to go: read-ahead stops where the last one's pass ends (for a dataset with hooks,
        whose next passes may change, only once this is the last). An iteration past the
        last counts as the last again."""
        with self._lock:
            if self.num_batches is None:
                return
            left = max(left, 1)
            if left == 1 or not self._stateful:
                limit = (self._cursor.head[0] + left, 0)
            else:
                return
            self._set_read_limit(limit)

    def _set_read_limit(self, limit):
        """Read-ahead stops before `limit` (None: no limit); queued batches at or after
        it are dropped, and a stream waiting at the old limit goes on."""
        self._read_limit = limit
        if limit is not None:
            for k in [k for k in self._queue if k >= limit]:
                self._drop(k)
        self._fill_after_read()

    def _demand(self, consumer):
        """The reader of `consumer`'s stream waits at the read limit while Keras asks for
        a batch: the limit was Keras's plan, and Keras reads on -- lift it."""
        with self._lock:
            self._read_limit = None
            stream = consumer.stream
            if stream is not None and stream.resume is not None:
                stream.resume.set()
            self._fill()

    def _keras_epoch_end(self, consumer):
        """Keras ended an epoch of the consumer: runs the dataset's `on_epoch_end`, unless
        the epoch ended inside a pass of a finite dataset (`steps_per_epoch < len`). When
        the epoch ends the consumer's Keras call (the last of `fit`, an `evaluate`, a
        validation run), Keras >= 3.7 starts the next call with another `on_epoch_end`
        (its reset) before `on_epoch_begin`: a dataset with hooks loads nothing ahead
        until then, as the reset may change it again (a reshuffle: all reloaded)."""
        with self._lock:
            taken = consumer.end_epoch()
            stream = consumer.stream
            if stream is not None and stream.pending and self._cursor.stream_at_pass_end(stream, taken):
                stream.pending = False
                if stream.base[0] == self._cursor.head[0]:
                    self._pass_completed()
            if self.num_batches is None or self._cursor.at_pass_start(consumer.stream, taken):
                hold = consumer.ends_call and _compat.keras_at_least(_compat.KERAS_EPOCH_ITERATOR_RESET)
                self._run_hook("on_epoch_end", hold=hold)  # hold: until on_epoch_begin or a read

    def _keras_reset(self, consumer):
        """Keras dropped the consumer's iterator (`EpochIterator.reset`, Keras >= 3.7): its
        stream ends, and the next one starts the head's pass again."""
        with self._lock:
            stream, consumer.stream = consumer.stream, None
            if stream is not None:
                stream.live = False

    def _peek(self, index):
        """Batch `index` after the head, for a probe (Keras's tensor spec): moves nothing,
        and the batch is kept for the read that consumes it."""
        with self._lock:
            return self._fetch(self._cursor.walk(self._cursor.head, index), keep=True)

    def _begin_probe(self):
        with self._lock:
            self._cursor.begin_probe()

    def _end_probe(self):
        with self._lock:
            self._cursor.end_probe()

    def _probing(self):
        with self._lock:
            return self._cursor.probing

    def _probe_may_load(self, key):
        """A probe reads at most a queue's worth past the head (Keras needs one batch)."""
        return self._cursor.walk(self._cursor.head, self.max_queue_size) > key

    def _key_after(self, origin, consumed):
        """The key `consumed` batches after `origin` (for BackupAndRestore)."""
        with self._lock:
            return self._cursor.walk(origin, consumed)

    def _state_at(self, key):
        return {
            "format": STATE_FORMAT,
            "pass": int(key[0]),
            "position": int(key[1]),
            "num_batches": self._dataset_length(key[0]),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_shards": self.num_shards,
            "shard_index": self.shard_index,
        }

    def _check_state(self, state):
        if not isinstance(state, dict):
            raise ValueError(f"`state` must be a dict from `loader.state()`. Received: {str(state)[:100]} of type {type(state).__name__}.")
        fmt = state.get("format")
        if fmt != STATE_FORMAT:
            newer = isinstance(fmt, int) and fmt > STATE_FORMAT
            raise ValueError(
                f"Cannot restore a loader state of format {fmt!r}: this kpipe reads format {STATE_FORMAT}"
                + (" (the state comes from a newer kpipe; upgrade kpipe here)." if newer else ".")
            )
        try:
            pass_, position = _check_int("state['pass']", state["pass"], 0, ""), _check_int("state['position']", state["position"], 0, "")
        except KeyError as exc:
            raise ValueError(f"`state` lacks the entry {exc}; pass a dict from `loader.state()`.") from None
        expected = {"seed": self.seed, "shuffle": self.shuffle, "num_shards": self.num_shards, "shard_index": self.shard_index}
        for name, want in expected.items():
            if state.get(name) != want:
                raise ValueError(
                    f"The state was saved by a loader with {name}={state.get(name)!r}, but this loader has "
                    f"{name}={want!r}. Restore it into a loader built with the same {name}."
                )
        saved_n = state.get("num_batches")
        current_n = self._dataset_length()
        if not self._stateful and saved_n != current_n:
            raise ValueError(
                f"The state was saved for a dataset of {saved_n} batches, but `{self._name}` has {current_n}: "
                "it is not the same data. Restore it into a loader of the same dataset."
            )
        length = self._planner.length(saved_n)
        if length is not None and position >= length:
            raise ValueError(f"state['position']={position} is out of range for a pass of {length} batches.")
        return pass_, position, saved_n

    # --------------------------------------------------------------- internals
    def _signature(self):
        import tensorflow as tf

        first = self._peek(0)
        treedef, leaves, _ = _tree.flatten(first)
        if "none" in repr(treedef):
            raise LoaderError("as_dataset() cannot express `None` entries of a batch; drop them in __getitem__.")
        n = self.num_batches
        second = _tree.flatten(self._peek(1))[1] if n is None or n > 1 else leaves
        specs = []
        for a, b in zip(leaves, second):
            shape = [None] + [d if d == e else None for d, e in zip(a.shape[1:], b.shape[1:])] if a.ndim else []
            specs.append(tf.TensorSpec(shape, tf.as_dtype(a.dtype)))
        return _lists_to_tuples(_tree.unflatten(treedef, specs))

    def _fetch(self, key, keep):
        """The batch at `key`: loaded (or taken from what a probe kept). `keep` keeps it
        queued for the next read of the same key."""
        backend = self._ensure_backend()
        if not keep:  # a real read: the consumer goes on (with the dataset as it is)
            if self._ahead is not None and key[0] >= self._ahead.pass_:  # before its real hooks ran
                self._cancel_ahead()
            if key[0] >= self._cursor.head[0]:
                self._hooks_due = False
            if self._read_limit is not None and key >= self._read_limit:
                self._read_limit = None
        entry = self._seek(key, probe=keep)
        if entry.batch is not None:
            batch = entry.batch
            if not keep:
                del self._queue[key]
                self._fill_after_read(key)
            return batch
        if self._slot_awaited:  # did the consumer release a batch since (_fill_after_read)?
            self._slot_awaited = False
            self._consumer_releases = backend.slot_releases > self._releases_seen
        elif not self._consumer_releases and isinstance(backend, ProcessBackend):
            self._consumer_releases = backend.slots_held() <= 1  # it holds its last batch only
        self._fill()
        t0 = time.perf_counter()
        try:
            batch, treedef, meta = backend.get(entry.seq, on_starved=lambda: self._starved(entry.seq))
        except BaseException:
            self._queue.pop(key, None)
            self._after_failure()
            raise
        finally:
            now = time.perf_counter()
            waited = now - t0
            self._stats["wait_s"] += waited
            if self._idle_since is not None:  # workers idled behind this batch (see _starved)
                self._idle_behind_s += (now - self._idle_since[0]) * self._idle_since[1]
                self._idle_since = None
            if key[1] == 0 and key[0] == self._completed_before:  # the start of the pass after one completed here
                self._stats["pass_start_wait_s"] += waited
        entry.seq = None
        try:
            self._checker.check(entry.index, treedef, meta)
            self._account(meta)
        except BaseException:
            self._queue.pop(key, None)
            self._fill()
            raise
        if keep:
            entry.batch = batch
        else:
            del self._queue[key]
        self._fill_after_read(key)
        if self._autoscaler is not None:
            self._maybe_autoscale()
        return batch

    def _seek(self, key, probe):
        """The queue entry of `key`, submitting it if needed. A real read drops every
        entry before `key` (those batches were skipped); a probe keeps them."""
        queue = self._queue
        if not probe:
            for k in [k for k in queue if k < key]:
                self._drop(k)
        entry = queue.get(key)
        if entry is not None:
            return entry
        first = next(iter(queue), None)
        if first is not None and key < first and self._distance(key, first) <= self.max_queue_size:
            # e.g. a new stream replays the start of a pass whose batches were consumed
            missing, k = [], key
            while k < first:
                missing.append(k)
                k = self._cursor.successor(k, cross_passes=True)
            for k in reversed(missing):
                queue[k] = self._submit(k)
                queue.move_to_end(k, last=False)
            return queue[key]
        if not probe or first is None or key > next(reversed(queue)):
            for k in [k for k in queue if not (probe and queue[k].batch is not None)]:
                self._drop(k)
        if key not in queue:
            queue[key] = self._submit(key)
            self._sort_queue()
        self._fill(after=key)
        return queue[key]

    def _distance(self, a, b):
        steps = 0
        while a < b and steps <= self.max_queue_size:
            a = self._cursor.successor(a, cross_passes=True)
            steps += 1
        return steps

    def _sort_queue(self):
        for k in sorted(self._queue):
            self._queue.move_to_end(k)

    def _submit(self, key):
        if self._ahead is not None and key[0] < self._ahead.pass_:  # the workers hold the next pass's state
            self._cancel_ahead()
        index = self._planner.index(key[0], key[1], self._dataset_length(key[0]))
        self._stats["loads"] += 1
        return _Entry(index, self._backend.submit(index, seed=_wi.batch_seed(self.seed, key[0], key[1])))

    def _drop(self, key):
        entry = self._queue.pop(key)
        if entry.batch is None:
            self._stats["discards"] += 1
            if entry.seq is not None and self._backend is not None:
                self._backend.discard(entry.seq)

    def _in_flight(self):
        return sum(1 for e in self._queue.values() if e.batch is None)

    def _next_dispatch(self, after=_UNSET):
        """The next key to load: after the last queued one (or the head / the current
        read), at most one pass past the head, across a pass boundary only when the next
        pass's plan cannot change (no epoch hooks), nothing of the head's pass while the
        consumer may still call the dataset's hooks before reading it, and nothing at or
        after the read limit -- see the NOTE in _cursor.py and `_hooks_due`."""
        last = next(reversed(self._queue), None)
        if last is None:
            key = self._cursor.read_position() if after is _UNSET else after
        else:
            key = self._cursor.successor(last, cross_passes=self._may_cross(last[0]))
            if key is None and self._begin_ahead(last):
                key = self._cursor.successor(last, cross_passes=True)
        if key is None or key[0] > self._cursor.read_ahead_limit():
            return None
        key = max(key, self._cursor.head)
        if self._read_limit is not None and key >= self._read_limit:
            return None
        if self._hooks_due and not (self._ahead is not None and key[0] >= self._ahead.pass_):
            return None
        return key

    def _fill(self, after=_UNSET, new_slot=True):
        """Submits batches up to the window. One that would need a new shared-memory slot
        (none free) waits while every worker has work -- or, with `new_slot=False`, even
        if one idles -- for the consumer to release one (see `_starved`). Returns True
        if a batch waits so."""
        backend = self._backend
        if backend is None or backend.closed:
            return False
        limit = self._limit()
        needs_new_slot = getattr(backend, "needs_new_slot", None)
        while self._in_flight() < limit:
            key = self._next_dispatch(after)
            if key is None:
                return False
            if needs_new_slot is not None and needs_new_slot(for_idle_worker=new_slot):
                return True
            self._queue[key] = self._submit(key)
        return False

    def _fill_after_read(self, key=None):
        """The fill after a read (of `key`) or a pass end. A consumer that holds an older
        batch besides this one usually releases it as it takes this one (`x, y =
        loader[i]`), so a batch that needs a new slot waits for the next read, even for
        an idle worker -- unless the consumer released nothing between the last such wait
        and the next read (it keeps its batches, in a list say): then loading goes on in
        new slots, until it holds one batch at most again."""
        after = _UNSET if key is None else self._cursor.successor(key, cross_passes=self._may_cross(key[0]))
        backend = self._backend
        wait = self._consumer_releases and isinstance(backend, ProcessBackend) and backend.slots_held() >= 2
        if self._fill(after=after, new_slot=not wait) and wait:
            self._slot_awaited, self._releases_seen = True, backend.slot_releases

    def _pass_completed(self):
        """The head's pass was read to its end (or ended early by `on_epoch_end`): new
        reads start the next pass, which keeps the dataset's length. With epoch hooks,
        nothing of it loads ahead until the consumer called them or reads it."""
        self._cursor.complete_pass()
        self._stats["passes"] += 1
        self._maybe_suggest_ahead()
        head = self._cursor.head
        self._completed_before = head[0]
        for k in [k for k in self._queue if k < head]:
            self._drop(k)
        if head[0] not in self._dataset_lengths:  # (epoch_end_ahead may have set it)
            n = self._dataset_length(head[0] - 1)
            self._dataset_lengths[head[0]] = n
            self._cursor.set_length(head[0], self._planner.length(n))
        if self._stateful:
            self._hooks_due = True
        self._fill_after_read()

    def _run_hook(self, name, fill=True, hold=False):
        """Runs the dataset's `name` ("on_epoch_begin"/"on_epoch_end") now, because its
        consumer called it, then brings the workers up to date (`_hook_ran`). `hold`: an
        `on_epoch_end` that another will follow before the head's pass is read (see
        `_keras_epoch_end`): a dataset with hooks loads nothing ahead yet."""
        if name == "on_epoch_begin" or not self._has_begin:
            # the hooks due before the head's pass have run
            self._hooks_due = self._stateful and hold and name == "on_epoch_end"
        hook = getattr(self.dataset, name, None)
        if not _overrides(self.dataset, name):
            if callable(hook):
                hook()  # (PyDataset's no-op)
            if fill:
                self._fill_after_read()
            return
        try:
            hook()
        finally:
            self._hook_ran(name, fill)

    def _hook_ran(self, name, fill):
        """After a hook that may have changed the dataset: batches loaded ahead stand if
        it pickles to the bytes the workers hold (or, with epoch_end_ahead, to the copy's);
        else they are dropped and the workers get the new state (and length) before they
        load anything more. Threads and `workers=0` share the dataset: what was loaded
        ahead is dropped."""
        n = _num_batches(self.dataset)
        ahead = self._ahead
        if ahead is not None and ahead.pass_ == self._cursor.head[0] and self._cursor.at_pass_start(None):
            if name == "on_epoch_end" and self._has_begin:
                ahead.real_hooks_ran = True  # compared once on_epoch_begin ran too
                return
            kept, dumped = self._keep_ahead(n)
            changed = not kept
        else:
            if ahead is not None:
                self._cancel_ahead()
            changed, dumped = self._state_changed(n)
        if changed:
            for k in list(self._queue):
                self._drop(k)
            self._set_length(n)
            backend = self._backend
            if backend is not None and not backend.closed:
                try:
                    backend.reset_target(self.dataset, dumped=dumped)
                except BaseException:
                    backend.close(force=True)  # its workers' state is unknown: the next read starts a new pool
                    self._after_failure()
                    raise
        if fill:
            self._fill_after_read()

    def _state_changed(self, n):
        """Whether the workers' copy of the dataset is stale now (with a fresh pickle of
        it, or None where the backend holds no pickle)."""
        backend = self._backend
        if not isinstance(backend, ProcessBackend) or backend.closed:
            return True, None
        payload, keys = backend.current_state()
        new_payload, new_keys, rewrote = backend.dump(self.dataset)
        same_shape = (not rewrote and payload is not None and new_keys == keys
                      and n == self._dataset_length(self._next_unread_pass()))
        # other bytes can hold the same state (a class pickled by value: state_fingerprint)
        changed = not same_shape or (new_payload != payload and not backend.same_state(self.dataset))
        return changed, (new_payload, new_keys)

    def _next_unread_pass(self):
        """The first pass nothing of which was read: where a new length applies."""
        head = self._cursor.head
        return head[0] if head[1] == 0 and not self._cursor.handed_in_pass else head[0] + 1

    def _set_length(self, n):
        pass_ = self._next_unread_pass()
        for p in [p for p in self._dataset_lengths if p > pass_]:
            del self._dataset_lengths[p]
        self._cursor.forget_lengths_after(pass_)
        self._dataset_lengths[pass_] = n
        self._cursor.set_length(pass_, self._planner.length(n))

    def _maybe_suggest_ahead(self):
        """Once per loader, at INFO: the consumer spent a noticeable share of its time
        waiting at the starts of passes that the dataset's own hook held back."""
        st = self._stats
        if not self._stateful or self._ahead_stats is not None or self._ahead_suggested or st["passes"] < 3:
            return
        if st["first_batch_s"] is None or not isinstance(self._backend, ProcessBackend):  # the option needs processes
            return
        since_first = time.perf_counter() - self._t_created - st["first_batch_s"]
        if since_first > 0 and st["pass_start_wait_s"] >= _SUGGEST_AHEAD_SHARE * since_first:
            self._ahead_suggested = True
            logger.info(
                "ProcessLoader(%s): the consumer waited %.2f s for the first batches of passes (%.0f%% of the %.1f s "
                "since the first batch; stats()['pass_start_wait_s']): the dataset's on_epoch_end makes each pass wait "
                "for the previous one's last batch. If the hook changes nothing but the dataset (a reshuffle, an epoch "
                "counter), epoch_end_ahead=True loads the next pass while this one ends.",
                self._name, st["pass_start_wait_s"], 100 * st["pass_start_wait_s"] / since_first, since_first)

    def _jump(self, pass_, position, num_batches):
        self._completed_before = None  # the next pass start is a (re)start, not a pass end
        self._cancel_ahead()
        self._ahead_tried = None
        self._read_limit = None
        self._hooks_due = self._stateful and position == 0
        for k in list(self._queue):
            self._drop(k)
        self._dataset_lengths[pass_] = num_batches
        self._cursor.set_length(pass_, self._planner.length(num_batches))
        self._cursor.jump(pass_, position)
        self._fill()

    def _dataset_length(self, pass_=None):
        """The dataset's own len() at pass `pass_` (the newest known when not recorded)."""
        lengths = self._dataset_lengths
        return lengths.get(pass_, lengths[max(lengths)]) if pass_ is not None else lengths[max(lengths)]

    def _start_backend(self):
        common = dict(mode="dataset", name=self._name)
        if self.num_workers == 0:
            self._backend = InlineBackend(self.dataset, **common)
        elif self.use_threads:
            self._backend = ThreadBackend(self.dataset, num_workers=self.num_workers, timeout=self._wait_s(), seed=self.seed, **common)
        else:
            auto = self._autoscaler
            self._backend = ProcessBackend(
                self.dataset,
                num_workers=self.num_workers,
                start_method=self.start_method,
                timeout=self._wait_s(),
                seed=self.seed,
                keep_idle=self.max_queue_size + (auto.max_workers if auto else self.num_workers),
                max_workers=auto.max_workers if auto else None,
                keep_payload=self._stateful,  # compared with the dataset after its hooks
                worker_threads=self.worker_threads,
                **common,
            )
            if auto is not None:
                auto.reset()
                self._maybe_autoscale()  # the first window opens as the workers start

    # ------------------------------------------ epoch_end_ahead (kpipe/_engine/_ahead.py)
    def _ahead_enabled(self):
        return self._ahead_stats is not None and self._ahead_stats["off"] is None

    def _may_cross(self, pass_):
        """Whether batches of pass `pass_ + 1` may be loaded now (before `pass_` ends)."""
        return not self._stateful or (self._ahead is not None and self._ahead.pass_ == pass_ + 1)

    def _begin_ahead(self, last):
        """`last`, the final batch of the head's pass, was sent to the workers: runs the
        hooks on a copy and sends its state, so the next pass loads now. Returns True if
        it did."""
        backend = self._backend
        pass_ = last[0]
        if (
            not self._ahead_enabled() or self._ahead is not None or self._ahead_tried == pass_
            or pass_ != self._cursor.head[0] or pass_ + 1 > self._cursor.read_ahead_limit()
            or (self._read_limit is not None and (pass_ + 1, 0) >= self._read_limit)
            or not isinstance(backend, ProcessBackend) or backend.closed
        ):
            return False
        self._ahead_tried = pass_
        payload, keys = backend.current_state()
        try:
            if payload is None:
                raise _ahead.NotAhead("the workers' state is not kept")
            out, out_keys, n = _ahead.run_hook_on_copy(
                payload, backend.shared, call_hooks=_call_hooks, num_batches=_num_batches, what=f"`{self._name}`",
            )
            if out_keys != keys:  # (both sorted)
                raise _ahead.NotAhead("on_epoch_end drops a shared array")
            if n is None:
                raise _ahead.NotAhead("the dataset becomes infinite")
        except _ahead.NotAhead as exc:
            self._ahead_failed("skipped", str(exc))
            return False
        self._ahead = _ahead.Ahead(pass_ + 1, out, out_keys, n, payload, keys)
        self._dataset_lengths[pass_ + 1] = n
        self._cursor.set_length(pass_ + 1, self._planner.length(n))
        try:
            backend.send_state(out, out_keys)
        except BaseException:  # e.g. Ctrl-C: some workers may hold the copy's state
            self._cancel_ahead()
            raise
        return True

    def _keep_ahead(self, n):
        """At a pass end, after the real hooks: whether the batches loaded ahead stand
        (the dataset pickles to the copy's bytes). Returns `(kept, dumped)`: if not
        kept, the caller sends the workers the dataset's state -- `dumped`, the pickle
        made here, or None (not pickled yet)."""
        ahead, self._ahead = self._ahead, None
        backend = self._backend
        if ahead is None or ahead.pass_ != self._cursor.head[0] or backend is None or backend.closed:
            return False, None
        payload, keys, rewrote = backend.dump(self.dataset)
        if payload == ahead.payload and keys == ahead.keys and not rewrote and n == ahead.num_batches:
            self._ahead_stats["kept"] += 1
            self._ahead_fails = 0
            return True, None
        why = ("on_epoch_end edited a shared array in place" if rewrote else
               f"the length became {n}, not {ahead.num_batches}" if n != ahead.num_batches else
               "the dataset's state after on_epoch_end differs from the copy's")
        self._ahead_failed("missed", why)
        return False, (payload, keys)  # (the caller records the pass's real length)

    def _ahead_failed(self, kind, reason):
        stats = self._ahead_stats
        stats[kind] += 1
        stats["last_reason"] = reason
        self._ahead_fails += 1
        logger.debug("ProcessLoader(%s): pass not loaded ahead of on_epoch_end (%s): %s", self._name, kind, reason)
        if self._ahead_fails >= _ahead.MISSES_OFF:
            stats["off"] = f"{self._ahead_fails} passes in a row could not load ahead; the last: {reason}"
            logger.info("ProcessLoader(%s, epoch_end_ahead=True): no longer loading ahead of on_epoch_end: %s",
                        self._name, stats["off"])

    def _cancel_ahead(self):
        """Drops the batches loaded ahead and gives the workers back the state they had
        (something reads or loads the current pass again, or jumps). Never leaves a pool
        whose workers' state is unknown: one that could not be told is closed (the next
        read starts a new one from the dataset)."""
        ahead = self._forget_ahead()
        if ahead is None:
            return
        for k in [k for k in self._queue if k[0] >= ahead.pass_]:
            self._drop(k)
        backend = self._backend
        if backend is not None and not backend.closed:
            try:
                if ahead.real_hooks_ran:  # the dataset's own hook ran since: the workers need its state
                    backend.reset_target(self.dataset)
                else:
                    backend.reset_target(None, dumped=(ahead.prev_payload, ahead.prev_keys))
            except BaseException:
                backend.close(force=True)
                self._after_failure()
                raise
        if ahead.real_hooks_ran:
            self._set_length(_num_batches(self.dataset))

    def _forget_ahead(self):
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._dataset_lengths.pop(ahead.pass_, None)
            self._cursor.forget_length(ahead.pass_)
        return ahead

    # ------------------------------------------------------- workers="auto"
    def _init_autoscale(self, max_queue_size, start_method, use_threads):
        """Checks `workers="auto"` against the other arguments; returns the workers to
        start with and the default `max_queue_size`."""
        if use_threads:
            raise ValueError(
                "`workers='auto'` runs worker processes; it cannot size a thread pool. Received: "
                "workers='auto', use_threads=True. Pass a number of threads, e.g. workers=8, use_threads=True."
            )
        if start_method == "fork":
            raise ValueError(
                "`workers='auto'` starts workers during training, once TensorFlow is loaded, where "
                "forking deadlocks (keras-team/keras#11461). Received: workers='auto', start_method='fork'. "
                "Use start_method='forkserver' (the default) or 'spawn'."
            )
        limit = _autoscale.cpu_limit()
        max_workers = _autoscale.max_workers_for(limit)
        if max_queue_size is not None:  # workers beyond the batches in flight would idle
            max_queue_size = _check_int("max_queue_size", max_queue_size, 1, "It bounds the batches loaded ahead; use at least 1.")
            max_workers = min(max_workers, max_queue_size)
        self._autoscaler = _autoscale.AutoScaler(limit, max_workers)
        self._cpu_clock = _autoscale.CpuClock()
        return min(_autoscale.start_workers_for(limit), max_workers), max_queue_size or max(4, 2 * max_workers)

    def _maybe_autoscale(self):
        """Feeds the controller (`kpipe/_engine/_autoscale.py`) the counters -- at every
        call during its first window, then at most every `_AUTOSCALE_READ_S` -- and starts
        or retires workers as it decides."""
        now = time.perf_counter()
        backend = self._backend
        if now < self._autoscale_next and not self._autoscaler.in_first_window:
            return
        if not isinstance(backend, ProcessBackend) or backend.closed:
            return
        self._autoscale_next = now + _AUTOSCALE_READ_S
        done, busy, cpu, runq = backend.timings
        stolen, cpus_busy = self._cpu_clock()
        decision = self._autoscaler.observe(_autoscale.Sample(
            t=now, workers=backend.num_workers, consumed=self._stats["batches"], wait_s=self._stats["wait_s"],
            main_cpu_s=time.process_time(), done=done, busy_s=busy, cpu_s=cpu, runq_s=runq,
            stolen_s=stolen, cpus_busy_s=cpus_busy,
        ))
        if decision is None:
            return
        record = dict(decision.as_dict(), t=round(now - self._t_created, 3))
        try:
            if decision.workers_to > decision.workers_from:
                backend.add_worker(decision.workers_to - decision.workers_from)
            else:
                for _ in range(decision.workers_from - decision.workers_to):
                    backend.retire_worker()
        except Exception as exc:  # the batch in hand is fine; a broken pool restarts on next use
            record["error"] = f"{type(exc).__name__}: {exc}"
            logger.warning("ProcessLoader(%s, workers='auto'): could not change the worker count %d -> %d: %s",
                           self._name, decision.workers_from, decision.workers_to, record["error"])
        self._auto_decisions.append(record)
        if backend.closed:
            return
        self.num_workers = backend.num_workers
        self._window = min(self.max_queue_size, 2 * self.num_workers)
        self._idle_behind_s = 0.0
        logger.info("ProcessLoader(%s, workers='auto'): %d -> %d workers: %s",
                    self._name, decision.workers_from, self.num_workers, decision.reason)
        self._fill()

    def _wait_s(self):
        return self.timeout  # None: the engine waits without a limit

    def _ensure_backend(self):
        if self._closed:
            raise LoaderClosedError(f"This ProcessLoader of `{self._name}` was closed; create a new one.")
        if self._backend is not None and self._backend.closed:  # e.g. Ctrl-C mid-send
            self._backend = None
            self._queue.clear()
            self._forget_ahead()
        if self._backend is None:  # a fatal failure stopped the previous workers
            self._stats["restarts"] += 1
            self._start_backend()
        return self._backend

    def _after_failure(self):
        if self._backend is not None and self._backend.closed:
            self._backend = None
            self._queue.clear()
            self._forget_ahead()

    def _starved(self, seq):
        """A worker ran out of work while the consumer waits for batch `seq`. Returns
        whether to be told again during this wait.

        First it gets the next batch to load: one that waited for a free slot now takes
        a new slot, since a worker idles otherwise. If the window is full instead, batch
        times vary, and one more batch in flight per worker would keep every worker
        busy -- at a price: with processes, each batch in flight holds a slot, and a
        new slot costs its worker a one-time set-up (the kernel allocating and mapping
        its pages: 46 ms for a 77 MB batch here, 250-400 ms on memory a virtual
        machine's host had taken back), besides the memory. So the window deepens
        (once per wait) like renting before buying: only once workers have spent at
        least that price idle behind slow batches since it last deepened -- at once
        where the new slots cost less than loading one batch (threads need none; small
        batches' slots cost microseconds) -- and never for a
        wait behind `seq`'s first use of its slot, a delay that does not recur, where
        more batches in flight would mean more slots, each paying it again. A wait that
        does not deepen counts its idle worker-seconds towards the price (see `_fetch`).
        Then (or when the window is at `max_queue_size`) the idle worker allocates a
        slot the window will need -- one per batch in flight and one the consumer
        holds -- instead of idling (`ProcessBackend.prepare_slots`).
        """
        loads = self._stats["loads"]
        self._fill()
        if self._stats["loads"] > loads:
            return True
        backend = self._backend
        processes = isinstance(backend, ProcessBackend)
        if self._in_flight() >= self._limit() and self._next_dispatch() is not None:
            if self._window < self.max_queue_size and not (processes and backend.is_first_use(seq)):
                price = self.num_workers * backend.slot_setup_s() if processes else 0.0
                if self._idle_behind_s >= price or price <= (backend.mean_batch_s() if processes else 0.0):
                    self._window = min(self.max_queue_size, self._window + self.num_workers)
                    self._idle_behind_s = 0.0
                    self._fill()
                    return False
                if self._idle_since is None:
                    self._idle_since = (time.perf_counter(), max(1, backend.idle_workers()))
            if processes:
                return backend.prepare_slots(up_to=self._limit() + 1) > 0
        return False

    def _limit(self):
        """Batches to keep in flight now: the window, within max_queue_bytes if set."""
        limit = self._window
        last = self._stats["last_batch_bytes"]
        if self.max_queue_bytes is not None:  # until a batch size is known: one per worker
            limit = max(1, self.num_workers, min(limit, self.max_queue_bytes // last if last else 0))
        return limit

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


def _lists_to_tuples(tree):
    """tf.data takes tuples and dicts, not lists, at any depth of a structure."""
    if isinstance(tree, (list, tuple)):
        return tuple(_lists_to_tuples(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _lists_to_tuples(v) for k, v in tree.items()}
    return tree


def stream_batches(ref, *, hooks=None, consumer=None, stop=None, confirm=False):
    """Yields one stream of the loader behind weak reference `ref`: the rest of its current
    pass. Holds the loader only while fetching (see NOTE in kpipe/_keras_hook.py).

    Args:
        ref: A weak reference to the loader.
        hooks: "iteration" for a stream whose start and end run the dataset's epoch hooks
            (`as_dataset()`). Defaults to None.
        consumer: The Keras consumer (kpipe's adapter) reading the stream: it then
            records the stream, and Keras's epoch calls are passed on by the stream's
            position. Defaults to None.
        stop: A `threading.Event` of the reader (kpipe's feed thread): with it, the
            stream waits at the loader's read limit -- where the consumer's Keras epoch
            ends and its hooks come first, or where its last epoch ends -- instead of
            loading past it, until the limit moves, is lifted (`_demand`), or `stop` is
            set (the stream then ends). Without it the stream reads on: a tf.data thread
            must never wait for the main thread. Defaults to None.
        confirm: The pass completes at the consumer's Keras epoch end that took its last
            batch, not when the stream hands that batch out (a `tf.data` reader runs
            ahead of Keras's steps). Defaults to False.
    """
    loader = ref()
    if loader is None:
        return
    stream = loader._open_stream(hooks=hooks, consumer=consumer, confirm=confirm)
    if stop is not None:
        stream.resume = threading.Event()  # set: reading; clear: waiting at the read limit
        stream.resume.set()
    del loader
    while True:
        loader = ref()
        batch = None if loader is None else loader._stream_next(stream)
        if batch is _AT_LIMIT:
            event = stream.resume
            del loader
            while not event.wait(_PARK_POLL_S):
                if stop.is_set() or ref() is None:
                    return
            continue
        del loader
        if batch is None:
            return
        yield batch


class _Entry:
    """A queued batch: its dataset index, the backend task, and the batch once a probe
    read it (kept for the read that consumes it)."""

    __slots__ = ("index", "seq", "batch")

    def __init__(self, index, seq):
        self.index = index
        self.seq = seq
        self.batch = None


def _keep_alive(ds, loader):
    """`ds` (and the datasets made from it) hold `loader`; TensorFlow's graphs, which keep
    the generator forever, only hold it weakly (see NOTE in kpipe/_keras_hook.py)."""
    try:
        ds._kpipe_loader = loader
    except AttributeError:  # pragma: no cover - a tf.data object without a __dict__
        pass


def _check_device(device):
    """`device` as TensorFlow's canonical name, or a ValueError listing the devices."""
    from kpipe import _devices

    name = _devices.local_device(device)
    if name is not None:
        return name
    raise ValueError(
        f"`device` must name a device of this process. Received: device={device!r}. "
        f"Available: {', '.join(_devices.available())}. Pass one of them (e.g. '/gpu:0'), or device=None to "
        "leave batches on the host."
    )


def _check_timeout(timeout):
    if timeout is None or (isinstance(timeout, float) and math.isinf(timeout) and timeout > 0):
        return None
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0 or math.isnan(timeout):
        raise ValueError(
            f"`timeout` must be a positive number of seconds, or None for no timeout. Received: timeout={timeout!r}."
        )
    return float(timeout)


def _check_dataset(dataset):
    if isinstance(dataset, (str, bytes, bytearray, dict)) or not hasattr(dataset, "__getitem__"):
        raise TypeError(
            "`dataset` must have __getitem__(i) returning batch i and __len__ (a keras.utils.PyDataset "
            f"or Sequence). Received: {str(dataset)[:100]!s} of type {type(dataset).__name__}. For a Python "
            "generator, pass it to model.fit directly; for arrays, use kpipe.data.from_numpy."
        )


def _default_start_method():
    return "forkserver" if hasattr(os, "fork") and hasattr(os, "memfd_create") else "spawn"


def _check_int(name, value, minimum, fix):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an integer. Received: {name}={value!r} of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}. Received: {name}={value}. {fix}".rstrip())
    return int(value)


def _call_hooks(dataset):
    """What runs at a pass end: the dataset's on_epoch_end, then its on_epoch_begin."""
    if hasattr(dataset, "on_epoch_end"):
        dataset.on_epoch_end()
    if _overrides(dataset, "on_epoch_begin"):
        dataset.on_epoch_begin()


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
    except Exception as exc:
        raise LoaderError(
            f"len() of `{type(dataset).__name__}` raised {type(exc).__name__}: {exc}. kpipe asks the "
            "dataset for its length when the loader is built and after each pass; fix __len__ "
            "(or num_batches) so that it returns the number of batches."
        ) from exc
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
