"""Per-sample datasets for tests/test_samples.py, in a module that imports only NumPy: the
workers that unpickle them must not import TensorFlow on their account."""

import numpy as np


class Points:
    """Sample j: x = a (3,) float32 row of j, y = j (a Python int), w = j / 10."""

    def __init__(self, n=10, ragged_at=None, dict_samples=False):
        self.n, self.ragged_at, self.dict_samples = n, ragged_at, dict_samples

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        if not 0 <= j < self.n:
            raise IndexError(j)
        x = np.full(4 if j == self.ragged_at else 3, j, np.float32)
        if self.dict_samples:
            return {"x": x, "y": j}
        return x, j, np.float32(j / 10)


class Counter(Points):
    """Points with a hook: on_epoch_end adds 100 to every x from then on."""

    def __init__(self, n=10):
        super().__init__(n)
        self.shift = 0

    def __getitem__(self, j):
        x, y, w = super().__getitem__(j)
        return x + self.shift, y, w

    def on_epoch_end(self):
        self.shift += 100
