"""Main-process side of the engine: backends that run `target[key]` (or `target(inputs)`).

`ProcessBackend`: persistent worker processes, batches in shared-memory slots -- the
backend protocol of `_backend.py` with every capability (`ThreadBackend` and
`InlineBackend`, in `_local.py`, have none).

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
in flight and when a task may take a new slot (the loader's window, see `fill` and
`starved` in `kpipe/_engine/_window.py`):
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

A new target version is not waited for (`reset_target` after a hook, and `send_state`
for `epoch_end_ahead=True`): the `state` message goes behind each worker's pending
tasks, which still run on the old version; tasks submitted after it run on the new one
(a worker handles its messages in order), so the workers unpickle it while this process
submits the next pass. `send_state`'s may hold only the shared arrays the workers
already map.

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

"""

import collections
import itertools
import math
import select
import weakref

from kpipe._engine import _pickling, _procs, _tree, _wire
from kpipe._engine._backend import Backend
from kpipe._engine._workerset import WorkerSet, work_pending
from kpipe._engine._shm import SlotPool, fd_limit_error, is_fd_exhaustion, plan_layout, raise_fd_limit, take_interrupt
from kpipe._engine._procs import WORKER_ENV as _WORKER_ENV  # noqa: F401 (scripts/bench_loaders.py)
from kpipe._engine._procs import describe_exit
from kpipe._engine._worker import fork_hazard, pack_exception, rebuild_exception
from kpipe.errors import (
    BatchTimeoutError,
    LoaderClosedError,
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


class ProcessBackend(WorkerSet, Backend):
    """Runs `target[key]` (mode "dataset") or `target(inputs)` (mode "function") in worker
    processes. Used from one thread at a time."""

    keeps_copy = has_slots = can_send_state = can_resize = thread_budget = True

    def __init__(self, target, *, num_workers, mode, start_method, timeout, seed, name, keep_idle, max_workers=None,
                 keep_payload=False, worker_threads=None):
        if start_method not in _START_METHODS:
            raise ValueError(
                f"Invalid value for argument `start_method`. Received: start_method={start_method!r}. "
                f"Expected one of {_START_METHODS} or None (spawn)."
            )
        hazard = fork_hazard() if start_method == "fork" else None
        if hazard:
            raise ValueError(
                f"`start_method='fork'` is unsafe here: {hazard}. Received: start_method='fork'. Use "
                "start_method='forkserver' (the default: a fresh server process forks the workers) or "
                "'spawn'; neither imports TensorFlow or starts JAX's runtime in the workers."
            )
        self.name = name
        self.timeout = timeout  # seconds; None or inf: no limit
        self._mode = mode
        self._init_workers(num_workers=num_workers, max_workers=max_workers, start_method=start_method, seed=seed,
                           worker_threads=worker_threads)
        raise_fd_limit()  # once per process: one descriptor per live slot adds up
        self._slots = SlotPool(keep_idle=keep_idle)
        self._shared = _pickling.SharedArrays()
        self._poll_key, self._poller, self._poll_owners = None, None, {}  # see _poll_set
        self._finalizer = weakref.finalize(self, _procs.shutdown, self._procs, self._slots, self._shared)
        self._results = {}
        self._tasks = {}
        self._discarded = set()
        self._seq = itertools.count()
        self.closed = False
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
                self._start_server()
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

    def _forget_payload(self):
        if not (self._growable or self._keep_payload):  # no one needs the pickled copy again
            self._payload = None

    def _send_state(self, proc, deadline):
        new = sorted(k for k in self._keys if k not in proc.array_keys)
        drop = sorted(proc.array_keys - set(self._keys))
        proc.pending.append("state")
        self._send(proc, ("state", self._payload, new, drop), [self._shared.fd(k) for k in new], deadline)
        proc.array_keys = set(self._keys)

    def needs_new_slot(self, for_idle_worker=True):
        """Whether a task submitted now would need a new slot, none being free, although
        every live worker is busy (or, with `for_idle_worker=False`, even if one idles).
        The owner may then wait for the consumer to release one (see the NOTE above)."""
        if self._slots.has_free():
            return False
        return not (for_idle_worker and self._a_worker_idles())

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
        """Sends a new version of the target (e.g. after `on_epoch_end`) to every worker,
        behind their discarded tasks (call it with no other task in flight), without
        waiting for them to load it (NOTE above). A worker that fails to load it fails the
        pool at the next wait. Shared arrays the new version no longer holds are freed here
        and dropped by every worker. Sending takes at most `timeout`.

        Args:
            target: The new version.
            dumped: `dump(target)`'s result if the caller pickled it already, optionally
                with the target's `fingerprint` as a third item (so it is not taken twice).

        Raises:
            BatchTimeoutError: a worker did not take the new state in time.
            WorkerDiedError: a worker is dead (e.g. it died between batches).
        """
        self._check_open()
        deadline = _wire.deadline_after(self.timeout)
        self._raise_if_a_worker_died()
        payload, keys = (dumped[0], dumped[1]) if dumped is not None else self.dump(target)[:2]
        self._send_state_to_all(payload, keys, deadline)
        self._pump(0)  # a worker found dead by the send (EPIPE) or its sentinel
        self._raise_if_a_worker_died()
        if self._keep_payload and target is not None:
            taken = dumped is not None and len(dumped) > 2
            self._sent_fingerprint = dumped[2] if taken else self.fingerprint(target)

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

    def same_state(self, fingerprint):
        """Whether a target of this `fingerprint` (`fingerprint(target)`) holds the state
        the workers hold, though it pickles to other bytes (keep_payload; fingerprints
        are taken only for this and when a state is sent, not at every `dump`)."""
        return fingerprint is not None and fingerprint == self._sent_fingerprint

    def fingerprint(self, target):
        """`target`'s `state_fingerprint` (None where it cannot be taken)."""
        return _pickling.state_fingerprint(target, self._shared)

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
        self._sent_fingerprint = None  # (unknown: a later same_state compares payloads only)

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
            pinned = msg[8] if kind == "done" else msg[3]
            if pinned and seq in self._tasks:  # the dataset kept memory of this slot (NOTE in _alloc.py)
                self._slots.pin(self._tasks[seq].slot)
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
        pending = list(task.worker.pending) if task is not None else []
        ahead = pending[: pending.index(seq)] if seq in pending else []  # what it must finish first
        earlier = next((self._tasks[s].key for s in ahead if s in self._tasks), None)
        state = (f"which is still loading batch {earlier}, given to it earlier" if earlier is not None else
                 "which is still loading the new state of the dataset (after on_epoch_end)" if "state" in ahead
                 else "which is still running")
        return BatchTimeoutError(
            f"Batch {key} of `{self.name}` did not arrive within timeout={self.timeout} s from {who}, "
            f"{state}. If batches are legitimately this slow, raise `timeout`; "
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
    return work_pending(proc), free.isdisjoint(proc.known_slots), proc.last_task, proc.id


__all__ = ["ProcessBackend", "describe_exit", "pack_exception", "rebuild_exception"]
