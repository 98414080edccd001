"""ProcessLoader failure modes: each raises clearly, nothing hangs, nothing leaks."""

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import kpipe
from _datasets import EagerH5, Failing, LazyH5, Locked, Reshuffling, Squares
from conftest import gone, kill_and_reap, killed_at_exit, kpipe_children, live_pids, memfd_count, orphaned_shm, running, shm_entries, sigint_when

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


@pytest.mark.parametrize("kw", [dict(workers=2), dict(workers=2, use_threads=True), dict(workers=0)])
def test_worker_exception_keeps_type_message_traceback_and_index(kw, no_leaks):
    with kpipe.ProcessLoader(Failing("raise", bad=3), **kw) as loader:
        for i in range(3):
            loader[i]
        with pytest.raises(ValueError, match="cannot decode record 3") as info:
            loader[3]
        assert info.value.kpipe_batch_index == 3
        text = str(info.value) + "".join(getattr(info.value, "__notes__", []))
        assert "batch 3" in text
        if kw["workers"] and not kw.get("use_threads"):
            assert "Traceback" in text and "_datasets.py" in text and "worker" in text
        # the loader keeps going after a dataset error
        assert loader[4][0][0, 0] == 4


def test_keyerror_message_stays_readable():
    with kpipe.ProcessLoader(Failing("keyerror", bad=0), workers=1) as loader:
        with pytest.raises(KeyError) as info:
            loader[0]
    assert "missing-label" in str(info.value) and "\\n" not in str(info.value)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
@pytest.mark.parametrize(
    "how, pattern",
    [
        ("exit", r"exited with code 3"),
        ("os_exit", r"exited with code 3"),
        ("sigkill", r"SIGKILL \(exit code -9\).*out-of-memory"),
        ("segfault", r"SIGSEGV"),
    ],
)
def test_dead_worker_raises_naming_worker_pid_code_and_batch(how, pattern, start_method, no_leaks):
    loader = kpipe.ProcessLoader(Failing(how, bad=3), workers=2, max_queue_size=2, start_method=start_method)
    pids = loader.stats()["pids"]
    loader[0], loader[1], loader[2]
    with pytest.raises(kpipe.WorkerDiedError, match=pattern) as info:
        loader[3]
    msg = str(info.value)
    # which worker loads batch 3 depends on which one was idle first: the message names it
    named = re.match(r"Worker (\d) \(pid (\d+)\) while loading batch 3 of `Failing`", msg)
    assert named and pids[int(named.group(1))] == int(named.group(2)), msg
    # the loader restarts its workers on next use, and close() still returns
    assert loader[4][0][0, 0] == 4
    assert loader.stats()["restarts"] == 1
    loader.close()
    assert not live_pids(pids)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_hanging_batch_times_out_and_close_returns(start_method, no_leaks):
    loader = kpipe.ProcessLoader(Failing("hang", bad=1), workers=2, timeout=60, start_method=start_method)
    loader[0]  # the workers' start-up, which a loaded machine may make slow, is behind us
    loader.timeout = 1.5  # the limit under test: batch 1's
    t0 = time.monotonic()
    with pytest.raises(kpipe.BatchTimeoutError, match=r"Batch 1 of `Failing` did not arrive within timeout=1.5"):
        loader[1]
    loader.close()
    assert time.monotonic() - t0 < 60  # a sanity bound on "does not hang", not a timing claim


def test_unpicklable_dataset_raises_at_construction(no_leaks):
    with pytest.raises(kpipe.DatasetPicklingError, match=r"`Locked` cannot be pickled.*lock.*lazily"):
        kpipe.ProcessLoader(Locked(), workers=2)
    with kpipe.ProcessLoader(Locked(), workers=2, use_threads=True) as loader:  # threads need no pickling
        assert loader[0].shape == (1,)



