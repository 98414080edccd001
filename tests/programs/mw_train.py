"""Worker program of the multi-worker tests: run it under `kpipe launch` (one copy per worker).

Each copy trains small models under `kpipe.distribute.auto_strategy()` on several input
kinds and writes what the tests compare to `--out/worker<i>.npz` (weights, predictions)
and `--out/worker<i>.json` (histories, learning rates, batches loaded, errors). With
`--reference`, the chief then trains the same models in one process without a strategy.

Scenarios (`--scenario`):
  main   fit/evaluate/predict with tf.data (auto-sharded), presharded PyDataset, presharded
         tf.data and sharded ProcessLoader input, then NumPy arrays; class_weight, validation_data, Warmup;
         steps_per_execution 2 and 3 (3 leaves a partial execution at each epoch's end) with
         tf.data of known and unknown length and a ProcessLoader; then the error cases
         (unseeded shuffle, Keras's in-graph steps loop called directly).
  stock  fit with the stock tf.distribute.MultiWorkerMirroredStrategy (expected to fail).
  resume fit with BackupAndRestore in per-worker directories; `--kill-at-epoch E` makes
         worker 1 SIGKILL itself during epoch E, after the previous epoch was saved.
"""

import argparse
import json
import os
import signal
import sys

import numpy as np

N_SAMPLES = 64
GLOBAL_BATCH = 16
FEATURES = 4
CLASS_WEIGHT = {0: 2.0, 1: 1.0}
BASE_LR = 0.05
WARMUP_STEPS = 3
INITIAL_LR = 0.01


def make_data(n=N_SAMPLES, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.rand(n, FEATURES).astype("float32")
    y = (x[:, 0] + x[:, 1] > 1.0).astype("int32")
    return x, y


def build_model(keras, initial_weights=None):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2)])
    if initial_weights is not None:
        model.set_weights(initial_weights)
    return model


