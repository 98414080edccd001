"""`kpipe.data.from_hdf5`: samples from one or many HDF5 files, read in chunk-aligned blocks."""

import collections
import errno
import re
import threading
import weakref
from typing import List

import numpy as np

from kpipe.data._blocks import BlockSource, Leaf, block_rows, check_dtype, flatten_keys
from kpipe.data._paths import expand_paths
from kpipe.data._sharding import resolve_shard
from kpipe.data._source import attach

# Idle h5py handles kept open for reuse, over all files (least recently used closed first).
_MAX_IDLE_HANDLES = 64
# h5py's per-dataset chunk cache; holds a few chunks of the label array between blocks.
_CHUNK_CACHE_BYTES = 4 << 20


def from_hdf5(paths, x, y=None, *, block_size=None, input_context=None, num_shards=None, index=None):
    """Returns a `tf.data.Dataset` of the samples stored in HDF5 files.

    Each element is one sample: `x`, or `(x, y)` when `y` is given, with the structure of
    the `x`/`y` arguments (a key gives a tensor, a tuple/dict of keys gives a tuple/dict of
    tensors). Rows are read in contiguous blocks aligned to the files' chunks (one h5py
    call per block, never per sample, never the whole file), several blocks in parallel.
    Works with chunked and compressed (gzip, lzf, ...) files.

    Files are opened lazily and a handle is used by one reading thread at a time (h5py
    objects are not safe to share between threads); handles are reused across reads and
    epochs and closed when the dataset is garbage collected. h5py serializes all reads of
    a process behind one lock (measured: 1, 2 or 4 threads read a gzip file at the same
    rate), so parallel reads overlap I/O with training rather than with each other; what
    makes reading fast is one call per chunk-aligned block instead of one per sample. The returned dataset may be iterated from several threads; it
    holds Python state and cannot be serialized (e.g. for the tf.data service).

    Pass the result to `kpipe.data.pipeline` to shard, shuffle, map and batch it: the
    pipeline shards and shuffles at the source (block order) instead of reading all data.

    Args:
        paths: An HDF5 file, a glob pattern, or a list of them. All files must have the
            datasets named by `x` and `y`, with the same dtypes and per-sample shapes.
        x: Name of the input dataset in each file (e.g. `"images"` or `"group/images"`),
            or a tuple/list/dict of names for several inputs.
        y: Name (or tuple/dict of names) of the target dataset. Defaults to None (the
            elements are `x` alone).
        block_size: Rows per read, rounded up to a multiple of the storage chunk. Defaults
            to None (about 2 MiB of rows per read).
        input_context: A `tf.distribute.InputContext`; read only the rows of its input
            pipeline. Defaults to None.
        num_shards: Split the rows into this many contiguous shards (instead of
            `input_context`). Defaults to None (no sharding).
        index: The shard to read, with `num_shards`. Defaults to None.

    Returns:
        A `tf.data.Dataset` of single samples, in storage order (file after file).

    Raises:
        FileNotFoundError: if a file does not exist.
        PermissionError: if this user may not read a file.
        BlockingIOError: if a file is locked by a process writing it (HDF5 file locking).
        KeyError: if a file lacks a dataset named in `x`/`y`.
        TypeError: if a dataset has a dtype tensors cannot hold (strings, compound, ...).
        ValueError: if a file is not an HDF5 file, `x` and `y` datasets differ in length
            within a file, or files disagree on dtypes or per-sample shapes.

    Example:

    >>> import os, tempfile, h5py, numpy as np, kpipe
    >>> tmp = tempfile.TemporaryDirectory()
    >>> path = os.path.join(tmp.name, "train.h5")
    >>> with h5py.File(path, "w") as f:
    ...     _ = f.create_dataset("x", data=np.zeros((10, 4), "float32"), chunks=(5, 4), compression="gzip")
    ...     _ = f.create_dataset("y", data=np.arange(10))
    >>> ds = kpipe.data.from_hdf5(path, x="x", y="y")
    >>> [int(y) for _, y in ds.as_numpy_iterator()][:3]
    [0, 1, 2]
    >>> tmp.cleanup()
    """
    files = expand_paths(paths, "paths", "HDF5")
    shard = resolve_shard(input_context, num_shards, index)
    keys, structure, label_leaf = flatten_keys(x, y)
    for key, arg in keys:
        if not isinstance(key, str):
            raise TypeError(
                f"`{arg}` must name an HDF5 dataset. Received: {arg}={key!r} of type "
                f"{type(key).__name__}. Pass the dataset's path inside the file, e.g. \"images\"."
            )
    leaves: List[Leaf] = []
    lengths, chunk_rows = [], []
    for path in files:
        with open_hdf5(path) as f:
            n, chunks = _inspect_file(f, path, keys, leaves)
        lengths.append(n)
        chunk_rows.append(chunks)
    # Blocks follow the chunks of the widest array: it dominates the bytes read.
    widest = int(np.argmax([l.dtype.itemsize * int(np.prod(l.sample_shape, dtype=np.int64)) for l in leaves]))
    grids = [block_rows(leaves, c[widest], block_size) for c in chunk_rows]
    name = files[0] if len(files) == 1 else f"{files[0]}, ... ({len(files)} files)"
    source = BlockSource(
        what=f"from_hdf5({name!r})",
        leaves=leaves,
        structure=structure,
        lengths=lengths,
        grids=grids,
        reader=_Hdf5Reader(files, [k for k, _ in keys]),
        label_leaf=label_leaf,
    )
    return attach(source.build(shard), source, shard)


