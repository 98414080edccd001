"""`ps_fit()`: Keras 3 training under `tf.distribute.ParameterServerStrategy` (imports TensorFlow).

NOTE [ ps_fit: steps, the step counter and failures ]
-----------------------------------------------------
Keras 3 has no `fit()` for parameter servers (keras-team/keras#18624), so `ps_fit` is
the loop, run on the chief::

    chief                                        workers (async)          ps tasks
    -----                                        ---------------          --------
    on_train_batch_begin(s)
    coordinator.schedule(train_step) ---------> next(per-worker dataset)
       (at most `_IN_FLIGHT_PER_WORKER` per      forward, backward
        worker ahead of the fetches)             optimizer.apply  ------> variables
    RemoteValue.fetch() <----------------------- loss, batch size,        iterations
    loss/metrics updated on the chief            (y, y_pred, weights)     (atomic += 1)
    on_train_batch_end(s, running logs)
    ... epoch end: coordinator.join(); iterations := steps completed;
        validation on the chief; on_epoch_end; backup (tf.train.Checkpoint)

*Step counter.* Keras's `optimizer.apply` ends with `iterations.assign_add(1)`, which
Keras implements as `assign(self + 1)`: a read and a write, so two workers updating at
once lose a count (60 steps scheduled read 40). While the step function is traced,
`ps_fit` points that one call at the underlying `tf.Variable.assign_add`, a single
`AssignAddVariableOp` that the parameter server applies under the variable's lock, so
concurrent steps are all counted and learning-rate schedules and Adam's bias correction
see the running step. At each epoch end, once every scheduled step has finished, the
chief sets `iterations` to the number of steps *completed* (each scheduled step counts
once): after epoch `e` it equals `(e + 1) * steps_per_epoch` exactly, whatever happened.

*At-least-once steps.* When a worker dies, the `ClusterCoordinator` runs the steps it
held on another worker. A step that had already pushed its update to the parameter
servers before the worker died is then applied twice (its batch counts twice); the
counter above still counts it once, so it stays the number of steps the job asked for.
The worker's input pipeline restarts with it, so which batches a step sees is not
reproducible under failures (nor without them: workers pull steps as they free up).

*Which errors are a lost worker* is TF's classification plus one error TF 2.21 raises
for a killed worker (`_ps_failures.py`).

*Parameter server lost.* Its variables are gone: every pending step fails with
`UnavailableError` naming `/job:ps/.../task:i`. `ps_fit` raises `ParameterServerError`
with the task and address; relaunch the whole job, and with `backup_dir` it resumes
from the last epoch backed up.

*Loss and metrics* come from each step's fetched results: the step's loss (weighted
by its batch size, as Keras's `fit` logs it) and, when the model has compiled metrics,
the step's targets, predictions and sample weights, which update a copy of the
compiled metrics living on the chief. Keras metric objects on the parameter servers
would lose updates the same way the counter did.
"""

import collections
import logging
import os
import re
import shutil
from typing import Callable, Dict, Mapping, Optional

import keras
import tensorflow as tf

from kpipe.distribute import _ps_failures, _sharding

logger = logging.getLogger("kpipe.distribute")

_IN_FLIGHT_PER_WORKER = 4
_PY_FUNC_OPS = ("PyFunc", "PyFuncStateless", "EagerPyFunc")
_PS_TASK_RE = re.compile(r"/job:ps/replica:\d+/task:(\d+)")
_DATA_SERVICE_HINT = (
    "Python code cannot run inside a remote worker's graph: the worker processes have no "
    "copy of your Python functions. Run Python-side preprocessing in tf.data service "
    "workers instead (kpipe data-service dispatcher|worker, then "
    "kpipe.distribute.via_data_service(ds, dispatcher_address) in dataset_fn), or write "
    "the preprocessing with TensorFlow ops.")


