"""A loader's workers as Ray actors: `ProcessLoader(dataset, workers=kpipe.RayWorkers(n, ...))`.

NOTE [ Loader workers on a Ray cluster ]
----------------------------------------
When one machine's cores cannot feed its accelerators, the Python work of a `PyDataset`
(h5py reads, decoding, NumPy augmentation) can run on other machines' CPUs. Ray runs
arbitrary Python there; kpipe keeps its guarantees in the loader (`Position`, `Window`, the
epoch-hook rule), so only the backend changes (the protocol in `_backend.py`):

    main: RayBackend.submit(index, seed) -> actor.load.remote(index, seed)   (ObjectRef)
    actor: reseed random/numpy.random from the batch's seed (as a process worker does);
           batch = dataset[index]; returned with its timings
    main: RayBackend.get(seq) -> ray.get(ref): NumPy arrays backed by the object store --
           no copy on the trainer's node; Ray's transfer from other nodes (what travels
           matters there: uint8 before a float conversion is 4x fewer bytes)

* The dataset goes to the actors once, through the object store (`ray.put` of kpipe's
  pickle: classes from `__main__`/notebooks by value, Keras's `PyDataset` base swapped for
  a TensorFlow-free stand-in, as for process workers), and again after a hook changed it.
  An actor runs one task at a time, in the order it got them, so a new state sent behind
  its tasks applies to the tasks submitted after it.
* Placement: `num_cpus` per actor and `resources` (a custom resource the CPU-only
  preprocessing nodes were started with: `ray start --resources='{"preprocess": 8}'`);
  actors that cannot be placed within `timeout` are a named error, never a hang.
* Faults: an actor (or its node) lost while loading is replaced -- a new actor with the
  same id and the current state -- and its pending batches are loaded again there, in
  order: batches are pure functions of (dataset state, index, seed), so every batch is
  delivered once, the same as it would have been. An exception in `__getitem__` is raised
  in the main process with its type and the remote traceback, as from a process worker.
* Lifetime: actors are killed on `close()`, when the loader is dropped, or at exit. With
  no `address` (and no `RAY_ADDRESS`), kpipe starts a local Ray instance and shuts it down
  with the last loader that used it; a cluster it connected to is left running.
"""

import dataclasses
import itertools
import os
import random
import sys
import threading
import time
import weakref
from typing import Optional

from kpipe._engine import _pickling, _threads, _tree
from kpipe._engine import worker_info as _wi
from kpipe._engine._backend import Backend
from kpipe.errors import BatchTimeoutError, LoaderClosedError, LoaderError, WorkerDiedError

_CONNECT_LOCK = threading.Lock()
_STARTED = {"count": 0, "by_kpipe": False}  # loaders using a Ray instance kpipe started
_MAX_REPLACEMENTS = 8  # actors replaced in a row without a batch delivered: the cluster is failing


@dataclasses.dataclass(frozen=True)
class RayWorkers:
    """Loader workers as Ray actors, for `ProcessLoader(dataset, workers=RayWorkers(...))`.

    Args:
        count: Actors loading batches.
        address: The Ray cluster to connect to (`"auto"`, `"ray://host:10001"`, ...).
            Defaults to None: `RAY_ADDRESS` if set, else a local Ray instance that kpipe
            starts for the loader and shuts down with the last loader using it.
        num_cpus: CPUs each actor reserves. Defaults to 1.
        resources: Custom resources each actor needs, e.g. `{"preprocess": 1}` to place
            actors only on nodes started with that resource. Defaults to None.

    Example (a local Ray instance; needs `pip install "kpipe[ray]"`):

        loader = kpipe.ProcessLoader(Images(...), workers=kpipe.RayWorkers(16, resources={"preprocess": 1}))
    """

    count: int
    address: Optional[str] = None
    num_cpus: float = 1
    resources: Optional[dict] = None

    def __post_init__(self):
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"`count` must be an int >= 1 (actors). Received: count={self.count!r}.")
        if not isinstance(self.num_cpus, (int, float)) or isinstance(self.num_cpus, bool) or self.num_cpus < 0:
            raise ValueError(f"`num_cpus` must be a number >= 0. Received: num_cpus={self.num_cpus!r}.")
        if self.resources is not None and (not isinstance(self.resources, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and v > 0 for k, v in self.resources.items())):
            raise ValueError(f"`resources` must map resource names to positive amounts, e.g. {{'preprocess': 1}}. "
                             f"Received: resources={self.resources!r}.")


def _ray():
    try:
        import ray
    except ImportError:
        raise LoaderError("RayWorkers needs Ray: pip install 'kpipe[ray]' (or `pip install ray`).") from None
    return ray


