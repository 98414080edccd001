"""`ProcessLoader.from_samples`: batches of a per-sample dataset, built by the workers in
the batch's shared memory (kpipe/_samples.py). Compared with `np.stack` of the same samples
in the same order, read by hand; every sample once per pass; the order independent of the
worker count; resumable; shardable; trained by fit() like the same batches in a PyDataset."""

import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest

import kpipe
from kpipe import _samples
from kpipe.errors import BatchStructureError
from _sample_datasets import Counter, Points

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _stacked(ds, samples):
    rows = [ds[int(j)] for j in samples]
    if isinstance(rows[0], dict):
        return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}
    return tuple(np.stack([np.asarray(v) for v in col]) for col in zip(*rows))


def _ids(batch):
    return [int(v) for v in (batch["y"] if isinstance(batch, dict) else batch[1])]


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b))


MODES = {"inline": dict(workers=0), "threads": dict(workers=2, use_threads=True), "processes": dict(workers=2)}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("shuffle, drop", [(False, False), (True, False), (True, True)], ids=["ordered", "shuffled", "shuffled-drop"])
def test_batches_equal_the_stacked_samples_and_each_pass_reads_every_sample_once(mode, shuffle, drop, no_leaks):
    ds = Points(n=10)
    with kpipe.ProcessLoader.from_samples(ds, 4, shuffle=shuffle, seed=3, drop_remainder=drop, **MODES[mode]) as loader:
        assert len(loader) == (2 if drop else 3)
        orders = []
        for pass_ in range(3):
            seen = []
            for i in range(len(loader)):
                batch = loader[i]
                want = _stacked(ds, _samples.SampleBatches(ds, 4, shuffle=shuffle, seed=3, drop_remainder=drop).samples((pass_, i)))
                assert _equal(batch, want), (pass_, i)
                seen += _ids(batch)
            assert len(seen) == len(set(seen)) == (8 if drop else 10)
            orders.append(seen)
    if shuffle:
        assert orders[0] != orders[1] != orders[2]
    else:
        assert orders == [list(range(10))] * 3


def test_the_order_depends_on_the_seed_and_pass_only_not_the_worker_count(no_leaks):
    def read(workers):
        with kpipe.ProcessLoader.from_samples(Points(n=21), 4, shuffle=True, seed=9, workers=workers) as loader:
            return [_ids(loader[i]) for _ in range(2) for i in range(len(loader))]

    assert read(1) == read(2) == read(0)


def test_samples_land_in_the_batch_slot_without_a_copy():
    from kpipe._engine import _alloc, _shm

    segment = _shm.Segment.create(0)
    try:
        alloc = _alloc.begin(segment)  # what a worker does around __getitem__
        try:
            batch = _samples.SampleBatches(Points(n=10), 4, shuffle=False, seed=0, drop_remainder=False)[(0, 1)]
        finally:
            _alloc.end()
        assert all(alloc.offset_of(leaf) is not None for leaf in batch)  # in the slot: handed over as they are
        assert _ids(batch) == [4, 5, 6, 7]
        del batch, alloc
    finally:
        segment.close()


class _Watched:
    """Per-sample images that note, at each `__getitem__`, which earlier samples' arrays
    are still alive (a weak reference each)."""

    def __init__(self, n):
        import weakref

        self.n, self.alive_at_load, self._refs, self._weakref = n, [], [], weakref.ref

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        self.alive_at_load.append([k for k, ref in self._refs if ref() is not None])
        image = np.full((8, 8, 3), j, np.float32)
        self._refs.append((j, self._weakref(image)))
        return image, np.int64(j)


def test_each_sample_is_released_before_the_next_is_loaded():
    # A sample held while the next is made keeps its memory from being reused for it:
    # with large samples (600 KB images) the allocator then cycles through one more
    # buffer per sample, out of the core's cache -- measured 10 us per sample more.
    ds = _Watched(9)
    batch = _samples.SampleBatches(ds, 4, shuffle=True, seed=3, drop_remainder=False)[(0, 1)]
    assert ds.alive_at_load == [[], [], [], []]
    assert sorted(batch[1].tolist()) == sorted(batch[0][:, 0, 0, 0].astype(int).tolist())


class _ScalarLabels:
    """Samples `(image, label)` whose label is a NumPy scalar, a float one from `float_at` on."""

    def __init__(self, n, float_at=None):
        self.n, self.float_at = n, float_at

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        label = np.float64(j) if self.float_at is not None and j >= self.float_at else np.int64(j)
        return np.full((2, 2), j, np.float32), label


