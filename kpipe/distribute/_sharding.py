"""Input sharding rules shared by loaders and the multi-worker strategy.

* A *presharded* input already holds only this worker's share of each epoch (a
  `ProcessLoader(num_shards=W, shard_index=w)`, or a `tf.data.Dataset` passed through
  `mark_presharded`). Its batch size is the per-worker batch; tf.data auto-sharding must
  not split it again.
* A shuffle that each worker draws with its own random seed puts different samples in
  each worker's share of one common stream: some samples are seen twice per epoch, others
  never. `check_shuffle_seed` (loaders) and `unseeded_shuffles` (tf.data graphs) catch it.

`is_presharded` and `check_shuffle_seed` do not import TensorFlow.
"""

from typing import List

from kpipe.distribute._cluster import cluster_info

# Marker stored in `tf.data.Options.framework_type`, a list of strings that TensorFlow only
# records for telemetry and that survives `map`, `batch`, `prefetch`, `with_options`.
PRESHARDED_MARKER = "kpipe_presharded"

# Dataset classes that read files: with `AutoShardPolicy.AUTO`, TensorFlow shards such
# pipelines by file, so each worker's own shuffle order is harmless.
_FILE_READER_NAMES = ("TFRecord", "TextLine", "FixedLengthRecord", "ListFiles")
_SHUFFLE_DATASET_OPS = ("ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3",
                        "ShuffleAndRepeatDataset", "ShuffleAndRepeatDatasetV2")


def is_presharded(obj) -> bool:
    """Whether `obj` (a loader or `PyDataset`) loads only this worker's shard.

    True for objects with an integer `num_shards > 1` attribute, such as
    `kpipe.ProcessLoader(..., num_shards=2, shard_index=0)`, or with a true
    `_kpipe_presharded` attribute.

    Args:
        obj: Any object.

    Returns:
        A bool.

    Example:

    >>> class Shard:
    ...     num_shards = 2
    >>> is_presharded(Shard()), is_presharded(object())
    (True, False)
    """
    if getattr(obj, "_kpipe_presharded", False):
        return True
    num_shards = getattr(obj, "num_shards", None)
    return isinstance(num_shards, int) and not isinstance(num_shards, bool) and num_shards > 1


def mark_presharded(dataset):
    """Marks a `tf.data.Dataset` as holding only this worker's share of the data.

    kpipe's `MultiWorkerMirroredStrategy` then feeds it to this worker's replicas as is
    (no auto-sharding, no split of the global batch across workers): its batch size is
    the per-worker batch, and the global batch is the sum over workers.

    Args:
        dataset: A batched `tf.data.Dataset` of this worker's shard.

    Returns:
        The dataset with the marker in its options (`framework_type`).

    Example:

    >>> import tensorflow as tf
    >>> ds = mark_presharded(tf.data.Dataset.range(8).shard(2, 0).batch(2))
    >>> "kpipe_presharded" in ds.options().framework_type
    True
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.framework_type = [PRESHARDED_MARKER]
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options)


def dataset_is_marked_presharded(dataset) -> bool:
    """Whether `mark_presharded` was applied to `dataset` (or one of its inputs)."""
    try:
        return PRESHARDED_MARKER in dataset.options().framework_type
    except (AttributeError, TypeError):
        return False


def check_shuffle_seed(shuffle, seed, *, what: str = "ProcessLoader") -> None:
    """Raises when a shuffle without a seed would run on several workers.

    Loaders call this in their constructor. Under a multi-worker `TF_CONFIG`, every
    worker plans the same epoch and takes its own shard of it, which only works if all
    workers draw the same order.

    Args:
        shuffle: The loader's `shuffle` argument (any truthy value means shuffling).
        seed: The loader's `seed` argument.
        what: Name used in the error message. Defaults to `"ProcessLoader"`.

    Raises:
        ValueError: `shuffle` is set, `seed` is `None` and `TF_CONFIG` lists more than one
            training process.

    Example:

    >>> check_shuffle_seed(True, seed=0)   # seeded: fine anywhere
    """
    if not shuffle or seed is not None:
        return
    info = cluster_info()
    if info.is_multi_worker:
        raise ValueError(
            f"`{what}(shuffle=True)` needs a `seed` under multi-worker training "
            f"({info.num_workers} workers in TF_CONFIG). Received: seed=None. Without a "
            "common seed each worker shuffles differently and its shard overlaps the "
            f"others': samples are repeated and dropped. Pass the same `seed=` on every "
            "worker, e.g. seed=0.")


def unseeded_shuffles(dataset) -> List[str]:
    """Names the shuffles in a `tf.data` pipeline that draw a fresh random seed per process.

    Walks the Python dataset objects and the graphs of their functions (`map`,
    `flat_map`, ...): `Dataset.shuffle` and `tf.random.shuffle` with neither an op seed nor
    a global seed (`tf.random.set_seed` / `keras.utils.set_random_seed`) are reported.

    Args:
        dataset: A `tf.data.Dataset`.

    Returns:
        A list of descriptions, empty when every shuffle is seeded.
    """
    found: List[str] = []
    seen = set()
    stack = [dataset]
    while stack:
        ds = stack.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        if "Shuffle" in type(ds).__name__ and _both_zero(getattr(ds, "_seed", None),
                                                         getattr(ds, "_seed2", None)):
            found.append("Dataset.shuffle() without a seed")
        stack.extend(_safe_call(ds, "_inputs"))
        for wrapper in _safe_call(ds, "_functions"):
            graph = getattr(getattr(wrapper, "function", None), "graph", None)
            if graph is not None:
                _scan_graph(graph, found, seen, depth=0)
    return found


def reads_files(dataset) -> bool:
    """Whether a `tf.data` pipeline reads files (so AUTO sharding shards by file)."""
    seen, stack = set(), [dataset]
    while stack:
        ds = stack.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        if any(name in type(ds).__name__ for name in _FILE_READER_NAMES):
            return True
        stack.extend(_safe_call(ds, "_inputs"))
    return False


def _safe_call(obj, method: str) -> list:
    try:
        return list(getattr(obj, method)())
    except Exception:  # noqa: BLE001 -- private TF API, absent on some dataset types
        return []


def _scan_graph(graph, found: List[str], seen: set, depth: int) -> None:
    if id(graph) in seen or depth > 8:
        return
    seen.add(id(graph))
    import tensorflow as tf

    for op in graph.get_operations():
        if op.type == "RandomShuffle":
            if op.get_attr("seed") == 0 and op.get_attr("seed2") == 0:
                found.append("tf.random.shuffle() without a seed (e.g. fit(shuffle=True) "
                             "on NumPy arrays)")
        elif op.type in _SHUFFLE_DATASET_OPS and len(op.inputs) >= 4:
            seeds = [tf.get_static_value(op.inputs[i]) for i in (2, 3)]
            if _both_zero(*seeds):
                found.append("Dataset.shuffle() without a seed inside a dataset function")
    for function in getattr(graph, "_functions", {}).values():
        nested = getattr(function, "graph", None)
        if nested is not None:
            _scan_graph(nested, found, seen, depth + 1)


def _both_zero(seed, seed2) -> bool:
    if seed is None or seed2 is None:
        return False
    try:
        return int(seed) == 0 and int(seed2) == 0
    except (TypeError, ValueError):
        return False

