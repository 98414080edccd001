"""`kpipe.fit_generator`: the Keras 2 `fit_generator` call, on Keras 3, with kpipe loaders."""

import warnings

import keras
import numpy as np

from kpipe import _compat
from kpipe.loader import ProcessLoader

# Batches Keras reads for a PyDataset's element spec before iterating it from batch 0
# (`NUM_BATCHES_FOR_TENSOR_SPEC` in Keras 3.5-3.15).
_SPEC_BATCHES = 2


def fit_generator(
    model,
    generator,
    steps_per_epoch=None,
    epochs=1,
    verbose=1,
    callbacks=None,
    validation_data=None,
    validation_steps=None,
    validation_freq=1,
    class_weight=None,
    max_queue_size=10,
    workers=1,
    use_multiprocessing=False,
    shuffle=True,
    initial_epoch=0,
    *,
    seed=None,
    timeout=120.0,
):
    """Trains `model` like Keras 2's `Model.fit_generator`, loading with kpipe.

    Keras 3 removed `fit_generator`; this keeps old training scripts running with only
    the `kpipe.` prefix and the `model` argument added. A `PyDataset`/`Sequence`
    `generator` (and `validation_data`) is wrapped in a `ProcessLoader`:
    `use_multiprocessing=True` runs `workers` processes with shared-memory hand-off,
    `use_multiprocessing=False` runs `workers` threads, `workers=0` loads in this
    thread. `shuffle` permutes the batch order of each pass (seeded by `seed`). A plain
    Python generator is passed to `model.fit` as it is (it cannot be split across
    workers). Loaders created here are closed before returning.

    Steps are Keras 2's: every epoch trains `steps_per_epoch` batches, drawn from the
    passes over `generator` one after another -- `steps_per_epoch=3` over 7 batches
    trains batches 0-2, 3-5, then 6 and the next pass's 0-1 -- and the Sequence's
    `on_epoch_end` runs at each end of a pass, as Keras 2's `OrderedEnqueuer` did (not
    at Keras's epoch ends, which fall inside passes). Plain Keras 3 `fit()` would stop
    the third epoch after one step, at the end of the data. With `initial_epoch`, the
    run starts where an uninterrupted run's epoch `initial_epoch` would (Keras 2 started
    at the first batch). Validation data is read as plain Keras 3 reads it.

    Args:
        model: A compiled `keras.Model`.
        generator: A `keras.utils.PyDataset`/`Sequence`, or a Python generator.
        steps_per_epoch: Batches per epoch. Defaults to None (the dataset's length).
        epochs: Defaults to 1.
        verbose: Defaults to 1.
        callbacks: Defaults to None.
        validation_data: A `PyDataset`/`Sequence`, a generator, or `(x, y[, w])`.
            Defaults to None.
        validation_steps: Defaults to None.
        validation_freq: Defaults to 1.
        class_weight: `{class: weight}`. Defaults to None.
        max_queue_size: Batches loaded ahead. Defaults to 10.
        workers: Loader workers. Defaults to 1.
        use_multiprocessing: Processes (True) or threads (False). Defaults to False.
        shuffle: Shuffle batch order each epoch. Defaults to True.
        initial_epoch: Defaults to 0.
        seed: Seed of the batch shuffle and worker RNGs. Defaults to None.
        timeout: Seconds to wait for one batch. Defaults to 120.

    Returns:
        The `keras.callbacks.History` of `model.fit`.

    Example:

    >>> import numpy as np, keras, kpipe
    >>> class Data(keras.utils.PyDataset):
    ...     def __len__(self):
    ...         return 4
    ...     def __getitem__(self, i):
    ...         rng = np.random.default_rng(i)
    ...         return rng.normal(size=(8, 3)).astype("float32"), rng.integers(0, 2, 8)
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="softmax")])
    >>> model.compile("sgd", "sparse_categorical_crossentropy")
    >>> history = kpipe.fit_generator(model, generator=Data(), epochs=2, verbose=0,
    ...                               class_weight={0: 2.0, 1: 1.0}, workers=2,
    ...                               use_multiprocessing=True)
    >>> len(history.history["loss"])
    2
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a keras.Model (kpipe.fit_generator(model, generator, ...)). "
            f"Received: model of type {type(model).__name__}."
        )
    owned = []

    def wrap(data, do_shuffle, what, steps=None):
        if not _indexable(data):
            if _is_generator(data) and workers > 1:
                warnings.warn(
                    f"`{what}` is a Python generator: it is read in this thread and "
                    f"workers={workers} is ignored. Pass a keras.utils.PyDataset to load in parallel.",
                    stacklevel=3,
                )
            return data
        loader = ProcessLoader(
            data,
            workers=workers,
            max_queue_size=max_queue_size,
            shuffle=do_shuffle,
            seed=seed,
            use_threads=not use_multiprocessing,
            timeout=timeout,
        )
        owned.append(loader)
        n = loader.num_batches
        if steps is not None and n and steps != n:
            # Keras 2's steps: the passes one after another (see the docstring)
            return _Passes(loader, start=initial_epoch * steps)
        if initial_epoch:
            loader.set_epoch(initial_epoch)
        return loader

    try:
        train = wrap(generator, shuffle, "generator", steps_per_epoch)
        val = wrap(validation_data, False, "validation_data") if validation_data is not None else None
        # A whole pass an epoch: Keras < 3.7 restarts it only when steps are None (see _compat).
        steps_per_epoch = _compat.finite_steps_per_epoch(
            steps_per_epoch, _finite_length(train), epochs, initial_epoch)
        validation_steps = _compat.finite_steps_per_epoch(
            validation_steps, _finite_length(val), -(-epochs // validation_freq)
            if isinstance(validation_freq, int) else epochs)
        return model.fit(
            train,
            steps_per_epoch=steps_per_epoch,
            epochs=epochs,
            verbose=verbose,
            callbacks=callbacks,
            validation_data=val,
            validation_steps=validation_steps,
            validation_freq=validation_freq,
            class_weight=class_weight,
            # the loader orders its batches (as `shuffle` said); Keras must not reorder a
            # `_Passes` (a plain PyDataset), and the same value for a loader warns of nothing
            shuffle=bool(shuffle) if isinstance(train, ProcessLoader) else False,
            initial_epoch=initial_epoch,
        )
    finally:
        for loader in owned:
            loader.close()


class _Passes(keras.utils.PyDataset):
    """A `ProcessLoader`'s passes one after another, as one endless `PyDataset`: batch `i`
    is the `i`-th batch (from `start`) of pass 0, then pass 1, ... -- what Keras 2's
    `fit_generator` drew `steps_per_epoch` at a time from its `OrderedEnqueuer`. Entering
    a pass runs the dataset's `on_epoch_end` (the enqueuer called it after each pass);
    Keras's own epoch calls reach no one. Read in order by one thread (Keras's); Keras
    first reads batches 0 and 1 for the element spec, then iterates from 0, so copies of
    the first `_SPEC_BATCHES` batches are kept and served again. Reading a pass already
    left otherwise raises."""

    def __init__(self, loader, start=0):
        super().__init__()  # workers=1, no multiprocessing: Keras reads in its own thread
        self._loader = loader
        self._first = {}  # index -> a copy of batch `index`, for index < _SPEC_BATCHES
        self._length = loader.num_batches
        skipped = start // self._length  # passes before `start`, each as long as the current one
        self._start = skipped * self._length - start  # where the loader's current pass begins
        if skipped:
            loader.set_epoch(loader.epoch + skipped)

    @property
    def num_batches(self):
        return None

    def __getitem__(self, index):
        if index in self._first:
            return self._first[index]
        while index >= self._start + self._length:  # a later pass: end this one, as Keras 2 did
            self._start += self._length
            self._loader.on_epoch_end()
            self._length = self._loader.num_batches
        if index < self._start:
            raise RuntimeError(
                f"fit_generator was asked for batch {index} of its endless view after batch {self._start} "
                "of a later pass: Keras restarted its iterator, which Keras 2's steps cannot follow. "
                "Pass steps_per_epoch=None (one pass an epoch) or report this with your Keras version."
            )
        batch = self._loader[index - self._start]
        if index < _SPEC_BATCHES:  # a copy: a loader's batch holds its shared-memory slot
            batch = _copy(batch)
            self._first[index] = batch
        return batch


def _copy(tree):
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_copy(v) for v in tree)
    return np.array(tree, copy=True)


def _finite_length(loader):
    return loader.num_batches if isinstance(loader, ProcessLoader) else None


def _indexable(data):
    return hasattr(data, "__getitem__") and (hasattr(data, "__len__") or hasattr(data, "num_batches")) and not isinstance(data, (tuple, list, dict))


def _is_generator(data):
    return hasattr(data, "__next__") or hasattr(data, "__iter__") and not hasattr(data, "__getitem__")
