"""Nothing outlives its use in the process engine: shared arrays, descriptors, workers.

Mostly at the level of `ProcessBackend` (the engine's stable entry point: `submit`,
`get`, `reset_target`, `close`), plus loader-level checks that use only `len()`, `[i]`
and `on_epoch_end()`.
"""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import kpipe
from _engine_datasets import Empty, Replacing, Resizing, Slow, StuckWithBigState, array_mappings, fd_count, memfd_count
from conftest import kpipe_children, live_pids, running, sigint_when
from kpipe._engine import _pool
from kpipe._engine._pool import ProcessBackend

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

START_METHODS = ["forkserver", "spawn"]
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kpipe.__file__)))


def _backend(target, start_method="forkserver", workers=2, timeout=60.0, keep_idle=4):
    return ProcessBackend(
        target, num_workers=workers, mode="dataset", start_method=start_method, timeout=timeout, seed=0, name=type(target).__name__, keep_idle=keep_idle
    )


def _one_pass(backend, n):
    return [backend.get(backend.submit(i))[0] for i in range(n)]


def _counts(backend):
    """Descriptors and shared arrays in the main process and in each worker."""
    gc.collect()
    me = os.getpid()
    return {
        "main_fds": fd_count(me),
        "main_memfds": memfd_count(me),
        "main_entries": len(backend._shared.entries),
        "main_array_maps": array_mappings(me),
        "workers": [(fd_count(p), memfd_count(p), array_mappings(p)) for p in backend.pids],
    }




