"""Soak tests (slow): nothing accumulates over many epochs or many pools.

* 50 epochs of a dataset that replaces its 8 MB index array in `on_epoch_end`: process
  count, descriptors and shared arrays exactly flat in the main process and in every
  worker; RSS within a small tolerance (a leak would add 8 MB per epoch and process).
* 200 open/use/close cycles of `ProcessBackend` over every start method, in a fresh
  interpreter (so `fork` is allowed: no TensorFlow there): no process, descriptor or
  shared-memory segment left at the end.
* 50 passes of `ProcessLoader.from_samples` over a dataset whose hook changes it, as a
  manual loop runs them: each sample once a pass, the hook once a pass, processes,
  descriptors and RSS flat.
"""

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import psutil
import pytest

import kpipe
from _engine_datasets import Replacing, array_mappings, fd_count, memfd_count
from conftest import kpipe_children, reader_of
from kpipe._engine._pool import ProcessBackend

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(300)]

_MIB = 1 << 20
# RSS may drift by allocator noise; a leak of the replaced array would be 8 MiB an epoch.
_RSS_TOLERANCE = 8 * _MIB


def _snapshot(backend):
    gc.collect()
    procs = [psutil.Process()] + [psutil.Process(p) for p in backend.pids]
    return {
        "children": len(kpipe_children()),
        "fds": [fd_count(p.pid) for p in procs],
        "memfds": [memfd_count(p.pid) for p in procs],
        "array_maps": [array_mappings(p.pid) for p in procs],
        "entries": len(backend._shared.entries),
        "rss": [p.memory_info().rss for p in procs],
    }


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_50_epochs_of_a_replacing_dataset_stay_flat(start_method, no_leaks, record_property):
    ds = Replacing(n=1_000_000, batches=8)  # an 8 MB int64 index, replaced every epoch
    backend = ProcessBackend(ds, num_workers=2, mode="dataset", start_method=start_method, timeout=60, seed=0, name="Replacing", keep_idle=4)
    try:
        snaps = {}
        for epoch in range(51):
            got = [backend.get(backend.submit(i))[0] for i in range(len(ds))]
            assert got[-1][0].tolist() == ds.indexes[28:32].tolist()
            del got
            if epoch in (5, 50):
                snaps[epoch] = _snapshot(backend)
            ds.on_epoch_end()
            backend.reset_target(ds)
    finally:
        backend.close()
    start, end = snaps[5], snaps[50]
    for key in ("children", "fds", "memfds", "array_maps", "entries"):
        assert end[key] == start[key], f"{key} after 5 epochs: {start[key]}, after 50: {end[key]}"
    growth = [b - a for a, b in zip(start["rss"], end["rss"])]
    record_property("rss_growth_mib", [round(g / _MIB, 2) for g in growth])
    assert max(growth) < _RSS_TOLERANCE, f"RSS growth over 45 epochs (main, workers), MiB: {[g / _MIB for g in growth]}"


_CYCLES_SCRIPT = textwrap.dedent(
    """
    import gc, os, sys
    sys.path.insert(0, {tests!r})
    from _engine_datasets import Replacing, memfd_count
    from conftest import kpipe_children
    from kpipe._engine._pool import ProcessBackend

    assert 'tensorflow' not in sys.modules
    methods = ['spawn', 'forkserver', 'fork', 'fork']
    def cycle(i):
        b = ProcessBackend(Replacing(batches=2), num_workers=1 + i % 2, mode='dataset', start_method=methods[i % 4],
                           timeout=60, seed=i, name='Replacing', keep_idle=2)
        try:
            x = b.get(b.submit(i % 2))[0][0]
            assert int(x[0]) == 4 * (i % 2)
            if i % 3 == 0:
                return x  # a batch kept past close() stays valid
        finally:
            b.close()

    cycle(0); gc.collect()  # first-use costs (imports, the fd limit, the spawner) out of the count
    fds0, memfds0 = len(os.listdir('/proc/self/fd')), memfd_count(os.getpid())
    kept = []
    for i in range(1, 201):
        x = cycle(i)
        if x is not None:
            kept = [(x, i)]  # one batch at a time outlives its pool (a mapping, no descriptor)
        assert all(int(x[0]) == 4 * (j % 2) for x, j in kept)
    del kept, x
    gc.collect()
    children = kpipe_children()
    print('CYCLES 200 CHILDREN', len(children), 'FDS', fds0, len(os.listdir('/proc/self/fd')),
          'MEMFDS', memfds0, memfd_count(os.getpid()), flush=True)
    """
)


