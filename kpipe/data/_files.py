"""`kpipe.data.from_files`: (image, label) samples from a folder with one sub-folder per class."""

import os

import numpy as np

from kpipe.data._decoded import checked, named, order, positions, sample_seed
from kpipe.data._jpeg import Decoder, check_augment_args
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
    crop=None,
    scale=(0.08, 1.0),
    ratio=(3 / 4, 4 / 3),
    flip=False,
    center_fraction=0.875,
    seed=None,
    input_context=None,
    num_shards=None,
    index=None,
):
    """Returns a `tf.data.Dataset` of `(image, label)` from an image folder.

    The folder holds one sub-folder per class (`directory/cat/1.jpg`, `directory/dog/2.png`,
    ...); labels are the classes' positions in `class_names` (sorted folder names by
    default). Files are decoded (JPEG, PNG, BMP, GIF, WebP, told by their bytes, not their
    names) and resized with TensorFlow ops, many in parallel. Images come out as float32 in
    [0, 255] of shape `image_size + (channels,)`. Sharding assigns files to shards round
    robin (file `i` to shard `i % num_shards`), so each shard sees every class.

    With `crop=None` the work is `keras.utils.image_dataset_from_directory`'s (whole image,
    bilinear resize) and so is the output. `crop="random"` is the random-resized crop of
    Inception / Goyal et al. and `crop="center"` the evaluation crop, fused into the decode:
    only the crop of a JPEG is decoded, at 1/2..1/8 scale in the DCT domain when it is at
    least twice the output; other formats are decoded whole and cropped. Random draws depend
    on `(seed, epoch, file)` only (stateless ops), whatever the threads or shards.

    As in Keras: files are picked by `extensions` (a `notes.txt` is not read), EXIF
    orientation is not applied (pixels come in stored order: `decode_image` ignores it, and
    so does Keras's function), grayscale and CMYK JPEGs and RGBA PNGs are converted to
    `channels`, and an empty class folder keeps its label (no samples). Unlike Keras, a file
    that cannot be read or decoded (unreadable, truncated, not an image) is named.

    Args:
        directory: The folder.
        image_size: `(height, width)` to resize to, or None to keep each image's size (then
            images stay uint8 and must share a size to be batched). Defaults to (256, 256).
        channels: 1, 3 or 4 color channels to decode to. Defaults to 3.
        class_names: Sub-folders to use, in label order. Defaults to None (every
            sub-folder, sorted).
        extensions: File name endings that count as images (case-insensitive). Defaults to
            (".jpg", ".jpeg", ".png", ".bmp", ".gif").
        on_error: What to do with a file that cannot be read or decoded: "raise" fails the
            iteration with an error naming the file, at the end of the pass (after its good
            samples: a pass without a failure then costs nothing for the naming); "skip" drops
            it and prints its name with the number skipped so far in this pass to stderr.
            Defaults to "raise".
        crop: None (resize the whole image), "random" (random-resized crop) or "center"
            (central square of `center_fraction` of the shorter side). Defaults to None.
        scale: With `crop="random"`, the range of the crop's area as a fraction of the
            image's. Defaults to (0.08, 1.0).
        ratio: With `crop="random"`, the range of the crop's width / height. Defaults to
            (3/4, 4/3).
        flip: Flip each image left-right with probability 1/2. Defaults to False.
        center_fraction: With `crop="center"`, the crop's side as a fraction of the
            shorter side. Defaults to 0.875 (224 of 256).
        seed: Seed of the random crops and flips (and of the file order when
            `kpipe.data.pipeline(..., shuffle=...)` gets no seed of its own). Defaults to
            None (random).
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
        tf.errors.InvalidArgumentError: while iterating, at the end of a pass in which a file
            failed with `on_error="raise"`; the message names the file (the first, in storage
            order, that fails to read or decode).

    Example:

    >>> import os, tempfile, numpy as np, tensorflow as tf, kpipe
    >>> tmp = tempfile.TemporaryDirectory()
    >>> for c in ("cat", "dog"):
    ...     os.makedirs(os.path.join(tmp.name, c))
    ...     tf.io.write_file(os.path.join(tmp.name, c, "0.png"), tf.io.encode_png(np.zeros((8, 8, 3), "uint8")))
    >>> ds = kpipe.data.from_files(tmp.name, image_size=(4, 4))
    >>> [(image.shape, int(label)) for image, label in ds.as_numpy_iterator()]
    [((4, 4, 3), 0), ((4, 4, 3), 1)]
    >>> train = kpipe.data.from_files(tmp.name, image_size=(4, 4), crop="random", flip=True, seed=0)
    >>> [image.shape for image, label in train.as_numpy_iterator()]
    [(4, 4, 3), (4, 4, 3)]
    >>> tmp.cleanup()
    """
    shard = resolve_shard(input_context, num_shards, index)
    _check_args(image_size, channels, on_error, extensions)
    check_augment_args(image_size, crop, scale, ratio, flip, center_fraction)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ValueError(f"`seed` must be an integer or None. Received: seed={seed!r}.")
    directory = os.fsdecode(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"`directory` {directory!r} is not an existing folder. Check the path.")
    names, paths, labels = list_files(directory, class_names, extensions)
    decoder = Decoder(None if image_size is None else tuple(image_size), channels, crop, tuple(scale), tuple(ratio),
                      flip, float(center_fraction))
    source = _FileSource(directory, names, paths, labels, decoder, on_error, seed)
    ds = attach(source.build(shard), source, shard)
    ds.class_names = list(names)
    return ds