class ParameterServerError(RuntimeError):
    """A parameter server of a `ps_fit` job is unreachable: its variables are lost.

    `ps_fit` raises it, in place of TensorFlow's `UnavailableError`, when a step fails
    because a `ps` task went away; the message names the task and its address and says
    how a relaunch resumes (`backup_dir=`). Relaunch the whole job.

    Example (the error `ps_fit` makes of TensorFlow's, without a cluster to lose):

    >>> import tensorflow as tf, kpipe.distribute
    >>> from kpipe.distribute import _ps_fit
    >>> lost = tf.errors.UnavailableError(None, None, "failed to connect to all addresses; "
    ...                                   "/job:ps/replica:0/task:0")
    >>> error = _ps_fit._ps_error(lost, tf.distribute.get_strategy(), None, None)
    >>> isinstance(error, kpipe.distribute.ParameterServerError), str(error)[:40]
    (True, 'Parameter server ps 0 (?) is unreachable')
    """


def ps_fit(model, dataset_fn: Callable, *, epochs: int, steps_per_epoch: int,
           class_weight: Optional[Mapping[int, float]] = None, callbacks=None,
           validation_data=None, validation_steps: Optional[int] = None, verbose="auto",
           backup_dir: Optional[str] = None) -> "keras.callbacks.History":
    """Trains `model` with parameter servers: `fit()` for `tf.distribute.ParameterServerStrategy`.

    Call it on the chief of a cluster with `ps` tasks; the same script, started on every
    task, serves as a worker or parameter server inside `auto_strategy()` (see
    `kpipe launch --workers N --ps M`). Build and compile the model under the strategy's
    scope. Each worker builds its own input pipeline with `dataset_fn` and takes steps
    asynchronously; the parameter servers hold the variables. See the module NOTE for
    the step counter, at-least-once steps and failures.

    Keras callbacks run on the chief with correct epoch and step numbers and logs
    (progress bar, `History`, `CSVLogger`, `ModelCheckpoint`, `EarlyStopping`,
    `TensorBoard` scalars, `LearningRateScheduler`). kpipe's `Warmup` works (with a float
    learning rate the chief assigns the rate before scheduling each step, so steps
    already in flight use the previous one). `InputProfiler` and the `BackupAndRestore`
    callbacks (kpipe's and Keras's) are rejected: the input runs on the workers, and
    `backup_dir` replaces them.

    Args:
        model: A compiled Keras model built under a `ParameterServerStrategy` scope
            (`with kpipe.distribute.auto_strategy().scope():` on the chief).
        dataset_fn: `dataset_fn(input_context) -> tf.data.Dataset` of batches `(x, y)`
            or `(x, y, sample_weight)`. TensorFlow traces it once on the chief and runs
            the graph on every worker, so every worker gets the same
            `tf.distribute.InputContext` (1 pipeline, id 0): shuffle rather than shard.
            It is repeated without end; Python steps (`py_function`,
            `numpy_function`, `from_generator`, `ProcessLoader`) are rejected.
        epochs: Number of epochs. Must be >= 1.
        steps_per_epoch: Steps per epoch (each on one worker's batch). Must be >= 1.
        class_weight: `{class: weight}`; becomes per-sample weights inside each
            worker's pipeline (integer labels, or one-hot labels by their argmax).
            Defaults to `None`.
        callbacks: Keras callbacks. Defaults to `None`.
        validation_data: A `tf.data.Dataset` of batches, or a tuple `(x, y)` /
            `(x, y, sample_weight)` of arrays (batched by 32), evaluated on the chief at
            each epoch end. Defaults to `None`.
        validation_steps: Batches of `validation_data` per evaluation. Defaults to
            `None` (all of it).
        verbose: `"auto"` (= 1), 0, 1 or 2, as for `fit()`. Defaults to `"auto"`.
        backup_dir: Directory for a `tf.train.Checkpoint` of the model, optimizer and
            epoch, written by the chief at each epoch end. A relaunched job restores it
            and continues with the next epoch; it is deleted when training completes.
            Defaults to `None` (no backup).

    Returns:
        A `keras.callbacks.History` with one entry per epoch trained. Its `kpipe_steps`
        attribute holds `{"completed": ..., "counted_on_ps": ...}`: steps completed in
        this call, and the atomic count the parameter servers kept before the chief
        set the counter (larger when steps were re-run after a worker failure).

    Raises:
        ValueError: An argument is invalid, the model is not under a
            `ParameterServerStrategy`, its variables are partitioned, or `dataset_fn`
            returns something other than a `tf.data.Dataset` or one with Python steps.
        ParameterServerError: A parameter server became unreachable.

    Example (run under `kpipe launch --workers 2 --ps 1 -- python train.py`):

        strategy = kpipe.distribute.auto_strategy()   # workers and ps tasks stay inside
        with strategy.scope():
            model = build_model()
            model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
        history = kpipe.distribute.ps_fit(
            model, lambda ctx: make_dataset().shuffle(1000).batch(64),
            epochs=3, steps_per_epoch=50, backup_dir="/shared/backup")
        print(history.history["loss"])
    """
    _check_arguments(epochs, steps_per_epoch, class_weight, validation_steps, verbose,
                     dataset_fn)
    strategy = _ps_strategy_of(model)
    if tf.distribute.has_strategy():
        raise ValueError("Call `ps_fit` outside `strategy.scope()`: build and compile the "
                         "model inside the scope, then leave it. Received: a call inside the "
                         f"scope of {type(tf.distribute.get_strategy()).__name__}.")
    callbacks = _check_callbacks(callbacks)
    verbose = 1 if verbose == "auto" else verbose
    _ps_failures.install()  # a killed worker's garbled request counts as a lost worker (NOTE there)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    optimizer = model.optimizer
    with strategy.scope():
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
    _check_not_partitioned(strategy, model)
    # Built once here first, eagerly, so that a wrong pipeline fails with a plain error
    # rather than from inside TensorFlow's tracing of the per-worker function.
    check_worker_dataset(dataset_fn(tf.distribute.InputContext()))
    dataset_fn = _checked_dataset_fn(dataset_fn, class_weight)
    per_worker = coordinator.create_per_worker_dataset(
        strategy.distribute_datasets_from_function(dataset_fn))
    iterator = iter(per_worker)
    train_metrics = _ChiefMetrics(model)
    val_metrics = _ChiefMetrics(model) if validation_data is not None else None
    train_step = _make_train_step(model, strategy, with_outputs=train_metrics.enabled)
    backup = _Backup(model, backup_dir) if backup_dir else None
    initial_epoch = backup.restore() if backup else 0
    completed_before = int(optimizer.iterations.numpy())
    cb = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0,
                                      model=model, verbose=verbose, epochs=epochs,
                                      steps=steps_per_epoch)
    num_workers = len(_cluster(strategy).get("worker", ()))
    in_flight = _IN_FLIGHT_PER_WORKER * max(1, num_workers)
    model.stop_training = False
    completed, counted = 0, 0
    logs: Dict[str, float] = {}
    try:
        cb.on_train_begin()
        for epoch in range(initial_epoch, epochs):
            train_metrics.reset()
            cb.on_epoch_begin(epoch)
            pending = collections.deque()
            for step in range(steps_per_epoch):
                cb.on_train_batch_begin(step)
                pending.append((step, coordinator.schedule(train_step, args=(iterator,))))
                while len(pending) > in_flight:
                    _finish(pending.popleft(), train_metrics, cb)
            while pending:
                _finish(pending.popleft(), train_metrics, cb)
            coordinator.join()
            completed += steps_per_epoch
            counted_now = int(optimizer.iterations.numpy())
            counted += counted_now - (completed_before + completed - steps_per_epoch)
            optimizer.iterations.assign(completed_before + completed)
            logs = train_metrics.results()
            if validation_data is not None:
                logs.update(_validate(model, validation_data, validation_steps, val_metrics))
            cb.on_epoch_end(epoch, logs)
            if backup:
                backup.save(epoch + 1)
            if model.stop_training:
                break
    except (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.AbortedError) as e:
        raise _ps_error(e, strategy, backup_dir, backup) or e
    cb.on_train_end(logs)
    if backup:
        backup.delete()
    history = model.history
    history.kpipe_steps = {"completed": completed, "counted_on_ps": counted}
    return history


