"""Exact-resume cases of `kpipe.callbacks.BackupAndRestore` (and `Warmup`): a library for
tests/test_backup.py and a program that relaunches them in fresh processes.

Every case trains one small model holding every random layer users have (RandomFlip,
RandomCrop, SpatialDropout2D/1D, BatchNormalization, Dropout, GaussianNoise) with one
optimizer (SGD with momentum, Adam, AdamW, a learning-rate schedule) and, in some cases,
`Warmup` before or after the backup callback, on a shuffled `kpipe.ProcessLoader` (or
unshuffled NumPy arrays). `full` trains it without interruption; `crash` trains it with
backups every `SAVE_FREQ` steps and stops after `CRASH_AT` steps; `resume` trains it again
(the same model object for a same-process retry, a new one after a relaunch). Each run
returns its final weights and the learning rate each trained optimizer step applied.

    python resume_cases.py --dir D --phase first    # crashed runs -> D/backup
    python resume_cases.py --dir D --phase resume   # (a new process) resumed runs -> D/resumed

(tests/test_backup.py compares the resumed runs with `full` run in its own process.)
"""

import argparse
import os
import sys

import numpy as np

BATCH = 4
SAMPLES = 32  # 8 steps an epoch
EPOCHS = 3
SAVE_FREQ = 5
CRASH_AT = 13  # backups at steps 5 and 10: resumed at step 2 of epoch 1
LOADER_SEED = 3
# name: (optimizer, save_freq, input, callback order)
CASES = {
    "sgd-momentum": ("sgd_momentum", SAVE_FREQ, "loader", None),
    "adam": ("adam", SAVE_FREQ, "loader", None),
    "adamw-epoch-backups": ("adamw", "epoch", "loader", None),
    "schedule": ("schedule", SAVE_FREQ, "loader", None),
    "arrays-unshuffled": ("adam", SAVE_FREQ, "arrays", None),
    "warmup-before-backup": ("sgd_momentum", SAVE_FREQ, "loader", "warmup-first"),
    "warmup-after-backup": ("sgd_momentum", SAVE_FREQ, "loader", "warmup-last"),
}


def _data():
    rng = np.random.RandomState(0)
    x = rng.rand(SAMPLES, 6, 6, 2).astype("float32")
    y = x.mean(axis=(1, 2, 3))[:, None].astype("float32")
    return x, y


class Images:
    """`SAMPLES` images in contiguous batches of `BATCH`; module level so that it pickles."""

    def __init__(self):
        self.x, self.y = _data()

    def __len__(self):
        return SAMPLES // BATCH

    def __getitem__(self, i):
        return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]


def build(optimizer):
    import keras

    keras.utils.set_random_seed(1)
    layers = keras.layers
    model = keras.Sequential([
        keras.Input((6, 6, 2)), layers.RandomFlip(seed=1), layers.RandomCrop(4, 4, seed=2),
        layers.SpatialDropout2D(0.3, seed=3), layers.Reshape((16, 2)),
        layers.SpatialDropout1D(0.3, seed=4), layers.Flatten(), layers.Dense(8),
        layers.BatchNormalization(), layers.Dropout(0.3, seed=5), layers.GaussianNoise(0.1, seed=6),
        layers.Dense(1)])
    optimizers = keras.optimizers
    model.compile({
        "sgd_momentum": lambda: optimizers.SGD(0.05, momentum=0.9),
        "adam": lambda: optimizers.Adam(0.01),
        "adamw": lambda: optimizers.AdamW(0.01, weight_decay=0.1),
        "schedule": lambda: optimizers.SGD(optimizers.schedules.ExponentialDecay(0.1, 4, 0.5)),
    }[optimizer](), "mse")
    return model


def make_input(kind):
    import kpipe

    if kind == "loader":
        return kpipe.ProcessLoader(Images(), workers=0, shuffle=True, seed=LOADER_SEED)
    return _data()


