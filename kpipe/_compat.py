"""What differs between the TensorFlow / Keras versions kpipe supports, in one place.

NOTE [ Supported versions and what differs between them ]
---------------------------------------------------------
kpipe is tested on the pairs in the README's "Tested with" table
(`scripts/version_matrix.py` runs the suite on each); `MIN_TENSORFLOW` / `MIN_KERAS` below
are its oldest row and equal the floors in `setup.cfg`. `import kpipe` refuses older
versions (`check_versions`). Keras internals that kpipe relies on changed inside that
range; every version test about them lives in this module:

    Keras   what differs from the newest Keras, and what kpipe does about it
    -----   ----------------------------------------------------------------
    < 3.5   Not supported (below `MIN_KERAS`): the TensorFlow optimizer all-reduces
            gradients inside its merge call, where there is no replica context, so it
            does not reduce at all and MirroredStrategy's copies of a variable drift
            apart; Keras 3.3/3.4 never call a dataset's `on_epoch_begin`.
    < 3.7   `model.train_function` is a `tf.function` of an *iterator* that calls
            `next(iterator)` in the graph: a Python list is no iterator, and any Python
            object passed to it is traced anew on every call, so
            `train_step_on_batches()` builds Keras's one-step function for the profiler.
            `TFEpochIterator` keeps one iterator across epochs when `steps_per_epoch`
            is set and never restarts it: a finite dataset runs out after one pass
            ("Your input ran out of data"), the epoch in which it ran out ends there and
            later epochs get no batches; so `finite_steps_per_epoch()` passes a full
            pass as `None` (Keras then restarts the dataset every epoch).
            `steps_per_execution=k` runs k one-step calls in a Python loop, which works
            under MultiWorkerMirroredStrategy. `BackupAndRestore` has no
            `double_checkpoint` argument.
    >= 3.7  `train_function` also takes a Python iterable of batches (as
            `train_on_batch` passes it), so kpipe's epoch iterator hands a
            ProcessLoader over through `kpipe._feed.Feed` (before 3.7, through the
            adapter's `tf.data.Dataset.from_generator`). With `steps_per_epoch` set,
            `EpochIterator` keeps one iterator across epochs and restarts a finite
            dataset only once a whole pass was drawn; an epoch that would run past the
            pass's end stops there ("Your input ran out of data"): `steps_per_epoch=3`
            over 7 batches trains 3, 3, 1, 3, 3, 1 steps (checked up to 3.15.1; Keras 2
            trained 3, 3, 3 across the end: `kpipe.fit_generator` does, on every
            version, by handing Keras its passes as one endless dataset); `steps_per_execution=k` is a `tf.while_loop` over
            `get_next_as_optional`, which fails under MultiWorkerMirroredStrategy
            (kpipe's epoch iterator hands Keras a Python iterator there, so that it
            runs the k steps in Python: `kpipe/_keras_hook.py`, `_StepsInPython`).
    < 3.8   Under a `tf.distribute` strategy with N > 1 replicas the loss is not divided
            by N before the gradients are summed across replicas: every step is N times
            too large. 3.8 divides each loss by N in `Loss.__call__`;
            `install_keras_fixes()` divides it in the optimizer's `scale_loss`, which
            `train_step` calls on the loss inside the tape after the loss tracker saw
            it: the same gradients and logs as 3.8.
    < 3.9   `fit()` rejects a dataset from `strategy.distribute_datasets_from_function`
            ("Unrecognized data type"); nothing kpipe can fix from outside `fit()`.
    < 3.10  Metric variables are not synchronized on read: under N > 1 replicas the
            epoch's logs (`History`, callbacks, `evaluate()`) are replica 0's metrics
            (per-step logs are right: Keras averages them over replicas).
            `install_keras_fixes()` makes the epoch logs the last step's logs under
            N > 1 replicas -- exact when replicas get equal shares of each batch, as
            Keras's batch splitting gives.

`install_keras_fixes()` is idempotent and patches nothing on Keras >= 3.10; kpipe's
strategies (`kpipe.distribute`) call it on import.

Importing this module is cheap: it never imports TensorFlow or Keras itself.
"""

import os
import re
import sys

