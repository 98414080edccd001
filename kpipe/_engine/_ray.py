"""A loader's workers as Ray actors: `ProcessLoader(dataset, workers=kpipe.RayWorkers(n, ...))`.

NOTE [ Loader workers on a Ray cluster ]
----------------------------------------
When one machine's cores cannot feed its accelerators, the Python work of a `PyDataset`
(h5py reads, decoding, NumPy augmentation) can run on other machines' CPUs. Ray runs
arbitrary Python there; kpipe keeps its guarantees in the loader (`Position`, `Window`, the
epoch-hook rule), so only the backend changes (the protocol in `_backend.py`):

    main: RayBackend.submit(index, seed) -> actor.load_many.remote([(index, seed), ...], released, local)
    actor: reseed random/numpy.random from the batch's seed (as a process worker does);
           batch = dataset[index]; returned with its timings, one of two ways:
      other node (local=False): the arrays, which Ray copies into its object store when
           the task returns (`kpipe.empty` arrays live in the actor's own reused buffer,
           so building a batch faults in no new pages); main: ray.get(ref) -- Ray's
           transfer between nodes (what travels matters: uint8 before a float
           conversion is 4x fewer bytes)
      this node (local=True, the actor runs on the trainer's node): as a process worker,
           into a shared-memory slot (a memfd of the actor's; `kpipe.empty` allocates
           there, other arrays are copied in once); only (slot, fd, pid, layout) travels.
           main: opens /proc/<pid>/fd/<fd> once per slot and returns views of it, each
           holding a lease; when the consumer drops a batch, its slot goes back to the
           actor with the actor's next task (`released`). A batch outlives its actor
           (the pages live while mapped). Where /proc/<pid>/fd cannot be opened (another
           user, a hardened kernel), a warning, and every later batch takes the object
           store. On one node this removes Ray's copy of every batch (77 MB batches:
           0.24x of process workers through the object store, see scripts/bench_ray.py).

* Small, quick batches share actor calls. A Ray actor call costs CPU of its own (here, Ray
  2.60: ~0.6 ms in this process and ~0.45 ms in the actor), which for batches of about a
  millisecond of work is as much as the work: with one call per batch, 1 to 16 actors all
  delivered about what one did. So once 8 batches were measured, batches under 4 MiB taking
  less than 5 ms (not counting waits for a CPU; waits for I/O count) go to an actor
  several at a time (`batches_per_call`: up to 8, enough to make the call's cost small
  beside their work), in one `load_many` call that returns each batch's outcome (an
  exception in one batch is that batch's alone). Submitted batches wait in the actor's
  outbox until a call is full -- or at once when the actor has nothing to do, when the
  consumer waits for one of them, and before a new state is sent (so that they load under
  the state they were submitted under). The window keeps two calls per actor in flight
  (`Window.limit` multiplies its depth by `batches_per_call`, within `max_queue_size`,
  whose default is 8x larger with actors), so one call loads while the next fills. Big
  or slow batches never share a call: they stay at two per actor, as before.
* The dataset goes to the actors once, through the object store (`ray.put` of kpipe's
  pickle: classes from `__main__`/notebooks by value, Keras's `PyDataset` base swapped for
  a TensorFlow-free stand-in, as for process workers), and again after a hook changed it.
  An actor runs one task at a time, in the order it got them, so a new state sent behind
  its tasks applies to the tasks submitted after it: `epoch_end_ahead=True` sends the
  next pass's state without waiting (`send_state`). Each task remembers the state it was
  submitted under, so a replaced actor loads it under that state, whatever came after.
* Actors run with the allocator settings of kpipe's workers (`WORKER_ENV`: glibc keeps
  freed memory, so a batch built with `np.stack` reuses warm pages instead of faulting in
  77 MB of new ones per call).
* Placement: `num_cpus` per actor and `resources` (a custom resource the CPU-only
  preprocessing nodes were started with: `ray start --resources='{"preprocess": 8}'`);
  actors that cannot be placed within `timeout` are a named error, never a hang.
* Faults: an actor (or its node) lost while loading costs throughput, not the run. Its
  batches not fetched yet go to the live actors, in order, each under the state it was
  submitted under (batches are pure functions of (dataset state, index, seed): every batch
  is delivered once, the same as it would have been), with the actors of every node Ray
  marked dead; a replacement of each (same id, current state) is asked of Ray without a
  wait: placed at once where there is room, else when capacity returns (a node added back,
  the autoscaler), it takes tasks once ready (polled at each submit and read). One warning
  says what is waited for. Only when no actor was live for `timeout` (batches waiting for
  one) is it the named `BatchTimeoutError` of actors not placed; then, as on every failure
  path, the actors and pending creations are killed (`_fail` -> `close`). An exception in
  `__getitem__` is raised in the main process with its type and the remote traceback, as
  from a process worker.
* The actor count (`RayWorkers("auto")`): the controller of `workers="auto"` (NOTE in
  `_autoscale.py`) with the CPUs and the actor count the cluster's live nodes offer this
  spec (`capacity()`). Added actors take tasks once Ray placed them and they are ready
  (polled at each submit, never waited for); one not placed within `timeout` is dropped
  with a warning. A retired actor takes no new task and is killed once its queued batches
  were answered.
* Thread budget: each actor limits its native pools (BLAS, OpenMP, OpenCV, TensorFlow)
  to the CPUs it reserved (`num_cpus`, at least 1), as a process worker does to its
  share of the host; `stats()["worker_thread_pools"]` shows what each actor set.
* Lifetime: actors are killed on `close()`, when the loader is dropped, or at exit. With
  no `address` (and no `RAY_ADDRESS`), kpipe starts a local Ray instance and shuts it down
  with the last loader that used it; a cluster it connected to is left running.
"""

