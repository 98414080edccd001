import gc
import os

import psutil
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def kpipe_children():
    """Live child processes of this process (kpipe workers among them)."""
    return [p for p in psutil.Process().children(recursive=True) if _alive(p)]


def _alive(process):
    # A child can exit between children() and status(): that one is not alive either.
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def memfd_count():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:kpipe" in os.readlink(f"/proc/self/fd/{fd}"):
                n += 1
        except OSError:
            pass
    return n


def shm_entries():
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture
def no_leaks():
    """Asserts the test leaves no child process, memfd segment or /dev/shm entry behind."""
    before_children = {p.pid for p in kpipe_children()}
    before_shm = shm_entries()
    before_fd = memfd_count()
    yield
    gc.collect()
    left = [p for p in kpipe_children() if p.pid not in before_children]
    assert not left, f"leaked processes: {left}"
    assert shm_entries() - before_shm == set()
    assert memfd_count() <= before_fd
