"""`kpipe.data.pipeline`: the steps of an input pipeline in the right order, with fast options."""

import os
import warnings

from kpipe.data._sharding import merge_shards, resolve_shard
from kpipe.data._source import source_of

# `shuffle=True` buffers up to this many samples ...
_DEFAULT_SHUFFLE_BUFFER = 10_000
# ... and at most this many bytes of them (never fewer than _MIN_SHUFFLE_BUFFER samples).
_SHUFFLE_BUFFER_BYTES = 512 << 20
_MIN_SHUFFLE_BUFFER = 64
# Threads of the pipeline's private pool: enough to overlap I/O waits beyond the cores
# (measured on 2 cores, 5 ms I/O wait per sample: AUTOTUNE alone 1.7x serial, 16 threads 12-14x).
_MIN_THREADPOOL = 16
_DEFAULT_TIMEOUT_S = 120.0


def pipeline(
    ds,
    *,
    batch_size,
    map_fn=None,
    py_map_fn=None,
    workers=None,
    shuffle=None,
    seed=None,
    cache=None,
    repeat=False,
    drop_remainder=False,
    deterministic=True,
    input_context=None,
    num_shards=None,
    index=None,
    threadpool_size=None,
    timeout=_DEFAULT_TIMEOUT_S,
    py_output_signature=None,
):
    """Returns `ds` sharded, cached, shuffled, mapped, batched and prefetched, in that order.

    The order is shard -> (source interleave) -> cache -> shuffle -> repeat -> `map_fn` ->
    batch -> `py_map_fn` -> prefetch, every step AUTOTUNE-parallel, and the dataset
    options a user would otherwise forget are set: autotuning on, and a private thread
    pool of `threadpool_size` threads so that steps waiting on I/O overlap beyond the core
    count (measured on 2 cores with 5 ms of I/O wait per sample: AUTOTUNE alone 1.7x a
    serial loop, a 16-thread pool 12-14x).

    When `ds` is a dataset returned by a kpipe source (`from_hdf5`, `from_numpy`,
    `from_files`, `from_tfrecord`) and not yet transformed, sharding and shuffling happen at
    the source: each pipeline reads only its own rows/files, and blocks/files are read in a
    seeded, per-epoch order before the shuffle buffer mixes samples. Any other dataset is
    sharded with `Dataset.shard` (every pipeline reads everything and keeps its share).

    Use inside `strategy.distribute_datasets_from_function` by passing its
    `input_context` (and `batch_size=input_context.get_per_replica_batch_size(global_batch)`).
    A shuffle across several shards needs a `seed`, the same on every worker.

    Args:
        ds: A `tf.data.Dataset` of single samples.
        batch_size: Samples per batch (per replica under a strategy).
        map_fn: A function of TensorFlow ops applied to each sample (unpacked like
            `Dataset.map`), in parallel. Defaults to None.
        py_map_fn: A Python/NumPy function applied to each sample (NumPy arrays in, NumPy
            arrays out; unpacked like `Dataset.map`) in kpipe worker processes, after
            `map_fn` and batching, one batch per hand-off, in order. It is sent with
            cloudpickle (lambdas and notebook functions work) and called once in this
            process to learn its output shapes and dtypes, unless `py_output_signature`
            is given (that probe reads the first sample of `ds`: an iteration of `ds`,
            which advances a seeded shuffle made inside `ds` itself, not kpipe's). Its outputs must have the same shape and dtype for every sample
            (a dtype change is a `TypeError` naming the element, as tf.data refuses it).
            The workers are kept between epochs and stopped after 30 s without use.
            Defaults to None.
        workers: Worker processes for `py_map_fn`. Each one's BLAS/OpenMP/OpenCV
            thread pools get `max(1, CPUs // workers)` threads (as `ProcessLoader`'s
            `worker_threads`). Defaults to None (one per CPU core).
        shuffle: Shuffle buffer in samples, True for a default buffer (10,000 samples, or
            fewer so that it holds at most ~512 MiB), or None/False/0 for no shuffling.
            `from_files` reads its files in a new uniformly random order every epoch, so
            True adds no buffer there (a buffer of decoded images would only delay each
            epoch's first batch until it filled); a number still adds one. Defaults to None.
        seed: Seed of the shuffle and of `py_map_fn`'s randomness: `random` and
            `numpy.random` are reseeded before each element from `(seed, iteration,
            element index)` (~11 us an element), so a seeded pipeline gives the same
            output whatever `workers` is (0 included) and, with `deterministic=True`,
            whatever the timing; each iteration of the dataset (epoch) draws anew. A generator made inside `py_map_fn`
            (`np.random.default_rng()`) is the function's own. Required when shuffling
            a sharded dataset. Defaults to None (`py_map_fn`'s generators not reseeded).
        cache: True or "memory" to cache samples in memory after the first epoch, a file
            path to cache them on disk (".shard-I-of-N" is appended when sharded), or
            None/False. Defaults to None.
        repeat: True to repeat forever, an int to repeat that many times, or False.
            Defaults to False.
        drop_remainder: Drop the last, smaller batch. Defaults to False.
        deterministic: Keep the element order deterministic; False lets parallel steps
            deliver out of order (faster when step times vary). Defaults to True.
        input_context: A `tf.distribute.InputContext` naming this pipeline's shard.
            Defaults to None.
        num_shards: Number of shards (instead of `input_context`). Defaults to None.
        index: This pipeline's shard, with `num_shards`. Defaults to None.
        threadpool_size: Threads of the pipeline's private pool. Defaults to None
            (max(16, 2 * CPU cores)).
        timeout: Seconds to wait for one `py_map_fn` batch before raising. Defaults to 120.
        py_output_signature: Per-sample `tf.TensorSpec` (nest) of `py_map_fn`'s output;
            skips the probe call, and outputs are cast to its dtypes. Defaults to None.

    Returns:
        A `tf.data.Dataset` of batches, ready for `model.fit`.

    Raises:
        ValueError: for invalid arguments; for an unseeded shuffle of a sharded dataset.
        TypeError: if `ds` is not a `tf.data.Dataset` or a function is not callable.
        tf.errors.OpError: while iterating, when `py_map_fn` raises, a worker dies or a
            batch exceeds `timeout`. tf.data turns Python exceptions into its own types
            (`InvalidArgumentError` for ValueError/TypeError, `UnknownError` otherwise);
            the message keeps the original type, message and the worker's traceback.

    Example:

    >>> import numpy as np, kpipe
    >>> ds = kpipe.data.from_numpy(np.arange(10, dtype="float32"), np.arange(10) % 2)
    >>> ds = kpipe.data.pipeline(ds, batch_size=4, map_fn=lambda x, y: (x * 2, y), shuffle=10, seed=0)
    >>> [len(x) for x, y in ds.as_numpy_iterator()]
    [4, 4, 2]
    """
    import tensorflow as tf

    _check_args(ds, batch_size, map_fn, py_map_fn, workers, shuffle, seed, cache, repeat, threadpool_size, timeout)
    requested = resolve_shard(input_context, num_shards, index)
    record = source_of(ds)
    shuffling = bool(shuffle)
    if record is not None:
        source, own = record
        shard = merge_shards(own, requested, source.what)
    else:
        source, shard = None, requested
    if shuffling and shard.sharded and seed is None:
        raise ValueError(
            f"Shuffling a sharded dataset needs a `seed`. Received: shuffle={shuffle!r}, seed=None, "
            f"for {shard}. Pass the same seed=<int> on every worker: unseeded shuffles across "
            "workers silently duplicate and drop samples."
        )
    if source is not None:
        # With a cache, samples are stored in the order of the first epoch: read in storage order.
        if shard != record[1] or (shuffling and not cache):
            ds = source.build(shard, shuffle=shuffling and not cache, seed=seed)
    elif shard.sharded:
        ds = ds.shard(shard.num_shards, shard.index)
    sample_ds = ds
    if source is not None and shuffling and not cache and py_map_fn is not None and py_output_signature is None:
        # py_map_fn's probe reads a sample from a build of its own: reading `ds` would advance
        # its seeded block order by one iteration, and the first epoch would get the second's.
        sample_ds = source.build(shard)
    if cache:
        ds = ds.cache() if cache is True or cache == "memory" else ds.cache(_cache_path(cache, shard))
    if shuffling and not (shuffle is True and source is not None and source.shuffles_samples and not cache):
        # (a source that permutes every sample needs no buffer: one of decoded images only made
        # each epoch wait for it to fill -- 0.6-0.9 s for 851 images of 224x224 -- and held 512 MB)
        ds = ds.shuffle(_buffer_size(shuffle, ds.element_spec), seed=seed, reshuffle_each_iteration=True)
    if repeat is True:
        ds = ds.repeat()
    elif repeat:
        ds = ds.repeat(repeat)
    if map_fn is not None:
        ds = ds.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
        sample_ds = sample_ds.map(map_fn)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder, num_parallel_calls=tf.data.AUTOTUNE, deterministic=deterministic)
    options = _options(tf, deterministic, threadpool_size, shard)
    if py_map_fn is not None:
        from kpipe.data._pymap import infer_signature, py_map

        signature = py_output_signature
        if signature is None:
            signature = infer_signature(py_map_fn, _first_sample(sample_ds))
        ds = py_map(
            ds,
            py_map_fn,
            workers=(os.cpu_count() or 1) if workers is None else workers,
            timeout=timeout,
            seed=seed,
            output_signature=signature,
            options=options,
            declared=py_output_signature is not None,
        )
    elif workers is not None:
        warnings.warn("`workers` is ignored without `py_map_fn`. Remove it or pass a `py_map_fn`.", stacklevel=2)
    return ds.prefetch(tf.data.AUTOTUNE).with_options(options)


