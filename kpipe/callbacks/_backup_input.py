"""Which inputs of `fit()` `BackupAndRestore` can resume inside an epoch, and how.

NOTE [ Inputs a mid-epoch backup can position ]
-----------------------------------------------
A backup taken at step s of epoch e resumes by starting epoch e again and skipping its
first s steps (see NOTE [ Resuming inside an epoch ] in `_backup.py`). The steps after
them train on exactly the batches of the uninterrupted run only if the input stands
where that run's input stood:

* a `kpipe.ProcessLoader` given as `loaders=` is put back on its saved position, and
  the skipped steps read nothing ("positioned");
* NumPy arrays (and tensors, lists and dicts of them) that `fit()` does not shuffle are
  batched the same way in every epoch and every process: the skipped steps read their
  batch and drop it, so the first trained step takes batch s ("read through"). Shuffled
  arrays are not: Keras draws each epoch's order from TensorFlow's random state, which a
  relaunched process does not share; nor are arrays with `steps_per_epoch` shorter than
  a pass (Keras then carries its iterator across epochs);
* a `tf.data.Dataset`, a generator, a plain `PyDataset`, or a `ProcessLoader` not given
  as `loaders=`, has a position (a shuffle buffer's random state, a generator's frame, a
  pass's order) that the backup cannot record: the resumed epoch would train other
  batches than the interrupted run, silently.

So `fit()` with such an input and backups that can fall inside an epoch (`save_freq` not
a multiple of the steps per epoch) is refused before the first step, with the way out.
With `loaders=` and another input (e.g. `loader.as_dataset()`) the input is taken to be
read from those loaders.
"""

from typing import Optional, Sequence

POSITIONED = "positioned"
READ_THROUGH = "read-through"


def resume_mode(model, save_freq: int, steps: Optional[int], loaders: Sequence) -> str:
    """How a backup of `model`'s running `fit()` resumes inside an epoch: `POSITIONED`
    (nothing to read) or `READ_THROUGH` (skipped steps read their batch).

    Raises:
        ValueError: the input cannot be resumed inside an epoch; the message says why and
            how to fix it.
    """
    from kpipe import _fit_scope

    call = _fit_scope.current(model)
    arguments = call.arguments if call is not None else {}
    x = arguments.get("x")
    if call is not None and _is_loader(x):
        if any(x is loader for loader in loaders):
            return POSITIONED
        fix = ("it is not in `loaders`, so its position is not saved. Pass it as "
               "BackupAndRestore(..., loaders=loader) (kpipe.fit_generator makes a loader of "
               "its own: call fit() with a kpipe.ProcessLoader instead)")
        return _refuse(save_freq, steps, f"a kpipe.ProcessLoader ({_describe(x)})", fix)
    if call is not None and _is_arrays(x, arguments):
        if arguments.get("shuffle"):
            return _refuse(save_freq, steps, f"x={_describe(x)}, shuffle={arguments['shuffle']!r}",
                           "Keras shuffles arrays anew in every epoch and process. Pass "
                           "shuffle=False to fit() (arrays are then batched alike every epoch)")
        if arguments.get("steps_per_epoch") is not None:
            return _refuse(save_freq, steps, f"x={_describe(x)}, steps_per_epoch="
                           f"{arguments['steps_per_epoch']!r}", "Keras carries its iterator over "
                           "arrays across epochs then. Leave steps_per_epoch unset")
        return READ_THROUGH
    if loaders:
        return POSITIONED
    what = f"x={_describe(x)}" if call is not None else "an input that kpipe's fit() hook did not see"
    return _refuse(save_freq, steps, what, "its position cannot be saved. Feed fit() a "
                   "kpipe.ProcessLoader and pass it as BackupAndRestore(..., loaders=loader)")


def _refuse(save_freq, steps, received, fix):
    raise ValueError(
        f"BackupAndRestore(save_freq={save_freq}) can resume inside an epoch, but not with "
        f"this input: a resumed epoch would train other batches than the interrupted run. "
        f"Received: {received}; {fix}, or use save_freq='epoch' (or a multiple of the "
        f"{steps} steps per epoch).")


def _is_loader(x) -> bool:
    return getattr(type(x), "_kpipe_orders_batches", False)


def _is_arrays(x, arguments) -> bool:
    try:
        from keras.src.trainers.data_adapters import array_data_adapter
    except ImportError:  # another Keras layout: not known to be arrays
        return False
    try:
        return bool(array_data_adapter.can_convert_arrays((x, arguments.get("y"),
                                                           arguments.get("sample_weight"))))
    except Exception:  # noqa: BLE001 -- Keras raises on inputs it does not know
        return False


def _describe(x) -> str:
    kind = type(x)
    return f"<{kind.__module__}.{kind.__qualname__}>"
