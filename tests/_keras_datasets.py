"""keras.utils.PyDataset subclasses for the fit tests (module-level so workers can import)."""

import keras
import numpy as np

from _datasets import Regression


class RegressionPyDataset(keras.utils.PyDataset):
    def __init__(self, weights=False, classes=False, n=6, **kwargs):
        super().__init__(**kwargs)
        self.inner = Regression(n=n, weights=weights, classes=classes)
        self.epochs_ended = 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]

    def on_epoch_end(self):
        self.epochs_ended += 1


class InfiniteClasses(keras.utils.PyDataset):
    @property
    def num_batches(self):
        return None

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        x = rng.normal(size=(8, 4)).astype("float32")
        return x, (x.sum(axis=1) > 0).astype("int64")


class Probe(keras.utils.PyDataset):
    """Reports whether the worker running it imported TensorFlow/Keras."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import sys

        return np.full((2, 1), i, "float32"), np.array(["tensorflow" in sys.modules, "keras" in sys.modules])


class BatchIds(keras.utils.PyDataset):
    """Batch i holds the id i in every entry of x; appends i to the file `log` (if set)
    at every load, so tests count __getitem__ calls across worker processes."""

    def __init__(self, n=12, log=None, **kwargs):
        super().__init__(**kwargs)
        self.n, self.log = n, log

    def __len__(self):
        return self.n

    def _note(self, i):
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{i}\n")

    def __getitem__(self, i):
        self._note(i)
        return np.full((2, 3), i, "float32"), np.zeros((2, 1), "float32")


class ReplacingIds(BatchIds):
    """The canonical Keras Sequence: on_epoch_end *replaces* its index array with a new
    permutation; batch i holds id order[i]."""

    def __init__(self, n=12, log=None, **kwargs):
        super().__init__(n, log, **kwargs)
        self.order = np.arange(n)
        self.ends = 0

    def __getitem__(self, i):
        self._note(i)
        return np.full((2, 3), self.order[i], "float32"), np.zeros((2, 1), "float32")

    def on_epoch_end(self):
        self.ends += 1
        self.order = np.random.default_rng(self.ends).permutation(self.n)


class GrowingIds(BatchIds):
    """A curriculum: every on_epoch_end adds two batches."""

    def __init__(self, n=4, log=None, **kwargs):
        super().__init__(n, log, **kwargs)
        self.ends = 0

    def on_epoch_end(self):
        self.ends += 1
        self.n += 2


class HookLog(BatchIds):
    """Records its epoch hooks ("B", "E") in `calls`, in this process, and appends each
    load to the file `log`; `reshuffle`: on_epoch_end replaces the order (batch i holds
    id order[i]), seeded by the count of calls; `infinite`: num_batches is None."""

    def __init__(self, n=6, log=None, reshuffle=False, infinite=False, **kwargs):
        super().__init__(n, log, **kwargs)
        self.calls, self.reshuffle, self.infinite = [], reshuffle, infinite
        self.order = np.arange(n)

    @property
    def num_batches(self):
        return None if self.infinite else self.n

    def __getstate__(self):  # the record of calls is not state the batches depend on
        return {k: v for k, v in self.__dict__.items() if k != "calls"}

    def __setstate__(self, state):
        self.__dict__.update(state, calls=[])

    def __getitem__(self, i):
        self._note(i)
        return np.full((2, 3), self.order[i % self.n], "float32"), np.zeros((2, 1), "float32")

    def on_epoch_begin(self):
        self.calls.append("B")

    def on_epoch_end(self):
        self.calls.append("E")
        if self.reshuffle:
            self.order = np.random.default_rng(len(self.calls)).permutation(self.n)
