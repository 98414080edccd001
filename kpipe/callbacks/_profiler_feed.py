"""`InputProfiler` on the JAX and PyTorch backends: the input wait timed where Keras's
epoch iterator hands each batch over.

NOTE [ Input wait on JAX and PyTorch ]
--------------------------------------
Neither the JAX nor the torch trainer fetches inside a compiled graph: Keras's epoch
iterator pulls each batch in Python, from the iterator its `_get_iterator()` returns (for
a `PyDataset` or `ProcessLoader`: the adapter's NumPy batches, put on the device by
`get_jax_iterator()` / the torch `DataLoader`):

    JAX   fit loop: on_train_batch_begin -> train_function(state, epoch_iterator)
                                              -> next(epoch_iterator)   <- input wait
                                              -> jitted step
    torch fit loop: next(epoch_iterator)     <- input wait
                    on_train_batch_begin -> train_function(batches)

So the profiler wraps the training epoch iterator's `_get_iterator` (on that one
instance, for the duration of `fit()`) so that each `next()` on what it returns is timed
(`_TimedIterator`), and wraps `model.train_function` to close each step when the call
returns. A step's record: its start is the first fetch since the last step ended (torch
fetches before the call) or the call's start (JAX fetches inside it), its wait is the
time blocked in those fetches, its samples are the fetched batches' leading dimension.
The figures are then those of the TensorFlow backend (the NOTE in `_profiler.py`): the
epoch's wall time from the first measured step's start to the last one's end.

The epoch iterator is found the way `_describe_input` finds the input: in Keras's
`fit()` frame, the local `epoch_iterator` (looked up from `on_train_begin`). A Keras
whose `fit()` keeps it elsewhere gets the warning that nothing is measured.
"""

import sys
import time


class TimedIterator:
    """Times every `next()` of `iterator` into `timer`."""

    __slots__ = ("_iterator", "_timer")

    def __init__(self, iterator, timer):
        self._iterator = iterator
        self._timer = timer

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        batch = next(self._iterator)  # StopIteration passes through, untimed
        self._timer.fetched(t0, time.perf_counter() - t0, batch)
        return batch


class StepTimer:
    """Wraps the training epoch iterator and the train function of one `fit()` on the
    JAX / PyTorch backend and reports each step to `record(start, end, wait_s, batches)`."""

    def __init__(self, model, epoch_iterator, record):
        self.model = model
        self.epoch_iterator = epoch_iterator
        self._record = record
        self._first = None  # start of the first fetch since the last step ended
        self._wait_s = 0.0
        self._batches = []
        self._original_get = epoch_iterator.__dict__.get("_get_iterator")
        get_iterator = epoch_iterator._get_iterator

        def _get_iterator():
            return TimedIterator(iter(get_iterator()), self)

        epoch_iterator._get_iterator = _get_iterator
        current = getattr(epoch_iterator, "_current_iterator", None)
        if current is not None and not isinstance(current, TimedIterator):
            epoch_iterator._current_iterator = TimedIterator(current, self)
        self.original = model.train_function
        model.train_function = self

    def fetched(self, t0, wait_s, batch):
        if self._first is None:
            self._first = t0
        self._wait_s += wait_s
        self._batches.append(batch)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        result = self.original(*args, **kwargs)
        end = time.perf_counter()
        if self._batches:
            first = self._first if self._first is not None and self._first < start else start
            self._record(first, end, self._wait_s, self._batches)
        self._first, self._wait_s, self._batches = None, 0.0, []
        return result

    def remove(self):
        """Puts Keras's train function and the epoch iterator's method back."""
        if self.model.train_function is self:
            self.model.train_function = self.original
        if self._original_get is None:
            self.epoch_iterator.__dict__.pop("_get_iterator", None)
        else:
            self.epoch_iterator._get_iterator = self._original_get
        current = getattr(self.epoch_iterator, "_current_iterator", None)
        if isinstance(current, TimedIterator):
            self.epoch_iterator._current_iterator = current._iterator


def fit_frame(model):
    """Keras's `fit()` frame of `model` on this thread's stack (its `self` is the model and
    it holds `epoch_iterator`), or None."""
    frame = sys._getframe(1)
    while frame is not None:
        local = frame.f_locals
        if local.get("self") is model and "epoch_iterator" in local and frame.f_code.co_name == "fit":
            return frame
        frame = frame.f_back
    return None


def batch_size(batch):
    """Samples in a batch (a nest of arrays / tensors): the first leaf's leading dimension."""
    import keras

    for leaf in keras.tree.flatten(batch):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) > 0 and shape[0] is not None:
            return int(shape[0])
    return 0
