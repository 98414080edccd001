# Adapted from keras-team/keras v3.15.1 keras/src/trainers/trainer_test.py, Apache License 2.0
# (Copyright The Keras Authors). Only the cases that use a PyDataset: the "py_dataset*" cases
# of TestTrainer.test_fit_with_data_adapter, with the helpers they need (ExampleModel,
# TestPyDataset, the py_dataset branch of create_dataset). Changes: every test runs in two
# modes (see _upstream.py and README.md): "plain" hands Keras the PyDataset itself, "kpipe"
# hands it `kpipe.ProcessLoader(dataset, workers=2)`; the unittest/absl class became a pytest
# class; the Trainer is the active backend's (TensorFlow, JAX or PyTorch: tests/test_backend_jax.py
# runs this folder under KERAS_BACKEND=jax); the custom marker `requires_trainable_backend` is
# dropped (all three are trainable). The test asserts that
# fit() runs (upstream has no assertion in it). `backend.device` is `device` (Keras < 3.7
# has `device_scope`).
import pytest

from _upstream import (
    UpstreamTestCase,
    mode,  # noqa: F401 -- fixture
    named_parameters,
    wrap,  # noqa: F401 -- fixture
)
from keras.src import backend
from keras.src import initializers
from keras.src import layers
from keras.src import losses
from keras.src import metrics
from keras.src import ops
from keras.src import optimizers
if backend.backend() == "jax":
    from keras.src.backend.jax.trainer import JAXTrainer as Trainer
elif backend.backend() == "torch":
    from keras.src.backend.torch.trainer import TorchTrainer as Trainer
else:
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer as Trainer
from keras.src.trainers.data_adapters import py_dataset_adapter

# `backend.device` is Keras >= 3.7; before, the same context manager is `backend.device_scope`.
device = getattr(backend, "device", None) or backend.device_scope

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


# A model is just a layer mixed in with a Trainer.
class ExampleModel(Trainer, layers.Dense):
    def __init__(self, units):
        layers.Dense.__init__(
            self,
            units=units,
            use_bias=False,
            kernel_initializer=initializers.Ones(),
        )
        Trainer.__init__(self)


class TestPyDataset(py_dataset_adapter.PyDataset):
    def __init__(self, infinite=False, **kwargs):
        super().__init__(**kwargs)
        self.infinite = infinite

    @property
    def num_batches(self):
        return None if self.infinite else 20

    def __getitem__(self, idx):
        CPU_DEVICES = {
            "tensorflow": "CPU:0",
            "jax": "cpu:0",
            "torch": "cpu",
        }
        with device(CPU_DEVICES[backend.backend()]):
            return ops.ones((5, 4)), ops.zeros((5, 3))


TestPyDataset.__test__ = False  # a dataset, not a pytest test class


def create_dataset(dataset_type, dataset_kwargs, wrap):
    # Upstream's other dataset types (arrays, tf.data, torch, generators, grain) use no
    # PyDataset and are left out.
    if dataset_type == "py_dataset":
        return wrap(TestPyDataset(**dataset_kwargs)), None
    else:
        raise ValueError(f"Invalid dataset type {dataset_type}")


class TestTrainer(UpstreamTestCase):
    @named_parameters(
        [
            {
                "testcase_name": "py_dataset",
                "dataset_type": "py_dataset",
            },
            {
                "testcase_name": "py_dataset_cw",
                "dataset_type": "py_dataset",
                "fit_kwargs": {"class_weight": {0: 1, 1: 2}},
            },
            {
                "testcase_name": "py_dataset_infinite",
                "dataset_type": "py_dataset",
                "dataset_kwargs": {"infinite": True},
                "fit_kwargs": {"steps_per_epoch": 20},
            },
            {
                "testcase_name": "py_dataset_infinite_cw",
                "dataset_type": "py_dataset",
                "dataset_kwargs": {"infinite": True},
                "fit_kwargs": {
                    "steps_per_epoch": 20,
                    "class_weight": {0: 1, 1: 2},
                },
            },
            {
                "testcase_name": "py_dataset_multithreading",
                "dataset_type": "py_dataset",
                "dataset_kwargs": {"workers": 2},
            },
            {
                "testcase_name": "py_dataset_multithreading_cw",
                "dataset_type": "py_dataset",
                "dataset_kwargs": {"workers": 2},
                "fit_kwargs": {"class_weight": {0: 1, 1: 2}},
            },
            {
                "testcase_name": "py_dataset_multithreading_infinite",
                "dataset_type": "py_dataset",
                "dataset_kwargs": {"infinite": True, "workers": 2},
                "fit_kwargs": {"steps_per_epoch": 20},
            },
            {
                "testcase_name": "py_dataset_multiprocessing",
                "dataset_type": "py_dataset",
                "dataset_kwargs": {"workers": 2, "use_multiprocessing": True},
            },
            {
                "testcase_name": "py_dataset_multiprocessing_cw",
                "dataset_type": "py_dataset",
                "dataset_kwargs": {"workers": 2, "use_multiprocessing": True},
                "fit_kwargs": {"class_weight": {0: 1, 1: 2}},
            },
            {
                "testcase_name": "py_dataset_multiprocessing_infinite",
                "dataset_type": "py_dataset",
                "dataset_kwargs": {
                    "infinite": True,
                    "workers": 2,
                    "use_multiprocessing": True,
                },
                "fit_kwargs": {"steps_per_epoch": 20},
            },
        ]
    )
    def test_fit_with_data_adapter(
        self, mode, wrap, dataset_type, dataset_kwargs={}, fit_kwargs={}
    ):
        jit_compile = True
        if dataset_kwargs.get("use_multiprocessing", False):
            if backend.backend() == "jax" and mode == "plain":
                # kpipe: as on TensorFlow below, kpipe mode runs it (a ProcessLoader)
                pytest.skip("Multiprocessing not supported with JAX backend")
            elif backend.backend() == "tensorflow" and mode == "plain":
                # kpipe: a ProcessLoader loads the batches itself (Keras's own worker
                # pool, which hangs on TensorFlow, is not used), so kpipe mode runs it.
                pytest.skip("Multiprocessing hangs on Tensorflow")

        model = ExampleModel(units=3)
        optimizer = optimizers.Adagrad()
        model.compile(
            optimizer=optimizer,
            loss=losses.MeanSquaredError(),
            metrics=[metrics.MeanSquaredError()],
            jit_compile=jit_compile,
        )
        x, y = create_dataset(dataset_type, dataset_kwargs, wrap)
        model.fit(x, y, epochs=3, **fit_kwargs)
