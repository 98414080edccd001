"""Datasets and a model for the fit(shuffle=...) tests (tests/test_fit_shuffle.py,
tests/test_fit_audit.py): the model's first layer records the id of every batch it sees
(`run_eagerly=True`); module level, so that the datasets pickle."""

import keras
import numpy as np

N = 8
SEEN = []


class Ids(keras.utils.PyDataset):
    """Batch `i`: x filled with `i` (the id the model's first layer records)."""

    def __init__(self, n=N, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full((2, 1), i, "float32"), np.full((2, 1), i % 2, "float32")


class Points:
    """A per-sample dataset (for `from_samples`): sample `j` is `j`."""

    def __len__(self):
        return 12

    def __getitem__(self, j):
        return np.float32([j]), np.float32([0])


class Record(keras.layers.Layer):
    """Passes its input on, appending the batch's id (`x[0, 0]`) to `SEEN`."""

    def call(self, x):
        try:
            SEEN.append(int(keras.ops.convert_to_numpy(x)[0, 0]))
        except Exception:  # noqa: BLE001 -- the symbolic build: no batch
            pass
        return x


def recording_model(seed=0):
    """`keras.utils.set_random_seed(seed)`, then a model whose first layer appends the id of
    each batch it sees to `SEEN`."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((1,)), Record(), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse", run_eagerly=True)
    return model


def split_epochs(ids, n=N):
    """`ids` cut into epochs of `n` batches."""
    return [ids[i:i + n] for i in range(0, len(ids), n)]
