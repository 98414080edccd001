"""from_samples with a dataset that writes samples into the batch's rows (`kpipe_sample_into`)."""

import numpy as np
import pytest

import kpipe


class Into:
    """Samples (a 3x2 float image of j, the label j % 3); `kpipe_sample_into` counts its calls."""

    def __init__(self, n=10):
        self.n, self.got, self.into = n, [], []

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        self.got.append(j)
        return np.full((3, 2), j, np.float32), np.int64(j % 3)

    def kpipe_sample_into(self, j, out):
        self.into.append(j)
        image, label = out
        assert image.shape == (3, 2) and image.dtype == np.float32 and label.shape == () and label.dtype == np.int64
        image[...] = j
        label[...] = j % 3


def test_rows_after_the_first_are_written_by_the_dataset():
    data = Into()
    with kpipe.ProcessLoader.from_samples(data, 4, shuffle=True, seed=3, workers=0) as loader:
        batches = [loader[i] for i in range(len(loader))]
    seen = np.concatenate([x[:, 0, 0] for x, _ in batches]).astype(int)
    assert sorted(seen.tolist()) == list(range(10))  # every sample once, its own values in its row
    for x, y in batches:
        assert (x == x[:, :1, :1]).all() and y.tolist() == [int(v) % 3 for v in x[:, 0, 0]]
    assert sorted(data.got) == sorted(seen[[0, 4, 8]].tolist())  # __getitem__: each batch's first sample only
    assert sorted(data.got + data.into) == list(range(10))


def test_an_error_in_the_hook_reaches_the_caller():
    class Broken(Into):
        def kpipe_sample_into(self, j, out):
            raise ValueError(f"sample {j} does not fit")

    with kpipe.ProcessLoader.from_samples(Broken(), 4, shuffle=False, workers=0) as loader:
        with pytest.raises(ValueError, match="sample 1 does not fit"):
            loader[0]
