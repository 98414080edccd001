"""What kpipe asks of a user's dataset in the main process: its length and whether it has
epoch hooks of its own (beyond the no-ops of Keras's `PyDataset`)."""

import operator

import keras

from kpipe._engine._pydataset_shim import PyDataset as _ShimPyDataset
from kpipe.errors import LoaderError


def num_batches(dataset):
    """The dataset's batches per pass (`num_batches` or `len()`), None when infinite.

    Raises:
        TypeError: it has no length (or no `__getitem__`).
        LoaderError: its `len()` raised.
        ValueError: it is empty.
    """
    if not hasattr(dataset, "__getitem__"):
        raise TypeError(
            f"`dataset` must have __getitem__ and __len__ (a keras.utils.PyDataset or Sequence). "
            f"Received: {type(dataset).__name__}. For a Python generator, pass it to model.fit directly."
        )
    try:
        n = dataset.num_batches if hasattr(type(dataset), "num_batches") else len(dataset)
    except (TypeError, NotImplementedError) as exc:
        raise TypeError(
            f"Cannot tell how many batches `{type(dataset).__name__}` has: {exc}. Define __len__ "
            "(or a num_batches property returning None for an infinite dataset)."
        ) from None
    except Exception as exc:
        raise LoaderError(
            f"len() of `{type(dataset).__name__}` raised {type(exc).__name__}: {exc}. kpipe asks the "
            "dataset for its length when the loader is built and after each pass; fix __len__ "
            "(or num_batches) so that it returns the number of batches."
        ) from exc
    if n is None:
        return None
    n = operator.index(n)
    if n <= 0:
        raise ValueError(
            f"`{type(dataset).__name__}` is empty: it has {n} batches. Check the data path or the "
            "batch size (len() must be the number of batches, not samples)."
        )
    return n


def overrides(obj, method):
    """True when `obj` defines `method` beyond the no-op of (Keras's or kpipe's) PyDataset."""
    impl = getattr(type(obj), method, None)
    if impl is None:
        return False
    return impl not in (getattr(keras.utils.PyDataset, method, None), getattr(_ShimPyDataset, method, None))


def has_hooks(dataset):
    """Whether the dataset has epoch hooks of its own (the loader's rule applies to them)."""
    return overrides(dataset, "on_epoch_end") or overrides(dataset, "on_epoch_begin")


def call_pass_end_hooks(dataset):
    """What runs at a pass end: the dataset's on_epoch_end, then its on_epoch_begin."""
    if hasattr(dataset, "on_epoch_end"):
        dataset.on_epoch_end()
    if overrides(dataset, "on_epoch_begin"):
        dataset.on_epoch_begin()
