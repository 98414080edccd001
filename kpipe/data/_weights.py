"""`kpipe.data.class_weights`: a `class_weight` dict for `fit()` from labels or a dataset."""

import numpy as np

from kpipe.data._sharding import ShardSpec
from kpipe.data._source import source_of

_MODES = ("balanced", "sqrt")
# Samples per label batch when an unbatched dataset's labels are read.
_LABEL_BATCH = 4096


def class_weights(labels_or_dataset, mode="balanced", *, num_classes=None, batched=None):
    """Returns `{class: weight}` for `model.fit(class_weight=...)`.

    With `mode="balanced"` a class seen `n_c` times out of `n` samples over `k` present
    classes gets `n / (k * n_c)` (scikit-learn's "balanced"): every class then contributes
    the same total weight and the average weight per sample is 1. `mode="sqrt"` uses the
    square root of that, a milder correction.

    For a dataset made by a kpipe source (`from_hdf5`, `from_numpy`, `from_files`), only the
    labels are read (`from_files(on_error="skip")` is decoded, so that only the files the
    dataset yields count). A source's shard counts the *whole* source: every worker of a
    sharded job gets the same weights, those of the full training set. Any other
    `tf.data.Dataset` is iterated once: its elements (or batches) must be `(x, y)` or
    `(x, y, sample_weight)` with integer (or one-hot) `y`.

    Whether a dataset's elements are samples or batches, and so whether a label vector is
    one sample's one-hot row or a batch of class ids, is read from its `element_spec`,
    never from label values: labels of rank 0 are samples; an unknown first dimension or
    labels of rank 2 are batches; labels of rank 1 of static length are a batch when every
    component of the element has that same first dimension, else one-hot samples. Pass
    `batched` where that rule cannot know (e.g. unbatched `x` of shape `(k,)` beside
    one-hot `y` of shape `(k,)`).

    Args:
        labels_or_dataset: Integer class labels (any array-like of shape `(n,)` or `(n, 1)`),
            one-hot labels of shape `(n, k)`, or a `tf.data.Dataset` as above.
        mode: "balanced" or "sqrt". Defaults to "balanced".
        num_classes: If given, classes must be in `[0, num_classes)`. Defaults to None.
        batched: For a `tf.data.Dataset` other than a kpipe source: True if its elements
            are batches, False if they are single samples. Defaults to None (read from
            its `element_spec` as above).

    Returns:
        A dict from each class that occurs to its float weight. Classes that never occur are
        left out (Keras gives them weight 1.0).

    Raises:
        ValueError: for an unknown `mode` or `batched`, no labels, negative or non-integer
            labels, or labels outside `[0, num_classes)`.

    Example:

    >>> import kpipe
    >>> kpipe.data.class_weights([0, 0, 0, 1])
    {0: 0.6666666666666666, 1: 2.0}
    """
    if mode not in _MODES:
        raise ValueError(f"`mode` must be one of {_MODES}. Received: mode={mode!r}.")
    if batched not in (None, True, False):
        raise ValueError(
            f"`batched` must be True, False or None. Received: batched={batched!r}. Use None to "
            "read it from the dataset's element_spec."
        )
    labels = _labels(labels_or_dataset, batched)
    if labels.size == 0:
        raise ValueError("`labels_or_dataset` has no labels. Pass at least one sample.")
    if labels.dtype.kind == "f":
        if not np.all(np.isfinite(labels)) or not np.all(labels == np.round(labels)):
            raise ValueError(
                "Labels must be integer class ids (or one-hot rows). Received float labels such as "
                f"{labels[labels != np.round(labels)][:5].tolist()}. Convert them to class ids."
            )
        labels = labels.astype(np.int64)
    elif labels.dtype.kind not in "iub":
        raise ValueError(f"Labels must be integer class ids. Received dtype {labels.dtype}.")
    labels = labels.astype(np.int64)
    if labels.min() < 0:
        raise ValueError(f"Labels must be >= 0. Received a label {int(labels.min())}.")
    if num_classes is not None and labels.max() >= num_classes:
        raise ValueError(
            f"Labels must be < num_classes={num_classes}. Received a label {int(labels.max())}. "
            "Pass the right `num_classes` or fix the labels."
        )
    counts = np.bincount(labels)
    present = np.flatnonzero(counts)
    weights = labels.size / (len(present) * counts[present].astype(np.float64))
    if mode == "sqrt":
        weights = np.sqrt(weights)
    return {int(c): float(w) for c, w in zip(present, weights)}


def _labels(value, batched):
    record = source_of(value)
    if record is not None:
        source = record[0]
        labels = source.labels()
        if labels is not None:
            return _squeeze(np.asarray(labels))
        # Labels known only by reading the samples: read the whole source (see docstring),
        # whose elements are single samples.
        return _dataset_labels(source.build(ShardSpec()), False)
    if _is_dataset(value):
        return _dataset_labels(value, batched)
    if isinstance(value, dict):
        raise TypeError(
            "`labels_or_dataset` must be labels or a tf.data.Dataset, not a dict. Received a dict "
            f"with keys {sorted(value)[:5]}."
        )
    return _squeeze(np.asarray(value))


def _squeeze(labels):
    if labels.ndim == 2 and labels.shape[1] > 1:  # one-hot or probabilities
        return np.argmax(labels, axis=1)
    if labels.ndim == 2 and labels.shape[1] == 1:
        return labels[:, 0]
    if labels.ndim == 0:
        return labels.reshape(1)
    if labels.ndim != 1:
        raise ValueError(
            f"Labels must have shape (n,), (n, 1) or one-hot (n, k). Received shape {labels.shape}."
        )
    return labels


def _is_dataset(value):
    try:
        import tensorflow as tf
    except ImportError:  # pragma: no cover - TensorFlow is a dependency
        return False
    return isinstance(value, tf.data.Dataset)


def _dataset_labels(ds, batched):
    spec = ds.element_spec
    if not isinstance(spec, tuple) or len(spec) < 2 or not hasattr(spec[1], "shape"):
        raise ValueError(
            "A dataset passed to `class_weights` must yield (x, y) or (x, y, sample_weight) with "
            f"one label tensor y. Received elements with spec {str(spec)[:200]}. Pass the labels instead."
        )
    if batched is None:
        batched = _is_batched(spec)
    labels = ds.map(lambda *e: e[1])
    if not batched:  # samples: read them in batches, each a batch of per-sample labels
        labels = labels.batch(_LABEL_BATCH)
    parts = [_squeeze(np.asarray(y)) for y in labels.as_numpy_iterator()]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int64)


def _is_batched(spec):
    """Whether elements of `spec` (`(x, y[, w])`) are batches, from their declared shapes only."""
    import tensorflow as tf

    shape = spec[1].shape
    if shape.rank is None:
        raise ValueError(
            f"The labels of the dataset have unknown rank (spec {spec[1]}), so class_weights cannot "
            "tell samples from batches. Pass batched=True or batched=False."
        )
    if shape.rank == 0:
        return False
    if shape[0] is None or shape.rank >= 2:
        return True
    leading = set()
    for s in tf.nest.flatten(spec):
        s_shape = getattr(s, "shape", None)
        if s_shape is None or s_shape.rank is None or s_shape.rank == 0:
            return False
        leading.add(s_shape[0])
    return len(leading) == 1
