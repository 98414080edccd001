"""Keras callbacks: `InputProfiler` (input-wait share of each step) and `Warmup`
(gradual learning-rate warmup for large minibatches)."""

import importlib

_LAZY_ATTRS = {
    "InputProfiler": "kpipe.callbacks._profiler",
    "Warmup": "kpipe.callbacks._warmup",
}
__all__ = sorted(_LAZY_ATTRS)


def __getattr__(name):
    if name in _LAZY_ATTRS:
        value = getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kpipe.callbacks' has no attribute {name!r}")