def compile_model(keras, model, steps_per_execution=1):
    model.compile(keras.optimizers.SGD(BASE_LR, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=steps_per_execution)


class ShardedBatches:
    """A PyDataset serving batches `shard, shard + num_shards, ...` of contiguous batches."""

    def __new__(cls, *args, **kwargs):
        import keras

        class _Impl(keras.utils.PyDataset):
            def __init__(self, x, y, batch_size, num_shards, shard_index):
                super().__init__()
                self.x, self.y, self.batch_size = x, y, batch_size
                self.num_shards, self.shard_index = num_shards, shard_index
                self.loaded = []

            def __len__(self):
                return (len(self.x) // self.batch_size) // self.num_shards

            def __getitem__(self, i):
                b = i * self.num_shards + self.shard_index
                self.loaded.append(b)
                sl = slice(b * self.batch_size, (b + 1) * self.batch_size)
                return self.x[sl], self.y[sl]

        return _Impl(*args, **kwargs)


class ContiguousBatches:
    """Batch `i` holds samples `[i * batch_size, (i + 1) * batch_size)`; no TensorFlow."""

    def __init__(self, x, y, batch_size):
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return len(self.x) // self.batch_size

    def __getitem__(self, i):
        sl = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[sl], self.y[sl]


class LrRecorder:
    def __new__(cls):
        import keras

        class _Impl(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.rates = []

            def on_train_batch_begin(self, batch, logs=None):
                lr = self.model.optimizer.learning_rate
                self.rates.append(float(keras.ops.convert_to_numpy(lr)))

        return _Impl()


STEPS_PER_EXECUTION = (2, 3)  # 4 global batches per epoch: 3 ends each epoch mid-execution
SPE_INPUTS = ("tfdata", "tfdata_unknown_length", "loader")


def train(keras, kpipe, strategy, make_input, initial, epochs, extra_callbacks=(), steps_per_execution=1):
    with strategy.scope():
        model = build_model(keras, initial)
        compile_model(keras, model, steps_per_execution)
    recorder = LrRecorder()
    warmup = kpipe.callbacks.Warmup(steps=WARMUP_STEPS, initial_lr=INITIAL_LR)
    x_val, y_val = make_data(32, seed=1)
    history = model.fit(make_input(), epochs=epochs, verbose=0, class_weight=CLASS_WEIGHT,
                        validation_data=(x_val, y_val), validation_batch_size=GLOBAL_BATCH,
                        shuffle=False, callbacks=[warmup, recorder, *extra_callbacks])
    return model, {"history": history.history, "lr": recorder.rates}


def scenario_main(args, keras, kpipe, tf, strategy, info, out):
    x, y = make_data()
    num_workers, rank = info.num_workers, info.worker_index
    per_worker = GLOBAL_BATCH // num_workers
    initial = build_model(keras).get_weights()
    results, arrays = {}, {}

    def numpy_input():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)

    pydatasets = []

    def pydataset_input():
        pydatasets.append(ShardedBatches(x, y, per_worker, num_workers, rank))
        return pydatasets[-1]

    def tfdata_presharded_input():
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(num_workers, rank).batch(per_worker)
        return kpipe.distribute.mark_presharded(ds)

    loaders = []

    def loader_input():  # sharded by TF_CONFIG: kpipe.distribute.default_shard()
        loaders.append(kpipe.ProcessLoader(ContiguousBatches(x, y, per_worker), workers=1))
        return loaders[-1]

    inputs = {"tfdata": numpy_input, "pydataset": pydataset_input,
              "tfdata_presharded": tfdata_presharded_input, "loader": loader_input}
    def fit_and_record(name, strategy, make_input, steps_per_execution=1, eval_input=None):
        model, record = train(keras, kpipe, strategy, make_input, initial, args.epochs,
                              steps_per_execution=steps_per_execution)
        if eval_input is None:
            record["evaluate"] = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
            predictions = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
        else:  # the same input type for evaluate() and predict() too
            record["evaluate"] = model.evaluate(eval_input(), verbose=0)
            predictions = model.predict(eval_input(), verbose=0)
        for i, w in enumerate(model.get_weights()):
            arrays[f"{name}/w{i}"] = w
        arrays[f"{name}/predict"] = predictions
        results[name] = record

    for name, make_input in inputs.items():
        fit_and_record(name, strategy, make_input)

    # steps_per_execution > 1 under multi-worker training (kpipe/distribute/_strategy.py).
    def unknown_length_input():
        return numpy_input().filter(lambda a, b: True)

    spe_inputs = {"tfdata": numpy_input, "tfdata_unknown_length": unknown_length_input,
                  "loader": loader_input}
    for spe in STEPS_PER_EXECUTION:
        for name in SPE_INPUTS:
            eval_input = None if name == "loader" else spe_inputs[name]
            fit_and_record(f"spe{spe}/{name}", strategy, spe_inputs[name], spe, eval_input)
    results["pydataset"]["loaded"] = pydatasets[0].loaded
    results["pydataset"]["len"] = len(pydatasets[0])
    with loaders[0]:
        results["loader"]["presharded"] = kpipe.distribute.is_presharded(loaders[0])
        results["loader"]["shard"] = [getattr(loaders[0], "num_shards", None),
                                      getattr(loaders[0], "shard_index", None)]
        results["loader"]["len"] = len(loaders[0])
        results["loader"]["stats_batches"] = loaders[0].stats()["batches"]
    for loader in loaders[1:]:
        loader.close()

    # NumPy arrays straight into fit(): Keras shuffles them unless told otherwise.
    with strategy.scope():
        model = build_model(keras, initial)
        compile_model(keras, model)
    model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False)
    results["numpy_arrays_fit"] = "ok"

    if args.reference and info.is_chief:  # plain Keras in one process, the same global batch
        one_process = tf.distribute.get_strategy()

        def reference_input():
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)

        def unknown_length_reference():
            return reference_input().filter(lambda a, b: True)

        fit_and_record("reference", one_process, reference_input)
        for spe in STEPS_PER_EXECUTION:  # per length: Keras counts steps differently without one
            fit_and_record(f"spe{spe}/reference", one_process, reference_input, spe, reference_input)
            fit_and_record(f"spe{spe}/reference_unknown_length", one_process,
                           unknown_length_reference, spe, unknown_length_reference)

    # Error cases, after everything else: both raise before any collective runs.
    results["errors"] = {}
    tf.random.set_seed(None)  # forget the global seed: Keras's shuffle is now unseeded
    with strategy.scope():
        model = build_model(keras, initial)
        compile_model(keras, model)
    tf.random.set_seed(None)
    results["errors"]["unseeded_shuffle"] = _error_of(
        lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=True))
    results["errors"]["steps_per_execution"] = None
    from kpipe import _compat

    if _compat.keras_at_least(_compat.KERAS_STEPS_PER_EXECUTION_IN_GRAPH):
        # Keras's in-graph loop of steps, called directly (fit() does not go there).
        with strategy.scope():
            model = build_model(keras, initial)
            compile_model(keras, model, steps_per_execution=2)
        model.make_train_function()
        distributed = strategy.experimental_distribute_dataset(numpy_input())
        results["errors"]["steps_per_execution"] = _error_of(
            lambda: model.train_function(iter(distributed)))
    write(out, info, results, arrays)


