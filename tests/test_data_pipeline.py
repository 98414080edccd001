"""kpipe.data.pipeline: order of steps, determinism, shards, cache, options, training."""

import os
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest
import tensorflow as tf

import kpipe.data
from kpipe import _compat
from kpipe.data._source import source_of

N = 96
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _numpy_source(**kw):
    x = np.arange(N, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    return kpipe.data.from_numpy(x, np.arange(N), block_size=8, **kw)


def _ids(ds):
    return [int(i) for _, y in ds.as_numpy_iterator() for i in np.atleast_1d(y)]


def test_batches_map_and_exactly_once_with_shuffle():
    ds = kpipe.data.pipeline(_numpy_source(), batch_size=10, shuffle=32, seed=3, map_fn=lambda x, y: (x * 2, y))
    batches = list(ds.as_numpy_iterator())
    assert [len(y) for _, y in batches] == [10] * 9 + [6]
    ids = [int(i) for _, y in batches for i in y]
    assert sorted(ids) == list(range(N)) and ids != list(range(N))
    for x, y in batches:
        assert np.array_equal(x[:, 0], 2 * y)


def test_drop_remainder_and_repeat():
    ds = kpipe.data.pipeline(_numpy_source(), batch_size=10, drop_remainder=True, repeat=2)
    assert ds.element_spec[0].shape == (10, 3)
    ids = _ids(ds)
    assert len(ids) == 190 and sorted(ids[:96]) == list(range(N))


def test_seed_makes_order_deterministic_and_epochs_differ():
    def epochs(seed):
        ds = kpipe.data.pipeline(_numpy_source(), batch_size=8, shuffle=16, seed=seed)
        return _ids(ds), _ids(ds)

    a1, a2 = epochs(7)
    b1, b2 = epochs(7)
    c1, _ = epochs(8)
    assert (a1, a2) == (b1, b2)
    assert a1 != a2 and a1 != c1
    assert sorted(a1) == sorted(a2) == list(range(N))


def test_shuffle_mixes_blocks_at_the_source_even_without_a_seed():
    ids = _ids(kpipe.data.pipeline(_numpy_source(), batch_size=8, shuffle=2))
    assert sorted(ids) == list(range(N))
    # 12 blocks of 8 rows are read in a shuffled order and interleaved sample by sample: the
    # first 12 samples read come from 12 different blocks, and with a 2-sample buffer the
    # first 11 delivered are among them (storage order would give blocks 0 and 1 only).
    assert len({i // 8 for i in ids[:11]}) == 11
    plain = _ids(kpipe.data.pipeline(_numpy_source(), batch_size=8))
    assert plain == list(range(N))


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_pipeline_shards_a_source_at_the_source(tmp_path, num_shards):
    path = str(tmp_path / "d.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.arange(N * 2, dtype=np.float32).reshape(N, 2), chunks=(8, 2), compression="gzip")
        f.create_dataset("y", data=np.arange(N))
    source_ds = kpipe.data.from_hdf5(path, x="x", y="y", block_size=8)
    source, _ = source_of(source_ds)
    read = source.reader.read
    rows_read = []
    source.reader.read = lambda part, lo, hi, ids: rows_read.append(hi - lo) or read(part, lo, hi, ids)
    seen = []
    for index in range(num_shards):
        rows_read.clear()
        ds = kpipe.data.pipeline(source_ds, batch_size=5, shuffle=20, seed=1, num_shards=num_shards, index=index)
        ids = _ids(ds)
        assert sum(rows_read) == len(ids) <= N // num_shards + 1  # reads only its own rows
        seen.extend(ids)
    assert sorted(seen) == list(range(N))


@pytest.mark.parametrize("num_shards", [2, 3])
def test_pipeline_shards_any_dataset(num_shards):
    seen = []
    for index in range(num_shards):
        ctx = tf.distribute.InputContext(num_input_pipelines=num_shards, input_pipeline_id=index)
        ds = tf.data.Dataset.range(N).map(lambda i: (i, i))
        seen.extend(_ids(kpipe.data.pipeline(ds, batch_size=7, shuffle=10, seed=0, input_context=ctx)))
    assert sorted(seen) == list(range(N))


def test_sharded_shuffle_needs_a_seed():
    with pytest.raises(ValueError, match="Shuffling a sharded dataset needs a `seed`.*shard 1 of 2"):
        kpipe.data.pipeline(_numpy_source(), batch_size=4, shuffle=10, num_shards=2, index=1)
    with pytest.raises(ValueError, match="already created as shard 0 of 2.*asked for shard 1 of 3"):
        kpipe.data.pipeline(_numpy_source(num_shards=2, index=0), batch_size=4, num_shards=3, index=1)


def test_cache_in_memory_serves_later_epochs_from_memory():
    x = np.zeros((N, 1), np.float32)
    cached = kpipe.data.pipeline(kpipe.data.from_numpy(x), batch_size=16, cache=True)
    plain = kpipe.data.pipeline(kpipe.data.from_numpy(x), batch_size=16)
    assert sum(float(b.sum()) for b in cached.as_numpy_iterator()) == 0
    x += 1  # the source changes; the cache does not
    assert sum(float(b.sum()) for b in cached.as_numpy_iterator()) == 0
    assert sum(float(b.sum()) for b in plain.as_numpy_iterator()) == N


def test_cache_to_file_per_shard(tmp_path):
    x = np.zeros((N, 1), np.float32)
    path = tmp_path / "cache" / "train"
    with pytest.raises(FileNotFoundError, match="folder of the cache file"):
        kpipe.data.pipeline(kpipe.data.from_numpy(x), batch_size=16, cache=str(path))
    path.parent.mkdir()
    ds = kpipe.data.pipeline(kpipe.data.from_numpy(x), batch_size=16, cache=str(path), shuffle=8, seed=0, num_shards=2, index=1)
    assert sum(float(b.sum()) for b in ds.as_numpy_iterator()) == 0
    written = os.listdir(path.parent)
    assert written and all(name.startswith("train.shard-1-of-2") for name in written)
    x += 1
    assert sum(float(b.sum()) for b in ds.as_numpy_iterator()) == 0
    again = kpipe.data.pipeline(kpipe.data.from_numpy(x), batch_size=16, cache=str(path), shuffle=8, seed=0, num_shards=2, index=1)
    assert sum(float(b.sum()) for b in again.as_numpy_iterator()) == 0  # a new pipeline reads the file


def test_sets_the_options_users_forget():
    ds = kpipe.data.pipeline(_numpy_source(), batch_size=8)
    options = ds.options()
    assert options.autotune.enabled is True
    assert options.threading.private_threadpool_size >= 16
    assert options.deterministic is True
    sharded = kpipe.data.pipeline(_numpy_source(), batch_size=8, num_shards=2, index=0, deterministic=False, threadpool_size=4)
    assert sharded.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.OFF
    assert sharded.options().threading.private_threadpool_size == 4
    assert sharded.options().deterministic is False


def test_trains_a_model_with_class_weight():
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 4)).astype(np.float32)
    y = (np.arange(120) % 4 == 0).astype(np.int64)  # imbalanced: 1 in 4 is class 1
    source = kpipe.data.from_numpy(x, y)
    weights = kpipe.data.class_weights(source)
    assert weights == pytest.approx({0: 120 / (2 * 90), 1: 120 / (2 * 30)})

    def train(class_weight):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        before = [w.copy() for w in model.get_weights()]
        ds = kpipe.data.pipeline(source, batch_size=32, shuffle=64, seed=0)
        history = model.fit(ds, epochs=2, class_weight=class_weight, verbose=0)
        changed = any(not np.allclose(a, b) for a, b in zip(before, model.get_weights()))
        return history.history["loss"], changed

    losses, changed = train(weights)
    assert changed and all(np.isfinite(losses))
    zero_losses, zero_changed = train({0: 0.0, 1: 0.0})  # class weights reach the loss
    assert not zero_changed and zero_losses == [0.0, 0.0]


def test_bad_arguments():
    ds = _numpy_source()
    with pytest.raises(ValueError, match="`batch_size` must be an integer >= 1. Received: batch_size=0"):
        kpipe.data.pipeline(ds, batch_size=0)
    with pytest.raises(ValueError, match="`shuffle` must be a buffer size"):
        kpipe.data.pipeline(ds, batch_size=2, shuffle=-1)
    with pytest.raises(ValueError, match="`cache` must be True"):
        kpipe.data.pipeline(ds, batch_size=2, cache=3)
    with pytest.raises(ValueError, match="`repeat` must be True, False or a count"):
        kpipe.data.pipeline(ds, batch_size=2, repeat=0)
    with pytest.raises(TypeError, match="`map_fn` must be callable"):
        kpipe.data.pipeline(ds, batch_size=2, map_fn="double")
    with pytest.raises(TypeError, match="`ds` must be a tf.data.Dataset"):
        kpipe.data.pipeline(np.zeros(3), batch_size=2)
    with pytest.warns(UserWarning, match="`workers` is ignored without `py_map_fn`"):
        kpipe.data.pipeline(ds, batch_size=2, workers=2)


_STRATEGY_PROGRAM = textwrap.dedent(
    """
    import numpy as np, tensorflow as tf
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras, kpipe.data
    x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
    y = np.arange(64) % 2
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    seen = []

    def dataset_fn(ctx):
        seen.append((ctx.num_input_pipelines, ctx.num_replicas_in_sync))
        source = kpipe.data.from_numpy(x, y, input_context=ctx)
        return kpipe.data.pipeline(source, batch_size=ctx.get_per_replica_batch_size(16),
                                   shuffle=32, seed=0, input_context=ctx, drop_remainder=True)

    dist = strategy.distribute_datasets_from_function(dataset_fn)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(dist, epochs=2, verbose=0)
    batch = next(iter(dist))
    print("RESULT", seen[0], len(strategy.experimental_local_results(batch[0])),
          strategy.experimental_local_results(batch[0])[0].shape[0], len(history.history["loss"]),
          bool(np.all(np.isfinite(history.history["loss"]))))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(
    not _compat.keras_at_least(_compat.KERAS_FITS_DISTRIBUTED_DATASETS_FROM_FUNCTION),
    reason="Keras < 3.9 fit() rejects a dataset from distribute_datasets_from_function (see kpipe/_compat.py)")
def test_works_inside_distribute_datasets_from_function():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", _STRATEGY_PROGRAM], env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result == ["RESULT (1, 2) 2 8 2 True"], proc.stdout[-2000:]


def _make_source(kind, tmp_path):
    """A small dataset of each source kind whose labels are the sample ids 0..23."""
    ids = np.arange(24)
    if kind == "numpy":
        return kpipe.data.from_numpy(ids.astype(np.float32)[:, None], ids, block_size=4)
    if kind == "hdf5":
        paths = []
        for f in range(2):
            paths.append(str(tmp_path / f"{f}.h5"))
            with h5py.File(paths[-1], "w") as h:
                h.create_dataset("x", data=ids[f * 12 : (f + 1) * 12, None].astype(np.float32), chunks=(4, 1), compression="gzip")
                h.create_dataset("y", data=ids[f * 12 : (f + 1) * 12])
        return kpipe.data.from_hdf5(paths, x="x", y="y", block_size=4)
    if kind == "tfrecord":
        paths = []
        for f in range(4):
            paths.append(str(tmp_path / f"{f}.tfrecord"))
            with tf.io.TFRecordWriter(paths[-1]) as w:
                for i in ids[f * 6 : (f + 1) * 6]:
                    feature = {"y": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(i)]))}
                    w.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
        return kpipe.data.from_tfrecord(paths, {"y": tf.io.FixedLenFeature([], tf.int64)}, label="y")
    for c in range(2):
        (tmp_path / "img" / str(c)).mkdir(parents=True)
    for i in ids:  # the id is stored in the pixel value; the class folder is i % 2
        png = tf.io.encode_png(np.full((4, 4, 1), i, np.uint8)).numpy()
        (tmp_path / "img" / str(i % 2) / f"{i}.png").write_bytes(png)
    ds = kpipe.data.from_files(tmp_path / "img", image_size=(2, 2), channels=1)
    return ds


@pytest.mark.parametrize("kind", ["numpy", "hdf5", "tfrecord", "files"])
def test_every_source_through_a_sharded_shuffled_pipeline_is_exactly_once(kind, tmp_path):
    source = _make_source(kind, tmp_path)
    epochs = []
    for epoch in range(2):
        seen = []
        for index in range(2):
            ds = kpipe.data.pipeline(source, batch_size=5, shuffle=8, seed=4, num_shards=2, index=index)
            for x, y in ds.as_numpy_iterator():
                seen.extend(np.round(x.reshape(len(x), -1)[:, 0]).astype(int).tolist() if kind == "files" else y.tolist())
        epochs.append(seen)
        assert sorted(seen) == list(range(24))
    assert epochs[0] == epochs[1]  # same seed, new pipeline objects: same order
