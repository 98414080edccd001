"""Keras callbacks: `InputProfiler` (input-wait share of each step), `Warmup` (gradual
learning-rate warmup for large minibatches) and `BackupAndRestore` (crash-consistent,
multi-worker-safe backups that resume every worker from the same epoch)."""

import importlib

_LAZY_ATTRS = {
    "BackupAndRestore": "kpipe.callbacks._backup",
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
