"""Main-process side of the engine: backends that run `target[key]` (or `target(inputs)`).

Three backends share one small interface -- `submit(key, inputs=None) -> seq`,
`get(seq) -> (tree, treedef, meta)`, `discard(seq)`, `reset_target(target)`, `close()`:

* `ProcessBackend`: persistent worker processes, batches in shared-memory slots.
* `ThreadBackend`: a thread pool, for I/O-bound work that releases the GIL.
* `InlineBackend`: runs in the calling thread (`workers=0`).

NOTE [ kpipe worker shutdown and slot lifecycle ]
------------------------------------------------
Data flow for one task (`seq` increases by one per task; it goes to the live worker with
the fewest tasks pending, on ties one that has mapped a free slot, then round-robin --
which worker loads a batch changes nothing in it: the owner passes each batch's seed
with the task):

    main: acquire slot S (a memfd; a free one W already maps if any) --task(seq, key, S)--> W
                         [S's fd follows via SCM_RIGHTS unless W holds it already]
    W:    out = target[key]; flatten; write leaves into S (grow S with ftruncate and
          allocate the pages with fallocate if needed; the pages W will write are mapped
          in one madvise -- MADV_POPULATE_WRITE for pages it allocated, _READ for pages
          another worker wrote -- not faulted one by one)
    W:    --done(seq, treedef, layout)--> main      (arrays never go through the socket)
    main: get(seq): arrays = views of S, each holding a Lease(S)
    consumer drops the last array/view  ->  Lease.__del__  ->  S back to the free list

A slot is written only while it is "in flight" (acquired, not yet leased), so a consumer
never sees its arrays change. Slots the consumer still holds do not stall loading: a new
slot is created instead; idle slots beyond `keep_idle` are closed and workers are told to
unmap them with the next task they get.

Each slot costs a batch of memory and, on first use, the kernel's allocation and zeroing
of its pages (in the worker that grows it, with one fallocate: ~0.65 ms per MB, several
times that on a virtual machine that has handed the freed memory back to its host) and
each further process's mapping of them (~0.12 ms per MB for a worker, ~0.06 for the
consumer's reads; `python scripts/bench_shm.py`). So the owner decides how many tasks are
in flight and when a task may take a new slot (`ProcessLoader`, see `_fill` and `_starved`
in `kpipe/loader.py`):
  * up to a window: two per worker, deeper (up to `max_queue_size`) when `get(seq,
    on_starved=...)` reports a worker idle behind a slow batch -- unless that batch is its
    worker's first use of its slot (`is_first_use`), a delay that does not recur -- and
    only once workers have idled so for longer than the new slots would cost them to set
    up: workers time that (`_shm.setup_seconds`, each batch's `setup_s`), and
    `slot_setup_s()` prices a slot at the rate measured so far;
  * a task takes a free slot if there is one (`needs_new_slot`); a new slot only for a
    worker that would otherwise idle, and not between a read and the next one (the
    consumer releases its previous batch when it takes the new one), so the slots
    number at most the window plus what the consumer holds;
  * a worker idle behind a first use, with the window full, allocates the slot the
    window will need ahead (`prepare_slots`), so that no later batch pays for it.
A Ctrl-C while `get` waits discards that task: its slot is freed when the worker's answer
arrives.

Descriptors, bounded by what is alive:
  main    one memfd per live slot (free, in flight or held by the consumer) and per
          shared dataset array; mappings are made with libc mmap (`_shm.Mapping`), which
          -- unlike Python's mmap.mmap -- keeps no duplicate descriptor, and are unmapped
          when the last array viewing them dies. The soft RLIMIT_NOFILE is raised to the
          hard limit once, when the first ProcessBackend starts; running out anyway is a
          LoaderError naming the limit and `ulimit -n`, never a raw OSError(24).
  worker  mappings of the slots it wrote, but descriptors for at most `_WORKER_SLOT_FDS`
          of them: the task message names the descriptors to close (`_slot_fds`, least
          recently used first) and carries the ones it needs, so a worker always holds the
          descriptor of the slot it writes (to grow it) and held batches cost it none.
          Shared dataset arrays are mapped once and their descriptors closed at once.
  arrays  `reset_target` pickles the new target; arrays it no longer references (replaced
          in `on_epoch_end`, or resized in place) are freed here (`SharedArrays.retain`)
          and named in the `state` message, so each worker unmaps them too.

A new target version without a wait (`send_state`, for `epoch_end_ahead=True`): the
`state` message goes behind each worker's pending tasks, which still run on the old
version; tasks submitted after it run on the new one (a worker handles its messages in
order). It may hold only the shared arrays the workers already map.

Changing the worker count (`workers="auto"`): `add_worker` forks new workers from the
fork server (or spawns them), gives them the target's current state (a `state` message
when `reset_target` ran since the server unpickled it) and puts them before the server
in `_procs`; they take tasks at once. `retire_worker` marks the worker with the highest
id `retiring`: it gets no new task, and once its pending tasks are answered it is sent
`stop` (`stopped`); its EOF is then no death, and it is reaped without waiting
(`_reap_retired`, or by `shutdown` like every other worker). Ids stay unique among the
processes alive; a new worker takes the lowest free one. Both re-divide the CPUs among
the workers taking tasks (`_rebudget`): each running worker gets a `threads` message with
its new thread budget before new workers start (which start with it), and after one
retires (NOTE in `_threads.py`).

Failures: every wait is a `poll` on the worker sockets and process sentinels with a
deadline (one poll set, kept while the workers stay the same), and so is every write:
messages go out non-blocking, waiting for room in the socket with `poll` (`_wire.send`),
because a worker stuck in `__getitem__` stops reading, and a large `init`/`state` payload
would otherwise block the main process past any `timeout`. A Ctrl-C that lands in a
batch's release (a `Lease.__del__`, where Python would drop it) is raised by the next
`get`. A worker exception comes back as data (type, message,
traceback) and is re-raised for that batch; the pool stays usable. A dead worker (EOF
on its socket, its sentinel fires, or a write gets EPIPE/ECONNRESET), a batch past
`timeout`, or a worker that takes no message before the deadline raises
WorkerDiedError/BatchTimeoutError naming the worker and the batch, and breaks the pool:
it is closed, and the owner starts a new one on next use. (A failed write of a task is
raised by `get` of that task, so batches already made by other workers still arrive.)

Shutdown (`close()`, `with`, garbage collection via `weakref.finalize`, interpreter exit,
or a fatal error): close our slot and array descriptors first (held batches keep their
mappings; a process out of descriptors gets some back); send `stop` to every worker
without waiting for socket room; join each for up to `_procs.JOIN_TIMEOUT_S`; SIGTERM the ones
still running (a stuck `__getitem__`), then SIGKILL after `_procs.KILL_TIMEOUT_S`; reap every
child; close sockets and sentinels. No step can raise.

Parent death: workers ignore SIGINT (Ctrl-C reaches the whole process group; the main
process decides) and must not outlive the main process, however it dies. Each worker
and the fork server ask the kernel for SIGKILL when their parent dies
(PR_SET_PDEATHSIG); forkserver workers ask it of the fork server, which asks it of the
main process. The kernel's "parent" is the *thread* that forked the child, so processes
are started from the main thread, or from kpipe's daemon spawner thread that lives as
long as the process (`_procs.start_process`) -- never from a short-lived thread, whose end
would kill them. A watchdog thread in each worker also checks `os.getppid()` every
`_worker._PARENT_POLL_S` (for systems without prctl), and workers exit when their socket
reaches EOF. Shared memory is anonymous (memfd): it cannot outlive the processes that
map it.
"""

