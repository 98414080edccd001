"""Open handles a dataset holds, sent to workers as what they are and reopened there.

A dataset that has been used once in the main process (`ds[0]`, to look at a batch) often
holds what it opened lazily: an h5py `File`, a `Group` or `Dataset` of one, a file object,
an `np.memmap`. None of them pickles. Instead of failing, the pickler (`_pickling._Pickler`,
through `persistent_id`: the user's object is never touched) sends each as a small spec,
and the worker's unpickler turns the spec back into a handle on the same file:

* h5py objects: `("h5py", path, object name, kind)`. In a worker they come back as a
  `LazyH5`, which opens the file read-only (`"r"`) at its first use in each process -- not
  at unpickling, since the forkserver unpickles once and forks every worker from that
  process, and an HDF5 file must not be opened before a fork. The objects of one file
  share one open `h5py.File` per process.
* file objects opened for reading: `("file", path, mode, encoding, errors)`, reopened at
  their first use in each process as a `LazyFile`, at position 0 (a position shared by
  several workers would mean nothing).
* memmaps (and arrays viewing one): `("memmap", path, offset, shape, strides, dtype, mode,
  is_memmap)`: mapped again from the same file -- the data is never copied into the pickle.
  A memmap opened `"c"` (copy-on-write) is mapped `"c"`, any other `"r"`.

A spec holds only what the handle is, never when it was taken, so an unchanged dataset
pickles to the same bytes each time (the pass-end state check compares those bytes). What
cannot be reopened from a name -- a file or HDF5 file opened for writing, a closed handle,
a file moved or deleted since it was opened, a pipe, a socket, a database connection --
raises `Unreopenable` with the reason, which `_pickling.dumps` turns into a
`DatasetPicklingError` naming the attribute and what works instead.
"""

import io
import mmap
import os
import socket

import numpy as np

_FILE_TYPES = (io.FileIO, io.BufferedReader, io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)
_H5_KINDS = {"File": "file", "Group": "group", "Dataset": "dataset", "Datatype": "datatype",
             "AttributeManager": "attrs"}
_DB_MODULES = ("sqlite3", "psycopg", "psycopg2", "pymysql", "MySQLdb", "pymongo", "redis", "sqlalchemy")


class Unreopenable(Exception):
    """A handle that cannot be sent as a name: `reason` says why, `fix` what works."""

    def __init__(self, obj, what, reason, fix=None):
        super().__init__(reason)
        self.obj, self.what, self.reason, self.fix = obj, what, reason, fix


def spec_of(obj):
    """The spec `obj` travels as; None when it is no handle (pickled as usual).

    Raises:
        Unreopenable: a handle that cannot be reopened by name.
    """
    kind = type(obj)
    if isinstance(obj, (LazyH5, LazyFile)):
        return obj._kpipe_spec
    if kind is np.memmap or kind is np.ndarray:
        return _memmap_spec(obj)
    module = kind.__module__ or ""
    if module.startswith("h5py."):
        return _h5_spec(obj)
    if isinstance(obj, _FILE_TYPES):
        return _file_spec(obj)
    if isinstance(obj, socket.socket):
        raise Unreopenable(obj, "a socket", "a connection cannot be reopened by another process")
    if module.split(".")[0] in _DB_MODULES:
        raise Unreopenable(obj, f"a {module.split('.')[0]} object", "a database connection cannot be shared with other processes")
    return None


def reopen(spec):
    """The handle a worker uses for `spec` (lazy, but for memmaps, which map at once)."""
    if spec[0] == "h5py":
        return LazyH5(spec)
    if spec[0] == "file":
        return LazyFile(spec)
    return _map(spec)


# --- h5py ------------------------------------------------------------------------------

