"""The worker process: receive a target, load batches into shared-memory slots.

Runs in a fresh interpreter (`spawn`, via `_exec_main`), a child forked by kpipe's fork
server (`forkserver`, see `_zygote_main`), or a forked child of the main process (`fork`).
Imports only the standard library, NumPy and cloudpickle -- never TensorFlow, unless the
user's dataset does.

Protocol (main -> worker, over one Unix socket, after `init`):
  ("init", cfg)                                         then the shared-array fds
  ("task", seq, key, out_slot, inputs, fds, close, drop, seed) then the fds of the slots in `fds`
  ("state", payload, new_keys, drop_keys)                then the fds of the new arrays
  ("prepare", slot, nbytes, fds, close, drop)           then the fds of the slots in `fds`
  ("threads", n)                                        the thread budget changed
  ("stop",)
worker -> main:
  ("ready", pid) | ("init-error", exc) | ("done", seq, treedef, layout, busy_s, cpu_s, runq_s, setup_s, pinned)
  ("error", seq, exc, pinned) | ("state-ok",) | ("prepared", slot, setup_s) | ("threads", report)

Thread budget: `cfg["threads"]` (and `("threads", n)` later) is how many threads the
worker's native pools (BLAS, OpenMP, OpenCV, TensorFlow) may use; the worker sets the
environment before unpickling the target, limits what is loaded after, and answers each
application with `("threads", report)` (unasked too, after a message during which the
dataset imported modules: they may bring pools of their own). The NOTE in `_threads.py`
says how each start method gets it; the consumer process is never limited.

`prepare` has an idle worker allocate and map the first `nbytes` of a new slot (what its
first batch there would otherwise pay; see the NOTE in `_pool.py`).

Descriptors: a worker maps each shared dataset array once and closes its descriptor at
once (arrays never change size; a changed one comes back under a new key). It keeps the
mapping of every slot it has written but holds a slot's descriptor only while the main
process says so: `fds` hands over descriptors for this task's slots, `close` names the
slots whose descriptors to close (keeping their mappings), `drop` the slots to forget
(unmap). The main process caps the descriptors a worker holds (`_WORKER_SLOT_FDS` in
`_pool.py`), so the batches a consumer holds cost workers none. `drop_keys` of a state
message are the dataset arrays the new state no longer uses.

Timings of a batch (for `workers="auto"`, `_autoscale.py`): `busy_s` is its wall time in
the worker, `cpu_s` the worker's CPU time meanwhile (`time.process_time`: all its
threads), `runq_s` the time its main thread waited for a CPU (Linux
`/proc/self/schedstat`, 0 elsewhere): wall >> CPU + run queue means I/O-bound.
`setup_s` (of a batch, or of a `prepare`) is the part of its time spent growing, mapping
and paging in shared memory (`_shm.setup_seconds`): 0 in a slot the worker has written
before at that size, what a new slot costs otherwise (the loader weighs it before
taking more slots, see `Window.starved` in `_window.py`).

Parent death: a worker (and kpipe's fork server) asks the kernel for SIGKILL when its
parent dies (Linux `PR_SET_PDEATHSIG`), and a watchdog thread checks `os.getppid()`
every `_PARENT_POLL_S` as a fallback, so a worker inside a long `__getitem__` still goes
when the main process is killed.
"""

import ctypes
import gc
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import numpy as np

from kpipe._engine import _alloc, _pickling, _threads, _tree
from kpipe._engine import worker_info as _wi
from kpipe._engine._shm import Segment, setup_seconds
from kpipe._engine._wire import recv_fds, send_fds
from kpipe.errors import LoaderError

_PARENT_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1
_UNSET = object()


def pack_exception(exc):
    """An exception as plain data: type (pickled if possible), name, message, traceback."""
    try:
        import cloudpickle

        type_bytes = cloudpickle.dumps(type(exc))
    except Exception:
        type_bytes = None
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "type": type_bytes,
        "name": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": str(exc),
        "traceback": tb,
    }


class TaskError(Exception):
    """The dataset raised while loading a batch: `packed` (`pack_exception`), and whether
    it kept memory of the batch's slot all the same (`pinned`)."""

    def __init__(self, packed, pinned):
        super().__init__(packed["message"])
        self.packed, self.pinned = packed, pinned


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