def test_numpy_scalar_labels_stack_and_a_changed_dtype_is_named():
    batch = _samples.SampleBatches(_ScalarLabels(6), 3, shuffle=False, seed=0, drop_remainder=False)[(0, 1)]
    assert batch[1].dtype == np.int64 and batch[1].tolist() == [3, 4, 5]
    ds = _samples.SampleBatches(_ScalarLabels(6, float_at=4), 3, shuffle=False, seed=0, drop_remainder=False)
    with pytest.raises(BatchStructureError, match=r"Sample 4 of `_ScalarLabels` has sample\[1\] with shape \(\) and dtype "
                                                  r"float64, but sample 3 of the same batch had \(\) and int64"):
        ds[(0, 1)]


def test_dict_samples_and_scalar_labels(no_leaks):
    with kpipe.ProcessLoader.from_samples(Points(n=6, dict_samples=True), 4, workers=2) as loader:
        batch = loader[1]
    assert batch["x"].shape == (2, 3) and batch["y"].tolist() == [4, 5]


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "processes"])
def test_samples_of_other_shapes_get_a_named_error(workers, no_leaks):
    with kpipe.ProcessLoader.from_samples(Points(n=8, ragged_at=5), 4, workers=workers) as loader:
        assert _ids(loader[0]) == [0, 1, 2, 3]
        with pytest.raises(BatchStructureError, match=r"Sample 5 of `Points` has sample\[0\] with shape \(4,\) .* but sample 4 "
                                                      r"of the same batch had \(3,\)"):
            loader[1]


def test_state_saved_mid_pass_resumes_the_same_batches_with_other_workers(no_leaks):
    with kpipe.ProcessLoader.from_samples(Points(n=18), 4, shuffle=True, seed=5, workers=2) as loader:
        full = [_ids(loader[i]) for _ in range(3) for i in range(len(loader))]
    with kpipe.ProcessLoader.from_samples(Points(n=18), 4, shuffle=True, seed=5, workers=2) as loader:
        head = [_ids(loader[i]) for i in range(len(loader))] + [_ids(loader[i]) for i in range(2)]
        state = loader.state()
    with kpipe.ProcessLoader.from_samples(Points(n=18), 4, shuffle=True, seed=5, workers=1) as loader:
        loader.restore(state)
        rest = [_ids(loader[i]) for i in range(2, len(loader))] + [_ids(loader[i]) for i in range(len(loader))]
    assert head + rest == full


def test_shards_read_disjoint_samples_and_cover_every_one(no_leaks):
    seen = []
    for shard in range(3):
        with kpipe.ProcessLoader.from_samples(Points(n=29), 4, shuffle=True, seed=2, workers=0, num_shards=3,
                                              shard_index=shard) as loader:
            assert len(loader) == 3  # 8 batches of a pass (the last of 1 sample), 3 steps per shard
            batches = [_ids(loader[i]) for i in range(len(loader))]
            assert (batches[-1] == []) == (shard == 2)  # shard 2 ends with a pad: no rows
            seen += [j for batch in batches for j in batch]
    assert sorted(seen) == list(range(29))


def test_the_datasets_own_hooks_run_and_reach_the_workers(no_leaks):
    with kpipe.ProcessLoader.from_samples(Counter(n=8), 4, workers=2) as loader:
        first = [float(loader[i][0][0, 0]) for i in range(2)]
        loader.on_epoch_end()
        second = [float(loader[i][0][0, 0]) for i in range(2)]
    assert first == [0.0, 4.0] and second == [100.0, 104.0]


