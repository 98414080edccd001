"""`BackupAndRestore` resuming inside an epoch on the PyTorch backend.

The torch trainer's epoch iterator fetches each step's batch *before* the step's
`on_train_batch_begin` and `train_function` call (the TensorFlow and JAX trainers fetch
inside the call, which `_StepGate` does not make for a skipped step). A positioned loader
is restored to the first batch the interrupted run had not trained on, so the fetches of
the skipped steps must not read it: `hold_fetches` wraps the training epoch iterator's
`_get_iterator` (on that instance, for the resumed `fit()`) so that while steps are
being skipped a fetch returns None without reading, and the step gate drops it.
"""

from kpipe.callbacks import _profiler_feed


class _HeldFetches:
    __slots__ = ("_iterator", "_callback")

    def __init__(self, iterator, callback):
        self._iterator = iterator
        self._callback = callback

    def __iter__(self):
        return self

    def __next__(self):
        if self._callback._skip > 0:  # noqa: SLF001 -- a skipped step: trained before the backup
            return None
        return next(self._iterator)


def hold_fetches(model, callback):
    """Makes the skipped steps of the resumed epoch read nothing (see the module docstring);
    returns False where Keras's `fit()` frame or its epoch iterator is not found."""
    frame = _profiler_feed.fit_frame(model)
    iterator = frame.f_locals["epoch_iterator"] if frame is not None else None
    if iterator is None or not hasattr(iterator, "_get_iterator"):
        return False
    get_iterator = iterator._get_iterator

    def _get_iterator():
        return _HeldFetches(iter(get_iterator()), callback)

    iterator._get_iterator = _get_iterator
    return True
