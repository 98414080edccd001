import contextlib
import gc
import os
import time

import psutil
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def reader_of(loader):
    """The parts behind a ProcessLoader (`kpipe._reader.Reader`: `.backend`, `.window`,
    `.ahead`, `.position`), found through the stream protocol as kpipe's own readers find
    them -- for tests that look at the engine a loader drives."""
    from kpipe import _stream

    return _stream.source_of(loader)


def kpipe_children():
    """Live child processes of this process (kpipe workers among them)."""
    return [p for p in psutil.Process().children(recursive=True) if _alive(p)]


def _alive(process):
    # A child can exit between children() and status(): that one is not alive either.
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def live_pids(pids):
    """The pids among `pids` whose process still runs (not exited, not a zombie)."""
    out = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        if _alive(process):
            out.append(pid)
    return out


def gone(pids, within_s=60.0):
    """Whether every process in `pids` has ended (exited or a zombie) within `within_s`.

    The default is a deadline that only catches a process that never ends: a loaded
    machine may take seconds to run a dying process's exit."""
    deadline = time.monotonic() + within_s
    while live_pids(pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def kill_and_reap(proc):
    """SIGKILLs a `subprocess.Popen` that still runs, and reaps it."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate(timeout=30)


@contextlib.contextmanager
def killed_at_exit(proc):
    """Kills and reaps a test's script process (and so its workers) however the test ends:
    a script that ignored its signal must not loop on after a failed test."""
    try:
        yield proc
    finally:
        kill_and_reap(proc)


def memfd_count():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:kpipe" in os.readlink(f"/proc/self/fd/{fd}"):
                n += 1
        except OSError:
            pass
    return n


def feed_threads(wait_s=60.0):
    """kpipe feed threads still running after up to `wait_s` seconds (they stop within
    a poll interval once their stream, feed or loader is gone; the default deadline only
    catches a thread that never stops, as a loaded machine may be slow to schedule it)."""
    import threading
    import time

    deadline = time.monotonic() + wait_s
    while True:
        alive = [t for t in threading.enumerate() if t.name == "kpipe-feed" and t.is_alive()]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@contextlib.contextmanager
def sigint_when(thread_id, where, within_s=60.0):
    """While in the `with` block, sends SIGINT to thread `thread_id`, as a Ctrl-C would,
    once one of the frames it runs satisfies `where(frame)`: a daemon thread looks every
    5 ms, at most `within_s` (a deadline that only catches a thread that never gets
    there), and stops looking when the block ends. Use it instead of a timer, so that the
    signal lands in the wait the test means however slow the machine is."""
    import signal
    import sys
    import threading

    done = threading.Event()

    def watch():
        deadline = time.monotonic() + within_s
        while not done.is_set() and time.monotonic() < deadline:
            frame = sys._current_frames().get(thread_id)
            while frame is not None:
                if where(frame):
                    signal.pthread_kill(thread_id, signal.SIGINT)
                    return
                frame = frame.f_back
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, name="sigint-when", daemon=True)
    watcher.start()
    try:
        yield watcher
    finally:
        done.set()
        watcher.join()


def running(function, file_suffix):
    """A `where` for `sigint_when`: the frame runs `function` of a file ending in `file_suffix`."""
    return lambda frame: frame.f_code.co_name == function and frame.f_code.co_filename.endswith(file_suffix)


@pytest.fixture
def ctrl_c():
    """Makes SIGINT raise KeyboardInterrupt in this test, as it does in a terminal. A
    process started in the background by a shell without job control (`cmd &` in a
    script, some CI runners) inherits SIGINT ignored, and Python then installs no handler."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def shm_entries():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def orphaned_shm(names, settle_s=5.0):
    """Those of the /dev/shm entries `names` still there that no live process maps or holds
    open: what a test left behind. An entry some process uses is that process's (a run of
    other tests beside this one creates and removes its own; a child of this test that
    lives on is caught by the process checks). An entry of another run may also be seen
    between its process letting go of it and its removal (multiprocessing's semaphores,
    unlinked by a resource tracker a moment after): an orphan counts only if it is still
    there after `settle_s` (a deadline, not a timing: a leak stays)."""
    deadline = time.monotonic() + settle_s
    while True:
        orphans = _orphaned_now(names)
        if not orphans or time.monotonic() > deadline:
            return orphans
        time.sleep(0.2)


def _orphaned_now(names):
    names = {n for n in names if os.path.exists(os.path.join("/dev/shm", n))}
    if not names:
        return set()
    used = set()
    for proc in psutil.process_iter():
        try:
            paths = [m.path for m in proc.memory_maps(grouped=True)] + [f.path for f in proc.open_files()]
        except (psutil.Error, OSError):
            continue
        used.update(os.path.basename(p) for p in paths if p.startswith("/dev/shm/"))
    return {n for n in names if n not in used and os.path.exists(os.path.join("/dev/shm", n))}


@pytest.fixture
def no_leaks():
    """Asserts the test leaves no child process, memfd segment, /dev/shm entry or feed
    thread behind."""
    before_children = {p.pid for p in kpipe_children()}
    before_shm = shm_entries()
    before_fd = memfd_count()
    yield
    gc.collect()
    left = [p for p in kpipe_children() if p.pid not in before_children]
    assert not left, f"leaked processes: {left}"
    assert orphaned_shm(shm_entries() - before_shm) == set()
    assert memfd_count() <= before_fd
    assert not feed_threads(), "a kpipe feed thread outlived the test"


# Child processes a test left running (not failing it: a test that means to check for
# leaks uses `no_leaks`); listed at the end of the run, so a leak shows which test made it.
_LEFT_RUNNING = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = {p.pid for p in kpipe_children()}
    yield
    left = [p for p in kpipe_children() if p.pid not in before]
    if left:
        time.sleep(0.5)  # (a process mid-exit gets a moment: this is a report, not a check)
        left = live_pids([p.pid for p in left])
    if left:
        _LEFT_RUNNING[item.nodeid] = left


def pytest_terminal_summary(terminalreporter):
    if _LEFT_RUNNING:
        terminalreporter.section("child processes left running by tests")
        for nodeid, pids in _LEFT_RUNNING.items():
            terminalreporter.write_line(f"{nodeid}: {len(pids)} (pids {', '.join(map(str, pids))})")
