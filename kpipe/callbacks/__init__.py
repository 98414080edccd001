"""Keras callbacks: `InputProfiler` (input-wait share of each step, its per-step timeline
as arrays, a plot and TensorBoard scalars), `Warmup` (gradual learning-rate warmup for large
minibatches) and `BackupAndRestore` (crash-consistent, multi-worker-safe backups that resume
every worker from the same epoch).

Example:

>>> import kpipe
>>> kpipe.callbacks.__all__
['BackupAndRestore', 'InputProfiler', 'Warmup']
>>> profiler = kpipe.callbacks.InputProfiler()   # model.fit(..., callbacks=[profiler])
"""

from kpipe import _lazy

_LAZY_ATTRS = {
    "BackupAndRestore": "kpipe.callbacks._backup",
    "InputProfiler": "kpipe.callbacks._profiler",
    "Warmup": "kpipe.callbacks._warmup",
}
__all__ = sorted(_LAZY_ATTRS)

__getattr__, __dir__ = _lazy.attach(globals(), _LAZY_ATTRS)
