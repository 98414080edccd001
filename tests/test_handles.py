"""Open handles held by a dataset travel as what they are: reopened in workers by name."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import kpipe
from _datasets import LazyH5
from _handle_datasets import Images, Nested, Rows
from kpipe._engine import _pickling

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


def _h5(path, n=64):
    import h5py

    with h5py.File(path, "w") as f:
        f["x"] = np.arange(n * 3, dtype="float32").reshape(n, 3)
        f["y"] = np.arange(n, dtype="int64")
        f["x"].attrs["offset"] = 0.5
    return str(path)


def test_readme_images_after_looking_at_a_batch_trains_through_workers(tmp_path, no_leaks):
    ds = Images(_h5(tmp_path / "train.h5"), 8)
    x0, y0 = ds[0]  # looking at a batch first, as everyone does: the file is now open
    opened = ds._h5
    with kpipe.ProcessLoader(ds, workers=2, shuffle=True, seed=0) as loader:
        ys = np.concatenate([loader[i][1] for i in range(len(loader))])
    assert sorted(ys.tolist()) == list(range(64))
    assert ds._h5 is opened and bool(opened) and opened.mode == "r"  # the user's object, untouched
    assert np.array_equal(ds[0][0], x0)


def test_readme_images_fit_through_workers(tmp_path, no_leaks):
    import keras

    ds = Images(_h5(tmp_path / "train.h5"), 8)
    ds[0]
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with kpipe.ProcessLoader(ds, workers=2) as loader:
        history = model.fit(loader, epochs=2, verbose=0)
    assert len(history.history["loss"]) == 2


def test_an_unchanged_dataset_with_handles_pickles_to_the_same_bytes(tmp_path):
    ds = Images(_h5(tmp_path / "d.h5"), 8)
    ds[0]
    assert _pickling.dumps(ds)[0] == _pickling.dumps(ds)[0]
    assert _pickling.state_fingerprint(ds) == _pickling.state_fingerprint(ds) is not None


def test_nested_handles_reopen_in_each_worker(tmp_path, no_leaks):
    labels = tmp_path / "labels.txt"
    labels.write_text(" ".join(f"n{i}" for i in range(64)))
    ds = Nested(_h5(tmp_path / "d.h5"), str(labels))
    with kpipe.ProcessLoader(ds, workers=2) as loader:
        batches = [loader[i] for i in range(len(loader))]
    for i, (x, y, named) in enumerate(batches):
        assert np.array_equal(x, np.arange(i * 12, i * 12 + 12, dtype="float32").reshape(4, 3) + 0.5)
        assert np.array_equal(y, named) and np.array_equal(y, np.arange(i * 4, i * 4 + 4))


def test_a_closed_file_gets_a_clear_error(tmp_path, no_leaks):
    ds = LazyH5(_h5(tmp_path / "d.h5"))  # (its length is read in __init__)
    ds[0]
    ds._h5.close()
    with pytest.raises(kpipe.DatasetPicklingError, match=r"`LazyH5` holds an h5py File in `self._h5` .*closed.*set the attribute to None"):
        kpipe.ProcessLoader(ds, workers=2)


def test_a_file_moved_after_opening_gets_an_error_naming_the_path(tmp_path, no_leaks):
    path = _h5(tmp_path / "d.h5")
    ds = Images(path, 8)
    ds[0]
    os.rename(path, tmp_path / "moved.h5")
    with pytest.raises(kpipe.DatasetPicklingError) as info:
        kpipe.ProcessLoader(ds, workers=2)
    assert f"opened from {path!r}, which no longer exists" in str(info.value)
    assert str(tmp_path / "moved.h5") in str(info.value)


def test_a_memmap_is_mapped_again_in_workers_not_copied(tmp_path, no_leaks):
    path = str(tmp_path / "rows.f32")
    data = np.memmap(path, dtype="float32", mode="w+", shape=(64, 4096))  # 1 MB
    data[:] = np.arange(64, dtype="float32")[:, None]
    data.flush()
    ds = Rows(np.memmap(path, dtype="float32", mode="r", shape=(64, 4096)))
    payload, _ = _pickling.dumps(ds)
    assert len(payload) < 10_000  # the file's name, not its 1 MB
    with kpipe.ProcessLoader(ds, workers=2) as loader:
        batches = [loader[i] for i in range(len(loader))]
    for i, (rows, flags) in enumerate(batches):
        assert np.array_equal(rows[:, 0], np.arange(i * 8, i * 8 + 8))
        assert flags[0].tolist() == [True, True, False]  # a memmap of the file, no TensorFlow


@pytest.mark.parametrize("view", ["slice", "strided", "transposed", "array view", "copy-on-write"])
def test_memmap_views_come_back_as_the_same_view_of_the_same_file(tmp_path, view):
    path = str(tmp_path / "m.i16")
    np.arange(40 * 30, dtype="int16").tofile(path)
    mode = "c" if view == "copy-on-write" else "r"
    mm = np.memmap(path, dtype="int16", mode=mode, offset=60, shape=(30, 30))
    arr = {"slice": mm[3:9], "strided": mm[2:20:3, ::-2], "transposed": mm.T, "array view": np.asarray(mm)[1:4],
           "copy-on-write": mm}[view]
    payload, _ = _pickling.dumps(arr)
    assert len(payload) < 1000
    back = _pickling.loads(payload, {})
    assert type(back) is type(arr) and back.dtype == arr.dtype and back.strides == arr.strides
    assert np.array_equal(back, arr)
    if view == "copy-on-write":
        back[0, 0] = -1  # a private page, as in the user's own memmap
        assert np.fromfile(path, dtype="int16")[30] == 30


def test_handles_that_cannot_be_reopened_get_a_named_error(tmp_path):
    class Holder:
        pass

    holder = Holder()
    with open(tmp_path / "log.txt", "w") as log:
        holder.outputs = {"log": log}
        with pytest.raises(kpipe.DatasetPicklingError, match=r"holds a file object .* in `self.outputs\['log'\]`.*open for writing.*__getstate__.*factory"):
            _pickling.dumps(holder)
    with socket.socket() as sock:
        holder.outputs = [sock]
        with pytest.raises(kpipe.DatasetPicklingError, match=r"holds a socket in `self.outputs\[0\]`.*__setstate__"):
            _pickling.dumps(holder)
    import h5py

    with h5py.File(tmp_path / "w.h5", "w") as f:
        holder.outputs = f
        with pytest.raises(kpipe.DatasetPicklingError, match=r"open for writing \(mode 'r\+'\).*h5py.File\(path, 'r'\)"):
            _pickling.dumps(holder)


@pytest.mark.timeout(240)
def test_kpipe_bench_on_the_readme_images(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", KPIPE_TEST_H5=_h5(tmp_path / "d.h5"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, TESTS, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "kpipe.cli", "bench", "_handle_datasets:make_images",
                           "--workers", "0,2", "--batches", "4", "--json"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DatasetPicklingError" not in proc.stderr
