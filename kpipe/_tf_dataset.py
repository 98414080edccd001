"""`ProcessLoader.as_dataset()`: a `tf.data.Dataset` over a loader's streams."""

import weakref

from kpipe import _args, _stream
from kpipe._engine import _tree
from kpipe.errors import LoaderError


def build(loader, reader, *, prefetch, device, epochs):
    """The dataset `loader.as_dataset(...)` returns (see its docstring); `reader` is the
    loader's source (`kpipe._reader.Reader`)."""
    import tensorflow as tf

    from kpipe.distribute import mark_presharded  # (kpipe.distribute imports TensorFlow)

    if device is not None:
        device = _args.check_device(device)
    epochs = _args.check_epochs(epochs)
    signature = _signature(reader, loader.num_batches)
    ref = weakref.ref(loader)
    runs = [0]

    def generate():
        if epochs is not None:
            runs[0] += 1
            owner = ref()
            if owner is not None:
                _stream.source_of(owner).iteration_begin(epochs - runs[0] + 1)
            del owner
        for batch in _stream.stream_batches(ref, hooks="iteration"):
            yield _lists_to_tuples(batch)

    ds = tf.data.Dataset.from_generator(generate, output_signature=signature)
    if loader.num_batches is not None and not reader.stateful and reader.position.head[1] == 0:
        ds = ds.apply(tf.data.experimental.assert_cardinality(loader.num_batches))
    if device is None:
        ds = ds.prefetch(prefetch)
    else:
        ds = ds.apply(tf.data.experimental.prefetch_to_device(device, buffer_size=prefetch))
    if loader.num_shards > 1:  # already this worker's share: no second split by tf.data
        ds = mark_presharded(ds)
    try:  # `ds` (and the datasets made from it) hold the loader; TensorFlow's graphs, which
        ds._kpipe_loader = loader  # keep the generator forever, hold it weakly (NOTE in _keras_hook.py)
    except AttributeError:  # pragma: no cover - a tf.data object without a __dict__
        pass
    return ds


def _signature(reader, num_batches):
    """The element spec of `as_dataset()`: from the first batch (and the second, where
    inner dimensions may differ), read as a probe (kept for the real reads)."""
    import tensorflow as tf

    first = reader.peek(0)
    treedef, leaves, _ = _tree.flatten(first)
    if "none" in repr(treedef):
        raise LoaderError("as_dataset() cannot express `None` entries of a batch; drop them in __getitem__.")
    second = _tree.flatten(reader.peek(1))[1] if num_batches is None or num_batches > 1 else leaves
    varying = getattr(reader.dataset, "kpipe_varying_shapes", False)  # from_samples padding/collate: any inner size
    specs = []
    for a, b in zip(leaves, second):
        inner = [d if d == e and not varying else None for d, e in zip(a.shape[1:], b.shape[1:])]
        shape = [None] + inner if a.ndim else []
        specs.append(tf.TensorSpec(shape, tf.as_dtype(a.dtype)))
    return _lists_to_tuples(_tree.unflatten(treedef, specs))


def _lists_to_tuples(tree):
    """tf.data takes tuples and dicts, not lists, at any depth of a structure."""
    if isinstance(tree, (list, tuple)):
        return tuple(_lists_to_tuples(t) for t in tree)
    if isinstance(tree, dict):
        return {k: _lists_to_tuples(v) for k, v in tree.items()}
    return tree
