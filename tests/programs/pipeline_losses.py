"""Pipeline stages vs the unsplit model for the heads and losses users write:
`python pipeline_losses.py OUT.json [PART,PART...]` (default: every part).

Must run in a fresh process (3 logical CPU devices are configured before TensorFlow
initialises). Each case trains the unsplit model and the pipeline model from the same
weights on the same batches (shuffle=False) and records per-epoch losses and metrics,
the largest weight difference, how far the weights moved and `evaluate()`; the checks
of `tests/test_distribute_pipeline_losses.py` read the JSON object written, `{part:
result}` (a part that raises records `{"error": traceback}`, the others still run).

Parts:
  heads   softmax/sigmoid/logits/linear heads with the losses, metrics, class weights,
          regularizers and outputs users write, each at (2 stages, M=1) and (3, M=4).
  menu    every loss class `keras.losses` exports, with a head and targets that fit it
          (RECIPES), at (2, M=1) and (3, M=4); a class without a recipe is reported.
  eager   `run_eagerly=True`.
  checks  the losses the pipeline cannot back-propagate get `PipelineGradientError`
          (`add_loss` in a layer, a loss reading a stage's tensor by a side channel), a
          stage tensor read under `stop_gradient` does not; the op types Keras's
          crossentropies read through.
"""

import importlib
import inspect
import json
import re
import sys
import traceback

import numpy as np

DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2"]
N, BATCH, EPOCHS, FEATURES, CLASSES, T = 48, 16, 2, 6, 3, 6
CONFIGS = [(2, 1), (3, 4)]  # (stages, micro-batches); the first head also runs at (2, 4)

