"""The loader's coordinator: it answers the stream protocol (`kpipe/_stream.py`) and the
facade's reads by moving the parts together -- where the loader stands (`Position`), what
is in flight (`Window`), read-ahead across passes (`LoadAhead`), the backend, the
worker-count controller (`AutoscaleDriver`) -- under the dataset's epoch-hook rule (the
`ProcessLoader` docstring).

One batch's way through, for `loader[i]` or a stream's next batch:

    Position.direct_key / next_key   which key
    Reader.fetch(key)                a real read: read-ahead of an older state is
                                     cancelled, the hooks due are done, the read limit
                                     lifted if passed
      Window.seek(key)               the key's entry (submitted now if it was not)
      Window.wait(key, entry)        the backend's answer (workers fill in meanwhile)
      StructureChecker, counters     batch i has batch 0's structure
      Window.fill_after_read         the next keys, by `next_dispatch` (hooks due, read
                                     limit, read-ahead into the next pass)
    Position.handed_out              the pass ends at its last batch -> pass_completed

Every method runs under the facade's lock (an `RLock`), except `queue_depth()`.
"""

import collections
import contextlib
import functools
import math
import threading
import time
import weakref

from kpipe import _args, _compat, _dataset_api, _stream
from kpipe._engine import _ahead, _pickling, _tree, _unsent
from kpipe._engine._local import InlineBackend, ThreadBackend
from kpipe._engine._pool import ProcessBackend
from kpipe._engine._ray import RayBackend
from kpipe._engine._position import Position
from kpipe._engine._shm import as_dtype
from kpipe._engine._window import _UNSET, Window
from kpipe.errors import LoaderClosedError

_AUTO_DECISIONS_KEPT = 100


