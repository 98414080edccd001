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
        self.pools = _threads.PoolLimiter()
        if threads is not None:
            self.pools.set_env(threads)
        self.target, self.error = _pickling.loads(payload, {}), None
        self.arena = None  # kpipe.empty's buffer for batches that go through the object store
        self.slots, self.free = [], []  # batches for a consumer on this node: shared-memory slots, free ones
        self.pinned = set()  # slots the dataset kept memory of
        self.arena_alloc = None  # the arena's allocator of the last task, checked at the next one
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

    def load(self, key, seed, released=(), local=False):
        """Loads batch `key`. `released`: slots the consumer let go of since the last call.
        `local`: the consumer is on this node -- the batch goes into a shared-memory slot
        and only its place travels: `(treedef, None, timings, pools, (slot, fd, pid,
        layout))`; else the arrays go through the object store: `(treedef, leaves,
        timings, pools, None)`."""
        from kpipe._engine import _alloc, _shm

        for slot in released:
            if slot in self.pinned:  # never reused: closed here (the dataset's arrays keep its pages)
                self.slots[slot].close()
            else:
                self.free.append(slot)
        if self.arena_alloc is not None and self.arena_alloc.kept():  # the last batch Ray took is gone by now
            self.arena = None  # the dataset kept memory of the arena: a new one (NOTE in _alloc.py)
        self.arena_alloc = None
        if self.error is not None:
            raise LoaderError(f"This Ray actor could not take the dataset's new state: {type(self.error).__name__}: "
                              f"{self.error}") from self.error
        t0, cpu0 = time.perf_counter(), time.process_time()
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
            if self.arena is None:
                self.arena = _shm.Segment.create(0, name="kpipe-ray-arena")
            segment = self.arena  # reused from task to task: Ray copies the result before the next one
        alloc = _alloc.begin(segment)  # kpipe.empty and big np.stack results: views of `segment`
        try:
            with _alloc.stacking_into():
                out = self.target[key]
        except BaseException:
            if local:
                self.free.append(slot)
            raise
        finally:
            _alloc.end()
        treedef, leaves, _ = _tree.flatten(out)
        pools = self.pools.refresh()  # the dataset imported a library with a pool of its own
        if not local:
            self.arena_alloc = alloc
            return treedef, leaves, (time.perf_counter() - t0, time.process_time() - cpu0), pools, None
        layout = alloc.place(leaves)
        del out, leaves
        if alloc.kept():  # the dataset kept memory of this slot: it is never reused (NOTE in _alloc.py)
            self.pinned.add(slot)
        return (treedef, None, (time.perf_counter() - t0, time.process_time() - cpu0), pools,
                (slot, segment.fd, os.getpid(), layout))


def _seed_numpy(seed):
    import numpy as np

    np.random.seed(seed)
