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
