"""Model parallelism on TensorFlow: a Keras model cut into pipeline stages on several devices,
trained by `fit()` with GPipe micro-batches (Huang et al. 2019).

NOTE [ Pipeline stages: what runs where, and why the gradients are exact ]
--------------------------------------------------------------------------
`pipeline_model(model, devices)` cuts the layer graph of a functional or Sequential model
into K = len(devices) contiguous stages (in the order of `model.layers`), rebuilds each stage
as a functional model from clones of its layers under `tf.device(devices[k])` -- so stage k's
variables, and the optimizer slots colocated with them, live on device k -- and copies the
weights. The returned `PipelineModel` tracks the clones in the order of `model.layers`: its
`weights`, `get_weights()` and `.weights.h5` files are those of the unsplit model.

One training step on a batch of N samples (M = `num_microbatches`)::

    x --split--> x_0 .. x_{M-1}        sizes ceil/floor(N/M): any N works (N < M: the
                                       empty ones get x's last row, ignored below)
    forward   for m: h = x_m; for k: [dev k, tape T_mk] h = stage_k(h)   (acts kept)
    loss      [dev K-1] y_pred = concat_m(h_m), with the logits behind a softmax/sigmoid
              output and the mask joined alike (_pipeline_loss.py NOTE); loss, metrics on
              the WHOLE batch, as Keras computes them (sample_weight, class_weight, loss
              weights, regularizers); g = d loss / d (y_pred, logits), split back into M pieces
    backward  for m: for k = K-1 .. 0: [dev k] (g, dW_mk) = T_mk.gradient(h_out, (h_in, W_k), g)
              (for k = K-1, h_out is the outputs and their logits)
    update    [dev of each variable] dW_k = sum_m dW_mk; one optimizer step

Keras's `tf.function` traces this into one graph; its executor runs each op once its inputs
are ready, so micro-batch m+1 on stage k overlaps micro-batch m on stage k+1 -- the GPipe
schedule -- with the idle "bubble" (K-1)/(M+K-1) of each pass.

With one `GradientTape` around everything, the backward ops would request no device and land
wherever TensorFlow's placer puts them (the first GPU); a tape per stage and micro-batch,
differentiated inside `tf.device(stage device)`, places each stage's backward pass on its own
device. The chain rule through `output_gradients` makes sum_m dW_mk the gradient of the
full-batch loss: exact for any loss (mean, sum, weighted), because the loss itself is
computed once on the concatenated outputs. It is exact only while each sample's activations
do not depend on the other samples of its micro-batch: `BatchNormalization` in training
normalizes each micro-batch with its own statistics (a warning says so).

Limits: one host; no `tf.distribute` strategy around it (an error); no XLA (`jit_compile`
must be False: one XLA program cannot span the stages' devices); layers used more than once
(shared layers) and activity regularizers are rejected; a loss a layer adds with `add_loss`
inside `call`, or a loss that reads a tensor inside a stage other than through the model's
outputs, raises `PipelineGradientError` on the first step (the pipeline would not
back-propagate it).
"""

import contextlib
import dataclasses
import functools
import re
import warnings

import keras
import tensorflow as tf

from kpipe import _devices
from kpipe.distribute import _pipeline_cuts, _pipeline_loss

_FLOAT_KINDS = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class PipelineStage:
    """One stage of a `PipelineModel`.

    Attributes:
        index: Position of the stage, 0 for the one that takes the model's inputs.
        device: The device its variables, forward and backward pass are on
            (`"/device:GPU:1"`).
        model: A functional `keras.Model` of this stage's layers; its inputs are the
            tensors that cross the cut before it.
        layer_names: Names of the original model's layers in this stage.
        params: Number of weights (trainable or not) in this stage.
    """

    index: int
    device: str
    model: "keras.Model"
    layer_names: tuple
    params: int


