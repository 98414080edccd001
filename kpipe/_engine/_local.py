"""Backends that load in this process (see the protocol in `_backend.py`): a thread pool
for I/O-bound work that releases the GIL (`use_threads=True`), and the calling thread
(`workers=0`). Both share the target object with their owner and hand batches over as
they are (validated as a worker's would be), without shared memory."""

import concurrent.futures
import itertools
import os
import threading
import time
import weakref

from kpipe._engine import _tree, _wire
from kpipe._engine._shm import dtype_token
from kpipe._engine import worker_info as _wi
from kpipe._engine._backend import Backend
from kpipe.errors import BatchTimeoutError, LoaderClosedError


class ThreadBackend(Backend):
    """Runs `target[key]` in a thread pool: for I/O-bound work that releases the GIL. Shares
    the target with this process (`keeps_copy` False) and has no slots."""

    def __init__(self, target, *, num_workers, mode, timeout, seed, name):
        self.name = name
        self.timeout = timeout
        self._target = target
        self._mode = mode
        ids = itertools.count()
        lock = threading.Lock()

        def init():
            with lock:
                wid = next(ids)
            _wi._set_thread(
                _wi.WorkerInfo(id=wid, num_workers=num_workers, seed=_wi.derive_seed(seed, wid), pid=os.getpid(), mode="thread")
            )

        self._pool = concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="kpipe", initializer=init)
        self._num_workers = num_workers
        self._futures = {}
        self._seq = itertools.count()
        self.closed = False
        self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)

    @property
    def num_workers(self):
        return self._num_workers

    def _run(self, key, inputs):
        return _in_process_result(self._target[key] if self._mode == "dataset" else self._target(inputs))

    def submit(self, key, inputs=None, seed=None):  # threads share the process's RNGs: no reseeding
        if self.closed:
            raise LoaderClosedError(f"The thread pool of `{self.name}` is closed.")
        seq = next(self._seq)
        self._futures[seq] = (key, self._pool.submit(self._run, key, inputs))
        return seq

    def get(self, seq, on_starved=None):
        key, fut = self._futures.pop(seq)
        deadline = _wire.deadline_after(self.timeout)  # None: no limit
        while on_starved is not None and not fut.done():
            # Wake at each completion: has a thread run out of work while `fut` loads?
            others = [f for _, f in self._futures.values() if not f.done()]
            concurrent.futures.wait([fut] + others, _wire.remaining(deadline), concurrent.futures.FIRST_COMPLETED)
            if deadline is not None and time.monotonic() >= deadline:
                break
            if not fut.done() and 1 + sum(not f.done() for _, f in self._futures.values()) < self._num_workers:
                if not on_starved():
                    on_starved = None
        try:
            return fut.result(timeout=_wire.remaining(deadline))
        except concurrent.futures.TimeoutError:
            self.close()
            raise BatchTimeoutError(
                f"Batch {key} of `{self.name}` did not arrive within timeout={self.timeout} s from its "
                "worker thread. Raise `timeout` if batches are this slow, or look for a hang in "
                "__getitem__. (A thread cannot be stopped: it ends when its call returns.)"
            ) from None
        except Exception as exc:
            _add_note(exc, f"[kpipe] raised in a worker thread while loading batch {key} of `{self.name}`.")
            exc.kpipe_batch_index = key
            raise

    def discard(self, seq):
        item = self._futures.pop(seq, None)
        if item is not None:
            item[1].cancel()

    def reset_target(self, target, dumped=None):  # threads share the object: nothing to pickle
        for seq in list(self._futures):
            self.discard(seq)
        self._target = target

    def close(self, force=False):
        self.closed = True
        self._finalizer()


class InlineBackend(Backend):
    """Runs `target[key]` in the calling thread when the result is asked for (`workers=0`)."""

    def __init__(self, target, *, mode, name):
        self.name = name
        self._target = target
        self._mode = mode
        self._todo = {}
        self._seq = itertools.count()
        self.closed = False

    num_workers = 0

    def submit(self, key, inputs=None, seed=None):  # the calling thread's RNGs stay the user's
        if self.closed:
            raise LoaderClosedError(f"The loader of `{self.name}` is closed.")
        seq = next(self._seq)
        self._todo[seq] = (key, inputs)
        return seq

    def get(self, seq, on_starved=None):
        key, inputs = self._todo.pop(seq)
        try:
            out = self._target[key] if self._mode == "dataset" else self._target(inputs)
        except Exception as exc:
            _add_note(exc, f"[kpipe] raised while loading batch {key} of `{self.name}`.")
            exc.kpipe_batch_index = key
            raise
        return _in_process_result(out)

    def discard(self, seq):
        self._todo.pop(seq, None)

    def reset_target(self, target, dumped=None):
        self._todo.clear()
        self._target = target

    def close(self, force=False):
        self.closed = True


def _in_process_result(out):
    """`(tree, treedef, meta)` for a batch made in this process (threads, inline): the same
    validation and leaf conversion as a worker's, without shared memory."""
    treedef, leaves, _ = _tree.flatten(out)
    return _tree.unflatten(treedef, leaves), treedef, [(dtype_token(a.dtype), a.shape) for a in leaves]


def _add_note(exc, note):
    if hasattr(exc, "add_note"):
        exc.add_note(note)