def connect(address, timeout):
    """Connects this process to Ray (or starts a local instance). Returns whether kpipe
    started it (then `disconnect` shuts it down with its last user)."""
    ray = _ray()
    with _CONNECT_LOCK:
        if ray.is_initialized():
            if _STARTED["by_kpipe"]:
                _STARTED["count"] += 1
            return _STARTED["by_kpipe"]
        address = address or os.environ.get("RAY_ADDRESS")
        try:
            if address:
                ray.init(address=address, logging_level="WARNING", log_to_driver=False)
            else:
                ray.init(logging_level="WARNING", log_to_driver=False, include_dashboard=False)
        except Exception as exc:
            where = f"the Ray cluster at address={address!r}" if address else "a local Ray instance"
            raise LoaderError(f"Could not connect to {where}: {type(exc).__name__}: {exc}. Start it "
                              "(`ray start --head` on the trainer host) or pass RayWorkers(address=...).") from exc
        _STARTED["by_kpipe"] = not address
        _STARTED["count"] = 1 if not address else 0
        return _STARTED["by_kpipe"]


def disconnect(started):
    if not started:
        return
    ray = _ray()
    with _CONNECT_LOCK:
        _STARTED["count"] -= 1
        if _STARTED["count"] <= 0 and _STARTED["by_kpipe"] and ray.is_initialized():
            ray.shutdown()
            _STARTED["by_kpipe"] = False


class _Loader:
    """The actor: one loader worker (see the NOTE)."""

    def __init__(self, payload, worker_id, num_workers, seed, threads, sys_path):
        import sys

        for path in reversed(sys_path):  # the driver's import paths that exist on this node
            if path not in sys.path and os.path.isdir(path):
                sys.path.insert(0, path)
        self.pools = _threads.PoolLimiter()
        if threads is not None:
            self.pools.set_env(threads)
        self.target = _pickling.loads(payload, {})
        if threads is not None:
            self.pools.apply(threads)
        info = _wi.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, pid=os.getpid())
        _wi._set(info)
        random.seed(seed)
        _seed_numpy(seed)

    def ready(self):
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()

    def set_target(self, payload):
        self.target = _pickling.loads(payload, {})
        return True

    def load(self, key, seed):
        t0, cpu0 = time.perf_counter(), time.process_time()
        if seed is not None:  # this batch's randomness: see worker_info.batch_seed
            random.seed(seed)
            _seed_numpy(seed)
        out = self.target[key]
        treedef, leaves, _ = _tree.flatten(out)
        return treedef, leaves, (time.perf_counter() - t0, time.process_time() - cpu0)


def _seed_numpy(seed):
    import numpy as np

    np.random.seed(seed)


class _Actor:
    __slots__ = ("id", "handle", "pid", "node", "pending", "last_task")

    def __init__(self, wid, handle):
        self.id, self.handle = wid, handle
        self.pid = self.node = None
        self.pending = []  # seqs, in the order sent
        self.last_task = -1