import itertools
import logging
import sys
import time
import weakref

from kpipe._engine import _pickling, _procs, _ray_actor, _ray_slots, _shm, _tree
from kpipe._engine import worker_info as _wi
from kpipe._engine._backend import Backend
from kpipe._engine._ray_cluster import capacity, connect, describe, disconnect
from kpipe._engine._ray_cluster import ray_module as _ray
from kpipe._engine._worker import rebuild_exception
from kpipe.errors import BatchTimeoutError, LoaderClosedError, LoaderError, WorkerDiedError

_MAX_REPLACEMENTS = 8  # actors replaced in a row without a batch delivered: the cluster is failing
# Batches sharing an actor call (see the NOTE): Ray's cost per call, about 1 ms of CPU here
# (0.6 ms in this process, 0.45 ms in the actor), weighs on batches of little work.
_CALL_COST_S = 0.005  # batches taking less time than this (without waiting for a CPU) share calls...
_SMALL_BATCH_BYTES = 4 << 20  # ...if they are this small (more batches in flight cost little memory)
MAX_PER_CALL = 8  # at most this many per call
logger = logging.getLogger("kpipe")


class _Actor:
    __slots__ = ("id", "handle", "pid", "node", "pools", "pending", "outbox", "last_task", "starting", "retiring",
                 "replacing", "loads")

    def __init__(self, wid, handle):
        self.id, self.handle = wid, handle
        self.pid = self.node = self.pools = None
        self.pending = []  # seqs, in the order submitted (sent or in `outbox`), until gotten
        self.outbox = []  # seqs submitted but not sent yet: they go in the next call
        self.last_task = -1
        self.starting = None  # (ready ref, since): added while running, not placed and ready yet
        self.retiring = False  # takes no new task; stopped once its pending ones are answered
        self.replacing = False  # stands for a lost actor: waits to be placed as long as it takes
        self.loads = 0  # batches it delivered