def _locked(method):
    """Runs `method` under the reader's lock (for callers from other threads: streams)."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return call


def _weakly(method):
    """`method` of an object, called through a weak reference (None once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call


class Reader:
    """Coordinates one loader's parts (module docstring). Built by `ProcessLoader` with
    checked arguments; `autoscale` is an `AutoscaleDriver` for `workers="auto"`."""

    def __init__(self, dataset, *, name, num_batches, workers, worker_threads, max_queue_size, max_queue_bytes,
                 shuffle, seed, num_shards, shard_index, start_method, use_threads, timeout, epoch_end_ahead,
                 autoscale=None, keyed_by_pass=False, remote=None, seed_given=True):
        self.lock = threading.RLock()
        self.dataset = dataset
        self.name = name
        self.num_workers = workers
        self.worker_threads = worker_threads
        max_queue_size, small = _args.small_batch_queue(dataset, max_queue_size, workers, use_threads=use_threads,
                                                        remote=remote, autoscale=autoscale)  # (from_samples' default)
        self.max_queue_size = max_queue_size
        self.start_method = start_method
        self.use_threads = use_threads
        self.timeout = timeout
        self.autoscale = autoscale
        self.remote = remote  # kpipe.RayWorkers(...): the workers are Ray actors
        self.stateful = _dataset_api.has_hooks(dataset)
        self._has_begin = _dataset_api.overrides(dataset, "on_epoch_begin")
        self.position = Position(num_batches, shuffle=shuffle, seed=seed, num_shards=num_shards, shard_index=shard_index,
                                 keyed_by_pass=keyed_by_pass, seed_given=seed_given)
        self.stats = {
            "batches": 0, "samples": 0, "bytes": 0, "last_batch_bytes": 0, "wait_s": 0.0,
            "pass_start_wait_s": 0.0, "first_batch_s": None, "restarts": 0, "loads": 0, "discards": 0, "passes": 0,
        }
        # (the window calls back weakly: no reference cycle keeps the reader, and so the
        # workers, alive once the loader is dropped -- reference counting frees them then)
        self.window = Window(self.position, self.stats, max_queue_size=max_queue_size, max_queue_bytes=max_queue_bytes,
                             workers=workers, next_key=_weakly(self.next_dispatch), before_submit=_weakly(self._before_submit),
                             small_batches=small)
        self.ahead = _ahead.LoadAhead(epoch_end_ahead, stateful=self.stateful, in_process=workers == 0 or use_threads,
                                      name=name, call_hooks=_dataset_api.call_pass_end_hooks,
                                      num_batches=_dataset_api.num_batches)
        self.closed = False
        # The consumer may call the dataset's hooks before it reads the head pass (Keras
        # >= 3.7 calls on_epoch_end before the first epoch; a pass end is followed by one):
        # a dataset with hooks loads nothing of that pass ahead until they ran, or until
        # the consumer reads it (see _hook_ran and the ProcessLoader docstring's hook rule).
        self._hooks_due = self.stateful
        # Where read-ahead stops: the key after the last one the consumer will read, when
        # Keras said so (its last epoch; the end of a Keras epoch of an infinite dataset
        # with hooks). None: no limit. Reads past it lift it.
        self._read_limit = None
        self._checker = _tree.StructureChecker(name)
        self._completed_before = None  # the pass that follows the last one completed here
        self._check_due = False  # a pass ended and no state check ran since (see check_state)
        self._unsent = _unsent.UnsentWatch(name)  # class/module state the workers cannot see: warned once
        self._auto_decisions = collections.deque(maxlen=_AUTO_DECISIONS_KEPT)
        self._t_created = time.perf_counter()
        self.start_backend()
        self.window.fill()

    @property
    def backend(self):
        return self.window.backend

    def set_timeout(self, timeout):
        """Seconds to wait for one batch from now on (None: no limit), also in the
        running backend."""
        self.timeout = timeout
        if self.backend is not None:
            self.backend.timeout = timeout

    # ------------------------------------------------------------------ reads
    def fetch(self, key, keep):
        """The batch at `key`: loaded (or taken from what a probe kept). `keep` keeps it
        queued for the next read of the same key."""
        self.ensure_backend()
        window = self.window
        if not keep:  # a real read: the consumer goes on (with the dataset as it is)
            if self.ahead.current is not None and key[0] >= self.ahead.current.pass_:  # before its real hooks ran
                self.cancel_ahead()
            if key[0] >= self.position.head[0]:
                self._hooks_due = False
            if self._read_limit is not None and key >= self._read_limit:
                self._read_limit = None
            if self._check_due and key[0] >= self.position.head[0]:  # a pass read without on_epoch_end
                self.check_state()
        entry = window.seek(key, probe=keep)
        if entry.batch is not None:
            batch = entry.batch
            if not keep:
                del window.queue[key]
                self.fill_after_read(key)
            return batch
        waited = self.stats["wait_s"]
        try:
            batch, treedef, meta = window.wait(key, entry)
        except BaseException:
            self.after_failure()
            raise
        finally:
            if key[1] == 0 and key[0] == self._completed_before:  # the start of the pass after one completed here
                self.stats["pass_start_wait_s"] += self.stats["wait_s"] - waited
        try:
            batch = self._checker.check(entry.index, treedef, meta, batch)  # (dtypes cast to batch 0's)
            self._account(meta)
        except BaseException:
            window.queue.pop(key, None)
            window.fill()
            raise
        if keep:
            entry.batch = batch
        else:
            del window.queue[key]
        self.fill_after_read(key)
        if self.autoscale is not None:
            self._maybe_autoscale()
        return batch

    def read(self, index):
        """`loader[index]` of a checked `index`: batch `index` of the head's pass; reading
        its last batch in order ends the pass."""
        position = self.position
        key, sequential = position.direct_key(index)
        batch = position.as_handed_out(key, self.fetch(key, keep=position.probing))
        if position.handed_out_direct(key, sequential):
            self.pass_completed()
        return batch

    def epoch_end_by_hand(self):
        """`loader.on_epoch_end()`: ends the pass if any of it was read, then runs the hook."""
        if self.position.pass_begun():
            self.pass_completed()
        self.run_hook("on_epoch_end")

    def fill_after_read(self, key=None):
        """Loads on after a read of `key` (or a pass end): see `Window.fill_after_read`."""
        after = _UNSET if key is None else self.position.successor(key, cross_passes=self._may_cross(key[0]))
        self.window.fill_after_read(after)

    def next_dispatch(self, after=_UNSET):
        """The next key to load: after the last queued one (or the head / the current
        read), at most one pass past the head, across a pass boundary only when the next
        pass's plan cannot change (no epoch hooks), nothing of the head's pass while the
        consumer may still call the dataset's hooks before reading it, and nothing at or
        after the read limit -- see the NOTE in _position.py and `_hooks_due`."""
        position, last = self.position, self.window.last_key()
        if last is None:
            key = position.read_position() if after is _UNSET else after
        else:
            key = position.successor(last, cross_passes=self._may_cross(last[0]))
            if key is None and self.begin_ahead(last):
                key = position.successor(last, cross_passes=True)
        if key is None or key[0] > position.read_ahead_limit():
            return None
        key = max(key, position.head)
        if self._read_limit is not None and key >= self._read_limit:
            return None
        current = self.ahead.current
        if self._hooks_due and not (current is not None and key[0] >= current.pass_):
            return None
        return key

    def _before_submit(self, key):
        current = self.ahead.current
        if current is not None and key[0] < current.pass_:  # the workers hold the next pass's state
            self.cancel_ahead()

    def _may_cross(self, pass_):
        """Whether batches of pass `pass_ + 1` may be loaded now (before `pass_` ends)."""
        current = self.ahead.current
        return not self.stateful or (current is not None and current.pass_ == pass_ + 1)

    def pass_completed(self):
        """The head's pass was read to its end (or ended early by `on_epoch_end`): new
        reads start the next pass, which keeps the dataset's length. With epoch hooks,
        nothing of it loads ahead until the consumer called them or reads it."""
        position = self.position
        position.complete_pass()
        self.stats["passes"] += 1
        self._maybe_suggest_ahead()
        head = position.head
        self._completed_before = head[0]
        self.window.drop_where(lambda k: k < head)
        self._check_due = True
        if self.stateful:
            self._hooks_due = True
        self.fill_after_read()

    def jump(self, pass_, position, num_batches, order=None):
        """Moves to `position` of pass `pass_` (set_epoch, restore; `order`: see Position.jump), dropping work in flight."""
        self._completed_before = None  # the next pass start is a (re)start, not a pass end
        self.cancel_ahead()
        self.ahead.tried = None
        self._read_limit = None
        self._hooks_due = self.stateful and position == 0
        self.window.drop_all()
        self.position.jump(pass_, position, num_batches, order)
        self.window.fill()

    # ------------------------------------------------------------------ epoch hooks
    def run_hook(self, name, fill=True, hold=False):
        """Runs the dataset's `name` ("on_epoch_begin"/"on_epoch_end") now, because its
        consumer called it, then brings the workers up to date (`_hook_ran`). `hold`: an
        `on_epoch_end` that another will follow before the head's pass is read (see
        `keras_epoch_end`): a dataset with hooks loads nothing ahead yet."""
        if name == "on_epoch_begin" or not self._has_begin:
            # the hooks due before the head's pass have run
            self._hooks_due = self.stateful and hold and name == "on_epoch_end"
        hook = getattr(self.dataset, name, None)
        if not _dataset_api.overrides(self.dataset, name):
            if callable(hook):
                hook()  # (PyDataset's no-op)
            if name == "on_epoch_end":
                self.check_state(fill=False)
            if fill:
                self.fill_after_read()
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
        n = _dataset_api.num_batches(self.dataset)
        current, position = self.ahead.current, self.position
        if current is not None and current.pass_ == position.head[0] and position.at_pass_start(None):
            if name == "on_epoch_end" and self._has_begin:
                current.real_hooks_ran = True  # compared once on_epoch_begin ran too
                return
            kept, dumped = self._keep_ahead(n)
            changed = not kept
        else:
            if current is not None:
                self.cancel_ahead()
            changed, dumped = self._state_changed(n)
        self._check_due = False
        if changed:
            self.window.drop_all()
            position.set_length(n)
            self._reset_target(dumped)
        if fill:
            self.fill_after_read()

    def check_state(self, fill=True):
        """Between passes, outside any hook (`on_epoch_end` of a dataset without one, or the
        first read of a pass no `on_epoch_end` preceded): what the dataset holds now reaches
        the workers if it changed since they got it (`ds.offset = 100` between passes; an
        array edited in place) -- batches loaded ahead under the old state are dropped.
        One `dump` of the dataset per pass (what it costs: docs/loader-in-depth.md, "What the fast paths
        assume"). Threads and `workers=0` share the dataset: nothing to send."""
        self._check_due = False
        backend = self.backend
        if backend is None or not backend.keeps_copy or backend.closed or self.ahead.current is not None:
            return
        self._hook_ran("on_epoch_end", fill)
    def _state_changed(self, n):
        """Whether the workers' copy of the dataset is stale now (with a fresh pickle of
        it, or None where the backend holds no pickle)."""
        backend = self.backend
        if backend is None or not backend.keeps_copy or backend.closed:
            return True, None
        self._unsent.check(self.dataset, _pickling.by_value_modules(self.dataset))
        payload, keys = backend.current_state()
        new_payload, new_keys, rewrote = backend.dump(self.dataset)
        same_shape = (not rewrote and payload is not None and new_keys == keys
                      and n == self.position.dataset_length(self.position.next_unread_pass()))
        if not same_shape or new_payload == payload:
            return not same_shape, (new_payload, new_keys)
        # other bytes can hold the same state (a class pickled by value: state_fingerprint),
        # taken once: the new state's, if it is sent
        fingerprint = backend.fingerprint(self.dataset)
        return not backend.same_state(fingerprint), (new_payload, new_keys, fingerprint)

    def _reset_target(self, dumped=None, target=_UNSET):
        """Gives the workers the dataset's state (or `target`: None with `dumped`, the
        state they held before). A pool whose workers' state is unknown after a failure
        is closed: the next read starts a new one from the dataset."""
        backend = self.backend
        if backend is None or backend.closed:
            return
        try:
            backend.reset_target(self.dataset if target is _UNSET else target, dumped=dumped)
        except BaseException:
            backend.close(force=True)
            self.after_failure()
            raise

    def _maybe_suggest_ahead(self):
        """Once per loader, at INFO: the consumer spent a noticeable share of its time
        waiting at the starts of passes that the dataset's own hook held back."""
        st, backend = self.stats, self.backend
        if not self.stateful or st["first_batch_s"] is None or backend is None or not backend.can_send_state:
            return
        self.ahead.maybe_suggest(st, time.perf_counter() - self._t_created - st["first_batch_s"])

    # ------------------------------------------ epoch_end_ahead (kpipe/_engine/_ahead.py)
    def begin_ahead(self, last):
        """`last`, the final batch of the head's pass, was sent to the workers: runs the
        hooks on a copy and sends its state, so the next pass loads now. Returns True if
        it did."""
        backend, position, pass_ = self.backend, self.position, last[0]
        if (
            not self.ahead.may_try(pass_) or pass_ != position.head[0] or pass_ + 1 > position.read_ahead_limit()
            or (self._read_limit is not None and (pass_ + 1, 0) >= self._read_limit)
            or backend is None or not backend.can_send_state or backend.closed
        ):
            return False
        current = self.ahead.start(pass_ + 1, backend)
        if current is None:
            return False
        position.record_length(pass_ + 1, current.num_batches)
        try:
            backend.send_state(current.payload, current.keys)
        except BaseException:  # e.g. Ctrl-C: some workers may hold the copy's state
            self.cancel_ahead()
            raise
        return True

    def _keep_ahead(self, n):
        """At a pass end, after the real hooks: whether the batches loaded ahead stand
        (the dataset pickles to the copy's bytes). Returns `(kept, dumped)`: if not
        kept, the caller sends the workers the dataset's state -- `dumped`, the pickle
        made here, or None (not pickled yet)."""
        current, self.ahead.current = self.ahead.current, None
        backend = self.backend
        if current is None or current.pass_ != self.position.head[0] or backend is None or backend.closed:
            return False, None
        payload, keys, rewrote = backend.dump(self.dataset)
        if self.ahead.kept(current, payload, keys, rewrote, n, shared=backend.shared):
            return True, None
        return False, (payload, keys)  # (the caller records the pass's real length)

    def cancel_ahead(self):
        """Drops the batches loaded ahead and gives the workers back the state they had
        (something reads or loads the current pass again, or jumps). Never leaves a pool
        whose workers' state is unknown: one that could not be told is closed (the next
        read starts a new one from the dataset)."""
        current = self.forget_ahead()
        if current is None:
            return
        self.window.drop_where(lambda k: k[0] >= current.pass_)
        if current.real_hooks_ran:  # the dataset's own hook ran since: the workers need its state
            self._reset_target()
            self.position.set_length(_dataset_api.num_batches(self.dataset))
        else:
            self._reset_target((current.prev_payload, current.prev_keys), target=None)

    def forget_ahead(self):
        current, self.ahead.current = self.ahead.current, None
        if current is not None:
            self.position.forget_length(current.pass_)
        return current

    # ------------------------------------------------------------------ backend
    def start_backend(self):
        common = dict(mode="dataset", name=self.name)
        if self.remote is not None:
            backend = RayBackend(self.dataset, workers=self.remote, timeout=self.timeout, seed=self.position.seed, name=self.name,
                                 num_workers=self.num_workers, worker_threads=self.worker_threads,
                                 max_workers=self.autoscale.ceiling if self.autoscale else None)
        elif self.num_workers == 0:
            backend = InlineBackend(self.dataset, **common)
        elif self.use_threads:
            backend = ThreadBackend(self.dataset, num_workers=self.num_workers, timeout=self.timeout, seed=self.position.seed, **common)
        else:
            auto = self.autoscale
            backend = ProcessBackend(
                self.dataset,
                num_workers=self.num_workers,
                start_method=self.start_method,
                timeout=self.timeout,
                seed=self.position.seed,
                keep_idle=self.window.ceiling() + (auto.max_workers if auto else self.num_workers),  # (Window.ceiling)
                max_workers=auto.max_workers if auto else None,
                keep_payload=True,  # compared with the dataset at each pass end (check_state, _hook_ran)
                worker_threads=self.worker_threads,
                **common,
            )
        self.window.backend = backend
        if self.autoscale is not None and backend.can_resize:
            self.autoscale.fit_to(backend)  # (workers on other machines: the cluster's CPUs)
            self.autoscale.reset()
            self._maybe_autoscale()  # the first window opens as the workers start

    def ensure_backend(self):
        if self.closed:
            raise LoaderClosedError(f"This ProcessLoader of `{self.name}` was closed; create a new one.")
        self.after_failure()  # e.g. Ctrl-C mid-send closed it
        if self.backend is None:  # a fatal failure stopped the previous workers
            self.stats["restarts"] += 1
            self.start_backend()
        return self.backend

    def after_failure(self):
        """Forgets a backend that a failure closed (the next read starts a new one)."""
        if self.backend is not None and self.backend.closed:
            self.window.backend = None
            self.window.forget()
            self.forget_ahead()

    def close(self):
        self.closed = True
        backend, self.window.backend = self.backend, None
        self.window.forget()
        if backend is not None:
            backend.close()

    def _maybe_autoscale(self):
        """Feeds the worker-count controller its counters; starts or retires workers as it
        decides (see `AutoscaleDriver`)."""
        backend = self.backend
        if backend is None or not backend.can_resize or backend.closed:
            return
        record = self.autoscale.tick(backend, consumed=self.stats["batches"], wait_s=self.stats["wait_s"],
                                     t0=self._t_created, name=self.name)
        if record is None:
            return
        self._auto_decisions.append(record)
        if backend.closed:
            return
        self.num_workers = backend.num_workers
        self.window.set_workers(self.num_workers)
        self.window.fill()

    # ------------------------------------------------------------------ counters
    def _account(self, meta):
        st = self.stats
        st["batches"] += 1
        if meta and len(meta[0][1]):
            st["samples"] += int(meta[0][1][0])
        nbytes = sum(math.prod(s) * as_dtype(d).itemsize for d, s in meta)
        st["bytes"] += nbytes
        st["last_batch_bytes"] = nbytes
        if st["first_batch_s"] is None:
            st["first_batch_s"] = time.perf_counter() - self._t_created

    def stats_dict(self):
        """`ProcessLoader.stats()`."""
        out = dict(self.stats)
        out["queue_depth"] = self.window.limit()
        out["workers"] = self.num_workers
        backend = self.backend
        live = backend is not None and not backend.closed
        out["pids"] = list(backend.pids) if backend is not None else []
        out["worker_threads"] = backend.worker_threads if live else None
        out["worker_thread_pools"] = backend.thread_pools() if live else []
        if self.ahead.requested:
            out["ahead"] = dict(self.ahead.stats)
        if self.autoscale is not None:
            out["cpu_limit"] = self.autoscale.cpu_limit
            out["max_workers"] = self.autoscale.max_workers
            out["auto_decisions"] = list(self._auto_decisions)
        return out

    def queue_depth(self):
        """Batches requested and not handed out yet, read without the lock (the profiler
        calls it while a stream holds the lock waiting for a worker)."""
        st = self.stats
        return max(0, st["loads"] - st["batches"] - st["discards"])

    # ------------------------------------------------- the stream protocol (_stream.py)
    @_locked
    def open_stream(self, hooks=None, consumer=None, confirm=False):
        """A stream over the rest of the head's pass. `hooks`: "keras" (Keras's adapter
        passes its epoch calls on, `consumer` records the stream) or "iteration" (the
        stream's start and end run the dataset's hooks: `as_dataset()`). `confirm`: the
        consumer's epoch end completes the pass (a `tf.data` reader runs ahead of Keras;
        see the NOTE in kpipe/_engine/_position.py)."""
        stream = self.position.open_stream(hooks=hooks, confirm=confirm)
        if consumer is not None and not stream.probe:
            consumer.stream, consumer.consumed, consumer.taken = stream, 0, 0
        return stream

    @_locked
    def stream_next(self, stream):
        """The next batch of `stream`, None when its pass has ended, or `AT_LIMIT`."""
        position = self.position
        if stream.hooks == "iteration" and not stream.began and stream.live:
            stream.began = True
            if position.at_pass_start(None) and stream.base == position.head:
                self.run_hook("on_epoch_begin")
        key = position.next_key(stream)
        if key is None or (stream.probe and not self._probe_may_load(key)):
            if stream.hooks == "iteration" and not stream.ended and position.stream_at_pass_end(stream):
                stream.ended = True
                self.run_hook("on_epoch_end")
            return None
        if stream.resume is not None and self._read_limit is not None and key >= self._read_limit:
            stream.resume.clear()
            return _stream.AT_LIMIT
        batch = position.as_handed_out(key, self.fetch(key, keep=stream.probe))
        if position.handed_out(stream, key):
            if stream.confirm:
                stream.pending = True  # until the consumer's epoch end took it
            else:
                self.pass_completed()
        return batch

    @_locked
    def keras_epoch_begin(self, consumer, *, steps=None, left=None, probe=False):
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
        position = self.position
        stream, consumed = consumer.stream, consumer.epoch_start()
        n = position.length_of(position.head[0])
        finite = n is not None
        if not finite or position.at_pass_start(stream, consumed):
            self.run_hook("on_epoch_begin", fill=probe)
        if probe:
            return
        start = position.stream_position(stream, consumed)
        if left is not None and finite and steps is not None and consumer.each_a_call and steps < n:
            left = 1  # every epoch a call (validation) that starts the pass again: none reads past its steps
        limit = None
        if left is not None and (left == 1 or not self.stateful):
            limit = start
            for _ in range(left):
                if not finite:
                    limit = position.walk(limit, steps) if steps is not None else None
                elif steps is None:
                    limit = (limit[0] + 1, 0)
                else:
                    limit = min(position.walk(limit, steps), (limit[0] + 1, 0))
                if limit is None:
                    break
            if finite and steps is not None and not _compat.keras_at_least(_compat.KERAS_EPOCH_ITERATOR_RESET):
                limit = min(limit, (start[0] + 1, 0))  # Keras < 3.7 stops where the pass ends
        elif not finite and steps is not None and self.stateful:
            limit = position.walk(start, steps)
        self._set_read_limit(limit)
        if stream is not None and stream.resume is not None:
            stream.resume.set()  # a stream waiting at the old limit goes on

    @_locked
    def iteration_begin(self, left):
        """An `as_dataset(epochs=...)` iteration starts, `left` of them (this one included)
        to go: read-ahead stops where the last one's pass ends (for a dataset with hooks,
        whose next passes may change, only once this is the last). An iteration past the
        last counts as the last again."""
        position = self.position
        if position.length_of(position.head[0]) is None:
            return
        left = max(left, 1)
        if left == 1 or not self.stateful:
            self._set_read_limit((position.head[0] + left, 0))

    def _set_read_limit(self, limit):
        """Read-ahead stops before `limit` (None: no limit); queued batches at or after
        it are dropped, and a stream waiting at the old limit goes on."""
        self._read_limit = limit
        if limit is not None:
            self.window.drop_where(lambda k: k >= limit)
        self.fill_after_read()

    @_locked
    def demand(self, consumer):
        """The reader of `consumer`'s stream waits at the read limit while Keras asks for
        a batch: the limit was Keras's plan, and Keras reads on -- lift it."""
        self._read_limit = None
        stream = consumer.stream
        if stream is not None and stream.resume is not None:
            stream.resume.set()
        self.window.fill()

    @_locked
    def keras_epoch_end(self, consumer):
        """Keras ended an epoch of the consumer: runs the dataset's `on_epoch_end`, unless
        the epoch ended inside a pass of a finite dataset (`steps_per_epoch < len`). When
        the epoch ends the consumer's Keras call (the last of `fit`, an `evaluate`, a
        validation run), Keras >= 3.7 starts the next call with another `on_epoch_end`
        (its reset) before `on_epoch_begin`: a dataset with hooks loads nothing ahead
        until then, as the reset may change it again (a reshuffle: all reloaded)."""
        position = self.position
        taken = consumer.end_epoch()
        stream = consumer.stream
        if stream is not None and stream.pending and position.stream_at_pass_end(stream, taken):
            stream.pending = False
            if stream.base[0] == position.head[0]:
                self.pass_completed()
        if position.length_of(position.head[0]) is None or position.at_pass_start(consumer.stream, taken):
            hold = consumer.ends_call and _compat.keras_at_least(_compat.KERAS_EPOCH_ITERATOR_RESET)
            self.run_hook("on_epoch_end", hold=hold)  # hold: until on_epoch_begin or a read

    @_locked
    def keras_reset(self, consumer):
        """Keras dropped the consumer's iterator (`EpochIterator.reset`, Keras >= 3.7): its
        stream ends, and the next one starts the head's pass again."""
        stream, consumer.stream = consumer.stream, None
        if stream is not None:
            stream.live = False

    @_locked
    def peek(self, index):
        """Batch `index` after the head, for a probe (Keras's tensor spec): moves nothing,
        and the batch is kept for the read that consumes it."""
        return self.fetch(self.position.walk(self.position.head, index), keep=True)

    @contextlib.contextmanager
    def probe(self):
        """Reads in this context consume nothing (Keras's symbolic build, its spec reads)."""
        with self.lock:
            self.position.begin_probe()
        try:
            yield
        finally:
            with self.lock:
                self.position.end_probe()

    @_locked
    def probing(self):
        return self.position.probing

    def _probe_may_load(self, key):
        """A probe reads at most a queue's worth past the head (Keras needs one batch)."""
        return self.position.walk(self.position.head, self.max_queue_size) > key

    @_locked
    def state_after(self, origin, consumed):
        """The state `consumed` batches after `origin` (for BackupAndRestore)."""
        return self.position.state_at(self.position.walk(origin, consumed))

    @_locked
    def head(self):
        return self.position.head

