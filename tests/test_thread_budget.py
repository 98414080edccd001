"""The thread budget of worker processes (NOTE in kpipe/_engine/_threads.py): what each
worker's native pools get, read from inside the workers, for every start method, after
`workers="auto"`-style changes of the count, with OpenCV and TensorFlow; bad values; and
the consumer's own pools left alone."""

import importlib.util
import math
import os
import warnings

import numpy as np
import pytest

from kpipe._engine import _autoscale, _threads
from tests._thread_datasets import Pools, pools_of, row

_CPUS = 4.0  # the CPU limit the tests give the pools, whatever the machine has


@pytest.fixture
def four_cpus(monkeypatch):
    """The main process's CPU limit (affinity and cgroup quota) reads 4 CPUs."""
    monkeypatch.setattr(_autoscale, "cpu_limit", lambda **kw: _CPUS)


def _rows(loader):
    return [row(loader[i]) for i in range(len(loader))]


def _assert_budget(rows, threads, start_method="forkserver", started_with=True):
    """Every row came from a worker whose pools and environment hold `threads`; with
    `started_with`, a budget the worker started with (a lowered budget leaves OpenBLAS's
    extra threads asleep, see the NOTE in _threads.py)."""
    for r in rows:
        assert r["pools"] >= 1, r  # NumPy's BLAS at least
        assert r["pool_min"] == r["pool_max"] == threads, r
        for name in _threads.ENV_VARS:
            assert r[name] == threads, (name, r)
        if started_with and start_method != "fork" and r["os_threads"] > 0:
            # the main thread, kpipe's watchdog and OpenBLAS's threads (one per thread of
            # the budget after the first): nothing sized for the whole machine.
            assert r["os_threads"] <= threads + 1, r