def open_hdf5(path, **kwargs):
    """Opens `path` read-only with h5py; a failure says which of the usual causes it is.

    h5py raises `OSError` subclasses carrying the C library's errno (in `exc.errno`, and
    as "errno = N" in the message for the file-locking failure); a file that exists but
    is not HDF5 has no errno and says "file signature not found".

    Args:
        path: The file.
        **kwargs: Passed to `h5py.File` (e.g. `rdcc_nbytes`).

    Returns:
        The open `h5py.File`.

    Raises:
        FileNotFoundError: The file does not exist (any more).
        PermissionError: This user may not read it.
        BlockingIOError: HDF5's file lock is held by another process writing the file.
        ValueError: The file exists but is not an HDF5 file.
        OSError: Any other failure to open, with the file named.
    """
    import h5py

    try:
        return h5py.File(path, "r", **kwargs)
    except OSError as exc:
        raise _open_error(path, exc) from None


def _open_error(path, exc):
    text = re.sub(r"^\[Errno \d+\] ", "", str(exc))  # the new error shows the errno once
    errno_ = exc.errno
    if errno_ is None:  # the lock failure's errno sits in the message
        m = re.search(r"unable to lock file, errno = (\d+)", text)
        errno_ = int(m.group(1)) if m else None
    if "unable to lock file" in text or errno_ in (errno.EAGAIN, errno.EWOULDBLOCK):
        return BlockingIOError(
            errno.EAGAIN,
            f"HDF5 file {path!r} is locked by another process that has it open for writing "
            f"({text}). Close the writer first; if no process writes it (e.g. a stale lock on "
            "a network file system that lacks locking), set HDF5_USE_FILE_LOCKING=FALSE in the "
            "environment before starting Python. Reading a file while it is written can return "
            "partial data.")
    if isinstance(exc, FileNotFoundError) or errno_ == errno.ENOENT:
        return FileNotFoundError(
            errno.ENOENT, f"HDF5 file {path!r} does not exist ({text}). It may have been moved "
            "or deleted after the dataset was created; check the path.")
    if isinstance(exc, PermissionError) or errno_ in (errno.EACCES, errno.EPERM):
        return PermissionError(
            errno.EACCES, f"Permission denied reading HDF5 file {path!r} ({text}). Give this "
            f"user read access to the file and execute access to its directories (e.g. "
            f"chmod a+r {path!r}), or copy it somewhere readable.")
    if "file signature not found" in text:
        return ValueError(f"{path!r} is not an HDF5 file (h5py: {text}). Check that the path "
                          "names an HDF5 file (.h5/.hdf5), not e.g. a NumPy or TFRecord file.")
    return OSError(errno_, f"Cannot open HDF5 file {path!r}: {text}")


