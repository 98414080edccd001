"""kpipe on a Keras backend other than TensorFlow: a program that tests/test_backend_jax.py
and tests/test_backend_torch.py run in a fresh process with KERAS_BACKEND set (Keras picks
its backend at import). Every case trains one small model twice -- plain Keras on the
same data, and through kpipe -- and keeps both final weights; the tests compare them.

    python backend_cases.py --out D --phase first        # all cases; a crashed backup run
    python backend_cases.py --out D --phase resume       # (a new process) its resumed run
    python backend_cases.py --out D --phase dataparallel # keras.distribution.DataParallel
                                                         # (JAX, XLA_FLAGS=...device_count=2)
    python backend_cases.py --out D --phase multiprocess --process-id I --port P  # I = 0, 1

Each phase writes `_outputs.write(D/<phase>, I, record, arrays)` (I: the process id, else 0).
"""

import argparse
import os
import sys

import keras  # the backend is KERAS_BACKEND's, set by the test
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _outputs  # noqa: E402

BATCH, STEPS, EPOCHS = 8, 8, 2  # 64 samples
CRASH_AT = 13  # backups every 5 steps: resumed at step 2 of epoch 1 (of 8-step epochs)


def _data():
    rng = np.random.RandomState(0)
    x = rng.rand(BATCH * STEPS, 4).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")
    return x, y


class Batches(keras.utils.PyDataset):
    """`STEPS` batches of `BATCH` rows, in order."""

    def __init__(self, delay=0.0):
        super().__init__()
        self.x, self.y = _data()
        self.delay = delay

    def __len__(self):
        return STEPS

    def __getitem__(self, i):
        if self.delay:
            import time

            time.sleep(self.delay)
        return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]


class Points:
    """One sample per index, for `ProcessLoader.from_samples`."""

    def __init__(self):
        self.x, self.y = _data()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, j):
        return self.x[j], self.y[j]