def _check_arguments(epochs, steps_per_epoch, class_weight, validation_steps, verbose,
                     dataset_fn) -> None:
    for name, value in (("epochs", epochs), ("steps_per_epoch", steps_per_epoch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an integer >= 1. Received: {name}={value!r}.")
    if validation_steps is not None and (isinstance(validation_steps, bool) or
                                         not isinstance(validation_steps, int) or
                                         validation_steps < 1):
        raise ValueError("`validation_steps` must be an integer >= 1 or None. Received: "
                         f"validation_steps={validation_steps!r}.")
    if verbose not in ("auto", 0, 1, 2):
        raise ValueError(f"`verbose` must be 'auto', 0, 1 or 2. Received: verbose={verbose!r}.")
    if not callable(dataset_fn):
        raise ValueError("`dataset_fn` must be a function `input_context -> tf.data.Dataset`. "
                         f"Received: dataset_fn={_short(dataset_fn)}. Wrap the dataset: "
                         "dataset_fn=lambda ctx: make_dataset().")
    if class_weight is not None:
        if not isinstance(class_weight, Mapping) or not class_weight or not all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 0
                for k in class_weight):
            raise ValueError("`class_weight` must be a dict {class index (int >= 0): weight}. "
                             f"Received: class_weight={_short(class_weight)}.")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


def _ps_strategy_of(model):
    strategy = getattr(model, "distribute_strategy", None)
    if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise ValueError(
            "`ps_fit` trains a model built under a ParameterServerStrategy. Received: a model "
            f"built under {type(strategy).__name__}. On the chief of a cluster with ps tasks, "
            "create it with `strategy = kpipe.distribute.auto_strategy()` and build and "
            "compile the model inside `with strategy.scope():`.")
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ValueError("`model` must be compiled with an optimizer and a loss before "
                         "`ps_fit`. Call model.compile(...) inside strategy.scope().")
    return strategy


def _cluster(strategy) -> dict:
    resolver = getattr(strategy, "_cluster_resolver", None) or \
        tf.distribute.cluster_resolver.TFConfigClusterResolver()
    return resolver.cluster_spec().as_dict()


def _check_callbacks(callbacks):
    callbacks = list(callbacks or [])
    for callback in callbacks:
        name = type(callback).__name__
        module = type(callback).__module__
        if name == "InputProfiler" and module.startswith("kpipe"):
            raise ValueError(
                "`kpipe.callbacks.InputProfiler` cannot measure `ps_fit`: the input pipelines "
                "run on the workers, not in this process. Received: callbacks=[..., "
                "InputProfiler, ...]. Measure a worker's pipeline alone (kpipe bench, or "
                "time iterating dataset_fn(None)), and drop the callback here.")
        if name == "BackupAndRestore":
            raise ValueError(
                f"`{module}.BackupAndRestore` does not work with `ps_fit` (it resumes "
                "through Keras's fit loop). Received: callbacks=[..., BackupAndRestore, ...]. "
                "Pass `backup_dir=` to ps_fit instead: the chief checkpoints the model, "
                "optimizer and epoch there at each epoch end and a relaunch resumes.")
    return callbacks


def _check_not_partitioned(strategy, model) -> None:
    partitioner = getattr(strategy.extended, "_variable_partitioner", None)
    sharded = [v.path if hasattr(v, "path") else v.name for v in model.variables
               if "Sharded" in type(getattr(v, "value", v)).__name__]
    if partitioner is not None or sharded:
        received = f"variable_partitioner={partitioner!r}" if partitioner is not None else \
            f"sharded variables {sharded[:3]}"
        raise ValueError(
            "`ps_fit` cannot train partitioned variables: Keras 3's gradient code fails on "
            "TensorFlow's ShardedVariable (\"'ShardedVariable' object has no attribute "
            f"'handle'\"). Received: {received}. Create the ParameterServerStrategy without "
            "`variable_partitioner` (kpipe.distribute.auto_strategy() does); large "
            "variables are then placed whole, round-robin over the ps tasks.")


# -- input -------------------------------------------------------------------------------


def python_steps(dataset) -> list:
    """Names the Python functions (`py_function`, `numpy_function`, generators) in a pipeline."""
    found, seen, stack = [], set(), [dataset]
    while stack:
        ds = stack.pop()
        if id(ds) in seen:
            continue
        seen.add(id(ds))
        stack.extend(_sharding._safe_call(ds, "_inputs"))  # noqa: SLF001
        for wrapper in _sharding._safe_call(ds, "_functions"):  # noqa: SLF001
            graph = getattr(getattr(wrapper, "function", None), "graph", None)
            if graph is not None:
                _scan_for_py_funcs(graph, found, seen, 0)
    return sorted(set(found))


def _scan_for_py_funcs(graph, found: list, seen: set, depth: int) -> None:
    if id(graph) in seen or depth > 8:
        return
    seen.add(id(graph))
    for op in graph.get_operations():
        if op.type in _PY_FUNC_OPS:
            found.append(f"{op.type} op {op.name!r}")
    for function in getattr(graph, "_functions", {}).values():
        nested = getattr(function, "graph", None)
        if nested is not None:
            _scan_for_py_funcs(nested, found, seen, depth + 1)


def check_worker_dataset(dataset) -> None:
    """Raises `ValueError` unless `dataset` is a `tf.data.Dataset` a remote worker can run."""
    if isinstance(dataset, keras.utils.PyDataset) or hasattr(dataset, "as_dataset"):
        raise ValueError(
            "`dataset_fn` returned a Python-side dataset "
            f"({type(dataset).__name__}), which cannot run on a remote worker. Received: "
            f"{_short(dataset)}. {_DATA_SERVICE_HINT}")
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            "`dataset_fn` must return a `tf.data.Dataset` of batches. Received: an object of "
            f"type {type(dataset).__name__}: {_short(dataset)}. For arrays, return "
            "tf.data.Dataset.from_tensor_slices((x, y)).shuffle(n).batch(batch_size).")
    found = python_steps(dataset)
    if found:
        raise ValueError(
            "`dataset_fn` returned a pipeline with Python steps (tf.py_function, "
            "tf.numpy_function, Dataset.from_generator, kpipe's py_map_fn or "
            f"ProcessLoader.as_dataset()). Received: a pipeline containing {', '.join(found)}. "
            f"{_DATA_SERVICE_HINT}")


