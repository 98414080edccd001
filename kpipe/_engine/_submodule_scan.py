"""cloudpickle's search for a function's imported submodules, with one scan of `sys.modules`.

For every function it pickles by value (each method of a dataset class defined in
`__main__`, a notebook or a module that imports Keras), cloudpickle looks for the
loaded submodules the function may reach as attributes of a module it uses (`np.linalg`
through `np`): `_find_imported_submodules` walks the whole of `sys.modules` once per
such module, per function. With TensorFlow loaded that is ~3000 names, and it was 70%
of re-pickling a stateful dataset after each `on_epoch_end` (2.0 of 2.9 ms for
`scripts/bench_loaders.py`'s workload b), time in which every worker waits for the new
state.

`submodule_scan()` swaps in a version that returns the same list, built from an index
of `sys.modules`' names by package prefix. The index is kept between calls while
`sys.modules` holds the same names (checked on entry, and by its length on each call),
so a module imported in between is found as cloudpickle would find it; so is, per code
object, which of a prefix's names its `co_names` reach (a stateful dataset's methods are
pickled again after every pass end, each time the same code); the modules are looked up
in `sys.modules` on each call. Where cloudpickle has no such function (a
future version), nothing is swapped and pickling is unchanged.
"""

import contextlib
import sys
import threading
import types

import cloudpickle

_NAME = "_find_imported_submodules"
_MAX_CODES = 4096  # code objects whose reached names are kept


def _cloudpickle_globals():
    """The globals through which cloudpickle's `_function_getstate` calls `_NAME`
    (`cloudpickle.cloudpickle` in 3.x, `cloudpickle.cloudpickle_fast` in 2.x), or None."""
    module = sys.modules.get(getattr(cloudpickle.Pickler, "__module__", ""))
    getstate = getattr(module, "_function_getstate", None)
    namespace = getattr(getstate, "__globals__", None)
    if not isinstance(namespace, dict) or not callable(namespace.get(_NAME)):
        return None
    return namespace


class _Index:
    """Names in `sys.modules` (in its order) that start with each prefix asked for."""

    def __init__(self):
        self.names = None  # sys.modules' names when the prefixes were listed
        self.count = -1
        self.by_prefix = {}
        self.by_code = {}  # (code, prefix): the names of by_prefix[prefix] that code reaches
        self.left_out = False  # list none (`submodule_scan(listed=False)`)

    def refresh(self):
        """Drops the lists if `sys.modules` no longer holds the same names."""
        names = sys.modules.keys()
        if self.names is None or len(names) != len(self.names) or names != self.names:
            self.names = frozenset(names)
            self.count = len(self.names)
            self.by_prefix = {}
            self.by_code = {}

    def starting_with(self, prefix):
        if len(sys.modules) != self.count:  # a module imported while pickling
            self.refresh()
        found = self.by_prefix.get(prefix)
        if found is None:
            found = self.by_prefix[prefix] = [n for n in list(sys.modules) if n is not None and n.startswith(prefix)]
        return found

    def find_imported_submodules(self, code, top_level_dependencies):
        """cloudpickle's `_find_imported_submodules(code, top_level_dependencies)`."""
        subimports = []
        if self.left_out:
            return subimports
        for x in top_level_dependencies:
            if isinstance(x, types.ModuleType) and getattr(x, "__package__", None):
                prefix = x.__name__ + "."
                names = self.starting_with(prefix)  # (refreshes both caches if sys.modules changed)
                reached = self.by_code.get((code, prefix))
                if reached is None:
                    if len(self.by_code) >= _MAX_CODES:  # (cells re-run: new code objects)
                        self.by_code.clear()
                    co_names = set(code.co_names)
                    reached = self.by_code[(code, prefix)] = [
                        name for name in names if not set(name[len(prefix) :].split(".")) - co_names]
                for name in reached:
                    if name in sys.modules:
                        subimports.append(sys.modules[name])
        return subimports


_INDEX = _Index()
_LOCK = threading.RLock()
_depth = 0


@contextlib.contextmanager
def submodule_scan(listed=True):
    """Pickles inside this block search submodules through the index (see above).
    `listed=False`: they list none -- for a pickle compared with another of the same
    object (`_pickling.state_fingerprint`), not one sent to a worker: which submodules are
    loaded is this process's history, not the object's state. (Where cloudpickle has no
    such search, they list what cloudpickle lists.)"""
    global _depth
    namespace = _cloudpickle_globals()
    if namespace is None:
        yield
        return
    with _LOCK:
        if _depth == 0:
            _INDEX.refresh()
            original = namespace[_NAME]
            namespace[_NAME] = _INDEX.find_imported_submodules
        _depth += 1
        left_out, _INDEX.left_out = _INDEX.left_out, not listed
        try:
            yield
        finally:
            _INDEX.left_out = left_out
            _depth -= 1
            if _depth == 0:
                namespace[_NAME] = original
