"""kpipe.data.from_hdf5: coverage, sharding, block reads, compressed files, bad input."""

import errno
import gc
import os
import threading

import h5py
import numpy as np
import pytest

import kpipe.data
from kpipe.data._hdf5 import _Hdf5Reader, open_hdf5
from kpipe.data._source import source_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = 150  # per file; not a multiple of the chunk, so partial chunks are covered too


def _write(path, start, rows=ROWS, *, chunks=(16, 3, 2), compression="gzip", y_rows=None):
    x = (np.arange(start, start + rows, dtype=np.float32)[:, None, None] * np.ones((1, 3, 2), np.float32))
    y = np.arange(start, start + (rows if y_rows is None else y_rows), dtype=np.int64)
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=x, chunks=chunks, compression=compression)
        f.create_dataset("labels", data=y, chunks=(min(64, len(y)),) if compression else None, compression=compression)
    return str(path)


@pytest.fixture
def files(tmp_path):
    return [_write(tmp_path / f"part{i}.h5", i * ROWS) for i in range(3)]


def _ids(ds):
    return [int(y) for _, y in ds.as_numpy_iterator()]


def test_every_sample_exactly_once_in_storage_order(files):
    ds = kpipe.data.from_hdf5(files, x="images", y="labels", block_size=16)
    out = list(ds.as_numpy_iterator())
    assert [int(y) for _, y in out] == list(range(3 * ROWS))
    for x, y in out[::37]:
        assert x.shape == (3, 2) and np.all(x == y)


def test_compressed_chunked_file_reads_correctly(tmp_path):
    path = _write(tmp_path / "z.h5", 0, rows=200, chunks=(32, 3, 2), compression="gzip")
    with h5py.File(path) as f:
        assert f["images"].compression == "gzip" and f["images"].chunks == (32, 3, 2)
    x = kpipe.data.from_hdf5(path, x="images")
    got = np.stack(list(x.as_numpy_iterator()))
    assert got.shape == (200, 3, 2) and np.array_equal(got[:, 0, 0], np.arange(200))


def test_reads_chunk_aligned_blocks_not_samples(files):
    ds = kpipe.data.from_hdf5(files, x="images", y="labels", block_size=20)  # rounded up to 32
    source, _ = source_of(ds)
    calls = []
    read = source.reader.read

    def counting(part, lo, hi, ids):
        calls.append((part, lo, hi))
        return read(part, lo, hi, ids)

    source.reader.read = counting
    assert _ids(ds) == list(range(3 * ROWS))
    assert len(calls) == 3 * 5  # ceil(150 / 32) blocks per file, not 450 sample reads
    assert all(lo % 32 == 0 and hi - lo <= 32 for _, lo, hi in calls)


def test_glob_and_x_y_structures(files, tmp_path):
    pattern = str(tmp_path / "part*.h5")
    ds = kpipe.data.from_hdf5(pattern, x={"a": "images", "b": "labels"}, y=("labels",))
    x, y = next(ds.as_numpy_iterator())
    assert set(x) == {"a", "b"} and x["a"].shape == (3, 2) and y == (0,)
    alone = kpipe.data.from_hdf5(files[0], x="labels")
    assert [int(v) for v in alone.as_numpy_iterator()] == list(range(ROWS))


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_shards_are_disjoint_and_complete(files, num_shards):
    seen = []
    for index in range(num_shards):
        ds = kpipe.data.from_hdf5(files, x="images", y="labels", block_size=16, num_shards=num_shards, index=index)
        ids = _ids(ds)
        assert abs(len(ids) - 3 * ROWS / num_shards) <= 1
        seen.extend(ids)
    assert sorted(seen) == list(range(3 * ROWS))


def test_input_context_shards_like_num_shards(files):
    import tensorflow as tf

    ctx = tf.distribute.InputContext(num_input_pipelines=3, input_pipeline_id=2, num_replicas_in_sync=3)
    a = _ids(kpipe.data.from_hdf5(files, x="images", y="labels", input_context=ctx))
    b = _ids(kpipe.data.from_hdf5(files, x="images", y="labels", num_shards=3, index=2))
    assert a == b == list(range(300, 450))


def test_concurrent_threads_never_share_a_handle_and_gc_closes_them(files):
    reader = _Hdf5Reader(files, ["labels"])
    in_use, clashes, errors, results = set(), [], [], {}
    guard = threading.Lock()
    checkout, checkin = reader._checkout, reader._checkin

    def tracked_checkout(part):
        entry = checkout(part)
        with guard:
            if id(entry[0]) in in_use:
                clashes.append(part)
            in_use.add(id(entry[0]))
        return entry

    def tracked_checkin(part, entry):
        with guard:
            in_use.discard(id(entry[0]))
        checkin(part, entry)

    reader._checkout, reader._checkin = tracked_checkout, tracked_checkin

    def work(t):
        try:
            results[t] = [int(reader.read(part, 7, ROWS, [0])[0][0]) for _ in range(20) for part in range(3)]
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)  # a deadline that only catches a hang
    assert not errors and not clashes
    assert not any(t.is_alive() for t in threads) and sorted(results) == [0, 1, 2, 3]
    assert all(r == [7, 157, 307] * 20 for r in results.values())
    assert 3 <= reader.opened <= 4 * 3  # reused, at most one per concurrent reader and file
    handles = list(reader._open)
    del reader, tracked_checkout, tracked_checkin, checkout, checkin
    gc.collect()
    assert handles and not any(h.id.valid for h in handles)


