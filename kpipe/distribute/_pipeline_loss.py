"""The pipeline's join of the micro-batches' outputs, carrying what Keras's loss reads besides
`y_pred`, and the check that the loss reads nothing else from inside the stages.

NOTE [ What a Keras loss reads besides y_pred, and how the pipeline carries it ]
--------------------------------------------------------------------------------
`PipelineModel.train_step` computes the loss once per batch under its own gradient tape,
from `y_pred`: the last stage's outputs of the M micro-batches, joined. The gradient of
the loss reaches the stages only through the tensors that tape watches; the stages' own
tapes then carry it inside (`_Pipeline.backward`). Keras's losses on the TensorFlow
backend do not always differentiate through `y_pred` itself
(`keras/src/backend/tensorflow/nn.py`, `_get_logits`, Keras 3.5 to 3.15 alike): the
crossentropies (`categorical_crossentropy`, `sparse_categorical_crossentropy`,
`binary_crossentropy`, and the focal losses built on them) read

  (a) `y_pred._keras_logits` when it is set -- Keras's softmax and sigmoid activations set
      it to their input (the logits) -- and compute the loss from those logits;
  (b) otherwise, in a graph, `y_pred.op.inputs[0]` when `y_pred.op.type` is "Softmax" /
      "Sigmoid" (a model ending in `tf.nn.softmax` inside a layer).

Either way the loss is a function of the logits, made inside the last stage: with the
stage's output tensor itself as `y_pred` (M = 1) the loss tape sees no path from the loss
to what it watches and every weight gets a zero gradient; joined by `tf.concat` (M > 1)
the alias is gone and the loss is computed from clipped probabilities -- it trains, but
not as the unsplit model does.

`join_outputs` therefore builds `y_pred` from fresh tensors (`tf.identity` for M = 1,
`tf.concat` for M > 1, rows added by the split dropped) and gives each joined output what
Keras would find on the unsplit model's output:

    output with       joined output                          watched by the loss tape
    -----------       -------------                          ------------------------
    _keras_logits     join(outputs), ._keras_logits =        join(outputs), join(logits)
                      join(logits)
    op Softmax/Sigm.  raw op(join(op inputs)) -- same op     raw op(...), join(op inputs)
                      type, so Keras takes the same route
    neither           join(outputs)                          join(outputs)
    _keras_mask       + ._keras_mask = join(masks)           (masks carry no gradient)

The loss tape watches the joined outputs and the joined logits; their gradients are cut
back into micro-batches, and `_Pipeline.backward` differentiates each micro-batch's last
stage from its outputs and its logits together (`output_gradients` for both): the chain
rule gives exactly the unsplit model's gradient, whichever tensors the loss read.

A loss that reads anything else made inside a stage (a custom loss walking `y_pred.op`,
an attribute Keras may add later) would train nothing through it, silently. So on the
first step (while Keras traces it) `check_loss_reads_only` walks the loss's graph back to
the watched tensors: a floating-point tensor made during the stages' forward pass that
the loss reaches around them, and through which the loss has a gradient (`tf.gradients`,
only then), raises `PipelineGradientError`. Run eagerly (`run_eagerly=True`) there is no
graph to walk: `check_gradients_arrived` raises when no watched tensor got a gradient
while the stages have trainable weights (a loss that reads such a tensor *besides* the
outputs is caught only when traced). The commonest such loss, a layer's `add_loss` in
`call`, is refused by name in both modes (`check_no_added_losses`, after the forward pass).
A gradient that is None for a variable because the loss does not depend on it at all is
left to Keras's optimizer, which warns about it as it does for the unsplit model.
"""

import dataclasses
import re

import tensorflow as tf

_FLOATS = ("float16", "bfloat16", "float32", "float64")
# The op types Keras's `_get_logits` reads through (keras/src/backend/tensorflow/nn.py),
# and the same op re-applied to the joined logits.
_LOGITS_OPS = {
    "Softmax": lambda logits: tf.raw_ops.Softmax(logits=logits),
    "Sigmoid": lambda logits: tf.raw_ops.Sigmoid(x=logits),
}


