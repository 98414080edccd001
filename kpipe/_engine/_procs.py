"""Worker processes as the main process sees them: starting, watching, stopping.

`ProcessBackend` (`_pool.py`) owns the workers; this module holds the mechanics -- how a
worker is started (`spawn_exec`: a fresh interpreter; `spawn_fork`; the fork server's
children are `ZygoteChild`ren), from which thread (`start_process`, see the NOTE in
`_pool.py` on parent death), and how a pool is shut down (`shutdown`, which never raises).
"""

import collections
import concurrent.futures
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import kpipe
from kpipe._engine import _threads, _wire
from kpipe.errors import LoaderError

JOIN_TIMEOUT_S = 2.0
KILL_TIMEOUT_S = 2.0
SPAWN_TIMEOUT_S = 60.0
# glibc keeps freed buffers for reuse instead of unmapping them, so a worker that allocates
# fresh arrays per call reuses warm pages instead of page-faulting and zeroing new ones:
# temporaries up to 32 MiB (the largest mmap threshold glibc takes; 600 KB per-sample
# temporaries cost 38,000 page faults per batch otherwise) and, with no mmap at all
# (MALLOC_MMAP_MAX_=0), bigger ones too -- a 77 MB `np.stack` batch per call: +22% samples/s
# for such a dataset (`python scripts/bench_loaders.py --workloads b-stack`). Freed memory
# stays in the worker's heap up to MALLOC_TRIM_THRESHOLD_ (1 GiB) before it is returned.
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_MMAP_MAX_": "0"}


def describe_exit(code):
    if code is None:
        return "exited (exit code unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {
            signal.SIGKILL: " It was killed, often by the kernel's out-of-memory killer; lower "
            "`max_queue_size` or `workers`, or check the dataset for memory growth.",
            signal.SIGSEGV: " It crashed in native code (a segmentation fault), e.g. in a C "
            "extension used by __getitem__.",
        }.get(-code, "")
        return f"was killed by {name} (exit code {code}).{hint}"
    return (
        f"exited with code {code}. Something in the dataset ended the process (sys.exit, "
        "os._exit); raise an exception instead so it can be reported."
    )


class Proc:
    """One worker process as seen from the main process."""

    def __init__(self, wid, conn, pid, handle, sentinel):
        self.id = wid
        self.conn = conn
        self.pid = pid
        self.handle = handle  # subprocess.Popen or multiprocessing.Process
        self.sentinel = sentinel  # waitable fd or None
        self.known_slots = set()  # slots this worker has mapped
        self.fd_slots = collections.OrderedDict()  # slots whose descriptor it holds, oldest first
        self.drops = []
        self.pending = collections.deque()  # seqs sent, not answered, in order
        self.array_keys = set()  # shared dataset arrays whose fds this worker holds
        self.alive = True
        self.dead_error = None  # set when the worker is found dead
        self.last_key = None  # the last batch it delivered (or failed)
        self.retiring = False  # gets no new tasks; is stopped once it has none (workers="auto")
        self.stopped = False  # was sent `stop` while the pool goes on
        self.last_task = -1  # seq of the last task it was given (ties go round-robin)
        self.pools = None  # what its thread budget set, as it last reported (_threads.PoolLimiter)

    def exitcode(self, wait_s=0.0):
        h = self.handle
        if isinstance(h, (subprocess.Popen, ZygoteChild)):
            try:
                return h.wait(timeout=wait_s) if wait_s else h.poll()
            except subprocess.TimeoutExpired:
                return None
        h.join(wait_s if wait_s else 0)
        return h.exitcode

    def signal(self, sig):
        try:
            os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def release(self):
        """Closes the socket and sentinel (after the process is reaped)."""
        self.alive = False
        quietly(self.conn.close)
        if isinstance(self.handle, (subprocess.Popen, ZygoteChild)):
            close_fd(self.sentinel)  # our pidfd
        else:  # multiprocessing owns a fork child's sentinel: closing it here closed it twice
            quietly(self.handle.close)
        self.sentinel = None


class ZygoteChild:
    """A worker forked by the fork server: Popen-like `poll`/`wait`. Its exit code comes
    from the server's ("exited", pid, code) messages (only a parent can reap a child)."""

    def __init__(self, pid, zygote_conn, codes):
        self.pid = pid
        self._conn = zygote_conn
        self._codes = codes

    def _drain(self):
        if self._codes.get("eof"):
            return
        try:
            while self._conn.poll():
                msg = self._conn.recv()
                if msg[0] == "exited":
                    self._codes[msg[1]] = msg[2]
        except (EOFError, OSError, ValueError):
            self._codes["eof"] = True  # the server is gone: no more codes will come

    def _gone(self):
        import psutil

        try:
            return psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def _wait_code(self, wait_s):
        deadline = time.monotonic() + wait_s
        while self.pid not in self._codes and not self._codes.get("eof") and time.monotonic() < deadline:
            try:
                if self._conn.poll(0.01):
                    self._drain()
            except (OSError, ValueError):
                break
        return self._codes.get(self.pid)

    def poll(self):
        self._drain()
        if self.pid in self._codes:
            return self._codes[self.pid]
        if self._gone():
            code = self._wait_code(0.5)
            return -1 if code is None else code
        return None

    def wait(self, timeout=None):
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while True:
            self._drain()
            if self.pid in self._codes:
                return self._codes[self.pid]
            if self._gone():
                return self._wait_code(1.0)  # the server reaps it and reports the code
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("kpipe-worker", timeout)
            time.sleep(0.005)


