"""`ProcessLoader(shuffle=None)` follows `fit(shuffle=...)` as plain Keras shuffles a
`PyDataset` (issue 43): batch orders against plain Keras on the TensorFlow and JAX
backends, seeds in fresh processes, exact resume, shards, `from_samples`,
`fit_generator` (the other `fit()` arguments: tests/test_fit_audit.py)."""

import importlib.util
import os
import sys
import warnings

import keras
import numpy as np
import pytest

import kpipe
from kpipe.callbacks import BackupAndRestore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(ROOT, "tests", "programs")
sys.path.insert(0, PROGRAMS)
import _outputs  # noqa: E402 (tests/programs)
import shuffle_orders  # noqa: E402
from _shuffle_datasets import N, SEEN, Ids, Points, split_epochs, recording_model  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _fit(data, seed=0, n=N, **kwargs):
    """The batch ids `fit(data, **kwargs)` trained on, one list per epoch of `n`; and the model."""
    model = recording_model(seed)
    del SEEN[:]
    kwargs.setdefault("epochs", 3)
    model.fit(data, verbose=0, **kwargs)
    return split_epochs(list(SEEN), n), model


def _shuffled_like_plain_keras(record):
    """Plain Keras and kpipe: each epoch a permutation, epochs differ, not all in order;
    fit(shuffle=False) and evaluate in order."""
    in_order = list(range(N))
    for run in ("plain", "kpipe"):
        epochs = record[run]
        assert len(epochs) == 3 and all(sorted(e) == in_order for e in epochs), (run, epochs)
        assert len({tuple(e) for e in epochs}) == 3, (run, epochs)  # 3 distinct of 8! orders
        assert record[f"{run}_in_order"] == [in_order] * 3, run
        assert record[f"{run}_evaluate"] == [in_order], run


def test_fit_shuffles_batches_as_plain_keras_does_on_tensorflow(tmp_path, no_leaks):
    shuffle_orders.main(["--out", str(tmp_path)])
    record, _ = _outputs.read(tmp_path, 0)
    assert record["backend"] == "tensorflow"
    _shuffled_like_plain_keras(record)


def _program(out, *args, backend="tensorflow"):
    _outputs.run_program("shuffle_orders.py", out, *args, backend=backend)
    return _outputs.read(out, 0)


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_fit_shuffles_batches_as_plain_keras_does_on_jax(tmp_path):
    record, _ = _program(tmp_path, backend="jax")
    assert record["backend"] == "jax"
    _shuffled_like_plain_keras(record)


def test_set_random_seed_fixes_orders_and_weights_in_fresh_processes(tmp_path):
    # Two fresh processes, each an unseeded run first (c, d: in a fresh process, as a program
    # without set_random_seed runs), then set_random_seed(7) and a run on a new loader (a, b).
    # (Two processes instead of four: TensorFlow's start-up is most of each one's time.)
    runs = [_program(tmp_path / name, "--kpipe-only", "--then-seed", "7") for name in ("p", "q")]
    (p, wp), (q, wq) = runs
    a, b, c, d = p["kpipe_seeded"], q["kpipe_seeded"], p["kpipe"], q["kpipe"]
    seeded = [k for k in wp if k.startswith("seeded/")]
    assert len(seeded) == 2 and len(a) == 3 and all(sorted(e) == list(range(8)) for e in a)
    assert a == b and all(np.array_equal(wp[k], wq[k]) for k in seeded)
    assert c != d and c != a  # unseeded: each run its own orders


def test_a_loader_seed_wins_over_keras_seed(no_leaks):
    orders = []
    for keras_seed in (1, 2):
        with kpipe.ProcessLoader(Ids(), workers=1, seed=5) as loader:
            orders.append(_fit(loader, seed=keras_seed)[0])
    assert orders[0] == orders[1] and len({tuple(e) for e in orders[0]}) == 3
    with kpipe.ProcessLoader(Ids(), workers=1) as one, kpipe.ProcessLoader(Ids(), workers=1) as other:
        assert _fit(one, seed=3)[0] == _fit(other, seed=3)[0]  # no loader seed: Keras's seed decides


def test_explicit_shuffle_wins_and_a_contradicting_fit_warns_once(no_leaks):
    with kpipe.ProcessLoader(Ids(), workers=1, shuffle=False) as loader:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _fit(loader)[0] == [list(range(N))] * 3  # fit's default True: no warning
            assert not [w for w in caught if "ProcessLoader" in str(w.message)]
            _fit(loader, shuffle=True)
            _fit(loader, shuffle=True)
        messages = [str(w.message) for w in caught if "ProcessLoader" in str(w.message)]
        assert len(messages) == 1 and "fit(shuffle=True)" in messages[0] and "ProcessLoader(shuffle=False)" in messages[0]
    with kpipe.ProcessLoader(Ids(), workers=1, shuffle=True, seed=4) as loader:
        with pytest.warns(UserWarning, match=r"fit\(shuffle=False\).*ProcessLoader\(shuffle=True\)"):
            epochs, _ = _fit(loader, shuffle=False)
    assert len({tuple(e) for e in epochs}) == 3


def test_evaluate_predict_validation_manual_loops_and_as_dataset_read_in_order(no_leaks):
    in_order = list(range(N))
    with kpipe.ProcessLoader(Ids(), workers=2) as train, kpipe.ProcessLoader(Ids(), workers=1) as val:
        model = recording_model()
        del SEEN[:]
        model.fit(train, validation_data=val, epochs=2, verbose=0)
        ids = list(SEEN)  # epoch: 8 training batches, then 8 validation batches
        assert ids[N:2 * N] == in_order and ids[3 * N:] == in_order and ids[:N] != in_order
        del SEEN[:]
        model.predict(train, verbose=0)
        assert SEEN == in_order
        # after fit(), the loader's own setting again: None reads in order
        assert [int(train[i][0][0, 0]) for i in range(N)] == in_order
        assert [int(x[0, 0]) for x, _ in train.as_dataset()] == in_order