class RayBackend(Backend):
    """Runs `target[key]` in Ray actors (see the NOTE). Used from one thread at a time."""

    keeps_copy = True

    def __init__(self, target, *, workers, timeout, seed, name):
        self.name = name
        self.timeout = timeout
        self.closed = False
        self._spec = workers
        self._seed = seed
        self._started = connect(workers.address, timeout)
        ray = _ray()
        self._remote = ray.remote(_Loader).options(num_cpus=workers.num_cpus, resources=workers.resources or None,
                                                   max_restarts=0, max_task_retries=0)
        self._actors = []
        self._tasks = {}  # seq -> [key, seed, actor, ref]
        self._seq = itertools.count()
        self._dead = weakref.WeakSet()
        self._finalizer = weakref.finalize(self, _kill_all, self._actors, self._started)
        self.timings = [0, 0.0, 0.0, 0.0]  # batches done; their wall, CPU and run-queue seconds
        self._failures = 0
        try:
            self._payload, _ = _pickling.dumps(target, None, what=f"`{name}`")
            self._payload_ref = ray.put(self._payload)
            for wid in range(workers.count):
                self._actors.append(self._start(wid))
            self._wait_ready(self._actors)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ actors
    def _start(self, wid):
        handle = self._remote.remote(self._payload_ref, wid, self._spec.count, _wi.derive_seed(self._seed, wid),
                                     int(max(1, self._spec.num_cpus)), [p for p in sys.path if p])
        return _Actor(wid, handle)

    def _wait_ready(self, actors):
        ray = _ray()
        refs = [a.handle.ready.remote() for a in actors]
        try:
            answers = ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise BatchTimeoutError(
                f"The Ray actors of `{self.name}` did not start within timeout={self.timeout} s: they need "
                f"num_cpus={self._spec.num_cpus}" + (f" and resources={self._spec.resources}" if self._spec.resources else "")
                + f" each, and the cluster has {_describe(ray.available_resources())} free "
                f"(of {_describe(ray.cluster_resources())}). Add nodes with these resources or ask for less."
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise LoaderError(f"A Ray actor of `{self.name}` failed while starting: {exc}") from exc
        for actor, (pid, node) in zip(actors, answers):
            actor.pid, actor.node = pid, node

    @property
    def num_workers(self):
        return len(self._actors)

    @property
    def pids(self):
        return [a.pid for a in self._actors]

    def nodes(self):
        """The Ray node id of each actor, by worker id."""
        return [a.node for a in self._actors]

    def _replace(self, actor, why):
        """Starts a new actor for `actor`'s id and sends it its pending tasks again, in order."""
        ray = _ray()
        self._failures += 1
        if self._failures > _MAX_REPLACEMENTS:
            self._fail(WorkerDiedError(f"{_MAX_REPLACEMENTS} Ray actors of `{self.name}` were lost in a row "
                                       f"without a batch delivered; the last: {why}"))
        try:
            ray.kill(actor.handle, no_restart=True)
        except Exception:  # noqa: BLE001 -- already gone
            pass
        new = self._start(actor.id)
        self._wait_ready([new])
        self._actors[self._actors.index(actor)] = new
        for seq in actor.pending:
            task = self._tasks[seq]
            task[2] = new
            task[3] = new.handle.load.remote(task[0], task[1])
            new.pending.append(seq)
        actor.pending = []

    # ------------------------------------------------------------------ protocol
    def submit(self, key, inputs=None, seed=None):
        self._check_open()
        seq = next(self._seq)
        actor = min(self._actors, key=lambda a: (len(a.pending), a.last_task))
        actor.last_task = seq
        actor.pending.append(seq)
        self._tasks[seq] = [key, seed, actor, actor.handle.load.remote(key, seed)]
        return seq

    def get(self, seq, on_starved=None):
        ray = _ray()
        self._check_open()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            key, _, actor, ref = self._tasks[seq]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                treedef, leaves, (busy, cpu) = ray.get(ref, timeout=remaining)
            except ray.exceptions.GetTimeoutError:
                self._fail(BatchTimeoutError(
                    f"Batch {key} of `{self.name}` did not arrive within timeout={self.timeout} s from Ray actor "
                    f"{actor.id} (pid {actor.pid}). If batches are legitimately this slow, raise `timeout`; otherwise "
                    "look for a hang in __getitem__. The loader stopped its actors; using it again starts new ones."))
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
                self._replace(actor, f"{type(exc).__name__} while loading batch {key}")
                continue
            except ray.exceptions.RayTaskError as exc:
                self._forget(seq)
                cause = exc.as_instanceof_cause()
                error = cause if isinstance(cause, Exception) else LoaderError(str(exc))
                _add_note(error, f"[kpipe] raised in Ray actor {actor.id} (pid {actor.pid}) while loading batch {key} "
                                 f"of `{self.name}`.")
                error.kpipe_batch_index = key
                raise error from None
            break
        self._forget(seq)
        self._failures = 0
        t = self.timings
        t[0], t[1], t[2] = t[0] + 1, t[1] + busy, t[2] + cpu
        return _tree.unflatten(treedef, leaves), treedef, [(a.dtype.str, a.shape) for a in leaves]

    def _forget(self, seq):
        task = self._tasks.pop(seq)
        try:
            task[2].pending.remove(seq)
        except ValueError:
            pass

    def discard(self, seq):
        if seq in self._tasks:
            self._forget(seq)  # (its result, if it comes, is freed with its ref)

    def reset_target(self, target, dumped=None):
        """Sends every actor the new state and waits until each took it (behind its tasks)."""
        ray = _ray()
        self._check_open()
        payload = dumped[0] if dumped is not None else self.dump(target)[0]
        self._payload, self._payload_ref = payload, ray.put(payload)
        refs = [a.handle.set_target.remote(self._payload_ref) for a in self._actors]
        try:
            ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            self._fail(BatchTimeoutError(f"The Ray actors of `{self.name}` did not take the new state of the dataset "
                                         f"(after on_epoch_end) within timeout={self.timeout} s."))
        except ray.exceptions.RayActorError:
            for actor in list(self._actors):  # a lost actor: its replacement starts from the new state
                try:
                    ray.get(actor.handle.ready.remote(), timeout=self.timeout)
                except ray.exceptions.RayActorError:
                    self._replace(actor, "lost while taking the new state")

    def dump(self, target):
        payload, _ = _pickling.dumps(target, None, what=f"`{self.name}`")
        return payload, [], False

    def current_state(self):
        return self._payload, []

    def same_state(self, target):
        return False

    def _check_open(self):
        if self.closed:
            raise LoaderClosedError(f"The Ray actors of `{self.name}` were stopped.")

    def _fail(self, exc):
        self.close()
        raise exc

    def close(self, force=False):
        self.closed = True
        self._tasks.clear()
        self._finalizer()


def _kill_all(actors, started):
    try:
        import ray

        if ray.is_initialized():
            for actor in actors:
                try:
                    ray.kill(actor.handle, no_restart=True)
                except Exception:  # noqa: BLE001 -- already gone
                    pass
    finally:
        actors.clear()
        disconnect(started)


def _describe(resources):
    return ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items()) if not k.startswith("node:")) or "nothing"


def _add_note(exc, note):
    if hasattr(exc, "add_note"):
        exc.add_note(note)
