"""`kpipe.data.from_files`: (image, label) samples from a folder with one sub-folder per class."""

import os
import sys

import numpy as np

from kpipe.data._sharding import resolve_shard
from kpipe.data._source import Source, attach

_DEFAULT_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
_ON_ERROR = ("raise", "skip")


def from_files(
    directory,
    *,
    image_size=(256, 256),
    channels=3,
    class_names=None,
    extensions=_DEFAULT_EXTENSIONS,
    on_error="raise",
    input_context=None,
    num_shards=None,
    index=None,
):
    """Returns a `tf.data.Dataset` of `(image, label)` from an image folder.

    The folder holds one sub-folder per class (`directory/cat/1.jpg`, `directory/dog/2.png`,
    ...); labels are the classes' positions in `class_names` (sorted folder names by
    default). Files are decoded (JPEG, PNG, BMP, GIF) and resized with TensorFlow ops, many
    in parallel. Images come out as float32 in [0, 255] of shape `image_size + (channels,)`.
    Sharding assigns files to shards round robin (file `i` to shard `i % num_shards`), so
    each shard sees every class.

    Args:
        directory: The folder.
        image_size: `(height, width)` to resize to, or None to keep each image's size (then
            images stay uint8 and must share a size to be batched). Defaults to (256, 256).
        channels: 1, 3 or 4 color channels to decode to. Defaults to 3.
        class_names: Sub-folders to use, in label order. Defaults to None (every
            sub-folder, sorted).
        extensions: File name endings that count as images (case-insensitive). Defaults to
            (".jpg", ".jpeg", ".png", ".bmp", ".gif").
        on_error: What to do with a file that cannot be decoded: "raise" fails the
            iteration with an error naming the file; "skip" drops it and prints its name with
            the number skipped so far to stderr. Defaults to "raise".
        input_context: A `tf.distribute.InputContext`; read only the files of its input
            pipeline. Defaults to None.
        num_shards: Split the files into this many shards (instead of `input_context`).
            Defaults to None (no sharding).
        index: The shard to read, with `num_shards`. Defaults to None.

    Returns:
        A `tf.data.Dataset` of `(image, label)` in sorted file order, with the class names
        in its `class_names` attribute.

    Raises:
        FileNotFoundError: if `directory` or a folder in `class_names` does not exist.
        ValueError: if there are no class folders or no images, or an argument is invalid.
        tf.errors.InvalidArgumentError: while iterating, for an undecodable file with
            `on_error="raise"`; the message names the file.

    Example:

    >>> import os, tempfile, numpy as np, tensorflow as tf, kpipe
    >>> tmp = tempfile.TemporaryDirectory()
    >>> for c in ("cat", "dog"):
    ...     os.makedirs(os.path.join(tmp.name, c))
    ...     tf.io.write_file(os.path.join(tmp.name, c, "0.png"), tf.io.encode_png(np.zeros((8, 8, 3), "uint8")))
    >>> ds = kpipe.data.from_files(tmp.name, image_size=(4, 4))
    >>> [(image.shape, int(label)) for image, label in ds.as_numpy_iterator()]
    [((4, 4, 3), 0), ((4, 4, 3), 1)]
    >>> tmp.cleanup()
    """
    shard = resolve_shard(input_context, num_shards, index)
    _check_args(image_size, channels, on_error, extensions)
    directory = os.fsdecode(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"`directory` {directory!r} is not an existing folder. Check the path.")
    names = _class_names(directory, class_names)
    exts = tuple(e.lower() for e in extensions)
    paths, labels = [], []
    for label, name in enumerate(names):
        found = []
        for root, dirs, files in os.walk(os.path.join(directory, name)):
            dirs.sort()
            found.extend(os.path.join(root, f) for f in sorted(files) if f.lower().endswith(exts))
        paths.extend(found)
        labels.extend([label] * len(found))
    if not paths:
        raise ValueError(
            f"No images in the class folders of {directory!r} (classes {names}, extensions "
            f"{list(exts)}). Put image files in the class folders or change `extensions`."
        )
    source = _FileSource(directory, names, paths, labels, image_size, channels, on_error)
    ds = attach(source.build(shard), source, shard)
    ds.class_names = list(names)
    return ds


def _check_args(image_size, channels, on_error, extensions):
    if image_size is not None and (
        not isinstance(image_size, (tuple, list))
        or len(image_size) != 2
        or not all(isinstance(s, int) and s > 0 for s in image_size)
    ):
        raise ValueError(
            f"`image_size` must be (height, width) of positive integers or None. Received: "
            f"image_size={image_size!r}."
        )
    if channels not in (1, 3, 4):
        raise ValueError(f"`channels` must be 1, 3 or 4. Received: channels={channels!r}.")
    if on_error not in _ON_ERROR:
        raise ValueError(
            f"`on_error` must be one of {_ON_ERROR}. Received: on_error={on_error!r}. Use "
            "'raise' to stop at a bad file or 'skip' to drop it."
        )
    if isinstance(extensions, str) or not extensions:
        raise ValueError(
            f"`extensions` must be a non-empty tuple of file name endings. Received: "
            f"extensions={extensions!r}, e.g. ('.jpg', '.png')."
        )