class CrashAtStep:
    """A callback that raises after `step` batches, as a killed process would stop."""

    def __new__(cls, step):
        import keras

        class _Crash(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.done = 0

            def on_train_batch_end(self, batch, logs=None):
                self.done += 1
                if self.done == step:
                    raise RuntimeError("simulated crash")

        return _Crash()


def rate_recorder():
    """A callback recording {optimizer step: learning rate} for the steps that trained
    (list it last: the rate as the other callbacks left it for the step)."""
    import keras

    def read(value):
        return keras.ops.convert_to_numpy(value).item()

    class _Rates(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.rates, self._begin = {}, None

        def on_train_batch_begin(self, batch, logs=None):
            optimizer = self.model.optimizer
            self._begin = (read(optimizer.iterations), read(optimizer.learning_rate))

        def on_train_batch_end(self, batch, logs=None):
            step, rate = self._begin
            if read(self.model.optimizer.iterations) > step:
                self.rates[step] = rate

    return _Rates()


def callbacks(name, backup_dir):
    """The callbacks of case `name` (besides the crash and the recorder), in their order."""
    import kpipe

    _, save_freq, kind, order = CASES[name]
    made = []
    if backup_dir is not None:
        made.append(lambda data: kpipe.callbacks.BackupAndRestore(
            backup_dir, save_freq=save_freq, loaders=data if kind == "loader" else None))
    if order is not None:
        warmup = lambda data: kpipe.callbacks.Warmup(steps=12, initial_lr=0.0)  # noqa: E731
        made.insert(0 if order == "warmup-first" else len(made), warmup)
    return made


def run(name, model, data, made, crash=None):
    """Trains `model` on `data` (a loader, or (x, y)) with the callbacks `made` (built by
    `callbacks`); returns `(weights, rates)`, or raises the simulated crash."""
    recorder = rate_recorder()
    extra = [recorder] + ([CrashAtStep(crash)] if crash else [])
    if isinstance(data, tuple):
        model.fit(*data, batch_size=BATCH, shuffle=False, epochs=EPOCHS, verbose=0, callbacks=made + extra)
    else:
        model.fit(data, epochs=EPOCHS, verbose=0, callbacks=made + extra)
    return model.get_weights(), recorder.rates


def full(name):
    data = make_input(CASES[name][2])
    try:
        return run(name, build(CASES[name][0]), data, [make(data) for make in callbacks(name, None)])
    finally:
        getattr(data, "close", lambda: None)()


def crash(name, backup_dir, model=None, data=None):
    """Runs case `name` until the crash; returns (model, data, callbacks) for a retry."""
    model = model or build(CASES[name][0])
    data = data if data is not None else make_input(CASES[name][2])
    made = [make(data) for make in callbacks(name, backup_dir)]
    try:
        run(name, model, data, made, crash=CRASH_AT)
    except RuntimeError as error:
        if "simulated crash" not in str(error):
            raise
    else:
        raise AssertionError("the crash did not happen")
    return model, data, made


def _save(path, weights, rates):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez(path, rate_steps=np.array(sorted(rates)), rates=np.array([rates[k] for k in sorted(rates)]),
             **{f"w{i}": w for i, w in enumerate(weights)})


def load(path):
    """`(weights, rates)` saved by this program."""
    with np.load(path) as f:
        weights = [f[f"w{i}"] for i in range(len(f.files) - 2)]
        return weights, dict(zip(f["rate_steps"].tolist(), f["rates"].tolist()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--phase", choices=["first", "resume"], required=True)
    args = parser.parse_args(argv)
    for name in CASES:
        backup_dir = os.path.join(args.dir, "backup", name)
        if args.phase == "first":
            _, data, _ = crash(name, backup_dir)
            getattr(data, "close", lambda: None)()
        else:
            data = make_input(CASES[name][2])
            try:
                made = [make(data) for make in callbacks(name, backup_dir)]
                _save(os.path.join(args.dir, "resumed", name + ".npz"),
                      *run(name, build(CASES[name][0]), data, made))
            finally:
                getattr(data, "close", lambda: None)()
    return 0


if __name__ == "__main__":
    sys.exit(main())
