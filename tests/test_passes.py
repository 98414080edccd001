"""Every sample once per pass: what fit()/evaluate()/predict() consume from a ProcessLoader,
compared with plain Keras on the same dataset, and what the workers load to get there."""

import gc
import json
import os
import signal
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import kpipe
from _keras_datasets import BatchIds, GrowingIds, ReplacingIds
from conftest import kpipe_children

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs"))
import _outputs  # noqa: E402 (tests/programs)
from kpipe import _compat
from kpipe._engine._planner import EpochPlanner

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
# Keras < 3.7 never restarts a finite input when steps_per_epoch < its length: plain Keras
# and kpipe alike stop after one pass there (kpipe/_compat.py).
_RESTARTS = _compat.keras_at_least(_compat.KERAS_EPOCH_ITERATOR_RESET)
needs_restarts = pytest.mark.skipif(not _RESTARTS, reason="Keras < 3.7 does not restart finite inputs with steps_per_epoch")

SEEN = []


def _record(ids):
    SEEN.extend(int(v) for v in ids.numpy())
    return np.int32(0)


class Recorder(keras.Model):
    """Records the id of every batch its compiled train/test step consumes."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        tf.py_function(_record, [data[0][0, 0:1]], tf.int32)
        return super().train_step(data)

    def test_step(self, data):
        tf.py_function(_record, [data[0][0, 0:1]], tf.int32)
        return super().test_step(data)


def new_model(strategy=None):
    with strategy.scope() if strategy is not None else _nullcontext():
        model = Recorder()
        model.compile(keras.optimizers.SGD(0.01), "mse")
    return model


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def consumed(call, *args, **kwargs):
    """Ids consumed by `call(*args, **kwargs)` and the warnings it raised."""
    SEEN.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call(*args, verbose=0, **kwargs)
    return list(SEEN), [str(w.message) for w in caught]


def planned(n, count, shuffle, seed, start_pass=0):
    """The first `count` ids of the loader's pass sequence."""
    planner = EpochPlanner(n, shuffle=shuffle, seed=seed)
    out, p = [], start_pass
    while len(out) < count:
        out += planner.plan(p)
        p += 1
    return out[:count]


def loads(path):
    try:
        with open(path) as f:
            return len(f.read().split())
    except FileNotFoundError:
        return 0


_PLAIN_KERAS = {}  # steps_per_epoch -> ids plain Keras consumed (the same for every case)