def _check_args(ds, batch_size, map_fn, py_map_fn, workers, shuffle, seed, cache, repeat, threadpool_size, timeout):
    import tensorflow as tf

    if not isinstance(ds, tf.data.Dataset):
        raise TypeError(
            f"`ds` must be a tf.data.Dataset of single samples. Received: ds of type {type(ds).__name__}. "
            "Make one with kpipe.data.from_hdf5 / from_numpy / from_files / from_tfrecord."
        )
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"`batch_size` must be an integer >= 1. Received: batch_size={batch_size!r}.")
    for name, fn in (("map_fn", map_fn), ("py_map_fn", py_map_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"`{name}` must be callable or None. Received: {name}={fn!r}.")
    if workers is not None and (not _is_int(workers) or workers < 0):
        raise ValueError(
            f"`workers` must be an integer >= 0 or None. Received: workers={workers!r}. Use 0 to run "
            "py_map_fn in the pipeline's own thread."
        )
    if shuffle is not None and not isinstance(shuffle, bool) and (not _is_int(shuffle) or shuffle < 0):
        raise ValueError(
            f"`shuffle` must be a buffer size >= 0, True, False or None. Received: shuffle={shuffle!r}."
        )
    if seed is not None and not _is_int(seed):
        raise ValueError(f"`seed` must be an integer or None. Received: seed={seed!r}.")
    if cache not in (None, False, True, "memory") and not isinstance(cache, (str, os.PathLike)):
        raise ValueError(
            f"`cache` must be True, 'memory', a file path, or None. Received: cache={cache!r}."
        )
    if not isinstance(repeat, bool) and (not _is_int(repeat) or repeat < 1):
        raise ValueError(f"`repeat` must be True, False or a count >= 1. Received: repeat={repeat!r}.")
    if threadpool_size is not None and (not _is_int(threadpool_size) or threadpool_size < 1):
        raise ValueError(f"`threadpool_size` must be an integer >= 1 or None. Received: threadpool_size={threadpool_size!r}.")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"`timeout` must be a number of seconds > 0. Received: timeout={timeout!r}.")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _cache_path(cache, shard):
    path = os.fspath(cache)
    if shard.sharded:
        path = f"{path}.shard-{shard.index}-of-{shard.num_shards}"
    directory = os.path.dirname(path)
    if directory and not os.path.isdir(directory):
        raise FileNotFoundError(
            f"The folder of the cache file {path!r} (from `cache`) does not exist. Create it or pick "
            "another path."
        )
    return path