# ------------------------------------------------------------------ the rule
def test_budget_divides_the_cpus_among_workers():
    assert [_threads.budget(4.0, n) for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    assert _threads.budget(2.0, 1) == 2 and _threads.budget(2.0, 2) == 1
    assert _threads.budget(1.5, 1) == 1  # a quota of 1.5 CPUs: one whole CPU per thread
    assert _threads.budget(0.5, 1) == 1  # never 0
    assert _threads.budget(4.0, 4, fixed=3) == 3
    assert _threads.env(2)["OPENBLAS_NUM_THREADS"] == "2" and set(_threads.env(2)) == set(_threads.ENV_VARS)


@pytest.mark.parametrize("value, error, words", [
    (0, ValueError, "must be >= 1. Received: worker_threads=0"),
    (-2, ValueError, "Received: worker_threads=-2"),
    ("2", TypeError, "must be an integer or None. Received: worker_threads='2'"),
    (1.5, TypeError, "Received: worker_threads=1.5 of type float"),
    (True, TypeError, "Received: worker_threads=True"),
])
def test_bad_worker_threads_are_refused_by_name(value, error, words):
    import kpipe
    from kpipe._engine.mapper import ProcessMapper

    with pytest.raises(error, match="`worker_threads`") as info:
        kpipe.ProcessLoader(Pools(), workers=2, worker_threads=value)
    assert words in str(info.value)
    with pytest.raises(error, match="`worker_threads`"):
        ProcessMapper(pools_of, workers=1, worker_threads=value)


def test_numpy_integers_are_accepted():
    assert _threads.check(np.int64(3)) == 3 and isinstance(_threads.check(np.int64(3)), int)


@pytest.mark.parametrize("kwargs, words", [({"workers": 0}, "workers=0"), ({"workers": 2, "use_threads": True}, "use_threads=True")])
def test_worker_threads_without_worker_processes_warns(kwargs, words):
    import kpipe

    with pytest.warns(UserWarning, match=f"`worker_threads` has no effect with {words}"):
        loader = kpipe.ProcessLoader(Pools(n=2), worker_threads=1, **kwargs)
    with loader:
        row(loader[0])
        assert loader.stats()["worker_threads"] is None and loader.stats()["worker_thread_pools"] == []


# ------------------------------------------------------------------ in the workers
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_each_worker_gets_its_share_of_the_cpus(workers, four_cpus, no_leaks):
    import kpipe

    expected = int(_CPUS) // workers
    with kpipe.ProcessLoader(Pools(n=2 * workers), workers=workers) as loader:
        rows = _rows(loader)
        stats = loader.stats()
    _assert_budget(rows, expected)
    assert {r["pid"] for r in rows} == set(stats["pids"])  # two batches each: every worker answered
    assert stats["worker_threads"] == expected
    reports = stats["worker_thread_pools"]
    assert sorted(r["pid"] for r in reports) == sorted(stats["pids"])
    for report in reports:  # each sent its report before its first batch
        assert report["threads"] == expected and report["not_limited"] == [], report
        assert report["pools"] and all(p["threads"] == expected for p in report["pools"]), report


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_an_explicit_budget_holds(start_method, no_leaks):
    import kpipe

    with kpipe.ProcessLoader(Pools(n=4), workers=2, worker_threads=3, start_method=start_method) as loader:
        rows = _rows(loader)
        assert loader.stats()["worker_threads"] == 3
    _assert_budget(rows, 3, start_method)
    assert len({r["pid"] for r in rows}) == 2


_FORK_SCRIPT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from threadpoolctl import threadpool_info
from kpipe._engine._pool import ProcessBackend
from tests._thread_datasets import Pools, blas_work, row
assert 'tensorflow' not in sys.modules  # start_method='fork' is refused once it is
blas_work(0)
before = [(p['filepath'], p['num_threads']) for p in threadpool_info()]
env = {k: v for k, v in os.environ.items() if k.endswith('_THREADS') or k.endswith('THREADS_NUM')}
b = ProcessBackend(Pools(n=4), num_workers=2, mode='dataset', start_method='fork', timeout=60, seed=0, name='Pools',
                   keep_idle=4, worker_threads=3)
rows = [row(b.get(s)[0]) for s in [b.submit(i) for i in range(4)]]
blas_work(1)
after = [(p['filepath'], p['num_threads']) for p in threadpool_info()]
b.close()
env_after = {k: v for k, v in os.environ.items() if k.endswith('_THREADS') or k.endswith('THREADS_NUM')}
print(json.dumps({'rows': rows, 'consumer_same': before == after and env == env_after, 'consumer': after}))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_explicit_budget_holds_with_the_fork_start_method(tmp_path):
    """In a fresh process: this one has TensorFlow loaded (Keras), where fork is refused."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _FORK_SCRIPT, root], capture_output=True, text=True, timeout=100,
                         env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    _assert_budget(result["rows"], 3, "fork")
    assert len({r["pid"] for r in result["rows"]}) == 2
    assert result["consumer_same"], result["consumer"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_default_budget_follows_this_machines_cpu_limit(no_leaks):
    import kpipe

    limit = _autoscale.cpu_limit()
    with kpipe.ProcessLoader(Pools(n=4), workers=2) as loader:
        rows = _rows(loader)
    _assert_budget(rows, max(1, math.floor(limit) // 2))


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_the_budget_is_divided_again_when_workers_come_and_go(start_method, four_cpus, no_leaks):
    """What `workers="auto"` does, driven by hand: every worker taking tasks gets the
    budget of the new count (the retiring one is left to finish)."""
    from kpipe._engine._pool import ProcessBackend

    backend = ProcessBackend(Pools(n=64), num_workers=1, mode="dataset", start_method=start_method, timeout=60,
                             seed=0, name="Pools", keep_idle=16, max_workers=4)
    key = iter(range(10**6))

    def one_batch_each():
        seqs = [backend.submit(next(key) % 64) for _ in range(backend.num_workers)]  # least loaded: one each
        rows = [row(backend.get(s)[0]) for s in seqs]
        assert sorted(r["pid"] for r in rows) == sorted(backend.pids)
        return rows

    try:
        for change, workers, threads in [(None, 1, 4), ("add", 2, 2), ("add2", 4, 1), ("retire", 3, 1), ("retire", 2, 2),
                                         ("retire", 1, 4), ("add", 2, 2)]:
            if change == "add":
                backend.add_worker(1)
            elif change == "add2":
                backend.add_worker(2)
            elif change == "retire":
                backend.retire_worker()
            assert backend.num_workers == workers and backend.worker_threads == threads
            rows = one_batch_each()
            _assert_budget(rows, threads, started_with=change is None)
            reports = backend.thread_pools()  # their reports came before their batches
            assert [r["threads"] for r in reports] == [threads] * workers, (change, reports)
    finally:
        backend.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_workers_auto_reports_the_budget_of_its_current_count(no_leaks):
    import kpipe

    with kpipe.ProcessLoader(Pools(n=16), workers="auto") as loader:
        _rows(loader)
        stats = loader.stats()
    assert stats["worker_threads"] == _threads.budget(stats["cpu_limit"], stats["workers"])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_process_map_of_kpipe_data_gets_the_budget_too(four_cpus, no_leaks):
    from kpipe._engine.mapper import ProcessMapper

    with ProcessMapper(pools_of, workers=2) as mapper:
        rows = [row(out) for out in mapper.imap(np.full((1,), i) for i in range(4))]
    _assert_budget(rows, 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_the_consumers_pools_and_environment_are_untouched(start_method, no_leaks):
    import kpipe
    from threadpoolctl import threadpool_info

    from tests._thread_datasets import blas_work

    blas_work(0)  # this process's pool is running
    before = [(p["filepath"], p["num_threads"]) for p in threadpool_info()]
    env_before = {name: os.environ.get(name) for name in _threads.ENV_VARS}
    with kpipe.ProcessLoader(Pools(n=4), workers=2, worker_threads=1, start_method=start_method) as loader:
        _assert_budget(_rows(loader), 1, start_method)
        blas_work(1)
        assert [(p["filepath"], p["num_threads"]) for p in threadpool_info()] == before
    assert {name: os.environ.get(name) for name in _threads.ENV_VARS} == env_before


# ------------------------------------------------------------------ OpenCV, TensorFlow
_HAS_CV2 = importlib.util.find_spec("cv2") is not None  # without importing it here


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.skipif(not _HAS_CV2, reason="OpenCV (opencv-python-headless, in the `test` extra) is not installed")
@pytest.mark.parametrize("lazy", [False, True], ids=["imported-by-the-dataset-module", "imported-in-getitem"])
def test_opencv_gets_the_budget(lazy, four_cpus, no_leaks):
    import kpipe

    if lazy:
        from tests._thread_datasets import LazyCv2 as Dataset
    else:
        from tests._cv2_datasets import Blurs as Dataset
    with kpipe.ProcessLoader(Dataset(), workers=2) as loader:
        rows = [tuple(int(v) for v in loader[i]) for i in range(len(loader))]
        reports = loader.stats()["worker_thread_pools"]
    assert len({pid for pid, _ in rows}) == 2
    assert {threads for _, threads in rows} == {2}
    for report in reports:  # OpenCV's own pool, and the OpenBLAS it bundles, are reported
        assert {"library": "opencv", "api": "opencv", "file": "cv2", "threads": 2} in report["pools"], report
        assert report["not_limited"] == [], report
        # Every pool at the budget, or below it where the library is built for fewer
        # threads: OpenCV 4.x wheels bundle a single-threaded OpenBLAS 0.3.3 (5.x: none).
        for p in report["pools"]:
            assert p["threads"] == 2 or p["threads"] == p.get("max_threads") < 2, report
        assert any(p["api"] == "blas" and p["threads"] == 2 for p in report["pools"]), report  # NumPy's


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tensorflow_imported_by_the_dataset_gets_the_budget():
    """(Without `no_leaks`: TensorFlow itself leaves /dev/shm entries in a process that
    imported it, which kpipe neither makes nor owns.)"""
    import kpipe

    from tests._tf_thread_datasets import TfThreads
    from conftest import gone

    with kpipe.ProcessLoader(TfThreads(), workers=1, worker_threads=3, start_method="spawn", timeout=200) as loader:
        rows = [tuple(int(v) for v in loader[i]) for i in range(len(loader))]
        report = loader.stats()["worker_thread_pools"][0]
    assert gone([report["pid"]])
    assert [r[1:] for r in rows] == [(3, 3, 16)] * 2
    assert {"library": "tensorflow", "api": "tensorflow", "file": "tf.config.threading", "threads": 3} in report["pools"]


def test_tensorflow_started_before_the_budget_is_reported_not_limited(monkeypatch):
    """In-process (no worker): a TensorFlow whose runtime already runs keeps its pools,
    and the report says so instead of failing."""

    class Threading:
        @staticmethod
        def set_intra_op_parallelism_threads(n):
            raise RuntimeError("Intra op parallelism cannot be modified after initialization.")

        set_inter_op_parallelism_threads = set_intra_op_parallelism_threads

        @staticmethod
        def get_intra_op_parallelism_threads():
            return 0

    class FakeTf:
        class config:
            threading = Threading

    monkeypatch.setitem(__import__("sys").modules, "tensorflow", FakeTf)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        problem = _threads._limit_tensorflow(2)
    assert isinstance(problem, str) and "runtime started before the budget" in problem


# ------------------------------------------------------------------ workers="auto"
def test_auto_adds_workers_to_threaded_workers_on_the_cpus_they_share():
    """A worker whose BLAS runs on its whole budget (2 threads on 2 CPUs: CPU = 2x wall)
    still counts as one CPU: with the consumer waiting, one worker becomes two (each then
    gets one thread), and never more than the CPUs for CPU-bound batches."""
    from kpipe._engine._autoscale import AutoScaler, Sample

    scaler, t, n = AutoScaler(2, 16), 0.0, 1
    c = dict(consumed=0, wait_s=0.0, main_cpu_s=0.0, done=0, busy_s=0.0, cpu_s=0.0)
    scaler.observe(Sample(t=t, workers=n, **c))
    decisions = []
    for _ in range(8):
        t += 0.5
        c["consumed"] += 40
        c["done"] += 40
        c["wait_s"] += 0.45
        c["busy_s"] += 40 * 0.01
        c["cpu_s"] += 40 * 0.02 / n  # 2 threads at 1 worker, 1 thread each at 2
        d = scaler.observe(Sample(t=t, workers=n, **c))
        if d is not None:
            decisions.append((d.workers_from, d.workers_to))
            n = d.workers_to
            scaler.observe(Sample(t=t, workers=n, **c))
    assert decisions == [(1, 2)]