def test_epochs_reuse_handles_instead_of_reopening(files):
    ds = kpipe.data.from_hdf5(files, x="images", y="labels", block_size=16)
    source, _ = source_of(ds)
    shuffled = kpipe.data.pipeline(ds, batch_size=8, shuffle=32, seed=0)
    for _ in range(3):
        assert len(_ids(ds)) == 3 * ROWS
        assert sum(len(y) for _, y in shuffled.as_numpy_iterator()) == 3 * ROWS
    blocks = 3 * 10
    assert source.reader.opened < blocks  # 180 block reads over 6 epochs; handles are reused
    assert len(source.reader._open) == source.reader.opened


def test_missing_file(files, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.h5"):
        kpipe.data.from_hdf5([files[0], str(tmp_path / "nope.h5")], x="images")
    with pytest.raises(FileNotFoundError, match="matches no files"):
        kpipe.data.from_hdf5(str(tmp_path / "*.hdf"), x="images")


def test_missing_key_names_key_file_and_choices(files):
    with pytest.raises(KeyError, match=r"no dataset 'imgs'.*Datasets in the file: \['images', 'labels'\]"):
        kpipe.data.from_hdf5(files, x="imgs", y="labels")


def test_x_y_length_mismatch(tmp_path):
    path = _write(tmp_path / "bad.h5", 0, rows=50, y_rows=49)
    with pytest.raises(ValueError, match=r"'labels' \(from `y`\) has 49 rows but 'images' \(from `x`\) has 50"):
        kpipe.data.from_hdf5(path, x="images", y="labels")


def test_unsupported_dtype(tmp_path):
    path = str(tmp_path / "str.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("names", data=np.array([b"a", b"b"]))
    with pytest.raises(TypeError, match="dtype \\|S1.*Supported dtypes"):
        kpipe.data.from_hdf5(path, x="names")


def test_files_must_agree_on_sample_shape(tmp_path):
    a = _write(tmp_path / "a.h5", 0)
    b = str(tmp_path / "b.h5")
    with h5py.File(b, "w") as f:
        f.create_dataset("images", data=np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError, match=r"per-sample shape \(4,\).*first file has float32 and \(3, 2\)"):
        kpipe.data.from_hdf5([a, b], x="images")




# -- why a file cannot be opened -------------------------------------------------------------

def test_not_an_hdf5_file_is_told_apart_from_other_failures(tmp_path):
    path = tmp_path / "fake.h5"
    path.write_bytes(b"not hdf5")
    with pytest.raises(ValueError, match=r"'.*fake.h5' is not an HDF5 file \(h5py: .*file signature not found"):
        kpipe.data.from_hdf5(str(path), x="images")


def test_file_removed_after_the_dataset_was_made_names_the_file(files):
    os.remove(files[1])
    with pytest.raises(FileNotFoundError, match=r"HDF5 file '.*part1.h5' does not exist .*moved or deleted") as info:
        open_hdf5(files[1])
    assert info.value.errno == errno.ENOENT


def test_file_locked_by_a_writer_says_so_and_how_to_proceed(files):
    import subprocess
    import sys

    writer = subprocess.Popen(
        [sys.executable, "-c", f"import h5py, sys, time; f = h5py.File({files[0]!r}, 'a'); "
                               "print('open', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "open"
        with pytest.raises(BlockingIOError, match=r"'.*part0.h5' is locked by another process.*Close the writer.*HDF5_USE_FILE_LOCKING=FALSE"):
            kpipe.data.from_hdf5(files[0], x="images")
    finally:
        writer.stdin.close()
        writer.wait(timeout=30)
    assert kpipe.data.from_hdf5(files[0], x="images") is not None  # the writer closed: opens


def test_unreadable_file_is_a_permission_error_naming_the_file(files):
    """Run in a child without the capabilities that let root read anything."""
    import shutil
    import subprocess
    import sys

    os.chmod(files[0], 0)
    code = ("import sys; from kpipe.data._hdf5 import open_hdf5\n"
            f"try:\n    open_hdf5({files[0]!r})\n"
            "except PermissionError as e:\n    print('PermissionError', e.errno, e)\n")
    prefix = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("running as root without setpriv: root reads any file")
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(prefix + [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"PermissionError {errno.EACCES} [Errno 13] Permission denied reading HDF5 file "), proc.stdout
    assert "part0.h5" in proc.stdout and "read access" in proc.stdout