import collections
import concurrent.futures
import itertools
import math
import os
import select
import sys
import threading
import time
import weakref
from multiprocessing import connection as mp_connection

from kpipe._engine import _autoscale, _pickling, _procs, _threads, _tree, _wire
from kpipe._engine import worker_info as _wi
from kpipe._engine._shm import SlotPool, fd_limit_error, is_fd_exhaustion, plan_layout, raise_fd_limit, take_interrupt
from kpipe._engine._procs import WORKER_ENV as _WORKER_ENV  # noqa: F401 (scripts/bench_loaders.py)
from kpipe._engine._procs import describe_exit
from kpipe._engine._worker import pack_exception
from kpipe.errors import (
    BatchTimeoutError,
    LoaderClosedError,
    LoaderError,
    WorkerDiedError,
)

# Slot descriptors a worker may hold at once (it keeps the mappings of all its slots):
# enough for the few slots it cycles through, independent of how many batches are held.
_WORKER_SLOT_FDS = 4
_START_METHODS = ("forkserver", "spawn", "fork")
# `fresh`: the worker had not mapped the task's slot before (its first use costs it the
# kernel's allocation or mapping of the slot's pages, a one-time delay).
_Task = collections.namedtuple("_Task", "worker key slot in_slot fresh")
_PREPARE = "prepare"  # in a worker's `pending`: it allocates a slot (`prepare_slots`)
_POLL_MAX_MS = 2**31 - 1  # poll()'s longest wait; a longer timeout waits again


class _KeyErrorMessage(str):
    """KeyError repr-quotes its message; this keeps the traceback readable (as PyTorch does)."""

    def __repr__(self):
        return self


def rebuild_exception(packed, where):
    """An exception of the worker's type whose message adds `where` and the worker traceback."""
    msg = (
        f"{packed['message']}\n\n[kpipe] Caught {packed['name']} {where}.\n"
        f"Original traceback from the worker:\n{packed['traceback']}"
    )
    exc_type = None
    if packed.get("type"):
        try:
            import cloudpickle

            exc_type = cloudpickle.loads(packed["type"])
        except Exception:
            exc_type = None
    exc = None
    if isinstance(exc_type, type) and issubclass(exc_type, BaseException):
        try:
            exc = exc_type(_KeyErrorMessage(msg) if issubclass(exc_type, KeyError) else msg)
        except Exception:
            exc = None
    if exc is None:
        exc = LoaderError(msg)
    exc.worker_traceback = packed["traceback"]
    return exc


def _idles(proc):
    """Whether live worker `proc` has no task (nor other message) pending."""
    return not proc.pending and proc.dead_error is None


