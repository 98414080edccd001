"""kpipe.data.class_weights and the shard arguments shared by every source."""

import numpy as np
import pytest
import tensorflow as tf

import kpipe.data
from kpipe.data import ShardSpec
from kpipe.data._sharding import resolve_shard


def test_balanced_weights_formula():
    labels = np.array([0] * 6 + [1] * 3 + [3] * 1)
    weights = kpipe.data.class_weights(labels)
    assert weights == pytest.approx({0: 10 / (3 * 6), 1: 10 / (3 * 3), 3: 10 / (3 * 1)})
    per_sample = np.array([weights[int(c)] for c in labels])
    assert per_sample.mean() == pytest.approx(1.0)
    assert kpipe.data.class_weights(labels, mode="sqrt") == pytest.approx({c: np.sqrt(w) for c, w in weights.items()})


def test_one_hot_and_column_labels():
    one_hot = np.eye(3, dtype=np.float32)[[0, 0, 1, 2]]
    assert kpipe.data.class_weights(one_hot) == pytest.approx({0: 4 / 6, 1: 4 / 3, 2: 4 / 3})
    assert kpipe.data.class_weights(np.array([[1], [1], [0]])) == pytest.approx({0: 1.5, 1: 0.75})


def test_from_datasets_batched_unbatched_and_kpipe_sources(tmp_path):
    y = np.array([0, 0, 0, 1, 1, 2])
    want = kpipe.data.class_weights(y)
    x = np.zeros((6, 2), np.float32)
    plain = tf.data.Dataset.from_tensor_slices((x, y))
    assert kpipe.data.class_weights(plain) == pytest.approx(want)
    assert kpipe.data.class_weights(plain.batch(4)) == pytest.approx(want)
    assert kpipe.data.class_weights(plain.batch(2, drop_remainder=True)) == pytest.approx(want)
    one_hot = tf.data.Dataset.from_tensor_slices((x, np.eye(3, dtype=np.float32)[y]))
    assert kpipe.data.class_weights(one_hot) == pytest.approx(want)
    source = kpipe.data.from_numpy(x, y)
    assert kpipe.data.class_weights(source) == pytest.approx(want)


def test_kpipe_source_reads_only_labels():
    x = np.zeros((50, 8), np.float32)
    y = np.arange(50) % 5
    source = kpipe.data.from_numpy(x, y, block_size=10)
    from kpipe.data._source import source_of

    src, _ = source_of(source)
    read = src.reader.read
    leaves = []
    src.reader.read = lambda part, lo, hi, ids: leaves.extend(ids) or read(part, lo, hi, ids)
    assert kpipe.data.class_weights(source) == pytest.approx({c: 1.0 for c in range(5)})
    assert leaves == [1] * 5  # the label array only, in 5 blocks


def test_bad_labels():
    with pytest.raises(ValueError, match="`mode` must be one of"):
        kpipe.data.class_weights([0, 1], mode="inverse")
    with pytest.raises(ValueError, match="has no labels"):
        kpipe.data.class_weights([])
    with pytest.raises(ValueError, match="Labels must be >= 0"):
        kpipe.data.class_weights([0, -1])
    with pytest.raises(ValueError, match="integer class ids"):
        kpipe.data.class_weights([0.5, 1.0])
    with pytest.raises(ValueError, match="must be < num_classes=2"):
        kpipe.data.class_weights([0, 2], num_classes=2)
    with pytest.raises(ValueError, match="must yield \\(x, y\\)"):
        kpipe.data.class_weights(tf.data.Dataset.range(3))


def test_shard_spec_ranges_partition_and_validate():
    for n in (0, 1, 7, 100):
        for k in (1, 2, 3, 4):
            parts = [ShardSpec(k, i).range(n) for i in range(k)]
            assert parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            assert max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1
    with pytest.raises(ValueError, match="`num_shards` must be an integer >= 1. Received: num_shards=0"):
        ShardSpec(0, 0)
    with pytest.raises(ValueError, match="`index` must be an integer in \\[0, num_shards\\)"):
        ShardSpec(2, -1)