_JAX_DATASET = textwrap.dedent("""
    import jax.numpy as jnp
    import numpy as np
    import kpipe

    class Held:  # a dataset holding a JAX array: unpickling it imports JAX, which starts threads
        def __init__(self):
            self.x = jnp.arange(8.0)

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.asarray(self.x[2 * i:2 * i + 2])

    try:
        with kpipe.ProcessLoader(Held(), workers=2, timeout=60) as loader:
            loader[0]
    except kpipe.LoaderError as error:
        print("REFUSED", str(error).splitlines()[0])
    with kpipe.ProcessLoader(Held(), workers=2, start_method="spawn", timeout=120) as loader:
        print("SPAWN", [loader[i].tolist() for i in range(len(loader))])
""")


@pytest.mark.timeout(240)
def test_a_dataset_whose_unpickling_starts_jax_is_refused_by_the_fork_server_and_runs_under_spawn(tmp_path):
    # Forked from a fork server that imported JAX, the workers hung until the batch timeout.
    pytest.importorskip("jax")
    script = tmp_path / "held.py"
    script.write_text(_JAX_DATASET)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), os.environ.get("PYTHONPATH")])), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    refused = next(line for line in proc.stdout.splitlines() if line.startswith("REFUSED"))
    assert "started JAX's runtime" in refused and 'start_method="spawn"' in refused
    assert "SPAWN [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]" in proc.stdout

def _h5(tmp_path):
    import h5py

    path = str(tmp_path / "d.h5")
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(64, dtype="float32").reshape(32, 2)
        f["y"] = np.arange(32, dtype="int64")
    return path


def test_h5py_file_opened_in_init_or_lazily_both_work(tmp_path, no_leaks):
    path = _h5(tmp_path)
    eager = EagerH5(path)  # opened in __init__: sent as its file's name, reopened in each worker
    with kpipe.ProcessLoader(eager, workers=2) as loader:
        ys = np.concatenate([loader[i][1] for i in range(len(loader))])
    assert ys.tolist() == list(range(32))
    assert eager.handle.mode == "r"  # the user's handle is untouched
    eager.handle.close()
    ds = LazyH5(path)
    with kpipe.ProcessLoader(ds, workers=2, shuffle=True, seed=0) as loader:
        ys = np.concatenate([loader[i][1] for i in range(len(loader))])
    assert sorted(ys.tolist()) == list(range(32))
    assert ds._h5 is None  # the main process never opened it


