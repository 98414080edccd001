"""The worker processes of a `ProcessBackend` (`_pool.py`): starting them, adding and
retiring them, their thread budget, and which of them take tasks.

`WorkerSet` is mixed into `ProcessBackend`, which does the dispatch and the receiving
(tasks, slots, results, the target's versions); the two meet at a few names the backend
provides -- `_send(proc, msg, fds, deadline, defer=False)`, `_fail(exc)`, `_died(proc)`,
`_send_state(proc, deadline)`, `timeout`, `name`, `_mode`, and the target's pickled state
(`_payload`, `_keys`, `_zygote_keys`, `_reset_since_fork`, `_shared`) -- and at what this
class keeps: `_procs` (workers by id, then the fork server), `_zygote`, `_exit_codes`,
the budget (`_threads`) and the counts (`_info_workers`, `_growable`).

NOTE [ Workers: their number, their threads, their parent ]
------------------------------------------------------------
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

import os
import sys
import time

from kpipe._engine import _autoscale, _procs, _threads, _wire
from kpipe._engine import worker_info as _wi
from kpipe._engine._shm import fd_limit_error, is_fd_exhaustion
from kpipe._engine._worker import fork_hazard, rebuild_exception
from kpipe.errors import BatchTimeoutError, LoaderError
from multiprocessing import connection as mp_connection


def work_pending(proc):
    """How many of worker `proc`'s pending messages are work (tasks, slot set-ups): a new
    state of the target (`reset_target`) is not, as every worker gets it and tasks sent
    behind it wait for it alike -- a worker loading it takes tasks as an idle one does."""
    return len(proc.pending) - proc.pending.count("state") if proc.pending else 0


def _idles(proc):
    """Whether live worker `proc` has no work pending (`work_pending`)."""
    return proc.dead_error is None and not work_pending(proc)


class WorkerSet:
    """The workers of one backend (see the module docstring). Used from one thread."""

    def _init_workers(self, *, num_workers, max_workers, start_method, seed, worker_threads):
        # Threads per worker for its native pools (see the NOTE in _threads.py): fixed, or
        # max(1, CPUs // workers), sent again when the worker count changes.
        self._threads_fixed = _threads.check(worker_threads)
        self._cpu_limit = _autoscale.cpu_limit()
        self._threads = _threads.budget(self._cpu_limit, num_workers, self._threads_fixed)
        self._procs = []
        self._exit_codes = {}
        self._zygote = None
        self._seed = seed
        self._start_method = start_method
        self._info_workers = max(num_workers, max_workers or 0)  # WorkerInfo.num_workers
        self._growable = self._info_workers > num_workers  # keeps the pickled target for new workers

    def _start_server(self):
        """Starts the fork server first: its interpreter and imports (~0.2 s) overlap with
        pickling the dataset here."""
        self._zygote = _procs.start_process(_procs.spawn_exec, -1, os.getpid(), "_zygote_main", self._threads)
        self._zygote.is_zygote = True
        self._procs.append(self._zygote)  # last in the list: stopped after the workers

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
        hazard = fork_hazard() if self._start_method == "fork" else None
        if hazard:
            raise LoaderError(
                f"Cannot add workers to `{self.name}`: start_method='fork' is unsafe here: {hazard}. "
                "Use start_method='forkserver' (the default) or 'spawn'."
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

    def _a_worker_idles(self):
        """Whether a live worker that takes tasks has none."""
        return any(map(_idles, self._active))

    def idle_workers(self):
        """How many live workers that take tasks have none."""
        return sum(map(_idles, self._active))