# The oldest tested pair (README "Tested with", setup.cfg install_requires).
MIN_TENSORFLOW = "2.16.2"
MIN_KERAS = "3.5.0"

# Distributions that provide the `tensorflow` / `keras` modules.
_DISTRIBUTIONS = {
    "tensorflow": ("tensorflow", "tensorflow_cpu", "tensorflow_gpu", "tensorflow_intel",
                   "tensorflow_macos", "tensorflow_aarch64", "tf_nightly", "tf_nightly_cpu"),
    "keras": ("keras", "keras_nightly"),
}
_REQUIRED = {"tensorflow": MIN_TENSORFLOW, "keras": MIN_KERAS}
_SKIP_ENV = "KPIPE_SKIP_VERSION_CHECK"

# Keras versions from which a Keras behaviour kpipe adapts to exists.
KERAS_ITERABLE_TRAIN_FUNCTION = (3, 7)  # train_function takes a list of batches; reset()
# For kpipe's Keras hook (kpipe/_keras_hook.py, kpipe/_reader.py): EpochIterator.reset(),
# _enumerate_iterator(), __iter__/__next__ and _interrupted_warning() exist from 3.7 (before:
# enumerate_epoch() only, and fit() calls no reset); _enumerate_iterator() yields
# (begin_step, end_step, iterator) from 3.11, (step, iterator) before.
KERAS_EPOCH_ITERATOR_RESET = (3, 7)
KERAS_EPOCH_ITERATOR_BEGIN_END_STEPS = (3, 11)
# steps_per_execution > 1 runs as a tf.while_loop in the graph (fails under multi-worker);
# before, as a Python loop of one-step calls (works under multi-worker).
KERAS_STEPS_PER_EXECUTION_IN_GRAPH = (3, 7)
_KERAS_SCALES_LOSS_PER_REPLICA = (3, 8)  # Loss.__call__ divides by num_replicas_in_sync
_KERAS_SYNCS_METRICS_ON_READ = (3, 10)  # metric variables: synchronization="on_read"
KERAS_FITS_DISTRIBUTED_DATASETS_FROM_FUNCTION = (3, 9)


class IncompatibleVersionError(ImportError):
    """The installed TensorFlow or Keras is older than kpipe supports.

    `import kpipe` raises it (from `kpipe._compat.check_versions`, which reads the
    installed versions from package metadata), naming the installed and the required
    versions and the `pip install -U` line that fixes it.

    Example:

    >>> from kpipe import IncompatibleVersionError
    >>> from kpipe._compat import check_versions   # what `import kpipe` runs
    >>> try:
    ...     check_versions({"tensorflow": "2.3.0", "keras": "2.4.0"})
    ... except IncompatibleVersionError as e:
    ...     print(str(e)[:17])
    kpipe needs tenso
    """


def parse_version(text):
    """`"2.17.1"` -> `(2, 17, 1)`; pre-release and local tails are dropped
    (`"3.7.0.dev2024"` -> `(3, 7, 0)`, `"2.18.0rc1"` -> `(2, 18, 0)`)."""
    parts = []
    for piece in str(text).split("+")[0].split("."):
        match = re.match(r"\d+", piece)
        if match is None:
            break
        parts.append(int(match.group()))
        if match.end() != len(piece):
            break
    return tuple(parts)


def installed_version(module):
    """Version of the distribution providing `module` ("tensorflow" or "keras"), or None.

    Reads the `*.dist-info` folder names on `sys.path`, in import order (a listing per
    folder, no import of the package), and falls back to `importlib.metadata`.
    """
    names = _DISTRIBUTIONS[module]
    pattern = re.compile(r"^(%s)-([^-]+)\.dist-info$" % "|".join(names), re.IGNORECASE)
    for entry in sys.path:
        try:
            listing = os.listdir(entry or ".")
        except OSError:
            continue
        for name in listing:
            match = pattern.match(name)
            if match:
                return match.group(2)
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover -- Python < 3.8
        return None
    for name in names:
        try:
            return metadata.version(name.replace("_", "-"))
        except metadata.PackageNotFoundError:
            continue
    return None


