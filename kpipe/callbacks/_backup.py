"""`BackupAndRestore`: crash-consistent backups, per epoch or every N steps, that every
worker resumes from together -- mid-epoch exactly where training stopped.

NOTE [ Crash-consistent backups across workers ]
------------------------------------------------
Keras's `keras.callbacks.BackupAndRestore` keeps one backup per directory and overwrites
it at every save. Under `MultiWorkerMirroredStrategy` each worker needs its own
directory, and the workers save at slightly different moments, so a worker killed while
saving leaves the job with backups one save apart (or a half-written file); relaunched,
the workers restore different points and their mirrored variables diverge, or they wait
forever in collectives the others never run. This callback makes the set of backups
crash-consistent:

    backup_dir/                  (without a multi-worker TF_CONFIG the backups live here)
      worker-0/                  per_worker_path(backup_dir), stable across restarts
        epoch-000002/            save_freq="epoch": epochs completed
        (step-000000040/)        save_freq=N: the 40th save, after 40*N training steps
          state.weights.h5       model weights + optimizer variables (`iterations`, the
                                 learning-rate variable and slots too)
          metadata.json          written LAST: temp file, fsync, os.replace, fsync dir;
                                 also the states of the model's random seed generators
      worker-1/ ...

Saving backup k: remove its old `metadata.json` if any, write and fsync the files, then
commit the metadata atomically. A backup is *complete* when its metadata parses, names
k and lists files that exist with the recorded sizes; a crash at any point leaves it
incomplete, never half-valid. The metadata records where training stands: the Keras
epoch to resume and the steps already done in it, the training steps done in all, and
the state (`loader.state()`) of each of `loaders` at the first batch not yet trained on,
and the state of every `keras.random.SeedGenerator` of the model (Dropout, GaussianNoise,
SpatialDropout, RandomFlip, ...: not in `model.weights`, see `_backup_state.py`).

Resuming (`on_train_begin`): each worker lists its complete backups as a 0/1 vector over
`0..K` (K: the last save `fit()` can make; 0, "nothing trained", is always held) and
the workers all-reduce (SUM) the vectors through the strategy. The newest backup whose
count equals the number of replicas is held by everyone: all workers restore it and drop
their newer backups, which belong to a run the job abandons. Every worker computes the
same answer from the same reduced vector, so they cannot disagree.

Why the agreed backup is always on disk: training past save k needs an all-reduce with
every worker, and a worker joins it only after saving k. So when any worker saves k+1,
every worker has completed k: newest complete backups differ by at most one, and keeping
the last two per worker (`keep` is raised to 2 under multi-worker training) keeps the
agreed one.

NOTE [ Resuming inside an epoch ]
---------------------------------
Keras's `fit(initial_epoch=e)` can only start epoch e at its first step. To resume at
step s of epoch e, the callback sets the initial epoch to e, puts each loader back on
the saved state (the first batch the interrupted run had not trained on: a position
inside a pass) and, for the first s steps of epoch e, makes `model.train_function`
return the metrics as they stand without reading a batch or touching a variable. Keras's
step numbers, progress bar, `steps_per_epoch` and callbacks' epoch and batch indices are
then those of the uninterrupted run (the resumed epoch's logged metrics cover the steps
trained after the resume), and so are the batches: a loader's stream starts at its
restored position and the first real step trains on exactly the batch the interrupted
run would have trained on next. Unshuffled NumPy arrays have no loader: their skipped
steps read their batch and drop it instead. Inputs that neither can position are refused
when backups can fall inside an epoch (NOTE in `_backup_input.py`).

One detail of Keras: with `steps_per_epoch` set, its epoch iterator counts the steps
taken from the current pass (`_steps_seen`) to end an epoch early where a pass ends; a
resumed run would count from the start of epoch e instead. The backup records that
count, and at the first step of the resumed run the callback sets it to what the
uninterrupted run had at that step, so epochs end where they did. Without
`steps_per_epoch` an epoch is a pass and the counts agree.

What is not covered: a job killed while the backups are deleted after training finished
(`on_train_end`) may find some workers with no backup left, and then starts over.
"""