def _h5_spec(obj):
    kind = _H5_KINDS.get(type(obj).__name__)
    if kind is None:
        raise Unreopenable(obj, f"an h5py {type(obj).__name__}", "kpipe reopens h5py Files, Groups, Datasets, "
                           "Datatypes and attrs in workers, not this kind of h5py object")
    what = f"an h5py {type(obj).__name__}"
    oid = obj._id if kind == "attrs" else obj.id  # (attrs: its owner's id)
    if not oid.valid:
        raise Unreopenable(obj, what, "it is closed, so there is nothing to reopen",
                           "drop the closed handle (set the attribute to None) so that it is opened again lazily")
    import h5py

    f = h5py.File(h5py.h5i.get_file_id(oid))
    if f.mode != "r":
        raise Unreopenable(obj, what, f"its file {f.filename!r} is open for writing (mode {f.mode!r}), and HDF5 "
                           "lets no other process open a file that one process writes",
                           "open it with h5py.File(path, 'r'), or close it before creating the loader")
    fd = None
    if f.driver in ("sec2", "stdio"):
        fd = f.id.get_vfd_handle()
    elif f.driver != "core" or not os.path.isfile(f.filename):
        raise Unreopenable(obj, what, f"its file is not on disk (h5py driver {f.driver!r}), so workers cannot "
                           "reopen it by name")
    path = _same_file(obj, what, f.filename, fd)
    name = h5py.h5i.get_name(oid)
    name = name.decode("utf-8", "surrogateescape") if name is not None else None
    if name is None:
        raise Unreopenable(obj, what, "it is an anonymous object (no name in its file) and cannot be found again")
    return ("h5py", path, name, kind)


_OPEN_H5 = {}  # path -> (pid, h5py.File): the files LazyH5 objects opened in this process


def _open_h5(path):
    pid = os.getpid()
    held = _OPEN_H5.get(path)
    if held is None or held[0] != pid or not held[1].id.valid:
        import h5py

        held = _OPEN_H5[path] = (pid, h5py.File(path, "r"))
    return held[1]


class _Lazy:
    """A handle opened at its first use in each process; otherwise it forwards to it."""

    __slots__ = ("_kpipe_spec", "_kpipe_obj", "_kpipe_pid")

    def __init__(self, spec):
        self._kpipe_spec, self._kpipe_obj, self._kpipe_pid = spec, None, None

    def _kpipe_get(self):
        if self._kpipe_pid != os.getpid():
            self._kpipe_obj, self._kpipe_pid = self._kpipe_open(), os.getpid()
        return self._kpipe_obj

    def __getattr__(self, name):
        return getattr(self._kpipe_get(), name)

    def __iter__(self):
        return iter(self._kpipe_get())

    def __enter__(self):
        return self._kpipe_get().__enter__()

    def __exit__(self, *exc):
        return self._kpipe_get().__exit__(*exc)

    def __bool__(self):
        return bool(self._kpipe_get())

    def __reduce__(self):  # (pickled without kpipe's pickler: what a plain pickle can carry)
        return (type(self), (self._kpipe_spec,))

    def __repr__(self):
        return f"<reopened by kpipe: {self._kpipe_spec[0]} {self._kpipe_spec[1]!r}>"


class LazyH5(_Lazy):
    """An h5py File/Group/Dataset/Datatype/attrs reopened read-only in this process."""

    __slots__ = ()

    def _kpipe_open(self):
        _, path, name, kind = self._kpipe_spec
        f = _open_h5(path)
        if kind == "file":
            return f
        return f[name].attrs if kind == "attrs" else f[name]

    def __getitem__(self, key):
        return self._kpipe_get()[key]

    def __contains__(self, key):
        return key in self._kpipe_get()

    def __len__(self):
        return len(self._kpipe_get())

    def __array__(self, dtype=None, copy=None):
        out = np.asarray(self._kpipe_get()[()])
        return out if dtype is None else out.astype(dtype, copy=False)


# --- files -----------------------------------------------------------------------------