class PipelineModel(keras.Model):
    """A Keras model whose layers run as pipeline stages on several devices.

    Made by `pipeline_model()`; compile and train it like the model it was made from.
    `fit()`, `evaluate()` and `predict()` cut each batch into `num_microbatches`
    micro-batches that flow through the stages (GPipe): see the NOTE at the top of
    `kpipe/distribute/_pipeline.py`. Its `layers`, `weights` and weight files are those
    of the unsplit model. Not to be shared across processes; like any Keras model it may
    be read from several threads but trained from one.

    `fit()` raises `PipelineGradientError` on its first step when the loss depends on a
    tensor inside a stage other than through the model's outputs (and the logits Keras's
    crossentropies read behind a softmax or sigmoid output): a layer's `add_loss`, or a
    custom loss reading such a tensor.

    Example:

    >>> import keras, numpy as np, kpipe.distribute
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="a"),
    ...                           keras.layers.Dense(1, name="b")])
    >>> piped = kpipe.distribute.pipeline_model(model, ["/cpu:0", "/cpu:0"], split_at="a")
    >>> isinstance(piped, kpipe.distribute.PipelineModel), piped.stage_devices
    (True, ('/device:CPU:0', '/device:CPU:0'))
    >>> len(piped.weights) == len(model.weights)   # the unsplit model's weights
    True
    """

    def __init__(self, stages, layers, num_microbatches, name=None):
        super().__init__(name=name)
        self._pipe = _Pipeline(tuple(stages), num_microbatches)  # plain object: not tracked
        # The clones, in the original `model.layers` order: `weights` and the weight files'
        # paths (`layers/<class>_<i>/vars/<j>`) are then those of the unsplit model.
        self._pipeline_layers = list(layers)
        self.built = True

    @property
    def stages(self):
        """The `PipelineStage`s, first to last (a tuple)."""
        return self._pipe.stages

    @property
    def stage_devices(self):
        """The stages' devices, first to last (a tuple of strings)."""
        return tuple(s.device for s in self._pipe.stages)

    @property
    def num_microbatches(self):
        """Micro-batches each batch is cut into (an int)."""
        return self._pipe.num_microbatches

    def compile(self, *args, jit_compile=False, **kwargs):
        """`keras.Model.compile`, without XLA (`jit_compile` must be False or "auto").

        Also builds the optimizer, so that its slots (momenta...) live on their variables'
        devices.
        """
        if jit_compile not in (False, "auto", None):
            raise ValueError(
                f"`jit_compile` must be False for a PipelineModel. Received: jit_compile={jit_compile!r}. "
                "XLA compiles a step into one program for one device, which would undo the placement "
                "of the stages; leave `jit_compile` unset.")
        _check_no_strategy("compile")
        super().compile(*args, jit_compile=False, **kwargs)
        if self.optimizer is not None and not self.optimizer.built:
            # Now, eagerly: Keras would build it while tracing the first step, where the
            # optimizer's slots are not colocated with their variables (all land on the
            # default device). Built here, each slot lives on its variable's device.
            self.optimizer.build(self.trainable_variables)

    def get_config(self):
        raise NotImplementedError(
            f"A PipelineModel ({self.name!r}) has no config: it is saved as weights. Use "
            "`save_weights('w.weights.h5')`, and for a whole `.keras` file load those weights into the "
            "unsplit model (`model = build(); model.load_weights('w.weights.h5'); model.save('m.keras')`).")

    @functools.wraps(keras.Model.fit)
    def fit(self, *args, **kwargs):
        _check_no_strategy("train")
        return super().fit(*args, **kwargs)

    @functools.wraps(keras.Model.evaluate)
    def evaluate(self, *args, **kwargs):
        _check_no_strategy("evaluate")
        return super().evaluate(*args, **kwargs)

    @functools.wraps(keras.Model.predict)
    def predict(self, *args, **kwargs):
        _check_no_strategy("predict")
        return super().predict(*args, **kwargs)

    def call(self, inputs, training=None):
        # The whole batch through the stages in turn (direct calls, symbolic builds).
        h = inputs
        for stage in self._pipe.stages:
            with tf.device(stage.device):
                h = _call_stage(stage, h, training)
        return h

    def train_step(self, data):
        _check_no_strategy("train")
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        pipe = self._pipe
        sizes = pipe.microbatch_sizes(x)
        microbatches, rows = pipe.split_inputs(x, sizes)
        mark = _pipeline_loss.forward_mark()
        records, outputs = pipe.forward_with_tapes(microbatches)
        forward_ops = _pipeline_loss.ops_since(mark)
        _pipeline_loss.check_no_added_losses(pipe.stages, self.name)
        trainable = self.trainable_variables
        with tf.device(pipe.stages[-1].device), tf.name_scope("pipeline_loss"):
            # y_pred carries what Keras's loss reads besides the outputs (NOTE in _pipeline_loss).
            joined = _pipeline_loss.join_outputs(outputs, lambda parts: pipe.trim(parts, sizes))
            with tf.GradientTape() as tape:
                tape.watch(joined.watched)
                loss = self._compute_loss(x=x, y=y, y_pred=joined.y_pred, sample_weight=sample_weight, training=True)
                self._loss_tracker.update_state(loss, sample_weight=_batch_size(x))
                if self.optimizer is not None:
                    loss = self.optimizer.scale_loss(loss)
            if forward_ops is not None:  # tracing: decided exactly on the graph
                _pipeline_loss.check_loss_reads_only(loss, joined.watched, forward_ops, model_name=self.name,
                                                     stages=pipe.stages)
            grads = tape.gradient(loss, joined.watched + list(trainable))
            watched_grads = grads[: len(joined.watched)]
            if forward_ops is None and trainable:
                _pipeline_loss.check_gradients_arrived(watched_grads, pipe.stages, self.name)
            pieces = [pipe.pad(pipe.split(g, sizes), sizes, rows) if g is not None else [None] * pipe.num_microbatches
                      for g in watched_grads]
        if trainable:
            direct = dict(zip(map(id, trainable), grads[len(joined.watched):]))  # weight regularizers
            per_var = pipe.backward(records, joined.sources, [list(g) for g in zip(*pieces)])
            gradients = []
            for var in trainable:
                terms = [g for g in per_var.get(id(var), []) + [direct[id(var)]] if g is not None]
                with tf.device(_device_of(var)):
                    gradients.append(tf.add_n(terms) if len(terms) > 1 else terms[0] if terms else None)
            _place_updates_with_variables(self.optimizer)
            # A None gradient is one the unsplit model has too: Keras's optimizer warns for it.
            self.optimizer.apply_gradients(zip(gradients, trainable))
        else:
            warnings.warn("The model does not have any trainable weights.", stacklevel=2)
        return self.compute_metrics(x, y, joined.y_pred, sample_weight=sample_weight)

    def test_step(self, data):
        _check_no_strategy("evaluate")
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self._pipe.forward(x)
        with tf.device(self._pipe.stages[-1].device):
            loss = self._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
            self._loss_tracker.update_state(loss, sample_weight=_batch_size(x))
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def predict_step(self, data):
        _check_no_strategy("predict")
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._pipe.forward(x)


