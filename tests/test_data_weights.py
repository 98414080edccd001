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