import json
import logging
import os
import re
import shutil
from typing import Dict, List, Optional, Sequence

import keras
import numpy as np

from kpipe import _backends, _fit_scope, _keras_hook, _stream
from kpipe._keras_hook import keras_iterator
from kpipe.callbacks import _backup_input, _backup_state
from kpipe.distribute._chief import per_worker_path

logger = logging.getLogger("kpipe.callbacks")
_keras_hook.install_fit_wrappers()  # fit()'s end runs _release, however it ends (kpipe/_fit_scope.py)

_FORMAT = 2
_STATE_FILE = "state.weights.h5"
_METADATA_FILE = "metadata.json"
_DIR_RE = {"epoch": re.compile(r"^epoch-(\d+)$"), "step": re.compile(r"^step-(\d+)$")}
_DIR_FMT = {"epoch": "epoch-{:06d}", "step": "step-{:09d}"}


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up training state during `fit()`; a relaunched `fit()` resumes from it.

    A crash-consistent replacement for `keras.callbacks.BackupAndRestore`, for one process
    as for `MultiWorkerMirroredStrategy` jobs. After each epoch (or every `save_freq`
    training steps) every worker writes the model weights, optimizer variables, the
    states of the model's random seed generators (Dropout's, GaussianNoise's, ...), the
    position of its `loaders` and the epoch/step counters to files of its own under its
    own directory (`kpipe.distribute.per_worker_path(backup_dir)`), committing each backup
    with a small metadata file written last by atomic rename, and keeps the last `keep`
    backups. When `fit()` starts, all workers agree, by a collective through the model's
    strategy, on the newest backup *every* worker saved completely, restore it and
    continue from there -- mid-epoch too: the resumed run trains on exactly the batches,
    in the same order, that the interrupted run would have, and ends with the same
    weights. See the NOTEs in this module for the protocol and the mid-epoch mechanism.

    Give it the same `backup_dir` on every worker (a shared file system, or the same path
    on each host) and relaunch the job with the same program, `epochs` and
    `steps_per_epoch`. With `loaders`, each `kpipe.ProcessLoader` feeding `fit()` is put
    back on the batch the interrupted run had reached (`loader.restore`), whatever its
    `workers` is now. When `fit()` completes, the backups are deleted.

    It already uses per-worker directories: pass it to `fit()` directly, not through
    `kpipe.distribute.chief_only`. One instance serves one model in one process; do not
    share it across threads.

    Args:
        backup_dir: Directory for the backups, the same for every worker of the job. Do
            not store other files there. Each worker uses `backup_dir/worker-<i>` under
            a multi-worker `TF_CONFIG`, else `backup_dir` itself.
        save_freq: `"epoch"` to back up after every epoch, or an integer N to back up
            every N training steps (mid-epoch). Defaults to `"epoch"`.
        keep: How many of the newest backups to keep per worker, at least 1. Under
            multi-worker training at least 2 are kept (see the NOTE). Defaults to 2.
        loaders: The `kpipe.ProcessLoader` given to `fit()` (or a sequence of them), to
            put back on the resumed position; pass the same ones in the relaunched run.
            Without it, the input restarts wherever it starts; with `save_freq=N`,
            `fit()` then refuses inputs other than unshuffled NumPy arrays (see below).
            Defaults to `None`.
        verbose: 1 to print one line when `fit()` resumes (epoch, step, the backup
            used), 0 to log it instead (logger `kpipe.callbacks`, level INFO). Defaults to 1.

    Attributes:
        worker_dir: This worker's directory.
        restored_epoch: Epoch the last `fit()` resumed in (0: started from scratch),
            `None` before `fit()`.
        restored_step: Training steps the restored backup had done (0: from scratch).

    Raises:
        ValueError: `backup_dir` is empty, `save_freq` is neither `"epoch"` nor a positive
            integer, or `keep` is not a positive integer.
        TypeError: An item of `loaders` has no `state`/`restore` methods.

    `fit()` raises `ValueError` if a backup being restored recorded a different number of
    loaders or other data (see `ProcessLoader.restore`) or other random layers, if a
    backup was written by an incompatible kpipe, and with `save_freq=N` if
    `steps_per_execution > 1`, the steps per epoch are unknown, or backups can fall inside
    an epoch of an input they cannot position there (shuffled arrays, arrays with
    `steps_per_epoch`, a `tf.data.Dataset`, a generator, a `PyDataset` or `ProcessLoader`
    not in `loaders`): the message says how (`loaders=`, `shuffle=False`, or
    `save_freq="epoch"`). A same-process retry that finds no backup goes on from the
    model kept in memory and logs so (a warning).

    Example:

    >>> import tempfile, keras, numpy as np
    >>> class Interrupt(keras.callbacks.Callback):
    ...     def on_epoch_begin(self, epoch, logs=None):
    ...         if epoch == 2:
    ...             raise RuntimeError("interrupted")
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> x, y = np.zeros((8, 2)), np.zeros((8, 1))
    >>> backup = BackupAndRestore(tempfile.mkdtemp())
    >>> try:
    ...     model.fit(x, y, epochs=4, verbose=0, callbacks=[backup, Interrupt()])
    ... except RuntimeError:
    ...     pass
    >>> history = model.fit(x, y, epochs=4, verbose=0, callbacks=[backup])  # doctest: +ELLIPSIS
    BackupAndRestore: resuming at epoch 2, step 0 (2 training steps done) from backup .../epoch-000002.
    >>> backup.restored_epoch, len(history.history["loss"])
    (2, 2)
    """

    def __init__(self, backup_dir, *, save_freq="epoch", keep: int = 2, loaders=None, verbose: int = 1):
        super().__init__()
        if not backup_dir:
            raise ValueError(f"`backup_dir` must be a non-empty path. Received: "
                             f"backup_dir={backup_dir!r}. Pass a directory that this job "
                             "alone uses, the same on every worker.")
        by_steps = isinstance(save_freq, (int, np.integer)) and not isinstance(save_freq, bool)
        if not (save_freq == "epoch" if isinstance(save_freq, str) else by_steps and save_freq >= 1):
            raise ValueError(
                f"`save_freq` must be 'epoch' or a positive integer number of training steps. "
                f"Received: save_freq={save_freq!r}. Use save_freq='epoch' to back up after "
                "each epoch, or e.g. save_freq=500 to back up every 500 steps.")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"`keep` must be an integer >= 1. Received: keep={keep!r}. "
                             "Use keep=1 to keep only the newest backup.")
        self.backup_dir = os.fspath(backup_dir)
        self.worker_dir = per_worker_path(self.backup_dir)
        self.save_freq = save_freq if isinstance(save_freq, str) else int(save_freq)
        self.keep = keep
        self.loaders = _check_loaders(loaders)
        self.verbose = verbose
        self.restored_epoch: Optional[int] = None
        self.restored_step: Optional[int] = None
        self._kind = "epoch" if isinstance(save_freq, str) else "step"
        self._retain = keep
        self._set_initial_epoch = False
        self._gate = None
        self._running = False  # between on_train_begin and on_train_end
        self._reset_run()

    def _reset_run(self):
        self._epoch = 0  # Keras epoch in progress
        self._batch = 0  # steps of it done (skipped ones included)
        self._step = 0  # training steps done since the start of training (restored ones too)
        self._consumed = 0  # batches this fit() took from the loaders
        self._origins = []  # where each loader's reading began in this fit()
        self._skip = 0
        self._read_skipped = False  # skipped steps read their batch (see _backup_input.py)
        self._align = None  # [(loader, Keras step count)] to set at the first step of a resumed run

    # ------------------------------------------------------------------ Keras hooks
    def on_train_begin(self, logs=None):
        self._release()  # what a fit() that kpipe did not see end left behind
        _fit_scope.at_exit(self.model, self._release)  # however this fit() ends
        interrupted, self._running = self._running, True
        self._reset_run()
        if self._kind == "step" and _steps_per_execution(self.model) > 1:
            raise ValueError(
                f"BackupAndRestore(save_freq={self.save_freq}) needs steps_per_execution=1, "
                f"but the model was compiled with steps_per_execution="
                f"{_steps_per_execution(self.model)}. Compile with steps_per_execution=1 or "
                "use save_freq='epoch'.")
        self._check_keras_restarts_passes()
        self._check_input()
        strategy = _backends.strategy_of(self.model)  # jax/torch: one replica, no tf.distribute
        workers = _num_workers(strategy)
        self._retain = max(self.keep, 2) if workers > 1 else self.keep
        local = complete_backups(self.worker_dir, self._kind)
        index = self._agree(strategy, workers, sorted(local))
        self._drop_after(index)
        self.restored_epoch = 0
        self.restored_step = 0
        if index == 0:
            self._origins = [_head(loader) for loader in self.loaders]
            self._log_fresh_start(interrupted)
            return
        metadata = local[index]
        self._restore(strategy, index, metadata)
        self._origins = [_head(loader) for loader in self.loaders]
        self._epoch, self._batch, self._step = metadata["epoch"], metadata["batch"], metadata["step"]
        self._skip = metadata["batch"]
        if self._skip:
            _build_metrics(self.model, strategy, self.loaders)
        self._align = [(loader, seen - self._skip + 1)
                       for loader, seen in zip(self.loaders, metadata.get("keras_steps_seen", []))
                       if seen is not None]
        self.model._initial_epoch = metadata["epoch"]  # noqa: SLF001 -- how Keras's callback resumes
        self._set_initial_epoch = True
        self.restored_epoch, self.restored_step = metadata["epoch"], metadata["step"]
        if self._skip > 0 and not self._read_skipped and _backends.name() == "torch":
            from kpipe.callbacks import _backup_torch  # torch fetches before the step gate

            _backup_torch.hold_fetches(self.model, self)
        line = (f"BackupAndRestore: resuming at epoch {metadata['epoch']}, step {metadata['batch']} "
                f"({metadata['step']} training steps done) from backup {self._dir(index)}.")
        print(line) if self.verbose else logger.info(line)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._batch = epoch, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self._gate is None:  # outermost: wraps what other callbacks installed
            self._gate = _StepGate(self.model.train_function, self)
            self.model.train_function = self._gate

    def on_train_batch_end(self, batch, logs=None):
        self._batch = batch + 1
        if self._gate is not None and self._gate.last_was_real:
            self._step += 1
            if self._kind == "step" and self._step % self.save_freq == 0:
                self._save(self._step // self.save_freq)

    def on_epoch_end(self, epoch, logs=None):
        if self._kind == "epoch":
            self._epoch, self._batch = epoch + 1, 0
            self._save(epoch + 1)

    def on_train_end(self, logs=None):
        self._release()
        self._running = False
        for index in _backup_dirs(self.worker_dir, self._kind):
            _remove_backup(self._dir(index))
        _rmdir_if_empty(self.worker_dir)
        if self.backup_dir != self.worker_dir:  # the others' worker dirs may still be there
            _rmdir_if_empty(self.backup_dir)

    def _release(self):
        """Hands the model back as fit() found it: its train function unwrapped, its
        initial epoch unset (Keras never resets it: the next fit() would skip epochs)."""
        self._gate = None
        while isinstance(getattr(self.model, "train_function", None), _StepGate):
            self.model.train_function = self.model.train_function.original  # gates come at batch 0
        if self._set_initial_epoch:
            self.model._initial_epoch = None  # noqa: SLF001
            self._set_initial_epoch = False

    def _check_input(self):
        """Refuses backups inside an epoch of an input they cannot position (NOTE in
        `_backup_input.py`); notes whether skipped steps must read their batch."""
        steps = self.params.get("steps") if self.params else None
        if self._kind == "step" and steps and self.save_freq % int(steps):
            mode = _backup_input.resume_mode(self.model, self.save_freq, int(steps), self.loaders)
            self._read_skipped = mode == _backup_input.READ_THROUGH

    def _log_fresh_start(self, interrupted: bool):
        done = _optimizer_step(self.model) or 0
        if done:
            log = logger.warning if interrupted else logger.info
            log("BackupAndRestore: no backup held by every worker in %s; training goes on from "
                "the model kept in memory (%d optimizer steps done%s), not from the start.",
                self.backup_dir, done, ": the interrupted fit() in this process trained them. "
                "Build and compile the model again to start over" if interrupted else "")
        else:
            logger.info("BackupAndRestore: no backup held by every worker in %s; "
                        "training from the start.", self.backup_dir)

    def _check_keras_restarts_passes(self):
        """Keras < 3.7 never restarts a finite input when `steps_per_epoch` is shorter than
        it (training stops after one pass, as with any PyDataset): positions inside a pass
        cannot be resumed there."""
        from kpipe import _compat

        steps = self.params.get("steps") if self.params else None
        lengths = {len(loader) for loader in self.loaders if getattr(loader, "num_batches", None)}
        if self.loaders and steps and lengths and lengths != {steps}:
            _compat.require_keras(_compat.KERAS_EPOCH_ITERATOR_RESET,
                                  f"BackupAndRestore(loaders=...) with steps_per_epoch={steps} "
                                  f"(the loader has {sorted(lengths)[0]} batches per pass)",
                                  ", or leave steps_per_epoch unset")

    # ------------------------------------------------------------------ saving
    def _save(self, index: int) -> None:
        backup = self._dir(index)
        os.makedirs(backup, exist_ok=True)
        _remove_file(os.path.join(backup, _METADATA_FILE))  # an older copy is void now
        files = {}
        state = os.path.join(backup, _STATE_FILE)
        self.model.save_weights(state, overwrite=True)
        _fsync_file(state)
        files[_STATE_FILE] = os.path.getsize(state)
        metadata = {
            "format": _FORMAT,
            "index": index,
            "epoch": self._epoch,
            "batch": self._batch,
            "step": self._step,
            "optimizer_step": _optimizer_step(self.model),
            "random": _backup_state.random_state(self.model),
            "files": files,
            "loaders": [_loader_state(loader, origin, self._consumed) for loader, origin in zip(self.loaders, self._origins)],
            "keras_steps_seen": [_keras_steps_seen(loader) for loader in self.loaders],
        }
        self._commit(backup, metadata)
        self._prune(index)

    def _commit(self, backup: str, metadata: Dict) -> None:
        path = os.path.join(backup, _METADATA_FILE)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(backup)

    def _prune(self, newest: int) -> None:
        kept = sorted(i for i in complete_backups(self.worker_dir, self._kind) if i <= newest)[-self._retain:]
        for index in _backup_dirs(self.worker_dir, self._kind):
            if index not in kept:
                _remove_backup(self._dir(index))

    # ------------------------------------------------------------------ restoring
    def _last_index(self) -> int:
        epochs = int(self.params.get("epochs") or 0) if self.params else 0
        if self._kind == "epoch":
            return epochs
        steps = self.params.get("steps") if self.params else None
        if not steps:
            raise ValueError(
                f"BackupAndRestore(save_freq={self.save_freq}) needs to know the steps per "
                "epoch, but fit() was given an input of unknown length. Pass "
                "steps_per_epoch=... to fit(), or use save_freq='epoch'.")
        return epochs * int(steps) // self.save_freq

    def _agree(self, strategy, workers: int, local: Sequence[int]) -> int:
        last = self._last_index()
        held = np.zeros(last + 1, np.float32)
        held[0] = 1.0  # "nothing trained" is held by everyone
        held[np.array([i for i in local if i <= last], dtype=np.int64)] = 1.0
        if workers > 1:
            counts = _sum_over_replicas(strategy, held)
            everyone = counts > strategy.num_replicas_in_sync - 0.5
        else:
            everyone = held > 0.5
        return int(np.flatnonzero(everyone).max())

    def _restore(self, strategy, index: int, metadata: Dict) -> None:
        saved = metadata.get("loaders", [])
        if self.loaders and len(saved) != len(self.loaders):
            raise ValueError(
                f"BackupAndRestore was given {len(self.loaders)} loader(s) but the backup "
                f"{self._dir(index)} recorded {len(saved)}. Received: "
                f"loaders={[type(loader).__name__ for loader in self.loaders]}. Pass the "
                "same `loaders` as the run that wrote the backup (or delete the backup to "
                "start over).")
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with strategy.scope():  # slot variables must be created as mirrored ones
                optimizer.build(self.model.trainable_variables)
        self.model.load_weights(os.path.join(self._dir(index), _STATE_FILE))
        _backup_state.restore_random_state(self.model, metadata.get("random"), self._dir(index))
        step = _optimizer_step(self.model)
        if metadata.get("optimizer_step") is not None and step != metadata["optimizer_step"]:
            logger.warning("BackupAndRestore: backup %s was saved at optimizer step %s but "
                           "the restored optimizer is at step %s; its variables may not "
                           "have been restored.", self._dir(index), metadata["optimizer_step"], step)
        for loader, state in zip(self.loaders, saved):
            loader.restore(state)

    def _drop_after(self, index: int) -> None:
        for other in _backup_dirs(self.worker_dir, self._kind):
            if other > index:
                _remove_backup(self._dir(other))

    def _dir(self, index: int) -> str:
        return os.path.join(self.worker_dir, _DIR_FMT[self._kind].format(index))


class _StepGate:
    """Stands in for `model.train_function`: skips the steps of a resumed epoch that the
    interrupted run had done (see NOTE [ Resuming inside an epoch ]) and counts the
    batches training takes."""

    def __init__(self, original, callback):
        self.original = original
        self.callback = callback
        self.last_was_real = False

    def __call__(self, *args):
        # TensorFlow: (iterator,); JAX: (state, iterator) -> (logs, state); PyTorch: (batches,)
        iterator, cb = args[-1], self.callback
        if cb._align:  # noqa: SLF001 -- the first step of the resumed run
            for loader, seen in cb._align:  # noqa: SLF001
                _set_keras_steps_seen(loader, seen)
        cb._align = None  # noqa: SLF001
        if cb._skip > 0:  # noqa: SLF001
            cb._skip -= 1  # noqa: SLF001
            self.last_was_real = False
            if cb._read_skipped and not isinstance(iterator, list):  # noqa: SLF001 -- unshuffled arrays: drop the trained batch (PyTorch fetched it already)
                next(iterator)
            if len(args) == 2:  # JAX: the state goes on unchanged (its metrics: read at the epoch end)
                return {}, args[0]
            return _metrics_so_far(cb.model)
        self.last_was_real = True
        cb._consumed += 1  # noqa: SLF001
        return self.original(*args)


def _build_metrics(model, strategy, loaders):
    """Builds the compiled metrics before skipped steps report them (Keras builds them at
    the first real step; an epoch whose steps are all skipped would have none)."""
    compiled = getattr(model, "_compile_metrics", None)
    source = _stream.source_of(loaders[0]) if loaders else None
    if compiled is None or compiled.built or source is None:
        return
    batch = source.peek(0)  # kept for the first real step, no extra load
    batch = tuple(batch) if isinstance(batch, list) else batch
    try:
        with strategy.scope():
            model._symbolic_build(data_batch=batch)  # noqa: SLF001
    except Exception as exc:  # noqa: BLE001 -- only the skipped steps' logs depend on it
        logger.warning("BackupAndRestore: could not build the model's metrics before the "
                       "resumed steps (%s); their logs stay empty.", exc)


def _metrics_so_far(model):
    """The logs of a skipped step: the metrics as they stand (none before any step)."""
    try:
        return model.get_metrics_result()
    except ValueError:  # not built yet: no step has run in this process
        return {}


def _loader_state(loader, origin, consumed):
    """The state of `loader` `consumed` batches after `origin` (what training took), or
    its own `state()` for a loader kpipe does not read through its stream protocol."""
    source = _stream.source_of(loader)
    return source.state_after(origin, consumed) if source is not None else loader.state()


def _keras_iterator(loader):
    iterator = keras_iterator(loader)
    if iterator is None or not getattr(iterator, "steps_per_epoch", None):
        return None  # no steps_per_epoch: Keras's epochs are passes, nothing to align
    return iterator if hasattr(iterator, "_steps_seen") else None


def _keras_steps_seen(loader):
    """Steps Keras's epoch iterator took from the current pass (steps_per_epoch set)."""
    iterator = _keras_iterator(loader)
    return None if iterator is None else int(iterator._steps_seen)  # noqa: SLF001


