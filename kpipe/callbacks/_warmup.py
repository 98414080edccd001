"""`Warmup`: gradual learning-rate warmup for large minibatches (Goyal et al., 2017)."""

from typing import Optional

import keras

from kpipe import _backends, _compat, _keras_hook

_keras_hook.install_fit_wrappers()  # fit()'s end runs _hand_back, however it ends (kpipe/_fit_scope.py)


class Warmup(keras.callbacks.Callback):
    """Raises the learning rate linearly to its target over the first steps, then hands over.

    During warmup, optimizer step `t` (counted by `optimizer.iterations`: the steps
    `BackupAndRestore` skips in a resumed epoch do not count, and training resumed from a
    backup continues the ramp where it stopped, whatever the order of the callbacks) uses

        lr(t) = initial_lr + (target_lr - initial_lr) * t / T,    0 <= t < T,

    and from step `T` on the optimizer's own learning rate: the constant you compiled
    with (e.g. from `kpipe.distribute.scaled_learning_rate`) or your
    `keras.optimizers.schedules.LearningRateSchedule`, evaluated at the true step.

    How it acts depends on what the optimizer holds:

    * a float (Keras keeps it in a variable, which `LearningRateScheduler` and
      `ReduceLROnPlateau` assign): the variable is assigned before each step of the
      warmup and set to `target_lr` at step `T` (or when `fit()` ends before `T`); other
      callbacks may change it afterwards. With `steps_per_execution > 1` the rate changes
      once per execution.
    * a `LearningRateSchedule`, or a zero-argument callable: it is wrapped, for the
      duration of `fit()`, in one that computes the ramp inside the compiled step and
      calls yours from step `T` on. When `fit()` ends, the optimizer gets yours back and
      the wrapper in the step compiled with it calls yours alone: a later `fit()` does
      not ramp.

    `fit()` ending by an exception (a crash, Ctrl-C) hands the rate back the same way,
    so a retry in the same process ramps to the same target. (A `fit` looked up before
    kpipe's callbacks were imported, as in `model.fit(x, callbacks=[kpipe.callbacks.
    Warmup(...)])` first thing in a process, is not seen ending: the same `Warmup` then
    hands back when the next `fit()` starts.)

    One instance serves one model; do not share it across threads.

    Args:
        epochs: Warmup length in epochs (needs `fit()` to know the steps per epoch).
            Give either `epochs` or `steps`. Defaults to `None`.
        steps: Warmup length in optimizer steps. Defaults to `None`.
        initial_lr: Rate at step 0. Defaults to `None`: `target_lr` divided by the
            strategy's `num_replicas_in_sync`, the rate before linear scaling when the
            per-replica batch is the base batch (equal to `target_lr` on one device).
        target_lr: Rate reached at step `T`. Defaults to `None`: the optimizer's rate
            when `fit()` starts -- read as Keras sets up the callbacks, before a
            `BackupAndRestore` restores a rate from the middle of the ramp -- or a
            schedule's value at step `T`.
        verbose: 1 prints the warmup plan when training starts. Defaults to 0.

    Raises:
        ValueError: Neither or both of `epochs` and `steps` are given, one is not a
            positive integer, or `epochs` is used when `fit()` does not know the number
            of steps per epoch.

    Example:

    >>> import keras, numpy as np
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile(keras.optimizers.SGD(0.4), "mse")
    >>> warmup = Warmup(steps=4, initial_lr=0.1)
    >>> _ = model.fit(np.zeros((8, 2)), np.zeros((8, 1)), batch_size=2, epochs=2,
    ...               verbose=0, callbacks=[warmup])
    >>> [round(lr, 3) for lr in warmup.planned_rates()]
    [0.1, 0.175, 0.25, 0.325]
    """

    def __init__(self, epochs: Optional[int] = None, *, steps: Optional[int] = None,
                 initial_lr: Optional[float] = None, target_lr: Optional[float] = None,
                 verbose: int = 0):
        super().__init__()
        if (epochs is None) == (steps is None):
            raise ValueError("Give exactly one of `epochs` and `steps`. Received: "
                             f"epochs={epochs!r}, steps={steps!r}.")
        for name, value in (("epochs", epochs), ("steps", steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"`{name}` must be a positive integer. "
                                 f"Received: {name}={value!r}.")
        self.epochs, self.steps = epochs, steps
        self.initial_lr, self.target_lr = initial_lr, target_lr
        self.verbose = verbose
        self._plan = None          # (warmup_steps, initial_lr, target_lr) once known
        self._user_schedule = None  # the optimizer's schedule while we wrap it
        self._wrapper = None  # what wraps it
        self._start_rate = None  # the optimizer's rate when fit() set the model
        self._variable_mode = self._ramping = self._reads_step = False
        self._step = None  # optimizer step of the next batch (see on_train_begin)
        self._handed_back = True

    # -- the plan --------------------------------------------------------------------

    @property
    def warmup_steps(self) -> Optional[int]:
        """Warmup length in optimizer steps, known once training has started."""
        return None if self._plan is None else self._plan[0]

    def planned_rates(self):
        """The learning rates of steps `0 .. warmup_steps - 1`, once training has started."""
        if self._plan is None:
            raise RuntimeError("The warmup plan is known once `fit()` has started.")
        steps, initial, target = self._plan
        return [_ramp(t, steps, initial, target) for t in range(steps)]

    def _make_plan(self, optimizer, lr):
        if self.steps is not None:
            steps = self.steps
        else:
            per_epoch = (self.params or {}).get("steps")
            if not per_epoch:
                raise ValueError(
                    f"`Warmup(epochs={self.epochs})` needs the number of steps per epoch, "
                    "which fit() does not know for this input. Pass `steps_per_epoch` "
                    "to fit(), or use `Warmup(steps=...)`.")
            steps = self.epochs * per_epoch
        if self.target_lr is not None:
            target = self.target_lr
        elif isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            target = float(lr(steps))
        elif not _compat.is_keras_variable(lr) and callable(lr):
            target = float(lr())
        elif self._start_rate is not None:
            target = self._start_rate
        else:
            target = float(_backends.numpy_value(optimizer.learning_rate))
        initial = self.initial_lr
        if initial is None:
            initial = target / max(1, int(_backends.strategy_of(self.model).num_replicas_in_sync))
        return steps, float(initial), float(target)

    # -- callback hooks --------------------------------------------------------------

    def set_model(self, model):
        if not self._handed_back and self.model is model:
            self._hand_back()  # the last fit() ended where kpipe did not see it end
        super().set_model(model)
        # Keras sets the model before any callback's on_train_begin: the rate read here is
        # the one fit() starts with, not one that BackupAndRestore restores (mid-ramp) there.
        optimizer = getattr(model, "optimizer", None)
        lr = getattr(optimizer, "_learning_rate", None)
        self._start_rate = (float(_backends.numpy_value(lr))
                            if _compat.is_keras_variable(lr) else None)

    def on_train_begin(self, logs=None):
        from kpipe import _fit_scope

        optimizer = self.model.optimizer
        lr = _unwrapped(optimizer._learning_rate)  # noqa: SLF001 -- what the optimizer was built with
        if lr is not optimizer._learning_rate:  # noqa: SLF001 -- left by a fit() that kpipe did not see end
            optimizer.learning_rate = lr
        self._plan = self._make_plan(optimizer, lr)
        steps, initial, target = self._plan
        self._variable_mode = _compat.is_keras_variable(lr) or not callable(lr)
        self._ramping, self._handed_back = self._variable_mode, False
        # In Keras's fit() the step about to run is the optimizer's count, which the steps
        # BackupAndRestore skips do not advance: read it before each step of the ramp.
        # kpipe.distribute.ps_fit calls back before scheduling a step while others are
        # still in flight (not counted yet): there, count the steps from the first one.
        self._step, self._reads_step = None, _fit_scope.current(self.model) is not None
        if not self._variable_mode:
            self._user_schedule = lr
            with _backends.strategy_of(self.model).scope():
                active = keras.Variable(1.0, dtype="float32", trainable=False, name="warmup_active")
            if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
                self._wrapper = _WarmupSchedule(lr, steps, initial, target, active)
            else:
                self._wrapper = _WarmupCallable(lr, optimizer, steps, initial, target, active)
            optimizer.learning_rate = self._wrapper
            # A step compiled by an earlier fit() baked in the old schedule: recompile.
            self.model.make_train_function(force=True)
        # However this fit() ends (an exception skips on_train_end), hand the rate back.
        _fit_scope.at_exit(self.model, self._hand_back)
        if self.verbose:
            print(f"Warmup: {initial:.6g} -> {target:.6g} over {steps} optimizer steps.")

    def on_train_batch_begin(self, batch, logs=None):
        if not self._ramping:
            return
        if self._step is None or self._reads_step:
            self._step = int(_backends.numpy_value(self.model.optimizer.iterations))
        steps, initial, target = self._plan
        if self._step <= steps:
            self.model.optimizer.learning_rate = _ramp(self._step, steps, initial, target)
        self._ramping = self._step < steps

    def on_train_batch_end(self, batch, logs=None):
        if self._step is not None:
            self._step += int(getattr(self.model, "steps_per_execution", 1) or 1)

    def on_train_end(self, logs=None):
        self._hand_back()

    def _hand_back(self):
        """Leaves the optimizer as fit() found it: the target rate if fit() ended inside the
        warmup (so that a later fit() ramps to the same target, or trains at it), the
        schedule unwrapped -- and the wrapper a pass-through in the step compiled with it."""
        if self._handed_back or self._plan is None:
            return
        self._handed_back, self._ramping = True, False
        optimizer = self.model.optimizer
        steps, _, target = self._plan
        if self._variable_mode:
            if int(_backends.numpy_value(optimizer.iterations)) < steps:
                optimizer.learning_rate = target
            return
        self._wrapper.active.assign(0.0)
        if optimizer._learning_rate is self._wrapper:  # noqa: SLF001
            optimizer.learning_rate = self._user_schedule
        self._user_schedule = self._wrapper = None


def _unwrapped(lr):
    while isinstance(lr, (_WarmupSchedule, _WarmupCallable)):
        lr.active.assign(0.0)
        lr = lr.schedule if isinstance(lr, _WarmupSchedule) else lr.function
    return lr


def _ramp(step: int, steps: int, initial: float, target: float) -> float:
    if step >= steps:
        return target
    return initial + (target - initial) * step / steps


class _WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear ramp for `steps` steps, then the wrapped schedule; the wrapped schedule
    alone once `active` (a variable the compiled step reads) is 0."""

    def __init__(self, schedule, steps: int, initial: float, target: float, active):
        self.schedule, self.steps = schedule, steps
        self.initial, self.target, self.active = initial, target, active

    def __call__(self, step):
        t = keras.ops.cast(step, "float32")
        ramp = self.initial + (self.target - self.initial) * t / float(self.steps)
        return keras.ops.where(_in_ramp(t, self.steps, self.active), ramp,
                               keras.ops.cast(self.schedule(step), "float32"))

    def get_config(self):
        return {"schedule": keras.saving.serialize_keras_object(self.schedule),
                "steps": self.steps, "initial": self.initial, "target": self.target}


class _WarmupCallable:
    """Linear ramp for `steps` steps, then the wrapped zero-argument callable; the
    callable alone once `active` is 0."""

    def __init__(self, function, optimizer, steps: int, initial: float, target: float, active):
        self.function, self.optimizer, self.steps = function, optimizer, steps
        self.initial, self.target, self.active = initial, target, active

    def __call__(self):
        t = keras.ops.cast(self.optimizer.iterations, "float32")
        ramp = self.initial + (self.target - self.initial) * t / float(self.steps)
        return keras.ops.where(_in_ramp(t, self.steps, self.active), ramp,
                               keras.ops.cast(self.function(), "float32"))


def _in_ramp(t, steps: int, active):
    return keras.ops.logical_and(t < float(steps), keras.ops.greater(active, 0.5))
