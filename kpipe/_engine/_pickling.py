"""Sending datasets (and functions) to workers: cloudpickle, with big arrays shared.

* cloudpickle pickles classes and functions defined in `__main__` or a notebook cell by
  value, so they work in spawned workers.
* NumPy arrays of at least `SHARE_MIN_BYTES` are not pickled: they are copied once into a
  shared-memory segment and replaced by a reference; every worker maps the same pages
  read-only. Re-sending the dataset after `on_epoch_end` compares each array with its
  shared copy and rewrites only what changed (in-place edits included); arrays the
  dataset no longer holds (replaced, not edited) are freed in every process.
* A dataset class from a user module whose import would import Keras or TensorFlow (the
  usual `class Images(keras.utils.PyDataset)` in `data.py`; a module that imports only
  its base's module, which imports keras; a module of a package whose `__init__` does) is
  sent by value -- its code, not an import of its module -- and its
  `keras.utils.PyDataset` base is swapped for a TensorFlow-free stand-in in workers.
  Workers then import TensorFlow only if the dataset's own methods use it.
* Open handles -- h5py objects, files opened for reading, memmaps -- travel as the name of
  what they have open and are reopened in each worker (`_handles.py`); the user's object is
  not touched. Handles that cannot be reopened (a file open for writing, a socket, a
  database connection) and locks cannot cross processes: the error names the attribute and
  says what works instead.
"""

import contextlib
import io
import os
import pickle
import re
import sys
import sysconfig
import types

import cloudpickle
import numpy as np

from kpipe._engine import _handles, _pydataset_shim
from kpipe._engine._shm import Segment, fd_limit_error, is_fd_exhaustion, plan_layout
from kpipe._engine._submodule_scan import submodule_scan
from kpipe.errors import DatasetPicklingError, LoaderError

SHARE_MIN_BYTES = 1 << 20
_OK_KINDS = frozenset("biufc")
_COMPARE_CHUNK_BYTES = 1 << 19  # compared at a time: the temporaries stay in the cache


