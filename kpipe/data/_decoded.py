"""Samples decoded in parallel, each failure named: the engine of `from_files` and `from_packed`.

NOTE [ Naming the file that failed ]
A failing op in a parallel `map` fails the iteration with the op's message, which does not
say which file it was reading. So each epoch is built as

    key       one int64 per iteration of the dataset (a seeded `Dataset.random`), the
              "epoch" in the (seed, epoch, sample) that random crops and the file order
              are drawn from, with stateless ops only
    positions (position, sample id, key) for 0..n-1: storage order, or a permutation drawn
              from key -- the only part made per epoch (a flat_map; the maps after it are
              built once: a decoder with control flow instantiated per epoch costs ~100 ms)
    load      AUTOTUNE-parallel, in order
    drop      `ignore_errors()`: a sample whose read or decode failed is simply missing

and then, with `on_error="raise"` (the default: `named`),

    fast      load gives `(image, label)` only, and the pass is
              `load.ignore_errors().concatenate(named).take(n)`: n good samples end the pass
              before `named` is read, so a pass without a failure costs what a bare
              `map(load)` does -- no function runs per sample after the decoding map
    named     read only when a sample is missing (the pass ran short): it reads and decodes
              every file whole, in storage order, through the checked chain below, and fails
              naming the first that fails (a file that failed a crop's decode fails whole
              too); if every file decodes now, it fails saying the failure did not repeat

so the error comes at the end of the pass, after its good samples, not where the file was.
With `on_error="skip"` each pass goes through the checked chain itself:

    check     load gives `(position, key, image, label)`; a scan over the positions that
              come out (plus a sentinel n at the end): a gap at position p is the sample at
              p, named from the order (recomputed from the key, only then); "raise" fails
              there with its name, "skip" prints it with the count so far and goes on

The checked chain costs ~0.1 ms of CPU a 224x224 image on the jpeg workload (500x375
JPEGs, ~1.1 ms to decode and resize): a function call per sample after the decoding map
(the scan) and the position carried through it. The fast pass measured within noise of a
bare `map` and of Keras's own function (scripts/bench_jpeg_steps.py: "source" vs "map").
"""

import sys


def epoch_keys(seed):
    """Returns a dataset of one int64 per iteration: the same sequence for the same seed."""
    import tensorflow as tf

    return tf.data.Dataset.random(seed=seed, rerandomize_each_iteration=True).take(1)


def order(n, key, shuffle):
    """Returns the sample ids by position: `range(n)`, or a permutation drawn from `key`."""
    import tensorflow as tf

    ids = tf.range(n, dtype=tf.int64)
    if not shuffle or n < 2:
        return ids
    return tf.random.experimental.stateless_shuffle(ids, seed=tf.stack([key, tf.constant(0x5EED, tf.int64)]))


def positions(n, seed, shuffle, keyed):
    """Returns a dataset of `(position, sample id, epoch key)` for positions 0..n-1 of each epoch.

    Only this cheap stream is made per epoch (in a `flat_map`: a function with control flow
    or many ops instantiated there each epoch costs ~100 ms); the reading and decoding maps
    come after it, built once. Without `shuffle` or `keyed` the key is 0 and no flat_map is used.
    """
    import tensorflow as tf

    # Slices, not a `map` making the triples: a sequential map calls a function per element
    # (0.04-0.08 ms of CPU an image in a side-by-side test on the shared 2 cores; in
    # scripts/bench_jpeg_steps.py the change was within its noise).
    if not (shuffle or keyed):
        ids = tf.range(n, dtype=tf.int64)
        return tf.data.Dataset.from_tensor_slices((ids, ids, tf.zeros([n], tf.int64)))

    def epoch(key):
        return tf.data.Dataset.from_tensor_slices((tf.range(n, dtype=tf.int64), order(n, key, shuffle), tf.fill([n], key)))

    return epoch_keys(seed).flat_map(epoch)


def sample_seed(key, sample_id):
    """The stateless seed `[2]` of one sample in one epoch."""
    import tensorflow as tf

    return tf.stack([key, tf.cast(sample_id, tf.int64)])