def _inspect_file(f, path, keys, leaves):
    """Checks one open file against `keys` (and the leaves of earlier files); returns (rows, chunk rows)."""
    import h5py

    n = None
    chunks = []
    first_file = not leaves
    for i, (key, arg) in enumerate(keys):
        if key not in f:
            available = _list_datasets(f)
            raise KeyError(
                f"HDF5 file {path!r} has no dataset {key!r} (from `{arg}`). Datasets in the file: "
                f"{available}. Pass one of them as `{arg}`."
            )
        d = f[key]
        if not isinstance(d, h5py.Dataset) or d.shape is None or len(d.shape) == 0:
            raise ValueError(
                f"{key!r} in HDF5 file {path!r} (from `{arg}`) is not an array with one row per sample "
                f"(it is {d!r}). Pass a dataset whose first dimension indexes samples."
            )
        what = f"HDF5 dataset {key!r} in {path!r} (from `{arg}`)"
        dtype = check_dtype(d.dtype, what)
        leaf = Leaf(f"`{arg}` ({key!r})", dtype, tuple(int(s) for s in d.shape[1:]))
        if first_file:
            leaves.append(leaf)
        elif (leaves[i].dtype, leaves[i].sample_shape) != (leaf.dtype, leaf.sample_shape):
            raise ValueError(
                f"{what} has dtype {leaf.dtype} and per-sample shape {leaf.sample_shape}, but the "
                f"first file has {leaves[i].dtype} and {leaves[i].sample_shape}. All files must store "
                "the same kind of samples."
            )
        rows = int(d.shape[0])
        if n is None:
            n, first = rows, (key, arg)
        elif rows != n:
            raise ValueError(
                f"In HDF5 file {path!r}, {key!r} (from `{arg}`) has {rows} rows but {first[0]!r} "
                f"(from `{first[1]}`) has {n}. Every dataset must have one row per sample; fix the "
                "file or pass matching datasets."
            )
        chunks.append(int(d.chunks[0]) if d.chunks else 1)
    return n, chunks


def _list_datasets(f, limit=20):
    import h5py

    names = []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            names.append(name)
        return len(names) >= limit or None

    f.visititems(visit)
    return names


class _Hdf5Reader:
    """Reads row blocks of HDF5 datasets; safe to call from many threads at once.

    h5py objects must not be used by two threads at once, so each read checks a handle
    out of a pool (opening one lazily when every handle of that file is busy) and checks
    it back in afterwards: a handle is only ever used by one thread at a time, and the pool
    holds about as many handles per file as there were concurrent reads. (A per-thread
    cache does not work here: tf.data calls Python from C++ threads whose Python thread
    state, and so their `threading.local` data, is created anew for each call.) At most
    `_MAX_IDLE_HANDLES` idle handles are kept; all are closed when the reader is garbage
    collected or at interpreter exit. Pickling the reader (to send it to a process) drops
    the handles; the copy opens its own.
    """

    def __init__(self, paths, keys):
        self.paths = list(paths)
        self.keys = list(keys)
        self._init_state()

    def _init_state(self):
        self._lock = threading.Lock()
        self._idle = collections.OrderedDict()  # part -> [(file, datasets)], least recently used first
        self._open = []  # every handle open now, idle or checked out
        self.opened = 0  # handles opened so far (for tests and tuning)
        self._finalizer = weakref.finalize(self, _close_files, self._open, self._lock)

    def __getstate__(self):
        return {"paths": self.paths, "keys": self.keys}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_state()

    def read(self, part, lo, hi, ids):
        entry = self._checkout(part)
        try:
            return [entry[1][i][lo:hi] for i in ids]
        finally:
            self._checkin(part, entry)

    def _checkout(self, part):
        with self._lock:
            stack = self._idle.get(part)
            if stack:
                return stack.pop()
        f = open_hdf5(self.paths[part], rdcc_nbytes=_CHUNK_CACHE_BYTES)
        with self._lock:
            self._open.append(f)
            self.opened += 1
        return f, [f[k] for k in self.keys]

    def _checkin(self, part, entry):
        evicted = []
        with self._lock:
            self._idle.setdefault(part, []).append(entry)
            self._idle.move_to_end(part)
            idle = sum(len(v) for v in self._idle.values())
            while idle > _MAX_IDLE_HANDLES:
                oldest = next(iter(self._idle))
                f, _ = self._idle[oldest].pop(0)
                if not self._idle[oldest]:
                    del self._idle[oldest]
                self._open.remove(f)
                evicted.append(f)
                idle -= 1
        for f in evicted:
            f.close()


def _close_files(files, lock):
    with lock:
        pending = list(files)
        files.clear()
    for f in pending:
        try:
            f.close()
        except Exception:  # already closed, interpreter shutting down
            pass