class _Pipeline:
    """The stages and the micro-batch schedule (graph-building code, no Keras state)."""

    def __init__(self, stages, num_microbatches):
        self.stages, self.num_microbatches = stages, num_microbatches

    def microbatch_sizes(self, x):
        """M sizes that sum to the batch size and differ by at most one (an int32 tensor)."""
        with tf.device(self.stages[0].device):
            n, m = _batch_size(x), self.num_microbatches
            return n // m + tf.cast(tf.range(m) < n % m, tf.int32)

    def split(self, x, sizes, device=None):
        """`x` (a nest of tensors) cut along axis 0 into a list of M nests, on `device`
        (None: the device scope of the caller)."""
        with tf.device(device) if device else contextlib.nullcontext():
            pieces = [tf.split(t, sizes, num=self.num_microbatches, axis=0) for t in tf.nest.flatten(x)]
        return [tf.nest.pack_sequence_as(x, [p[m] for p in pieces]) for m in range(self.num_microbatches)]

    def split_inputs(self, x, sizes):
        """`x` cut into the M micro-batches the stages run, none of them empty; returns
        `(microbatches, rows)`, `rows[m]` the rows of micro-batch m.

        A batch of fewer than M rows would leave micro-batches empty, and layers are not
        all safe on 0 rows (TensorFlow's oneDNN Conv2D on some x86 CPUs returns a tensor
        of the wrong shape, and its gradient fails; BatchNormalization's moving statistics
        would turn NaN). Those micro-batches get the batch's last row instead; `trim`
        drops its outputs and `pad` gives it a zero output gradient, so it changes
        neither the loss nor the gradients (only statistics a layer keeps of what it sees).
        """
        m = self.num_microbatches
        if m == 1:
            return [x], sizes
        with tf.device(self.stages[0].device):
            n = _batch_size(x)
            short = tf.logical_and(n > 0, n < m)

            def repeat_last():
                return tf.nest.map_structure(lambda t: tf.concat([t, tf.gather(t, tf.fill([m - n], n - 1))], 0), x)

            x = tf.cond(short, repeat_last, lambda: x)
            rows = tf.maximum(sizes, tf.minimum(n, 1))
        return self.split(x, rows, self.stages[0].device), rows

    def trim(self, outputs, sizes):
        """The last stage's outputs of each micro-batch, without rows `split_inputs` added."""
        if self.num_microbatches == 1:
            return outputs
        return [tf.nest.map_structure(lambda t: t[: sizes[m]], out) for m, out in enumerate(outputs)]

    def pad(self, pieces, sizes, rows):
        """Gradient `pieces` of each micro-batch, with zeros for the rows `split_inputs` added."""
        if self.num_microbatches == 1:
            return pieces
        return [tf.pad(g, [[0, rows[m] - sizes[m]]] + [[0, 0]] * (g.shape.rank - 1)) for m, g in enumerate(pieces)]

    def forward(self, x):
        """Inference: every micro-batch through every stage, outputs joined on the last device
        (with what Keras's loss reads besides them: `evaluate()` computes the loss as the unsplit
        model does)."""
        outputs = []
        sizes = self.microbatch_sizes(x)
        for h in self.split_inputs(x, sizes)[0]:
            for stage in self.stages:
                with tf.device(stage.device), tf.name_scope(f"pipeline_stage_{stage.index}"):
                    h = _call_stage(stage, h, False)
            outputs.append(h)
        with tf.device(self.stages[-1].device):
            return _pipeline_loss.join_outputs(outputs, lambda parts: self.trim(parts, sizes)).y_pred

    def forward_with_tapes(self, microbatches):
        """Training forward pass, one tape per (micro-batch, stage).

        Returns `(records, outputs)`: `records[m][k]` is `(tape, flat inputs, indices of the
        float inputs, flat outputs)` of stage k on micro-batch m; `outputs[m]` the last
        stage's output nest.
        """
        records, outputs = [], []
        for h in microbatches:
            row = []
            for stage in self.stages:
                flat_in = tf.nest.flatten(h)
                floats = [i for i, t in enumerate(flat_in) if stage.index > 0 and t.dtype.name in _FLOAT_KINDS]
                with tf.device(stage.device), tf.name_scope(f"pipeline_stage_{stage.index}"):
                    with tf.GradientTape(watch_accessed_variables=False) as tape:
                        tape.watch([flat_in[i] for i in floats])
                        tape.watch([v.value for v in stage.model.trainable_variables])
                        h = _call_stage(stage, h, True)
                row.append((tape, flat_in, floats, tf.nest.flatten(h)))
            records.append(row)
            outputs.append(h)
        return records, outputs

    def backward(self, records, last_targets, output_grads):
        """Back-propagates `output_grads[m]` (flat, per micro-batch) through every stage.

        `last_targets[m]` are the tensors of micro-batch m in the last stage that
        `output_grads[m]` belong to: its outputs, then the logits Keras's loss read behind
        them (`_pipeline_loss.join_outputs`). Returns `{id(variable): [gradient of each
        micro-batch]}`. Stage k's backward ops are built under `tf.device(stage k's
        device)`; TensorFlow names them after the forward ops they differentiate:
        `gradient_tape/pipeline_stage_<k>/...`. A stage none of whose targets got a gradient
        passes none on (its variables and those of the stages before it get no term from
        that micro-batch, as in the unsplit model).
        """
        per_var = {}
        for row, targets, grads in zip(records, last_targets, output_grads):
            for stage, (tape, flat_in, floats, flat_out) in zip(reversed(self.stages), reversed(row)):
                if stage is not self.stages[-1]:
                    targets = flat_out
                if all(g is None for g in grads):
                    break
                variables = list(stage.model.trainable_variables)
                with tf.device(stage.device):
                    grads = [tf.zeros_like(t) if g is None else g for t, g in zip(targets, grads)]
                    result = tape.gradient(targets, [flat_in[i] for i in floats] + variables,
                                           output_gradients=grads)
                for var, g in zip(variables, result[len(floats):]):
                    per_var.setdefault(id(var), []).append(g)
                grads = [None] * len(flat_in)
                for i, g in zip(floats, result[: len(floats)]):
                    grads[i] = g
        return per_var