def _buffer_size(shuffle, element_spec):
    if shuffle is not True:
        return int(shuffle)
    import tensorflow as tf

    nbytes = 0
    for spec in tf.nest.flatten(element_spec):
        shape = getattr(spec, "shape", None)
        if shape is None or not shape.is_fully_defined():
            return _DEFAULT_SHUFFLE_BUFFER
        nbytes += shape.num_elements() * spec.dtype.size
    return max(_MIN_SHUFFLE_BUFFER, min(_DEFAULT_SHUFFLE_BUFFER, _SHUFFLE_BUFFER_BYTES // max(1, nbytes)))


def _options(tf, deterministic, threadpool_size, shard):
    options = tf.data.Options()
    options.autotune.enabled = True
    options.deterministic = deterministic
    options.threading.private_threadpool_size = threadpool_size or max(_MIN_THREADPOOL, 2 * (os.cpu_count() or 1))
    if shard.sharded:  # already sharded here: a strategy must not shard it again
        from kpipe.distribute._sharding import PRESHARDED_MARKER

        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        # ...nor split its (per-worker) batch across workers: kpipe's strategy reads this.
        options.framework_type = [PRESHARDED_MARKER]
    return options


def _first_sample(ds):
    for sample in ds.take(1).as_numpy_iterator():
        return sample
    raise ValueError(
        "The dataset is empty (for this shard), so `py_map_fn`'s output shapes cannot be probed. "
        "Check the data, or pass `py_output_signature`."
    )
