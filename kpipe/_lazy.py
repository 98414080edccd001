"""Lazy public names for kpipe's packages (PEP 562), so `import kpipe` stays cheap.

A package lists the module that defines each lazy name; the module is imported, and the
name bound in the package, the first time it is used. Used by `kpipe`,
`kpipe.distribute` and `kpipe.callbacks`, whose lazy names need TensorFlow or Keras.
"""

import importlib


def attach(namespace, attrs, modules=()):
    """Returns `(__getattr__, __dir__)` for the package whose `globals()` is `namespace`.

    Args:
        namespace: The package's `globals()`; resolved names are cached there.
        attrs: `{name: "module.that.defines.it"}`.
        modules: Names of subpackages imported on first access (`kpipe.data`, say).

    Returns:
        The package's module-level `__getattr__` and `__dir__`.
    """
    package = namespace["__name__"]

    def __getattr__(name):
        if name in attrs:
            value = getattr(importlib.import_module(attrs[name]), name)
        elif name in modules:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(namespace.get("__all__", ())))

    return __getattr__, __dir__