def test_a_loader_validating_its_own_fit_keeps_the_fit_shuffle(no_leaks):
    with kpipe.ProcessLoader(Ids(), workers=2) as loader:
        model = recording_model()
        del SEEN[:]
        model.fit(loader, validation_data=loader, epochs=3, verbose=0)
    passes = split_epochs(list(SEEN))  # train, validate, train, validate, ...
    assert all(sorted(p) == list(range(N)) for p in passes) and len(passes) == 6
    assert len({tuple(p) for p in passes[0::2]}) == 3  # the training passes: three permutations


def test_state_carries_the_fit_order_and_restores_into_an_unseeded_loader(no_leaks):
    with kpipe.ProcessLoader(Ids(), workers=1) as loader:
        epochs, _ = _fit(loader, epochs=2)
        state = kpipe._stream.source_of(loader).state_after((1, 0), 3)  # 3 batches into the second pass
    assert state["shuffle"] is True and (state["pass"], state["position"]) == (1, 3)
    with kpipe.ProcessLoader(Ids(), workers=2) as other:  # a random seed of its own: it takes the state's
        other.restore(state)
        assert [int(other[i][0][0, 0]) for i in range(3, N)] == epochs[1][3:]
        assert other.state()["seed"] == state["seed"]
    with kpipe.ProcessLoader(Ids(), workers=0, seed=9) as seeded, pytest.raises(ValueError, match="seed="):
        seeded.restore(state)
    with kpipe.ProcessLoader(Ids(), workers=0, shuffle=False) as ordered, pytest.raises(ValueError, match="shuffle="):
        ordered.restore(state)


class _Crash(keras.callbacks.Callback):
    def __init__(self, step):
        super().__init__()
        self.step, self.steps = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.step:
            raise RuntimeError("simulated crash")


def test_backup_resumes_mid_epoch_exactly_under_the_fit_shuffle(tmp_path, no_leaks):
    def run(backup_dir, crash=None, seed=0):
        with kpipe.ProcessLoader(Ids(), workers=2) as loader:
            model = recording_model(seed)
            callbacks = [BackupAndRestore(str(backup_dir), save_freq=3, loaders=loader)] + ([crash] if crash else [])
            del SEEN[:]
            model.fit(loader, epochs=3, verbose=0, callbacks=callbacks)
            return list(SEEN), model.get_weights()

    whole, weights = run(tmp_path / "whole")
    assert all(sorted(e) == list(range(N)) for e in split_epochs(whole)) and len({tuple(e) for e in split_epochs(whole)}) == 3
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path / "cut", _Crash(11))  # in the second epoch, after the backup at step 9
    resumed, resumed_weights = run(tmp_path / "cut", seed=123)  # another Keras seed: the backup decides
    assert resumed == whole[9:]
    for a, b in zip(resumed_weights, weights):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_sharded_loaders_split_each_fit_shuffled_pass(no_leaks):
    shards = []
    for index in (0, 1):
        with kpipe.ProcessLoader(Ids(), workers=1, num_shards=2, shard_index=index, seed=3) as loader:
            shards.append(_fit(loader, n=N // 2, epochs=3)[0])
    for a, b in zip(*shards):  # each pass: the shards are disjoint and cover every batch
        assert sorted(a + b) == list(range(N))
    assert len({tuple(a + b) for a, b in zip(*shards)}) == 3  # a new permutation each pass
    with kpipe.ProcessLoader(Ids(), workers=1, num_shards=2, shard_index=0) as loader:
        with pytest.warns(UserWarning, match=r"shard 0 of 2.*Received: seed=None"):
            epochs = _fit(loader, n=N // 2, epochs=2)[0]
    assert epochs == [[0, 2, 4, 6]] * 2


def test_from_samples_follows_fit_shuffle_with_its_sample_order(no_leaks):
    with kpipe.ProcessLoader.from_samples(Points(), 4, workers=2) as loader:
        epochs, _ = _fit(loader, n=3, epochs=2)  # 3 batches of 4 samples a pass
        reads = [[int(v) for v in loader[i][0][:, 0]] for i in range(3)]  # after fit(): in order
    assert reads == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    # the first sample of each batch, each pass: shuffled samples, not batch 0, 4, 8 in order
    assert all(len(set(e)) == 3 for e in epochs) and epochs != [[0, 4, 8]] * 2
    with kpipe.ProcessLoader.from_samples(Points(), 4, workers=1) as loader:
        assert _fit(loader, n=3, epochs=2, shuffle=False)[0] == [[0, 4, 8]] * 2


def test_workers_auto_shuffles_each_pass(no_leaks):
    with kpipe.ProcessLoader(Ids(), workers="auto") as loader:
        epochs, _ = _fit(loader)
    assert all(sorted(e) == list(range(N)) for e in epochs) and len({tuple(e) for e in epochs}) == 3


def test_fit_generator_shuffle_keeps_its_meaning_without_a_warning(no_leaks):
    orders = {}
    for shuffle in (True, False):
        model = recording_model()
        del SEEN[:]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kpipe.fit_generator(model, Ids(), epochs=2, verbose=0, shuffle=shuffle, seed=3, workers=1,
                                use_multiprocessing=True)
        assert not [w for w in caught if "ProcessLoader" in str(w.message)]
        orders[shuffle] = split_epochs(list(SEEN))
    assert orders[False] == [list(range(N))] * 2
    assert all(sorted(e) == list(range(N)) for e in orders[True]) and len({tuple(e) for e in orders[True]}) == 2
