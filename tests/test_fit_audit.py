"""`fit()`'s arguments with a `ProcessLoader` against plain Keras on the same `PyDataset`:
one test per row of the audit table (docs/loader-in-depth.md) that other test files do not cover (the table
names those). Each runs both and compares what the model trained on or what Keras said."""

import contextlib
import io
import re

import keras
import numpy as np
import pytest

import kpipe
from kpipe import _compat
from _shuffle_datasets import N, SEEN, Ids, recording_model

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
_RESTARTS = _compat.keras_at_least(_compat.KERAS_EPOCH_ITERATOR_RESET)  # (see tests/test_passes.py)


@contextlib.contextmanager
def _loader(**kwargs):
    with kpipe.ProcessLoader(Ids(), workers=2, **kwargs) as loader:
        yield loader


def _both(**fit_kwargs):
    """`(plain, kpipe)`: the batch ids each `fit(**fit_kwargs)` trained on (and validated
    on), and its history."""
    out = []
    for make in (contextlib.nullcontext, _loader):
        with make() as loader:
            model = recording_model()
            del SEEN[:]
            history = model.fit(loader if loader is not None else Ids(), verbose=0, **fit_kwargs)
            out.append((list(SEEN), history.history))
    return out


def test_steps_per_epoch_under_the_fit_shuffle_trains_whole_shuffled_passes(no_leaks):
    (plain, plain_h), (got, got_h) = _both(epochs=3, steps_per_epoch=5)
    # 5 steps, 3 (the pass runs out: Keras ends the epoch there), then 5 of the next pass;
    # Keras 3.5's PyDataset adapter restarts the pass too (checked on 3.5.0 and 3.15.1)
    assert len(got) == len(plain) == 13 and len(got_h["loss"]) == len(plain_h["loss"])
    for ids in (plain, got):  # both: whole passes, each a permutation (epochs end inside them)
        assert sorted(ids[:N]) == list(range(N)) and len(set(ids[N:])) == len(ids) - N
        assert ids[:N] != list(range(N))


def test_initial_epoch_trains_the_remaining_epochs_like_plain_keras(no_leaks):
    (plain, plain_h), (got, got_h) = _both(epochs=3, initial_epoch=1, shuffle=False)
    assert got == plain == list(range(N)) * 2
    np.testing.assert_allclose(got_h["loss"], plain_h["loss"], rtol=1e-6)


def test_validation_freq_validates_the_same_epochs_and_batches(no_leaks):
    outs = []
    for make in (lambda: Ids(4), lambda: kpipe.ProcessLoader(Ids(4), workers=1)):
        val = make()
        with val if isinstance(val, kpipe.ProcessLoader) else contextlib.nullcontext():
            with _loader() as train:
                model = recording_model()
                del SEEN[:]
                history = model.fit(train, validation_data=val, validation_freq=2, validation_steps=3, epochs=4,
                                    verbose=0, shuffle=False).history
                outs.append((list(SEEN), history["val_loss"]))
    (plain, plain_val), (got, got_val) = outs
    # 8 training ids, 8 more, then 3 validation ids: epochs 2 and 4 only. Keras >= 3.7 starts
    # each validation from the first batch; Keras 3.5 goes on from where the last one stopped
    # (ids 0, 1, 2, then 3 and "ran out of data"): kpipe's validation loader does as each does.
    assert got == plain
    assert got.count(0) == plain.count(0) == 4 + (2 if _RESTARTS else 1)
    np.testing.assert_allclose(got_val, plain_val, rtol=1e-6)


@pytest.mark.parametrize("kwargs", [dict(validation_split=0.25), dict(y=np.zeros(8)), dict(sample_weight=np.ones(8))],
                         ids=["validation_split", "y", "sample_weight"])
def test_arguments_keras_refuses_for_a_pydataset_are_refused_alike(kwargs, no_leaks):
    errors = []
    for make in (contextlib.nullcontext, _loader):
        with make() as loader, pytest.raises(ValueError) as error:
            recording_model().fit(loader if loader is not None else Ids(), verbose=0, **kwargs)
        errors.append(re.sub(r"<class '[^']*'>", "<class>", str(error.value)))
    assert errors[0] == errors[1]


class _Logs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch", batch, sorted(logs)))
        self.losses.append(float(logs["loss"]))

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch", epoch, sorted(logs)))
        self.losses.append(float(logs["loss"]))


def test_callbacks_see_the_same_batch_indices_and_logs(no_leaks):
    calls = []
    for make in (contextlib.nullcontext, _loader):
        with make() as loader:
            cb = _Logs()
            recording_model().fit(loader if loader is not None else Ids(), epochs=2, verbose=0, callbacks=[cb], shuffle=False,
                         validation_data=Ids(2))
            calls.append(cb)
    assert calls[0].calls == calls[1].calls and len(calls[0].calls) == 2 * (N + 1)
    assert calls[0].calls[-1][2] == ["loss", "val_loss"]
    np.testing.assert_allclose(calls[1].losses, calls[0].losses, rtol=1e-6)


@pytest.mark.parametrize("verbose", [1, 2])
def test_verbose_prints_the_same_progress(verbose, no_leaks):
    printed = []
    for make in (contextlib.nullcontext, _loader):
        with make() as loader:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                recording_model().fit(loader if loader is not None else Ids(), epochs=2, verbose=verbose, shuffle=False)
            # timings and the progress bar's redraws differ; the epochs, steps per epoch and
            # each epoch's last step do not
            text = out.getvalue()
            printed.append((re.findall(r"Epoch \d+/\d+", text), set(re.findall(r"(?<!\d)\d+/(\d+)(?!\d)", text)),
                            text.count(f"{N}/{N}") >= 2))
    assert printed[0] == printed[1] == (["Epoch 1/2", "Epoch 2/2"], {"2", str(N)}, True)