def test_resolve_shard_from_context_or_numbers():
    ctx = tf.distribute.InputContext(num_input_pipelines=4, input_pipeline_id=3)
    assert resolve_shard(ctx) == ShardSpec(4, 3)
    assert resolve_shard(None, 2, 1) == ShardSpec(2, 1)
    assert resolve_shard() == ShardSpec(1, 0)
    with pytest.raises(ValueError, match="either `input_context` or `num_shards`/`index`, not both"):
        resolve_shard(ctx, 2, 0)
    with pytest.raises(TypeError, match="`input_context` must be a `tf.distribute.InputContext`"):
        resolve_shard("worker-0")


# -- issue 51: labels read by the declared structure, not by the values of one batch ---------

_Y51 = np.array([0, 0, 0, 1, 2, 2, 5, 5, 5, 5])
_W51 = {0: 10 / 12, 1: 10 / 4, 2: 10 / 8, 5: 10 / 16}


def test_integer_one_hot_samples_are_one_hot():
    x = np.zeros((10, 3), np.float32)
    one_hot = np.eye(6, dtype="int64")[_Y51]
    assert kpipe.data.class_weights(one_hot) == pytest.approx(_W51)
    ds = tf.data.Dataset.from_tensor_slices((x, one_hot))
    assert kpipe.data.class_weights(ds) == pytest.approx(_W51)
    assert kpipe.data.class_weights(ds.batch(4)) == pytest.approx(_W51)
    assert kpipe.data.class_weights(ds.batch(5, drop_remainder=True)) == pytest.approx(_W51)


def test_static_batches_of_binary_labels_are_ids_whatever_their_values():
    y = np.array([1, 0, 0, 0, 1, 1, 1, 0], np.float32)  # the first batch looks like a one-hot row
    x = np.zeros((8, 2), np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4, drop_remainder=True)
    assert ds.element_spec[1].shape == (4,)
    assert kpipe.data.class_weights(ds) == pytest.approx({0: 1.0, 1: 1.0})


def test_batched_argument_states_the_structure():
    # x's sample shape equals the label's: the structure is ambiguous, so `batched` says it
    y = np.array([[1, 0], [1, 0], [0, 1]], np.float32)  # 3 one-hot samples of 2 classes
    x = np.zeros((3, 2), np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    assert kpipe.data.class_weights(ds, batched=False) == pytest.approx({0: 0.75, 1: 1.5})
    ids = tf.data.Dataset.from_tensor_slices((np.zeros((4, 1), np.float32), np.array([0, 1, 1, 1]))).batch(2)
    assert kpipe.data.class_weights(ids, batched=True) == pytest.approx({0: 2.0, 1: 2 / 3})
    with pytest.raises(ValueError, match=r"`batched` must be True, False or None\. Received: batched='yes'"):
        kpipe.data.class_weights(ds, batched="yes")


def test_skipped_files_are_not_counted(tmp_path):
    for c, n in (("a", 3), ("b", 2)):
        (tmp_path / c).mkdir()
        for i in range(n):
            (tmp_path / c / f"{i}.png").write_bytes(tf.io.encode_png(np.zeros((4, 4, 3), np.uint8)).numpy())
    (tmp_path / "b" / "broken.png").write_bytes(b"not a png")
    ds = kpipe.data.from_files(tmp_path, image_size=(4, 4), on_error="skip")
    assert kpipe.data.class_weights(ds) == pytest.approx({0: 5 / 6, 1: 5 / 4})  # what ds yields
    strict = kpipe.data.from_files(tmp_path, image_size=(4, 4))
    assert kpipe.data.class_weights(strict) == pytest.approx({0: 1.0, 1: 1.0})  # labels only: 3 + 3


def test_a_sharded_source_counts_the_whole_source(tmp_path):
    y = np.array([0, 0, 0, 1, 1, 2])
    want = kpipe.data.class_weights(y)
    x = np.zeros((6, 2), np.float32)
    for index in range(2):
        shard = kpipe.data.from_numpy(x, y, num_shards=2, index=index)
        assert kpipe.data.class_weights(shard) == pytest.approx(want)
    for c, n in (("a", 2), ("b", 1)):
        (tmp_path / c).mkdir()
        for i in range(n):
            (tmp_path / c / f"{i}.png").write_bytes(tf.io.encode_png(np.zeros((4, 4, 3), np.uint8)).numpy())
    skip_shard = kpipe.data.from_files(tmp_path, image_size=(4, 4), on_error="skip", num_shards=2, index=1)
    assert kpipe.data.class_weights(skip_shard) == pytest.approx({0: 0.75, 1: 1.5})