class PipelineGradientError(RuntimeError):
    """The loss of a `PipelineModel` depends on a tensor inside a stage that the pipeline
    does not back-propagate from, so the unsplit model would train weights that the
    pipeline would not.

    Raised on the first training step. The fix is to compute the loss from `y_pred`
    (the model's outputs) or from the logits behind a softmax/sigmoid output, or to make
    the tensor the loss needs an output of the model.

    Example (a layer's `add_loss` reads a tensor inside stage 0):

    >>> import keras, numpy as np, kpipe.distribute
    >>> class Penalized(keras.layers.Dense):
    ...     def call(self, inputs):
    ...         outputs = super().call(inputs)
    ...         self.add_loss(0.01 * keras.ops.mean(outputs ** 2))
    ...         return outputs
    >>> model = keras.Sequential([keras.Input((4,)), Penalized(8, name="a"), keras.layers.Dense(1, name="b")])
    >>> piped = kpipe.distribute.pipeline_model(model, ["/cpu:0", "/cpu:0"], split_at="a")
    >>> piped.compile("sgd", "mse")
    >>> try:
    ...     piped.fit(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)
    ... except kpipe.distribute.PipelineGradientError as e:
    ...     print("add_loss" in str(e))
    True
    """


@dataclasses.dataclass(frozen=True)
class JoinedOutputs:
    """The micro-batches' outputs joined for the loss.

    Attributes:
        y_pred: The joined outputs, in the structure of the model's outputs, with
            `_keras_logits` / `_keras_mask` as Keras would find them on the unsplit model.
        watched: The tensors the loss tape watches (the joined outputs, then the joined
            logits), a list.
        sources: `sources[m][j]` is micro-batch m's tensor in the last stage whose rows
            (untrimmed) make up `watched[j]`.
    """

    y_pred: object
    watched: list
    sources: list


def _logits_of(tensor):
    """`(logits, op type)`: what Keras's crossentropies read in place of `tensor` (None if
    nothing), and the op type ("Softmax"/"Sigmoid") that made `tensor` from those logits in a
    graph (None if another op did, or eagerly)."""
    logits = getattr(tensor, "_keras_logits", None)
    op = None
    if not isinstance(tensor, tf.__internal__.EagerTensor) and hasattr(tensor, "op"):
        if tensor.op.type in _LOGITS_OPS and len(tensor.op.inputs) == 1:
            op = tensor.op.type
            if logits is None:
                logits = tensor.op.inputs[0]
            elif getattr(logits, "name", None) != tensor.op.inputs[0].name:
                op = None  # the alias is not the op's input: join the output itself
    return logits, op


def _join(pieces):
    return tf.identity(pieces[0]) if len(pieces) == 1 else tf.concat(pieces, axis=0)


def join_outputs(outputs, trim):
    """Joins the last stage's outputs of each micro-batch into `y_pred` for the loss.

    Args:
        outputs: `outputs[m]` is the last stage's output nest on micro-batch m.
        trim: A function of a list (one entry per micro-batch) of lists of tensors that
            drops the rows the split added (`_Pipeline.trim` with the sizes bound).

    Returns:
        A `JoinedOutputs`.
    """
    flat = [tf.nest.flatten(o) for o in outputs]
    count = len(flat[0])
    found = [[_logits_of(t) for t in row] for row in flat]
    # Carried only when every micro-batch has it (one model: they do, or none does).
    aliased = [i for i in range(count) if all(row[i][0] is not None for row in found)]
    rebuilt = {i: found[0][i][1] for i in aliased if all(row[i][1] == found[0][i][1] for row in found)}
    masked = [i for i in range(count) if all(getattr(row[i], "_keras_mask", None) is not None for row in flat)]
    parts = [row + [found[m][i][0] for i in aliased] + [row[i]._keras_mask for i in masked]
             for m, row in enumerate(flat)]
    columns = [_join(list(column)) for column in zip(*trim(parts))]
    logits = dict(zip(aliased, columns[count:]))
    masks = dict(zip(masked, columns[count + len(aliased):]))
    joined = []
    for i in range(count):
        out = columns[i]
        if rebuilt.get(i):  # the same op as the stage's, so that `y_pred.op` looks the same
            out = _LOGITS_OPS[rebuilt[i]](logits[i])
        if getattr(flat[0][i], "_keras_logits", None) is not None and i in logits:
            out._keras_logits = logits[i]
        if i in masks:
            out._keras_mask = masks[i]
        joined.append(out)
    watched = joined + [logits[i] for i in aliased]
    sources = [row + [found[m][i][0] for i in aliased] for m, row in enumerate(flat)]
    return JoinedOutputs(tf.nest.pack_sequence_as(outputs[0], joined), watched, sources)


