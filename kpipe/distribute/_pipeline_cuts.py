"""Cutting a functional or Sequential Keras model into pipeline stages, and building each
stage from clones of its layers on its device (see the NOTE in `_pipeline.py`)."""

import warnings

import keras
import tensorflow as tf


def graph_of(model):
    """`(functional graph, model.layers)` of a functional or Sequential model."""
    if isinstance(model, keras.Sequential):
        graph = getattr(model, "_functional", None)
        if graph is None:
            raise TypeError(
                f"`model` must be built: Sequential model {model.name!r} has no input shape yet. "
                "Start it with `keras.Input(shape)` (or call it on a batch) before `pipeline_model`.")
        return graph, model.layers
    if isinstance(model, keras.Model) and hasattr(model, "_nodes_by_depth") and hasattr(model, "_operations"):
        return model, model.layers
    raise TypeError(
        f"`model` must be a functional or Sequential keras.Model. Received: {type(model).__name__} "
        f"{str(model)[:100]}. A subclassed model has no layer graph to cut: rebuild it as a functional "
        "model (keras.Model(inputs, outputs)) or a Sequential.")


def ordered_nodes(model_name, graph):
    """The graph's nodes in topological order, ties kept in `graph._operations` order."""
    nodes = [n for depth in graph._nodes_by_depth.values() for n in depth]
    seen = {}
    for node in nodes:
        if id(node.operation) in seen:
            raise ValueError(
                f"Layer {node.operation.name!r} is used more than once in model {model_name!r} (a shared "
                "layer); `pipeline_model` cannot cut a model with shared layers. Give each use its own layer.")
        seen[id(node.operation)] = node
    rank = {id(op): i for i, op in enumerate(graph._operations)}
    producer = {id(t): n for n in nodes for t in n.outputs}
    ordered, done = [], set()
    pending = sorted(nodes, key=lambda n: rank.get(id(n.operation), len(rank)))
    while pending:
        ready = next(n for n in pending if all(id(producer[id(t)]) in done for t in n.input_tensors
                                               if id(t) in producer))
        pending.remove(ready)
        ordered.append(ready)
        done.add(id(ready))
    return ordered


def crossing_tensors(graph, ops, position):
    """Tensors made at or before `ops[position]` and used after it (or model outputs)."""
    made = {id(t): t for n in ops[: position + 1] for t in n.outputs}
    made.update({id(t): t for t in graph.inputs})
    used = [t for n in ops[position + 1 :] for t in n.input_tensors] + list(graph.outputs)
    crossing = {}
    for t in used:
        if id(t) in made:
            crossing.setdefault(id(t), t)
    return list(crossing.values())


def _cut_problem(graph, ops, position):
    """Why the graph cannot be cut right after `ops[position]`, or None if it can."""
    node = ops[position]
    crossing = crossing_tensors(graph, ops, position)
    if isinstance(node.operation, keras.layers.InputLayer):
        return "it is an input layer (a stage needs at least one layer)"
    if position == len(ops) - 1:
        return "it is the model's last layer (the last stage would be empty)"
    if {id(t) for t in crossing} == {id(t) for t in node.outputs}:
        return None
    owner = {id(t): n.operation.name for n in ops for t in n.outputs}
    extra = [t for t in crossing if id(t) not in {id(o) for o in node.outputs}]
    users = {id(t): [n.operation.name for n in ops[position + 1 :] if any(u is t for u in n.input_tensors)]
             for t in extra}
    where = "; ".join(
        f"the output of {owner.get(id(t), 'the model input')!r} is used by "
        + (", ".join(repr(u) for u in users[id(t)]) if users[id(t)] else "the model's outputs")
        for t in extra)
    return (f"more than its output would cross the cut: {where} (a skip connection or a parallel branch "
            "across the cut). A cut must cross one tensor or one tuple of tensors made by the cut layer: "
            "cut before the branch starts or after it joins")


def resolve_cuts(model_name, graph, ops, split_at, stages):
    """Positions in `ops` after which each of the `stages - 1` cuts goes."""
    if stages == 1:
        if split_at not in (None, [], ()):
            raise ValueError(f"`split_at` must be None for one device. Received: split_at={split_at!r}.")
        return []
    if split_at is None:
        return _balanced_cuts(model_name, graph, ops, stages)
    names = [split_at] if isinstance(split_at, str) else list(split_at)
    if len(names) != stages - 1 or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"`split_at` must name {stages - 1} layer(s) for {stages} devices (the last layer of each stage "
            f"but the last). Received: split_at={split_at!r}. Or pass split_at=None to balance the stages.")
    position = {n.operation.name: i for i, n in enumerate(ops)}
    cuts = []
    for i, name in enumerate(names):
        if name not in position:
            raise ValueError(
                f"`split_at[{i}]` is not a layer of model {model_name!r}. Received: {name!r}. "
                f"Layers: {[n.operation.name for n in ops][:50]}.")
        problem = _cut_problem(graph, ops, position[name])
        if problem:
            raise ValueError(f"Cannot cut model {model_name!r} after layer {name!r} (`split_at[{i}]`): {problem}.")
        if cuts and position[name] <= cuts[-1]:
            raise ValueError(
                f"`split_at` must list layers in model order. Received: {names!r}: {name!r} does not come "
                f"after {names[i - 1]!r}.")
        cuts.append(position[name])
    return cuts