def same_bytes(a, b):
    """Whether arrays `a` and `b` hold the same bytes (shape and dtype included).

    What `SharedArrays` asks at every `on_epoch_end`: has the dataset edited its array since
    the shared copy was written? Bytes, not values -- `np.array_equal` calls an array
    holding NaN different from itself (a dataset with missing values was re-sent at every
    pass end) and -0.0 equal to 0.0 (such an edit never reached the workers) -- and a
    chunk at a time: `np.array_equal` makes a temporary the size of the array (63 MB for
    63 MB of uint8), whose fresh pages cost more than the comparison (24 -> 9 ms for
    63 MB here).
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.ndim == 0 or a.size == 0:
        return a.tobytes() == b.tobytes()
    if a.flags.c_contiguous and b.flags.c_contiguous:
        x, y = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
        if x.size % 8 == 0:  # 8 bytes a comparison
            x, y = x.view(np.uint64), y.view(np.uint64)
        step = max(1, _COMPARE_CHUNK_BYTES // x.itemsize)
        return all(np.array_equal(x[i:i + step], y[i:i + step]) for i in range(0, x.size, step))
    # (an array that is a strided view: rows at a time, each made contiguous)
    step = max(1, _COMPARE_CHUNK_BYTES // max(1, a[0].nbytes))
    return all(np.ascontiguousarray(a[i:i + step]).tobytes() == np.ascontiguousarray(b[i:i + step]).tobytes()
               for i in range(0, len(a), step))


class SharedArrays:
    """Main-process registry of dataset arrays living in shared memory. Not thread-safe.

    An entry lives as long as the target uses its array: after each `dumps`, `retain`
    frees the entries that the new pickle no longer references (an array replaced in
    `on_epoch_end`, say), and workers are told to drop them too.
    """

    def __init__(self):
        # A strong reference to each array (not a weak one: NumPy refuses to resize an
        # array that has weak references). It keeps nothing alive for long: `retain` drops
        # the entries of arrays the target no longer holds at the next `dumps`.
        self._by_id = {}  # id(array) -> key
        self.entries = {}  # key -> [segment, array, layout]
        self._next = 0
        self.rewrites = 0  # shared copies rewritten because their array changed in place

    def put(self, arr, compare=True):
        """Returns `(key, is_new)`; (re)writes the shared copy only when it differs.

        A shared copy never changes size: an array whose shape or dtype changed in place
        gets a new entry (workers map each entry once, and keep no descriptor for it).
        `compare=False` takes an array it holds as it is, without reading it (for a
        pickle taken right after one that compared it: `state_fingerprint`).
        """
        key = self._by_id.get(id(arr))
        if key is not None:
            seg, held, layout = self.entries[key]
            if held is arr and plan_layout([arr]) == layout:
                if compare and not same_bytes(seg.views(layout)[0], arr):
                    seg.write([arr], layout)
                    self.rewrites += 1
                return key, False
        key = f"a{self._next}"
        try:
            seg = Segment.create(arr.nbytes, name="kpipe-array")
        except OSError as exc:
            if is_fd_exhaustion(exc):
                raise fd_limit_error(exc, f"share a {arr.nbytes}-byte array of the dataset with its workers") from exc
            raise
        self._next += 1
        layout = plan_layout([arr])
        seg.write([arr], layout)
        self.entries[key] = [seg, arr, layout]
        self._by_id[id(arr)] = key
        return key, True

    def retain(self, keys):
        """Frees every entry not in `keys` (the keys of the latest `dumps`); returns them."""
        dropped = [k for k in self.entries if k not in keys]
        for key in dropped:
            self.entries.pop(key)[0].close()
        if dropped:
            self._by_id = {i: k for i, k in self._by_id.items() if k in self.entries}
        return dropped

    def layout(self, key):
        return self.entries[key][2]

    def fd(self, key):
        return self.entries[key][0].fd

    def close(self):
        for seg, _, _ in self.entries.values():
            seg.close()
        self.entries.clear()
        self._by_id.clear()


# Types whose objects are never shared arrays nor h5py objects: most of what a pickle holds
# (a class pickled by value is ~600 of them), answered by one set lookup.
_PLAIN_TYPES = frozenset({str, bytes, int, float, bool, type(None), tuple, list, dict, set, frozenset,
                          type, types.FunctionType, types.CodeType, types.CellType})


class _Pickler(cloudpickle.Pickler):
    """cloudpickle's, with shared arrays and open handles sent by reference (`persistent_id`),
    and the functions and classes of the user's modules that import Keras/TF found anywhere
    in what is pickled -- a `py_map_fn`, a function or an object a dataset holds -- sent by
    value (`reducer_override`; `by_value` lists the modules so registered, for the caller to
    unregister), so that a worker does not import such a module, and TensorFlow with it."""

    def __init__(self, file, shared, used, compare=True):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._shared = shared
        self._used = used
        self._compare = compare  # compare shared arrays with their copies (see SharedArrays.put)
        self._scan = _HeavyScan()
        self.by_value = []

    def reducer_override(self, obj):
        if isinstance(obj, (types.FunctionType, type)):
            module = _user_module(getattr(obj, "__module__", None))
            if (module is not None and module.__name__ not in self._scan.heavy and self._scan.is_heavy(module)
                    and module.__name__ not in cloudpickle.list_registry_pickle_by_value()):
                cloudpickle.register_pickle_by_value(module)
                self.by_value.append(module)
        return super().reducer_override(obj)

    def persistent_id(self, obj):  # called for every object pickled
        if type(obj) in _PLAIN_TYPES:
            return None
        if type(obj) is np.ndarray and obj.base is None:
            return self._share(obj)
        spec = _handles.spec_of(obj)  # (an open handle: sent as what it has open)
        if spec is not None:  # (as bytes: the same bytes whatever the spec's objects share)
            return ("kpipe-handle", pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL))
        if type(obj) is np.ndarray:  # (a view, of no memmap)
            return self._share(obj)
        return None

    def _share(self, arr):
        if self._shared is not None and arr.nbytes >= SHARE_MIN_BYTES and arr.dtype.kind in _OK_KINDS:
            key, _ = self._shared.put(arr, compare=self._compare)
            self._used.add(key)
            return ("kpipe-shared-array", key, self._shared.layout(key)[0])
        return None


_WHAT_WORKS = (
    "create it lazily inside __getitem__, once per process (`if self.conn is None: self.conn = "
    "connect(...)`); or drop it in `__getstate__` and create it again in `__setstate__`; or keep "
    "a factory (a function that creates it) instead of the object; or pass use_threads=True / "
    "workers=0 to keep the dataset in this process"
)


def _unreopenable_message(what, obj, exc):
    where = _find_attribute(obj, exc.obj)
    fix = f"{exc.fix[0].upper()}{exc.fix[1:]}; or" if exc.fix else "What works:"
    return (f"{what} holds {exc.what}{where} ({_short(exc.obj)}), which cannot be sent to worker "
            f"processes: {exc.reason}. (kpipe reopens h5py objects, files opened for reading and "
            f"memmaps in each worker by their file name.) {fix} {_WHAT_WORKS}.")


_HEAVY_MODULES = ("keras", "tensorflow", "tf_keras", "jax", "torch")


_PATHS = (None, (), {})  # (the sys.path they were found for, library folders, {file: realpath})


def _library_paths():
    """The stdlib and site-packages folders, and a cache of module files' real paths,
    found again whenever `sys.path` changes. Resolving them stats every path component
    (~0.3 ms), and a stateful dataset is pickled again after every pass end."""
    global _PATHS
    key = tuple(sys.path)
    if _PATHS[0] != key:
        paths = sysconfig.get_paths()
        dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        dirs.update(p for p in key if p and os.path.basename(p) in ("site-packages", "dist-packages"))
        _PATHS = (key, tuple(os.path.realpath(d) + os.sep for d in dirs if d), {})
    return _PATHS[1], _PATHS[2]


def _user_module(name):
    """The module `name` when it is the user's own (not stdlib, site-packages, kpipe or a
    heavy framework; not `__main__`), else None."""
    module = sys.modules.get(name) if isinstance(name, str) else None
    path = getattr(module, "__file__", None)
    if module is None or not isinstance(path, str) or name == "__main__":
        return None
    if name.split(".")[0] in _HEAVY_MODULES + ("kpipe",):
        return None
    libs, real = _library_paths()
    resolved = real.get(path)
    if resolved is None:
        resolved = real[path] = os.path.realpath(path)
    return None if resolved.startswith(libs) else module


def _module_of(value):
    name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
    return name if isinstance(name, str) else None


class _HeavyScan:
    """Which user modules import Keras/TF/JAX/torch when imported -- directly, through
    another user module they take a name from (`from mypkg.base import Base`, whose
    module imports keras), or through their package's `__init__` -- found by reading
    module globals, never by importing anything."""

    def __init__(self):
        self.heavy = {}  # module name -> bool (None while it is being read: an import cycle)

    def is_heavy(self, module):
        name = module.__name__
        if name in self.heavy:
            return bool(self.heavy[name])
        self.heavy[name] = None
        found = False
        parent = _user_module(name.rpartition(".")[0])
        if parent is not None and self.is_heavy(parent):
            found = True
        for value in list(vars(module).values()):
            dep = _module_of(value)
            if dep is None:
                continue
            if dep.split(".")[0] in _HEAVY_MODULES:
                found = True
                continue
            dep_module = _user_module(dep)
            if dep_module is not None and dep_module is not module and self.is_heavy(dep_module):
                found = True  # (and read on: every user module reached gets its answer)
        self.heavy[name] = found
        return found

    def roots(self, module):
        """`module`'s user-module dependencies (for `__main__`, whose classes travel by
        value anyway but whose globals can name heavy user modules)."""
        for value in list(vars(module).values()):
            dep_module = _user_module(_module_of(value))
            if dep_module is not None:
                self.is_heavy(dep_module)


def _by_value_modules(obj):
    """User modules that import Keras/TF (`_HeavyScan`) among those that define `obj`'s
    classes and those their globals lead to: their classes and functions travel by value,
    so that a worker imports none of them -- and so imports TensorFlow only if the
    dataset's own code does. A dataset class whose module imports only its base's module
    (which imports keras) is one of them, as is the base itself."""
    scan = _HeavyScan()
    for cls in type(obj).__mro__:
        if cls.__module__ == "__main__":
            main = sys.modules.get("__main__")
            if main is not None and "__main__" not in scan.heavy:
                scan.heavy["__main__"] = False
                scan.roots(main)
            continue
        module = _user_module(cls.__module__)
        if module is not None:
            scan.is_heavy(module)
    return [sys.modules[name] for name, heavy in scan.heavy.items() if heavy and name in sys.modules]


by_value_modules = _by_value_modules  # (for `_unsent.py`: classes of these modules travel by value)


@contextlib.contextmanager
def _pickled_by_value(modules):
    registered = []
    try:
        for module in modules:
            if module.__name__ not in cloudpickle.list_registry_pickle_by_value():
                cloudpickle.register_pickle_by_value(module)
                registered.append(module)
        yield
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)


@contextlib.contextmanager
def _pickler(*args, **kwargs):
    pickler = _Pickler(*args, **kwargs)
    try:
        yield pickler
    finally:
        for module in pickler.by_value:
            cloudpickle.unregister_pickle_by_value(module)


def dumps(obj, shared=None, what=None):
    """Pickles `obj`; returns `(payload_bytes, keys_of_shared_arrays_used)`.

    Raises:
        DatasetPicklingError: with the reason and the fix.
    """
    buf = io.BytesIO()
    used = set()
    what = what or f"`{type(obj).__name__}`"
    try:
        with _pickled_by_value(_by_value_modules(obj)), submodule_scan(), _pickler(buf, shared, used) as pickler:
            pickler.dump(obj)
    except _handles.Unreopenable as exc:
        raise DatasetPicklingError(_unreopenable_message(what, obj, exc)) from None
    except LoaderError:  # DatasetPicklingError, or out of file descriptors
        raise
    except Exception as exc:
        if is_fd_exhaustion(exc):
            raise fd_limit_error(exc, f"send {what} to its workers") from exc
        where = _find_unpicklable(obj)
        raise DatasetPicklingError(
            f"{what} cannot be pickled to send it to worker processes{where}: "
            f"{type(exc).__name__}: {exc}. What works for such an object (a lock, a socket, a "
            f"database connection, a file opened for writing): {_WHAT_WORKS}."
        ) from exc
    return buf.getvalue(), used


def state_fingerprint(obj, shared=None):
    """Bytes that change when anything `dumps(obj)` sends does -- the object's state, and
    its class's attributes and the globals its methods use where those travel by value (a
    class defined in `__main__` or a notebook: `type(self).scale += 1` in a hook) -- but
    not when only this process's history does: `obj` pickled as `dumps` pickles it, except
    that functions sent by value list no imported submodules (cloudpickle lists the
    submodules loaded at the time, and NumPy 2 imports `numpy.random` lazily, so the same
    state pickles to other bytes later). None where it cannot be taken. Shared arrays count
    by their keys, unread: whether their contents changed is what the `dumps` taken just
    before found (its `SharedArrays.rewrites`), and reading them again would double what a
    pass end costs a dataset that holds its data in memory."""
    try:
        buf = io.BytesIO()
        with _pickled_by_value(_by_value_modules(obj)), submodule_scan(listed=False), \
                _pickler(buf, shared, set(), compare=False) as pickler:
            pickler.dump(obj)
        return buf.getvalue()
    except Exception:  # (a state cloudpickle cannot take: compare whole pickles only)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, segments, swaps=True):
        super().__init__(file)
        self._segments = segments
        self._swaps = _pydataset_shim.SWAPS if swaps else {}

    def persistent_load(self, pid):
        if pid[0] == "kpipe-shared-array":
            return self._segments[pid[1]].views([pid[2]])[0]
        if pid[0] == "kpipe-handle":
            return _handles.reopen(pickle.loads(pid[1]))
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")

    def find_class(self, module, name):
        swap = self._swaps.get((module, name))
        if swap is not None:
            return swap
        return super().find_class(module, name)


def loads(payload, segments, swaps=True):
    """Unpickles a `dumps` payload; `segments` maps shared-array keys to `Segment`s.
    `swaps=False`: Keras's `PyDataset` stays Keras's (not the workers' stand-in)."""
    return _Unpickler(io.BytesIO(payload), segments, swaps).load()


class NotApart(Exception):
    """This cloudpickle cannot unpickle a class apart from the one this process has."""


def loads_apart(payload, segments):
    """`loads`, in the process that pickled `payload`, without touching that process's own
    classes: a class sent by value (defined in `__main__`, a notebook cell) is unpickled as
    a new class holding the pickled attributes, where cloudpickle would find the class
    this process has and set the pickled attributes on it -- rebinding its methods to
    copies whose globals are a snapshot (the user's `ds[1]` then reads old globals). The
    new class pickles as the original does (same tracker id), so a copy's pickle can be
    compared with the original's. For `epoch_end_ahead`'s copy (`_ahead.py`).

    Raises:
        NotApart: this cloudpickle keeps its class tracker elsewhere.
    """
    module = sys.modules.get(getattr(cloudpickle.Pickler, "__module__", ""))
    lookup = getattr(module, "_lookup_class_or_track", None)
    by_class = getattr(module, "_DYNAMIC_CLASS_TRACKER_BY_CLASS", None)
    lock = getattr(module, "_DYNAMIC_CLASS_TRACKER_LOCK", None)
    if not callable(lookup) or by_class is None or lock is None:
        raise NotApart(f"cloudpickle {cloudpickle.__version__} has no class tracker kpipe knows")

    def track_apart(class_tracker_id, class_def):
        if class_tracker_id is not None:
            with lock:
                by_class[class_def] = class_tracker_id  # (pickles with the original's id; never found by it)
        return class_def

    module._lookup_class_or_track = track_apart
    try:
        return loads(payload, segments, swaps=False)  # (a copy that pickles as the original does)
    finally:
        module._lookup_class_or_track = lookup


def _attributes(root):
    """`(where, value)` for `root`'s attributes and the items of those that are lists,
    tuples or dicts (one level deeper): the places an error message can point at."""
    attrs = getattr(root, "__dict__", None)
    if not isinstance(attrs, dict):
        return
    for name, value in attrs.items():
        yield f"self.{name}", value
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                yield f"self.{name}[{i}]", v
        elif isinstance(value, dict):
            for k, v in value.items():
                yield f"self.{name}[{k!r}]", v


def _find_attribute(root, target):
    """Returns ' in `self.attr`' when `target` is an attribute (or one level deeper) of root."""
    return next((f" in `{where}`" for where, value in _attributes(root) if value is target), "")


def _find_unpicklable(root, max_depth=4, max_items=2000):
    """' (`self.guard` holds a _thread.lock)' for the deepest attribute path (through attributes,
    dict values, list/tuple items) whose value cloudpickle refuses, or '' if none is found
    within `max_depth` levels and `max_items` values tried. Run once, when pickling failed."""
    budget = [max_items]

    def refused(value):
        budget[0] -= 1
        try:
            cloudpickle.dumps(value)
        except Exception:
            return True
        return False

    def children(value):
        if isinstance(value, dict):
            return [(f"[{k!r}]", v) for k, v in list(value.items())[:100]]
        if isinstance(value, (list, tuple)):
            return [(f"[{i}]", v) for i, v in enumerate(value[:100])]
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(value, type):
            return [(f".{k}", v) for k, v in attrs.items()]
        return []

    def walk(value, path, depth):  # -> (path, value) of the deepest refused value found
        if depth >= max_depth or budget[0] <= 0:
            return path, value
        for part, child in children(value):
            if budget[0] > 0 and refused(child):
                return walk(child, path + part, depth + 1)
        return path, value

    try:
        path, leaf = walk(root, "self", 0)
    except Exception:  # (a value whose attributes cannot even be read)
        return ""
    if path == "self":
        return ""
    module = type(leaf).__module__
    kind = type(leaf).__qualname__ if module == "builtins" else f"{module}.{type(leaf).__qualname__}"
    return f" (`{path}` holds a {kind})"


def _short(value, limit=100):
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