def test_200_open_use_close_cycles_leave_nothing(no_leaks):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(kpipe.__file__))))
    script = _CYCLES_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=280, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    fields = out.stdout.split("CYCLES 200 CHILDREN")[1].split()
    children, fds_before, fds_after, memfds_before, memfds_after = int(fields[0]), int(fields[2]), int(fields[3]), int(fields[5]), int(fields[6])
    assert children == 0, out.stdout
    assert fds_after <= fds_before, out.stdout
    assert memfds_after <= memfds_before == 0, out.stdout
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr, out.stderr


def test_200_fits_on_dropped_loaders_leave_nothing_behind(record_property):
    """The notebook pattern: `model.fit(kpipe.ProcessLoader(ds))`, never closed, 200 times.
    Keras's traced graphs keep the adapter (and would keep the loader) forever; kpipe's
    adapter holds it weakly, so each loader's workers stop when fit() returns."""
    import keras
    import numpy as np
    from _keras_datasets import BatchIds

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    before = {p.pid for p in kpipe_children()}
    me = psutil.Process()

    def fit_and_drop():
        model.fit(kpipe.ProcessLoader(BatchIds(3), workers=2), epochs=1, verbose=0)

    for _ in range(20):  # warm up TensorFlow's caches
        fit_and_drop()
    gc.collect()
    fds, rss = fd_count(me.pid), me.memory_info().rss
    for _ in range(180):
        fit_and_drop()
    gc.collect()
    left = [p for p in kpipe_children() if p.pid not in before]
    growth = (me.memory_info().rss - rss) / 180
    record_property("rss_growth_per_fit_kib", round(growth / 1024, 1))
    record_property("fds_after_200", fd_count(me.pid))
    assert not left, f"{len(left)} worker processes outlived their loaders"
    assert fd_count(me.pid) <= fds + 2, "file descriptors accumulate"
    # TensorFlow itself keeps a little per fit() (each from_generator registers a function
    # forever); a leaked loader would keep its slots and arrays: far more than this.
    assert growth < 256 * 1024, f"RSS grew {growth / 1024:.0f} KiB per fit()"
    assert np.isfinite(model.get_weights()[0]).all()


def test_50_epochs_of_from_samples_stay_flat_and_read_each_sample_once_a_pass(no_leaks, record_property):
    """`ProcessLoader.from_samples` used as a manual loop does -- `len()`, `[i]` and
    `on_epoch_end()` -- for 50 passes of a dataset whose hook changes it: every pass reads
    each sample once, on the state its hook left, the hook runs once per pass, and
    processes, descriptors and RSS stay flat."""
    from _sample_datasets import Counter

    class Counting(Counter):
        hook_calls = 0

        def on_epoch_end(self):
            type(self).hook_calls += 1
            super().on_epoch_end()

    ds = Counting(n=40)
    with kpipe.ProcessLoader.from_samples(ds, 4, shuffle=True, seed=1, workers=2) as loader:
        snaps, orders = {}, set()
        for epoch in range(51):
            batches = [loader[i] for i in range(len(loader))]
            ids = [int(j) for _, y, _ in batches for j in y]
            assert sorted(ids) == list(range(40)), f"pass {epoch}: {ids}"
            assert all(np.array_equal(x[:, 0], y.astype(np.float32) + 100 * epoch) for x, y, _ in batches), f"pass {epoch}"
            orders.add(tuple(ids))
            del batches
            if epoch in (5, 50):
                backend = reader_of(loader).backend
                snaps[epoch] = dict(_snapshot(backend), pids=sorted(backend.pids))
            loader.on_epoch_end()
    assert Counting.hook_calls == 51
    assert len(orders) > 40  # shuffled anew each pass
    start, end = snaps[5], snaps[50]
    for key in ("children", "pids", "fds", "memfds", "array_maps", "entries"):
        assert end[key] == start[key], f"{key} after 5 passes: {start[key]}, after 50: {end[key]}"
    growth = [b - a for a, b in zip(start["rss"], end["rss"])]
    record_property("rss_growth_mib", [round(g / _MIB, 2) for g in growth])
    assert max(growth) < _RSS_TOLERANCE, f"RSS growth over 45 passes (main, workers), MiB: {[g / _MIB for g in growth]}"