def check_versions(installed=None):
    """Raises if the installed TensorFlow or Keras is older than kpipe supports.

    A package whose version cannot be read (a source build without metadata) passes.
    Setting the environment variable `KPIPE_SKIP_VERSION_CHECK=1` skips the check.

    Args:
        installed: `{"tensorflow": "2.17.1", "keras": "3.5.0"}`. Defaults to None
            (read what is installed).

    Raises:
        IncompatibleVersionError: naming the installed and the required versions.
    """
    if os.environ.get(_SKIP_ENV, "") not in ("", "0"):
        return
    if installed is None:
        installed = {module: installed_version(module) for module in _REQUIRED}
    too_old = [
        (module, installed[module], required)
        for module, required in _REQUIRED.items()
        if installed.get(module) and parse_version(installed[module]) < parse_version(required)
    ]
    if too_old:
        found = ", ".join(f"{m} {have}" for m, have, _ in too_old)
        needed = " and ".join(f"{m}>={req}" for m, _, req in too_old)
        raise IncompatibleVersionError(
            f"kpipe needs {needed}, but {found} is installed. Upgrade with "
            f"`pip install -U {' '.join(f'{m}>={req}' for m, _, req in too_old)}` "
            "(the README's 'Tested with' table lists the tested pairs), or set "
            f"{_SKIP_ENV}=1 to import kpipe anyway, untested."
        )


def is_keras_variable(value) -> bool:
    """Whether `value` is a Keras variable of any backend. Older Keras (3.5) exports `keras.Variable`
    as a class of its own that the backends' variables do not derive from (an optimizer's
    learning rate fails `isinstance(lr, keras.Variable)` there): test their common base."""
    import keras
    from keras.src.backend.common import variables

    base = getattr(variables, "KerasVariable", None) or variables.Variable
    return isinstance(value, (keras.Variable, base))


def keras_version():
    """The imported Keras's version as a tuple, e.g. `(3, 5, 0)`."""
    import keras

    return parse_version(keras.__version__)


def keras_at_least(version):
    """True when the imported Keras is `version` (a tuple) or newer."""
    return keras_version() >= tuple(version)


def require_keras(version, feature, fix=""):
    """Raises RuntimeError naming `feature` when the imported Keras is older than `version`."""
    have = keras_version()
    if have < tuple(version):
        wanted = ".".join(map(str, version))
        raise RuntimeError(
            f"{feature} needs Keras >= {wanted}; Keras {'.'.join(map(str, have))} is installed. "
            f"Upgrade with `pip install -U 'keras>={wanted}'`{fix}."
        )


# -- patches ------------------------------------------------------------------------------


def install_keras_fixes():
    """Patches the imported Keras where it trains differently from the newest (idempotent).

    Keras < 3.8: divides the loss by the number of replicas in sync before the gradients
    are taken, on the TensorFlow backend, for every optimizer (`LossScaleOptimizer`
    included). Keras < 3.10: epoch logs under several replicas are the last step's logs.
    See the NOTE at the top. Nothing is patched on Keras >= 3.10.
    """
    if not keras_at_least(_KERAS_SCALES_LOSS_PER_REPLICA):
        _patch_scale_loss()
    if not keras_at_least(_KERAS_SYNCS_METRICS_ON_READ):
        _patch_epoch_logs()


def _patch_scale_loss():
    from keras.src.optimizers import base_optimizer, loss_scale_optimizer

    for cls in (base_optimizer.BaseOptimizer, loss_scale_optimizer.LossScaleOptimizer):
        original = cls.__dict__.get("scale_loss")
        if original is None or getattr(original, "_kpipe_patched", False):
            continue

        def scale_loss(self, loss, _original=original):
            return _original(self, _divide_by_replicas(loss))

        scale_loss._kpipe_patched = True
        scale_loss.__doc__ = original.__doc__
        cls.scale_loss = scale_loss


def _patch_epoch_logs():
    from keras.src.trainers import trainer

    original = trainer.Trainer._get_metrics_result_or_logs
    if getattr(original, "_kpipe_patched", False):
        return

    def _get_metrics_result_or_logs(self, logs):
        strategy = getattr(self, "distribute_strategy", None)
        if isinstance(logs, dict) and logs and getattr(strategy, "num_replicas_in_sync", 1) > 1:
            # The step's logs are averaged over replicas by Keras; the metrics' result() is replica 0's.
            return {name: _python_value(value) for name, value in logs.items()}
        return original(self, logs)

    _get_metrics_result_or_logs._kpipe_patched = True
    trainer.Trainer._get_metrics_result_or_logs = _get_metrics_result_or_logs


