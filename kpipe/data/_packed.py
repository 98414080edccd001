"""`kpipe.data.from_packed`: (image, label) samples from the HDF5 shards `kpipe pack` writes."""

import threading

import numpy as np

from kpipe.data._decoded import positions, sample_seed
from kpipe.data._jpeg import Decoder, check_augment_args
from kpipe.data._packed_images import read_index
from kpipe.data._paths import expand_paths
from kpipe.data._sharding import resolve_shard
from kpipe.data._source import Source, attach


def from_packed(paths, *, image_size=(256, 256), channels=3, crop=None, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3),
                flip=False, center_fraction=0.875, seed=None, block_size=256, input_context=None, num_shards=None,
                index=None):
    """Returns a `tf.data.Dataset` of `(image, label)` from packed image shards.

    Reads the HDF5 shards `kpipe.data.pack` (or `kpipe pack`) wrote, `block_size` encoded
    images per read (one HDF5 read instead of one file open per image), and decodes them
    as `from_files` does, with the same crops (`crop`, `scale`, `ratio`, `flip`,
    `center_fraction`: see `from_files`), drawn from `(seed, epoch, image)`. Images were
    decoded once when packed (`validate=True`), so decoding is not checked again here.
    Sharding assigns blocks round robin; `kpipe.data.pipeline(..., shuffle=...)` reads the
    blocks in a new seeded order each epoch before its shuffle buffer mixes the images.

    Args:
        paths: The shards: a path, a glob pattern ("packed/train-*.h5"), or a list of them.
        image_size: `(height, width)`, or None to keep each image's size (uint8). Defaults
            to (256, 256).
        channels: 1 or 3. Defaults to 3.
        crop: None, "random" or "center", as in `from_files`. Defaults to None.
        scale: The random crop's area range, as in `from_files`. Defaults to (0.08, 1.0).
        ratio: The random crop's aspect range, as in `from_files`. Defaults to (3/4, 4/3).
        flip: Flip left-right with probability 1/2, as in `from_files`. Defaults to False.
        center_fraction: The center crop's side fraction, as in `from_files`. Defaults to 0.875.
        seed: Seed of the crops and flips (and of the order when shuffled), as in `from_files`.
        block_size: Images per read. Defaults to 256.
        input_context: A `tf.distribute.InputContext` to shard by, as in `from_files`.
        num_shards: Split the images into this many shards, as in `from_files`.
        index: The shard to read, with `num_shards`.

    Returns:
        A `tf.data.Dataset` of `(image, label)`, with the class names in its
        `class_names` attribute.

    Raises:
        FileNotFoundError: if a path does not exist.
        ValueError: if a file is not a complete kpipe pack, the shards disagree on the class
            names, or an argument is invalid.

    Example:

    >>> import os, tempfile, numpy as np, PIL.Image, kpipe
    >>> tmp = tempfile.TemporaryDirectory()
    >>> os.makedirs(os.path.join(tmp.name, "photos", "cat"))
    >>> PIL.Image.fromarray(np.zeros((40, 60, 3), "uint8")).save(os.path.join(tmp.name, "photos", "cat", "0.jpg"))
    >>> out = kpipe.data.pack(os.path.join(tmp.name, "photos"), os.path.join(tmp.name, "packed"), verbose=False)
    >>> ds = kpipe.data.from_packed(os.path.join(tmp.name, "packed-*.h5"), image_size=(8, 8), crop="random", seed=0)
    >>> [image.shape for image, label in ds.as_numpy_iterator()], ds.class_names
    ([(8, 8, 3)], ['cat'])
    >>> tmp.cleanup()
    """
    shard = resolve_shard(input_context, num_shards, index)
    if channels not in (1, 3):
        raise ValueError(f"`channels` must be 1 or 3. Received: channels={channels!r}.")
    if image_size is not None and (not isinstance(image_size, (tuple, list)) or len(image_size) != 2
                                   or not all(isinstance(s, int) and s > 0 for s in image_size)):
        raise ValueError(f"`image_size` must be (height, width) of positive integers or None. Received: image_size={image_size!r}.")
    check_augment_args(image_size, crop, scale, ratio, flip, center_fraction)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"`block_size` must be an integer >= 1. Received: block_size={block_size!r}.")
    files = expand_paths(paths, "paths", "packed HDF5")
    names, labels, offsets = read_index(files)
    decoder = Decoder(None if image_size is None else tuple(image_size), channels, crop, tuple(scale), tuple(ratio),
                      flip, float(center_fraction))
    source = _PackedSource(files, labels, offsets, decoder, block_size, seed)
    ds = attach(source.build(shard), source, shard)
    ds.class_names = list(names)
    return ds


class _PackedSource(Source):
    def __init__(self, files, labels, offsets, decoder, block_size, seed):
        self.what = f"from_packed({files[0]!r}{', ...' if len(files) > 1 else ''})"
        self.files = files
        self.label_array = np.concatenate(labels).astype(np.int32)
        self.offsets = offsets
        starts = np.cumsum([0] + [len(x) for x in labels])
        # (file, lo, hi, first global id) of every block
        self.blocks = np.asarray([(k, lo, min(lo + block_size, len(x)), starts[k] + lo)
                                  for k, x in enumerate(labels) for lo in range(0, len(x), block_size)], np.int64).reshape(-1, 4)
        self.decoder = decoder
        self.seed = seed
        self._open = {}
        self._lock = threading.Lock()

    def labels(self):
        return self.label_array

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_open", "_lock")}

    def __setstate__(self, state):
        self.__dict__.update(state, _open={}, _lock=threading.Lock())

    def _read(self, block):
        import h5py

        k, lo, hi, first = (int(v) for v in block)
        with self._lock:
            f = self._open.get(k)
            if f is None:
                f = self._open[k] = h5py.File(self.files[k], "r")
            off = self.offsets[k][lo:hi + 1]
            blob = f["bytes"][off[0]:off[-1]].tobytes()
        off = off - off[0]
        data = np.asarray([blob[a:b] for a, b in zip(off[:-1], off[1:])], dtype=object)
        return np.arange(first, first + hi - lo, dtype=np.int64), data

    def build(self, shard, shuffle=False, seed=None):
        import tensorflow as tf

        blocks = tf.constant(self.blocks[shard.index::shard.num_shards])
        n_blocks = int(blocks.shape[0])
        count = int((self.blocks[shard.index::shard.num_shards, 2] - self.blocks[shard.index::shard.num_shards, 1]).sum())
        labels = tf.constant(self.label_array)
        decoder, seed = self.decoder, self.seed if seed is None else seed

        def read(block):
            ids, data = tf.numpy_function(self._read, [block], (tf.int64, tf.string), stateful=False)
            ids.set_shape([None])
            data.set_shape([None])
            return ids, data

        def decode(i, data, key):
            return decoder(data, sample_seed(key, i) if decoder.random else None), tf.gather(labels, i)

        def read_keyed(block, key):
            ids, data = read(block)
            return ids, data, tf.fill(tf.shape(ids), key)

        # block order and epoch key per epoch (cheap, in positions' flat_map); reads and decodes built once
        ds = positions(n_blocks, seed, shuffle, decoder.random).map(lambda p, k, key: (tf.gather(blocks, k), key))
        ds = ds.map(read_keyed, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
        ds = ds.map(lambda i, data, key: decode(i, data, key), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return ds.apply(tf.data.experimental.assert_cardinality(count))