def die_with_parent(parent_pid):
    """Has the kernel SIGKILL this process when its parent dies (Linux), and exits now if
    the parent is already gone (it may have died before the request took effect).

    The parent is the *thread* that forked us: the main process starts workers from its
    main thread or from a thread that lives as long as the process (see `_pool.py`).
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the watchdog thread still notices
    if os.getppid() != parent_pid:
        os._exit(0)


def _watch_parent(parent_pid):
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(0)  # the main process is gone: nobody will read our results


def start_watchdog(parent_pid):
    """A daemon thread ending this process within `_PARENT_POLL_S` of its parent's death,
    even while the main thread runs a long `__getitem__`."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="kpipe-parent-watchdog", daemon=True).start()


class _RunQueueClock:
    """Seconds the calling process's main thread has waited for a CPU (Linux schedstat);
    always 0 where that file does not exist. ~3 us per reading."""

    def __init__(self):
        self._fd = None
        self._pid = None

    def __call__(self):
        try:
            if self._pid != os.getpid():  # opened lazily, and again in a forked child
                self._pid, self._fd = os.getpid(), -1
                self._fd = os.open("/proc/self/schedstat", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            return int(os.pread(self._fd, 128, 0).split()[1]) * 1e-9 if self._fd >= 0 else 0.0
        except (OSError, ValueError, IndexError, AttributeError):
            return 0.0


class _Worker:
    def __init__(self, conn, parent_pid):
        self.conn = conn
        self.parent_pid = parent_pid
        self.slots = {}
        self.arrays = {}
        self.target = None
        self.mode = None
        self.runq = _RunQueueClock()
        self.pools = _threads.PoolLimiter()

    def _adopt_arrays(self, keys):
        for key, fd in zip(keys, recv_fds(self.conn, len(keys))):
            seg = Segment(fd)
            try:
                seg.map_all()
            finally:
                seg.close_fd()  # the mapping keeps the pages; no descriptor per array
            self.arrays[key] = seg

    def _drop_arrays(self, keys):
        refs = []
        for key in keys:
            seg = self.arrays.pop(key, None)
            if seg is not None:
                refs.append(seg.mapping_ref())
                seg.close()
        if any(r is not None and r() is not None for r in refs):
            gc.collect()  # the old target sits in a reference cycle: unmap its arrays now

    def _take_slots(self, fd_slots, close, drop):
        fds = recv_fds(self.conn, len(fd_slots))
        for slot in drop:
            seg = self.slots.pop(slot, None)
            if seg is not None:
                seg.close()
        for slot in close:
            seg = self.slots.get(slot)
            if seg is not None:
                seg.close_fd()
        for slot, fd in zip(fd_slots, fds):
            seg = self.slots.get(slot)
            if seg is None:
                self.slots[slot] = Segment(fd)
            else:
                seg.adopt_fd(fd)

    def load(self, cfg):
        """Receives the shared arrays and unpickles the target, within the thread budget
        `cfg["threads"]`: set in the environment first, so that libraries the target
        imports start with it, and applied to every pool loaded after unpickling."""
        self._adopt_arrays(cfg["array_keys"])
        for path in reversed(cfg["sys_path"]):
            if path not in sys.path:
                sys.path.insert(0, path)
        self.mode = cfg["mode"]
        threads = cfg.get("threads")
        if threads is not None:
            self.pools.set_env(threads)
        self.target = _pickling.loads(cfg["payload"], self.arrays)
        if threads is not None:
            self.pools.apply(threads)

    def send_pools(self, report=_UNSET):
        """Sends the main process what the thread budget set (`report`, default: the last)."""
        report = self.pools.report if report is _UNSET else report
        if report is not None:
            self.conn.send(("threads", report))

    @staticmethod
    def become(worker_id, num_workers, seed):
        """Sets `kpipe.worker_info()` and seeds `random` and `numpy.random`."""
        info = _wi.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed, pid=os.getpid())
        _wi._set(info)
        random.seed(info.seed)
        np.random.seed(info.seed)

    def init(self, cfg):
        self.load(cfg)
        self.become(cfg["worker_id"], cfg["num_workers"], cfg["seed"])

    def run_task(self, seq, key, out_slot, inputs):
        """Loads one batch into `out_slot`; returns `(treedef, layout, timings)`,
        timings = (wall, CPU, run-queue, slot set-up) seconds and whether the dataset kept
        memory of the slot (`pinned`).

        Raises:
            TaskError: the dataset raised; `.packed` is the exception as data, `.pinned`
                whether it kept memory of the slot all the same (a cache filled first).
        """
        t0, cpu0, q0, s0 = time.perf_counter(), time.process_time(), self.runq(), setup_seconds()
        segment = self.slots[out_slot]
        alloc = _alloc.begin(segment)  # kpipe.empty() and big np.stack results now allocate in this slot
        packed = None
        try:
            if self.mode == "dataset":
                with _alloc.stacking_into():
                    out = self.target[key]
            else:
                in_slot, in_treedef, in_layout = inputs
                out = self.target(_tree.unflatten(in_treedef, self.slots[in_slot].views(in_layout, writable=True)))
        except Exception as exc:  # SystemExit/KeyboardInterrupt end the worker
            packed = pack_exception(exc)
        finally:
            _alloc.end()
        if packed is not None:  # (the exception, its traceback and their frames are gone by now)
            raise TaskError(packed, alloc.keep_apart())
        treedef, leaves, _ = _tree.flatten(out)
        layout = alloc.place(leaves)
        del out, leaves
        pinned = alloc.keep_apart()  # the dataset kept memory of this slot: never reuse it (NOTE in _alloc.py)
        return treedef, layout, (time.perf_counter() - t0, time.process_time() - cpu0, self.runq() - q0,
                                 setup_seconds() - s0, pinned)

    def serve(self):
        conn = self.conn
        while True:
            if not conn.poll(_PARENT_POLL_S):
                if os.getppid() != self.parent_pid:
                    return  # the main process is gone
                continue
            msg = conn.recv()
            kind = msg[0]
            if kind == "task":
                _, seq, key, out_slot, inputs, fd_slots, close, drop, seed = msg
                self._take_slots(fd_slots, close, drop)
                if seed is not None:  # this batch's randomness: see worker_info.batch_seed
                    random.seed(seed)
                    np.random.seed(seed)
                try:
                    treedef, layout, timings = self.run_task(seq, key, out_slot, inputs)
                except TaskError as failed:
                    conn.send(("error", seq, failed.packed, failed.pinned))
                except Exception as exc:  # (kpipe's own part failed, e.g. out of memory for the slot)
                    conn.send(("error", seq, pack_exception(exc), False))
                else:
                    conn.send(("done", seq, treedef, layout) + timings)
            elif kind == "prepare":
                _, slot, nbytes, fd_slots, close, drop = msg
                self._take_slots(fd_slots, close, drop)
                s0 = setup_seconds()
                try:
                    self.slots[slot].reserve(nbytes)
                except OSError:
                    pass  # e.g. out of memory: the batch that uses the slot reports it
                conn.send(("prepared", slot, setup_seconds() - s0))
            elif kind == "state":
                _, payload, new_keys, drop_keys = msg
                self._adopt_arrays(new_keys)
                try:
                    self.target = _pickling.loads(payload, self.arrays)
                except Exception as exc:
                    conn.send(("init-error", pack_exception(exc)))
                    return
                self._drop_arrays(drop_keys)
                conn.send(("state-ok",))
            elif kind == "threads":
                self.send_pools(self.pools.apply(msg[1]))
                continue
            elif kind == "stop":
                return
            self.send_pools(self.pools.refresh())  # the message imported modules: new pools?


