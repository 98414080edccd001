"""`kpipe.callbacks.BackupAndRestore`: resume after a crash with the weights of an
uninterrupted run, in one process (shuffled `ProcessLoader`) and in a real 2-worker job
whose backups were torn one epoch apart; argument errors."""

import doctest
import io
import json
import os
import signal
import sys

import numpy as np
import pytest

keras = pytest.importorskip("keras")

import kpipe  # noqa: E402
from kpipe.callbacks import _backup  # noqa: E402
from kpipe.callbacks import BackupAndRestore  # noqa: E402
from kpipe.distribute import launch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = os.path.join(ROOT, "tests", "programs")
sys.path.insert(0, PROGRAMS)
import _outputs  # noqa: E402 (tests/programs)
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
       "TF_CPP_MIN_LOG_LEVEL": "2"}
N_WORKERS = 2
EPOCHS = 4
BATCH = 8
SEED = 3


class Batches:
    """64 samples in contiguous batches of 8; module level so that it pickles."""

    def __init__(self):
        rng = np.random.RandomState(0)
        self.x = rng.rand(64, 4).astype("float32")
        self.y = (self.x[:, :1] + self.x[:, 1:2]).astype("float32")

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, i):
        return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]


class Crash(keras.callbacks.Callback):
    """Raises in the middle of epoch `epoch`, as a killed process would stop."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch, self._current = epoch, None

    def on_epoch_begin(self, epoch, logs=None):
        self._current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._current == self.epoch and batch == 2:
            raise RuntimeError("simulated crash")


def _model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    return model


def _loader():
    return kpipe.ProcessLoader(Batches(), workers=1, shuffle=True, seed=SEED)


def _fit(model, loader, callbacks):
    return model.fit(loader, epochs=EPOCHS, verbose=0, callbacks=callbacks)


@pytest.fixture(scope="module")
def uninterrupted():
    with _loader() as loader:
        model = _model()
        _fit(model, loader, [])
        return model.get_weights(), loader.epoch


@pytest.mark.timeout(120)
def test_resume_after_crash_equals_uninterrupted_run(tmp_path, uninterrupted, no_leaks):
    backup_dir = str(tmp_path / "backup")
    with _loader() as loader:
        with pytest.raises(RuntimeError, match="simulated crash"):
            _fit(_model(), loader, [BackupAndRestore(backup_dir, loaders=loader), Crash(epoch=2)])
    assert sorted(_backup.complete_epochs(backup_dir)) == [1, 2]  # keep=2: epoch 0 pruned

    epochs_run = []
    with _loader() as loader:  # a new loader at epoch 0, as in a restarted process
        callback = BackupAndRestore(backup_dir, loaders=loader)
        model = _model()
        history = _fit(model, loader, [callback, keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: epochs_run.append(epoch))])
        assert loader.epoch == uninterrupted[1] == EPOCHS  # one pass per epoch
    assert callback.restored_epoch == 2 and epochs_run == [2, 3]
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * len(Batches())
    for got, want in zip(model.get_weights(), uninterrupted[0]):
        assert np.array_equal(got, want)
    assert not os.path.exists(backup_dir)  # deleted when fit() completed
    assert model._initial_epoch is None  # the next fit() starts at its own initial_epoch


@pytest.mark.timeout(120)
def test_resume_without_loaders_replays_the_wrong_shuffle(tmp_path, uninterrupted):
    # The control for `loaders=`: a fresh loader not told the epoch serves epoch 0's
    # order in epoch 2, so the weights differ from the uninterrupted run.
    backup_dir = str(tmp_path / "backup")
    with _loader() as loader:
        with pytest.raises(RuntimeError):
            _fit(_model(), loader, [BackupAndRestore(backup_dir), Crash(epoch=2)])
    with _loader() as loader:
        # Given loaders, the backup must have recorded them: say so instead of guessing.
        with pytest.raises(ValueError, match=r"given 1 loader\(s\) but the backup .*epoch-000002 "
                                             r"recorded 0.*same `loaders`"):
            _fit(_model(), loader, [BackupAndRestore(backup_dir, loaders=[loader])])
        model = _model()
        _fit(model, loader, [BackupAndRestore(backup_dir)])
    assert not all(np.array_equal(a, b) for a, b in zip(model.get_weights(), uninterrupted[0]))


class _Stopped(Exception):
    pass


class _Stop(keras.callbacks.Callback):
    """Raises after the backup of epoch `at_epoch` (listed after BackupAndRestore)."""

    def __init__(self, at_epoch):
        super().__init__()
        self.at_epoch = at_epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.at_epoch:
            raise _Stopped()


@pytest.mark.timeout(60)
def test_torn_and_abandoned_epochs_are_ignored_then_removed(tmp_path):
    backup_dir = str(tmp_path / "backup")
    x, y = Batches()[0]
    with pytest.raises(_Stopped):
        _model().fit(x, y, epochs=3, verbose=0,
                     callbacks=[BackupAndRestore(backup_dir, keep=1), _Stop(at_epoch=1)])
    assert os.listdir(backup_dir) == ["epoch-000002"]  # keep=1
    assert sorted(_backup.complete_epochs(backup_dir)) == [2]
    # Tear epoch 2 (state written, metadata lost) and leave a half-written epoch 3.
    os.remove(os.path.join(backup_dir, "epoch-000002", "metadata.json"))
    os.makedirs(os.path.join(backup_dir, "epoch-000003"))
    assert _backup.complete_epochs(backup_dir) == {}
    callback = BackupAndRestore(backup_dir, keep=1)
    with pytest.raises(_Stopped):
        _model().fit(x, y, epochs=3, verbose=0, callbacks=[callback, _Stop(at_epoch=0)])
    assert callback.restored_epoch == 0
    assert os.listdir(backup_dir) == ["epoch-000001"]  # the torn and partial ones removed


@pytest.mark.parametrize("kwargs, fragments", [
    ({"keep": 0}, ["`keep`", "Received: keep=0", "keep=1"]),
    ({"keep": True}, ["`keep`", "Received: keep=True"]),
    ({"save_freq": 0}, ["`save_freq`", "Received: save_freq=0", "save_freq='epoch'", "save_freq=500"]),
    ({"save_freq": 2.5}, ["`save_freq`", "Received: save_freq=2.5"]),
    ({"save_freq": "batch"}, ["`save_freq`", "Received: save_freq='batch'"]),
])
def test_bad_arguments_name_the_argument_value_and_fix(tmp_path, kwargs, fragments):
    with pytest.raises(ValueError) as info:
        BackupAndRestore(str(tmp_path), **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_bad_backup_dir_and_loaders_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"`backup_dir`.*Received: backup_dir=''"):
        BackupAndRestore("")
    with pytest.raises(TypeError,
                       match=r"`loaders`.*`state\(\)` and `restore\(state\)`.*Received: loaders\[1\]=\[1, 2\]"):
        BackupAndRestore(str(tmp_path), loaders=[_FakeLoader(), [1, 2]])


class _FakeLoader:
    def state(self):
        return {}

    def restore(self, state):
        pass


@pytest.mark.timeout(60)
def test_docstring_example_runs():
    runner = doctest.DocTestRunner()
    globs = {"BackupAndRestore": BackupAndRestore}
    for test in doctest.DocTestFinder().find(BackupAndRestore, "BackupAndRestore", globs=globs):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 0


# ---------------------------------------------------------------- 2 workers on loopback
def _launch(out_dir, *args, expect=0):
    command = [sys.executable, os.path.join(PROGRAMS, "backup_train.py"), "--out", str(out_dir),
               *args]
    # A job whose worker dies: the other one, blocked in a collective, does not act on the
    # launcher's SIGTERM and is SIGKILLed after grace_s (10 s of waiting by default).
    grace = {} if expect == 0 else {"grace_s": 2.0}
    result = launch(command, workers=N_WORKERS, env=ENV, output=io.StringIO(), timeout_s=180, **grace)
    if result.returncode != expect and "address already in use" in "".join(result.tails).lower():
        # Another program took a port between free_ports() and the gRPC server's bind.
        result = launch(command, workers=N_WORKERS, env=ENV, output=io.StringIO(), timeout_s=180, **grace)
    assert result.returncode == expect, "\n".join(
        [f"launch returned {result.returncode}, expected {expect}"] + list(result.tails))
    return result


@pytest.mark.multiworker
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_workers_with_torn_backups_agree_on_the_older_epoch(tmp_path):
    backup = tmp_path / "backup"
    common = ["--backup", str(backup), "--epochs", "3"]
    result = _launch(tmp_path / "torn", *common, "--tear-at", "2",
                     expect=128 + signal.SIGKILL)
    assert result.failed_worker == 1 and result.returncodes[1] == -signal.SIGKILL
    newest = [sorted(_backup.complete_epochs(str(backup / f"worker-{i}")))
              for i in range(N_WORKERS)]
    assert newest == [[1, 2], [1]]  # worker 1 died before committing epoch 2
    assert (backup / "worker-1" / "epoch-000002" / "state.weights.h5").is_file()

    _launch(tmp_path / "resumed", *common, "--reference")
    records, arrays = zip(*(_outputs.read(tmp_path / "resumed", i) for i in range(N_WORKERS)))
    for record in records:
        assert record["restored_epoch"] == 1 and record["epochs_run"] == [1, 2]
        assert record["iterations"] == 3 * 4  # 3 epochs of 4 global batches
        assert not record["worker_dir_left"]
    assert not backup.exists()
    for i in range(4):
        assert np.array_equal(arrays[0][f"w{i}"], arrays[1][f"w{i}"])
        np.testing.assert_allclose(arrays[0][f"w{i}"], arrays[0][f"reference/w{i}"],
                                   rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- mid-epoch resume
_SEEN = []


def _record(ids):
    _SEEN.extend(int(v) for v in ids.numpy())
    return np.int32(0)


class RecordingModel(keras.Sequential):
    """Records the first input value of every batch its compiled train step consumes."""

    def train_step(self, data):
        import tensorflow as tf

        tf.py_function(_record, [tf.reshape(data[0][0, 0] * 1e6, [1])], tf.int32)
        return super().train_step(data)


def _recording_model():
    keras.utils.set_random_seed(1)
    model = RecordingModel([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
    return model


class CrashAtStep(keras.callbacks.Callback):
    """Raises after `step` training steps, as a killed process would stop."""

    def __init__(self, step):
        super().__init__()
        self.step, self.done = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.done == self.step:
            raise RuntimeError("simulated crash")


from kpipe import _compat  # noqa: E402

_OLD_KERAS = pytest.mark.skipif(not _compat.keras_at_least(_compat.KERAS_EPOCH_ITERATOR_RESET),
                                reason="Keras < 3.7 stops after one pass with steps_per_epoch")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("steps, save_freq, crash", [(None, 5, 13), pytest.param(3, 4, 9, marks=_OLD_KERAS),
                                                     pytest.param(5, 3, 10, marks=_OLD_KERAS), pytest.param(3, "epoch", 7, marks=_OLD_KERAS)],
                         ids=["epochs-are-passes", "steps3-save-at-pass-end", "steps5", "steps3-epoch-backups"])
def test_mid_epoch_resume_trains_the_same_batches_and_weights(steps, save_freq, crash, tmp_path, no_leaks):
    epochs = 4

    def fit(workers, callbacks):
        _SEEN.clear()
        with kpipe.ProcessLoader(Batches(), workers=workers, shuffle=True, seed=SEED) as loader:
            model = _recording_model()
            cbs = [cb(loader) if callable(cb) and not isinstance(cb, keras.callbacks.Callback) else cb
                   for cb in callbacks]
            try:
                history = model.fit(loader, epochs=epochs, steps_per_epoch=steps, verbose=0, callbacks=cbs)
            except RuntimeError:
                history = None
            return list(_SEEN), model.get_weights(), history, cbs

    full_ids, full_weights, full_history, _ = fit(1, [])
    backup = str(tmp_path / "backup")
    make = lambda loader: BackupAndRestore(backup, save_freq=save_freq, loaders=loader)  # noqa: E731
    crashed_ids, _, _, _ = fit(2, [make, CrashAtStep(crash)])
    assert crashed_ids == full_ids[:crash]
    resumed_ids, weights, history, (callback,) = fit(0, [make])
    done = callback.restored_step
    assert 0 < done < crash and (save_freq == "epoch" or done == crash // save_freq * save_freq)
    assert resumed_ids == full_ids[done:]  # exactly the batches an uninterrupted run takes next
    for got, want in zip(weights, full_weights):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    resumed_epochs = epochs - callback.restored_epoch
    assert len(history.history["loss"]) == resumed_epochs
    # epochs after the resumed one log what the uninterrupted run logged
    np.testing.assert_allclose(history.history["loss"][1:], full_history.history["loss"][-resumed_epochs + 1:], rtol=1e-5)
    assert not os.path.exists(backup) or not os.listdir(backup)


def test_backups_of_an_older_format_are_refused_with_the_reason(tmp_path):
    old = tmp_path / "epoch-000001"
    old.mkdir()
    (old / "state.weights.h5").write_bytes(b"x")
    (old / "metadata.json").write_text(json.dumps({"format": 1, "epoch": 1, "files": {"state.weights.h5": 1}}))
    with pytest.raises(ValueError, match=r"older kpipe \(format 1; this kpipe reads format 2\).*delete the backup"):
        _backup.complete_epochs(str(tmp_path))
    (old / "metadata.json").write_text(json.dumps({"format": 9, "index": 1, "files": {}}))
    with pytest.raises(ValueError, match="newer kpipe.*upgrade kpipe"):
        _backup.complete_epochs(str(tmp_path))


@pytest.mark.skipif(_compat.keras_at_least(_compat.KERAS_EPOCH_ITERATOR_RESET), reason="Keras >= 3.7 restarts passes")
def test_mid_pass_backups_need_a_keras_that_restarts_passes(tmp_path, no_leaks):
    with kpipe.ProcessLoader(Batches(), workers=0) as loader:
        with pytest.raises(RuntimeError, match=r"steps_per_epoch=3 \(the loader has 8 batches per pass\) needs Keras >= 3.7"):
            _model().fit(loader, epochs=1, steps_per_epoch=3, verbose=0,
                         callbacks=[BackupAndRestore(str(tmp_path), save_freq=2, loaders=loader)])


# ---------------------------------------------------------------- exact resume (issue 52)
import subprocess  # noqa: E402

import resume_cases  # noqa: E402 (tests/programs)


def _close(data):
    getattr(data, "close", lambda: None)()


@pytest.fixture(scope="module")
def full_runs():
    return {name: resume_cases.full(name) for name in resume_cases.CASES}


def _assert_resumed_like(full, weights, rates, restored_step):
    want_weights, want_rates = full
    assert len(weights) == len(want_weights)
    for got, want in zip(weights, want_weights):
        assert np.array_equal(got, want)
    # the steps trained after the resume applied the rates of the uninterrupted run
    assert sorted(rates) == [s for s in sorted(want_rates) if s >= restored_step]
    assert rates == {s: want_rates[s] for s in rates}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(resume_cases.CASES))
def test_same_process_retry_ends_bit_identical(name, full_runs, tmp_path, no_leaks):
    # Random layers' seed generators, the optimizer's state and Warmup (either side of the
    # backup callback) resume where the backup was taken; the model and callbacks are reused.
    model, data, made = resume_cases.crash(name, str(tmp_path / "backup"))
    try:
        weights, rates = resume_cases.run(name, model, data, made)
    finally:
        _close(data)
    backup = next(cb for cb in made if isinstance(cb, BackupAndRestore))
    assert backup.restored_step == (8 if resume_cases.CASES[name][1] == "epoch" else 10)
    _assert_resumed_like(full_runs[name], weights, rates, backup.restored_step)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_relaunched_process_ends_bit_identical(tmp_path, full_runs):
    # Crash in one fresh process, resume in another; the uninterrupted runs they must equal
    # bit for bit are the module's (this process's), shared with the same-process retries.
    program = os.path.join(PROGRAMS, "resume_cases.py")
    for phase in ("first", "resume"):
        result = subprocess.run([sys.executable, program, "--dir", str(tmp_path), "--phase", phase],
                                env={**os.environ, **ENV}, capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
    for name, (_, save_freq, _, _) in resume_cases.CASES.items():
        weights, rates = resume_cases.load(str(tmp_path / "resumed" / f"{name}.npz"))
        _assert_resumed_like(full_runs[name], weights, rates, 8 if save_freq == "epoch" else 10)


def _unpositioned_input(kind):
    """(fit arguments, fit keyword arguments) of an input the backup cannot position."""
    import tensorflow as tf

    x, y = Batches().x, Batches().y
    if kind == "shuffled-arrays":
        return (x, y), {"batch_size": BATCH}
    if kind == "arrays-steps-per-epoch":
        return (x, y), {"batch_size": BATCH, "shuffle": False, "steps_per_epoch": 3}
    if kind == "tf-data":
        return (tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),), {}
    if kind == "generator":
        def batches():
            while True:
                yield from (Batches()[i] for i in range(len(Batches())))
        return (batches(),), {"steps_per_epoch": len(Batches())}
    if kind == "pydataset":
        class Plain(keras.utils.PyDataset):
            def __len__(self):
                return len(Batches())

            def __getitem__(self, i):
                return Batches()[i]
        return (Plain(),), {}
    raise AssertionError(kind)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind, fix", [
    ("shuffled-arrays", "shuffle=False"), ("arrays-steps-per-epoch", "Leave steps_per_epoch unset"),
    ("tf-data", "loaders="), ("generator", "loaders="), ("pydataset", "loaders=")])
def test_mid_epoch_backups_refuse_an_input_they_cannot_position(kind, fix, tmp_path):
    args, kwargs = _unpositioned_input(kind)
    with pytest.raises(ValueError) as info:
        _model().fit(*args, epochs=2, verbose=0, **kwargs,
                     callbacks=[BackupAndRestore(str(tmp_path), save_freq=5)])
    message = str(info.value)
    for fragment in ("BackupAndRestore(save_freq=5)", "Received:", fix, "save_freq='epoch'"):
        assert fragment in message
    assert not os.path.exists(tmp_path / "step-000000001")
    # Backups that fall on epoch ends only resume at an epoch start: not refused.
    per_epoch = kwargs.get("steps_per_epoch") or len(Batches())
    _model().fit(*args, epochs=2, verbose=0, **kwargs,
                 callbacks=[BackupAndRestore(str(tmp_path / "ends"), save_freq=per_epoch)])


@pytest.mark.timeout(60)
def test_mid_epoch_backups_refuse_a_loader_not_given_as_loaders(tmp_path, no_leaks):
    with _loader() as loader:
        with pytest.raises(ValueError, match=r"ProcessLoader.*not in `loaders`.*loaders=.*save_freq='epoch'"):
            _model().fit(loader, epochs=2, verbose=0, callbacks=[BackupAndRestore(str(tmp_path), save_freq=5)])


@pytest.mark.timeout(60)
def test_retry_before_any_backup_logs_that_training_goes_on_from_memory(tmp_path, caplog):
    x, y = Batches().x, Batches().y
    model = _model()
    backup = BackupAndRestore(str(tmp_path), save_freq=50)
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=2, verbose=0,
                  callbacks=[backup, CrashAtStep(3)])
    with caplog.at_level("INFO", logger="kpipe.callbacks"):
        model.fit(x, y, batch_size=BATCH, shuffle=False, epochs=2, verbose=0, callbacks=[backup])
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "training from the start" not in text
    assert "3 optimizer steps" in text and "kept in memory" in text and "interrupted fit()" in text
    assert [r.levelname for r in caplog.records if "kept in memory" in r.getMessage()] == ["WARNING"]
    caplog.clear()
    with caplog.at_level("INFO", logger="kpipe.callbacks"):
        _model().fit(x, y, batch_size=BATCH, shuffle=False, epochs=1, verbose=0, callbacks=[backup])
    assert "training from the start" in " ".join(r.getMessage() for r in caplog.records)


def test_a_fit_looked_up_before_kpipe_wrapped_it_is_still_checked(tmp_path):
    # `model.fit(x, callbacks=[kpipe.callbacks.BackupAndRestore(...)])` as the first kpipe
    # name of a process resolves `fit` before kpipe's wrapper exists: the refusal holds.
    model = _model()
    unwrapped = type(model).fit.__wrapped__
    with pytest.raises(ValueError, match=r"Received: x=<numpy.ndarray>, shuffle=True.*shuffle=False"):
        unwrapped(model, Batches().x, Batches().y, batch_size=BATCH, epochs=1, verbose=0,
                  callbacks=[BackupAndRestore(str(tmp_path), save_freq=5)])


class _Noisy(keras.layers.Layer):
    """A user's layer with a seed generator of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.random.SeedGenerator(11)

    def call(self, x, training=False):
        return x + keras.random.normal(keras.ops.shape(x), stddev=0.1, seed=self.generator) if training else x


