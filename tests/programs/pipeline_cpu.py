"""Pipeline stages on 3 logical CPU devices vs the unsplit model: `python pipeline_cpu.py OUT.json`.

Must run in a fresh process: the logical devices are configured before TensorFlow
initialises. Runs every check of `tests/test_distribute_pipeline.py` in this one process
(TensorFlow starts once) and writes one JSON object, `{check: result}`; a check that raises
records `{"error": traceback}` and the others still run.
"""

import json
import os
import re
import sys
import tempfile
import traceback
import warnings

import numpy as np

from mw_train import ContiguousBatches  # TF-free; loader workers import it from this folder

DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2"]
N, BATCH, EPOCHS = 90, 22, 3  # 4 batches of 22 and one of 2: not divisible by M = 4


def main(argv=None):
    out = (sys.argv[1:] if argv is None else argv)[0]
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * len(DEVICES))
    import keras

    import kpipe
    import kpipe.distribute as kd

    L = keras.layers
    rng = np.random.default_rng(0)
    images = rng.normal(size=(N, 8, 8, 1)).astype("float32")
    labels = rng.integers(0, 3, N).astype("int32")

    def conv_net(seed=0):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((8, 8, 1), name="img")
        x = L.Conv2D(4, 3, activation="relu", name="conv")(inputs)
        x = L.Flatten(name="flat")(x)
        x = L.Dense(16, activation="relu", name="hidden")(x)
        x = L.Dense(8, activation="tanh", name="hidden2")(x)
        return keras.Model(inputs, L.Dense(3, name="logits")(x), name="net")

    def residual_net():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,), name="x")
        a = L.Dense(6, activation="relu", name="block_in")(inputs)
        b = L.Dense(6, activation="relu", name="branch")(a)
        c = L.Add(name="join")([a, b])
        d = L.Dense(32, activation="relu", name="wide")(c)
        return keras.Model(inputs, L.Dense(1, name="head")(d), name="resnet")

    def compile_(model):
        model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    def fit(model, data=None, **kw):
        kw = {"batch_size": BATCH, **kw} if data is None else kw
        history = model.fit(*(data if isinstance(data, tuple) else (data,)) if data is not None else (images, labels),
                            epochs=EPOCHS, verbose=0, shuffle=False, **kw)
        return history.history

    results = {}

    def check(fn):
        try:
            results[fn.__name__] = fn()
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            results[fn.__name__] = {"error": traceback.format_exc()[-4000:]}
        return fn

    base = compile_(conv_net())
    base_hist = fit(base)
    trained = {}

    @check
    def loss_equal():
        rows = []
        for devices, split_at, m in [(DEVICES[:2], "flat", 1), (DEVICES[:2], "flat", 2), (DEVICES[:2], "flat", 4),
                                     (DEVICES, None, 4)]:
            piped = compile_(kd.pipeline_model(conv_net(), devices, split_at=split_at, num_microbatches=m))
            hist = fit(piped)
            trained[(len(devices), m)] = piped
            rows.append({"stages": len(devices), "microbatches": m, "loss": hist["loss"],
                         "accuracy": hist["accuracy"], "split": [list(s.layer_names) for s in piped.stages],
                         "max_weight_diff": max(float(np.abs(a - b).max())
                                                for a, b in zip(piped.get_weights(), base.get_weights()))})
        return {"unsplit_loss": base_hist["loss"], "unsplit_accuracy": base_hist["accuracy"], "runs": rows}

    @check
    def placement():
        piped = trained[(3, 4)]
        var_devices = [[tf.DeviceSpec.from_string(v.value.device).device_index for v in s.model.weights]
                       for s in piped.stages]
        by_var = {id(v): k for k, s in enumerate(piped.stages) for v in s.model.trainable_variables}
        slots = {}
        for v in piped.optimizer.variables:
            for var in piped.trainable_variables:
                if v.path.endswith(var.path.replace("/", "_") + "_momentum") or \
                        v.path.endswith(var.path.replace("/", "_") + "_velocity"):
                    slots.setdefault(str(by_var[id(var)]), []).append(
                        tf.DeviceSpec.from_string(v.value.device).device_index)
        spec = (tf.TensorSpec((None, 8, 8, 1), tf.float32), tf.TensorSpec((None,), tf.int32))
        graph = tf.function(piped.train_step).get_concrete_function(spec).graph
        # Forward ops of stage k are named pipeline_stage_<k>/..., their gradients
        # gradient_tape/pipeline_stage_<k>/...; the optimizer's ops <optimizer name>/...
        # Ops without a requested device are recorded by type (resource reads and
        # placeholders follow their variable's device).
        groups = {}
        for op in graph.get_operations():
            match = re.match(r"(gradient_tape/)?pipeline_stage_(\d+)(_\d+)?/", op.name)
            if match:
                key = f"{match.group(2)}/{'backward' if match.group(1) else 'forward'}"
            elif op.name.startswith(piped.optimizer.name + "/"):
                key = "optimizer"
            else:
                continue
            entry = groups.setdefault(key, {"ops": 0, "devices": {}, "types": set(), "unplaced_types": set(),
                                            "microbatches": set()})
            entry["ops"] += 1
            entry["microbatches"].add(match.group(3) if match else None)
            if op.device:
                index = str(tf.DeviceSpec.from_string(op.device).device_index)
                entry["devices"][index] = entry["devices"].get(index, 0) + 1
                entry["types"].add(op.type)
            else:
                entry["unplaced_types"].add(op.type)
        return {
            "var_devices": var_devices, "slot_devices": slots,
            "vars_per_stage": [len(s.model.trainable_variables) for s in piped.stages],
            "graph": {k: {"ops": v["ops"], "devices": v["devices"], "types": sorted(v["types"]),
                          "unplaced_types": sorted(v["unplaced_types"]), "microbatches": len(v["microbatches"])}
                      for k, v in groups.items()},
        }

    @check
    def class_weight_and_callback():
        class_weight = {0: 1.0, 1: 3.0, 2: 0.5}

        class Recorder(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.batches, self.epoch_losses = 0, []

            def on_train_batch_end(self, batch, logs=None):
                self.batches += 1

            def on_epoch_end(self, epoch, logs=None):
                self.epoch_losses.append(float(logs["loss"]))

        unsplit = fit(compile_(conv_net()), class_weight=class_weight)
        recorder = Recorder()
        piped = compile_(kd.pipeline_model(conv_net(), DEVICES[:2], split_at="hidden", num_microbatches=3))
        hist = fit(piped, class_weight=class_weight, callbacks=[recorder])
        return {"unsplit_loss": unsplit["loss"], "loss": hist["loss"], "plain_loss": base_hist["loss"],
                "callback_batches": recorder.batches, "callback_losses": recorder.epoch_losses}

    @check
    def inputs():
        batches = ContiguousBatches(images, labels, BATCH)  # 4 batches of 22
        unsplit = fit(compile_(conv_net()), keras_dataset(keras, batches))
        piped = compile_(kd.pipeline_model(conv_net(), DEVICES[:2], split_at="flat", num_microbatches=4))
        with kpipe.ProcessLoader(batches, workers=2) as loader:
            loader_hist = fit(piped, loader)
        piped = compile_(kd.pipeline_model(conv_net(), DEVICES[:2], split_at="flat", num_microbatches=4))
        dataset = tf.data.Dataset.from_tensor_slices((images[:88], labels[:88])).batch(BATCH)
        tfdata_hist = fit(piped, dataset)
        return {"unsplit_loss": unsplit["loss"], "loader_loss": loader_hist["loss"], "tfdata_loss": tfdata_hist["loss"]}

    @check
    def predict_evaluate():
        piped = trained[(2, 4)]
        unsplit = compile_(conv_net(seed=5))
        unsplit.set_weights(piped.get_weights())
        return {
            "predict_diff": float(np.abs(piped.predict(images, batch_size=BATCH, verbose=0)
                                         - unsplit.predict(images, batch_size=BATCH, verbose=0)).max()),
            "evaluate": piped.evaluate(images, labels, batch_size=BATCH, verbose=0),
            "evaluate_unsplit": unsplit.evaluate(images, labels, batch_size=BATCH, verbose=0),
            "call_diff": float(np.abs(np.asarray(piped(images[:5])) - np.asarray(unsplit(images[:5]))).max()),
        }

    @check
    def weights_interchangeable():
        import h5py

        piped = trained[(3, 4)]
        tmp = tempfile.mkdtemp(prefix="kpipe-pipe-")

        def paths(path):
            with h5py.File(path, "r") as f:
                found = []
                f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
                return sorted(found)

        piped.save_weights(os.path.join(tmp, "piped.weights.h5"))
        unsplit = conv_net(seed=7)
        unsplit.load_weights(os.path.join(tmp, "piped.weights.h5"))
        forward = max(float(np.abs(a - b).max()) for a, b in zip(unsplit.get_weights(), piped.get_weights()))
        base.save_weights(os.path.join(tmp, "base.weights.h5"))
        other = kd.pipeline_model(conv_net(seed=8), DEVICES, num_microbatches=2)
        other.load_weights(os.path.join(tmp, "base.weights.h5"))
        back = max(float(np.abs(a - b).max()) for a, b in zip(other.get_weights(), base.get_weights()))
        return {
            "pipeline_to_unsplit_diff": forward, "unsplit_to_pipeline_diff": back,
            "paths_equal": paths(os.path.join(tmp, "piped.weights.h5")) == paths(os.path.join(tmp, "base.weights.h5")),
            "n_paths": len(paths(os.path.join(tmp, "base.weights.h5"))),
            "layer_names": [l.name for l in piped.layers] == [l.name for l in base.layers],
            "weight_shapes": [w.shape for w in piped.get_weights()] == [w.shape for w in base.get_weights()],
            "loaded_devices": [tf.DeviceSpec.from_string(v.value.device).device_index for v in other.weights],
        }

    @check
    def sequential_three_stages():
        def seq():
            keras.utils.set_random_seed(1)
            return keras.Sequential([keras.Input((5,)), L.Dense(8, activation="relu", name="s1"),
                                     L.Dense(8, activation="relu", name="s2", kernel_regularizer=keras.regularizers.L2(0.01)), L.Dense(4, activation="relu", name="s3"),
                                     L.Dense(1, name="s4")], name="seq")

        x = rng.normal(size=(40, 5)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        unsplit = seq()
        unsplit.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
        piped = kd.pipeline_model(seq(), DEVICES, split_at=["s1", "s3"], num_microbatches=2)
        piped.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
        a = unsplit.fit(x, y, batch_size=16, epochs=EPOCHS, verbose=0, shuffle=False).history["loss"]
        b = piped.fit(x, y, batch_size=16, epochs=EPOCHS, verbose=0, shuffle=False).history["loss"]
        return {"unsplit_loss": a, "loss": b, "split": [list(s.layer_names) for s in piped.stages],
                "devices": list(piped.stage_devices)}

    @check
    def balanced_split():
        piped = kd.pipeline_model(residual_net(), DEVICES[:2], split_at=None, num_microbatches=2)
        return {"split": [list(s.layer_names) for s in piped.stages], "params": [s.params for s in piped.stages]}

    def error_of(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the test reads type and message
            return {"type": type(e).__name__, "message": str(e)}
        return {"type": None, "message": "no error raised"}

    @check
    def errors():
        resnet = residual_net()
        mirrored = tf.distribute.MirroredStrategy(DEVICES[:2])

        def fit_under_strategy():
            piped = compile_(kd.pipeline_model(conv_net(), DEVICES[:2], num_microbatches=2))
            with mirrored.scope():
                piped.fit(images, labels, batch_size=BATCH, epochs=1, verbose=0)

        def build_under_strategy():
            with mirrored.scope():
                kd.pipeline_model(conv_net(), DEVICES[:2])

        return {
            "skip_connection": error_of(lambda: kd.pipeline_model(resnet, DEVICES[:2], split_at="branch")),
            "unknown_layer": error_of(lambda: kd.pipeline_model(resnet, DEVICES[:2], split_at="nope")),
            "wrong_count": error_of(lambda: kd.pipeline_model(resnet, DEVICES, split_at="join")),
            "out_of_order": error_of(lambda: kd.pipeline_model(resnet, DEVICES, split_at=["wide", "join"])),
            "input_layer": error_of(lambda: kd.pipeline_model(resnet, DEVICES[:2], split_at="x")),
            "last_layer": error_of(lambda: kd.pipeline_model(resnet, DEVICES[:2], split_at="head")),
            "missing_device": error_of(lambda: kd.pipeline_model(resnet, ["/cpu:0", "/cpu:7"])),
            "gpu_device": error_of(lambda: kd.pipeline_model(resnet, ["/cpu:0", "/gpu:0"])),
            "no_devices": error_of(lambda: kd.pipeline_model(resnet, [])),
            "device_string": error_of(lambda: kd.pipeline_model(resnet, "/cpu:0")),
            "microbatches_zero": error_of(lambda: kd.pipeline_model(resnet, DEVICES[:2], num_microbatches=0)),
            "microbatches_bool": error_of(lambda: kd.pipeline_model(resnet, DEVICES[:2], num_microbatches=True)),
            "microbatches_float": error_of(lambda: kd.pipeline_model(resnet, DEVICES[:2], num_microbatches=2.0)),
            "too_many_stages": error_of(lambda: kd.pipeline_model(
                keras.Sequential([keras.Input((3,)), L.Dense(2), L.Dense(1)]), DEVICES)),
            "subclassed": error_of(lambda: kd.pipeline_model(L.Dense(2), DEVICES[:2])),
            "jit_compile": error_of(lambda: kd.pipeline_model(resnet, DEVICES[:2]).compile("sgd", "mse", jit_compile=True)),
            "build_under_strategy": error_of(build_under_strategy),
            "fit_under_strategy": error_of(fit_under_strategy),
        }

    @check
    def batchnorm_warning():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), L.Dense(8, name="d"), L.BatchNormalization(name="bn"),
                                  L.Dense(1, name="o")])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            piped = kd.pipeline_model(model, DEVICES[:2], split_at="bn", num_microbatches=2)
        with warnings.catch_warnings(record=True) as quiet:
            warnings.simplefilter("always")
            kd.pipeline_model(model, DEVICES[:2], split_at="bn", num_microbatches=1)
        piped.compile("sgd", "mse")
        # 17 rows in batches of 8: the last batch (1 row) is smaller than M = 2
        loss = piped.fit(rng.normal(size=(17, 4)), rng.normal(size=(17, 1)), batch_size=8, verbose=0).history["loss"]
        return {"warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)],
                "warning_files": [os.path.basename(w.filename) for w in caught if issubclass(w.category, UserWarning)],
                "quiet": [str(w.message) for w in quiet if "BatchNormalization" in str(w.message)],
                "loss": loss, "weights_finite": all(bool(np.isfinite(w).all()) for w in piped.get_weights())}

    with open(out, "w") as f:
        json.dump(results, f, default=str)
    return 0


def keras_dataset(keras, batches):
    """`batches` as a plain `keras.utils.PyDataset` (the unsplit run's input)."""

    class Plain(keras.utils.PyDataset):
        def __len__(self):
            return len(batches)

        def __getitem__(self, i):
            return batches[i]

    return Plain()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