@pytest.mark.parametrize(
    "how, pattern",
    [
        ("string", r"batch\[0\] has dtype <U1.*numeric or bool"),
        ("structure", r"Batch 3 of `Failing` has structure \(array, array, array\) but batch 0 had \(array, array\)"),
        ("dtype", r"Batch 3 of `Failing` has batch\[0\] with dtype complex128 but batch 0 had float32.*within a kind"),
        ("rank", r"shape \(2, 1, 1\) but batch 0 had \(2, 1\)"),
    ],
)
@pytest.mark.parametrize("workers", [0, 2])
def test_bad_batches_get_clear_errors(how, pattern, workers, no_leaks):
    with kpipe.ProcessLoader(Failing(how, bad=3), workers=workers) as loader:
        for i in range(3):
            loader[i]
        with pytest.raises(kpipe.BatchStructureError, match=pattern):
            loader[3]


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(workers=-1), ValueError, r"`workers` must be >= 0. Received: workers=-1. Use 0"),
        (dict(workers=2.5), TypeError, r"`workers` must be an integer. Received: workers=2.5"),
        (dict(max_queue_size=0), ValueError, r"`max_queue_size` must be >= 1. Received: max_queue_size=0"),
        (dict(timeout=0), ValueError, r"`timeout` must be a positive number of seconds, or None for no timeout. Received: timeout=0"),
        (dict(timeout=float("nan")), ValueError, r"Received: timeout=nan"),
        (dict(timeout=float("-inf")), ValueError, r"Received: timeout=-inf"),
        (dict(timeout="10"), ValueError, r"Received: timeout='10'"),
        (dict(start_method="thread"), ValueError, r"start_method=.thread."),
        (dict(num_shards=2), ValueError, r"Pass both `num_shards` and `shard_index`"),
        (dict(num_shards=2, shard_index=2), ValueError, r"shard_index=2, num_shards=2"),
        (dict(num_shards=2, shard_index=0, shuffle=True), ValueError, r"needs a `seed`"),
    ],
)
def test_bad_arguments(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        kpipe.ProcessLoader(Squares(), **kwargs)


@pytest.mark.parametrize("timeout", [None, float("inf")])
def test_no_timeout(timeout, no_leaks):
    with kpipe.ProcessLoader(Squares(n=3), workers=1, timeout=timeout) as loader:
        assert loader.timeout is None
        assert [int(loader[i][0][0, 0]) for i in range(3)] == [0, 10, 20]


class _LenRaises:
    def __len__(self):
        raise RuntimeError("index file missing")

    def __getitem__(self, i):
        return np.zeros(1)


def test_bad_datasets():
    for bad in ("train.h5", b"x", {0: 1}):
        with pytest.raises(TypeError, match=rf"`dataset` must have __getitem__\(i\).*Received: .* of type {type(bad).__name__}"):
            kpipe.ProcessLoader(bad, workers=0)
    with pytest.raises(kpipe.LoaderError, match=r"len\(\) of `_LenRaises` raised RuntimeError: index file missing") as info:
        kpipe.ProcessLoader(_LenRaises(), workers=0)
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match=r"`Squares` is empty: it has 0 batches"):
        kpipe.ProcessLoader(Squares(n=0), workers=2)
    with pytest.raises(TypeError, match=r"must have __getitem__\(i\) returning batch i and __len__.*Received: <generator.* of type generator"):
        kpipe.ProcessLoader((i for i in range(3)), workers=2)
    from _datasets import Infinite

    with pytest.raises(ValueError, match="needs a finite dataset"):
        kpipe.ProcessLoader(Infinite(), shuffle=True, seed=0)


def test_fork_is_refused_once_tensorflow_is_loaded():
    import tensorflow  # noqa: F401  (already loaded by kpipe.ProcessLoader -> keras)

    with pytest.raises(ValueError, match=r"TensorFlow is loaded.*keras-team/keras#11461"):
        kpipe.ProcessLoader(Squares(), workers=2, start_method="fork")


def test_closed_loader_says_so():
    loader = kpipe.ProcessLoader(Squares(), workers=1)
    loader.close()
    loader.close()
    with pytest.raises(kpipe.LoaderClosedError, match="was closed; create a new one"):
        loader[0]


def test_stop_mid_epoch_gc_and_100_open_close_cycles_leak_nothing(no_leaks):
    fds0, shm0 = memfd_count(), shm_entries()
    before = {p.pid for p in kpipe_children()}  # (a process an earlier test left is not this one's)
    loader = kpipe.ProcessLoader(Squares(n=50), workers=2)
    loader[0], loader[1]
    pids = loader.stats()["pids"]
    del loader  # consumer stops mid-epoch; garbage collection stops the workers
    gc.collect()
    assert gone(pids)
    with pytest.raises(ValueError):
        with kpipe.ProcessLoader(Failing("raise", bad=1), workers=2) as bad:
            bad[0], bad[1]
    for i in range(100):
        with kpipe.ProcessLoader(Squares(n=4), workers=1, max_queue_size=2, start_method=("forkserver", "spawn")[i % 2]) as loader:
            if i % 10 == 0:
                loader[0]
    gc.collect()
    assert [p for p in kpipe_children() if p.pid not in before] == []
    assert memfd_count() <= fds0
    assert orphaned_shm(shm_entries() - shm0) == set()  # (entries no process uses: another run's are not ours)