@pytest.mark.parametrize("workers", [0, 1, 2], ids=["inline", "workers-1", "workers-2"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("steps", [None, 4, 5, 12, 13], ids=lambda s: f"steps_per_epoch={s}")
def test_fit_consumes_whole_passes_with_the_steps_keras_takes(steps, shuffle, workers, tmp_path, no_leaks):
    n, epochs = 12, 5
    if steps not in _PLAIN_KERAS:
        _PLAIN_KERAS[steps] = consumed(new_model().fit, BatchIds(n), epochs=epochs, steps_per_epoch=steps, shuffle=False)[0]
    keras_ids = _PLAIN_KERAS[steps]
    log = tmp_path / "loads"
    with kpipe.ProcessLoader(BatchIds(n, log=str(log)), workers=workers, shuffle=shuffle, seed=0) as loader:
        ids, _ = consumed(new_model().fit, loader, epochs=epochs, steps_per_epoch=steps)
        stats = loader.stats()
    assert len(ids) == len(keras_ids)  # the same number of steps as plain Keras
    assert ids == planned(n, len(ids), shuffle, seed=0)  # passes in plan order, none cut
    if not shuffle:
        assert ids == keras_ids
    # Read-ahead stops where the last epoch does: one load per step. Keras >= 3.7 builds no
    # tf.data dataset over a loader (no spec reads); Keras < 3.7 reads it through one that
    # pulls a batch per step (no tf.data prefetch on top of the loader's) and whose spec
    # reads are served from the batches loaded for the first steps.
    assert stats["passes"] == len(ids) // n  # a pass cut by the last epoch does not end
    assert loads(log) == len(ids)


@pytest.mark.parametrize("workers", [0, 2], ids=["inline", "workers-2"])
def test_the_last_epoch_loads_nothing_more_when_the_reader_ran_ahead_to_its_pass_end(workers, tmp_path, no_leaks):
    # 12 batches, 5 steps per epoch: when Keras ends epoch 2 at step 10, its reader (kpipe's
    # feed) has read ahead to the pass's last batch; the last epoch still starts at batch
    # 10, and its 2 steps load nothing of the next pass (they loaded 3 more when the read
    # limit was taken from where the reader stood)
    log = tmp_path / "loads"
    with kpipe.ProcessLoader(BatchIds(12, log=str(log)), workers=workers, shuffle=True, seed=0) as loader:
        ids, _ = consumed(new_model().fit, loader, epochs=3, steps_per_epoch=5)
    assert ids == planned(12, 12, True, seed=0)
    assert loads(log) == 12


def test_fit_with_threads_and_a_stateful_dataset_keeps_whole_passes(tmp_path, no_leaks):
    n = 12
    with kpipe.ProcessLoader(ReplacingIds(n, log=str(tmp_path / "loads")), workers=2, use_threads=True) as loader:
        ids, _ = consumed(new_model().fit, loader, epochs=6, steps_per_epoch=5)
        ends = loader.dataset.ends
    # each pass uses one `order`, replaced by the dataset's on_epoch_end at the pass's end
    assert len(ids) == 5 + 5 + 2 + 5 + 5 + 2
    passes = [ids[i : i + n] for i in range(0, len(ids), n)]
    assert all(sorted(p) == list(range(n)) for p in passes)
    # after each pass, not after each of the 6 Keras epochs; Keras >= 3.7 also calls it once
    # before the first epoch, at a pass start, as it does for the plain dataset
    assert ends == 2 + (1 if _RESTARTS else 0)
    # plain Keras calls on_epoch_end after every Keras epoch, mid-pass: batches repeat
    plain = ReplacingIds(n)
    keras_ids, _ = consumed(new_model().fit, plain, epochs=6, steps_per_epoch=5, shuffle=False)
    assert plain.ends >= 6 and sorted(keras_ids[:n]) != list(range(n))  # (+1 before epoch 0 from Keras 3.7)


@pytest.mark.parametrize("n", [1, 2, 5])
@pytest.mark.parametrize("steps", [None, pytest.param(1, marks=needs_restarts)], ids=lambda s: f"steps_per_epoch={s}")
def test_reads_for_the_tensor_spec_and_the_strategy_build_consume_nothing(n, steps, tmp_path, no_leaks):
    # Under a strategy Keras pulls batches from a throwaway iterator to build the model,
    # after reading two for the tensor spec; with 1-2 batches per pass that is all of it.
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    log = tmp_path / "loads"
    epochs = 4
    with kpipe.ProcessLoader(BatchIds(n, log=str(log)), workers=2, shuffle=True, seed=5) as loader:
        ids, _ = consumed(new_model(strategy).fit, loader, epochs=epochs, steps_per_epoch=steps)
    total = epochs * (steps or n)
    assert ids == planned(n, total, True, seed=5)
    # the spec reads and the build were served from the batches loaded for training; but a
    # loader loads its first window (2 per worker) from when it is built, before a fit()
    # says how few steps it takes, besides the batch the build kept: 5 here
    first = 2 * 2 + 1
    assert loads(log) == total if total >= first else total <= loads(log) <= first


@pytest.mark.parametrize("val_steps", [None, 2, 3])
def test_validation_and_evaluate_consume_what_plain_keras_does(val_steps, tmp_path, no_leaks):
    n = 5
    plain = new_model()
    SEEN.clear()
    history = plain.fit(BatchIds(8), validation_data=BatchIds(n), validation_steps=val_steps, epochs=3, verbose=0, shuffle=False)
    keras_ids = list(SEEN)
    log = tmp_path / "loads"
    with kpipe.ProcessLoader(BatchIds(8), workers=2) as train, kpipe.ProcessLoader(BatchIds(n, log=str(log)), workers=2) as val:
        SEEN.clear()
        new_model().fit(train, validation_data=val, validation_steps=val_steps, epochs=3, verbose=0, shuffle=False)
        ids = list(SEEN)
        assert ids == keras_ids
        # Each validation run loads what it takes, nothing past `validation_steps` (from
        # Keras 3.7 the next run starts again at 0); Keras's spec reads are served from those
        # batches -- on Keras < 3.7, which runs validation on from where the last run
        # stopped, unless the run that reads them starts elsewhere: then they load again.
        # (ids: 3 epochs of 8 training batches, then what validation took.)
        # On Keras < 3.7 how many of those reloads happen depends on how far the workers
        # had loaded ahead when the run began (timing): at most one window, 2 per worker.
        val_taken = len(ids) - 3 * 8
        assert val_taken <= loads(log) <= val_taken + (0 if _RESTARTS else 2 * 2)
        before = loads(log)
        eval_ids, _ = consumed(new_model().evaluate, val, steps=val_steps)
        keras_eval, _ = consumed(new_model().evaluate, BatchIds(n), steps=val_steps)
        assert eval_ids == keras_eval
        assert loads(log) - before == (val_steps or n)
    assert len(history.history["val_loss"]) == 3


def test_infinite_loader_continues_across_epochs_like_keras(no_leaks):
    from _keras_datasets import InfiniteClasses  # noqa: F401  (module import for workers)

    class Counting(BatchIds):
        @property
        def num_batches(self):
            return None

    keras_ids, _ = consumed(new_model().fit, Counting(), epochs=3, steps_per_epoch=5, shuffle=False)
    with kpipe.ProcessLoader(Counting(), workers=2) as loader:
        ids, _ = consumed(new_model().fit, loader, epochs=3, steps_per_epoch=5)
    assert ids == keras_ids == list(range(15))


def test_as_dataset_declares_cardinality_and_feeds_whole_passes(no_leaks):
    n = 6
    with kpipe.ProcessLoader(BatchIds(n), workers=2, shuffle=True, seed=1) as loader:
        ds = loader.as_dataset()
        assert int(ds.cardinality()) == n
        assert ds.element_spec[0].shape.as_list() == [None, 3]
        ids, caught = consumed(new_model().fit, ds, epochs=3)
        assert ids == planned(n, 3 * n, True, seed=1)
        assert not [w for w in caught if "ran out of data" in w]
    with kpipe.ProcessLoader(ReplacingIds(n), workers=0) as loader:
        assert int(loader.as_dataset().cardinality()) == tf.data.UNKNOWN_CARDINALITY
    from _datasets import Structured  # image sizes vary between batches

    with kpipe.ProcessLoader(Structured(), workers=0) as loader:
        spec = loader.as_dataset().element_spec
        assert spec[0]["image"].shape.as_list() == [None, None, None, 1]
        assert spec[1].shape.as_list() == [None]


@pytest.mark.parametrize("kw", [dict(workers=0), dict(workers=2)], ids=["inline", "workers-2"])
def test_a_length_changed_in_on_epoch_end_is_followed_at_the_next_pass(kw, no_leaks):
    with kpipe.ProcessLoader(GrowingIds(4), **kw) as loader:
        lengths = []
        for _ in range(3):
            lengths.append(len(loader))
            ids = [int(loader[i][0][0, 0]) for i in range(len(loader))]
            assert ids == list(range(lengths[-1]))
            loader.on_epoch_end()  # a manual loop calls the hook itself, as for a plain PyDataset
        assert lengths == [4, 6, 8] and loader.dataset.ends == 3
        ds = loader.as_dataset()
        assert [len(list(ds)) for _ in range(2)] == [10, 12]


def test_manual_loops_and_on_epoch_end(no_leaks):
    with kpipe.ProcessLoader(BatchIds(6), workers=2, shuffle=True, seed=2) as loader:
        first = [int(loader[i][0][0, 0]) for i in range(6)]
        loader.on_epoch_end()  # after a whole pass: nothing more to end
        second = [int(loader[i][0][0, 0]) for i in range(3)]
        loader.on_epoch_end()  # ends pass 1 early, as a loop cut short expects
        third = [int(loader[i][0][0, 0]) for i in range(6)]
        assert first + second + third == planned(6, 6, True, 2) + planned(6, 3, True, 2, 1) + planned(6, 6, True, 2, 2)
        assert loader.stats()["passes"] == 3


@pytest.mark.parametrize("after", [0, 4, 9])
def test_state_restores_exactly_with_another_worker_count(after, no_leaks):
    n = 6
    with kpipe.ProcessLoader(BatchIds(n), workers=2, shuffle=True, seed=3) as a:
        for i in range(after):  # a manual loop over passes: index 0 again after each
            a[i % n]
        state = a.state()
        assert [int(a[i][0][0, 0]) for i in range(2)] == planned(n, after + 2, True, 3)[after // n * n :][:2]
    import json

    rest = planned(n, after + n, True, 3)[after:]  # what an uninterrupted reader gets next

    state = json.loads(json.dumps(state))
    assert state["pass"] == after // n and state["position"] == after % n
    with kpipe.ProcessLoader(BatchIds(n), workers=1, shuffle=True, seed=3) as b:
        b.restore(state)
        # loader[i] is batch i of the restored pass: a reader goes on from the position, and
        # reading the pass's last index in order starts the next pass
        at = state["position"]
        assert [int(b[i][0][0, 0]) for i in [*range(at, n), *range(at)]] == rest
    with kpipe.ProcessLoader(BatchIds(n), workers=0, shuffle=True, seed=3) as c:
        c.restore(state)
        got = [int(x[0, 0]) for x, _ in c.as_dataset()]
        assert got == rest[: n - after % n]


def test_restore_refuses_a_state_of_other_data(no_leaks):
    with kpipe.ProcessLoader(BatchIds(6), workers=0, shuffle=True, seed=3) as loader:
        state = loader.state()
        for change, match in [
            (dict(num_batches=7), "dataset of 7 batches"),
            (dict(seed=4), "seed=4"),
            (dict(num_shards=2), "num_shards=2"),
            (dict(format=99), "newer kpipe"),
            (dict(format=0), "format 0"),
            (dict(position=6), "out of range"),
        ]:
            with pytest.raises(ValueError, match=match):
                loader.restore(dict(state, **change))
        with pytest.raises(ValueError, match="lacks the entry 'pass'"):
            loader.restore({k: v for k, v in state.items() if k != "pass"})
        with pytest.raises(ValueError, match="must be a dict"):
            loader.restore("pass 0")


@pytest.mark.slow
def test_loaders_dropped_after_fit_and_evaluate_leave_no_process(tmp_path):
    before = {p.pid for p in kpipe_children()}
    model = new_model()
    # The first round traces Keras's train/test/predict functions (the traces keep the
    # adapters they saw); the next rounds run those traces on new loaders. (Dropped loaders
    # at scale: tests/test_soak.py's 200 fits.)
    for _ in range(3):
        model.fit(kpipe.ProcessLoader(BatchIds(4), workers=2), epochs=1, verbose=0,
                  validation_data=kpipe.ProcessLoader(BatchIds(2), workers=1))
        model.evaluate(kpipe.ProcessLoader(BatchIds(3), workers=2), verbose=0)
        model.predict(kpipe.ProcessLoader(BatchIds(3), workers=1), verbose=0)
    gc.collect()
    left = [p for p in kpipe_children() if p.pid not in before]
    assert not left, f"{len(left)} processes outlived their loaders"


# ------------------------------------------------------------ 2 workers on loopback
_PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs", "passes_train.py")
_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                    os.environ.get("PYTHONPATH")])),
        "TF_CPP_MIN_LOG_LEVEL": "2"}