def pipeline_model(model, devices, *, split_at=None, num_microbatches=4):
    """Cuts a Keras model into pipeline stages, one per device, trained with GPipe micro-batches.

    Stage k holds a contiguous run of `model.layers`; its variables (and the optimizer's
    slots for them) are created on `devices[k]`, and the forward and backward passes of
    each micro-batch through it run there. `fit()`, `evaluate()` and `predict()` of the
    returned model cut every batch into `num_microbatches` micro-batches that flow
    through the stages, so the devices work at the same time on different micro-batches;
    the idle share ("bubble") of each pass is (K-1)/(M+K-1) for K stages and M
    micro-batches.

    The loss, `sample_weight`, `class_weight`, loss weights, weight regularizers and
    metrics are computed once per batch, on the last stage's device, from the
    concatenated outputs -- exactly as the unsplit model computes them -- and the
    gradients of the micro-batches are summed, which is the full-batch gradient for any
    loss (mean or not) and any batch size (the micro-batch sizes differ by at most one;
    a batch smaller than M repeats its last sample in the micro-batches that would be
    empty, whose outputs and gradients are dropped). One optimizer update per batch. The
    exception: `BatchNormalization` in training normalizes each micro-batch with its own
    statistics and updates its moving averages once per micro-batch (warned).

    The model given is left as it is (its variables are not moved): to keep memory for
    the stages, build it on the host (`with tf.device("/cpu:0"): model = build()`) and
    drop it once the pipeline model exists.

    Args:
        model: A built functional or Sequential `keras.Model`, not compiled or compiled
            (the result is not compiled either way: compile it).
        devices: The stages' devices, first to last, as TensorFlow names
            (`["/gpu:0", "/gpu:1"]`); logical devices count. `len(devices)` is the
            number of stages, >= 1; a device may appear twice.
        split_at: Names of the layers that end stages 0 .. K-2 (the cut is right after
            each, and what crosses it is that layer's output: one tensor or a tuple of
            tensors), in model order; a string for two stages. Defaults to None: cut
            where the stages' weight counts are most even.
        num_microbatches: Micro-batches per batch, >= 1. Defaults to 4.

    Returns:
        A `PipelineModel`: a `keras.Model` with the same layers (by class and name),
        weights and weight order as `model`; `save_weights` / `load_weights` files are
        interchangeable with `model`'s.

    Raises:
        ValueError: `devices`, `split_at` or `num_microbatches` is not valid; a cut
            crosses more than the cut layer's output (a skip connection across it, a
            parallel branch, a model output from an earlier stage); a layer is shared
            or has an activity regularizer.
        RuntimeError: called under a `tf.distribute` strategy scope.
        TypeError: `model` is not a built functional or Sequential Keras model.

    Example:

    >>> import keras, numpy as np, kpipe.distribute
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="a"),
    ...                           keras.layers.Dense(1, name="b")])
    >>> piped = kpipe.distribute.pipeline_model(model, ["/cpu:0", "/cpu:0"], split_at="a",
    ...                                         num_microbatches=2)
    >>> [s.layer_names for s in piped.stages]
    [('a',), ('b',)]
    >>> piped.compile("sgd", "mse")
    >>> piped.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0).history["loss"][0] >= 0
    True
    """
    _check_no_strategy("build")
    devices = _resolve_devices(devices)
    num_microbatches = _check_microbatches(num_microbatches)
    graph, public_layers = _pipeline_cuts.graph_of(model)
    ops = _pipeline_cuts.ordered_nodes(model.name, graph)
    _pipeline_cuts.check_layers(model, ops, num_microbatches)
    cuts = _pipeline_cuts.resolve_cuts(model.name, graph, ops, split_at, len(devices))
    bounds = [-1, *cuts, len(ops) - 1]
    stages, clones = [], {}
    crossing = graph.inputs
    for k, device in enumerate(devices):
        nodes = ops[bounds[k] + 1 : bounds[k + 1] + 1]
        last = k == len(devices) - 1
        out = graph.outputs if last else _pipeline_cuts.crossing_tensors(graph, ops, bounds[k + 1])
        stage_model = _pipeline_cuts.build_stage(graph, nodes, crossing, out, k, last, device, f"{model.name}_stage_{k}", clones)
        names = tuple(n.operation.name for n in nodes if isinstance(n.operation, keras.layers.Layer)
                      and not isinstance(n.operation, keras.layers.InputLayer))
        stages.append(PipelineStage(k, device, stage_model, names, int(sum(_pipeline_cuts.params(n) for n in nodes))))
        crossing = out
    return PipelineModel(stages, [clones[id(layer)] for layer in public_layers], num_microbatches, name=model.name)