def check_no_added_losses(stages, model_name):
    """Raises `PipelineGradientError` if a layer of a stage added a loss (`add_loss`) in the
    forward pass just run: that loss is made inside the stage, per micro-batch, and the
    pipeline would not back-propagate it."""
    added = []
    for stage in stages:
        for layer in _layers_of(stage.model):
            if getattr(layer, "_losses", None):  # Keras 3.5-3.15: what `add_loss` appended
                added.append((layer.name, stage))
    if added:
        names = ", ".join(f"{name!r} (stage {stage.index} on {stage.device})" for name, stage in added[:5])
        raise PipelineGradientError(
            f"Layer(s) {names} of pipeline model {model_name!r} add a loss in `call` (`add_loss`), which "
            "`pipeline_model` does not support: the loss is computed once per batch from the model's outputs, "
            "and a loss made inside a stage, per micro-batch, would not be back-propagated (the unsplit model "
            "trains through it). Make the term an output of the model with its own loss in `compile`, or use a "
            "weight regularizer.")


def _layers_of(model):
    for layer in model.layers:
        yield layer
        if getattr(layer, "layers", None):
            yield from _layers_of(layer)


def forward_mark():
    """Where the graph being traced stands now (None when running eagerly): pass it to
    `ops_since` after the forward pass."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    return graph, len(graph.get_operations())


def ops_since(mark):
    """Names of the ops made in the traced graph since `forward_mark()` returned `mark`."""
    if mark is None:
        return None
    graph, count = mark
    return {op.name for op in graph.get_operations()[count:]}


def check_loss_reads_only(loss, watched, forward_ops, *, model_name, stages):
    """Raises `PipelineGradientError` if, in the traced graph, `loss` has a gradient through a
    tensor made by an op in `forward_ops` other than through `watched`.

    Args:
        loss: The scalar loss tensor (graph).
        watched: The tensors the loss tape watches; the walk stops at them.
        forward_ops: Names of the ops made during the stages' forward pass.
        model_name: The model's name, for the message.
        stages: The `PipelineStage`s, for the message.

    Raises:
        PipelineGradientError: The loss depends on such a tensor, differentiably.
    """
    stop = {t.name for t in watched}
    seen, pending, leaks = set(), [loss.op], []
    while pending:
        op = pending.pop()
        for t in op.inputs:
            if t.dtype.name not in _FLOATS or t.name in stop or t.name in seen:
                continue  # integers and booleans carry no gradient
            seen.add(t.name)
            if t.op.name in forward_ops:
                leaks.append(t)
            else:
                pending.append(t.op)
    if not leaks:
        return
    # Only a dependence with a gradient matters (the unsplit model would train through it).
    grads = tf.gradients(loss, leaks, stop_gradients=list(watched),
                         unconnected_gradients=tf.UnconnectedGradients.NONE)
    leaks = [t for t, g in zip(leaks, grads) if g is not None]
    if leaks:
        raise PipelineGradientError(_leak_message(leaks, model_name, stages))


def _leak_message(leaks, model_name, stages):
    def where(t):
        match = re.search(r"pipeline_stage_(\d+)", t.name)
        if not match:
            return repr(t.name)
        stage = stages[int(match.group(1))]
        return f"{t.name!r} (stage {stage.index} on {stage.device}, layers {list(stage.layer_names)})"

    return (
        f"The loss of pipeline model {model_name!r} depends on {len(leaks)} tensor(s) made inside the stages "
        f"other than through the model's outputs: {', '.join(where(t) for t in leaks[:3])}. The pipeline "
        "back-propagates the loss into the stages only from the outputs (`y_pred`) and the logits Keras's "
        "crossentropies read behind a softmax/sigmoid output, so the unsplit model would train these weights "
        "and the pipeline would not. Compute the loss from `y_pred` (or `y_pred._keras_logits`), or make the "
        "tensor the loss needs an output of the model.")


def check_gradients_arrived(grads, stages, model_name):
    """Eager fallback of `check_loss_reads_only`: raises `PipelineGradientError` when no
    watched tensor got a gradient (`grads` all None) while the stages have trainable weights."""
    if any(g is not None for g in grads):
        return
    if not any(stage.model.trainable_variables for stage in stages):
        return
    raise PipelineGradientError(
        f"The loss of pipeline model {model_name!r} has no gradient with respect to the model's outputs "
        "(nor the logits Keras's crossentropies read behind a softmax/sigmoid output), so no weight of the "
        f"{len(stages)} stages would be trained. If the loss reads tensors made inside the model other than "
        "its outputs, compute it from `y_pred` instead, or make what it needs an output of the model; "
        "compiled with `run_eagerly=False` (the default) the error names the tensor.")
