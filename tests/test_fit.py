"""ProcessLoader and fit_generator inside Keras fit/evaluate/predict."""

import numpy as np
import pytest

import keras
import kpipe
from _keras_datasets import InfiniteClasses, RegressionPyDataset

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _classifier():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2, activation="softmax")])
    model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _regressor():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


class EpochCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs = 0

    def on_epoch_end(self, epoch, logs=None):
        self.epochs += 1


def _fit(make_model, data, val, **kw):
    model = make_model()
    cb = EpochCounter()
    history = model.fit(data, validation_data=val, epochs=3, verbose=0, callbacks=[cb], **kw)
    assert cb.epochs == 3
    return history.history, model


def test_fit_class_weight_validation_callback_equal_serial(no_leaks):
    serial_ds = RegressionPyDataset(classes=True)
    serial_hist, serial_model = _fit(
        _classifier, serial_ds, RegressionPyDataset(classes=True, n=2), class_weight={0: 3.0, 1: 1.0}, shuffle=False
    )
    ds = RegressionPyDataset(classes=True)
    with kpipe.ProcessLoader(ds, workers=2) as train, kpipe.ProcessLoader(RegressionPyDataset(classes=True, n=2), workers=1) as val:
        hist, model = _fit(_classifier, train, val, class_weight={0: 3.0, 1: 1.0}, shuffle=False)
        # Keras calls on_epoch_end after each epoch (and from 3.7 once before the first); a
        # ProcessLoader's dataset gets the same calls when every epoch is a whole pass.
        assert serial_ds.epochs_ended >= 3 and ds.epochs_ended == serial_ds.epochs_ended
        preds = model.predict(train, verbose=0)
        np.testing.assert_allclose(preds, serial_model.predict(RegressionPyDataset(classes=True), verbose=0), rtol=1e-6)
        ev = model.evaluate(val, verbose=0, return_dict=True)
    for key in ("loss", "val_loss", "accuracy", "val_accuracy"):
        np.testing.assert_allclose(hist[key], serial_hist[key], rtol=1e-6, err_msg=key)
    assert ev["loss"] == pytest.approx(serial_hist["val_loss"][-1], rel=1e-6)


def test_fit_sample_weights_equal_serial(no_leaks):
    serial_hist, _ = _fit(_regressor, RegressionPyDataset(weights=True), None, shuffle=False)
    with kpipe.ProcessLoader(RegressionPyDataset(weights=True), workers=2, use_threads=False) as train:
        hist, _ = _fit(_regressor, train, None, shuffle=False)
    np.testing.assert_allclose(hist["loss"], serial_hist["loss"], rtol=1e-6)


def test_fit_shuffled_loader_is_reproducible_and_ignores_keras_shuffle(no_leaks):
    losses = []
    for workers in (0, 2):
        with kpipe.ProcessLoader(RegressionPyDataset(), workers=workers, shuffle=True, seed=11) as train:
            hist, _ = _fit(_regressor, train, None, shuffle=True)
            losses.append(hist["loss"])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


def test_infinite_dataset_with_steps_per_epoch(no_leaks):
    with kpipe.ProcessLoader(InfiniteClasses(), workers=2) as train:
        hist, _ = _fit(_classifier, train, None, steps_per_epoch=5)
        assert len(hist["loss"]) == 3
        assert train.stats()["batches"] >= 15


def test_fit_generator_seed_call_runs_unchanged():
    model = _classifier()
    train_generator = RegressionPyDataset(classes=True)
    valid_generator = RegressionPyDataset(classes=True, n=2)
    w = 3.0
    callbacks = [EpochCounter()]
    history = kpipe.fit_generator(
        model,
        generator=train_generator,
        class_weight={0: w, 1: 1},
        epochs=2,
        verbose=0,
        steps_per_epoch=len(train_generator),
        callbacks=callbacks,
        validation_data=valid_generator,
        validation_steps=len(valid_generator),
        shuffle=True,
        workers=8,
        use_multiprocessing=True,
        max_queue_size=20,
    )
    assert isinstance(history, keras.callbacks.History)
    assert len(history.history["val_loss"]) == 2 and callbacks[0].epochs == 2
    assert np.isfinite(history.history["loss"]).all()


def test_fit_generator_threads_and_plain_generator():
    model = _regressor()
    hist = kpipe.fit_generator(model, RegressionPyDataset(), epochs=2, verbose=0, workers=2, use_multiprocessing=False)
    assert len(hist.history["loss"]) == 2

    def gen():
        ds = RegressionPyDataset()
        while True:
            for i in range(len(ds)):
                yield ds[i]

    with pytest.warns(UserWarning, match="Python generator"):
        hist = kpipe.fit_generator(model, gen(), steps_per_epoch=3, epochs=1, verbose=0, workers=4)
    with pytest.raises(TypeError, match="`model` must be a keras.Model"):
        kpipe.fit_generator(RegressionPyDataset(), RegressionPyDataset())