def _set_keras_steps_seen(loader, value):
    iterator = _keras_iterator(loader)
    if iterator is not None:
        iterator._steps_seen = value  # noqa: SLF001


def _head(loader):
    source = _stream.source_of(loader)
    return source.head() if source is not None else None


def _steps_per_execution(model) -> int:
    value = getattr(model, "steps_per_execution", 1)
    try:
        return int(_backends.numpy_value(value))
    except Exception:  # noqa: BLE001
        return 1


def complete_backups(worker_dir: str, kind: str = "epoch") -> Dict[int, Dict]:
    """Returns `{index: metadata}` for the completely saved backups under `worker_dir`.

    Raises:
        ValueError: if a backup was written in a format this kpipe cannot resume from.
    """
    complete = {}
    for index in _backup_dirs(worker_dir, kind):
        backup = os.path.join(worker_dir, _DIR_FMT[kind].format(index))
        try:
            with open(os.path.join(backup, _METADATA_FILE)) as f:
                metadata = json.load(f)
            files_ok = all(os.path.getsize(os.path.join(backup, name)) == size
                           for name, size in metadata["files"].items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        fmt = metadata.get("format") if isinstance(metadata, dict) else None
        if fmt != _FORMAT and isinstance(fmt, int):
            raise ValueError(
                f"The backup {backup} was written by "
                + ("a newer kpipe" if fmt > _FORMAT else "an older kpipe")
                + f" (format {fmt}; this kpipe reads format {_FORMAT})"
                + (": upgrade kpipe to resume it." if fmt > _FORMAT else
                   ", which recorded no loader positions and cannot resume exactly: resume "
                   "it with the kpipe that wrote it, or delete the backup to start over."))
        if files_ok and fmt == _FORMAT and metadata.get("index") == index:
            complete[index] = metadata
    return complete


def complete_epochs(worker_dir: str) -> Dict[int, Dict]:
    """Returns `{epoch: metadata}` for the completely saved epoch backups under `worker_dir`."""
    return complete_backups(worker_dir, "epoch")


def _check_loaders(loaders) -> List:
    if loaders is None:
        return []
    if hasattr(loaders, "restore"):
        loaders = [loaders]
    loaders = list(loaders)
    for i, loader in enumerate(loaders):
        if not (callable(getattr(loader, "state", None)) and callable(getattr(loader, "restore", None))):
            raise TypeError(f"`loaders` must hold objects with `state()` and `restore(state)` "
                            f"methods, such as kpipe.ProcessLoader. Received: loaders[{i}]="
                            f"{str(loader)[:100]} of type {type(loader).__name__}. Remove it "
                            "from `loaders` (fit() input without a position needs none).")
    return loaders


def _num_workers(strategy) -> int:
    if isinstance(strategy, _backends.NoStrategy):
        return 1
    import tensorflow as tf

    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 1
    count = getattr(strategy, "num_workers", None)  # kpipe's repaired strategy
    if count is None:
        spec = strategy.cluster_resolver.cluster_spec().as_dict()
        count = len(spec.get("chief", ())) + len(spec.get("worker", ()))
    return max(1, int(count))


def _sum_over_replicas(strategy, values: np.ndarray) -> np.ndarray:
    """All-reduce (SUM) of `values` given by every replica of every worker."""
    import tensorflow as tf

    tensor = tf.constant(values)
    per_replica = strategy.experimental_distribute_values_from_function(lambda _: tensor)
    total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
    return np.asarray(total)


def _optimizer_step(model) -> Optional[int]:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    return int(_backends.numpy_value(optimizer.iterations))


def _backup_dirs(worker_dir: str, kind: str) -> List[int]:
    try:
        names = os.listdir(worker_dir)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_DIR_RE[kind].match, names) if m)


def _remove_backup(backup: str) -> None:
    # Metadata first: a backup whose removal is interrupted is incomplete, not damaged.
    _remove_file(os.path.join(backup, _METADATA_FILE))
    shutil.rmtree(backup, ignore_errors=True)


def _remove_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _rmdir_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:  # not empty (other workers, other files) or already gone
        pass


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows: directories cannot be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
