# Adapted from keras-team/keras v3.15.1 keras/src/trainers/epoch_iterator_test.py, Apache License 2.0
# (Copyright The Keras Authors). Only the cases that use a PyDataset (test_epoch_callbacks).
# Changes: every test runs in two modes (see _upstream.py and README.md): "plain" hands
# Keras the PyDataset itself, "kpipe" hands it `kpipe.ProcessLoader(dataset, workers=2)`;
# the unittest/absl class became a pytest class. Assertions are upstream's, unchanged.
import numpy as np
import pytest

from _upstream import (
    UpstreamTestCase,
    mode,  # noqa: F401 -- fixture
    named_parameters,
    needs_keras,
    wrap,  # noqa: F401 -- fixture
)
from keras.src.trainers import data_adapters
from keras.src.trainers import epoch_iterator

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


class TestEpochIterator(UpstreamTestCase):
    @named_parameters(
        [
            {"testcase_name": "infinite", "infinite": True},
            {"testcase_name": "finite", "infinite": False},
        ]
    )
    def test_epoch_callbacks(self, wrap, infinite):
        needs_keras(
            (3, 11),
            "iterating an EpochIterator yields (begin_step, end_step, batch) from Keras "
            "3.11 (3.7-3.10: (step, batch); before 3.7 only enumerate_epoch() iterates)",
        )

        class TestPyDataset(data_adapters.py_dataset_adapter.PyDataset):
            def __init__(
                self,
                workers=1,
                use_multiprocessing=False,
                max_queue_size=10,
                infinite=False,
            ):
                super().__init__(workers, use_multiprocessing, max_queue_size)
                self.data = np.random.rand(64, 2)
                self.batch_size = 16
                self.infinite = infinite

                # check that callbacks are called in the correct order
                self.tracker = []

            @property
            def num_batches(self):
                if self.infinite:
                    return None
                return len(self.data) // self.batch_size

            def on_epoch_begin(self):
                self.tracker.append(1)

            def __getitem__(self, index):
                idx = index % 2
                return self.data[
                    idx * self.batch_size : (idx + 1) * self.batch_size
                ]

            def on_epoch_end(self):
                self.tracker.append(2)

        ds = TestPyDataset(infinite=infinite)
        epoch_iter = epoch_iterator.EpochIterator(x=wrap(ds), steps_per_epoch=10)

        num_epochs = 5
        for epoch in range(num_epochs):
            for _, _, _ in epoch_iter:
                pass

        self.assertAllEqual(ds.tracker, [1, 2] * num_epochs)
