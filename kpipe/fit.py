"""`kpipe.fit_generator`: the Keras 2 `fit_generator` call, on Keras 3, with kpipe loaders."""

import warnings

import keras

from kpipe import _compat
from kpipe.loader import ProcessLoader


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
    thread. `shuffle` permutes the batch order each epoch (seeded by `seed`). A plain
    Python generator is passed to `model.fit` as it is (it cannot be split across
    workers). Loaders created here are closed before returning.

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

    def wrap(data, do_shuffle, what):
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
        if initial_epoch:
            loader.set_epoch(initial_epoch)
        return loader

    try:
        train = wrap(generator, shuffle, "generator")
        val = wrap(validation_data, False, "validation_data") if validation_data is not None else None
        # Keras < 3.7 never restarts a finite dataset when steps are given: see _compat.
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
            shuffle=False,
            initial_epoch=initial_epoch,
        )
    finally:
        for loader in owned:
            loader.close()


def _finite_length(loader):
    return loader.num_batches if isinstance(loader, ProcessLoader) else None


def _indexable(data):
    return hasattr(data, "__getitem__") and (hasattr(data, "__len__") or hasattr(data, "num_batches")) and not isinstance(data, (tuple, list, dict))


def _is_generator(data):
    return hasattr(data, "__next__") or hasattr(data, "__iter__") and not hasattr(data, "__getitem__")