_spawner_lock = threading.Lock()
_spawner_queue = None


def _spawner_loop(requests):
    while True:
        fn, args, future = requests.get()
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as exc:
                future.set_exception(exc)


def _reset_spawner():
    global _spawner_lock, _spawner_queue
    _spawner_lock = threading.Lock()  # it may have been held by a thread the fork left behind
    _spawner_queue = None  # a forked child has no spawner thread: start one on demand


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_spawner)


def start_process(fn, *args):
    """Runs `fn(*args)` (which starts a worker process) in a thread that lives as long as
    this process: the main thread, or else kpipe's daemon spawner thread.

    Workers ask the kernel to kill them when their parent dies (PR_SET_PDEATHSIG), and
    the kernel's "parent" is the *thread* that forked them: a worker started from a
    thread that ends sooner (a Keras or TensorFlow pool thread, a ThreadPoolExecutor)
    would be killed with it.
    """
    global _spawner_queue
    if threading.current_thread() is threading.main_thread():
        return fn(*args)
    with _spawner_lock:
        if _spawner_queue is None:
            _spawner_queue = queue.SimpleQueue()
            threading.Thread(target=_spawner_loop, args=(_spawner_queue,), name="kpipe-spawner", daemon=True).start()
        requests = _spawner_queue
    future = concurrent.futures.Future()
    requests.put((fn, args, future))
    try:
        return future.result(timeout=SPAWN_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise LoaderError(f"kpipe could not start a worker process within {SPAWN_TIMEOUT_S:.0f} s.") from None


def spawn_exec(wid, parent_pid, entry="_exec_main", threads=None):
    """Starts a fresh interpreter running `kpipe._engine._worker.<entry>`; it never
    re-imports `__main__` (unlike multiprocessing's spawn), so a script's top-level
    `import tensorflow` does not run again in workers. With `threads`, its native thread
    pools start at that size (`_threads.env`: NumPy's OpenBLAS loads with the worker)."""
    import socket
    from multiprocessing.connection import Connection

    ours, theirs = socket.socketpair()
    env = dict(os.environ, **WORKER_ENV)
    if threads is not None:
        env.update(_threads.env(threads))
    root = os.path.dirname(os.path.dirname(os.path.abspath(kpipe.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    code = f"from kpipe._engine._worker import {entry}; {entry}()"
    try:
        popen = subprocess.Popen(
            [sys.executable, "-c", code, str(theirs.fileno()), str(parent_pid)],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
    finally:
        theirs.close()
    sentinel = None
    if hasattr(os, "pidfd_open"):
        try:
            sentinel = os.pidfd_open(popen.pid)
        except OSError:
            sentinel = None
    return Proc(wid, Connection(ours.detach()), popen.pid, popen, sentinel)


def spawn_fork(wid, parent_pid):
    import multiprocessing

    from kpipe._engine._worker import _fork_main

    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_fork_main, args=(theirs, parent_pid), daemon=True, name=f"kpipe-worker-{wid}")
    proc.start()
    theirs.close()
    return Proc(wid, ours, proc.pid, proc, proc.sentinel)


def has_exited(proc):
    """True once a stopped worker's exit is known (reaped); never waits."""
    h = proc.handle
    if isinstance(h, subprocess.Popen):
        return h.poll() is not None
    if isinstance(h, ZygoteChild):  # the fork server reaps it and reports the code
        h._drain()
        return h.pid in h._codes or bool(h._codes.get("eof"))
    h.join(0)
    return h.exitcode is not None


def close_fd(fd):
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def quietly(fn, *args):
    try:
        return fn(*args)
    except Exception:  # shutdown must finish whatever fails (no fds left, a reaped pid)
        return None


def shutdown(procs, slots, shared, force=False):
    """Stops and reaps workers, then frees shared memory. Safe to call twice; never raises.

    Our descriptors go first: batches still held keep their mappings (not descriptors),
    workers keep their own, and a process that ran out of descriptors gets some back for
    the rest of the shutdown.
    """
    quietly(slots.close)
    quietly(shared.close)
    if not force:
        now = time.monotonic()
        for p in procs:
            if p.alive:  # never waits: a worker whose socket is full is stopped by signal
                quietly(_wire.send, p.conn, ("stop",), (), now)
    deadline = time.monotonic() + (0 if force else JOIN_TIMEOUT_S)
    for p in procs:
        if quietly(p.exitcode, max(0.0, deadline - time.monotonic()) or 0.001) is None:
            p.signal(signal.SIGTERM)
    for p in procs:
        if quietly(p.exitcode, KILL_TIMEOUT_S) is None:
            p.signal(signal.SIGKILL)
            quietly(p.exitcode, KILL_TIMEOUT_S)
        p.release()
    procs.clear()