class ProcessBackend:
    """Runs `target[key]` (mode "dataset") or `target(inputs)` (mode "function") in worker
    processes. Used from one thread at a time."""

    def __init__(self, target, *, num_workers, mode, start_method, timeout, seed, name, keep_idle, max_workers=None,
                 keep_payload=False, worker_threads=None):
        if start_method not in _START_METHODS:
            raise ValueError(
                f"Invalid value for argument `start_method`. Received: start_method={start_method!r}. "
                f"Expected one of {_START_METHODS} or None (spawn)."
            )
        if start_method == "fork" and ("tensorflow" in sys.modules or "jax" in sys.modules):
            raise ValueError(
                "`start_method='fork'` is unsafe here: TensorFlow is loaded in this process, and "
                "forking it deadlocks workers (keras-team/keras#11461). Received: "
                "start_method='fork'. Use start_method='spawn' (the default): kpipe's spawned "
                "workers start in ~0.2 s and do not import TensorFlow."
            )
        self.name = name
        self.timeout = timeout  # seconds; None or inf: no limit
        self._mode = mode
        # Threads per worker for its native pools (see the NOTE in _threads.py): fixed, or
        # max(1, CPUs // workers), sent again when the worker count changes.
        self._threads_fixed = _threads.check(worker_threads)
        self._cpu_limit = _autoscale.cpu_limit()
        self._threads = _threads.budget(self._cpu_limit, num_workers, self._threads_fixed)
        raise_fd_limit()  # once per process: one descriptor per live slot adds up
        self._slots = SlotPool(keep_idle=keep_idle)
        self._shared = _pickling.SharedArrays()
        self._procs = []
        self._poll_key, self._poller, self._poll_owners = None, None, {}  # see _poll_set
        self._finalizer = weakref.finalize(self, _procs.shutdown, self._procs, self._slots, self._shared)
        self._results = {}
        self._tasks = {}
        self._discarded = set()
        self._seq = itertools.count()
        self._exit_codes = {}
        self._zygote = None
        self.closed = False
        self._seed = seed
        self._start_method = start_method
        self._info_workers = max(num_workers, max_workers or 0)  # WorkerInfo.num_workers
        self._growable = self._info_workers > num_workers  # keeps the pickled target for new workers
        self._keep_payload = keep_payload  # ... or for `current_state` (loading ahead)
        self._payload = self._keys = self._zygote_keys = None
        # keep_payload: state_fingerprint of the target the workers hold (None: unknown)
        self._sent_fingerprint = None
        self._reset_since_fork = False  # the fork server holds an older target
        self.timings = [0, 0.0, 0.0, 0.0]  # batches done; their wall, CPU and run-queue seconds
        self._setup = [0.0, 0]  # seconds workers spent setting up slots, and the bytes set up
        self._slot_bytes = 0  # slot bytes the last batch used
        try:
            if start_method == "forkserver":
                # Start the server first: its interpreter and imports (~0.2 s) overlap
                # with pickling the dataset here.
                self._zygote = _procs.start_process(_procs.spawn_exec, -1, os.getpid(), "_zygote_main", self._threads)
                self._zygote.is_zygote = True
                self._procs.append(self._zygote)  # last in the list: stopped after the workers
            payload, keys = _pickling.dumps(target, self._shared, what=f"`{name}`")
            keys = sorted(keys)
            self._payload, self._keys = payload, keys
            if keep_payload:
                self._sent_fingerprint = _pickling.state_fingerprint(target, self._shared)
            if start_method == "forkserver":
                self._start_forked(num_workers, seed, mode, payload, keys)
            else:
                self._spawn_workers(list(range(num_workers)))
            self._forget_payload()
        except BaseException as exc:
            self.close()
            if is_fd_exhaustion(exc):
                raise fd_limit_error(exc, f"start the workers of `{name}`") from exc
            raise

    def _start_forked(self, num_workers, seed, mode, payload, keys):
        """Sends the fork server its target, then has it fork every worker (ms each)."""
        zygote = self._zygote
        cfg = {"mode": mode, "sys_path": [p for p in sys.path if p], "payload": payload, "array_keys": keys,
               "threads": self._threads}
        deadline = _wire.deadline_after(self.timeout)
        self._send(zygote, ("init", cfg), [self._shared.fd(k) for k in keys], deadline)
        self._zygote_keys = keys
        self._fork_workers(list(range(num_workers)), deadline)

    def _fork_workers(self, ids, deadline):
        """Has the fork server fork workers `ids`; they go before it in `_procs`."""
        from multiprocessing.connection import Connection

        zygote = self._zygote
        for wid in ids:
            self._send(zygote, ("fork", wid, self._info_workers, _wi.derive_seed(self._seed, wid), self._threads), (), deadline)
        workers = []
        while len(workers) < len(ids):
            msg = self._recv_zygote(deadline)
            if msg[0] == "forked":
                _, wid, pid = msg
                fd = _wire.recv_fds(zygote.conn, 1)[0]
                sentinel = None
                if hasattr(os, "pidfd_open"):
                    try:
                        sentinel = os.pidfd_open(pid)
                    except OSError:
                        sentinel = None
                proc = _procs.Proc(wid, Connection(fd), pid, _procs.ZygoteChild(pid, zygote.conn, self._exit_codes), sentinel)
                proc.array_keys = set(self._zygote_keys)
                workers.append(proc)
        workers.sort(key=lambda p: p.id)
        at = len(self._workers)
        self._procs[at:at] = workers  # before the server
        if self._reset_since_fork:  # they hold the server's (older) target: send the current one
            for proc in workers:
                self._send_state(proc, deadline)

    def _spawn_workers(self, ids):
        """Starts workers `ids` as fresh interpreters and sends each the current target."""
        procs = []
        for wid in ids:  # all start at once; each reads its init when up
            if self._start_method == "spawn":
                proc = _procs.start_process(_procs.spawn_exec, wid, os.getpid(), "_exec_main", self._threads)
            else:
                proc = _procs.start_process(_procs.spawn_fork, wid, os.getpid())
            procs.append(proc)
            self._procs.insert(len(self._workers), proc)
        deadline = _wire.deadline_after(self.timeout)
        for proc in procs:
            cfg = {
                "worker_id": proc.id,
                "num_workers": self._info_workers,
                "seed": _wi.derive_seed(self._seed, proc.id),
                "mode": self._mode,
                "sys_path": [p for p in sys.path if p],
                "payload": self._payload,
                "array_keys": self._keys,
                "threads": self._threads,
            }
            self._send(proc, ("init", cfg), [self._shared.fd(k) for k in self._keys], deadline)
            proc.array_keys = set(self._keys)

    def _forget_payload(self):
        if not (self._growable or self._keep_payload):  # no one needs the pickled copy again
            self._payload = None

    def _send_state(self, proc, deadline):
        new = sorted(k for k in self._keys if k not in proc.array_keys)
        drop = sorted(proc.array_keys - set(self._keys))
        proc.pending.append("state")
        self._send(proc, ("state", self._payload, new, drop), [self._shared.fd(k) for k in new], deadline)
        proc.array_keys = set(self._keys)

    # ------------------------------------------------- changing the worker count
    def add_worker(self, count=1):
        """Starts `count` more workers (forked by the fork server, or spawned); they
        take tasks at once. Returns their ids.

        Raises:
            LoaderError: with `start_method="fork"` once TensorFlow is loaded.
            WorkerDiedError, BatchTimeoutError: the fork server died or did not answer
                within `timeout` (the pool is then closed, as for any fatal failure).
        """
        self._check_open()
        self._reap_retired()
        if not self._growable or len(self._active) + count > self._info_workers:
            raise ValueError(
                f"Cannot run more than max_workers={self._info_workers} workers for `{self.name}`. "
                f"Received: count={count} with {len(self._active)} running."
            )
        if self._start_method == "fork" and ("tensorflow" in sys.modules or "jax" in sys.modules):
            raise LoaderError(
                f"Cannot add workers to `{self.name}`: start_method='fork' is unsafe once TensorFlow is "
                "loaded (keras-team/keras#11461). Use start_method='forkserver' (the default) or 'spawn'."
            )
        used = {p.id for p in self._workers}
        ids = [i for i in range(len(used) + count) if i not in used][:count]
        try:
            self._rebudget(len(self._active) + count)  # the running workers first: fewer threads each
            if self._zygote is not None:
                self._fork_workers(ids, _wire.deadline_after(self.timeout))
            else:
                self._spawn_workers(ids)
        except BaseException as exc:
            if is_fd_exhaustion(exc):
                self.close(force=True)
                raise fd_limit_error(exc, f"start more workers for `{self.name}`") from exc
            raise
        return ids

    def retire_worker(self):
        """Retires the live worker with the highest id: it takes no new task and stops once
        its pending tasks are answered (their batches are delivered as usual). Returns its
        id, or None when only one live worker is left."""
        self._check_open()
        self._reap_retired()
        live = [p for p in self._active if p.dead_error is None]
        if len(live) <= 1:
            return None
        proc = max(live, key=lambda p: p.id)
        proc.retiring = True
        self._stop_if_idle(proc)
        self._rebudget(len(self._active))  # the ones left may use more threads
        return proc.id

    # ------------------------------------------------------------- thread budget
    @property
    def worker_threads(self):
        """Threads each worker's native pools may use now (see `_threads.py`)."""
        return self._threads

    def thread_pools(self):
        """What the budget set in each worker taking tasks, as it last reported (workers
        report after starting and after each change): a list, by worker id, of
        `{"worker", "pid", "threads", "pools", "not_limited"}` -- `pools` one entry per
        library (`library`, `api`, `file`, `threads`, and `max_threads` where the library
        is built for fewer threads than the budget), `not_limited` what stays above the
        budget and why. A worker that has not reported yet shows `threads` None."""
        out = []
        for p in sorted(self._active, key=lambda p: p.id):
            report = p.pools or {"threads": None, "pools": [], "not_limited": []}
            out.append({"worker": p.id, "pid": p.pid, **report})
        return out

    def _rebudget(self, workers):
        """Sends every worker taking tasks the budget for `workers` workers, if it changed
        (without waiting: it applies between tasks). A worker found dead keeps the error
        for `get`, as with a task."""
        threads = _threads.budget(self._cpu_limit, workers, self._threads_fixed)
        if threads == self._threads:
            return
        self._threads = threads
        deadline = _wire.deadline_after(self.timeout)
        for proc in self._active:
            if proc.dead_error is None:
                self._send(proc, ("threads", threads), (), deadline, defer=True)

    def _stop_if_idle(self, proc):
        if proc.retiring and not proc.stopped and not proc.pending:
            proc.stopped = True
            try:  # never waits: an idle worker reads its socket
                _wire.send(proc.conn, ("stop",), (), time.monotonic())
            except BaseException:
                proc.signal(15)  # SIGTERM; it is reaped like any stopped worker

    def _reap_retired(self):
        """Forgets stopped workers whose exit is known (never waits)."""
        for proc in [p for p in self._procs if p.stopped and not p.alive]:
            if _procs.has_exited(proc):
                proc.release()
                self._procs.remove(proc)

    def _recv_zygote(self, deadline):
        zygote = self._zygote
        while True:
            remaining = _wire.remaining(deadline)
            if remaining is not None and remaining <= 0:
                self._fail(BatchTimeoutError(f"kpipe's fork server did not start the workers of `{self.name}` within timeout={self.timeout} s."))
            ready = mp_connection.wait([zygote.conn] + ([zygote.sentinel] if zygote.sentinel is not None else []), remaining)
            if zygote.conn in ready:
                try:
                    msg = zygote.conn.recv()
                except (EOFError, OSError):
                    self._fail(self._died(zygote))
                if msg[0] == "init-error":
                    self._fail(rebuild_exception(msg[1], f"in kpipe's fork server (pid {zygote.pid}) while unpickling `{self.name}`"))
                if msg[0] == "exited":
                    self._exit_codes[msg[1]] = msg[2]
                    continue
                if msg[0] == "ready":
                    continue
                return msg
            if ready:
                self._fail(self._died(zygote))

    @property
    def _workers(self):
        """Every worker process not yet reaped (retiring ones included)."""
        return [p for p in self._procs if not getattr(p, "is_zygote", False)]

    @property
    def _active(self):
        """The workers that take tasks (not retiring)."""
        return [p for p in self._procs if not p.retiring and not getattr(p, "is_zygote", False)]

    @property
    def num_workers(self):
        """Workers that take tasks now."""
        return len(self._active)

    @property
    def pids(self):
        return [p.pid for p in self._active]

    def needs_new_slot(self, for_idle_worker=True):
        """Whether a task submitted now would need a new slot, none being free, although
        every live worker is busy (or, with `for_idle_worker=False`, even if one idles).
        The owner may then wait for the consumer to release one (see the NOTE above)."""
        if self._slots.has_free():
            return False
        return not (for_idle_worker and self._a_worker_idles())

    def _a_worker_idles(self):
        """Whether a live worker that takes tasks has none."""
        return any(map(_idles, self._active))

    def slots_held(self):
        """Slots whose batches the consumer holds: handed out by `get`, not released."""
        busy = sum(1 + (t.in_slot is not None) for t in self._tasks.values())
        busy += sum(p.pending.count(_PREPARE) for p in self._procs)
        return self._slots.in_use() - busy

    @property
    def slot_releases(self):
        """How many batches the consumer has let go (the last array of each gone), ever;
        slots freed by discarded tasks or after `prepare` do not count."""
        return self._slots.lease_releases

    def _count_setup(self, seconds, nbytes):
        if seconds > 0 and nbytes > 0:
            self._setup[0] += seconds
            self._setup[1] += nbytes

    def slot_setup_s(self, nbytes=None):
        """What one more slot of `nbytes` (default: the last batch's size) costs a worker
        once, in seconds: growing, mapping and paging it in, at the rate the workers
        measured so far (0.0 before any measurement). On a virtual machine whose host
        takes freed memory back, this is where it shows: 77 MB slots took 46 ms to set
        up here on memory the guest had just used, 250-400 ms on memory handed back."""
        seconds, nbytes_set_up = self._setup
        nbytes = self._slot_bytes if nbytes is None else nbytes
        return seconds / nbytes_set_up * nbytes if nbytes_set_up else 0.0

    def mean_batch_s(self):
        """The mean time a worker took per batch so far (0.0 before the first)."""
        done, busy = self.timings[0], self.timings[1]
        return busy / done if done else 0.0

    def idle_workers(self):
        """How many live workers that take tasks have none."""
        return sum(map(_idles, self._active))

    def is_first_use(self, seq):
        """Whether task `seq` is its worker's first use of its slot."""
        task = self._tasks.get(seq)
        return task is not None and task.fresh

    def submit(self, key, inputs=None, seed=None):
        """Queues `target[key]` (or `target(inputs)`); with `seed`, the worker reseeds
        `random` and `numpy.random` with it first. Returns the task's `seq`."""
        self._check_open()
        seq = next(self._seq)
        free = self._slots.free_ids()
        proc = min(self._active, key=lambda p: _load(p, free))
        proc.last_task = seq
        slot, _ = self._slots.acquire(proc.known_slots)
        in_info = in_slot = None
        try:
            if inputs is not None:
                treedef, leaves, _ = _tree.flatten(inputs, what="input")
                layout = plan_layout(leaves)
                in_slot, _ = self._slots.acquire(proc.known_slots)
                self._slots.segments[in_slot].write(leaves, layout)
                in_info = (in_slot, treedef, layout)
        except BaseException:
            for s in (slot, in_slot):
                if s is not None:
                    self._slots.release(s)
            raise
        self._tasks[seq] = _Task(proc, key, slot, in_slot, slot not in proc.known_slots)
        if proc.dead_error is None:
            # A failure is raised by get(seq), when the consumer reaches this batch: the
            # batches before it (perhaps from other workers) are still delivered.
            self._send_with_slots(
                proc,
                lambda fd_slots, close, drops: ("task", seq, key, slot, in_info, fd_slots, close, drops, seed),
                [slot] if in_slot is None else [slot, in_slot],
                key=key,
                on_abort=lambda: self._release_task(seq),
            )
        proc.pending.append(seq)
        return seq

    def _send_with_slots(self, proc, make_msg, task_slots, key=None, on_abort=None):
        """Sends `make_msg(fd_slots, close, drops)` to `proc` with the descriptors of
        `task_slots` it lacks; returns True if sent (see `_send`). Interrupted before the
        message was written, it restores the descriptor bookkeeping, calls `on_abort()`
        and re-raises."""
        fd_slots, close = self._slot_fds(proc, task_slots)
        self._queue_drops()
        drops, proc.drops = proc.drops, []
        fds = [self._slots.segments[s].fd for s in fd_slots]
        try:
            sent = self._send(proc, make_msg(fd_slots, close, drops), fds, _wire.deadline_after(self.timeout), key=key, defer=True)
        except BaseException:  # interrupted before the message was written: forget it
            if not self.closed:
                for s in fd_slots:
                    proc.fd_slots.pop(s, None)
                for s in close:  # the worker still holds these
                    proc.fd_slots[s] = None
                    proc.fd_slots.move_to_end(s, last=False)
                proc.drops.extend(drops)
                if on_abort is not None:
                    on_abort()
            raise
        if sent:
            proc.known_slots.update(task_slots)
            proc.known_slots.difference_update(drops)
        return sent

    def prepare_slots(self, up_to):
        """Has each idle live worker allocate and map one new slot the size of the last
        batch, while fewer than `up_to` slots exist; the slots are free once ready, and
        that worker's next tasks prefer them. Returns how many were started.

        Every slot costs the kernel's allocation of its pages on first use (and, on
        virtual machines that hand freed memory back to the host, the host's too): a
        worker that would idle pays it now, instead of a batch in the consumer's way."""
        started, nbytes = 0, self._slot_bytes
        for proc in self._active:
            if not nbytes or len(self._slots) >= up_to:
                break
            if proc.pending or proc.dead_error is not None:
                continue
            slot = self._slots.create()
            sent = self._send_with_slots(
                proc,
                lambda fd_slots, close, drops: ("prepare", slot, nbytes, fd_slots, close, drops),
                [slot],
                on_abort=lambda: self._slots.release(slot),
            )
            if not sent:
                self._slots.release(slot)
                continue
            proc.pending.append(_PREPARE)
            started += 1
        return started

    def _slot_fds(self, proc, task_slots):
        """Which of `task_slots` need their descriptor sent to `proc`, and which held
        descriptors it must close to stay within `_WORKER_SLOT_FDS` (oldest first)."""
        held = proc.fd_slots
        send = [s for s in task_slots if s not in held]
        for s in task_slots:
            held[s] = None
            held.move_to_end(s)
        close = []
        while len(held) > max(_WORKER_SLOT_FDS, len(task_slots)):
            close.append(held.popitem(last=False)[0])
        return send, close

    def _queue_drops(self):
        for slot in self._slots.take_retired():
            for p in self._procs:
                if slot in p.known_slots:
                    p.drops.append(slot)
                    p.fd_slots.pop(slot, None)

    def _send(self, proc, msg, fds=(), deadline=None, key=None, defer=False):
        """Sends `msg` (and `fds`) to `proc` within `deadline`; returns True if sent.

        A dead worker is a WorkerDiedError, a socket still full at the deadline a
        BatchTimeoutError (the worker no longer reads). Either stops the pool when raised;
        with `defer`, it is kept as the worker's `dead_error` instead, for `get` to raise.
        """
        try:
            _wire.send(proc.conn, msg, fds, deadline)
            return True
        except _wire.SendTimeout:
            error = self._send_timed_out(proc, msg[0], key)
        except (OSError, EOFError, ValueError) as exc:  # BrokenPipe, ConnectionReset, closed
            if is_fd_exhaustion(exc):
                self._fail(fd_limit_error(exc, f"send a message to worker {proc.id} of `{self.name}`"))
            error = self._died(proc, key, doing=msg[0])
        except BaseException as exc:  # Ctrl-C while waiting for room in the socket
            if getattr(exc, "kpipe_torn", False):  # half a message: the stream is lost
                self.close(force=True)
            raise
        proc.dead_error = proc.dead_error or error
        if not defer:
            self._fail(proc.dead_error)
        return False

    def _send_timed_out(self, proc, kind, key):
        busy = next((self._tasks[s].key for s in proc.pending if s in self._tasks and self._tasks[s].key != key), None)
        what = {"init": f"`{self.name}` to start", "state": f"the new state of `{self.name}` (after on_epoch_end)"}.get(
            kind, f"batch {key} of `{self.name}`" if key is not None else f"a task of `{self.name}`"
        )
        who = "kpipe's fork server" if getattr(proc, "is_zygote", False) else f"Worker {proc.id}"
        doing = f"it is still loading batch {busy}" if busy is not None else "it does not read its socket"
        return BatchTimeoutError(
            f"{who} (pid {proc.pid}) did not take {what} within timeout={self.timeout} s: {doing}. "
            "If batches are legitimately this slow, raise `timeout`; otherwise look for a hang in "
            "__getitem__ (a deadlock, a stuck read). The loader stopped its workers; using it again "
            "starts new ones."
        )

    def get(self, seq, on_starved=None):
        """Waits for task `seq`; returns `(tree, treedef, meta)`, meta = [(dtype_str, shape)].

        `on_starved()`, if given, is called whenever a live worker is out of tasks while
        this one is still loading (after each message that leaves one idle), until it
        returns False: the caller may submit more. If the wait is interrupted (Ctrl-C),
        the task is discarded and its slot freed when it arrives.
        """
        self._check_open()
        deadline = _wire.deadline_after(self.timeout)
        try:
            take_interrupt()  # a Ctrl-C that landed in a lease's release (kpipe/_engine/_shm.py)
            while seq not in self._results:
                owner = self._tasks[seq].worker
                if owner.dead_error is not None:
                    self._fail(owner.dead_error)
                remaining = _wire.remaining(deadline)
                if remaining is not None and remaining <= 0:
                    self._fail(self._timed_out(seq))
                self._pump(remaining)
                if on_starved is not None and seq not in self._results and self._a_worker_idles():
                    if not on_starved():
                        on_starved = None
        except Exception:
            raise
        except BaseException:  # KeyboardInterrupt: nobody will ask for this batch again
            if not self.closed:
                self.discard(seq)
            raise
        result = self._results.pop(seq)
        task = self._tasks.pop(seq)
        if task.in_slot is not None:
            self._slots.release(task.in_slot)
        if result[0] == "error":
            self._slots.release(task.slot)
            where = (
                f"in kpipe worker {task.worker.id} (pid {task.worker.pid}) while loading "
                + (f"batch {task.key} of `{self.name}`" if self._mode == "dataset" else f"item {seq} with `{self.name}`")
            )
            exc = rebuild_exception(result[1], where)
            exc.kpipe_batch_index = task.key
            raise exc
        treedef, layout = result[1], result[2]
        seg = self._slots.segments[task.slot]
        leaves = seg.views(layout, lease=self._slots.lease(task.slot), writable=True)
        return _tree.unflatten(treedef, leaves), treedef, [(d, s) for _, _, d, s in layout]

    def discard(self, seq):
        """Forgets task `seq`: its result is dropped (and its slot freed) when it arrives."""
        if seq in self._results:
            self._results.pop(seq)
            self._release_task(seq)
        elif seq in self._tasks:
            self._discarded.add(seq)

    def _release_task(self, seq):
        task = self._tasks.pop(seq)
        self._slots.release(task.slot)
        if task.in_slot is not None:
            self._slots.release(task.in_slot)

    def reset_target(self, target, dumped=None):
        """Sends a new version of the target (e.g. after `on_epoch_end`) to every worker.

        Call it with no task in flight (discarded ones may still be). Waits until every
        worker has loaded it. Shared arrays the new version no longer holds (replaced
        rather than edited) are freed here and dropped by every worker. Sending and
        waiting together take at most `timeout`.

        Args:
            target: The new version.
            dumped: `dump(target)`'s result if the caller pickled it already.

        Raises:
            BatchTimeoutError: a worker did not take or load the new state in time.
            WorkerDiedError: a worker is dead (e.g. it died between batches).
        """
        self._check_open()
        deadline = _wire.deadline_after(self.timeout)
        self._raise_if_a_worker_died()
        payload, keys = (dumped[0], dumped[1]) if dumped is not None else self.dump(target)[:2]
        self._send_state_to_all(payload, keys, deadline)
        if self._keep_payload and target is not None:
            self._sent_fingerprint = _pickling.state_fingerprint(target, self._shared)
        while any(p.pending for p in self._active):
            self._raise_if_a_worker_died()
            remaining = _wire.remaining(deadline)
            if remaining is not None and remaining <= 0:
                slow = [p for p in self._active if "state" in p.pending]
                self._fail(self._send_timed_out(slow[0], "state", None) if slow else BatchTimeoutError(
                    f"Workers of `{self.name}` did not finish their batches within timeout={self.timeout} s."
                ))
            self._pump(remaining)

    def dump(self, target):
        """Pickles `target` as the workers would get it. Returns `(payload, keys,
        rewrote)`: `rewrote` is True if a shared array's copy was rewritten (the target
        edited it in place since the last dump)."""
        rewrites = self._shared.rewrites
        payload, keys = _pickling.dumps(target, self._shared, what=f"`{self.name}`")
        return payload, sorted(keys), self._shared.rewrites != rewrites

    def current_state(self):
        """`(payload, keys)` the workers hold now (with `keep_payload=True`; keys sorted)."""
        return self._payload, list(self._keys)

    def same_state(self, target):
        """Whether `target` holds the state the workers hold, though it pickles to other
        bytes: the `state_fingerprint`s are equal (keep_payload; taken only here and when
        a state is sent, not at every `dump`)."""
        if self._sent_fingerprint is None:
            return False
        return _pickling.state_fingerprint(target, self._shared) == self._sent_fingerprint

    @property
    def shared(self):
        return self._shared

    def send_state(self, payload, keys):
        """Queues a new target version (`dump` output holding only arrays the workers
        hold) behind each worker's tasks, without waiting: tasks submitted afterwards
        run on it. New workers get it too."""
        self._check_open()
        if sorted(keys) != self._keys:
            raise ValueError(f"send_state takes the shared arrays the workers hold ({self._keys}); received {sorted(keys)}")
        self._raise_if_a_worker_died()
        self._send_state_to_all(payload, keys, _wire.deadline_after(self.timeout))

    def _raise_if_a_worker_died(self):
        for p in self._active:
            if p.dead_error is not None:
                self._fail(p.dead_error)

    def _send_state_to_all(self, payload, keys, deadline):
        self._payload, self._keys, self._reset_since_fork = payload, sorted(keys), True
        self._sent_fingerprint = None  # (reset_target sets it again from its target)
        for p in self._active:
            self._send_state(p, deadline)
        self._forget_payload()
        self._shared.retain(set(keys))

    def _poll_set(self):
        """A `select.poll` with the sockets and sentinels of the live workers, made anew
        only when they change (not per wait, as `multiprocessing.connection.wait` does),
        and which process each descriptor belongs to: `(proc, is_sentinel, probe)`, where
        `probe` polls that worker's socket alone, without waiting (`Connection.poll()`
        builds a selector per call: ~10 us, twice or more per batch)."""
        live = [p for p in self._procs if p.dead_error is None and p.alive]
        key = [(p, p.conn.fileno(), p.sentinel) for p in live]
        if key != self._poll_key:  # the cache holds the processes: their ids stay unique
            poller, owners = select.poll(), {}
            for proc, fd, sentinel in key:
                probe = select.poll()
                probe.register(fd, select.POLLIN)
                for f, is_sentinel in ((fd, False), (sentinel, True)):
                    if f is not None:
                        poller.register(f, select.POLLIN)
                        owners[f] = (proc, is_sentinel, probe)
            self._poll_key, self._poller, self._poll_owners = key, poller, owners
        return self._poller, self._poll_owners

    def _drain(self, proc, probe):
        """Handles every message `proc` has sent so far. A `Connection` buffers nothing
        itself, so a readable socket holds a message, or EOF (then `recv` raises)."""
        while probe.poll(0):
            self._handle(proc, proc.conn.recv())

    def _pump(self, timeout):
        poller, owners = self._poll_set()
        events = poller.poll(None if timeout is None else min(math.ceil(timeout * 1000), _POLL_MAX_MS))
        ready = [owners[fd] for fd, _ in events if fd in owners]
        dead = []
        for proc, is_sentinel, probe in ready:
            if is_sentinel:
                continue
            try:
                self._drain(proc, probe)
            except (EOFError, OSError):
                dead.append(proc)
        for proc, is_sentinel, probe in ready:
            if is_sentinel and proc not in dead:
                try:  # a last message may still be buffered
                    self._drain(proc, probe)
                except (EOFError, OSError):
                    pass
                dead.append(proc)
        for proc in dead:
            if proc.stopped:  # a retired worker ended, as asked
                proc.alive = False
                continue
            # Batches this worker already delivered stay valid; the error is raised when
            # the consumer reaches a batch that this worker can no longer deliver.
            proc.dead_error = self._died(proc)
            if getattr(proc, "is_zygote", False):
                self._fail(proc.dead_error)

    def _handle(self, proc, msg):
        kind = msg[0]
        if kind == "exited":  # from the fork server
            self._exit_codes[msg[1]] = msg[2]
        elif kind in ("done", "error"):
            seq = msg[1]
            if seq in self._tasks:
                proc.last_key = self._tasks[seq].key
            if proc.pending and proc.pending[0] == seq:
                proc.pending.popleft()
            else:
                try:
                    proc.pending.remove(seq)
                except ValueError:
                    pass
            if kind == "done":
                self._slot_bytes = max((o + n for o, n, _, _ in msg[3]), default=0)
                t = self.timings
                t[0] += 1
                t[1] += msg[4]
                t[2] += msg[5]
                t[3] += msg[6]
                self._count_setup(msg[7], self._slot_bytes)
            if seq in self._discarded:
                self._discarded.discard(seq)
                self._release_task(seq)
            else:
                self._results[seq] = (kind,) + tuple(msg[2:])
            if proc.retiring:
                self._stop_if_idle(proc)
        elif kind == "state-ok":
            proc.pending.remove("state")
        elif kind == "threads":
            proc.pools = msg[1]
        elif kind == "prepared":
            proc.pending.remove(_PREPARE)
            self._count_setup(msg[2], self._slot_bytes)
            self._slots.release(msg[1])
            if proc.retiring:
                self._stop_if_idle(proc)
        elif kind == "init-error":
            exc = rebuild_exception(msg[1], f"in kpipe worker {proc.id} (pid {proc.pid}) while unpickling `{self.name}`")
            self._fail(exc)
        # "ready" needs no action: tasks were queued behind init already.

    def _died(self, proc, key=None, doing=None):
        code = proc.exitcode(1.0)
        proc.alive = False
        if getattr(proc, "is_zygote", False):
            return WorkerDiedError(
                f"kpipe's fork server (pid {proc.pid}) for `{self.name}` {describe_exit(code)} "
                "Its workers stop with it; using the loader again starts new ones."
            )
        running = next((s for s in proc.pending if s in self._tasks), None)
        loading = self._tasks[running].key if running in self._tasks else None
        if self._mode == "function" and running is not None:
            what = f"while running `{self.name}` on item {running}"
        elif loading is not None:
            what = f"while loading batch {loading} of `{self.name}`"
        else:
            what = f"while idle, after loading batch {proc.last_key} of `{self.name}`" if proc.last_key is not None else f"while idle (`{self.name}`)"
            if doing == "state":
                what += " (found when sending it the new state of the dataset, after on_epoch_end)"
            elif key is not None:
                what += f" (found when sending it batch {key})"
        return WorkerDiedError(f"Worker {proc.id} (pid {proc.pid}) {what}: it {describe_exit(code)}")

    def _timed_out(self, seq):
        task = self._tasks.get(seq)
        who = f"worker {task.worker.id} (pid {task.worker.pid})" if task else "a worker"
        key = task.key if task else seq
        return BatchTimeoutError(
            f"Batch {key} of `{self.name}` did not arrive within timeout={self.timeout} s from {who}, "
            "which is still running. If batches are legitimately this slow, raise `timeout`; "
            "otherwise look for a hang in __getitem__ (a deadlock, a stuck read). The loader "
            "stopped its workers; using it again starts new ones."
        )

    def _fail(self, exc):
        self.close(force=True)
        raise exc

    def _check_open(self):
        if self.closed:
            raise LoaderClosedError(f"The worker pool of `{self.name}` is closed.")

    def close(self, force=False):
        self.closed = True
        if force:
            _procs.shutdown(self._procs, self._slots, self._shared, force=True)
        self._finalizer()