def test_fit_trains_like_the_same_batches_in_a_pydataset(no_leaks):
    class Stacked(keras.utils.PyDataset):
        def __init__(self, ds, order):
            super().__init__()
            self.ds, self.order = ds, order

        def __len__(self):
            return len(self.order)

        def __getitem__(self, i):
            x, y, w = _stacked(self.ds, self.order[i])
            return x, y.astype("float32")[:, None], w

    def model():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        m.compile(keras.optimizers.SGD(0.001), "mse")
        return m

    ds = Points(n=20)
    batches = _samples.SampleBatches(ds, 8, shuffle=False, seed=0, drop_remainder=False)
    plain = model()
    plain.fit(Stacked(ds, [batches.samples((0, i)) for i in range(len(batches))]), epochs=2, shuffle=False, verbose=0)

    class AsFloat:  # the per-sample dataset with the same float32 targets
        def __len__(self):
            return len(ds)

        def __getitem__(self, j):
            x, y, w = ds[j]
            return x, np.float32([y]), w

    got = model()
    with kpipe.ProcessLoader.from_samples(AsFloat(), 8, workers=2) as loader:
        got.fit(loader, epochs=2, verbose=0, shuffle=False)  # (the loader follows it: shuffle=None)
    for a, b in zip(got.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("args, error, message", [
    (dict(batch_size=0), ValueError, "`batch_size` must be >= 1. Received: batch_size=0"),
    (dict(batch_size=2.5), TypeError, "`batch_size` must be an integer"),
    (dict(batch_size=20, drop_remainder=True), ValueError, "has 10 samples, fewer than batch_size=20"),
])
def test_bad_arguments_are_refused_with_what_was_received(args, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        kpipe.ProcessLoader.from_samples(Points(n=10), workers=0, **args)


def test_a_dataset_without_a_length_is_refused():
    class Stream:
        def __getitem__(self, j):
            return np.zeros(3)

    with pytest.raises(TypeError, match="must have __len__"):
        kpipe.ProcessLoader.from_samples(Stream(), 4, workers=0)


def test_workers_do_not_import_tensorflow_for_the_sample_batches(no_leaks):
    with kpipe.ProcessLoader.from_samples(Points(n=8), 4, workers=1) as loader:
        pid = loader.stats()["pids"][0]
        loader[0]
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    assert "tensorflow" not in maps and "_pywrap" not in maps and os.getpid() != pid


class _Nested:
    def __init__(self, bad_at=None):
        self.bad_at = bad_at

    def __len__(self):
        return 6

    def __getitem__(self, j):
        if j == self.bad_at:
            return {"a": np.zeros(2, np.float32)}, j  # the nested dict lost a key
        return {"a": np.full(2, j, np.float32), "b": (np.int8(j), [j, j])}, j


def test_nested_samples_stack_leaf_by_leaf_and_a_changed_structure_is_named():
    batches = _samples.SampleBatches(_Nested(), 4, shuffle=False, seed=0, drop_remainder=False)
    (features, labels) = batches[(0, 0)]
    assert features["a"].shape == (4, 2) and features["b"][0].dtype == np.int8
    assert [leaf.tolist() for leaf in features["b"][1]] == [[0, 1, 2, 3]] * 2  # a list is a container of leaves, as in a batch
    assert labels.tolist() == [0, 1, 2, 3]
    bad = _samples.SampleBatches(_Nested(bad_at=2), 4, shuffle=False, seed=0, drop_remainder=False)
    with pytest.raises(BatchStructureError, match=r"Sample 2 of `_Nested` has structure \(\{'a': array\}, array\), but sample 0"):
        bad[(0, 0)]


_ORPHAN_SCRIPT = """
import os, sys, time
import numpy as np
import kpipe

class Sleepy:  # each worker marks that it is inside a sample's load, then sleeps an hour
    def __init__(self, marks):
        self.marks = marks
    def __len__(self):
        return 16
    def __getitem__(self, j):
        open(os.path.join(self.marks, str(os.getpid())), 'w').close()
        time.sleep(3600)
        return np.zeros(2)

if __name__ == '__main__':
    loader = kpipe.ProcessLoader.from_samples(Sleepy(sys.argv[1]), 4, shuffle=True, workers=2, timeout=None)
    pids = loader.stats()['pids']
    import threading
    threading.Thread(target=lambda: loader[0], daemon=True).start()  # asks for batches 0-1...
    deadline = time.monotonic() + 60  # ...until both workers are inside __getitem__ (only catches a hang)
    while len(os.listdir(sys.argv[1])) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    print('PIDS', *pids, flush=True)
    time.sleep(3600)
"""


def test_sigkilled_main_process_leaves_no_sample_worker_even_mid_sample(tmp_path):
    from conftest import gone, kill_and_reap, live_pids

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(kpipe.__file__))))
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    pids = []
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and sorted(os.listdir(tmp_path)) == sorted(map(str, pids))  # both mid-sample
        kill_and_reap(proc)
        # (gone's deadline only catches a hang: a sample takes an hour)
        assert gone(pids), f"workers {live_pids(pids)} outlived the SIGKILLed main process"
    finally:
        kill_and_reap(proc)
        for p in live_pids(pids):
            os.kill(p, signal.SIGKILL)