class RayBackend(Backend):
    """Runs `target[key]` in Ray actors (see the NOTE). Used from one thread at a time."""

    keeps_copy = can_send_state = can_resize = thread_budget = True
    shared = None  # no shared-memory arrays across nodes: the payload carries the dataset's arrays

    def __init__(self, target, *, workers, timeout, seed, name, num_workers=None, max_workers=None, worker_threads=None):
        self.name = name
        count = workers.count if num_workers is None else num_workers
        self._max = max_workers or count  # actors at most (workers="auto"); also worker_info().num_workers
        self._threads = worker_threads  # None: the CPUs each actor reserved
        self.timeout = timeout
        self.closed = False
        self._spec = workers
        self._seed = seed
        self._started = connect(workers.address, timeout)
        ray = _ray()
        self._remote = ray.remote(_ray_actor.Loader).options(num_cpus=workers.num_cpus, resources=workers.resources or None,
                                                   max_restarts=0, max_task_retries=0,
                                                   runtime_env={"env_vars": dict(_procs.WORKER_ENV)})
        self._actors = []
        self._tasks = {}  # seq -> [key, seed, actor, ref, state, j]: the batch is item j of call `ref` (None: not
        # sent yet); `state`, the payload's ref it was submitted under
        self._done = {}  # seq -> outcome (`_finish`) of a batch whose call was fetched, until it is gotten
        self._last_bytes = None  # bytes of the last batch gotten (batches share calls only when small)
        self._seq = itertools.count()
        self._finalizer = weakref.finalize(self, _kill_all, self._actors, self._started)
        self.timings = [0, 0.0, 0.0, 0.0]  # batches done; their wall, CPU and run-queue seconds
        self._failures = 0  # actors lost in a row without a batch delivered
        self._start_failures = 0  # replacements that failed to start, in a row
        self._homeless = []  # seqs waiting for a live actor (none is: `_await_live`), in order
        self._none_live_since = None  # since when no actor was live (a lost one's batches had nowhere to go)
        self._warned = False  # the warning of actors lost and waited for was given (until all are back)
        # Actors on this node hand batches over in shared-memory slots (see the NOTE):
        self._node = ray.get_runtime_context().get_node_id()
        self._slots = _ray_slots.Slots(name)
        try:
            self._payload, _ = _pickling.dumps(target, None, what=f"`{name}`")
            self._sent_fingerprint = _pickling.state_fingerprint(target)  # (see same_state)
            self._payload_ref = ray.put(self._payload)
            for wid in range(count):
                self._actors.append(self._start(wid))
            self._wait_ready(self._actors)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ actors
    def _start(self, wid, state=None):
        handle = self._remote.remote(self._payload_ref if state is None else state, wid, self._max,
                                     _wi.derive_seed(self._seed, wid), self.worker_threads, [p for p in sys.path if p])
        return _Actor(wid, handle)

    def _wait_ready(self, actors):
        ray = _ray()
        refs = [a.handle.ready.remote() for a in actors]
        try:
            answers = ray.get(refs, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise self._not_started() from None
        except ray.exceptions.RayActorError as exc:
            raise LoaderError(f"A Ray actor of `{self.name}` failed while starting: {exc}") from exc
        for actor, (pid, node, pools) in zip(actors, answers):
            actor.pid, actor.node, actor.pools = pid, node, pools

    def _not_started(self, lost=False):
        ray = _ray()
        return BatchTimeoutError(
            f"The Ray actors of `{self.name}` did not start within timeout={self.timeout} s"
            + (" (and none was live meanwhile: the others were lost)" if lost else "") + ": they need "
            f"num_cpus={self._spec.num_cpus}" + (f" and resources={self._spec.resources}" if self._spec.resources else "")
            + f" each, and the cluster has {describe(ray.available_resources())} free "
            f"(of {describe(ray.cluster_resources())}). Add nodes with these resources or ask for less.")

    def actors(self):
        """Each actor as the loader saw it at its last submit or read (a snapshot, safe
        from another thread): a dict of `id`, `pid`, `node`, `loads` (batches delivered)
        and `state`: "live", "starting" (not placed or not ready yet: added by
        `RayWorkers("auto")`, or replacing a lost actor) or "retiring"."""
        return [{"id": a.id, "pid": a.pid, "node": a.node, "loads": a.loads,
                 "state": "retiring" if a.retiring else "starting" if a.starting else "live"} for a in list(self._actors)]

    @property
    def num_workers(self):
        """Actors taking tasks, or starting to (retiring ones not counted)."""
        return sum(not a.retiring for a in self._actors)

    @property
    def pids(self):
        return [a.pid for a in self._actors if a.starting is None and a.pid is not None]

    def nodes(self):
        """The Ray node id of each actor that started, by worker id."""
        return [a.node for a in self._actors if a.starting is None and a.pid is not None]

    def capacity(self):
        """`(cpus, actors)` the cluster's live nodes offer this spec (`_ray_cluster.capacity`)."""
        return capacity(self._spec)

    # ------------------------------------------------------ changing the actor count
    def add_worker(self, count=1):
        """Starts `count` more actors without waiting: each takes tasks once Ray placed
        it and it is ready (one not ready within `timeout` is dropped, with a warning).
        Returns their ids."""
        self._check_open()
        if self.num_workers + count > self._max:
            raise ValueError(f"Cannot run more than {self._max} Ray actors for `{self.name}`. Received: count={count} "
                             f"with {self.num_workers} running.")
        used = {a.id for a in self._actors}
        ids = [i for i in range(len(used) + count) if i not in used][:count]
        for wid in ids:
            actor = self._start(wid)
            actor.starting = (actor.handle.ready.remote(), time.monotonic())
            self._actors.append(actor)
        return ids

    def retire_worker(self):
        """Retires the live actor with the highest id: it takes no new task and is stopped
        once its pending tasks are answered (their batches are delivered as usual). Returns
        its id, or None when only one live actor is left."""
        self._check_open()
        live = [a for a in self._actors if not a.retiring]
        if len(live) <= 1:
            return None
        actor = max(live, key=lambda a: (a.starting is not None, a.id))  # one not placed yet first
        actor.retiring = True
        self._send(actor)  # what it was given is still loaded
        if not actor.pending:
            self._stop(actor)
        return actor.id

    def _stop(self, actor):
        self._actors.remove(actor)
        self._forget_actor(actor)

    def _forget_actor(self, actor):
        """Kills `actor` (a pending creation is cancelled) and closes its slots here."""
        self._slots.forget(actor.pid)
        try:
            _ray().kill(actor.handle, no_restart=True)
        except Exception:  # noqa: BLE001 -- already gone
            pass

    def _poll_starting(self):
        """Actors added while running that became ready take tasks from now on."""
        starting = [a for a in self._actors if a.starting is not None]
        if not starting:
            return
        ray = _ray()
        ready, _ = ray.wait([a.starting[0] for a in starting], num_returns=len(starting), timeout=0)
        ready = set(ready)
        for actor in starting:
            ref, since = actor.starting
            if ref in ready:
                try:
                    actor.pid, actor.node, actor.pools = ray.get(ref)
                    actor.starting, self._none_live_since = None, None
                    self._start_failures = 0 if actor.replacing else self._start_failures
                    continue
                except ray.exceptions.RayError as exc:
                    why = f"{type(exc).__name__}: {exc}"
            elif actor.replacing or self.timeout is None or time.monotonic() - since <= self.timeout:
                continue  # (a replacement waits for capacity as long as it takes: `_await_live` bounds the wait)
            else:
                why = (f"not placed within timeout={self.timeout} s (the cluster has {describe(ray.available_resources())}"
                       " free)")
            if actor.replacing:  # (e.g. its node was lost while it started): asked of Ray again
                self._start_failures += 1
                if self._start_failures > _MAX_REPLACEMENTS:
                    self._fail(LoaderError(f"{_MAX_REPLACEMENTS} Ray actors of `{self.name}` failed in a row while "
                                           f"starting; the last: {why}"))
                self._forget_actor(actor)
                self._actors[self._actors.index(actor)] = self._replacement(actor.id)
                continue
            logger.warning("ProcessLoader(%s): a Ray actor added by workers='auto' was dropped: %s", self.name, why)
            self._stop(actor)
        if self._homeless and any(a.starting is None and not a.retiring for a in self._actors):
            homeless, self._homeless = self._homeless, []
            self._route(homeless)  # (the batches that waited for a live actor, first)
        if not any(a.replacing and a.starting for a in self._actors):
            self._warned = False  # (every lost actor is back: a later loss is told again)

    @property
    def worker_threads(self):
        """Threads each actor's native pools may use: `worker_threads` if given, else the
        CPUs it reserved, at least 1."""
        return self._threads if self._threads is not None else int(max(1, self._spec.num_cpus))

    def thread_pools(self):
        """What the budget set in each actor, as it last reported (see `_threads.py`)."""
        return [{"worker": a.id, "pid": a.pid, "node": a.node,
                 **(a.pools or {"threads": None, "pools": [], "not_limited": []})} for a in self._actors]

    def _replacement(self, wid):
        """A new actor for worker `wid`, on the current state, asked of Ray without waiting:
        it takes tasks once placed and ready (`_poll_starting`), however long that takes."""
        actor = self._start(wid)
        actor.starting, actor.replacing = (actor.handle.ready.remote(), time.monotonic()), True
        return actor

    def _lose(self, actor, why):
        """`actor` was lost, with the other actors on nodes Ray marked dead: a replacement
        of each is asked of Ray in the background, and their batches not fetched yet go to
        the live actors, in order, each under the state it was submitted under (with none
        live, they wait for one: `_await_live`)."""
        self._failures += 1  # (a node lost is one failure, however many actors it held)
        if self._failures > _MAX_REPLACEMENTS:
            self._fail(WorkerDiedError(f"{_MAX_REPLACEMENTS} Ray actors of `{self.name}` were lost in a row "
                                       f"without a batch delivered; the last: {why}"))
        dead = {n["NodeID"] for n in _ray().nodes() if not n.get("Alive")}
        lost = [actor] + [a for a in self._actors if a is not actor and a.starting is None and a.node in dead]
        again, replaced = [], False
        for one in lost:
            self._forget_actor(one)
            again += [seq for seq in one.pending if seq not in self._done]
            one.pending, one.outbox = [seq for seq in one.pending if seq in self._done], []  # (fetched: in hand)
            if one in self._actors:
                index = self._actors.index(one)
                if one.retiring:
                    del self._actors[index]
                else:
                    self._actors[index], replaced = self._replacement(one.id), True
        if replaced:
            self._warn_lost(actor, why, len(lost), len(again))
        self._route(sorted(again))

    def _warn_lost(self, actor, why, lost, count):
        """Warns once (until every lost actor is back) of what the loader waits for."""
        if self._warned:
            return
        self._warned, ray = True, _ray()
        live = sum(a.starting is None and not a.retiring for a in self._actors)
        logger.warning(
            "ProcessLoader(%s): Ray actor %s (pid %s) was lost (%s), %d in all with those on nodes Ray marked dead. "
            "%s; waiting for Ray to place a replacement of each (num_cpus=%s%s; the cluster has %s free): each takes "
            "batches once ready. Loading fails only if no actor is live for timeout=%s s.",
            self.name, actor.id, actor.pid, why, lost,
            f"Loading goes on with the {live} live actors, which load their {count} batches in flight again" if live
            else f"No actor is live: their {count} batches in flight wait for one", self._spec.num_cpus,
            f", resources={self._spec.resources}" if self._spec.resources else "", describe(ray.available_resources()),
            self.timeout)

    def _route(self, seqs):
        """Sends the tasks `seqs` (in order) to the live actors, the least loaded first;
        with none live, they wait for one."""
        live, sent = [a for a in self._actors if a.starting is None and not a.retiring], {}
        for seq in seqs:
            task = self._tasks[seq]
            task[2] = task[3] = None
            if not live:
                self._homeless.append(seq)
                continue
            actor = task[2] = min(live, key=lambda a: (len(a.pending), a.last_task))
            actor.pending.append(seq)
            actor.outbox.append(seq)
            sent[id(actor)] = actor
        self._homeless.sort()
        if self._homeless and self._none_live_since is None:
            self._none_live_since = time.monotonic()
        for actor in sent.values():
            self._send(actor)

    def _await_live(self):
        """No actor is live: waits for one starting to be ready (then the batches that
        waited go to it), or fails once none was live for `timeout` (as at the start)."""
        ray = _ray()
        since = self._none_live_since or time.monotonic()
        while self._homeless:
            starting = [a.starting[0] for a in self._actors if a.starting is not None]
            left = None if self.timeout is None else since + self.timeout - time.monotonic()
            if not starting or (left is not None and left <= 0):
                self._fail(self._not_started(lost=True))
            ray.wait(starting, num_returns=1, timeout=1.0 if left is None else min(left, 1.0))
            self._poll_starting()

    # ------------------------------------------------------------------ protocol
    def submit(self, key, inputs=None, seed=None):
        self._check_open()
        seq = next(self._seq)
        self._poll_starting()
        ready = [a for a in self._actors if not a.retiring and a.starting is None]
        if not ready:  # (every actor was lost: the batch waits for one, `_await_live`)
            self._tasks[seq] = [key, seed, None, None, self._payload_ref, 0]
            self._route([seq])
            return seq
        actor = min(ready, key=lambda a: (len(a.pending), a.last_task))
        actor.last_task = seq
        actor.pending.append(seq)
        actor.outbox.append(seq)
        self._tasks[seq] = [key, seed, actor, None, self._payload_ref, 0]
        if not self._busy(actor) or len(actor.outbox) >= self.batches_per_call():  # (an idle actor gets it at once)
            self._send(actor)
        return seq

    def batches_per_call(self):
        """Batches an actor call carries now (see the NOTE): one, unless batches are small
        (under `_SMALL_BATCH_BYTES`) and quick (under `_CALL_COST_S` each, measured over at
        least 8, without the time they waited for a CPU), when enough share a call to make
        Ray's cost per call small beside their work -- at most `MAX_PER_CALL`. The window
        keeps twice that in flight per actor (`Window.limit`), so that one call is loaded
        while the next one fills."""
        done, busy, runq = self.timings[0], self.timings[1], self.timings[3]
        if done < 8 or self._last_bytes is None or self._last_bytes > _SMALL_BATCH_BYTES:
            return 1
        # A batch's own time: its wall time but for the time it waited for a CPU (actors
        # sharing CPUs stretch each batch without making it more work); waits count.
        own = (busy - runq) / done
        return max(1, min(MAX_PER_CALL, int(_CALL_COST_S / max(own, 1e-6))))

    def _send(self, actor):
        """Sends `actor` the batches of its outbox, in calls of batches submitted under one
        state (at most `batches_per_call`). Every actor's queue ends on the current state:
        a call of batches submitted under an older one (a lost actor's, sent again) goes
        between that state and the current one."""
        seqs, actor.outbox = actor.outbox, []
        per = self.batches_per_call()
        while seqs:
            state, n = self._tasks[seqs[0]][4], 1
            while n < min(per, len(seqs)) and self._tasks[seqs[n]][4] is state:
                n += 1
            call, seqs = seqs[:n], seqs[n:]
            if state is not self._payload_ref:
                actor.handle.set_target.remote(state)
            ref = self._load(actor, [(self._tasks[seq][0], self._tasks[seq][1]) for seq in call])
            for j, seq in enumerate(call):
                self._tasks[seq][3], self._tasks[seq][5] = ref, j
            if state is not self._payload_ref:
                actor.handle.set_target.remote(self._payload_ref)

    def _busy(self, actor):
        """Whether `actor` has a call sent and not fetched yet that a batch still waits for."""
        return any(self._tasks[seq][3] is not None and seq not in self._done for seq in actor.pending)

    def _send_all(self):
        for actor in self._actors:
            self._send(actor)

    # ------------------------------------------------------- slots on this node
    def _load(self, actor, items):
        """`actor.load_many.remote(items, ...)`, telling it the slots the consumer let go
        of, and whether the batches may stay on this node in slots."""
        released = self._slots.released_for(actor.pid)
        local = self._slots.reachable and actor.node == self._node
        return actor.handle.load_many.remote(items, released, local)

    @property
    def slots_reachable(self):
        """False once an actor's slot could not be opened here (batches then take the object store)."""
        return self._slots.reachable

    @slots_reachable.setter
    def slots_reachable(self, value):
        self._slots.reachable = value

    def local_slots(self):
        """Slots of actors on this node mapped here now (each is reused once released)."""
        return self._slots.count()

    def get(self, seq, on_starved=None):
        ray = _ray()
        self._check_open()
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while seq not in self._done:
            self._poll_starting()  # (replacements placed since take tasks)
            key, _, actor, ref, _, _ = self._tasks[seq]
            if actor is None:  # no actor is live: it waits for one
                self._await_live()
                continue
            if ref is None:
                self._send(actor)
                ref = self._tasks[seq][3]
            for other in self._actors:  # an actor with nothing to do takes what waits for it
                if other.outbox and not self._busy(other):
                    self._send(other)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                outcomes, pools = ray.get(ref, timeout=remaining)
            except ray.exceptions.GetTimeoutError:
                self._fail(BatchTimeoutError(
                    f"Batch {key} of `{self.name}` did not arrive within timeout={self.timeout} s from Ray actor "
                    f"{actor.id} (pid {actor.pid}). If batches are legitimately this slow, raise `timeout`; otherwise "
                    "look for a hang in __getitem__. The loader stopped its actors; using it again starts new ones."))
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
                self._lose(actor, f"{type(exc).__name__} while loading batch {key}")
                deadline = None if self.timeout is None else time.monotonic() + self.timeout  # (sent again)
                continue
            except ray.exceptions.RayTaskError as exc:  # (the actor catches a batch's exceptions; this is Ray's)
                self._fail(LoaderError(f"Ray actor {actor.id} (pid {actor.pid}) of `{self.name}` failed while "
                                       f"loading batch {key}: {exc}"))
            self._fetched(actor, ref, outcomes, pools)
        kind, value = self._done.pop(seq)
        key, _, actor, _, _, _ = self._tasks[seq]
        if kind == "error":
            self._forget(seq)
            error = rebuild_exception(value, f"in Ray actor {actor.id} (pid {actor.pid}) while loading batch {key} "
                                             f"of `{self.name}`")
            error.kpipe_batch_index = key
            raise error
        if kind == "reload":  # its slot cannot be opened here: loaded again through the object store
            actor.pending.remove(seq)
            self._route([seq])
            return self.get(seq, on_starved)
        treedef, leaves, meta, (busy, cpu, runq) = value
        self._forget(seq)
        self._failures = 0
        actor.loads += 1
        self._last_bytes = sum(leaf.nbytes for leaf in leaves)
        t = self.timings
        t[0], t[1], t[2], t[3] = t[0] + 1, t[1] + busy, t[2] + cpu, t[3] + runq
        return _tree.unflatten(treedef, leaves), treedef, meta

    def _fetched(self, actor, ref, outcomes, pools):
        """Call `ref` of `actor` answered: each of its batches still wanted gets its outcome."""
        if pools is not None:
            actor.pools = pools
        for seq in actor.pending:
            task = self._tasks.get(seq)
            if task is not None and task[3] is ref:
                self._done[seq] = self._finish(actor, outcomes[task[5]])

    def _finish(self, actor, outcome):
        """A batch's outcome as `get` returns it: `("ok", (treedef, leaves, meta, timings))`
        (arrays in a slot viewed here at once, so that they outlive the actor), `("error",
        packed exception)`, or `("reload", None)` where its slot cannot be opened here."""
        kind, value = outcome
        if kind != "ok":
            return outcome
        treedef, leaves, timings, slot = value
        if slot is None:
            return "ok", (treedef, leaves, [(_shm.dtype_token(a.dtype), a.shape) for a in leaves], timings)
        views = self._slots.views(slot, actor)
        if views is None:
            return "reload", None
        return "ok", (treedef, views[0], views[1], timings)

    def _forget(self, seq):
        task = self._tasks.pop(seq)
        actor = task[2]
        if actor is None:
            return
        try:
            actor.pending.remove(seq)
        except ValueError:
            pass
        if actor.retiring and not actor.pending and actor in self._actors:
            self._stop(actor)

    def discard(self, seq):
        task = self._tasks.get(seq)
        if task is None:
            return
        actor, ref = task[2], task[3]
        if self._done.pop(seq, None) is None:  # (a batch fetched: its views go, and its slot with them)
            if actor is None:
                self._homeless.remove(seq)
            elif ref is None:
                actor.outbox.remove(seq)
            else:
                self._slots.orphan(ref, task[5])  # (a slot it fills is released when its call ends)
        self._forget(seq)

    def reset_target(self, target, dumped=None):
        """Sends every actor the new state and waits until each took it (behind its tasks)."""
        ray = _ray()
        self._check_open()
        payload = dumped[0] if dumped is not None else self.dump(target)[0]
        self._send_all()  # batches submitted before load under the state they were submitted under
        self._payload, self._payload_ref = payload, ray.put(payload)
        if target is not None:
            self._sent_fingerprint = dumped[2] if dumped is not None and len(dumped) > 2 else self.fingerprint(target)
        refs = [(a, a.handle.set_target.remote(self._payload_ref)) for a in self._actors]
        refs = [(a, ref) for a, ref in refs if a.starting is None]  # (those starting take it once placed)
        try:
            ray.get([ref for _, ref in refs], timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            self._fail(BatchTimeoutError(f"The Ray actors of `{self.name}` did not take the new state of the dataset "
                                         f"(after on_epoch_end) within timeout={self.timeout} s."))
        except ray.exceptions.RayActorError:
            for actor, ref in refs:  # a lost actor: its replacement starts from the new state
                try:
                    ray.get(ref, timeout=self.timeout)
                except ray.exceptions.RayActorError:
                    self._lose(actor, "lost while taking the new state")

    def send_state(self, payload, keys):
        """Queues a new state (`dump` output) behind each actor's tasks, without waiting:
        tasks submitted afterwards load under it (`epoch_end_ahead=True`). A lost actor
        surfaces when one of its batches is read, and is replaced then."""
        self._check_open()
        if keys:
            raise ValueError(f"Ray actors hold no shared arrays: send_state takes keys=[]; received {sorted(keys)}")
        self._send_all()  # batches submitted before load under the state they were submitted under
        self._payload, self._payload_ref = payload, _ray().put(payload)
        self._sent_fingerprint = None  # (unknown: a later same_state compares payloads only)
        for actor in self._actors:
            actor.handle.set_target.remote(self._payload_ref)

    def dump(self, target):
        payload, _ = _pickling.dumps(target, None, what=f"`{self.name}`")
        return payload, [], False

    def current_state(self):
        return self._payload, []

    def same_state(self, fingerprint):
        """Whether a target of this `fingerprint` holds the state the actors hold, though it
        pickles to other bytes (as `ProcessBackend.same_state`)."""
        return fingerprint is not None and fingerprint == self._sent_fingerprint

    def fingerprint(self, target):
        return _pickling.state_fingerprint(target)

    def _check_open(self):
        if self.closed:
            raise LoaderClosedError(f"The Ray actors of `{self.name}` were stopped.")

    def _fail(self, exc):
        self.close()
        raise exc

    def close(self, force=False):
        self.closed = True
        self._homeless.clear()
        self._tasks.clear()
        self._done.clear()
        self._finalizer()
        self._slots.close()  # (arrays still viewing slots keep their mappings)


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