def checked(loaded, n, name_of, on_error, blank, what, in_order=False):
    """Returns `loaded` (elements `(position, image, label)` with failed ones missing) as
    `(image, label)`, raising or reporting at each missing position.

    Args:
        loaded: Dataset of `(position, key, image, label)`, positions increasing, gaps where a
            sample failed (after `ignore_errors`).
        n: Number of positions.
        name_of: Function of a position and the epoch key (int64 scalar tensors) -> the
            sample's name (string tensor); called only where a sample is missing.
        on_error: "raise" or "skip".
        blank: An `(image, label)` with the dataset's dtypes, for the end sentinel.
        what: The source, for messages, e.g. "kpipe.data.from_files".
        in_order: `name_of` is cheap (no shuffle): "raise" then checks each sample with
            one `Assert`, without a `cond`.
    """
    import tensorflow as tf

    end = tf.data.Dataset.from_tensors((tf.constant(n, tf.int64), tf.constant(0, tf.int64)) + tuple(blank))
    ds = loaded.concatenate(end)

    def step(state, element):
        expected, skipped, key = state
        position = element[0]
        key = tf.where(position < n, element[1], key)  # the sentinel has no key: keep the last
        missing = position - expected

        def fail():
            check = tf.debugging.Assert(
                False,
                [f"{what}: cannot read or decode image file", name_of(tf.minimum(expected, n - 1), key),
                 "(unreadable, not a JPEG/PNG/BMP/GIF/WebP, or truncated). Remove or replace the "
                 "file, or pass on_error='skip' to skip such files."],
                summarize=1,
            )
            with tf.control_dependencies([check]):
                return tf.identity(missing)

        def report():
            names = tf.map_fn(lambda p: name_of(p, key), tf.range(expected, position), fn_output_signature=tf.string)
            tf.print(f"{what}: skipped unreadable or undecodable image file", names,
                     "-", skipped + missing, "skipped so far.", output_stream=sys.stderr, summarize=-1)
            return tf.identity(missing)

        if on_error == "raise" and in_order:
            done = tf.debugging.Assert(
                tf.equal(missing, 0),
                [f"{what}: cannot read or decode image file", name_of(tf.minimum(expected, n - 1), key),
                 "(unreadable, not a JPEG/PNG/BMP/GIF/WebP, or truncated). Remove or replace the "
                 "file, or pass on_error='skip' to skip such files."],
                summarize=1,
            )
        else:
            done = tf.cond(missing > 0, fail if on_error == "raise" else report, lambda: tf.identity(missing))
        with tf.control_dependencies([done]):
            out = tuple(tf.identity(t) for t in (element[0],) + tuple(element[2:]))
        return (position + 1, skipped + missing, key), (out if on_error == "skip" else out[1:])

    zero = tf.constant(0, tf.int64)
    ds = ds.scan((zero, zero, zero), step)
    if on_error == "raise":
        # n good samples come before the sentinel, which is read only when one is missing
        # (and then fails the check): `take` is cheaper than a filter on every sample.
        return ds.take(n)
    return ds.filter(lambda position, image, label: position < n).map(lambda position, image, label: (image, label))


def named(n, read, name_of, channels, blank, what):
    """Returns the dataset a fast "raise" pass reads only when it lost a sample (see the NOTE):
    it yields nothing, and fails naming the first of the n samples (storage order) that cannot
    be read and decoded whole, or, if all can now, saying the failure did not repeat.

    Args:
        n: Number of samples.
        read: Function of a sample id (int64 scalar tensor) -> its encoded bytes.
        name_of: Function of a sample id -> its name (string tensor).
        channels: Channels to decode to.
        blank: An `(image, label)` with the fast pass's element spec (never yielded).
        what: The source, for messages, e.g. "kpipe.data.from_files".
    """
    import tensorflow as tf

    def probe(position, j, key):
        image = tf.io.decode_image(read(j), channels=channels, expand_animations=False)
        return position, key, tf.shape(image), tf.constant(0, tf.int32)

    ds = positions(n, None, False, False).map(probe, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = checked(ds.ignore_errors(), n, lambda position, key: name_of(position), "raise",
                 (tf.zeros([3], tf.int32), tf.constant(0, tf.int32)), what, in_order=True)

    def did_not_repeat(_):
        check = tf.debugging.Assert(False, [
            f"{what}: an image file failed to read or decode in this pass, but every file reads and decodes "
            "now (a transient read error?). Iterate again, or pass on_error='skip' to skip such files."])
        with tf.control_dependencies([check]):
            return tuple(tf.identity(t) for t in blank)

    def nothing(shape, label):
        return False

    def as_blank(shape, label):
        return blank

    ds = ds.filter(nothing).map(as_blank)
    return ds.concatenate(tf.data.Dataset.from_tensors(tf.constant(0)).map(did_not_repeat))