@pytest.mark.parametrize("make", [lambda: Squares(n=8), lambda: Reshuffling(n=6, big=False)], ids=["stateless", "with-hooks"])
def test_a_dropped_loader_stops_its_workers_by_reference_counting_alone(make, no_leaks):
    """No reference cycle holds a loader's parts: dropping the last reference stops the
    workers at once, without waiting for the garbage collector (disabled here)."""
    gc.collect()
    gc.disable()
    try:
        loader = kpipe.ProcessLoader(make(), workers=2)
        loader[0], loader[1]
        pids = loader.stats()["pids"]
        del loader
        assert gone(pids)
    finally:
        gc.enable()


_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises even if started with SIGINT ignored
    sys.path.insert(0, {tests!r})
    import numpy as np
    import kpipe

    class Local:  # defined in __main__: reaches spawned workers by value (cloudpickle)
        def __len__(self):
            return 6
        def __getitem__(self, i):
            return np.full((2, 2), i, 'float32'), np.array(['tensorflow' in sys.modules, 'keras' in sys.modules])

    if __name__ == '__main__':
        mode = sys.argv[1]
        loader = kpipe.ProcessLoader(Local(), workers=2, max_queue_size=2)
        print('PIDS', *loader.stats()['pids'], flush=True)
        got = [loader[i] for i in range(6)]
        assert [int(x[0, 0]) for x, _ in got] == list(range(6))
        print('TF_IN_WORKERS', any(bool(f[0]) for _, f in got), any(bool(f[1]) for _, f in got), flush=True)
        if mode == 'exit':
            sys.exit(0)  # no close(): interpreter exit must stop the workers
        if mode == 'sigint':
            print('LOOPING', flush=True)
            while True:
                for i in range(6):
                    loader[i]
                loader.on_epoch_end()
    """
)


def _run_script(tmp_path, mode):
    script = tmp_path / "main_script.py"
    script.write_text(_SCRIPT.format(tests=os.path.dirname(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(kpipe.__file__))))
    return subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_main_module_class_under_spawn_and_interpreter_exit(tmp_path):
    proc = _run_script(tmp_path, "exit")
    with killed_at_exit(proc):
        out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    pids = [int(p) for p in out.split("PIDS")[1].split("\n")[0].split()]
    assert "TF_IN_WORKERS False False" in out, out
    assert gone(pids)


def _start_looping(tmp_path):
    """Starts the script in its endless loading loop; returns (process, worker pids)."""
    proc = _run_script(tmp_path, "sigint")
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("LOOPING"):
                break
    except BaseException:
        kill_and_reap(proc)
        raise
    return proc, [int(p) for p in "".join(lines).split("PIDS")[1].split("\n")[0].split()]


def test_ctrl_c_stops_everything(tmp_path):
    proc, pids = _start_looping(tmp_path)
    with killed_at_exit(proc):
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode != 0  # KeyboardInterrupt
    assert gone(pids)


def test_main_process_killed_leaves_no_worker(tmp_path):
    proc, pids = _start_looping(tmp_path)
    with killed_at_exit(proc):
        proc.kill()
        proc.communicate(timeout=60)
    assert gone(pids)


def test_fork_start_method_without_tensorflow(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import numpy as np
        from kpipe._engine.mapper import ProcessMapper
        from kpipe._engine._pool import ProcessBackend
        from _datasets import Squares
        assert 'tensorflow' not in sys.modules
        b = ProcessBackend(Squares(n=6), num_workers=2, mode='dataset', start_method='fork', timeout=60, seed=0, name='Squares', keep_idle=4)
        seqs = [b.submit(i) for i in range(6)]
        got = [b.get(s)[0] for s in seqs]
        assert [int(x[0, 0]) for x, _ in got] == [0, 10, 20, 30, 40, 50]
        b.close()
        with ProcessMapper(lambda x: x + 1, workers=2, start_method='fork') as m:
            assert [int(y[0]) for y in m.imap(np.full(1, i) for i in range(5))] == [1, 2, 3, 4, 5]
        print('OK')
        """
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(kpipe.__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_dataset_that_fails_to_load_in_workers_is_reported(start_method, no_leaks):
    from _datasets import BreaksInWorkers

    with pytest.raises(RuntimeError, match=r"(?s)cannot restore BreaksInWorkers here.*while unpickling `BreaksInWorkers`"):
        loader = kpipe.ProcessLoader(BreaksInWorkers(), workers=2, start_method=start_method)
        try:
            loader[0]
        finally:
            loader.close()


# --------------------------------------------------- issue 10: engine failure modes
@pytest.mark.parametrize("kw", [dict(workers=2), dict(workers=2, start_method="spawn"), dict(workers=2, use_threads=True), dict(workers=0)])
def test_batches_of_zero_rows_load_in_fresh_slots(kw, no_leaks):
    from _engine_datasets import Empty

    ds = Empty()
    with kpipe.ProcessLoader(ds, max_queue_size=4, **kw) as loader:
        for i in range(len(ds)):
            got, want = loader[i], ds[i]
            assert [(a.shape, a.dtype) for a in got] == [(a.shape, a.dtype) for a in want]
            assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_ctrl_c_during_a_batch_wait_keeps_the_loader_usable(ctrl_c, no_leaks, tmp_path):
    import threading

    from _engine_datasets import Slow

    gate = tmp_path / "gate"  # batch 1 arrives once the test creates it
    with kpipe.ProcessLoader(Slow(slow=1, seconds=120, gate=str(gate)), workers=2) as loader:
        assert float(loader[0][0]) == 0.0
        with sigint_when(threading.get_ident(), running("_pump", os.path.join("_engine", "_pool.py"))):  # once it waits
            with pytest.raises(KeyboardInterrupt):
                loader[1]
        gate.touch()
        assert float(loader[1][0]) == 1.0 and float(loader[2][0]) == 2.0


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_worker_dead_between_batches_makes_on_epoch_end_raise_worker_died(start_method, no_leaks):
    from _engine_datasets import Replacing

    loader = kpipe.ProcessLoader(Replacing(), workers=2, start_method=start_method)
    try:
        for i in range(len(loader) - 1):  # (reading the last batch would end the pass)
            loader[i]
        victim = loader.stats()["pids"][1]
        os.kill(victim, signal.SIGKILL)
        assert gone([victim])
        with pytest.raises(kpipe.WorkerDiedError, match=rf"Worker 1 \(pid {victim}\) while (idle|loading batch \d).*of `Replacing`.*SIGKILL"):
            loader.on_epoch_end()  # ends the pass: the new state goes to the workers
        assert int(loader[0][1][0]) == 1  # new workers, with the new epoch's state
    finally:
        loader.close()


def test_no_leaks_counts_a_dev_shm_entry_no_process_uses_not_one_another_process_maps():
    import mmap
    import threading

    from conftest import orphaned_shm

    names = [f"kpipe-test-{os.getpid()}-{what}" for what in ("held", "orphan", "transient")]
    maps = []
    for name in names:
        fd = os.open(os.path.join("/dev/shm", name), os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        if name.endswith("held"):
            maps.append(mmap.mmap(fd, 4096))  # mapped by this process: in use
        os.close(fd)  # the orphan: unmapped, never unlinked -- what a leak leaves
    # the transient one: unmapped, then removed a moment later (another run's semaphore,
    # unlinked by its resource tracker): not a leak
    remover = threading.Timer(0.5, os.unlink, [os.path.join("/dev/shm", names[2])])
    remover.start()
    try:
        assert orphaned_shm(set(names) | {"no-such-entry"}, settle_s=3.0) == {names[1]}
    finally:
        remover.join()
        for m in maps:
            m.close()
        for name in names[:2]:
            os.unlink(os.path.join("/dev/shm", name))