# Loss class -> (head, target kind, constructor kwargs, SGD learning rate): what `menu`
# trains it with (MAPE's and Circle's gradients are ~100x the others').
# head: "softmax"/"sigmoid"/"tanh"/"softplus" (a Dense activation), "linear", "unit" (an
# L2-normalised embedding), "sequence" (per-time-step logits for CTC); units from `UNITS`.
RECIPES = {
    "BinaryCrossentropy": ("sigmoid", "binary", {}, 0.1),
    "BinaryFocalCrossentropy": ("sigmoid", "binary", {}, 0.1),
    "CTC": ("sequence", "ctc", {}, 0.1),
    "CategoricalCrossentropy": ("softmax", "onehot", {}, 0.1),
    "CategoricalFocalCrossentropy": ("softmax", "onehot", {}, 0.1),
    "CategoricalGeneralizedCrossEntropy": ("softmax", "sparse", {}, 0.1),
    "CategoricalHinge": ("linear", "onehot", {}, 0.1),
    "Circle": ("unit", "sparse", {}, 0.001),
    "CosineSimilarity": ("linear", "vectors", {}, 0.1),
    "Dice": ("sigmoid", "binary", {}, 0.1),
    "Hinge": ("tanh", "signs", {}, 0.1),
    "Huber": ("linear", "regression", {}, 0.1),
    "KLDivergence": ("softmax", "distribution", {}, 0.1),
    "LogCosh": ("linear", "regression", {}, 0.1),
    "MeanAbsoluteError": ("linear", "regression", {}, 0.1),
    "MeanAbsolutePercentageError": ("linear", "positive", {}, 0.001),
    "MeanSquaredError": ("linear", "regression", {}, 0.1),
    "MeanSquaredLogarithmicError": ("softplus", "positive", {}, 0.1),
    "Poisson": ("softplus", "counts", {}, 0.1),
    "SparseCategoricalCrossentropy": ("softmax", "sparse", {}, 0.1),
    "SquaredHinge": ("tanh", "signs", {}, 0.1),
    "Tversky": ("sigmoid", "binary", {}, 0.1),
}
UNITS = {"binary": 1, "signs": 1, "regression": 1, "positive": 1, "counts": 1, "onehot": CLASSES,
         "sparse": CLASSES, "distribution": CLASSES, "vectors": CLASSES, "ctc": 5}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    out = argv[0]
    wanted = set(argv[1].split(",")) if len(argv) > 1 else None  # the parts to run (default: all)
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * len(DEVICES))
    import keras

    import kpipe.distribute as kd

    L = keras.layers
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    labels = ((x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5)).astype("int32")
    targets = {
        "sparse": labels,
        "onehot": np.eye(CLASSES, dtype="float32")[labels],
        "binary": (x[:, 2] > 0).astype("float32")[:, None],
        "signs": np.where(x[:, 2] > 0, 1.0, -1.0).astype("float32")[:, None],
        "regression": (x[:, :3].sum(axis=1, keepdims=True) + 0.1).astype("float32"),
        "positive": (np.abs(x[:, :3].sum(axis=1, keepdims=True)) + 1.0).astype("float32"),
        "counts": rng.poisson(2.0, size=(N, 1)).astype("float32"),
        "distribution": rng.dirichlet(np.ones(CLASSES), size=N).astype("float32"),
        "vectors": rng.normal(size=(N, CLASSES)).astype("float32"),
        "ctc": rng.integers(1, UNITS["ctc"], size=(N, 3)).astype("int32"),
    }
    sequences = rng.normal(size=(N, T, FEATURES)).astype("float32")

    class RawSoftmax(L.Layer):
        """Ends a model in `tf.nn.softmax` (no `_keras_logits`): Keras's loss reads `op.inputs[0]`."""

        def call(self, inputs):
            return tf.nn.softmax(inputs)

    class Penalized(L.Dense):
        """A Dense layer that adds an activity penalty with `add_loss` in `call`."""

        def call(self, inputs):
            outputs = super().call(inputs)
            self.add_loss(0.01 * tf.reduce_mean(outputs ** 2))
            return outputs

    class Remember(L.Layer):
        """Passes its input through and keeps it on the layer (a side channel to the loss)."""

        def call(self, inputs):
            self.seen = inputs
            return inputs

    def dense_net(head, units, seed=0, regularizer=None, hidden=L.Dense):
        """input -> d1 -> d2 -> head: cuts after d1 (2 stages) or d1 and d2 (3 stages)."""
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((FEATURES,), name="x")
        h = hidden(8, activation="relu", name="d1", kernel_regularizer=regularizer)(inputs)
        h = L.Dense(8, activation="tanh", name="d2", kernel_regularizer=regularizer)(h)
        if head == "unit":
            out = L.UnitNormalization(name="head")(L.Dense(units, name="embed")(h))
        elif head == "raw_softmax":
            out = RawSoftmax(name="head")(L.Dense(units, name="logits")(h))
        elif head == "softmax_layer":
            out = L.Activation("softmax", name="head")(L.Dense(units, name="logits")(h))
        else:
            out = L.Dense(units, activation=None if head == "linear" else head, name="head",
                          kernel_regularizer=regularizer)(h)
        return keras.Model(inputs, out, name=f"net_{head}")

    def sequence_net(seed=0):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((T, FEATURES), name="frames")
        h = L.Dense(8, activation="relu", name="d1")(inputs)
        h = L.Dense(8, activation="tanh", name="d2")(h)
        return keras.Model(inputs, L.Dense(UNITS["ctc"], name="head")(h), name="net_sequence")

    def two_output_net(seed=0):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((FEATURES,), name="x")
        h = L.Dense(8, activation="relu", name="d1")(inputs)
        h = L.Dense(8, activation="tanh", name="d2")(h)
        cls = L.Dense(CLASSES, activation="softmax", name="cls")(h)
        reg = L.Dense(1, name="reg")(h)
        return keras.Model(inputs, {"cls": cls, "reg": reg}, name="net_two")

    def masked_net(seed=0):
        keras.utils.set_random_seed(seed)
        inputs = keras.Input((T,), dtype="int32", name="tokens")
        h = L.Embedding(10, 4, mask_zero=True, name="d1")(inputs)
        h = L.Dense(8, activation="tanh", name="d2")(h)
        return keras.Model(inputs, L.Dense(CLASSES, activation="softmax", name="head")(h), name="net_masked")

    tokens = rng.integers(1, 10, size=(N, T))
    for i, n in enumerate(rng.integers(2, T + 1, size=N)):
        tokens[i, n:] = 0
    token_labels = rng.integers(0, CLASSES, size=(N, T)).astype("int32")

    def cuts(stages):
        return "d1" if stages == 2 else ["d1", "d2"]

    def compare(build, loss, data, configs, *, metrics=None, fit_kwargs=None, run_eagerly=False,
                optimizer=lambda: keras.optimizers.SGD(0.1)):
        """Trains the unsplit model and the pipeline at each (stages, M); returns the record."""
        inputs, y = data
        fit_kwargs = fit_kwargs or {}

        def train(model):
            model.compile(optimizer(), loss, metrics=metrics, run_eagerly=run_eagerly)
            start = [w.copy() for w in model.get_weights()]
            hist = model.fit(inputs, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
                             **fit_kwargs).history
            moved = max(float(np.abs(a - b).max()) for a, b in zip(start, model.get_weights()))
            evaluated = model.evaluate(inputs, y, batch_size=BATCH, verbose=0, return_dict=True)
            return hist, moved, evaluated

        unsplit = build()
        hist, moved, evaluated = train(unsplit)
        record = {"unsplit": {"history": hist, "moved": moved, "evaluate": evaluated}, "runs": []}
        for stages, m in configs:
            piped = kd.pipeline_model(build(), DEVICES[:stages], split_at=cuts(stages), num_microbatches=m)
            p_hist, p_moved, p_eval = train(piped)
            record["runs"].append({
                "stages": stages, "microbatches": m, "history": p_hist, "moved": p_moved, "evaluate": p_eval,
                "max_weight_diff": max(float(np.abs(a - b).max())
                                       for a, b in zip(piped.get_weights(), unsplit.get_weights())),
            })
        return record

    results = {}

    def part(fn):
        if wanted is not None and fn.__name__ not in wanted:
            return fn
        try:
            results[fn.__name__] = fn()
        except Exception:  # noqa: BLE001 - reported to the test, which fails with it
            results[fn.__name__] = {"error": traceback.format_exc()[-4000:]}
        return fn

    def safe(fn):
        try:
            return fn()
        except Exception:  # noqa: BLE001 - one case's failure is recorded, the others still run
            return {"error": traceback.format_exc()[-3000:]}

    @part
    def heads():
        sparse, onehot, binary = (x, targets["sparse"]), (x, targets["onehot"]), (x, targets["binary"])
        regression = (x, targets["regression"])
        configs = CONFIGS

        def op_input_loss(y_true, y_pred):  # what Keras does for an op-type softmax, by hand
            return keras.losses.sparse_categorical_crossentropy(y_true, y_pred.op.inputs[0], from_logits=True)

        cases = {
            "softmax_sparse_string": lambda: compare(
                lambda: dense_net("softmax", CLASSES), "sparse_categorical_crossentropy", sparse,
                [*configs, (2, 4)], metrics=["accuracy"]),
            "softmax_sparse_object": lambda: compare(
                lambda: dense_net("softmax", CLASSES), keras.losses.SparseCategoricalCrossentropy(), sparse, configs,
                metrics=["accuracy"]),
            "softmax_categorical_onehot": lambda: compare(
                lambda: dense_net("softmax", CLASSES), "categorical_crossentropy", onehot, configs,
                metrics=["accuracy"]),
            "sigmoid_binary": lambda: compare(
                lambda: dense_net("sigmoid", 1), "binary_crossentropy", binary, configs, metrics=["accuracy"]),
            "logits_from_logits": lambda: compare(
                lambda: dense_net("linear", CLASSES), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                sparse, configs, metrics=["accuracy"]),
            "linear_mse": lambda: compare(lambda: dense_net("linear", 1), "mse", regression, configs),
            "linear_mae": lambda: compare(lambda: dense_net("linear", 1), "mae", regression, configs),
            "softmax_class_weight": lambda: compare(
                lambda: dense_net("softmax", CLASSES), "sparse_categorical_crossentropy", sparse, configs,
                metrics=["accuracy"], fit_kwargs={"class_weight": {0: 1.0, 1: 3.0, 2: 0.5}}),
            "softmax_kernel_regularizer": lambda: compare(
                lambda: dense_net("softmax", CLASSES, regularizer=keras.regularizers.L2(0.01)),
                "sparse_categorical_crossentropy", sparse, configs),
            "softmax_adam": lambda: compare(
                lambda: dense_net("softmax", CLASSES), "sparse_categorical_crossentropy", sparse, configs,
                optimizer=lambda: keras.optimizers.Adam(0.01)),
            "two_outputs": lambda: compare(
                two_output_net, {"cls": "sparse_categorical_crossentropy", "reg": "mse"},
                (x, {"cls": targets["sparse"], "reg": targets["regression"]}), configs,
                metrics={"cls": ["accuracy"]}),
            # The logits cross the last cut: the alias is the last stage's input.
            "softmax_activation_layer": lambda: compare(
                lambda: dense_net("softmax_layer", CLASSES), "sparse_categorical_crossentropy", sparse, configs,
                metrics=["accuracy"]),
            # tf.nn.softmax inside a layer: Keras's loss reads the Softmax op's input.
            "raw_softmax_op": lambda: compare(
                lambda: dense_net("raw_softmax", CLASSES), "sparse_categorical_crossentropy", sparse, configs),
            "custom_loss_reads_op_input": lambda: compare(
                lambda: dense_net("softmax", CLASSES), op_input_loss, sparse, configs),
            # Embedding(mask_zero=True): the loss and the metric apply the output's mask.
            "masked_sequence": lambda: compare(
                masked_net, "sparse_categorical_crossentropy", (tokens, token_labels), configs,
                metrics=["accuracy"]),
        }
        return {name: safe(case) for name, case in cases.items()}

    def menu_data(kind):
        return (sequences, targets["ctc"]) if kind == "ctc" else (x, targets[kind])

    @part
    def menu():
        exported = sorted(name for name, c in vars(keras.losses).items()
                          if inspect.isclass(c) and issubclass(c, keras.losses.Loss) and c is not keras.losses.Loss)
        record = {"exported": exported, "without_recipe": [n for n in exported if n not in RECIPES], "cases": {}}
        for name in exported:
            if name not in RECIPES:
                continue
            head, kind, kwargs, lr = RECIPES[name]
            cls = getattr(keras.losses, name)
            build = sequence_net if head == "sequence" else (lambda head=head, kind=kind: dense_net(head, UNITS[kind]))
            record["cases"][name] = {"head": head, "target": kind,
                                     **safe(lambda: compare(build, cls(**kwargs), menu_data(kind), CONFIGS,
                                                            optimizer=lambda: keras.optimizers.SGD(lr)))}
        return record

    @part
    def eager():
        sparse = (x, targets["sparse"])
        return {
            "softmax_sparse": safe(lambda: compare(lambda: dense_net("softmax", CLASSES),
                                                   "sparse_categorical_crossentropy", sparse, [(2, 1), (2, 4)],
                                                   metrics=["accuracy"], run_eagerly=True)),
            "sigmoid_binary": safe(lambda: compare(lambda: dense_net("sigmoid", 1), "binary_crossentropy",
                                                   (x, targets["binary"]), [(2, 1)], run_eagerly=True)),
        }

    def error_of(fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the test reads type and message
            return {"type": type(e).__name__, "message": str(e)}
        return {"type": None, "message": "no error raised"}

    @part
    def checks():
        sparse_y = targets["sparse"]

        def piped_fit(model, loss_for, m=1, run_eagerly=False):
            piped = kd.pipeline_model(model, DEVICES[:2], split_at="d1", num_microbatches=m)
            piped.compile(keras.optimizers.SGD(0.1), loss_for(piped), run_eagerly=run_eagerly)
            return piped.fit(x, sparse_y, batch_size=BATCH, epochs=1, verbose=0).history

        def side_channel_net(seed=0):
            keras.utils.set_random_seed(seed)
            inputs = keras.Input((FEATURES,), name="x")
            h = L.Dense(8, activation="relu", name="d1")(inputs)
            h = Remember(name="remember")(L.Dense(CLASSES, name="logits")(h))
            return keras.Model(inputs, L.Dense(CLASSES, name="head")(h), name="side")

        def side_channel_loss(model, with_y_pred=True):
            def loss(y_true, y_pred):
                # An activity penalty on a tensor inside the last stage, read off the layer
                # (any batch size: with M > 1 it is the last micro-batch's).
                penalty = tf.reduce_mean(model.get_layer("remember").seen ** 2)
                if not with_y_pred:
                    return penalty + 0.0 * tf.reduce_mean(tf.cast(y_true, "float32"))
                return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True) + penalty
            return loss

        def unsplit_moves(loss_for):
            model = side_channel_net()
            start = [w.copy() for w in model.get_weights()]
            model.compile(keras.optimizers.SGD(0.1), loss_for(model))
            model.fit(x, sparse_y, batch_size=BATCH, epochs=1, verbose=0)
            return [float(np.abs(a - b).max()) for a, b in zip(start, model.get_weights())]

        def sparse(_):
            return "sparse_categorical_crossentropy"

        def added_loss_net():
            return dense_net("softmax", CLASSES, hidden=Penalized)

        def stopped_loss(y_true, y_pred):  # reads the stage's logits, but without a gradient
            logits = tf.stop_gradient(y_pred.op.inputs[0].op.inputs[0])
            return keras.losses.sparse_categorical_crossentropy(y_true, y_pred) + 0.0 * tf.reduce_mean(logits, -1)

        source = inspect.getsource(importlib.import_module("keras.src.backend.tensorflow.nn"))
        return {
            "side_channel_unsplit_moves": unsplit_moves(side_channel_loss),
            "side_channel_graph_m1": error_of(lambda: piped_fit(side_channel_net(), side_channel_loss)),
            "side_channel_graph_m4": error_of(lambda: piped_fit(side_channel_net(), side_channel_loss, m=4)),
            # Run eagerly there is no graph to walk: caught when no gradient reaches the outputs.
            "side_channel_only_eager": error_of(lambda: piped_fit(
                side_channel_net(), lambda m: side_channel_loss(m, with_y_pred=False), run_eagerly=True)),
            "add_loss_graph_m1": error_of(lambda: piped_fit(added_loss_net(), sparse)),
            "add_loss_graph_m4": error_of(lambda: piped_fit(added_loss_net(), sparse, m=4)),
            "add_loss_eager_m4": error_of(lambda: piped_fit(added_loss_net(), sparse, m=4,
                                                            run_eagerly=True)),
            "stop_gradient_read": safe(lambda: compare(lambda: dense_net("softmax", CLASSES), stopped_loss,
                                                       (x, sparse_y), [(2, 1)])),
            "keras_logits_op_types": sorted(set(re.findall(r'_get_logits\(\s*\w+,\s*\w+,\s*"(\w+)"', source))),
            "keras_sets_keras_logits": "_keras_logits = " in source and "hasattr(output, \"_keras_logits\")" in source,
        }

    with open(out, "w") as f:
        json.dump(results, f, default=str)
    return 0


if __name__ == "__main__":
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