def scenario_stock(args, keras, kpipe, tf, strategy, info, out):
    x, y = make_data()
    with strategy.scope():
        model = build_model(keras)
        compile_model(keras, model)
    results = {"stock_fit": _error_of(
        lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, verbose=0, shuffle=False))}
    write(out, info, results, {})


def scenario_resume(args, keras, kpipe, tf, strategy, info, out):
    x, y = make_data()
    initial = build_model(keras).get_weights()
    callbacks = kpipe.distribute.chief_only(
        keras.callbacks.BackupAndRestore(args.backup, delete_checkpoint=False),
        keras.callbacks.ModelCheckpoint(os.path.join(out, "ckpt", "model-{epoch}.keras")),
        keras.callbacks.CSVLogger(os.path.join(out, "log.csv")))
    epochs_run = []

    class Progress(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            epochs_run.append(epoch)

        def on_train_batch_end(self, batch, logs=None):
            # Step 1 of an epoch ran a collective with every worker, so all of them have
            # finished saving the previous epoch: kill one worker here.
            if args.kill_at_epoch == epochs_run[-1] and batch == 1 and info.worker_index == 1:
                os.kill(os.getpid(), signal.SIGKILL)

    def numpy_input():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)

    model, record = train(keras, kpipe, strategy, numpy_input, initial, args.epochs,
                          extra_callbacks=[*callbacks, Progress()])
    record["epochs_run"] = epochs_run
    record["backup_dir"] = callbacks[0].backup_dir
    record["checkpoint"] = callbacks[1].filepath
    record["csv"] = callbacks[2].filename
    record["saved"] = kpipe.distribute.chief_path(os.path.join(out, "final.keras"))
    model.save(record["saved"])
    arrays = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    write(out, info, {"resume": record}, arrays)


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the tests read type and message
        return {"type": type(e).__name__, "message": str(e)[:2000]}
    return None


def write(out, info, results, arrays):
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"worker{info.worker_index}")
    np.savez(stem + ".npz", **arrays)
    with open(stem + ".json.tmp", "w") as f:
        json.dump(results, f, default=float)
    os.replace(stem + ".json.tmp", stem + ".json")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", choices=["main", "stock", "resume"], default="main")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--backup")
    parser.add_argument("--kill-at-epoch", type=int)
    args = parser.parse_args(argv)

    import kpipe
    import kpipe.distribute

    info = kpipe.distribute.cluster_info()
    os.makedirs(args.out, exist_ok=True)
    import tensorflow as tf

    if args.scenario == "stock":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = kpipe.distribute.auto_strategy(communication="ring")
    import keras
    import kpipe.callbacks

    keras.utils.set_random_seed(0)
    scenario = {"main": scenario_main, "stock": scenario_stock, "resume": scenario_resume}
    scenario[args.scenario](args, keras, kpipe, tf, strategy, info, args.out)
    print(f"worker {info.worker_index}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    status = main()
    import _outputs

    _outputs.leave(status)
