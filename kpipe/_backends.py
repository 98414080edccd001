"""Which Keras backend is running (`KERAS_BACKEND`: tensorflow, jax or torch), its trainer
class, and the refusal of TensorFlow-only names on the others.

NOTE [ kpipe on the JAX and PyTorch backends ]
----------------------------------------------
Keras picks its backend once, when `keras` is first imported. A `ProcessLoader` is a
`keras.utils.PyDataset`, so every backend reads it through the same `PyDatasetAdapter`
(kpipe's subclass, `kpipe/_keras_hook.py`): the TensorFlow trainer as a `tf.data`
dataset or a `kpipe._feed.Feed`, the JAX trainer through `get_jax_iterator()` (NumPy
batches, `jax.device_put` by Keras), the torch trainer through `get_torch_dataloader()`.
The hooks that make a loader follow Keras's calls -- epochs planned per `fit`/
`evaluate`/`predict`, `kpipe._fit_scope.running` for kpipe's callbacks -- wrap the
*active* backend's trainer class (`trainer_class()`); the TensorFlow-only hooks (the
symbolic-build probe under a strategy, the feed) are installed on TensorFlow only, so on
jax and torch neither kpipe nor its loader workers import TensorFlow.

What needs TensorFlow's `tf.distribute` (kpipe's strategies, parameter-server training,
pipeline model parallelism) raises `UnsupportedBackendError` on the other backends,
naming what to use there instead (`keras.distribution.DataParallel` on JAX).

Example:

>>> from kpipe import _backends
>>> _backends.name() in ("tensorflow", "jax", "torch", "numpy", "openvino")
True
"""

import os

from kpipe.errors import UnsupportedBackendError

# Keras's trainer class per backend: (module, class name).
_TRAINERS = {
    "tensorflow": ("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer"),
    "jax": ("keras.src.backend.jax.trainer", "JAXTrainer"),
    "torch": ("keras.src.backend.torch.trainer", "TorchTrainer"),
}

# TensorFlow-only kpipe names -> what to use on the JAX / PyTorch backends instead.
INSTEAD = {
    "auto_strategy": "keras.distribution.DataParallel() with keras.distribution.set_distribution(...) "
    "on JAX (docs: guides/backends.md); on PyTorch, torch.distributed outside Keras's fit()",
    "MultiWorkerMirroredStrategy": "keras.distribution.DataParallel over jax.distributed processes on JAX",
    "ps_fit": "plain model.fit(kpipe.ProcessLoader(...)): parameter-server training is tf.distribute's",
    "pipeline_model": "keras.distribution.ModelParallel (a LayoutMap) on JAX",
    "PipelineModel": "keras.distribution.ModelParallel (a LayoutMap) on JAX",
}


def name():
    """The Keras backend this process runs (`keras.config.backend()`), read without
    importing Keras when it is not imported yet (the `KERAS_BACKEND` variable, else
    Keras's config file, else "tensorflow")."""
    import sys

    if "keras" in sys.modules:
        from keras.src.backend import config

        return config.backend()
    value = os.environ.get("KERAS_BACKEND")
    if value:
        return value
    try:
        import json

        home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
        with open(os.path.join(home, "keras.json")) as f:
            return json.load(f).get("backend", "tensorflow")
    except (OSError, ValueError):
        return "tensorflow"


def is_tensorflow():
    return name() == "tensorflow"


def trainer_class():
    """Keras's trainer class of the active backend (whose `fit`/`evaluate`/`predict`
    kpipe wraps), or None when this Keras lays its modules out differently."""
    import importlib

    module, cls = _TRAINERS.get(name(), (None, None))
    if module is None:
        return None
    try:
        return getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError):
        return None


def require_tensorflow(feature):
    """Raises `UnsupportedBackendError` for the TensorFlow-only `feature` (a key of
    `INSTEAD` or a description) when the Keras backend is not TensorFlow."""
    backend = name()
    if backend == "tensorflow":
        return
    instead = INSTEAD.get(feature, "the TensorFlow backend (KERAS_BACKEND=tensorflow)")
    raise UnsupportedBackendError(
        f"`kpipe.distribute.{feature}` needs TensorFlow's tf.distribute, which Keras uses on the "
        f"TensorFlow backend only. Received: KERAS_BACKEND={backend!r}. On this backend use "
        f"{instead} instead, or set KERAS_BACKEND=tensorflow before importing Keras."
    )


class NoStrategy:
    """What kpipe's callbacks use as `model.distribute_strategy` on a backend without
    `tf.distribute` (JAX, PyTorch): one replica, a scope that does nothing."""

    num_replicas_in_sync = 1

    def scope(self):
        import contextlib

        return contextlib.nullcontext()


NO_STRATEGY = NoStrategy()


def strategy_of(model):
    """`model.distribute_strategy` on TensorFlow; `NO_STRATEGY` on the other backends.

    (Never `getattr(model, "distribute_strategy", None)` on JAX: a missing attribute on a
    model there goes through Keras's attribute lookup, which mid-`fit()` leaves the next
    step a donated state buffer: "Buffer has been deleted or donated".)"""
    return model.distribute_strategy if is_tensorflow() else NO_STRATEGY


def numpy_value(x):
    """`keras.ops.convert_to_numpy(x)`; a `keras.Variable` on JAX/PyTorch is read through its
    `.value` (the variable itself warns there: its `__array__` takes no `copy` argument)."""
    import keras

    from kpipe._compat import is_keras_variable

    if is_keras_variable(x) and not is_tensorflow():
        x = x.value
    return keras.ops.convert_to_numpy(x)
