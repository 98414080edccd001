"""The hand-over of ProcessLoader batches into Keras's step functions (kpipe/_feed.py):
tensors alias the shared-memory slots where TensorFlow can, stay intact while the loader
moves on, errors reach fit() with their traceback, and no feed thread outlives its use."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import kpipe
from kpipe import _compat
from kpipe import _feed

needs_feed = pytest.mark.skipif(
    not _compat.keras_at_least(_compat.KERAS_ITERABLE_TRAIN_FUNCTION),
    reason="Keras < 3.7 feeds ProcessLoaders through tf.data.Dataset.from_generator (kpipe/_compat.py)",
)


class Images(keras.utils.PyDataset):
    """Batch i: 8 images filled with i (uint8) and labels i (int64), computed in the worker."""

    def __init__(self, n=12, fail_at=None, **kw):
        super().__init__(**kw)
        self.n, self.fail_at = n, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"no image {i}")
        return np.full((8, 6, 6, 3), i, np.uint8), np.full((8,), i, np.int64)


def tiny_model():
    inputs = keras.Input((6, 6, 3), dtype="uint8")
    h = keras.layers.Flatten()(keras.layers.Lambda(lambda t: keras.ops.cast(t, "float32") / 255.0)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _address(tensor):
    return tensor._numpy().ctypes.data  # the tensor's own buffer (numpy() would copy)


def test_to_tensor_aliases_aligned_contiguous_numeric_arrays_and_copies_the_rest():
    raw = np.zeros(4096 + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    aligned = raw[start:start + 4096].view(np.float32)  # 1024 floats at a 64-byte boundary
    aligned[:] = np.arange(1024)
    t = _feed.to_tensor(aligned)
    assert _address(t) == aligned.ctypes.data  # aliased: no copy
    aligned[0] = -1.0
    assert float(t[0]) == -1.0  # the same memory

    cases = {
        "unaligned": raw[start + 4:start + 4 + 4000].view(np.float32),
        "strided": aligned[::2],
        "read-only": np.frombuffer(aligned.tobytes(), np.float32),
        "bool": np.ones(128, bool),
        "empty": np.zeros((0, 3), np.float32),
    }
    for name, array in cases.items():
        t = _feed.to_tensor(array)
        if array.size:
            assert _address(t) != array.ctypes.data, name  # copied
        np.testing.assert_array_equal(t.numpy(), array, err_msg=name)
        assert t.dtype == tf.as_dtype(array.dtype), name


@needs_feed
def test_fit_path_tensors_alias_the_slots_and_stay_intact_while_the_loader_moves_on(monkeypatch, no_leaks):
    made = []  # (array, tensor) for every leaf the fit path converted
    original = _feed.to_tensor

    def recording(array):
        tensor = original(array)
        made.append((array, tensor))
        return tensor

    monkeypatch.setattr(_feed, "to_tensor", recording)
    with kpipe.ProcessLoader(Images(), workers=1, max_queue_size=2) as loader:
        tiny_model().fit(loader, epochs=4, verbose=0)
        assert loader.stats()["batches"] >= 48
    first_x, first_y = made[0][1], made[1][1]
    assert len(made) >= 2 * 48
    for array, tensor in made:
        assert array.ctypes.data % 64 == 0  # slots and leaves are 64-byte aligned
        assert _address(tensor) == array.ctypes.data  # aliased, not copied
    # Every slot was reused many times over four passes of 12 batches with a queue of 2;
    # the first batch's tensors, still held, kept their slot's lease: intact.
    np.testing.assert_array_equal(first_x.numpy(), np.full((8, 6, 6, 3), first_y.numpy()[0], np.uint8))
    ids = [int(t.numpy().ravel()[0]) for a, t in made[1::2]]
    assert sorted(ids[:12]) == list(range(12))  # one whole pass first


@needs_feed
def test_a_worker_error_reaches_fit_with_its_traceback_and_no_thread_is_left(no_leaks):
    with kpipe.ProcessLoader(Images(fail_at=5), workers=2) as loader:
        with pytest.raises(KeyError) as info:  # the worker's exception type, raised in fit()
            tiny_model().fit(loader, epochs=1, verbose=0)
    message = str(info.value)
    assert "no image 5" in message and "while loading batch 5" in message
    assert "in __getitem__" in message  # the worker's own traceback


@needs_feed
def test_feed_threads_stop_when_a_stream_is_dropped_mid_pass_or_the_loader_closes(no_leaks):
    from conftest import feed_threads
    from keras.src.trainers import data_adapters

    loader = kpipe.ProcessLoader(Images(n=20), workers=1)
    adapter = data_adapters.get_data_adapter(loader)
    feed = adapter._kpipe_feed(tf.distribute.get_strategy())
    x, y = next(feed)
    assert int(y[0]) == 0 and len(feed_threads(wait_s=0)) == 1
    del feed  # Keras drops an iterator mid-pass (evaluate(steps=1), a fit that ended)
    assert not feed_threads()
    feed = adapter._kpipe_feed(tf.distribute.get_strategy())
    assert int(next(feed)[1][0]) == 0  # a dropped stream's pass starts again at its head
    loader.close()  # the feed still referenced: its thread ends with the loader
    assert not feed_threads()
    with pytest.raises(Exception):
        list(feed)
    del feed, adapter


@needs_feed
def test_feed_ends_each_stream_at_its_pass_and_keras_sees_every_batch_once(no_leaks):
    seen = []
    with kpipe.ProcessLoader(Images(n=7), workers=2, shuffle=True, seed=1) as loader:
        from keras.src.trainers import data_adapters

        adapter = data_adapters.get_data_adapter(loader)
        for _ in range(3):
            feed = adapter._kpipe_feed(tf.distribute.get_strategy())
            seen.append(sorted(int(y[0]) for _, y in feed))
            del feed
        assert loader.stats()["passes"] == 3
    assert seen == [list(range(7))] * 3



class Unbounded(keras.utils.PyDataset):
    """Batch i: 8 rows filled with i; `num_batches` None (infinite) or `n`."""

    def __init__(self, n=None):
        super().__init__()
        self.n = n

    @property
    def num_batches(self):
        return self.n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((8, 6, 6, 3), i % 200, np.uint8), np.full((8,), i, np.int64)


@needs_feed
@pytest.mark.parametrize("n", [None, 40])
def test_feed_counts_only_the_batches_keras_took_so_epochs_load_nothing_extra(no_leaks, n):
    # The feed's thread reads ahead; the epochs' read limits start where Keras's own count
    # (what the feed handed to Keras) is. Counted by what the thread read instead, each epoch's
    # limit fell behind the stream: 23 loads and 5 discards for 15 steps, 17 batches handed out.
    model = tiny_model()
    with kpipe.ProcessLoader(Unbounded(n), workers=2) as loader:
        model.fit(loader, epochs=3, steps_per_epoch=5, verbose=0)
        stats = loader.stats()
    assert (stats["batches"], stats["loads"], stats["discards"]) == (15, 15, 0)


def test_split_rows_gives_contiguous_near_equal_parts_larger_first():
    a = np.arange(5)
    assert [p.tolist() for p in _feed._split_rows(a, 2)] == [[0, 1, 2], [3, 4]]
    assert [p.tolist() for p in _feed._split_rows(np.arange(7), 3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [p.tolist() for p in _feed._split_rows(np.arange(1), 2)] == [[0], []]


def test_as_dataset_device_must_name_a_device_of_this_process(no_leaks):
    with kpipe.ProcessLoader(Images(n=2), workers=0) as loader:
        for bad in ("/gpu:7", "banana", 3):
            with pytest.raises(ValueError, match=r"`device` must name a device of this process\. Received: device="):
                loader.as_dataset(device=bad)
        x, y = next(iter(loader.as_dataset(device="/cpu:0")))
        assert x.device.endswith("device:CPU:0") and int(y[0]) == 0


@needs_feed
def test_calls_through_the_feed_build_no_tf_data_pipeline(no_leaks, monkeypatch):
    # Keras's TFEpochIterator builds `from_generator` + `experimental_distribute_dataset`
    # over the adapter at every fit/evaluate/predict (~30 ms before the first step); a
    # ProcessLoader is read through the feed, so kpipe builds it only if asked for.
    from keras.src.trainers import data_adapters

    built = []
    adapter = data_adapters.PyDatasetAdapter
    original = adapter.get_tf_dataset
    monkeypatch.setattr(adapter, "get_tf_dataset", lambda self: built.append(self) or original(self))
    model = tiny_model()
    with kpipe.ProcessLoader(Images(), workers=2) as loader:
        model.fit(loader, validation_data=loader, epochs=2, verbose=0)
        model.evaluate(loader, verbose=0)
        assert model.predict(loader, verbose=0).shape == (96, 1)
        assert built == []
        plain = Images()
        model.fit(plain, epochs=1, verbose=0)  # a plain PyDataset still goes through tf.data
        assert len(built) == 1
        with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
            strategic = tiny_model()
        strategic.fit(loader, epochs=1, verbose=0)  # (its symbolic build reads through the feed too)
        assert len(built) == 1