def list_files(directory, class_names, extensions):
    """Returns `(class names, paths, labels)` of the image folder, in sorted order.

    Raises:
        FileNotFoundError, ValueError: as `from_files` documents.
    """
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
    return names, paths, labels


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
    """Image files and their labels; reads and decodes a shard's files in parallel with TF ops."""

    shuffles_samples = True  # (a stateless permutation of every file per epoch: `order` in _decoded.py)

    def __init__(self, directory, class_names, paths, labels, decoder, on_error, seed):
        self.what = f"from_files({directory!r})"
        self.class_names = class_names
        self.paths = np.asarray(paths, dtype=object)
        self.label_array = np.asarray(labels, dtype=np.int32)
        self.decoder = decoder
        self.on_error = on_error
        self.seed = seed

    def labels(self):
        # With on_error="skip" the samples are the files that decode, known only by decoding:
        # None makes `class_weights` read the labels the dataset yields.
        return self.label_array if self.on_error == "raise" else None

    def build(self, shard, shuffle=False, seed=None):
        import tensorflow as tf

        take = np.arange(shard.index, len(self.paths), shard.num_shards)
        n = len(take)
        paths = tf.constant(self.paths[take].astype(str).tolist(), tf.string)
        labels = tf.constant(self.label_array[take])
        ids = tf.constant(take, tf.int64)  # a file's id, the same in every shard layout
        decoder, seed = self.decoder, self.seed if seed is None else seed

        def load(position, j, key):
            data = tf.io.read_file(paths[j])
            return position, key, decoder(data, sample_seed(key, ids[j]) if decoder.random else None), labels[j]

        if self.on_error == "raise":
            # see NOTE [ Naming the file that failed ] in _decoded.py: a pass of n good samples
            # never reads `named`; a failed one is named after the pass by a second look
            def fast(position, j, key):
                return load(position, j, key)[2:]

            def read(j):
                return tf.io.read_file(paths[j])

            def name_of(j):
                return paths[j]

            ds = positions(n, seed, shuffle, decoder.random)
            ds = ds.map(fast, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).ignore_errors()
            ds = ds.concatenate(named(n, read, name_of, decoder.channels, (decoder.blank(), tf.constant(0, tf.int32)),
                                      "kpipe.data.from_files"))
            return ds.take(n).apply(tf.data.experimental.assert_cardinality(n))
        ds = positions(n, seed, shuffle, decoder.random)
        ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).ignore_errors()
        return checked(ds, n, lambda position, key: paths[order(n, key, shuffle)[position]], self.on_error,
                       (decoder.blank(), tf.constant(0, tf.int32)), "kpipe.data.from_files", in_order=not shuffle)
