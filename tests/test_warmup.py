"""`kpipe.callbacks.Warmup`: the learning rate each optimizer step really applied.

The model has one weight `w`, input 1 and loss `mean(w * x)`, so the gradient is 1 and plain
SGD changes `w` by exactly `-lr` per step: the weight deltas are the applied rates."""

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from kpipe.callbacks import Warmup  # noqa: E402

STEPS_PER_EPOCH = 4


class _Deltas(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.weights = [float(self.model.get_weights()[0][0, 0])]

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append(float(self.model.get_weights()[0][0, 0]))

    @property
    def rates(self):
        return [round(a - b, 6) for a, b in zip(self.weights, self.weights[1:])]


def _model(learning_rate):
    model = keras.Sequential([keras.Input((1,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(keras.optimizers.SGD(learning_rate), loss=lambda y, p: keras.ops.mean(p))
    return model


def _fit(model, *callbacks, epochs=2, x=None):
    deltas = _Deltas()
    if x is None:
        x = np.ones((2 * STEPS_PER_EPOCH, 1), "float32")
        model.fit(x, np.zeros_like(x), batch_size=2, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[*callbacks, deltas])
    else:
        model.fit(x, epochs=epochs, verbose=0, callbacks=[*callbacks, deltas])
    return deltas.rates


RAMP = [0.1, 0.175, 0.25, 0.325]


def test_float_rate_ramps_then_stays_at_the_target():
    warmup = Warmup(steps=4, initial_lr=0.1)
    rates = _fit(_model(0.4), warmup)
    assert rates == pytest.approx(RAMP + [0.4] * 4)
    assert warmup.warmup_steps == 4 and warmup.planned_rates() == pytest.approx(RAMP)


def test_schedule_is_ramped_into_then_takes_over_at_the_true_step():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay([5], [0.4, 0.04])  # step > 5: 0.04
    model = _model(schedule)
    rates = _fit(model, Warmup(steps=4, initial_lr=0.1))
    assert rates == pytest.approx(RAMP + [0.4, 0.4, 0.04, 0.04])
    assert model.optimizer._learning_rate is schedule  # handed back after fit()


def test_callable_rate_is_wrapped_like_a_schedule():
    rates = _fit(_model(lambda: 0.4), Warmup(steps=4, initial_lr=0.1))
    assert rates == pytest.approx(RAMP + [0.4] * 4)


def test_warmup_in_epochs_uses_the_steps_per_epoch():
    warmup = Warmup(epochs=1, initial_lr=0.0, target_lr=0.2)
    rates = _fit(_model(0.4), warmup)
    assert warmup.warmup_steps == STEPS_PER_EPOCH
    assert rates == pytest.approx([0.0, 0.05, 0.1, 0.15] + [0.2] * 4)


def test_other_callbacks_own_the_rate_after_warmup():
    halve_from_epoch_2 = keras.callbacks.LearningRateScheduler(
        lambda epoch, lr: lr * 0.5 if epoch == 2 else lr)
    rates = _fit(_model(0.4), Warmup(steps=4, initial_lr=0.1), halve_from_epoch_2, epochs=3)
    assert rates == pytest.approx(RAMP + [0.4] * 4 + [0.2] * 4)


def test_default_initial_rate_is_target_over_replicas():
    # One replica: the rate before linear scaling is the target itself, so nothing ramps.
    rates = _fit(_model(0.4), Warmup(steps=4))
    assert rates == pytest.approx([0.4] * 8)


def test_warmup_counts_optimizer_steps_across_fit_calls():
    model = _model(0.4)
    assert _fit(model, Warmup(steps=6, initial_lr=0.1), epochs=1) == pytest.approx(
        [0.1, 0.15, 0.2, 0.25])
    # A second fit() continues at step 4, as training resumed from a backup does.
    assert _fit(model, Warmup(steps=6, initial_lr=0.1), epochs=1) == pytest.approx(
        [0.3, 0.35, 0.4, 0.4])


@pytest.mark.parametrize("kwargs, match", [
    ({}, "Give exactly one of `epochs` and `steps`"),
    ({"epochs": 1, "steps": 2}, "Give exactly one of `epochs` and `steps`"),
    ({"steps": 0}, "`steps` must be a positive integer. Received: steps=0"),
    ({"epochs": 1.5}, "`epochs` must be a positive integer. Received: epochs=1.5"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Warmup(**kwargs)


def test_epochs_need_a_known_epoch_length():
    tf = pytest.importorskip("tensorflow")
    unknown_length = tf.data.Dataset.from_tensor_slices(
        (np.ones((8, 1), "float32"), np.zeros((8, 1), "float32"))).filter(lambda x, y: True).batch(2)
    with pytest.raises(ValueError, match="needs the number of steps per epoch"):
        _fit(_model(0.4), Warmup(epochs=1), x=unknown_length, epochs=1)
    with pytest.raises(RuntimeError, match="once `fit\\(\\)` has started"):
        Warmup(steps=2).planned_rates()


# ---------------------------------------------------------------- interrupted fits (issue 52)
class _Crash(keras.callbacks.Callback):
    def __init__(self, after):
        super().__init__()
        self.after, self.done = after, 0

    def on_train_batch_end(self, batch, logs=None):
        self.done += 1
        if self.done == self.after:
            raise RuntimeError("simulated crash")


class _Rates(keras.callbacks.Callback):
    """{optimizer step: weight delta} of the steps that trained (skipped ones move nothing)."""

    def on_train_begin(self, logs=None):
        self.rates, self._w = {}, float(self.model.get_weights()[0][0, 0])

    def on_train_batch_end(self, batch, logs=None):
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        w = float(self.model.get_weights()[0][0, 0])
        if step not in self.rates and w != self._w:
            self.rates[step - 1] = round(self._w - w, 6)
        self._w = w


def _crashing_fit(model, *callbacks, after=3):
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(model, *callbacks, _Crash(after))


def _ramp(steps, initial, target):
    return [initial + (target - initial) * t / steps for t in range(steps)]


CONSTANT_SCHEDULE = keras.optimizers.schedules.PiecewiseConstantDecay([100], [0.4, 0.04])


@pytest.mark.parametrize("rate", [0.4, CONSTANT_SCHEDULE], ids=["float", "schedule"])
def test_an_interrupted_fit_leaves_the_compiled_rate_behind(rate):
    model = _model(rate)
    _crashing_fit(model, Warmup(steps=8, initial_lr=0.1))
    if rate is CONSTANT_SCHEDULE:
        assert model.optimizer._learning_rate is CONSTANT_SCHEDULE
    assert float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)) == pytest.approx(0.4)
    assert _fit(model) == pytest.approx([0.4] * 8)  # a plain fit: no ramp left in it


def test_a_schedule_warmup_ending_mid_ramp_leaves_no_ramp_in_the_compiled_step():
    model = _model(CONSTANT_SCHEDULE)
    assert _fit(model, Warmup(steps=12, initial_lr=0.1)) == pytest.approx(_ramp(12, 0.1, 0.4)[:8])
    assert _fit(model) == pytest.approx([0.4] * 8)  # steps 8-15: the schedule's own rate


@pytest.mark.parametrize("rate", [0.4, CONSTANT_SCHEDULE], ids=["float", "schedule"])
def test_a_retry_after_an_interruption_ramps_on_to_the_compiled_rate(rate):
    model = _model(rate)
    warmup = Warmup(steps=8, initial_lr=0.1)
    _crashing_fit(model, warmup)
    assert _fit(model, warmup) == pytest.approx(_ramp(8, 0.1, 0.4)[3:] + [0.4] * 3)


@pytest.mark.parametrize("warmup_first", [True, False], ids=["warmup-first", "backup-first"])
@pytest.mark.parametrize("rate", [0.4, CONSTANT_SCHEDULE], ids=["float", "schedule"])
def test_warmup_with_backup_resumes_the_ramp_at_the_trained_step(rate, warmup_first, tmp_path):
    from kpipe.callbacks import BackupAndRestore

    def callbacks(backup_dir):
        warmup, backup = Warmup(steps=6, initial_lr=0.1), BackupAndRestore(backup_dir, save_freq=2)
        return [warmup, backup] if warmup_first else [backup, warmup]

    full = _Rates()
    reference = _model(rate)
    _fit(reference, *callbacks(str(tmp_path / "full")), full, epochs=3)
    assert list(full.rates.values()) == pytest.approx(_ramp(6, 0.1, 0.4) + [0.4] * 6)
    model, made = _model(rate), callbacks(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(model, *made, _Crash(5), epochs=3)  # backed up after step 4
    resumed = _Rates()
    _fit(model, *made, resumed, epochs=3)  # the same callbacks, retried in this process
    assert resumed.rates == {t: full.rates[t] for t in range(4, 12)}
    assert np.array_equal(model.get_weights()[0], reference.get_weights()[0])


def test_a_retry_of_a_fit_kpipe_did_not_see_end_still_ramps_to_the_compiled_rate():
    # A `fit` looked up before kpipe wrapped it runs no clean-up when it raises: the
    # same Warmup hands the rate back when the next fit() sets the model.
    model = _model(0.4)
    warmup = Warmup(steps=8, initial_lr=0.1)
    x = np.ones((2 * STEPS_PER_EPOCH, 1), "float32")
    with pytest.raises(RuntimeError, match="simulated crash"):
        type(model).fit.__wrapped__(model, x, np.zeros_like(x), batch_size=2, epochs=2, shuffle=False,
                                    verbose=0, callbacks=[warmup, _Crash(3)])
    assert _fit(model, warmup) == pytest.approx(_ramp(8, 0.1, 0.4)[3:] + [0.4] * 3)