def _checked_dataset_fn(dataset_fn, class_weight):
    def worker_dataset_fn(input_context):
        dataset = dataset_fn(input_context)
        check_worker_dataset(dataset)
        if class_weight is not None:
            dataset = dataset.map(_class_weight_fn(class_weight))
        return dataset.repeat()

    return worker_dataset_fn


def _class_weight_fn(class_weight: Mapping[int, float]):
    table = [0.0] * (max(class_weight) + 1)
    for index, weight in class_weight.items():
        table[index] = float(weight)

    def add_weights(*batch):
        if len(batch) != 2:
            raise ValueError(
                "`class_weight` needs batches `(x, y)` to add per-sample weights. Received: "
                f"batches of {len(batch)} elements. Drop class_weight and put the weights in "
                "the pipeline's third element, or return (x, y) batches.")
        x, y = batch
        if tf.nest.is_nested(y):
            raise ValueError("`class_weight` needs a single target `y`. Received: a "
                             f"{type(y).__name__} of targets. Use per-sample weights.")
        labels = y
        if y.shape.rank is not None and y.shape.rank > 1 and y.shape[-1] not in (None, 1):
            labels = tf.argmax(y, axis=-1)
        labels = tf.reshape(tf.cast(labels, tf.int32), [-1])
        weights = tf.gather(tf.constant(table, tf.float32), labels)
        return x, y, weights

    return add_weights


