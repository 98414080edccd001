"""`kpipe.data.from_tfrecord`: parsed `tf.train.Example` records from TFRecord files."""

import warnings

from kpipe.data._paths import expand_paths
from kpipe.data._sharding import resolve_shard
from kpipe.data._source import Source, attach

# Files read at once, and records parsed per vectorized `parse_example` call.
_CYCLE_LENGTH = 8
_PARSE_BATCH = 128
_COMPRESSION = (None, "", "GZIP", "ZLIB")


def from_tfrecord(
    files, features, *, label=None, compression_type=None, input_context=None, num_shards=None, index=None
):
    """Returns a `tf.data.Dataset` of parsed `tf.train.Example` records.

    Files are read several at a time (parallel interleave) and records are parsed in
    parallel, in vectorized batches (`tf.io.parse_example`) split back into single samples
    -- one by one when `features` has a `VarLenFeature`, `SparseFeature`,
    `FixedLenSequenceFeature` or `RaggedFeature`, so that every sample is exactly
    `tf.io.parse_single_example`'s, values and spec (a sequence keeps its own length,
    never padded to its neighbours'). With as many files as shards or more, shards get whole files (file `i` to
    shard `i % num_shards`); with fewer files, every shard reads the files and keeps every
    `num_shards`-th record (exactly once per sample, but each shard reads all bytes, and a
    warning says so).

    Args:
        files: A TFRecord file, a glob pattern, or a list of them.
        features: Dict of feature name -> `tf.io.FixedLenFeature`, `tf.io.VarLenFeature`,
            `tf.io.RaggedFeature`, ... as for `tf.io.parse_example`.
        label: Name of a feature to return separately as the target: elements become
            `(features_without_label, label)`. Defaults to None (elements are the feature
            dict).
        compression_type: None, "GZIP" or "ZLIB". Defaults to None.
        input_context: A `tf.distribute.InputContext`; read only its input pipeline's part.
            Defaults to None.
        num_shards: Number of shards (instead of `input_context`). Defaults to None.
        index: The shard to read, with `num_shards`. Defaults to None.

    Returns:
        A `tf.data.Dataset` of single parsed samples; up to 8 files are read at once,
        their records alternating (a fixed, deterministic order).

    Raises:
        FileNotFoundError: if a file does not exist or a pattern matches nothing.
        TypeError: if `features` is not a dict of feature configurations.
        ValueError: if `label` is not a key of `features`, or `compression_type` is unknown.

    Example:

    >>> import os, tempfile, tensorflow as tf, kpipe
    >>> tmp = tempfile.TemporaryDirectory()
    >>> path = os.path.join(tmp.name, "train.tfrecord")
    >>> with tf.io.TFRecordWriter(path) as w:
    ...     for i in range(3):
    ...         f = {"v": tf.train.Feature(int64_list=tf.train.Int64List(value=[i]))}
    ...         w.write(tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString())
    >>> ds = kpipe.data.from_tfrecord(path, {"v": tf.io.FixedLenFeature([], tf.int64)})
    >>> [int(e["v"]) for e in ds.as_numpy_iterator()]
    [0, 1, 2]
    >>> tmp.cleanup()
    """
    import tensorflow as tf

    paths = expand_paths(files, "files", "TFRecord")
    shard = resolve_shard(input_context, num_shards, index)
    if not isinstance(features, dict) or not features:
        raise TypeError(
            f"`features` must be a non-empty dict of feature name -> tf.io feature configuration. "
            f"Received: features={features!r}. Example: {{'label': tf.io.FixedLenFeature([], tf.int64)}}."
        )
    configs = (
        tf.io.FixedLenFeature,
        tf.io.VarLenFeature,
        tf.io.RaggedFeature,
        tf.io.SparseFeature,
        tf.io.FixedLenSequenceFeature,
    )
    for key, value in features.items():
        if not isinstance(value, configs):
            raise TypeError(
                f"`features[{key!r}]` must be a tf.io feature configuration such as "
                f"tf.io.FixedLenFeature. Received: {value!r}."
            )
    if label is not None and label not in features:
        raise ValueError(
            f"`label` must be a key of `features`. Received: label={label!r}; features has "
            f"{sorted(features)}."
        )
    if compression_type not in _COMPRESSION:
        raise ValueError(
            f"`compression_type` must be None, 'GZIP' or 'ZLIB'. Received: compression_type={compression_type!r}."
        )
    source = _RecordSource(paths, dict(features), label, compression_type or "")
    return attach(source.build(shard), source, shard)


class _RecordSource(Source):
    def __init__(self, paths, features, label, compression_type):
        self.paths = paths
        self.features = features
        self.label = label
        self.compression_type = compression_type
        name = paths[0] if len(paths) == 1 else f"{paths[0]}, ... ({len(paths)} files)"
        self.what = f"from_tfrecord({name!r})"

    def build(self, shard, shuffle=False, seed=None):
        import tensorflow as tf

        by_file = len(self.paths) >= shard.num_shards
        paths = self.paths[shard.index :: shard.num_shards] if by_file else self.paths
        if shard.sharded and not by_file:
            warnings.warn(
                f"{self.what}: {len(self.paths)} file(s) for {shard.num_shards} shards, so every "
                "shard reads all records and keeps its share. Write at least as many files as "
                "shards to shard by file.",
                stacklevel=3,
            )
        ds = tf.data.Dataset.from_tensor_slices(paths)
        # Shuffling the file order is only safe when shards own whole files: record-level
        # sharding needs the same record order in every shard.
        if shuffle and by_file and len(paths) > 1:
            ds = ds.shuffle(len(paths), seed=seed, reshuffle_each_iteration=True)
        compression = self.compression_type
        ds = ds.interleave(
            lambda p: tf.data.TFRecordDataset(p, compression_type=compression),
            cycle_length=min(_CYCLE_LENGTH, len(paths)),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
        if shard.sharded and not by_file:
            ds = ds.shard(shard.num_shards, shard.index)
        features, label = self.features, self.label

        def split(parsed):
            if label is None:
                return parsed
            parsed = dict(parsed)
            target = parsed.pop(label)
            return parsed, target

        one_by_one = (tf.io.VarLenFeature, tf.io.SparseFeature, tf.io.FixedLenSequenceFeature, tf.io.RaggedFeature)
        if any(isinstance(f, one_by_one) for f in features.values()):
            # A vectorized parse pads sequence features to the longest record of its batch,
            # sparse outputs keep the batch's dense shape, and ragged ones split back into
            # ragged-rank-0 RaggedTensors: parse one by one, so that each sample is what
            # `tf.io.parse_single_example` gives (values and spec), whatever its neighbours.
            return ds.map(
                lambda r: split(tf.io.parse_single_example(r, features)),
                num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True,
            )
        parse = lambda records: split(tf.io.parse_example(records, features))  # noqa: E731
        return ds.batch(_PARSE_BATCH).map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
