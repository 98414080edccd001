"""Sources that read contiguous blocks of rows: the engine behind `from_hdf5` and `from_numpy`.

NOTE [ Block reading ]
A block source is a list of *parts* (one per HDF5 file, or one for a set of NumPy arrays),
each a stack of `length` rows. Rows are numbered globally, part after part. The plan for a
shard is:

    shard range   [start, stop) of the global rows            (ShardSpec.range)
    -> blocks     (part, lo, hi) aligned to the part's grid    (multiples of the storage chunk)
    -> order      storage order, or shuffled with the seed      (tf.data shuffle of the block table)
    -> read       one reader call per block, AUTOTUNE-parallel  (tf.numpy_function)
    -> samples    unbatch, or round-robin over `cycle_length` blocks when shuffling

so each read is one contiguous, chunk-aligned slice (never one call per sample), no part
is ever loaded whole, and the shards of 1..N pipelines are disjoint and cover every row.
Reads of one HDF5 process are serialized by h5py's global lock (and the GIL), so parallel
block reads overlap I/O with the consumer rather than with each other; big blocks keep the
per-call overhead (~50-100 us) small against the read itself.
"""

import dataclasses
from typing import Any, List, Optional, Sequence

import numpy as np

from kpipe.data._sharding import ShardSpec
from kpipe.data._source import Source