# ---------------------------------------------------------------------------------------------
# Arguments


def _check_no_strategy(what):
    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        raise RuntimeError(
            f"Cannot {what} a pipeline model under a `{type(strategy).__name__}` scope. Pipeline "
            "stages (model parallelism) cannot be combined with a tf.distribute strategy "
            "(MirroredStrategy, MultiWorkerMirroredStrategy) here: build, compile and fit the "
            "pipeline model outside any `strategy.scope()`, and give `pipeline_model` all the "
            "devices instead.")


def _resolve_devices(devices):
    if isinstance(devices, str) or not hasattr(devices, "__len__") or len(devices) == 0:
        raise ValueError(
            f"`devices` must be a non-empty list of device names, one per stage. Received: devices={devices!r}. "
            f"For example devices=['/gpu:0', '/gpu:1']; available here: {_devices.available()}.")
    resolved = []
    for i, name in enumerate(devices):
        canonical = _devices.local_device(name, require_index=True)
        if canonical is None:
            raise ValueError(
                f"`devices[{i}]` is not a device of this process. Received: devices[{i}]={name!r}. "
                f"Available: {_devices.available()} (type and index, e.g. '/gpu:1'; logical "
                "devices count; pipeline stages run on one host).")
        resolved.append(canonical)
    return resolved