def test_pydataset_from_a_module_importing_keras_does_not_make_workers_import_tensorflow(no_leaks):
    from _keras_datasets import Probe

    with kpipe.ProcessLoader(Probe(), workers=2) as loader:
        flags = [loader[i][1] for i in range(4)]
        assert [int(loader[i][0][0, 0]) for i in range(4)] == [0, 1, 2, 3]
    assert not any(f.any() for f in flags), flags


# -- issue 51: fit_generator keeps Keras 2's steps: steps_per_epoch batches a epoch, across pass ends


class _Recorder(keras.Model):
    """Records the batch id (x[0, 0]) of every training step; runs eagerly."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.seen = []

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        self.seen.append(int(data[0][0, 0]))
        return super().train_step(data)


class _StepsPerEpoch(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1] += 1


def _recorder():
    keras.utils.set_random_seed(0)
    model = _Recorder()
    model.compile(keras.optimizers.SGD(0.01), "mse", run_eagerly=True)
    return model


@pytest.mark.parametrize("workers, use_multiprocessing", [(0, False), (2, True)])
def test_fit_generator_draws_steps_per_epoch_across_the_end_of_the_sequence(workers, use_multiprocessing, no_leaks):
    from _keras_datasets import BatchIds, ReplacingIds

    model, steps = _recorder(), _StepsPerEpoch()
    kpipe.fit_generator(model, BatchIds(n=7), steps_per_epoch=3, epochs=3, verbose=0, shuffle=False,
                        callbacks=[steps], workers=workers, use_multiprocessing=use_multiprocessing)
    assert steps.steps == [3, 3, 3]  # Keras 2; plain Keras 3 fit() trains 3, 3, 1
    assert model.seen == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    # the Sequence's on_epoch_end runs at each end of a pass (Keras 2's OrderedEnqueuer): the
    # next pass reads the order it made
    model, steps = _recorder(), _StepsPerEpoch()
    kpipe.fit_generator(model, ReplacingIds(n=4), steps_per_epoch=3, epochs=3, verbose=0, shuffle=False,
                        callbacks=[steps], workers=workers, use_multiprocessing=use_multiprocessing)
    order1 = np.random.default_rng(1).permutation(4).tolist()
    order2 = np.random.default_rng(2).permutation(4).tolist()
    assert steps.steps == [3, 3, 3]
    assert model.seen == [0, 1, 2, 3] + order1 + order2[:1]


def test_fit_generator_steps_longer_than_the_sequence_and_initial_epoch(no_leaks):
    from _keras_datasets import BatchIds

    model, steps = _recorder(), _StepsPerEpoch()
    kpipe.fit_generator(model, BatchIds(n=4), steps_per_epoch=6, epochs=2, verbose=0, shuffle=False,
                        callbacks=[steps], workers=0)
    assert steps.steps == [6, 6] and model.seen == [0, 1, 2, 3] * 3
    # a resumed run (initial_epoch) trains on what the uninterrupted run's later epochs had
    model = _recorder()
    kpipe.fit_generator(model, BatchIds(n=4), steps_per_epoch=3, epochs=3, initial_epoch=1, verbose=0,
                        shuffle=False, workers=0)
    assert model.seen == [3, 0, 1, 2, 3, 0]
    # shuffled: every pass is a permutation, passes follow one another whatever the epochs cut
    model = _recorder()
    kpipe.fit_generator(model, BatchIds(n=5), steps_per_epoch=2, epochs=5, verbose=0, shuffle=True, seed=3,
                        workers=2, use_multiprocessing=True)
    assert sorted(model.seen[:5]) == sorted(model.seen[5:]) == list(range(5))


def test_endless_view_serves_the_spec_reads_again_and_refuses_a_pass_already_left():
    from _keras_datasets import BatchIds

    from kpipe.fit import _Passes

    with kpipe.ProcessLoader(BatchIds(n=3), workers=0) as loader:
        view = _Passes(loader)
        assert view.num_batches is None
        ids = [int(view[i][0][0, 0]) for i in (0, 1, 0, 1, 2, 3, 4)]  # Keras: 2 spec reads, then from 0
        assert ids == [0, 1, 0, 1, 2, 0, 1]
        with pytest.raises(RuntimeError, match=r"asked for batch 2 of its endless view after batch 3 of a later pass"):
            view[2]
