"""State a dataset reads that does not travel with it to persistent workers.

A dataset goes to its workers pickled. A class defined in `__main__` or a notebook cell
travels by value -- its attributes and the globals its methods use go with it, and a
change to them reaches the workers at the next pass end (`_pickling.state_fingerprint`).
A class imported from a module (`from mydata import Images`) travels by reference: each
worker imports the module itself, so a class attribute (`Images.scale += 1`) or a module
global (`mydata.OFFSET = 5`) changed in the main process after the workers started is
never seen by them -- as with PyTorch's `persistent_workers=True`. Keep such state on the
instance (`self.scale`), which travels.

`UnsentWatch` sees such a change cheaply and says so once per loader: at each pass end it
compares the plain values (numbers, strings, small containers; at most `_MAX_BYTES`
pickled each) of the class attributes of by-reference classes in the dataset's type and of
the module globals their methods name, with the values at the previous pass end.
"""

import logging
import pickle
import sys
import types

logger = logging.getLogger("kpipe")

_MAX_BYTES = 1 << 16
_PLAIN = (int, float, complex, str, bytes, bool, type(None), tuple, list, dict, set, frozenset)


def _by_reference(cls, by_value_modules):
    module = sys.modules.get(cls.__module__)
    if module is None or cls.__module__ in ("__main__", "builtins") or module in by_value_modules:
        return None
    if "<locals>" in cls.__qualname__ or getattr(module, cls.__name__, None) is not cls:
        return None  # (not importable by name: cloudpickle sends it by value)
    if cls.__module__.split(".")[0] in ("kpipe", "keras", "tensorflow", "numpy", "torch", "jax"):
        return None
    return module


def _plain(value):
    if not isinstance(value, _PLAIN):
        return None
    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return None
    return data if len(data) <= _MAX_BYTES else None


def snapshot(dataset, by_value_modules=()):
    """`{description: pickled value}` of the state described in the module docstring."""
    out = {}
    for cls in type(dataset).__mro__:
        module = _by_reference(cls, by_value_modules)
        if module is None:
            continue
        for name, value in vars(cls).items():
            if name.startswith("__"):
                continue
            if isinstance(value, (types.FunctionType, staticmethod, classmethod)):
                func = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
                for global_name in getattr(getattr(func, "__code__", None), "co_names", ()):
                    data = _plain(vars(module).get(global_name, _Missing))
                    if data is not None:
                        out[f"{module.__name__}.{global_name} (a global of module {module.__name__})"] = data
                continue
            data = _plain(value)
            if data is not None:
                out[f"{cls.__qualname__}.{name} (a class attribute of {module.__name__}.{cls.__qualname__})"] = data
    return out


class _Missing:
    pass


class UnsentWatch:
    """One loader's watch (module docstring): `check(dataset)` at each pass end."""

    def __init__(self, name):
        self.name = name
        self._last = None
        self.warned = False

    def check(self, dataset, by_value_modules=()):
        """Compares with the last pass end; logs a warning, once, naming what changed.
        Returns the descriptions that changed."""
        if self.warned:
            return []
        now = snapshot(dataset, by_value_modules)
        last, self._last = self._last, now
        if last is None:
            return []
        changed = sorted(k for k in now.keys() & last.keys() if now[k] != last[k])
        if changed:
            self.warned = True
            logger.warning(
                "ProcessLoader(%s): %s changed in this process since the last pass end. The dataset's class is "
                "imported from its module by each worker, so the workers keep the old value (they never see "
                "class attributes or module globals changed after they started). Keep such state on the dataset "
                "instance (e.g. self.scale), which reaches the workers at every pass end, or define the class in "
                "__main__/the notebook (sent by value). (Warned once per loader.)",
                self.name, ", ".join(changed))
        return changed