def _random_model(extra=True):
    inputs = keras.Input((4,))
    hidden = _Noisy()(keras.layers.Dropout(0.5, seed=1)(inputs))
    if extra:
        hidden = keras.layers.GaussianNoise(0.1, seed=2)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.generator = keras.random.SeedGenerator(5)  # one the model owns
    return model


def test_seed_generators_of_layers_nested_ones_and_the_model_are_all_saved(tmp_path):
    from kpipe.callbacks import _backup_state

    model = _random_model()
    assert len(_backup_state.seed_generators(model)) == 4
    saved = _backup_state.random_state(model)
    for generator in _backup_state.seed_generators(model):
        generator.next()
    assert _backup_state.random_state(model) != saved
    _backup_state.restore_random_state(model, saved, str(tmp_path))
    assert _backup_state.random_state(model) == saved
    with pytest.raises(ValueError, match=r"recorded 4 random seed generator state\(s\).*model has 3.*"
                                         r"Build the same model.*delete the backup"):
        _backup_state.restore_random_state(_random_model(extra=False), saved, str(tmp_path))


@pytest.mark.timeout(60)
def test_a_resumed_fit_says_so_in_one_line(tmp_path, capsys, caplog):
    x, y = Batches().x, Batches().y
    for verbose in (1, 0):
        backup = BackupAndRestore(str(tmp_path / f"v{verbose}"), verbose=verbose)
        with pytest.raises(RuntimeError, match="simulated crash"):
            _model().fit(x, y, batch_size=BATCH, shuffle=False, epochs=3, verbose=0, callbacks=[backup, Crash(epoch=2)])
        capsys.readouterr()
        with caplog.at_level("INFO", logger="kpipe.callbacks"):
            _model().fit(x, y, batch_size=BATCH, shuffle=False, epochs=3, verbose=0, callbacks=[backup])
        printed = [line for line in capsys.readouterr().out.splitlines() if "BackupAndRestore" in line]
        logged = [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]
        caplog.clear()
        steps = 2 * len(Batches())
        expected = (f"BackupAndRestore: resuming at epoch 2, step 0 ({steps} training steps done) from backup "
                    f"{os.path.join(str(tmp_path / f'v{verbose}'), 'epoch-000002')}.")
        assert (printed, logged) == (([expected], []) if verbose else ([], [expected]))