def _balanced_cuts(model_name, graph, ops, stages):
    """The valid cuts that make the largest stage's weight count smallest."""
    candidates = [p for p in range(len(ops) - 1) if _cut_problem(graph, ops, p) is None]
    if len(candidates) < stages - 1:
        raise ValueError(
            f"Model {model_name!r} has {len(candidates)} place(s) where it can be cut into stages (after "
            f"{[ops[p].operation.name for p in candidates]}) but {stages} devices need {stages - 1}. Use "
            "fewer devices, or pass `split_at`: a cut must cross one tensor or one tuple of tensors.")
    prefix = [0]
    for node in ops:
        prefix.append(prefix[-1] + params(node))
    ends = candidates + [len(ops) - 1]

    def weight(a, b):  # params in ops (a, b]
        return prefix[b + 1] - prefix[a + 1]

    # best[j][i]: (largest stage, sum of squares, cuts) for j+1 stages ending at ends[i].
    best = [{i: (weight(-1, e), weight(-1, e) ** 2, []) for i, e in enumerate(ends)}]
    for j in range(1, stages):
        row = {}
        for i, e in enumerate(ends):
            options = [(max(big, weight(ends[h], e)), sq + weight(ends[h], e) ** 2, cuts + [ends[h]])
                       for h, (big, sq, cuts) in best[-1].items() if h < i]
            if options:
                row[i] = min(options, key=lambda o: (o[0], o[1]))
        best.append(row)
    return best[stages - 1][len(ends) - 1][2]


def params(node):
    op = node.operation
    return op.count_params() if isinstance(op, keras.layers.Layer) and op.built else 0


def check_layers(model, ops, num_microbatches):
    warned = False
    for layer in _all_layers([n.operation for n in ops]):
        if getattr(layer, "activity_regularizer", None) is not None:
            raise ValueError(
                f"Layer {layer.name!r} has an activity regularizer, which `pipeline_model` does not support "
                "(its loss is made inside a stage, per micro-batch). Remove it, or regularize the weights.")
        if num_microbatches > 1 and isinstance(layer, keras.layers.BatchNormalization) and not warned:
            warned = True
            warnings.warn(
                f"Layer {layer.name!r} of model {model.name!r} is a BatchNormalization: in training it "
                f"normalizes each of the {num_microbatches} micro-batches with that micro-batch's own "
                "statistics and updates its moving averages once per micro-batch, so training differs "
                "from the unsplit model (and a batch smaller than `num_microbatches` leaves empty "
                "micro-batches, whose statistics are NaN). Use num_microbatches=1 for the same "
                "statistics, or LayerNormalization/GroupNormalization.", UserWarning, stacklevel=3)


def _all_layers(operations):
    for op in operations:
        if isinstance(op, keras.layers.Layer):
            yield op
            inner = getattr(op, "layers", None)
            if isinstance(op, keras.Model) and inner:
                yield from _all_layers(inner)


# Building a stage


def build_stage(graph, nodes, inputs, outputs, index, last, device, name, clones):
    """A functional model of `nodes` (clones of their layers) with its variables on `device`.

    `inputs` / `outputs` are the original graph's tensors that cross into / out of the
    stage; `clones` maps `id(original layer)` to its clone and is filled in here.
    """
    tensors = {}
    with tf.device(device):
        if index == 0:
            new_inputs = []
            for t in inputs:
                layer = t._keras_history[0]
                new_inputs.append(keras.Input(batch_shape=(None, *t.shape[1:]), dtype=t.dtype, name=layer.name))
                clones[id(layer)] = new_inputs[-1]._keras_history[0]
            stage_inputs = tf.nest.pack_sequence_as(graph._inputs_struct, new_inputs)
        else:
            new_inputs = [keras.Input(batch_shape=(None, *t.shape[1:]), dtype=t.dtype, name=f"{name}_input_{i}")
                          for i, t in enumerate(inputs)]
            stage_inputs = new_inputs[0] if len(new_inputs) == 1 else new_inputs
        tensors.update({id(t): n for t, n in zip(inputs, new_inputs)})
        for node in nodes:
            op = node.operation
            if node.is_input:
                continue
            args, kwargs = node.arguments.fill_in(tensors)
            if isinstance(op, keras.layers.Layer):
                clones[id(op)] = clone = _clone_layer(op)
                result = clone(*args, **kwargs)
            else:  # a stateless keras.ops operation of the functional graph
                result = op(*args, **kwargs)
            tensors.update({id(t): r for t, r in zip(node.outputs, tf.nest.flatten(result))})
        if last:
            stage_outputs = tf.nest.pack_sequence_as(graph._outputs_struct, [tensors[id(t)] for t in outputs])
        else:
            flat = [tensors[id(t)] for t in outputs]
            stage_outputs = flat[0] if len(flat) == 1 else flat
        stage = keras.Model(stage_inputs, stage_outputs, name=name)
    for node in nodes:
        op = node.operation
        if isinstance(op, keras.layers.Layer) and not node.is_input:
            clones[id(op)].set_weights(op.get_weights())
    return stage


def _clone_layer(layer):
    try:
        return layer.__class__.from_config(layer.get_config())
    except Exception as e:  # noqa: BLE001 - re-raised with the layer's name and the fix
        raise ValueError(
            f"Layer {layer.name!r} ({type(layer).__name__}) cannot be re-created on a stage's device: "
            f"`from_config(get_config())` failed with {type(e).__name__}: {str(e)[:300]}. Give the layer a "
            "`get_config()` that returns its constructor arguments.") from e


