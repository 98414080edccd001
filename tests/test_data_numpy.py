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
