"""kpipe.data.from_numpy: in-memory arrays and memory-mapped .npy files."""

import numpy as np
import pytest

import kpipe.data
from kpipe.data._source import source_of

N = 101


def _xy():
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    return x, np.arange(N)


def test_every_row_exactly_once_in_order():
    x, y = _xy()
    out = list(kpipe.data.from_numpy(x, y, block_size=8).as_numpy_iterator())
    assert [int(b) for _, b in out] == list(range(N))
    assert np.array_equal(np.stack([a for a, _ in out]), x)


def test_npy_files_are_memory_mapped_not_loaded(tmp_path):
    x, y = _xy()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    ds = kpipe.data.from_numpy(str(tmp_path / "x.npy"), tmp_path / "y.npy", block_size=10)
    source, _ = source_of(ds)
    assert all(isinstance(a, np.memmap) for a in source.reader.arrays)
    assert [int(b) for _, b in ds.as_numpy_iterator()] == list(range(N))


def test_dict_inputs_and_no_y():
    x, y = _xy()
    ds = kpipe.data.from_numpy({"a": x, "b": y})
    first = next(ds.as_numpy_iterator())
    assert set(first) == {"a", "b"} and first["a"].tolist() == [0.0, 1.0] and first["b"] == 0


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_shards_are_disjoint_and_complete(num_shards):
    x, y = _xy()
    seen = []
    for index in range(num_shards):
        ids = [int(b) for _, b in kpipe.data.from_numpy(x, y, num_shards=num_shards, index=index).as_numpy_iterator()]
        assert ids == sorted(ids)  # contiguous index ranges
        seen.extend(ids)
    assert sorted(seen) == list(range(N))


def test_length_mismatch():
    with pytest.raises(ValueError, match=r"`y` has 100 rows but `x` has 101"):
        kpipe.data.from_numpy(np.zeros((N, 2)), np.zeros(N - 1))


@pytest.mark.parametrize("bad", [np.array(["a", "b"]), np.array([{}, {}], dtype=object)])
def test_unsupported_dtype(bad):
    with pytest.raises(TypeError, match="`x` has dtype .*cannot read into tensors"):
        kpipe.data.from_numpy(bad)


def test_missing_and_wrong_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.npy"):
        kpipe.data.from_numpy(str(tmp_path / "missing.npy"))
    np.savez(tmp_path / "a.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a `.npy` file"):
        kpipe.data.from_numpy(str(tmp_path / "a.npz"))


def test_bad_shard_arguments():
    x, _ = _xy()
    with pytest.raises(ValueError, match="`index` must be an integer in \\[0, num_shards\\)"):
        kpipe.data.from_numpy(x, num_shards=2, index=2)
    with pytest.raises(ValueError, match="`num_shards` and `index` go together"):
        kpipe.data.from_numpy(x, num_shards=2)
    with pytest.raises(ValueError, match="`block_size` must be an integer >= 1"):
        kpipe.data.from_numpy(x, block_size=0)


@pytest.mark.parametrize("layout", ["memory", "npy"])
def test_blocks_handed_to_tensorflow_are_never_the_users_memory(layout, tmp_path):
    # tf.numpy_function wraps a returned array without a copy and may then write an op's
    # output into it: on TF 2.16 a shuffled from_numpy mapped with `y + 1` added 1 to the
    # user's y[0] every pass (issue 51). Every block read is memory of its own.
    x, y = _xy()
    if layout == "npy":
        np.save(tmp_path / "x.npy", x)
        np.save(tmp_path / "y.npy", y)
        x, y = np.load(tmp_path / "x.npy", mmap_mode="r"), np.load(tmp_path / "y.npy", mmap_mode="r")
    source, _ = source_of(kpipe.data.from_numpy(x, y, block_size=8))
    for lo in range(0, N, 8):
        hi = min(N, lo + 8)
        got = source._read_np(np.array([0, lo, hi]), [0, 1])
        assert [g.tolist() for g in got] == [x[lo:hi].tolist(), y[lo:hi].tolist()]
        assert not any(np.shares_memory(g, a) for g in got for a in (x, y))
        assert all(g.flags.writeable and g.base is None for g in got)


def test_a_mapped_shuffled_pipeline_leaves_the_users_arrays_unchanged():
    x, y = _xy()
    x0, y0 = x.copy(), y.copy()
    ds = kpipe.data.from_numpy(x, y.astype(np.int32), block_size=3)
    y32 = source_of(ds)[0].reader.arrays[1]
    want = sorted(int(v) + 1 for v in y32)
    pipe = kpipe.data.pipeline(ds, batch_size=2, shuffle=49, seed=412383074, map_fn=lambda a, b: (a * 1.0, b + 1))
    for _ in range(6):
        assert sorted(int(v) for _, b in pipe.as_numpy_iterator() for v in b) == want
    assert np.array_equal(x, x0) and np.array_equal(y, y0) and np.array_equal(y32, y0.astype(np.int32))