def serve(conn, parent_pid):
    """Entry point shared by the spawn and fork start methods."""
    # Ctrl-C reaches the whole process group; the main process decides how to stop us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start_watchdog(parent_pid)
    worker = _Worker(conn, parent_pid)
    _threads.preload()
    try:
        msg = conn.recv()
        try:
            worker.init(msg[1])
        except Exception as exc:
            conn.send(("init-error", pack_exception(exc)))
            return
        conn.send(("ready", os.getpid()))
        worker.send_pools()
        worker.serve()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the main process closed the loader or died
    finally:
        try:
            conn.close()
        except OSError:
            pass


def _exec_main():
    """`python -c 'from kpipe._engine._worker import _exec_main; _exec_main()' FD PARENT_PID`."""
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    die_with_parent(parent_pid)
    serve(Connection(fd), parent_pid)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (atexit of user libraries, GC of big objects): nothing of
    # ours needs it, and it can take seconds for large datasets.
    os._exit(0)


def _fork_main(conn, parent_pid):
    die_with_parent(parent_pid)
    serve(conn, parent_pid)


_ZYGOTE_POLL_S = 0.2


def jax_runtime_started():
    """Whether JAX's runtime (its XLA backends, with their thread pools) runs in this
    process. Importing JAX, as Keras's JAX backend does, starts none; the first JAX
    array or computation does."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))


def fork_hazard():
    """Why workers forked from this process (`start_method="fork"`) would hang, or None:
    TensorFlow is loaded (keras-team/keras#11461), or JAX's runtime runs here (forked
    children inherit its locks but not its threads; JAX itself warns that os.fork() is
    incompatible with multithreaded code)."""
    if "tensorflow" in sys.modules:
        return "TensorFlow is loaded in this process, and forking it deadlocks workers (keras-team/keras#11461)"
    if jax_runtime_started():
        return ("JAX's runtime runs in this process (its XLA backends' thread pools), and workers forked "
                "from it hang on them (JAX warns that os.fork() is incompatible with multithreaded code)")
    return None


def _check_fork_safe():
    """The fork server forks every worker: refuse, with the fix, a target whose unpickling
    started JAX's runtime (a dataset holding JAX arrays: the XLA client's thread pools,
    which forked workers would hang on -- JAX says so itself). Importing JAX, as Keras's
    JAX backend does, starts no runtime and is fine."""
    if jax_runtime_started():
        raise LoaderError(
            "Unpickling the dataset in kpipe's fork server started JAX's runtime (the dataset "
            "holds JAX arrays), whose threads workers forked from it would hang on. Pass "
            "`start_method=\"spawn\"` to the loader, or hold NumPy arrays in the dataset "
            "(np.asarray(...) in __init__).")


def _zygote_main():
    """kpipe's fork server: a fresh interpreter (no TensorFlow, no `__main__` re-import)
    that unpickles the target once, then forks each worker on request.

    `python -c '...; _zygote_main()' FD PARENT_PID`. Protocol on FD:
      main -> ("init", cfg) + array fds;  ("fork", worker_id, num_workers, seed, threads);  ("stop",)
      zygote -> ("ready", pid) | ("init-error", exc);  ("forked", worker_id, pid) + socket fd;
                ("exited", pid, exit_code) for every child it reaps.
    A forked worker inherits the unpickled target (copy-on-write) and starts in
    milliseconds; it talks to the main process over its own socket. It inherits the
    thread budget too: the server applies `threads` to itself before forking when it
    changed (the child then touches no pool; see the NOTE in `_threads.py`).
    """
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    # No watchdog thread here (it would make every fork multi-threaded): the server never
    # runs user code after `init`, and its loop checks the parent every _ZYGOTE_POLL_S.
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    zygote = _Worker(conn, parent_pid)
    children = set()
    _threads.preload()  # while the main process pickles the target
    try:
        try:
            zygote.load(conn.recv()[1])
            _check_fork_safe()
        except Exception as exc:
            conn.send(("init-error", pack_exception(exc)))
            return
        conn.send(("ready", os.getpid()))
        while True:
            if conn.poll(_ZYGOTE_POLL_S):
                msg = conn.recv()
                if msg[0] == "stop":
                    break
                _, wid, num_workers, seed, threads = msg
                if threads != zygote.pools.threads:  # workers="auto" changed the budget
                    zygote.pools.apply(threads)  # the child inherits it (see _threads.py)
                ours, theirs = socket.socketpair()
                server_pid = os.getpid()
                pid = os.fork()
                if pid == 0:  # the worker
                    code = 0
                    try:
                        die_with_parent(server_pid)
                        start_watchdog(server_pid)
                        conn.close()
                        ours.close()
                        zygote.conn = Connection(theirs.detach())
                        zygote.parent_pid = server_pid
                        zygote.become(wid, num_workers, seed)
                        zygote.conn.send(("ready", os.getpid()))
                        zygote.send_pools()
                        zygote.serve()
                    except (EOFError, BrokenPipeError, ConnectionResetError):
                        pass
                    except SystemExit as exc:  # sys.exit() in the dataset: keep its code
                        code = exc.code if isinstance(exc.code, int) else 1
                    except BaseException:
                        code = 1
                    finally:
                        sys.stdout.flush()
                        sys.stderr.flush()
                        os._exit(code)
                theirs.close()
                children.add(pid)
                conn.send(("forked", wid, pid))
                send_fds(conn, [ours.fileno()])
                ours.close()
            elif os.getppid() != parent_pid:
                break
            _reap(children, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
        pass
    finally:
        # The main process stops the workers first; wait for them (reporting their exit
        # codes), then end whatever is left, so that no worker outlives the server.
        for sig, wait_s in ((None, 2.0), (signal.SIGTERM, 1.0), (signal.SIGKILL, 1.0)):
            if sig is not None:
                for pid in children:
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            deadline = time.monotonic() + wait_s
            while children and time.monotonic() < deadline:
                _reap(children, conn)
                if children:
                    time.sleep(0.005)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _reap(children, conn):
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        try:
            conn.send(("exited", pid, os.waitstatus_to_exitcode(status)))
        except (OSError, ValueError):
            pass