def _launch(out, *args, expect=0):
    import io

    from kpipe.distribute import launch

    command = [sys.executable, _PROGRAM, "--out", str(out), *args]
    # A job whose worker dies: the other one, blocked in a collective, does not act on the
    # launcher's SIGTERM and is SIGKILLed after grace_s (10 s of waiting by default).
    grace = {} if expect == 0 else {"grace_s": 2.0}
    result = launch(command, workers=2, env=_ENV, output=io.StringIO(), timeout_s=180, **grace)
    if result.returncode != expect and "address already in use" in "".join(result.tails).lower():
        result = launch(command, workers=2, env=_ENV, output=io.StringIO(), timeout_s=180, **grace)
    assert result.returncode == expect, "\n".join([f"launch returned {result.returncode}"] + list(result.tails))
    return [_outputs.read(out, i)[0] for i in range(2)]


def _keras_steps(n, steps_per_epoch, epochs):
    """Steps Keras 3 takes on an n-batch PyDataset: with steps_per_epoch, an epoch also
    ends where a pass ends (keras/src/trainers/epoch_iterator.py)."""
    if not steps_per_epoch:
        return n * epochs
    seen = total = 0
    for _ in range(epochs):
        for _ in range(steps_per_epoch):
            if seen >= n:
                break
            seen += 1
            total += 1
        if seen >= n:
            seen = 0
    return total