def _python_value(value):
    if hasattr(value, "numpy"):
        value = value.numpy()
    return value.item() if getattr(value, "shape", None) == () and hasattr(value, "item") else value


def _divide_by_replicas(loss):
    import keras

    if keras.backend.backend() != "tensorflow":
        return loss
    import tensorflow as tf

    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return loss if replicas == 1 else loss * tf.cast(1.0 / replicas, loss.dtype)


# -- the TensorFlow trainer's train function ---------------------------------------------


def train_step_on_batches(model, train_function):
    """A callable `f(batches) -> logs` that runs `model`'s compiled training step on each
    batch of the list `batches` (tensors or `PerReplica` values) and returns the last logs.

    From Keras 3.7 that is `train_function` itself. Before, `train_function` only takes an
    iterator and is traced anew for every Python object it is given, so an equivalent
    function is built once per `train_function`: the same `model.train_step` under
    `strategy.run` with the same `jit_compile`, reduced with Keras's own
    `reduce_per_replica(..., "auto")`, as one `tf.function` of a batch.
    """
    if keras_at_least(KERAS_ITERABLE_TRAIN_FUNCTION):
        return train_function
    cached = getattr(model, "_kpipe_step_on_batches", None)
    if cached is not None and cached[0] is train_function:
        return cached[1]
    step = _one_step_on_data(model)

    def run(batches):
        logs = None
        for batch in batches:
            logs = step(batch)
        return logs

    model._kpipe_step_on_batches = (train_function, run)
    return run


def _one_step_on_data(model):
    import tensorflow as tf
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    def one_step_on_data(data):
        return model.train_step(data)

    if not model.run_eagerly:
        one_step_on_data = tf.function(one_step_on_data, reduce_retracing=True, jit_compile=model.jit_compile)

    def one_step_distributed(data):
        outputs = model.distribute_strategy.run(one_step_on_data, args=(data,))
        return reduce_per_replica(outputs, model.distribute_strategy, reduction="auto")

    if not model.run_eagerly:
        one_step_distributed = tf.function(one_step_distributed, reduce_retracing=True)
    return one_step_distributed


# -- fit() with steps_per_epoch -------------------------------------------------------------


def finite_steps_per_epoch(steps_per_epoch, num_batches, epochs, initial_epoch=0):
    """`steps_per_epoch` to pass to `fit()` for a finite `PyDataset` of `num_batches`.

    What `fit(steps_per_epoch=k)` does with a finite dataset of `n` batches, `k != n`:
    Keras >= 3.7 (through 3.15.1) keeps one iterator across epochs, restarts the dataset
    once a whole pass was drawn, and ends an epoch early at the pass's end (3 steps over 7
    batches: 3, 3, 1, 3, 3, 1) -- `k` is returned unchanged. Keras < 3.7 keeps one iterator
    and never restarts it: once a pass is drawn, the epochs get no more batches. So before
    3.7 a full pass per epoch (`k == n`) is passed as `None` (Keras then restarts the
    dataset every epoch), and a `k` that needs more batches than one pass raises.
    `kpipe.fit_generator` uses this for whole passes and validation; for other training
    steps it gives Keras an endless dataset instead (Keras 2's steps).

    Raises:
        RuntimeError: on Keras < 3.7 when the epochs need more than one pass of a
            dataset whose `steps_per_epoch` is not its length.
    """
    if steps_per_epoch is None or num_batches is None or keras_at_least(KERAS_ITERABLE_TRAIN_FUNCTION):
        return steps_per_epoch
    if steps_per_epoch == num_batches:
        return None
    if steps_per_epoch * (epochs - initial_epoch) > num_batches:
        require_keras(
            KERAS_ITERABLE_TRAIN_FUNCTION,
            f"steps_per_epoch={steps_per_epoch} over {epochs - initial_epoch} epochs of a dataset "
            f"of {num_batches} batches (Keras restarting a finite dataset after each pass)",
            fix=f", or pass steps_per_epoch={num_batches} (one pass per epoch) or None",
        )
    return steps_per_epoch