def _wait_gone(pids, within_s):
    deadline = time.monotonic() + within_s
    while live_pids(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return live_pids(pids)


# ----------------------------------------------------------- replaced shared arrays
@pytest.mark.parametrize("start_method", START_METHODS)
def test_arrays_replaced_in_on_epoch_end_are_freed_in_main_and_every_worker(start_method, no_leaks):
    ds = Replacing()
    backend = _backend(ds, start_method)
    try:
        _one_pass(backend, len(ds))
        for _ in range(2):
            ds.on_epoch_end()
            backend.reset_target(ds)
            _one_pass(backend, len(ds))
        before = _counts(backend)
        for _ in range(30):
            ds.on_epoch_end()
            backend.reset_target(ds)
            got = _one_pass(backend, len(ds))
            # workers see this epoch's array, not a stale one
            assert [x.tolist() for x, _ in got] == [ds.indexes[i * 4 : (i + 1) * 4].tolist() for i in range(len(ds))]
            assert all(int(e[0]) == ds.epoch for _, e in got)
            del got
        after = _counts(backend)
    finally:
        backend.close()
    assert after == before, f"after 2 epochs: {before}; after 32: {after}"
    assert after["main_entries"] == 1 and after["main_array_maps"] == 1
    assert all(maps == 1 for _, _, maps in after["workers"]), after


def test_in_place_edits_and_in_place_resizes_reach_workers_without_leaking(no_leaks):
    ds = Resizing()
    backend = _backend(ds, "spawn", workers=1)
    try:
        assert backend.get(backend.submit(0))[0].tolist() == [0, 1 << 18, 0]
        for epoch in range(1, 6):
            ds.on_epoch_end()
            backend.reset_target(ds)
            size = (1 << 18) + 1024 * epoch
            assert backend.get(backend.submit(0))[0].tolist() == [epoch, size, size]
            assert len(backend._shared.entries) == 2  # the edited one, and the resized one's newest copy
        assert array_mappings(backend.pids[0]) == 2
    finally:
        backend.close()


def test_loader_with_a_replacing_dataset_keeps_descriptors_flat(no_leaks):
    """Uses the loader through len(), [i] and on_epoch_end() only."""
    before_children = {p.pid for p in kpipe_children()}
    ds = Replacing()
    with kpipe.ProcessLoader(ds, workers=2) as loader:
        counts = []
        for epoch in range(32):
            for i in range(len(loader)):
                x, e = loader[i]
                assert int(e[0]) == epoch
            del x, e
            loader.on_epoch_end()
            if epoch in (1, 31):
                gc.collect()
                workers = sorted((p.pid for p in kpipe_children() if p.pid not in before_children))
                counts.append((memfd_count(os.getpid()), array_mappings(os.getpid()), [(memfd_count(p), array_mappings(p)) for p in workers]))
    # the main process: one descriptor per slot and per shared array, and one array mapped
    assert counts[0][:2] == counts[1][:2], counts
    # each worker: at most _WORKER_SLOT_FDS slot descriptors (how many slots it has used
    # depends on timing), none for arrays, and the newest array mapped only
    assert counts[1][1] == 1 and all(fds <= _pool._WORKER_SLOT_FDS and maps == 1 for fds, maps in counts[1][2]), counts


# ---------------------------------------------------------------- held batches
def test_held_batches_cost_one_descriptor_each_in_main_and_none_in_workers(no_leaks):
    backend = _backend(Replacing(batches=8), "spawn")
    try:
        _one_pass(backend, 8)
        gc.collect()
        main0, workers0 = fd_count(os.getpid()), [fd_count(p) for p in backend.pids]
        held = [backend.get(backend.submit(i % 8)) for i in range(300)]
        main_per_batch = (fd_count(os.getpid()) - main0) / len(held)
        worker_extra = [fd_count(p) - f0 for p, f0 in zip(backend.pids, workers0)]
        assert [int(t[0][0][0]) for t in held[:8]] == [0, 4, 8, 12, 16, 20, 24, 28]
    finally:
        del held
        backend.close()
    assert main_per_batch <= 1.0, f"{main_per_batch:.2f} descriptors per held batch in the main process"
    assert all(extra <= _pool._WORKER_SLOT_FDS for extra in worker_extra), worker_extra


_FD_LIMIT_SCRIPT = textwrap.dedent(
    """
    import gc, os, resource, sys
    sys.path.insert(0, {tests!r})
    from _engine_datasets import Replacing
    import kpipe
    from kpipe._engine._pool import ProcessBackend
    from kpipe.errors import LoaderError

    soft, hard = int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, soft if sys.argv[2] == 'hard' else hard))
    b = ProcessBackend(Replacing(batches=8), num_workers=2, mode='dataset', start_method=sys.argv[3],
                       timeout=60, seed=0, name='Replacing', keep_idle=4)
    print('LIMIT', *resource.getrlimit(resource.RLIMIT_NOFILE), flush=True)
    held, fds0 = [], len(os.listdir('/proc/self/fd'))
    try:
        for i in range(1500):
            held.append(b.get(b.submit(i % 8))[0])
        assert [int(x[0][0]) for x in held[:8]] == [0, 4, 8, 12, 16, 20, 24, 28]
        print('HELD', len(held), 'MAIN_FDS_PER_BATCH', (len(os.listdir('/proc/self/fd')) - fds0) / len(held),
              'WORKER_FDS', *[len(os.listdir(f'/proc/{{p}}/fd')) for p in b.pids], flush=True)
    except LoaderError as exc:
        print('ERROR', type(exc).__name__, len(held), str(exc).replace(chr(10), ' '), flush=True)
    b.close()
    print('CLOSED', flush=True)
    assert [int(x[0][0]) for x in held[:8]] == [0, 4, 8, 12, 16, 20, 24, 28]  # still valid after close
    del held
    gc.collect()
    # the process is usable again
    with kpipe.ProcessLoader(Replacing(batches=2), workers=1) as loader:
        assert int(loader[1][0][0]) == 4
    print('OK', flush=True)
    """
)


def _run_fd_limit_script(soft, which, start_method):
    env = dict(os.environ, PYTHONPATH=_ROOT)
    script = _FD_LIMIT_SCRIPT.format(tests=_TESTS_DIR)
    out = subprocess.run([sys.executable, "-c", script, str(soft), which, start_method], capture_output=True, text=True, timeout=150, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "CLOSED" in out.stdout and "OK" in out.stdout, out.stdout
    assert "Traceback" not in out.stderr and "Errno 24" not in out.stderr, out.stderr
    return out.stdout


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@pytest.mark.parametrize("start_method", START_METHODS)
def test_1500_held_batches_under_a_1024_soft_limit(start_method):
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard RLIMIT_NOFILE ({hard}) leaves no room above 1024")
    out = _run_fd_limit_script(1024, "soft", start_method)
    assert "HELD 1500" in out, out
    per_batch = float(out.split("MAIN_FDS_PER_BATCH")[1].split()[0])
    assert per_batch <= 1.0, out
    worker_fds = [int(v) for v in out.split("WORKER_FDS")[1].split("\n")[0].split()]
    assert max(worker_fds) < 30, out  # a few sockets and slot descriptors, not one per batch


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_running_out_of_descriptors_raises_a_named_error_and_close_succeeds():
    out = _run_fd_limit_script(1024, "hard", "forkserver")
    assert "LIMIT 1024 1024" in out, out
    assert "ERROR LoaderError" in out, out
    error = out.split("ERROR LoaderError")[1]
    assert "RLIMIT_NOFILE" in error and "soft limit 1024, hard limit 1024" in error and "ulimit -n" in error, error
    assert int(error.split()[0]) > 900  # it ran out near the limit, not at an arbitrary place


# ----------------------------------------------------------------- deadlines on writes
@pytest.mark.parametrize("start_method", START_METHODS)
def test_resync_with_a_stuck_worker_and_big_state_times_out_and_close_returns(start_method, no_leaks):
    ds = StuckWithBigState(hang_at=1)
    backend = _backend(ds, start_method, timeout=60.0)  # start-up (8 MB to each worker) may be slow
    try:
        assert backend.get(backend.submit(0))[0][0][0, 0] == 0
        backend.timeout = 2.0  # the workers are up: the limit under test is the state send's
        stuck = backend.submit(1)  # its worker hangs in __getitem__
        backend.discard(stuck)
        ds.on_epoch_end()
        with pytest.raises(kpipe.BatchTimeoutError, match=rf"Worker {backend._tasks[stuck].worker.id} \(pid \d+\) did not take the new state of `StuckWithBigState`.*within timeout=2.0 s: it is still loading batch 1"):
            backend.reset_target(ds)  # ~8 MB for a worker that does not read: must not block
        assert backend.closed
    finally:
        t0 = time.monotonic()
        backend.close()
    assert time.monotonic() - t0 < 60  # a sanity bound on "close() returns" (does not hang), not a timing claim


def test_loader_on_epoch_end_with_a_stuck_worker_raises_within_the_timeout(no_leaks):
    loader = kpipe.ProcessLoader(StuckWithBigState(hang_at=1), workers=2, timeout=60.0)  # start-up may be slow
    try:
        assert loader[0][0][0, 0] == 0  # batch 1 is now loading (and hangs) in worker 1
        loader.timeout = 2.0  # the workers are up: the limit under test is on_epoch_end's
        with pytest.raises(kpipe.BatchTimeoutError, match=r"new state of `StuckWithBigState`"):
            loader.on_epoch_end()
    finally:
        loader.close()


def test_on_epoch_end_does_not_wait_for_a_stuck_worker_and_its_next_batch_names_what_holds_it(no_leaks):
    """A small state goes out behind the stuck worker's discarded batch without a wait
    (workers load it while the next pass is submitted); the next pass's batch queued
    behind it times out naming the batch the worker is still loading."""
    loader = kpipe.ProcessLoader(StuckWithBigState(hang_at=1, state_mb=0), workers=1, timeout=60.0)
    try:
        assert loader[0][0][0, 0] == 0  # batch 1 is now loading (and hangs) in the worker
        loader.timeout = 2.0
        loader.on_epoch_end()  # returns: nothing waits for the worker to load the new state
        with pytest.raises(kpipe.BatchTimeoutError, match=r"Batch 0 of `StuckWithBigState` did not arrive within timeout=2.0 s "
                           r"from worker 0 \(pid \d+\), which is still loading batch 1, given to it earlier\."):
            loader[0]
    finally:
        loader.close()


def test_a_worker_stuck_loading_the_new_state_is_named_by_the_batch_behind_it(no_leaks):
    from _engine_datasets import StuckLoadingState

    loader = kpipe.ProcessLoader(StuckLoadingState(), workers=1, timeout=60.0)
    try:
        assert [float(loader[i][0, 0]) for i in range(2)] == [0.0, 1.0]
        loader.timeout = 2.0
        loader.on_epoch_end()  # the worker hangs unpickling this state
        with pytest.raises(kpipe.BatchTimeoutError, match=r"Batch 0 of `StuckLoadingState` did not arrive within timeout=2.0 s "
                           r"from worker 0 \(pid \d+\), which is still loading the new state of the dataset \(after on_epoch_end\)\."):
            loader[0]
    finally:
        loader.close()


@pytest.mark.parametrize("start_method", START_METHODS)
def test_worker_dead_between_batches_fails_the_resync_with_worker_died(start_method, no_leaks):
    ds = Replacing()
    backend = _backend(ds, start_method)
    try:
        _one_pass(backend, len(ds))
        victim = backend.pids[1]
        os.kill(victim, signal.SIGKILL)
        assert not _wait_gone([victim], 60.0)  # a deadline that only catches a hang
        ds.on_epoch_end()
        with pytest.raises(kpipe.WorkerDiedError, match=rf"Worker 1 \(pid {victim}\) while idle, after loading batch 3 of `Replacing`.*SIGKILL"):
            backend.reset_target(ds)
    finally:
        backend.close()


def test_sends_to_a_dead_worker_surface_when_its_batch_is_needed(no_leaks):
    backend = _backend(Replacing(batches=8), "spawn")
    try:
        _one_pass(backend, 2)
        victim = backend.pids[1]
        os.kill(victim, signal.SIGKILL)
        assert not _wait_gone([victim], 60.0)  # a deadline that only catches a hang
        seqs = [backend.submit(i) for i in range(2, 6)]  # 3 and 5 go to the dead worker
        assert int(backend.get(seqs[0])[0][0][0]) == 8  # worker 0's batch still arrives
        with pytest.raises(kpipe.WorkerDiedError, match=rf"Worker 1 \(pid {victim}\)"):
            backend.get(seqs[1])
    finally:
        backend.close()


# ------------------------------------------------------------------------ orphans
_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    import numpy as np
    import psutil
    from kpipe._engine._pool import ProcessBackend

    class Sleepy:
        def __init__(self, marks):
            self.marks = marks
        def __len__(self):
            return 4
        def __getitem__(self, i):
            open(os.path.join(self.marks, str(i)), 'w').close()  # inside __getitem__ now
            time.sleep(3600)  # longer than any deadline below: only a kill ends it
            return np.zeros(1)

    def start():
        return ProcessBackend(Sleepy(sys.argv[3]), num_workers=2, mode='dataset', start_method=sys.argv[1], timeout=120,
                              seed=0, name='Sleepy', keep_idle=4)

    if __name__ == '__main__':
        if sys.argv[2] == 'thread':  # started from a thread that ends at once
            box = []
            t = threading.Thread(target=lambda: box.append(start()))
            t.start(); t.join()
            backend = box[0]
        else:
            backend = start()
        seqs = [backend.submit(i) for i in range(2)]
        deadline = time.monotonic() + 60  # until both workers are inside __getitem__ (only catches a hang)
        while len(os.listdir(sys.argv[3])) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        print('PIDS', *[p.pid for p in psutil.Process().children(recursive=True)], flush=True)
        backend.get(seqs[0])
    """
)


@pytest.mark.parametrize("how", ["main-thread", "thread"])
@pytest.mark.parametrize("start_method", START_METHODS)
def test_sigkilled_main_process_leaves_no_worker_even_inside_getitem(start_method, how, tmp_path):
    env = dict(os.environ, PYTHONPATH=_ROOT)
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, start_method, how, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    pids = []
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line
        assert sorted(os.listdir(tmp_path)) == ["0", "1"]  # both workers are inside __getitem__
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == (3 if start_method == "forkserver" else 2)
        assert len(live_pids(pids)) == len(pids)  # a thread that ended did not take them along
        proc.kill()
        proc.wait(timeout=30)
        left = _wait_gone(pids, 60.0)  # a deadline that only catches a hang: __getitem__ sleeps an hour
        assert not left, f"{start_method}: workers {left} outlived the SIGKILLed main process"
    finally:
        proc.kill()
        proc.wait(timeout=30)
        for p in live_pids(pids):
            os.kill(p, signal.SIGKILL)


@pytest.mark.parametrize("start_method", START_METHODS)
def test_workers_started_from_a_short_lived_thread_outlive_that_thread(start_method, no_leaks):
    box = []
    t = threading.Thread(target=lambda: box.append(_backend(Replacing(), start_method)))
    t.start()
    t.join(timeout=120)
    backend = box[0]
    try:
        # PR_SET_PDEATHSIG fires when the forking *thread* exits, which join() does not wait
        # for: wait until the kernel has let it go (a deadline that only catches a hang), so
        # that workers tied to it would have been sent their SIGKILL by now
        task = f"/proc/self/task/{t.native_id}"
        deadline = time.monotonic() + 60
        while os.path.exists(task) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not os.path.exists(task)
        assert len(live_pids(backend.pids)) == 2
        assert [int(t[0][0]) for t in _one_pass(backend, 4)] == [0, 4, 8, 12]
    finally:
        backend.close()


# ---------------------------------------------------------------------- item 7 bits
@pytest.mark.parametrize("start_method", START_METHODS)
def test_batches_of_zero_rows_work_in_fresh_slots(start_method, no_leaks):
    ds = Empty(mixed=True)
    backend = _backend(ds, start_method, workers=1)
    try:
        for i in range(4):  # every batch in a slot of its own, all fresh
            got = backend.get(backend.submit(i))[0]
            want = ds[i]
            leaves_got, leaves_want = _leaves(got), _leaves(want)
            assert [(a.shape, a.dtype) for a in leaves_got] == [(a.shape, a.dtype) for a in leaves_want]
            assert all(np.array_equal(a, b) for a, b in zip(leaves_got, leaves_want))
    finally:
        backend.close()


def _leaves(tree):
    from kpipe._engine import _tree

    return _tree.flatten(tree)[1]


def test_ctrl_c_during_a_batch_wait_frees_that_batchs_slot(ctrl_c, no_leaks, tmp_path):
    gate = tmp_path / "gate"  # batch 1 arrives once the test creates it
    backend = _backend(Slow(slow=1, seconds=120, gate=str(gate)), "spawn", workers=2)
    main = threading.get_ident()
    try:
        backend.get(backend.submit(0))
        seq = backend.submit(1)
        with sigint_when(main, running("_pump", os.path.join("_engine", "_pool.py"))):  # once get() waits
            with pytest.raises(KeyboardInterrupt):
                backend.get(seq)
        assert not backend.closed
        # the slow batch arrives later and is dropped; its slot is free again
        gate.touch()
        deadline = time.monotonic() + 60  # only catches a hang
        while backend._tasks and time.monotonic() < deadline:
            backend._pump(0.1)
        assert not backend._tasks
        gc.collect()
        assert sorted(backend._slots._free) == sorted(backend._slots.segments)
        assert float(backend.get(backend.submit(2))[0][0]) == 2.0  # still usable
    finally:
        backend.close()


@pytest.mark.parametrize("timeout", [None, float("inf")])
def test_no_timeout_means_waiting_without_limit(timeout, no_leaks):
    backend = _backend(Replacing(), "spawn", timeout=timeout)
    try:
        assert [int(t[0][0]) for t in _one_pass(backend, 4)] == [0, 4, 8, 12]
        ds = Replacing()
        ds.on_epoch_end()
        backend.reset_target(ds)
        assert int(backend.get(backend.submit(0))[0][0][0]) == int(ds.indexes[0])
    finally:
        backend.close()


# ------------------------------------------------------------------- the wire itself
def test_wire_send_honours_its_deadline_and_passes_descriptors():
    import socket
    from multiprocessing.connection import Connection

    from kpipe._engine import _wire

    a, b = socket.socketpair()
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    fd = os.memfd_create("kpipe-test")
    try:
        os.ftruncate(fd, 12345)
        _wire.send(sender, ("hello", 1), [fd], _wire.deadline_after(5.0))
        assert receiver.recv() == ("hello", 1)
        (got,) = _wire.recv_fds(receiver, 1)
        assert os.fstat(got).st_size == 12345 and got != fd
        os.close(got)
        with pytest.raises(_wire.SendTimeout):  # nobody reads: the buffer fills, the deadline passes
            _wire.send(sender, bytes(16 << 20), (), _wire.deadline_after(0.3))
        assert _wire.deadline_after(None) is None and _wire.deadline_after(float("inf")) is None
    finally:
        os.close(fd)
        sender.close()
        receiver.close()


def test_wire_send_completes_a_message_the_socket_takes_in_parts():
    import socket
    from multiprocessing.connection import Connection

    from kpipe._engine import _wire

    a, b = socket.socketpair()
    sender, receiver = Connection(a.detach()), Connection(b.detach())
    big = np.random.RandomState(0).bytes(6 << 20)  # far more than a socket buffer holds
    got = []
    reader = threading.Thread(target=lambda: got.extend(receiver.recv() for _ in range(4)))
    try:
        reader.start()
        for msg in [("small", 1), big, ("after", 2), b"x" * 65531]:  # 65531 + 4: a 64 KiB write
            _wire.send(sender, msg, (), _wire.deadline_after(60.0))  # a deadline that only catches a hang
        reader.join(60.0)
        assert not reader.is_alive()
        assert got[0] == ("small", 1) and got[1] == big and got[2] == ("after", 2)
        assert got[3] == b"x" * 65531
    finally:
        sender.close()
        receiver.close()


def test_a_ctrl_c_landing_in_a_batch_release_is_raised_by_the_next_wait(no_leaks):
    # Python prints and drops an exception raised in __del__: a Ctrl-C arriving while the
    # last array of a batch is collected (its lease's release runs) would be lost, and a
    # loop of `loader[i]` would go on (seen in test_ctrl_c_stops_everything).
    from _datasets import Squares
    from kpipe._engine import _shm

    backend = _backend(Squares(n=4))
    try:
        x, _ = backend.get(backend.submit(0))[0]
        lease = _shm.Lease(lambda: (_ for _ in ()).throw(KeyboardInterrupt))
        del lease  # its release is interrupted: nothing escapes the finalizer...
        seq = backend.submit(1)
        with pytest.raises(KeyboardInterrupt):  # ...the next wait raises it
            backend.get(seq)
        assert not backend.closed  # as a Ctrl-C in any other wait: the task is discarded
        assert int(backend.get(backend.submit(2))[0][0].flat[0]) == 20  # and only once
        del x
    finally:
        backend.close()


def test_ctrl_c_while_a_state_send_waits_stops_the_pool_cleanly(ctrl_c, no_leaks):
    ds = StuckWithBigState(hang_at=1)
    backend = _backend(ds, "spawn", timeout=60.0)
    main = threading.get_ident()
    try:
        backend.get(backend.submit(0))
        seq = backend.submit(1)
        stuck = backend._tasks[seq].worker
        backend.discard(seq)  # worker 1 hangs and stops reading
        ds.on_epoch_end()

        def waits_on_the_stuck_worker(frame):  # _send_state(stuck) -> ... -> _wire._wait_writable
            if not running("_wait_writable", os.path.join("_engine", "_wire.py"))(frame):
                return False
            while frame is not None and frame.f_code.co_name != "_send_state":
                frame = frame.f_back
            return frame is not None and frame.f_locals.get("proc") is stuck

        with sigint_when(main, waits_on_the_stuck_worker):
            with pytest.raises(KeyboardInterrupt) as info:
                backend.reset_target(ds)  # blocked on worker 1's full socket
        assert getattr(info.value, "kpipe_torn", False)  # half of 8 MB went out...
        assert backend.closed  # ...so the pool cannot be trusted and stopped
    finally:
        backend.close()