def _file_spec(obj):
    what = f"a file object ({type(obj).__name__})"
    name = getattr(obj, "name", None)
    if obj.closed:
        raise Unreopenable(obj, what, "it is closed, so there is nothing to reopen",
                           "drop the closed handle (set the attribute to None) so that it is opened again lazily")
    if not isinstance(name, str):
        raise Unreopenable(obj, what, f"it has no file name to reopen it by (name={name!r}: a pipe or a "
                           "descriptor)")
    mode = getattr(obj, "mode", "r")
    if any(c in mode for c in "wax+"):
        raise Unreopenable(obj, what, f"{name!r} is open for writing (mode {mode!r}): each worker reopening it "
                           "would truncate or interleave the file")
    try:
        fd = obj.fileno()
    except (OSError, ValueError):
        fd = None
    if fd is not None and not _is_regular(fd):
        raise Unreopenable(obj, what, f"{name!r} is not a regular file (a pipe, socket or device), so workers "
                           "cannot reopen it by name")
    path = _same_file(obj, what, name, fd)
    text = isinstance(obj, io.TextIOWrapper)
    return ("file", path, mode if text or "b" in mode else mode + "b",
            obj.encoding if text else None, obj.errors if text else None)


def _is_regular(fd):
    import stat

    return stat.S_ISREG(os.fstat(fd).st_mode)


class LazyFile(_Lazy):
    """A file object opened for reading, reopened (at position 0) in this process."""

    __slots__ = ()

    def _kpipe_open(self):
        _, path, mode, encoding, errors = self._kpipe_spec
        return open(path, mode, encoding=encoding, errors=errors)

    def __next__(self):
        return next(self._kpipe_get())


# --- memmaps ---------------------------------------------------------------------------

def _memmap_root(arr):
    """The memmap that maps the file under `arr` (itself, or an array it views), or None."""
    while isinstance(arr, np.ndarray):
        if isinstance(arr, np.memmap) and isinstance(arr.base, mmap.mmap):
            return arr
        arr = arr.base
    return None


def _memmap_spec(arr):
    if arr.base is None:  # (an array owning its data: most arrays, answered at once)
        return None
    root = _memmap_root(arr)
    if root is None or not isinstance(getattr(root, "filename", None), str):
        return None
    what = "an np.memmap" if isinstance(arr, np.memmap) else "an array viewing an np.memmap"
    path = _same_file(arr, what, root.filename, None)
    offset = root.offset + (arr.__array_interface__["data"][0] - root.__array_interface__["data"][0])
    mode = "c" if root.mode == "c" else "r"
    return ("memmap", path, int(offset), tuple(arr.shape), tuple(arr.strides), arr.dtype, mode,
            isinstance(arr, np.memmap))


def _map(spec):
    _, path, offset, shape, strides, dtype, mode, is_memmap = spec
    if 0 in shape:
        return np.empty(shape, dtype)
    order = _contiguous_order(shape, strides, dtype) if all(s > 0 for s in strides) else None
    if is_memmap and order is not None:
        return np.memmap(path, dtype=dtype, mode=mode, offset=offset, shape=shape, order=order)
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0) + dtype.itemsize
    span = np.memmap(path, dtype=np.uint8, mode=mode, offset=offset + low, shape=(high - low,))
    out = np.ndarray(shape, dtype, buffer=span, offset=-low, strides=strides)
    return out.view(np.memmap) if is_memmap else out


def _contiguous_order(shape, strides, dtype):
    for order in "CF":
        step, want = dtype.itemsize, []
        dims = range(len(shape) - 1, -1, -1) if order == "C" else range(len(shape))
        for d in dims:
            want.append((d, step))
            step *= shape[d]
        if all(strides[d] == s or shape[d] == 1 for d, s in want):
            return order
    return None


# --- shared ----------------------------------------------------------------------------

def _same_file(obj, what, name, fd):
    """`name` made absolute, checked to still be the file `obj` has open (by its `fd`)."""
    path = os.path.abspath(name)
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if fd is not None:
        held = os.fstat(fd)
        if st is not None and (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino):
            return path
        now = _where_now(fd)
        where = f" (it is now at {now!r})" if now else ""
        gone = "no longer exists there" if st is None else "is another file now"
        raise Unreopenable(obj, what, f"it was opened from {path!r}, which {gone}{where}: it was moved, deleted or "
                           "replaced after it was opened, and workers reopen files by name",
                           "open it again from where it is now")
    if st is None:
        raise Unreopenable(obj, what, f"it was opened from {path!r}, which no longer exists (moved or deleted "
                           "after it was opened), and workers reopen files by name",
                           "open it again from where it is now")
    return path


def _where_now(fd):
    try:
        now = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return None if now.endswith(" (deleted)") else now