def _load(proc, free=frozenset()):
    """Least-loaded first, so tasks follow the live worker list; among those, a worker
    that has mapped one of the `free` slots (it writes there without paying for a first
    mapping), then the worker given a task longest ago (round-robin when batches take
    equal times)."""
    return len(proc.pending), free.isdisjoint(proc.known_slots), proc.last_task, proc.id


class ThreadBackend:
    """Runs `target[key]` in a thread pool: for I/O-bound work that releases the GIL."""

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

    pids = property(lambda self: [])

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


class InlineBackend:
    """Runs `target[key]` in the calling thread when the result is asked for (`workers=0`)."""

    def __init__(self, target, *, mode, name):
        self.name = name
        self._target = target
        self._mode = mode
        self._todo = {}
        self._seq = itertools.count()
        self.closed = False

    pids = property(lambda self: [])

    def submit(self, key, inputs=None, seed=None):  # the calling thread's RNGs stay the user's
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
    return _tree.unflatten(treedef, leaves), treedef, [(a.dtype.str, a.shape) for a in leaves]


def _add_note(exc, note):
    if hasattr(exc, "add_note"):
        exc.add_note(note)


__all__ = ["InlineBackend", "ProcessBackend", "ThreadBackend", "describe_exit", "pack_exception", "rebuild_exception"]