# -- the step on the workers -------------------------------------------------------------


class _AtomicIterations:
    """While tracing, `optimizer.iterations.assign_add` becomes one atomic variable op."""

    def __init__(self, optimizer):
        self._variable = optimizer._iterations  # noqa: SLF001 -- Keras's counter itself

    def __enter__(self):
        variable = self._variable

        def assign_add(value):
            tf_variable = variable.value if hasattr(variable.value, "assign_add") else \
                variable._value  # noqa: SLF001
            return tf_variable.assign_add(tf.cast(value, tf_variable.dtype))

        variable.assign_add = assign_add
        return self

    def __exit__(self, *exc):
        del self._variable.assign_add
        return False


def _make_train_step(model, strategy, *, with_outputs: bool):
    optimizer = model.optimizer

    def replica_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred,  # noqa: SLF001
                                       sample_weight=sample_weight, training=True)
            scaled = optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss
        variables = model.trainable_variables
        grads = tape.gradient(scaled, variables)
        with _AtomicIterations(optimizer):  # only runs while tracing: see the NOTE
            optimizer.apply(grads, variables)
        first = next(t for t in tf.nest.flatten(x) if t is not None)
        out = {"loss": loss, "size": tf.shape(first)[0]}
        if with_outputs:
            out["y"], out["y_pred"] = y, y_pred
            if sample_weight is not None:
                out["sample_weight"] = sample_weight
        return out

    @tf.function
    def train_step(iterator):
        return strategy.run(replica_step, args=(next(iterator),))

    return train_step


