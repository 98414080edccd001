"""`kpipe.data.from_numpy`: samples from in-memory arrays or memory-mapped `.npy` files."""

import os

import numpy as np

from kpipe.data._blocks import BlockSource, Leaf, block_rows, check_dtype, flatten_keys
from kpipe.data._sharding import resolve_shard
from kpipe.data._source import attach


def from_numpy(x, y=None, *, block_size=None, input_context=None, num_shards=None, index=None):
    """Returns a `tf.data.Dataset` of the rows of NumPy arrays or `.npy` files.

    Unlike `tf.data.Dataset.from_tensor_slices`, the arrays are not copied into the graph
    (no 2 GB limit, no second copy in memory): rows are sliced out in contiguous blocks
    when the dataset is iterated. A `.npy` path is memory-mapped, so only the rows that are
    read are loaded. The dataset holds Python references to the arrays and cannot be
    serialized (e.g. for the tf.data service); it may be iterated from several threads.

    Args:
        x: An array, a path to a `.npy` file, or a tuple/list/dict of them (several
            inputs). The first dimension indexes samples.
        y: Targets in the same forms. Defaults to None (the elements are `x` alone).
        block_size: Rows per read. Defaults to None (about 2 MiB of rows per read).
        input_context: A `tf.distribute.InputContext`; read only the rows of its input
            pipeline. Defaults to None.
        num_shards: Split the rows into this many contiguous shards (instead of
            `input_context`). Defaults to None (no sharding).
        index: The shard to read, with `num_shards`. Defaults to None.

    Returns:
        A `tf.data.Dataset` of single samples in row order: `x`, or `(x, y)`.

    Raises:
        FileNotFoundError: if a `.npy` file does not exist.
        TypeError: if an array has a dtype tensors cannot hold (strings, objects, ...).
        ValueError: if the arrays differ in their number of rows, or a file is not `.npy`.

    Example:

    >>> import numpy as np, kpipe
    >>> ds = kpipe.data.from_numpy(np.arange(12).reshape(6, 2), np.arange(6) % 2)
    >>> x, y = next(ds.as_numpy_iterator())
    >>> x.tolist(), int(y)
    ([0, 1], 0)
    """
    shard = resolve_shard(input_context, num_shards, index)
    items, structure, label_leaf = flatten_keys(x, y)
    arrays, leaves = [], []
    for value, arg in items:
        array = _as_array(value, arg)
        dtype = check_dtype(array.dtype, f"`{arg}`")
        if array.ndim == 0:
            raise ValueError(
                f"`{arg}` is a scalar. Received: {arg}={array!r}. Pass an array whose first "
                "dimension indexes samples."
            )
        arrays.append(array)
        leaves.append(Leaf(f"`{arg}`", dtype, tuple(int(s) for s in array.shape[1:])))
    n = len(arrays[0])
    for array, (_, arg) in zip(arrays, items):
        if len(array) != n:
            raise ValueError(
                f"`{arg}` has {len(array)} rows but `{items[0][1]}` has {n}. Every array must have "
                "one row per sample; pass arrays of equal length."
            )
    source = BlockSource(
        what="from_numpy",
        leaves=leaves,
        structure=structure,
        lengths=[n],
        grids=[block_rows(leaves, 1, block_size)],
        reader=_ArrayReader(arrays),
        label_leaf=label_leaf,
    )
    return attach(source.build(shard), source, shard)


def _as_array(value, arg):
    if isinstance(value, (str, bytes, os.PathLike)):
        path = os.fsdecode(value)
        if not os.path.exists(path):
            raise FileNotFoundError(f"NumPy file {path!r} (from `{arg}`) does not exist. Check the path.")
        if not path.endswith(".npy"):
            raise ValueError(
                f"`{arg}` names {path!r}, which is not a `.npy` file. Only `.npy` files can be "
                "memory-mapped; load other formats yourself and pass the arrays."
            )
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:  # object arrays cannot be memory-mapped
            raise TypeError(
                f"Cannot memory-map {path!r} (from `{arg}`): {exc}. Store numeric arrays "
                "(bool, integers, floats, complex)."
            ) from None
    if hasattr(value, "numpy") and callable(value.numpy):  # a tf.Tensor
        value = value.numpy()
    return value if isinstance(value, np.ndarray) else np.asarray(value)


class _ArrayReader:
    """Slices blocks of rows out of arrays; thread-safe (reads only)."""

    def __init__(self, arrays):
        self.arrays = arrays

    def read(self, part, lo, hi, ids):
        return [self.arrays[i][lo:hi] for i in ids]