class WorkerModules(keras.utils.PyDataset):
    """Batches of one row: 1 where the worker process has imported TensorFlow."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return np.array([["tensorflow" in sys.modules]], dtype="float32"), np.zeros((1, 1), "float32")


def build(dropout=False):
    """A small model with fixed initial weights (seeded initializers: no
    `keras.utils.set_random_seed`, which imports TensorFlow when it is installed)."""

    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="relu", kernel_initializer=keras.initializers.GlorotUniform(1))]
    if dropout:
        layers.append(keras.layers.Dropout(0.25, seed=2))
    layers.append(keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(3)))
    model = keras.Sequential(layers)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def _keep(arrays, name, weights):
    for i, w in enumerate(weights):
        arrays[f"{name}/{i}"] = np.asarray(w)


def _loader(data, **kwargs):
    import kpipe

    kwargs.setdefault("workers", 2)
    return kpipe.ProcessLoader(data, **kwargs)


class Crash:
    """Stops training by raising after `step` steps (a job killed mid-epoch)."""

    def __new__(cls, step):
        class _Crash(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seen = 0

            def on_train_batch_end(self, batch, logs=None):
                self.seen += 1
                if self.seen == step:
                    raise KeyboardInterrupt("crash")

        return _Crash()


class RateRecorder(keras.callbacks.Callback):
    """The learning rate of each step, read after `Warmup` set it (through `self.model`,
    which on JAX syncs the training state into the model's variables first)."""

    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def on_train_batch_begin(self, batch, logs=None):
        rate = self.model.optimizer.learning_rate
        self.seen.append(float(keras.ops.convert_to_numpy(getattr(rate, "value", rate))))


def _backup_fit(model, backup_dir, crash=None):
    """`fit()` of a shuffled ProcessLoader for 3 epochs with backups every 5 steps."""
    import kpipe

    with _loader(Batches(), shuffle=True, seed=3) as data:
        callbacks = [kpipe.callbacks.BackupAndRestore(backup_dir, save_freq=5, loaders=data, verbose=0)]
        if crash:
            callbacks.append(Crash(crash))
        try:
            model.fit(data, epochs=3, verbose=0, callbacks=callbacks)
        except KeyboardInterrupt:
            pass
    return callbacks[0]


def first(out, arrays, record):
    import kpipe

    record["backend"] = keras.backend.backend()
    record["tf_after_import"] = "tensorflow" in sys.modules

    # ProcessLoader (PyDataset form), validation, evaluate, predict.
    plain = build()
    h = plain.fit(Batches(), epochs=EPOCHS, shuffle=False, verbose=0, validation_data=Batches())
    _keep(arrays, "loader/plain", plain.get_weights())
    record["loader/plain/val_loss"] = h.history["val_loss"]
    record["loader/plain/evaluate"] = plain.evaluate(Batches(), verbose=0)
    arrays["loader/plain/predict"] = plain.predict(Batches(), verbose=0)
    model = build()
    with _loader(Batches()) as train, _loader(Batches(), workers=1) as val:
        h = model.fit(train, epochs=EPOCHS, shuffle=False, verbose=0, validation_data=val)
        record["loader/kpipe/evaluate"] = model.evaluate(val, verbose=0)
        arrays["loader/kpipe/predict"] = model.predict(train, verbose=0)
    _keep(arrays, "loader/kpipe", model.get_weights())
    record["loader/kpipe/val_loss"] = h.history["val_loss"]

    # ProcessLoader.from_samples against NumPy arrays in the same order.
    x, y = _data()
    plain = build()
    plain.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    _keep(arrays, "samples/plain", plain.get_weights())
    model = build()
    with kpipe.ProcessLoader.from_samples(Points(), BATCH, shuffle=False, workers=2) as data:
        model.fit(data, epochs=EPOCHS, verbose=0)
    _keep(arrays, "samples/kpipe", model.get_weights())

    # fit_generator: the Keras 2 call against plain fit of the PyDataset.
    _keep(arrays, "fit_generator/plain", _plain_fit(keras))
    model = build()
    kpipe.fit_generator(model, generator=Batches(), steps_per_epoch=STEPS, epochs=EPOCHS, shuffle=False,
                        workers=2, use_multiprocessing=True, verbose=0)
    _keep(arrays, "fit_generator/kpipe", model.get_weights())

    # Warmup: the same ramp on plain Keras input and on a ProcessLoader.
    rates = {}
    for name in ("plain", "kpipe"):
        model, seen = build(), []
        callbacks = [kpipe.callbacks.Warmup(steps=6, initial_lr=0.005), RateRecorder(seen)]
        if name == "plain":
            model.fit(Batches(), epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
        else:
            with _loader(Batches()) as data:
                model.fit(data, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
        _keep(arrays, f"warmup/{name}", model.get_weights())
        rates[name] = seen
    record["warmup/rates"] = rates

    # InputProfiler: a slow loader (one worker, 20 ms a batch) measured per step.
    model = build()
    profiler = kpipe.callbacks.InputProfiler(warn_above=None)
    with _loader(Batches(delay=0.02), workers=1) as data:
        h = model.fit(data, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[profiler])
    _keep(arrays, "profiler/plain", _plain_fit(keras))
    _keep(arrays, "profiler/kpipe", model.get_weights())
    steps = profiler.steps
    record["profiler/history"] = {k: h.history[k] for k in ("input_wait_share", "steps_per_sec", "samples_per_sec")}
    record["profiler/steps"] = int(steps.steps.sum())
    record["profiler/samples"] = steps.samples.tolist()
    record["profiler/wait_s"] = steps.wait_s.tolist()
    record["profiler/queue_depth_known"] = bool(np.isfinite(steps.queue_depth).all())
    record["profiler/kind"] = list(profiler._input_kind)
    record["profiler/train_function_restored"] = type(model.train_function).__name__ != "StepTimer"
    path = os.path.join(out, "timeline.png")
    try:
        profiler.plot(path)
        record["profiler/plot"] = path
    except ImportError:  # matplotlib (kpipe[plot]) not installed
        record["profiler/plot"] = None

    # BackupAndRestore: the uninterrupted run, and a run that crashes mid-epoch 1.
    model = build(dropout=True)
    _backup_fit(model, os.path.join(out, "backup-full"))
    _keep(arrays, "backup/full", model.get_weights())
    _backup_fit(build(dropout=True), os.path.join(out, "backup"), crash=CRASH_AT)

    # TensorFlow-only names: a named error that says what to use instead.
    errors = {}
    for name in ("auto_strategy", "MultiWorkerMirroredStrategy", "ps_fit", "pipeline_model"):
        try:
            getattr(kpipe.distribute, name)
        except kpipe.UnsupportedBackendError as e:
            errors[name] = str(e)
    record["tf_only_errors"] = errors

    # The hand-over: a batch made a backend tensor (on torch, `torch.as_tensor`: a view of the
    # slot) is kept while the loader goes on through more batches than it has slots in flight.
    with _loader(Batches(), workers=1, max_queue_size=2) as data:
        batches = iter(data)
        first = next(batches)[0]
        expected = first.copy()
        if keras.backend.backend() == "torch":
            import torch

            kept = torch.as_tensor(first)  # no copy: the tensor views the batch's slot
            record["handover/aliases"] = kept.data_ptr() == first.__array_interface__["data"][0]
        else:
            kept = keras.ops.convert_to_tensor(first)
            record["handover/aliases"] = None
        del first
        later = [np.asarray(x).copy() for x, _ in batches]
        record["handover/kept_equal"] = bool(np.array_equal(keras.ops.convert_to_numpy(kept), expected))
        record["handover/later_equal"] = all(np.array_equal(b, _data()[0][(i + 1) * BATCH:(i + 2) * BATCH])
                                             for i, b in enumerate(later))
        record["handover/batches"] = 1 + len(later)
        del kept

    # Loader workers: no TensorFlow there either.
    with _loader(WorkerModules(), workers=1) as data:
        record["tf_in_worker"] = [bool(data[i][0][0, 0]) for i in range(2)]
    record["tf_after_loading"] = "tensorflow" in sys.modules

    # kpipe.data (tf.data, so TensorFlow from here on) given to fit().
    plain = build()
    plain.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    _keep(arrays, "data/plain", plain.get_weights())
    model = build()
    model.fit(kpipe.data.pipeline(kpipe.data.from_numpy(x, y), batch_size=BATCH), epochs=EPOCHS, verbose=0)
    _keep(arrays, "data/kpipe", model.get_weights())


def _plain_fit(keras):
    model = build()
    model.fit(Batches(), epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


def resume(out, arrays, record):
    model = build(dropout=True)
    backup = _backup_fit(model, os.path.join(out, "..", "first", "backup"))
    _keep(arrays, "backup/resumed", model.get_weights())
    record["restored_epoch"], record["restored_step"] = backup.restored_epoch, backup.restored_step


def dataparallel(out, arrays, record):
    """One device against `keras.distribution.DataParallel` over the host's devices, both
    fed by a ProcessLoader: the losses of each epoch and the final weights."""
    import jax

    record["devices"] = len(jax.devices())
    for name in ("one_device", "data_parallel"):
        if name == "data_parallel":
            keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
        model = build()
        with _loader(Batches()) as data:
            h = model.fit(data, epochs=EPOCHS, shuffle=False, verbose=0)
        record[f"{name}/loss"] = h.history["loss"]
        _keep(arrays, name, model.get_weights())


def multiprocess(out, arrays, record, process_id, port):
    """One of two JAX processes (`jax.distributed.initialize` on 127.0.0.1), each feeding
    its shard of every pass through `ProcessLoader(num_shards=2, shard_index=process_id)`
    to `keras.distribution.DataParallel` over both processes' devices; process 0 then trains
    the one-process reference on the global batches (16 = the two shards' batches 2k, 2k+1)."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=120)
    record["processes"], record["devices"] = jax.process_count(), len(jax.devices())
    distribution = keras.distribution.DataParallel(devices=jax.devices())
    distribution.auto_shard_dataset = False  # each process loads its own shard
    keras.distribution.set_distribution(distribution)
    model = build()
    with _loader(Batches(), workers=1, num_shards=2, shard_index=process_id) as data:
        record["multiprocess/loss"] = model.fit(data, epochs=EPOCHS, shuffle=False, verbose=0).history["loss"]
    _keep(arrays, "multiprocess", model.get_weights())
    if process_id == 0:
        keras.distribution.set_distribution(None)
        model = build()
        x, y = _data()
        record["one_process/loss"] = model.fit(x, y, batch_size=2 * BATCH, epochs=EPOCHS, shuffle=False,
                                               verbose=0).history["loss"]
        _keep(arrays, "one_process", model.get_weights())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", choices=["first", "resume", "dataparallel", "multiprocess"], required=True)
    parser.add_argument("--process-id", type=int, default=0, help="multiprocess: this process's index (0 or 1)")
    parser.add_argument("--port", type=int, default=0, help="multiprocess: the coordinator's port on 127.0.0.1")
    args = parser.parse_args(argv)
    out = os.path.join(args.out, args.phase)
    os.makedirs(out, exist_ok=True)
    record, arrays = {}, {}
    if args.phase == "multiprocess":
        multiprocess(out, arrays, record, args.process_id, args.port)
    else:
        {"first": first, "resume": resume, "dataparallel": dataparallel}[args.phase](out, arrays, record)
    _outputs.write(out, args.process_id, record, arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