# -- results on the chief ----------------------------------------------------------------


class _ChiefMetrics:
    """The running loss and a chief-local copy of the model's compiled metrics."""

    def __init__(self, model):
        from keras.src.trainers.compile_utils import CompileMetrics

        config = getattr(getattr(model, "_compile_config", None), "config", {}) or {}
        metrics, weighted = config.get("metrics"), config.get("weighted_metrics")
        self.enabled = bool(metrics or weighted)
        self._metrics = None
        if self.enabled:
            with _no_strategy():
                self._metrics = CompileMetrics(metrics, weighted,
                                               output_names=getattr(model, "output_names", None))
        self.reset()

    def reset(self):
        self._loss_sum, self._samples = 0.0, 0
        if self._metrics is not None and self._metrics.built:
            self._metrics.reset_state()

    def update(self, out) -> None:
        size = int(out["size"])
        self._loss_sum += float(out["loss"]) * size
        self._samples += size
        if self._metrics is not None:
            with _no_strategy():
                self._metrics.update_state(out["y"], out["y_pred"], out.get("sample_weight"))

    def results(self, prefix: str = "") -> Dict[str, float]:
        logs = {prefix + "loss": self._loss_sum / max(self._samples, 1)}
        if self._metrics is not None and self._metrics.built:
            for name, value in self._metrics.result().items():
                logs[prefix + name] = float(value)
        return logs


def _no_strategy():
    """Places variables made here on the chief (`ps_fit` runs outside any strategy scope)."""
    return tf.device("/job:chief/replica:0/task:0/device:CPU:0")