def _check_microbatches(value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"`num_microbatches` must be an int >= 1. Received: num_microbatches={value!r}. "
            "Use 1 to run each batch whole through the stages, 4-8 to keep the devices busy.")
    return value


# ---------------------------------------------------------------------------------------------
# Small helpers


def _call_stage(stage, h, training):
    """`stage.model(h)`, without Keras's warning that the stage "destroys" a mask on `h`.

    A stage is a functional model, which Keras marks as not supporting masks and warns
    about when its input carries one -- but a functional model hands its inputs' masks to
    its layers, so the mask reaches the layers that use it, as in the unsplit model.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=f"Layer '{re.escape(stage.model.name)}' .*was passed an input with a mask")
        return stage.model(h, training=training)


def _batch_size(x):
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def _device_of(variable):
    """The device of a Keras variable or of the `tf.Variable` Keras's optimizer passes."""
    value = getattr(variable, "value", None)  # a method on a tf.Variable
    return value.device if isinstance(value, tf.Variable) else variable.device


def _place_updates_with_variables(optimizer):
    """Runs the optimizer's per-variable update under `tf.device(variable's device)`.

    Keras's TensorFlow optimizer builds each variable's update (`update_step`) without a
    device: its reads and writes follow the variable, but the arithmetic between them
    would go where the placer puts unplaced ops (the first GPU). Wrapping the instance's
    `update_step` (the innermost optimizer of a LossScaleOptimizer) keeps each stage's
    update on its stage's device. Idempotent.
    """
    inner = optimizer
    while getattr(inner, "inner_optimizer", None) is not None:
        inner = inner.inner_optimizer
    if getattr(inner, "_kpipe_update_on_variable_device", False):
        return
    update_step = inner.update_step

    def placed_update_step(gradient, variable, learning_rate):
        with tf.device(_device_of(variable)):
            return update_step(gradient, variable, learning_rate)

    inner.update_step = placed_update_step
    inner._kpipe_update_on_variable_device = True
