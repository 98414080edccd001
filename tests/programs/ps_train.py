"""Program of the parameter-server tests: run it under `kpipe launch --workers 2 --ps 1`.

Every task writes `--out/pid_<type><index>` and calls `kpipe.distribute.auto_strategy()`;
workers and the ps task serve there until the chief exits. The chief trains with
`kpipe.distribute.ps_fit` and writes `--out/chief.json`.

Scenarios (`--scenario`):
  main   a learnable task (Adam, ModelCheckpoint, CSVLogger, validation); with
         `--kill-worker E` the chief SIGKILLs worker 1 during epoch E. Then class weights
         (learning rate 0, one fixed batch) against a single-process Keras fit, and the
         error cases.
  backup ps_fit with `--backup DIR` and kpipe's Warmup; with `--kill-ps E` the chief SIGKILLs the ps task
         during epoch E (after epoch E-1 was backed up) and reports the error it got.
"""

import argparse
import json
import os
import signal
import sys

import numpy as np

FEATURES = 4
BATCH = 16
STEPS = 20
EPOCHS = 3
CLASS_WEIGHT = {0: 3.0, 1: 0.5}
LOSS_THRESHOLD = 0.35
LR = 0.02
WARMUP_STEPS = 10


def make_data(n=512, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.rand(n, FEATURES).astype("float32")
    y = (x[:, 0] + x[:, 1] > 1.0).astype("int32")
    return x, y


def build(keras, lr):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(lr),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def train_dataset(ctx):
    import tensorflow as tf

    x, y = make_data()
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512).batch(BATCH)


class Killer:
    """A callback that SIGKILLs a task of the job during one epoch, once."""

    def __new__(cls, out, task, epoch, at_batch=5):
        import keras

        class _Killer(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if self.done or self._epoch != epoch or batch != at_batch:
                    return
                self.done = True
                with open(os.path.join(out, f"pid_{task}")) as f:
                    os.kill(int(f.read()), signal.SIGKILL)
                print(f"chief: killed {task} in epoch {epoch}", flush=True)

            def on_epoch_begin(self, e, logs=None):
                self._epoch = e

        killer = _Killer()
        killer.done, killer._epoch = False, -1
        return killer


def errors(kd, keras, tf, strategy):
    found = {}
    with strategy.scope():
        model = build(keras, 0.01)
    x, y = make_data(64)
    cases = {
        "numpy": lambda ctx: (x, y),
        "py_function": lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).map(
            lambda a, b: (tf.py_function(lambda t: t, [a], tf.float32), b)).batch(8),
    }
    for name, fn in cases.items():
        try:
            kd.ps_fit(model, fn, epochs=1, steps_per_epoch=1, verbose=0)
            found[name] = "no error"
        except ValueError as e:
            found[name] = str(e)
    return found


def class_weight_check(kd, keras, tf, strategy):
    x, y = make_data(BATCH, seed=3)
    ds_fn = lambda ctx: tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)  # noqa: E731
    result = {}
    for name, weights in (("weighted", CLASS_WEIGHT), ("unweighted", None)):
        with strategy.scope():
            model = build(keras, 0.0)
        history = kd.ps_fit(model, ds_fn, epochs=1, steps_per_epoch=4, class_weight=weights,
                            verbose=0)
        result[f"ps_{name}"] = history.history["loss"][-1]
        local = build(keras, 0.0)  # one process, no strategy
        local_history = local.fit(x, y, batch_size=BATCH, epochs=1, class_weight=weights,
                                  shuffle=False, verbose=0)
        result[f"local_{name}"] = local_history.history["loss"][-1]
    return result


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", choices=("main", "backup"), default="main")
    parser.add_argument("--kill-worker", type=int, default=None)
    parser.add_argument("--kill-ps", type=int, default=None)
    parser.add_argument("--backup", default=None)
    args = parser.parse_args(argv)

    from kpipe.distribute import cluster_info

    info = cluster_info()
    with open(os.path.join(args.out, f"pid_{info.task_type}{info.task_index}"), "w") as f:
        f.write(str(os.getpid()))

    import keras
    import tensorflow as tf

    import kpipe.distribute as kd

    strategy = kd.auto_strategy()  # workers and ps tasks serve here and never return
    assert info.task_type == "chief", info
    result = {"coordinator": type(strategy.coordinator).__name__}
    with strategy.scope():
        model = build(keras, LR)
    callbacks = []
    x_val, y_val = make_data(128, seed=1)
    if args.scenario == "main":
        if args.kill_worker is not None:
            callbacks.append(Killer(args.out, "worker1", args.kill_worker))
        callbacks += [keras.callbacks.CSVLogger(os.path.join(args.out, "log.csv")),
                      keras.callbacks.ModelCheckpoint(os.path.join(args.out, "m.weights.h5"),
                                                      save_weights_only=True)]
        history = kd.ps_fit(model, train_dataset, epochs=EPOCHS, steps_per_epoch=STEPS,
                            callbacks=callbacks, validation_data=(x_val, y_val), verbose=2)
        result.update(history=history.history, epochs=history.epoch,
                      iterations=int(model.optimizer.iterations.numpy()),
                      kpipe_steps=history.kpipe_steps,
                      class_weight=class_weight_check(kd, keras, tf, strategy),
                      errors=errors(kd, keras, tf, strategy))
    else:
        import kpipe.callbacks

        if args.kill_ps is not None:
            callbacks.append(Killer(args.out, "ps0", args.kill_ps))
        callbacks.append(kpipe.callbacks.Warmup(steps=WARMUP_STEPS, initial_lr=0.002))
        try:
            history = kd.ps_fit(model, train_dataset, epochs=EPOCHS, steps_per_epoch=STEPS,
                                callbacks=callbacks, backup_dir=args.backup, verbose=2)
        except kd.ParameterServerError as e:
            result["error"] = str(e)
            with open(os.path.join(args.out, "chief.json"), "w") as f:
                json.dump(result, f)
            print(f"chief: {e}", flush=True)
            return 3
        result.update(history=history.history, epochs=history.epoch,
                      iterations=int(model.optimizer.iterations.numpy()),
                      learning_rate=float(model.optimizer.learning_rate.numpy()))
    with open(os.path.join(args.out, "chief.json"), "w") as f:
        json.dump(result, f, default=float)
    print("chief: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