def _class_names(directory, class_names):
    if class_names is None:
        names = sorted(e.name for e in os.scandir(directory) if e.is_dir())
        if not names:
            raise ValueError(
                f"{directory!r} has no sub-folders. Put each class's images in its own "
                "sub-folder, e.g. directory/cat/*.jpg and directory/dog/*.jpg."
            )
        return names
    names = [str(n) for n in class_names]
    for n in names:
        if not os.path.isdir(os.path.join(directory, n)):
            raise FileNotFoundError(
                f"Class folder {n!r} from `class_names` does not exist in {directory!r}. Pass "
                "the names of existing sub-folders."
            )
    if len(set(names)) != len(names):
        raise ValueError(f"`class_names` has duplicates. Received: class_names={class_names!r}.")
    return names


class _FileSource(Source):
    """Image files and their labels; decodes a shard's files in parallel with TF ops."""

    def __init__(self, directory, class_names, paths, labels, image_size, channels, on_error):
        self.what = f"from_files({directory!r})"
        self.class_names = class_names
        self.paths = np.asarray(paths, dtype=object)
        self.label_array = np.asarray(labels, dtype=np.int32)
        self.image_size = None if image_size is None else tuple(image_size)
        self.channels = channels
        self.on_error = on_error

    def labels(self):
        # With on_error="skip" the samples are the files that decode, known only by decoding:
        # None makes `class_weights` read the labels the dataset yields.
        return self.label_array if self.on_error == "raise" else None

    def build(self, shard, shuffle=False, seed=None):
        import tensorflow as tf

        take = np.arange(shard.index, len(self.paths), shard.num_shards)
        ds = tf.data.Dataset.from_tensor_slices(
            (tf.constant(self.paths[take].astype(str).tolist(), tf.string), self.label_array[take])
        )
        if shuffle and len(take) > 1:
            ds = ds.shuffle(len(take), seed=seed, reshuffle_each_iteration=True)
        # NOTE: decoding runs inside a one-element dataset with `ignore_errors`, so a failure
        # becomes an `ok=False` element that still carries its path: the error (or the skip
        # notice) can then name the file, which a failing op in a plain `map` cannot.
        ds = ds.interleave(self._try_decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        if self.on_error == "raise":
            ds = ds.map(_raise_if_failed, num_parallel_calls=tf.data.AUTOTUNE)
            return ds.apply(tf.data.experimental.assert_cardinality(len(take)))
        skipped = tf.Variable(0, dtype=tf.int64, trainable=False, name="kpipe_skipped_images")
        return ds.filter(lambda path, image, label, ok: _count_skip(skipped, path, ok)).map(
            lambda path, image, label, ok: (image, label)
        )

    def _decode(self, path):
        import tensorflow as tf

        image = tf.io.decode_image(tf.io.read_file(path), channels=self.channels, expand_animations=False)
        if self.image_size is not None:
            image = tf.image.resize(image, self.image_size)
        return image

    def _try_decode(self, path, label):
        import tensorflow as tf

        decoded = tf.data.Dataset.from_tensors(path).map(lambda p: (self._decode(p), True))
        decoded = decoded.ignore_errors()
        if self.image_size is None:
            blank = tf.zeros([0, 0, self.channels], tf.uint8)
        else:
            blank = tf.zeros(list(self.image_size) + [self.channels], tf.float32)
        failed = tf.data.Dataset.from_tensors((blank, False))
        return decoded.concatenate(failed).take(1).map(lambda image, ok: (path, image, label, ok))


def _raise_if_failed(path, image, label, ok):
    import tensorflow as tf

    check = tf.debugging.Assert(
        ok,
        [
            "kpipe.data.from_files: cannot decode image file",
            path,
            "(not a JPEG/PNG/BMP/GIF, or corrupt). Remove or replace the file, or pass "
            "on_error='skip' to skip undecodable files.",
        ],
    )
    with tf.control_dependencies([check]):
        return tf.identity(image), label


def _count_skip(counter, path, ok):
    import tensorflow as tf

    def report():
        n = counter.assign_add(1)
        tf.print(
            "kpipe.data.from_files: skipped undecodable image file", path, "-", n, "skipped so far.",
            output_stream=sys.stderr,
        )
        return ok

    return tf.cond(ok, lambda: ok, report)
