"""The Ray actor behind `kpipe.RayWorkers`: one loader worker on a Ray node (the NOTE in
`_ray.py`). Runs where Ray places it: imports kpipe and the dataset's modules, never
TensorFlow on kpipe's account."""

import os
import random
import time

from kpipe._engine import _pickling, _threads, _tree
from kpipe._engine import worker_info as _wi
from kpipe.errors import LoaderError


class Loader:
    """The actor: one loader worker (see the NOTE in `_ray.py`)."""

    def __init__(self, payload, worker_id, num_workers, seed, threads, sys_path):
        import sys

        for path in reversed(sys_path):  # the driver's import paths that exist on this node
            if path not in sys.path and os.path.isdir(path):
                sys.path.insert(0, path)
        from kpipe._engine._worker import _RunQueueClock

        self.runq = _RunQueueClock()  # seconds spent waiting for a CPU (actors may share CPUs)
        self.pools = _threads.PoolLimiter()
        if threads is not None:
            self.pools.set_env(threads)
        self.target, self.error = _pickling.loads(payload, {}), None
        self.arenas = []  # kpipe.empty's buffers for batches that go through the object store, one per batch of a call
        self.slots, self.free = [], []  # batches for a consumer on this node: shared-memory slots, free ones
        self.pinned = set()  # slots the dataset kept memory of
        self.arena_allocs = {}  # arena index -> its allocator in the last call, checked at the next one
        if threads is not None:
            self.pools.apply(threads)
        info = _wi.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, pid=os.getpid())
        _wi._set(info)
        random.seed(seed)
        _seed_numpy(seed)

    def ready(self):
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id(), self.pools.report

    def set_target(self, payload):
        try:
            self.target, self.error = _pickling.loads(payload, {}), None
        except BaseException as exc:  # sent without a wait (send_state): the next load raises it
            self.target, self.error = None, exc
            raise
        return True

    def load_many(self, items, released=(), local=False):
        """Loads the batches `items` (`[(key, seed), ...]`, in order) and returns
        `(outcomes, pools)`: per item `("ok", (treedef, leaves, timings, slot))` or
        `("error", packed exception)` -- one batch's exception does not stop the others;
        `timings` = (wall, CPU, run-queue) seconds.
        `released`: slots the consumer let go of since the last call. `local`: the consumer
        is on this node -- each batch goes into a shared-memory slot and only its place
        travels (`leaves` None, `slot` = (slot, fd, pid, layout)); else the arrays go
        through the object store (`slot` None). `pools`: what the thread budget set, when
        the dataset imported a library with a pool of its own (else None)."""
        from kpipe._engine._worker import TaskError, pack_exception

        for slot in released:
            if slot in self.pinned:  # never reused: closed here (the dataset's arrays keep its pages)
                self.slots[slot].close()
            else:
                self.free.append(slot)
        for j, alloc in self.arena_allocs.items():  # the batches Ray took last call are gone by now
            if alloc.kept():
                self.arenas[j] = None  # the dataset kept memory of this arena: a new one (NOTE in _alloc.py)
        self.arena_allocs = {}
        outcomes = []
        for j, (key, seed) in enumerate(items):
            try:
                outcomes.append(("ok", self._load(j, key, seed, local)))
            except TaskError as failed:
                outcomes.append(("error", failed.packed))
            except Exception as exc:  # SystemExit/KeyboardInterrupt end the actor
                outcomes.append(("error", pack_exception(exc)))
        return outcomes, self.pools.refresh()  # (the dataset may have imported a library with a pool)

    def _load(self, j, key, seed, local):
        """Loads batch `key`, the `j`-th of this call (see `load_many`)."""
        from kpipe._engine import _alloc, _shm
        from kpipe._engine._worker import TaskError, pack_exception

        if self.error is not None:
            raise LoaderError(f"This Ray actor could not take the dataset's new state: {type(self.error).__name__}: "
                              f"{self.error}") from self.error
        t0, cpu0, q0 = time.perf_counter(), time.process_time(), self.runq()
        if seed is not None:  # this batch's randomness: see worker_info.batch_seed
            random.seed(seed)
            _seed_numpy(seed)
        if local:
            if not self.free:
                self.free.append(len(self.slots))
                self.slots.append(_shm.Segment.create(0, name="kpipe-ray-slot"))
            slot = self.free.pop()
            segment = self.slots[slot]
        else:
            while len(self.arenas) <= j:
                self.arenas.append(None)
            if self.arenas[j] is None:
                self.arenas[j] = _shm.Segment.create(0, name="kpipe-ray-arena")
            # one per batch of a call, reused from call to call: Ray copies the results when
            # the call returns, before the next call
            segment = self.arenas[j]
        alloc = _alloc.begin(segment)  # kpipe.empty and big np.stack results: views of `segment`
        try:
            with _alloc.stacking_into():
                out = self.target[key]
        except Exception as exc:
            packed = pack_exception(exc)
        except BaseException:  # SystemExit/KeyboardInterrupt end the actor
            if local:
                self.free.append(slot)
            raise
        else:
            packed = None
        finally:
            _alloc.end()
        if packed is not None:  # (the exception and its frames are gone: what still holds the slot, the dataset kept)
            pinned = local and alloc.keep_apart()  # a cache filled before the exception: never reused (NOTE in _alloc.py)
            if pinned:
                self.pinned.add(slot)
                self.slots[slot].close()
            elif local:
                self.free.append(slot)
            raise TaskError(packed, pinned)
        treedef, leaves, _ = _tree.flatten(out)
        if not local:
            self.arena_allocs[j] = alloc
            return treedef, leaves, (time.perf_counter() - t0, time.process_time() - cpu0, self.runq() - q0), None
        layout = alloc.place(leaves)
        del out, leaves
        if alloc.keep_apart():  # the dataset kept memory of this slot: it is never reused (NOTE in _alloc.py)
            self.pinned.add(slot)
        return (treedef, None, (time.perf_counter() - t0, time.process_time() - cpu0, self.runq() - q0),
                (slot, segment.fd, os.getpid(), layout))


def _seed_numpy(seed):
    import numpy as np

    np.random.seed(seed)

