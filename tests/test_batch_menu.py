"""What plain Keras takes from a PyDataset, the drop-in takes (issue 54): each batch kind
through plain Keras `fit()`/`predict()` and through `ProcessLoader(ds, workers=2)`, final
weights and predictions compared bit for bit; kinds kpipe cannot carry get a named error."""

import numpy as np
import pytest

import kpipe

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(300)]

KEYS = ["alpha", "beta", "gamma"]


def _dataset(kind):
    import keras

    class Menu(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            rng = np.random.default_rng(i)
            x = rng.normal(size=(8, 3)).astype("float32")
            y = (x.sum(axis=1, keepdims=True) > 0).astype("float32")
            if kind == "dict-key-order":
                keys = KEYS if i % 2 == 0 else KEYS[::-1]
                return {k: x[:, KEYS.index(k) : KEYS.index(k) + 1] for k in keys}, y
            if kind == "dict-from-a-set":
                return {k: x[:, KEYS.index(k) : KEYS.index(k) + 1] for k in set(KEYS)}, y
            if kind == "dtype-per-batch":
                return x.astype("float64" if i % 2 else "float32"), y
            if kind == "big-endian":
                return x.astype(">f4"), y.astype(">f4")
            if kind == "bfloat16":
                import ml_dtypes

                return x.astype(ml_dtypes.bfloat16), y
            raise AssertionError(kind)

    return Menu()


def _model(kind):
    import keras

    keras.utils.set_random_seed(0)
    if kind.startswith("dict"):
        inputs = {k: keras.Input((1,), name=k) for k in KEYS}
        joined = keras.layers.Concatenate()([inputs[k] for k in KEYS])
        model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(joined))
    else:
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, activation="sigmoid")])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy")
    return model


def _train(kind, data):
    model = _model(kind)
    model.fit(data, epochs=2, shuffle=False, verbose=0)
    return model.get_weights(), model.predict(data, verbose=0)


@pytest.mark.parametrize("kind,start_method", [("dict-key-order", None), ("dict-from-a-set", "spawn"),
                                               ("dtype-per-batch", None), ("big-endian", None),
                                               ("bfloat16", None), ("bfloat16", "spawn")])
def test_the_loader_trains_every_batch_kind_plain_keras_trains(kind, start_method, no_leaks):
    want_w, want_p = _train(kind, _dataset(kind))
    with kpipe.ProcessLoader(_dataset(kind), workers=2, start_method=start_method) as loader:
        got_w, got_p = _train(kind, loader)
    assert all(np.array_equal(a, b) for a, b in zip(got_w, want_w)), kind
    assert np.array_equal(got_p, want_p), kind


def test_a_dtype_that_cannot_be_cast_within_its_kind_is_named(no_leaks):
    class Narrows:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.arange(6).reshape(2, 3).astype("int64" if i == 0 else "int32")

    class IntThenFloat:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.zeros((2, 3), "int64" if i == 0 else "float32")

    with kpipe.ProcessLoader(IntThenFloat(), workers=1) as loader:
        assert loader[0].dtype == np.int64
        with pytest.raises(kpipe.BatchStructureError, match=r"batch\[?.*dtype float32 but batch 0 had int64.*within a kind"):
            loader[1]
    with kpipe.ProcessLoader(Narrows(), workers=1) as loader:  # int32 after int64: cast, as Keras would
        assert loader[0].dtype == np.int64 and loader[1].dtype == np.int64
        assert loader[1].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_sparse_and_ragged_leaves_get_a_named_error(no_leaks):
    import tensorflow as tf

    class Sparse:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            import tensorflow as tf

            x = tf.sparse.SparseTensor(indices=[[0, 0]], values=[1.0], dense_shape=[2, 3])
            return x, np.zeros(2)

    with kpipe.ProcessLoader(Sparse(), workers=0) as loader:
        with pytest.raises(kpipe.BatchStructureError, match=r"batch\[0\] is a tf.SparseTensor.*to_dense"):
            loader[0]
    ragged = tf.ragged.constant([[1.0], [2.0, 3.0]])
    from kpipe._engine import _tree

    with pytest.raises(kpipe.BatchStructureError, match=r"batch\[1\] is a tf.RaggedTensor.*to_tensor"):
        _tree.flatten((np.zeros(2), ragged))


def test_pickling_errors_name_the_attribute_path():
    import threading

    class Holds:
        def __init__(self):
            self.ok = 1
            self.cache = {"fine": [1, 2], "stream": [0, (x for x in range(3))]}

        def __len__(self):
            return 1

        def __getitem__(self, i):
            return np.zeros(1)

    with pytest.raises(kpipe.DatasetPicklingError, match=r"`self.cache\['stream'\]\[1\]` holds a generator"):
        kpipe.ProcessLoader(Holds(), workers=1)
    locked = Holds()
    locked.cache = {}
    locked.guard = threading.Lock()
    with pytest.raises(kpipe.DatasetPicklingError, match=r"`self.guard` holds a _thread.lock"):
        kpipe.ProcessLoader(locked, workers=1)
