"""kpipe.data.from_tfrecord: parsing, coverage, file- and record-level shards, bad input."""

import pytest
import tensorflow as tf

import kpipe.data

PER_FILE = 9
FEATURES = {"id": tf.io.FixedLenFeature([], tf.int64), "x": tf.io.FixedLenFeature([2], tf.float32)}


def _example(i):
    feature = {
        "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[i])),
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=[i, -i])),
        "tags": tf.train.Feature(int64_list=tf.train.Int64List(value=list(range(i % 3)))),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _write(tmp_path, num_files, compression=None):
    paths = []
    for f in range(num_files):
        path = str(tmp_path / f"data-{f}.tfrecord")
        with tf.io.TFRecordWriter(path, options=compression) as w:
            for i in range(PER_FILE):
                w.write(_example(f * PER_FILE + i))
        paths.append(path)
    return paths


def test_parses_every_record_exactly_once(tmp_path):
    paths = _write(tmp_path, 3)
    out = list(kpipe.data.from_tfrecord(paths, FEATURES).as_numpy_iterator())
    assert sorted(int(e["id"]) for e in out) == list(range(3 * PER_FILE))
    assert all(e["x"].tolist() == [e["id"], -e["id"]] for e in out)


def test_label_split_glob_and_compression(tmp_path):
    _write(tmp_path, 2, compression="GZIP")
    ds = kpipe.data.from_tfrecord(str(tmp_path / "*.tfrecord"), FEATURES, label="id", compression_type="GZIP")
    pairs = list(ds.as_numpy_iterator())
    assert sorted(int(y) for _, y in pairs) == list(range(2 * PER_FILE))
    assert set(pairs[0][0]) == {"x"}


def test_sparse_features_parse_per_record(tmp_path):
    paths = _write(tmp_path, 1)
    ds = kpipe.data.from_tfrecord(paths, {"id": FEATURES["id"], "tags": tf.io.VarLenFeature(tf.int64)})
    for e in ds.take(4):
        assert e["tags"].dense_shape.numpy().tolist() == [int(e["id"]) % 3]


@pytest.mark.parametrize("num_files,num_shards", [(4, 1), (4, 2), (4, 3), (4, 4), (2, 3)])
def test_shards_are_disjoint_and_complete(tmp_path, num_files, num_shards):
    paths = _write(tmp_path, num_files)
    seen = []
    for index in range(num_shards):
        with pytest.warns(UserWarning, match="every shard reads all records") if num_files < num_shards else _nothing():
            ds = kpipe.data.from_tfrecord(paths, FEATURES, num_shards=num_shards, index=index)
        seen.extend(int(e["id"]) for e in ds.as_numpy_iterator())
    assert sorted(seen) == list(range(num_files * PER_FILE))


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bad_input(tmp_path):
    paths = _write(tmp_path, 1)
    with pytest.raises(FileNotFoundError, match="missing.tfrecord"):
        kpipe.data.from_tfrecord([paths[0], str(tmp_path / "missing.tfrecord")], FEATURES)
    with pytest.raises(TypeError, match="`features` must be a non-empty dict"):
        kpipe.data.from_tfrecord(paths, ["id"])
    with pytest.raises(TypeError, match=r"`features\['id'\]` must be a tf.io feature configuration"):
        kpipe.data.from_tfrecord(paths, {"id": tf.int64})
    with pytest.raises(ValueError, match="`label` must be a key of `features`"):
        kpipe.data.from_tfrecord(paths, FEATURES, label="y")
    with pytest.raises(ValueError, match="`compression_type` must be None, 'GZIP' or 'ZLIB'"):
        kpipe.data.from_tfrecord(paths, FEATURES, compression_type="zip")


def test_sequence_features_keep_each_records_length(tmp_path):
    # issue 51: records were parsed 128 at a time, so a sequence was padded to its neighbours'
    path = str(tmp_path / "seq.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        for n in range(1, 5):
            feature = {
                "s": tf.train.Feature(int64_list=tf.train.Int64List(value=list(range(10, 10 + n)))),
                "id": tf.train.Feature(int64_list=tf.train.Int64List(value=[n])),
            }
            w.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    features = {
        "s": tf.io.FixedLenSequenceFeature([], tf.int64, allow_missing=True),
        "id": tf.io.FixedLenFeature([], tf.int64),
    }
    want = [
        tf.io.parse_single_example(r, features)["s"].numpy().tolist()
        for r in tf.data.TFRecordDataset(path).as_numpy_iterator()
    ]
    assert want == [[10], [10, 11], [10, 11, 12], [10, 11, 12, 13]]
    got = [e["s"].tolist() for e in kpipe.data.from_tfrecord(path, features).as_numpy_iterator()]
    assert got == want
    pairs = kpipe.data.from_tfrecord(path, features, label="id")
    assert [(f["s"].tolist(), int(i)) for f, i in pairs.as_numpy_iterator()] == list(zip(want, range(1, 5)))


def test_ragged_features_have_parse_single_examples_spec(tmp_path):
    # found by the differential suite: a vectorized parse split back gave ragged-rank-0
    # RaggedTensors where parse_single_example gives tensors
    path = str(tmp_path / "ragged.tfrecord")
    with tf.io.TFRecordWriter(path) as w:
        for n in range(3):
            f = {"r": tf.train.Feature(int64_list=tf.train.Int64List(value=list(range(n))))}
            w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
    features = {"r": tf.io.RaggedFeature(tf.int64)}
    ref = tf.data.TFRecordDataset(path).map(lambda r: tf.io.parse_single_example(r, features))
    ds = kpipe.data.from_tfrecord(path, features)
    assert ds.element_spec == ref.element_spec
    assert [e["r"].tolist() for e in ds.as_numpy_iterator()] == [[], [0], [0, 1]]