@needs_restarts
def test_keras_step_count_model_matches_keras():
    for steps in (4, 5, 12, 13):
        assert len(_PLAIN_KERAS.get(steps) or consumed(new_model().fit, BatchIds(12), epochs=5, steps_per_epoch=steps,
                                                       shuffle=False)[0]) == _keras_steps(12, steps, 5)


def _weights(out, i):
    arrays = _outputs.read(out, i)[1]
    return [arrays[k] for k in sorted(arrays)]


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("steps", [None, pytest.param(3, marks=needs_restarts)])
def test_two_worker_job_consumes_each_shard_in_whole_passes(steps, tmp_path):
    from passes_train import N_BATCHES, SEED

    epochs = 3
    records = _launch(tmp_path, "--epochs", str(epochs), "--validation",
                      *(["--steps-per-epoch", str(steps)] if steps else []))
    shard_len = N_BATCHES // 2
    total = _keras_steps(shard_len, steps, epochs)
    for w, record in enumerate(records):
        assert record["shard"] == [2, w] and record["num_batches"] == shard_len
        planner = EpochPlanner(N_BATCHES, shuffle=True, seed=SEED, num_shards=2, shard_index=w)
        want = [i for p in range(4) for i in planner.plan(p)][:total]
        assert record["ids"] == want
        # each batch loaded once per step, nothing after the last epoch: the spec reads and
        # the strategy's build are served from the batches loaded for training
        assert record["train_loads"] == total
        assert record["val_loads"] == epochs * 2  # 2-batch validation shard, 3 runs
    # the shards of each pass are disjoint and cover all but the batches sharding drops
    first = records[0]["ids"][:shard_len] + records[1]["ids"][:shard_len]
    assert len(set(first)) == 2 * shard_len


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.timeout(420)
@needs_restarts
def test_two_worker_job_killed_mid_epoch_resumes_exactly_with_other_loader_workers(tmp_path):
    common = ["--epochs", "3", "--steps-per-epoch", "5", "--save-freq", "4", "--backup", str(tmp_path / "backup")]
    reference = _launch(tmp_path / "reference", *common)
    # worker 1 is SIGKILLed after 10 steps (saves at 4 and 8); the launcher stops worker 0
    _launch(tmp_path / "killed", *common, "--kill-at-step", "10", expect=128 + signal.SIGKILL)
    killed = json.loads((tmp_path / "killed" / "worker1.killed.json").read_text())
    assert killed["ids"] == reference[1]["ids"][:10]
    resumed = _launch(tmp_path / "resumed", *common, "--loader-workers", "1")
    for w in range(2):
        assert resumed[w]["restored_step"] == 8
        assert resumed[w]["ids"] == reference[w]["ids"][8:]  # the batches after step 8, once
        assert resumed[w]["iterations"] == reference[w]["iterations"]
        for got, want in zip(_weights(tmp_path / "resumed", w), _weights(tmp_path / "reference", w)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert not (tmp_path / "backup").exists() or not any((tmp_path / "backup").rglob("metadata.json"))


class _Augmented:
    """Random augmentation drawn from numpy.random in __getitem__."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return np.random.normal(size=(2, 3)).astype("float32") + i


def test_random_augmentation_does_not_depend_on_the_worker_count(no_leaks):
    from _datasets import Squares  # noqa: F401  (tests dir on the path for workers)

    def draws(workers, restore=None):
        with kpipe.ProcessLoader(_Augmented(), workers=workers, shuffle=True, seed=4) as loader:
            if restore is not None:
                loader.restore(restore)
            return [loader[i] for i in range(6)], loader

    one, _ = draws(1)
    three, _ = draws(3)
    assert all(np.array_equal(a, b) for a, b in zip(one, three))
    with kpipe.ProcessLoader(_Augmented(), workers=2, shuffle=True, seed=4) as loader:
        [loader[i] for i in range(4)]
        state = loader.state()
    resumed, _ = draws(3, restore=state)  # batch i of the restored pass, whatever was read before
    assert all(np.array_equal(a, b) for a, b in zip(resumed, one))
    assert not np.array_equal(one[0], draws(1)[0][1])  # batches differ from each other


@pytest.mark.parametrize("run", range(3))
def test_evaluate_with_steps_under_a_strategy_evaluates_the_first_batches(run, no_leaks):
    # Keras < 3.7 builds the model (a probe) from the very epoch iterator it then
    # evaluates with; that iterator's stream ended with the probe, so evaluate got only
    # what tf.data had prefetched (2 or 3 batches, by timing). Three runs: not by chance.
    keras.utils.set_random_seed(run)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "Your input ran out of data"
        with kpipe.ProcessLoader(ReplacingIds(12), workers=2) as loader:
            got = model.evaluate(loader, steps=3, verbose=0)
    if _RESTARTS:
        plain = ReplacingIds(12)  # plain Keras on the same dataset: the same hooks, the same batches
        want = model.evaluate(plain, steps=3, verbose=0)
        # Keras calls on_epoch_end before it starts (a pass start: passed on, the same
        # reshuffle) and after the 3 steps, mid-pass: the documented deviation keeps the pass whole
        assert loader.dataset.ends == plain.ends - 1
    else:  # (plain Keras < 3.7 evaluates the batches after its probe's: compare with arrays)
        xs, ys = zip(*(ReplacingIds(12)[i] for i in range(3)))  # the first pass's first three batches
        want = model.evaluate(np.concatenate(xs), np.concatenate(ys), batch_size=2, verbose=0)
        assert loader.dataset.ends == 0
    assert got == pytest.approx(want, rel=1e-5)
