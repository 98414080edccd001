"""A TensorFlow-free stand-in for `keras.utils.PyDataset` inside worker processes.

A dataset class defined in `__main__` or a notebook is pickled by value, with its base class
`keras.utils.PyDataset` by reference. Unpickling that reference would import Keras, and
Keras imports TensorFlow (seconds and ~500 MB per worker). Workers only ever call
`__getitem__`, `__len__` and the plain helpers below, so the worker-side unpickler swaps the
base class for this one. A user module that itself imports Keras still imports it.
"""

import itertools


class PyDataset:
    """Mirrors the public surface of `keras.utils.PyDataset` that datasets may call."""

    def __init__(self, workers=1, use_multiprocessing=False, max_queue_size=10):
        self._workers = workers
        self._use_multiprocessing = use_multiprocessing
        self._max_queue_size = max_queue_size

    def _warn_if_super_not_called(self):
        pass

    workers = property(lambda self: getattr(self, "_workers", 1))
    use_multiprocessing = property(lambda self: getattr(self, "_use_multiprocessing", False))
    max_queue_size = property(lambda self: getattr(self, "_max_queue_size", 10))

    @property
    def num_batches(self):
        if hasattr(self, "__len__"):
            return len(self)
        raise NotImplementedError("You need to implement the `num_batches` property.")

    def __getitem__(self, index):
        raise NotImplementedError

    def __iter__(self):
        n = self.num_batches
        for i in (range(n) if n is not None else itertools.count()):
            yield self[i]

    def on_epoch_begin(self):
        pass

    def on_epoch_end(self):
        pass


# (module, qualname) pairs that pickles of user datasets refer to, swapped in workers.
SWAPS = {
    ("keras.src.trainers.data_adapters.py_dataset_adapter", "PyDataset"): PyDataset,
}
