"""A dataset's epoch hooks through a ProcessLoader, call for call as plain Keras calls them
on the same dataset (the rule in docs/loader-in-depth.md and its one deviation), what each call loads, and
`loader[i]` against a plain PyDataset read by hand (issue 28)."""

import os
import warnings

import keras
import numpy as np
import pytest

import kpipe
from _keras_datasets import GrowingIds, HookLog
from kpipe import _compat

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
_RESETS = _compat.keras_at_least(_compat.KERAS_EPOCH_ITERATOR_RESET)


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


def _loads(path):
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return len(f.read().split())


class _Steps(keras.callbacks.Callback):
    """Counts the batches Keras's call really took."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1

    on_test_batch_end = on_predict_batch_end = on_train_batch_end


def _run(call, data, **kwargs):
    """Runs `model.<call>(data)`; returns the number of steps Keras took."""
    model, steps = _model(), _Steps()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ran out of data" and "shuffle ignored" are Keras's to say
        getattr(model, call)(data, verbose=0, callbacks=[steps], **kwargs)
    return steps.count


CASES = [
    ("fit", dict(n=6), dict(epochs=3)),
    ("fit", dict(n=6), dict(epochs=3, steps_per_epoch=6)),
    ("fit", dict(n=6, infinite=True), dict(epochs=4, steps_per_epoch=5)),
    ("evaluate", dict(n=6), {}),
    ("evaluate", dict(n=6, infinite=True), dict(steps=4)),
    ("predict", dict(n=6), {}),
]


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "workers-2"])
@pytest.mark.parametrize("reshuffle", [False, True], ids=["logs", "reshuffles"])
@pytest.mark.parametrize("call, data, kwargs", CASES, ids=[f"{c}-{'inf' if d.get('infinite') else 'finite'}-{k}" for c, d, k in CASES])
def test_keras_calls_reach_the_dataset_as_for_plain_keras(call, data, kwargs, reshuffle, workers, tmp_path, no_leaks):
    plain = HookLog(reshuffle=reshuffle, **data)
    plain_steps = _run(call, plain, **kwargs)
    log = str(tmp_path / "loads")
    with kpipe.ProcessLoader(HookLog(log=log, reshuffle=reshuffle, **data), workers=workers) as loader:
        steps = _run(call, loader, **kwargs)
        calls = loader.dataset.calls
    assert calls == plain.calls  # e.g. E B E B E B E for fit(epochs=3) on Keras >= 3.7
    assert steps == plain_steps
    # Loads: one per step, nothing past the call's last step. Keras >= 3.7 reads a loader
    # through kpipe's feed, and the tf.data dataset Keras would build over it (whose
    # element specs cost 2 batch reads) is never built (kpipe/_keras_hook.py); Keras < 3.7
    # reads it through that dataset, pulled once per step (no tf.data prefetch on top), and
    # its 2 spec reads serve the first steps unless a hook changed the dataset in between
    # (always with workers=0, which shares the dataset): then they load again. And Keras
    # 3.5/3.6 begins epochs after a finite input with steps_per_epoch ran out, which take
    # no step: the loader has loaded its first window (4 batches here) when the next
    # on_epoch_end, a reshuffle, drops it.
    extra = 0 if _RESETS else 2 + (4 if "steps_per_epoch" in kwargs and not data.get("infinite") else 0)
    assert steps <= _loads(log) <= steps + extra


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "workers-2"])
def test_validation_hooks_and_loads_equal_plain_keras(workers, tmp_path, no_leaks):
    plain_train, plain_val = HookLog(6), HookLog(4, reshuffle=True)
    keras.utils.set_random_seed(0)
    want = _model().fit(plain_train, validation_data=plain_val, epochs=3, shuffle=False, verbose=0).history
    log, val_log = str(tmp_path / "train"), str(tmp_path / "val")
    with kpipe.ProcessLoader(HookLog(6, log=log), workers=workers) as train, \
            kpipe.ProcessLoader(HookLog(4, log=val_log, reshuffle=True), workers=workers) as val:
        keras.utils.set_random_seed(0)
        got = _model().fit(train, validation_data=val, epochs=3, shuffle=False, verbose=0).history
        assert train.dataset.calls == plain_train.calls
        assert val.dataset.calls == plain_val.calls  # E B E, three times from Keras 3.7
    for key in ("loss", "val_loss"):  # the same batches, in each run's order
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, err_msg=key)
    # nothing loads past the last step; a validation run reshuffles twice (Keras's reset
    # and its epoch end) and nothing loads between them. Keras >= 3.7 builds no tf.data
    # dataset over a loader, so no spec reads; Keras < 3.7's are served from the first
    # batches, unless a hook ran between (always with workers=0, whose dataset is shared)
    spec_reads = 0 if _RESETS else 2
    assert 3 * 6 <= _loads(log) <= 3 * 6 + (spec_reads if workers == 0 else 0)
    assert 3 * 4 <= _loads(val_log) <= 3 * 4 + spec_reads


@pytest.mark.skipif(not _RESETS, reason="Keras < 3.7 does not restart finite inputs with steps_per_epoch")
def test_steps_per_epoch_below_len_keeps_passes_whole_the_one_deviation(no_leaks):
    plain = HookLog(6)
    _run("fit", plain, epochs=4, steps_per_epoch=3)
    with kpipe.ProcessLoader(HookLog(6), workers=2) as loader:
        _run("fit", loader, epochs=4, steps_per_epoch=3)
        calls = loader.dataset.calls
    # plain Keras: B E at every 3-step epoch (mid-pass); kpipe passes on only those at
    # the two pass ends (and Keras >= 3.7's first on_epoch_end, at a pass start)
    assert plain.calls == ["E"] + ["B", "E"] * 4
    assert calls == ["E"] + ["B", "E"] * 2


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "workers-2"])
def test_a_manual_loop_gets_exactly_the_hooks_it_calls(workers, tmp_path, no_leaks):
    log = str(tmp_path / "loads")
    with kpipe.ProcessLoader(HookLog(6, log=log, reshuffle=True), workers=workers) as loader:
        plain = HookLog(6, reshuffle=True)
        for _ in range(3):
            got = [int(loader[i][0][0, 0]) for i in range(len(loader))]
            want = [int(plain[i][0][0, 0]) for i in range(len(plain))]
            assert got == want
            # between the last read and on_epoch_end the dataset is still this pass's
            assert loader.dataset.calls == plain.calls and np.array_equal(loader.dataset.order, plain.order)
            loader.on_epoch_end()
            plain.on_epoch_end()
        assert loader.dataset.calls == ["E", "E", "E"]
        loader.on_epoch_begin()
        assert loader.dataset.calls == ["E", "E", "E", "B"]
        stats = loader.stats()
    assert stats["passes"] == 3
    assert _loads(log) <= 3 * 6 + 2 * max(workers, 1)  # a reshuffle drops what it loaded ahead


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "workers-2"])
def test_random_access_after_a_length_change_returns_that_index(workers, no_leaks):
    with kpipe.ProcessLoader(GrowingIds(4), workers=workers) as loader:
        assert [int(loader[i][0][0, 0]) for i in range(4)] == [0, 1, 2, 3]
        loader.on_epoch_end()
        loader.on_epoch_end()  # 4 -> 6 -> 8 batches
        assert len(loader) == 8
        assert [int(loader[i][0][0, 0]) for i in (5, 6, 2, 7, 0)] == [5, 6, 2, 7, 0]


class _Shuffled(keras.utils.PyDataset):
    """A plain PyDataset with state: on_epoch_end reshuffles with its own generator and
    may change its length, on_epoch_begin counts."""

    def __init__(self, n, seed):
        super().__init__()
        self.rng = np.random.default_rng(seed)
        self.order = np.arange(n)
        self.begun = 0

    def __len__(self):
        return len(self.order)

    def __getitem__(self, i):
        if not 0 <= i < len(self.order):
            raise IndexError(i)
        return np.full((1, 2), self.order[i] * 100 + self.begun, "float32")

    def on_epoch_begin(self):
        self.begun += 1

    def on_epoch_end(self):
        n = int(self.rng.integers(1, 9))  # a new length, 1..8
        self.order = self.rng.permutation(n)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "workers-2"])
def test_random_reads_and_hooks_match_a_plain_pydataset_read_by_hand(workers, no_leaks):
    """Property-style: random sequences of reads (in order, backwards, random, repeated),
    `on_epoch_end`/`on_epoch_begin` calls and the length changes they make, applied to a
    plain PyDataset and to a ProcessLoader over an equal one: every read equal."""
    for trial in range(6 if os.environ.get("KPIPE_SMALL") else 20):
        actions = np.random.default_rng(1000 + trial)
        plain = _Shuffled(int(actions.integers(1, 9)), seed=trial)
        with kpipe.ProcessLoader(_Shuffled(len(plain), seed=trial), workers=workers, max_queue_size=3) as loader:
            for step in range(60):
                assert len(loader) == len(plain), (trial, step)
                kind = actions.random()
                if kind < 0.08:
                    loader.on_epoch_end()
                    plain.on_epoch_end()
                elif kind < 0.12:
                    loader.on_epoch_begin()
                    plain.on_epoch_begin()
                else:
                    if kind < 0.5:
                        indices = range(len(plain))  # a whole pass in order
                    elif kind < 0.7:
                        indices = range(len(plain) - 1, -1, -1)
                    else:
                        indices = actions.integers(0, len(plain), size=int(actions.integers(1, 6)))
                    for i in indices:
                        np.testing.assert_array_equal(loader[int(i)], plain[int(i)], err_msg=f"trial {trial} step {step} [{i}]")


@pytest.mark.parametrize("hooks", [False, True], ids=["stateless", "reshuffles"])
def test_as_dataset_with_epochs_loads_each_batch_once_per_iteration(hooks, tmp_path, no_leaks):
    import tensorflow as tf

    from _keras_datasets import BatchIds

    log = str(tmp_path / "loads")
    dataset = HookLog(6, log=log, reshuffle=True) if hooks else BatchIds(6, log=log)
    with kpipe.ProcessLoader(dataset, workers=2) as loader:
        ds = loader.as_dataset(epochs=2)
        steps = _run("fit", ds, epochs=2)
        assert steps == 12
        # the element spec reads 2 batches, served to the first iteration (not loaded twice);
        # nothing of a third pass was sent to the workers (what they load later is in `_queue`:
        # without `epochs`, a stateless dataset's next max_queue_size batches)
        assert _loads(log) == 12 and loader.stats()["loads"] == 12
        if hooks:
            assert loader.dataset.calls == ["B", "E", "B", "E"]  # each iteration is one pass
        third = [int(x[0, 0]) for x, _ in ds]  # iterated once more than planned: still whole
        assert sorted(third) == list(range(6)) and _loads(log) == 18
    with kpipe.ProcessLoader(HookLog(6), workers=0) as loader:
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match=r"`epochs` must be a positive int .* Received: epochs="):
                loader.as_dataset(epochs=bad)
        assert isinstance(loader.as_dataset(epochs=1), tf.data.Dataset)


@pytest.mark.parametrize("multiprocessing", [True, False], ids=["processes", "threads"])
def test_fit_generator_passes_the_hooks_and_loads_of_plain_keras(multiprocessing, tmp_path, no_leaks):
    plain_train, plain_val = HookLog(6, reshuffle=True), HookLog(4)
    keras.utils.set_random_seed(0)
    want = _model().fit(plain_train, validation_data=plain_val, epochs=3, shuffle=False, verbose=0).history
    log, val_log = str(tmp_path / "train"), str(tmp_path / "val")
    train, val = HookLog(6, log=log, reshuffle=True), HookLog(4, log=val_log)
    keras.utils.set_random_seed(0)
    got = kpipe.fit_generator(_model(), generator=train, validation_data=val, epochs=3, verbose=0, workers=2, shuffle=False,
                              use_multiprocessing=multiprocessing).history
    assert train.calls == plain_train.calls and val.calls == plain_val.calls
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    spec_reads = 0 if _RESETS else 2  # Keras < 3.7 reads 2 batches for its tensor spec (see above)
    assert 3 * 6 <= _loads(log) <= 3 * 6 + spec_reads and 3 * 4 <= _loads(val_log) <= 3 * 4 + spec_reads
