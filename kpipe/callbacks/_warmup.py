"""`Warmup`: gradual learning-rate warmup for large minibatches (Goyal et al., 2017)."""

from typing import Optional

import keras


class Warmup(keras.callbacks.Callback):
    """Raises the learning rate linearly to its target over the first steps, then hands over.

    During warmup, optimizer step `t` (counted by `optimizer.iterations`, so training
    resumed by `BackupAndRestore` continues where it stopped) uses

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
      calls yours from step `T` on.

    One instance serves one model; do not share it across threads.

    Args:
        epochs: Warmup length in epochs (needs `fit()` to know the steps per epoch).
            Give either `epochs` or `steps`. Defaults to `None`.
        steps: Warmup length in optimizer steps. Defaults to `None`.
        initial_lr: Rate at step 0. Defaults to `None`: `target_lr` divided by the
            strategy's `num_replicas_in_sync`, the rate before linear scaling when the
            per-replica batch is the base batch (equal to `target_lr` on one device).
        target_lr: Rate reached at step `T`. Defaults to `None`: the optimizer's rate
            when training starts (a schedule's value at step `T`).
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
        self._step = None  # optimizer step of the next batch, read at the first batch
        self._variable_mode = False

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

    def _make_plan(self, optimizer):
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
        lr = optimizer._learning_rate  # noqa: SLF001 -- what the optimizer was built with
        if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            target = self.target_lr if self.target_lr is not None else float(lr(steps))
        elif not isinstance(lr, keras.Variable) and callable(lr):
            target = self.target_lr if self.target_lr is not None else float(lr())
        else:
            target = self.target_lr if self.target_lr is not None else float(
                keras.ops.convert_to_numpy(optimizer.learning_rate))
        initial = self.initial_lr
        if initial is None:
            initial = target / max(1, int(self.model.distribute_strategy.num_replicas_in_sync))
        return steps, float(initial), float(target)

    # -- callback hooks --------------------------------------------------------------

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        self._plan = self._make_plan(optimizer)
        steps, initial, target = self._plan
        lr = optimizer._learning_rate  # noqa: SLF001
        self._variable_mode = isinstance(lr, keras.Variable) or not callable(lr)
        if not self._variable_mode:
            self._user_schedule = lr
            if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
                optimizer.learning_rate = _WarmupSchedule(lr, steps, initial, target)
            else:
                optimizer.learning_rate = _WarmupCallable(lr, optimizer, steps, initial, target)
            # A step compiled by an earlier fit() baked in the old schedule: recompile.
            self.model.make_train_function(force=True)
        # Read the step at the first batch: `BackupAndRestore` may restore the optimizer
        # (and its step count) in an `on_train_begin` that runs after this one.
        self._step = None
        if self.verbose:
            print(f"Warmup: {initial:.6g} -> {target:.6g} over {steps} optimizer steps.")

    def on_train_batch_begin(self, batch, logs=None):
        if not self._variable_mode:
            return
        if self._step is None:
            self._step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        steps, initial, target = self._plan
        if self._step <= steps:
            self.model.optimizer.learning_rate = _ramp(self._step, steps, initial, target)

    def on_train_batch_end(self, batch, logs=None):
        if self._step is not None:
            self._step += int(getattr(self.model, "steps_per_execution", 1) or 1)

    def on_train_end(self, logs=None):
        steps, _, target = self._plan
        if self._variable_mode and (self._step is None or self._step < steps):
            # fit() ended inside the warmup: leave the rate the optimizer was built with,
            # so that the next fit() (with a new Warmup) ramps to the same target.
            self.model.optimizer.learning_rate = target
        if self._user_schedule is not None:
            self.model.optimizer.learning_rate = self._user_schedule
            self._user_schedule = None


def _ramp(step: int, steps: int, initial: float, target: float) -> float:
    if step >= steps:
        return target
    return initial + (target - initial) * step / steps


class _WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear ramp for `steps` steps, then the wrapped schedule."""

    def __init__(self, schedule, steps: int, initial: float, target: float):
        self.schedule, self.steps = schedule, steps
        self.initial, self.target = initial, target

    def __call__(self, step):
        t = keras.ops.cast(step, "float32")
        ramp = self.initial + (self.target - self.initial) * t / float(self.steps)
        return keras.ops.where(t < float(self.steps), ramp,
                               keras.ops.cast(self.schedule(step), "float32"))

    def get_config(self):
        return {"schedule": keras.saving.serialize_keras_object(self.schedule),
                "steps": self.steps, "initial": self.initial, "target": self.target}


class _WarmupCallable:
    """Linear ramp for `steps` steps, then the wrapped zero-argument callable."""

    def __init__(self, function, optimizer, steps: int, initial: float, target: float):
        self.function, self.optimizer, self.steps = function, optimizer, steps
        self.initial, self.target = initial, target

    def __call__(self):
        t = keras.ops.cast(self.optimizer.iterations, "float32")
        ramp = self.initial + (self.target - self.initial) * t / float(self.steps)
        return keras.ops.where(t < float(self.steps), ramp,
                               keras.ops.cast(self.function(), "float32"))