# Kinds tf.data can carry as tensors: bool, signed, unsigned, float, complex.
_OK_KINDS = frozenset("biufc")
# A block aims at this many bytes of rows (all leaves together) ...
_TARGET_BLOCK_BYTES = 2 << 20
# ... within these bounds on its number of rows (before rounding up to the storage chunk).
_MIN_BLOCK_ROWS = 16
_MAX_BLOCK_ROWS = 4096
# Blocks whose rows are mixed round-robin when the source is shuffled.
_DEFAULT_CYCLE_LENGTH = 16


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of every sample: its name (for errors), dtype and per-sample shape."""

    name: str
    dtype: np.dtype
    sample_shape: tuple


def check_dtype(dtype, what: str) -> np.dtype:
    """Returns `dtype` in native byte order, or raises if tf.data cannot carry it.

    Raises:
        TypeError: for strings, objects, records, dates and other non-numeric dtypes.
    """
    dtype = np.dtype(dtype)
    if dtype.kind not in _OK_KINDS or dtype.fields is not None:
        raise TypeError(
            f"{what} has dtype {dtype}, which kpipe.data cannot read into tensors. Supported "
            "dtypes: bool, signed/unsigned integers, floats, complex. Store the data as numbers "
            "(e.g. encode strings as integer ids) or convert the array with `.astype(...)`."
        )
    return dtype.newbyteorder("=")


def block_rows(leaves: Sequence[Leaf], chunk_rows: int, block_size: Optional[int]) -> int:
    """Returns the rows per block: `block_size` or ~2 MiB of rows, rounded up to `chunk_rows`."""
    chunk_rows = max(1, int(chunk_rows))
    if block_size is None:
        row_bytes = sum(l.dtype.itemsize * int(np.prod(l.sample_shape, dtype=np.int64)) for l in leaves)
        rows = _TARGET_BLOCK_BYTES // max(1, row_bytes)
        rows = min(max(rows, _MIN_BLOCK_ROWS), _MAX_BLOCK_ROWS)
    else:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(
                f"`block_size` must be an integer >= 1. Received: block_size={block_size!r}. "
                "Pass the number of rows per read, or None to read ~2 MiB per read."
            )
        rows = block_size
    return -(-rows // chunk_rows) * chunk_rows


def plan_blocks(lengths: Sequence[int], grids: Sequence[int], shard: ShardSpec) -> np.ndarray:
    """Returns the blocks of `shard` as an int64 array of rows `(part, lo, hi)`.

    Args:
        lengths: Rows of each part.
        grids: Block rows of each part; blocks start at multiples of it (part-local rows).
        shard: Which contiguous part of the global rows to cover.
    """
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    start, stop = shard.range(int(offsets[-1]))
    out = []
    for part, (length, grid) in enumerate(zip(lengths, grids)):
        a, b = max(start - offsets[part], 0), min(stop - offsets[part], length)
        if a >= b:
            continue
        edges = np.arange((a // grid + 1) * grid, b, grid, dtype=np.int64)
        los = np.concatenate([[a], edges])
        his = np.concatenate([edges, [b]])
        out.append(np.stack([np.full_like(los, part), los, his], axis=1))
    if not out:
        return np.zeros((0, 3), np.int64)
    return np.concatenate(out).astype(np.int64)


class BlockSource(Source):
    """A `Source` over parts read in contiguous blocks by a thread-safe `reader`.

    Args:
        what: Description for error messages.
        leaves: The arrays of a sample.
        structure: A nest (tuple/dict) of leaf indices giving the element structure.
        lengths: Rows per part.
        grids: Block rows per part.
        reader: Object with `read(part, lo, hi, leaf_ids) -> list of arrays`; called from
            several tf.data threads at once.
        label_leaf: Index of the label leaf, if the labels are one leaf. Defaults to None.
        cycle_length: Blocks mixed round-robin when shuffled. Defaults to 16.
    """

    def __init__(self, *, what, leaves, structure, lengths, grids, reader, label_leaf=None, cycle_length=None):
        self.what = what
        self.leaves: List[Leaf] = list(leaves)
        self.structure = structure
        self.lengths = [int(n) for n in lengths]
        self.grids = [int(g) for g in grids]
        self.reader = reader
        self.label_leaf = label_leaf
        self.cycle_length = _DEFAULT_CYCLE_LENGTH if cycle_length is None else int(cycle_length)

    @property
    def num_samples(self) -> int:
        return sum(self.lengths)

    def build(self, shard: ShardSpec, shuffle: bool = False, seed: Optional[int] = None):
        import tensorflow as tf

        blocks = plan_blocks(self.lengths, self.grids, shard)
        ds = tf.data.Dataset.from_tensor_slices(blocks)
        shuffle = shuffle and len(blocks) > 1
        if shuffle:
            ds = ds.shuffle(len(blocks), seed=seed, reshuffle_each_iteration=True)
        ids = list(range(len(self.leaves)))
        ds = ds.map(
            lambda row: tuple(self._read_tf(row, ids)), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
        )
        if shuffle:
            ds = ds.interleave(
                lambda *arrays: tf.data.Dataset.from_tensor_slices(arrays),
                cycle_length=min(self.cycle_length, len(blocks)),
                block_length=1,
            )
        else:
            ds = ds.unbatch()
        structure = self.structure
        ds = ds.map(lambda *flat: tf.nest.map_structure(lambda i: flat[i], structure))
        # A known length lets Keras size epochs and progress bars (and catches shrunk data).
        return ds.apply(tf.data.experimental.assert_cardinality(int(blocks[:, 2].sum() - blocks[:, 1].sum())))

    def _read_tf(self, row, ids):
        import tensorflow as tf

        tout = [tf.as_dtype(self.leaves[i].dtype) for i in ids]
        outs = tf.numpy_function(lambda r: self._read_np(r, ids), [row], tout, stateful=False)
        for i, t in zip(ids, outs):
            t.set_shape((None,) + self.leaves[i].sample_shape)
        return outs

    # NOTE [ A block TensorFlow may write into ]
    # `tf.numpy_function` wraps a returned array without a copy, and TensorFlow then treats
    # the memory as its own: an op whose input it is the last user of may write its output
    # there (buffer forwarding). A block sliced out of the user's in-memory array is a view
    # of it, so on TF 2.16 `map(lambda x, y: (x, y + 1))` after a shuffled `from_numpy`
    # added 1 to the user's `y[0]` every pass (and a view of a read-only memmap would fault).
    # A read that is not an array of its own is copied: one memcpy per block.
    def _read_np(self, row, ids):
        part, lo, hi = (int(v) for v in row)
        arrays = self.reader.read(part, lo, hi, ids)
        out = []
        for i, a in zip(ids, arrays):
            leaf = self.leaves[i]
            a = np.ascontiguousarray(a, dtype=leaf.dtype)
            if a.shape != (hi - lo,) + leaf.sample_shape:
                raise ValueError(
                    f"{self.what}: reading rows {lo}:{hi} of part {part} gave {leaf.name} with "
                    f"shape {a.shape}, expected {(hi - lo,) + leaf.sample_shape}. The data changed "
                    "after the dataset was created; recreate it."
                )
            if not a.flags.owndata or not a.flags.writeable:
                a = a.copy()  # see NOTE [ A block TensorFlow may write into ]
            out.append(a)
        return out

    def labels(self) -> Optional[np.ndarray]:
        if self.label_leaf is None:
            return None
        blocks = plan_blocks(self.lengths, self.grids, ShardSpec())
        parts = [self.reader.read(int(p), int(lo), int(hi), [self.label_leaf])[0] for p, lo, hi in blocks]
        if not parts:
            return np.zeros((0,), np.int64)
        return np.concatenate([np.asarray(p) for p in parts])


def flatten_keys(x: Any, y: Any, what_x: str = "x", what_y: str = "y"):
    """Turns the `x`/`y` arguments (a key, or a tuple/list/dict of keys) into leaves.

    Returns:
        `(keys, structure, label_leaf)`: the flat list of keys (or arrays), the element
        structure as a nest of indices into it, and the index of `y` if `y` is one leaf.
    """
    keys: list = []

    def walk(node, path):
        if isinstance(node, dict):
            return {k: walk(v, f"{path}[{k!r}]") for k, v in node.items()}
        if isinstance(node, (tuple, list)):
            if not node:
                raise ValueError(f"`{path}` is an empty {type(node).__name__}. Pass at least one item.")
            return tuple(walk(v, f"{path}[{i}]") for i, v in enumerate(node))
        keys.append((node, path))
        return len(keys) - 1

    if x is None:
        raise ValueError(f"`{what_x}` is required. Received: {what_x}=None.")
    sx = walk(x, what_x)
    if y is None:
        return keys, sx, None
    sy = walk(y, what_y)
    return keys, (sx, sy), (sy if isinstance(sy, int) else None)