def _finish(item, metrics: _ChiefMetrics, cb) -> None:
    step, remote = item
    try:
        out = tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t,
                                    remote.fetch())
    except tf.errors.UnavailableError as e:
        # The step finished (a step that fails is re-run until it succeeds), but its results
        # stayed on a worker that died before the chief copied them (TF < 2.17 copies them
        # only on fetch): its update is applied, its loss is not known.
        if _PS_TASK_RE.search(str(e)) or "/job:worker" not in str(e):
            raise
        logger.warning("ps_fit: step %d ran on a worker that died before its loss was "
                       "fetched; the epoch's loss and metrics leave that step out.", step)
    else:
        metrics.update(out)
    cb.on_train_batch_end(step, metrics.results())


def _validate(model, validation_data, validation_steps, metrics: _ChiefMetrics):
    if isinstance(validation_data, tuple):
        validation_data = tf.data.Dataset.from_tensor_slices(validation_data).batch(32)
    if not isinstance(validation_data, tf.data.Dataset):
        raise ValueError("`validation_data` must be a tf.data.Dataset of batches or a tuple "
                         "(x, y) / (x, y, sample_weight) of arrays. Received: "
                         f"{_short(validation_data)}.")
    if validation_steps is not None:
        validation_data = validation_data.take(validation_steps)
    step = getattr(model, "_kpipe_ps_val_step", None)
    if step is None:
        @tf.function
        def step(data):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            y_pred = model(x, training=False)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred,  # noqa: SLF001
                                       sample_weight=sample_weight, training=False)
            first = next(t for t in tf.nest.flatten(x) if t is not None)
            out = {"loss": loss, "size": tf.shape(first)[0], "y": y, "y_pred": y_pred}
            if sample_weight is not None:
                out["sample_weight"] = sample_weight
            return out

        model._kpipe_ps_val_step = step  # noqa: SLF001
    metrics.reset()
    for batch in validation_data:
        metrics.update(tf.nest.map_structure(lambda t: t.numpy(), step(batch)))
    return metrics.results(prefix="val_")


# -- backup and failures -----------------------------------------------------------------


class _Backup:
    """`tf.train.Checkpoint` of model, optimizer and epoch in `backup_dir` (chief only)."""

    def __init__(self, model, backup_dir: str):
        self.backup_dir = str(backup_dir)
        with _no_strategy():
            self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                                               epoch=self._epoch)
        self._manager = tf.train.CheckpointManager(self._checkpoint, self.backup_dir,
                                                   max_to_keep=2)

    def restore(self) -> int:
        latest = self._manager.latest_checkpoint
        if latest is None:
            return 0
        self._checkpoint.restore(latest).assert_existing_objects_matched()
        epoch = int(self._epoch.numpy())
        logger.info("ps_fit: resumed from %s at epoch %d.", latest, epoch)
        return epoch

    def save(self, epochs_done: int) -> None:
        self._epoch.assign(epochs_done)
        self._manager.save(checkpoint_number=epochs_done)

    def delete(self) -> None:
        shutil.rmtree(self.backup_dir, ignore_errors=True)

    def describe(self) -> str:
        latest = self._manager.latest_checkpoint
        if latest is None:
            return f"backup_dir={self.backup_dir!r} holds no backup yet: a relaunch starts over"
        return (f"a relaunch resumes from {os.path.basename(latest)} in "
                f"backup_dir={self.backup_dir!r}")


def _ps_error(error, strategy, backup_dir, backup) -> Optional[ParameterServerError]:
    match = _PS_TASK_RE.search(str(error))
    if match is None:
        return None
    task = int(match.group(1))
    addresses = _cluster(strategy).get("ps", [])
    address = addresses[task] if task < len(addresses) else "?"
    if backup is not None:
        resume = backup.describe()
    else:
        resume = "pass backup_dir= to resume a relaunched job from its last epoch"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first_line = next((line for line in lines if "connect" in line or "UNAVAILABLE" in line),
                      lines[0] if lines else "")
    return ParameterServerError(
        f"Parameter server ps {task} ({address}) is unreachable ({type(error).__name__}: "
        f"{first_line[:200]}). Its variables are lost, so training cannot continue. Relaunch "
        f"the whole job (chief, workers and ps tasks); {resume}.")
