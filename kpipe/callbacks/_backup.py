"""`BackupAndRestore`: per-worker, per-epoch backups that every worker resumes from together.

NOTE [ Crash-consistent backups across workers ]
------------------------------------------------
Keras's `keras.callbacks.BackupAndRestore` keeps one backup per directory and overwrites
it at every epoch end. Under `MultiWorkerMirroredStrategy` each worker needs its own
directory, and the workers save at slightly different moments, so a worker killed while
saving leaves the job with backups one epoch apart (or a half-written file); relaunched,
the workers restore different epochs and their mirrored variables diverge, or they wait
forever in collectives the others never run. This callback makes the set of backups
crash-consistent:

    backup_dir/                  (without a multi-worker TF_CONFIG the epochs live here)
      worker-0/                  per_worker_path(backup_dir), stable across restarts
        epoch-000002/
          state.weights.h5       model weights + optimizer variables (`iterations` too)
          metadata.json          written LAST: temp file, fsync, os.replace, fsync dir
        epoch-000003/ ...
      worker-1/ ...

Saving epoch n (`on_epoch_end`, n = epochs completed): remove epoch n's old
`metadata.json` if any, write and fsync the state, then commit the metadata atomically.
An epoch is *complete* when its metadata parses, names n and lists files that exist with
the recorded sizes; a crash at any point leaves the epoch incomplete, never half-valid.
The metadata also records `optimizer.iterations` and each of `loaders`' `epoch`.

Resuming (`on_train_begin`): each worker lists its complete epochs as a 0/1 vector over
`0..epochs` (epoch 0, "nothing trained", is always held) and the workers all-reduce (SUM)
the vectors through the strategy. The newest epoch whose count equals the number of
replicas is held by everyone: all workers restore it, set `model._initial_epoch` (as
Keras's callback does) and drop their newer epochs, which belong to a run the job
abandons. Every worker computes the same answer from the same reduced vector, so they
cannot disagree.

Loaders get back the `epoch` they had when the backup was written, not the Keras epoch:
`fit()` calls the input's `on_epoch_end()` once before training (Keras's
`EpochIterator.reset()` after the symbolic build), so a fresh `ProcessLoader` trains
Keras epoch k with its shuffle plan k + 1, and `set_epoch(k)` would replay the wrong one.

Why the agreed epoch is always on disk: training epoch n+1 needs an all-reduce with every
worker, and a worker joins it only after saving epoch n. So when any worker saves n+1,
every worker has completed n: newest complete epochs differ by at most one, and keeping
the last two epochs per worker (`keep` is raised to 2 under multi-worker training) keeps
the agreed one.

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

from kpipe.distribute._chief import per_worker_path

logger = logging.getLogger("kpipe.callbacks")

_FORMAT = 1
_STATE_FILE = "state.weights.h5"
_METADATA_FILE = "metadata.json"
_EPOCH_DIR = re.compile(r"^epoch-(\d+)$")


class BackupAndRestore(keras.callbacks.Callback):
    """Backs up training state after each epoch; a relaunched `fit()` resumes from it.

    A crash-consistent replacement for `keras.callbacks.BackupAndRestore`, for one process
    as for `MultiWorkerMirroredStrategy` jobs. After each completed epoch every worker
    writes the model weights, optimizer variables and epoch/step counters to files of
    their own under its own directory (`kpipe.distribute.per_worker_path(backup_dir)`),
    committing each epoch with a small metadata file written last by atomic rename, and
    keeps the last `keep` epochs. When `fit()` starts, all workers agree, by a collective
    through the model's strategy, on the newest epoch *every* worker saved completely,
    restore it and continue from there: a worker killed mid-save cannot make the workers
    resume from different epochs. See the NOTE in this module for the protocol.

    Give it the same `backup_dir` on every worker (a shared file system, or the same path
    on each host) and relaunch the job with the same program and `epochs`. With
    `loaders`, each `kpipe.ProcessLoader` is put back (`set_epoch`) on the shuffle plan it
    was on when the backup was written, so the resumed epochs see the same batches in the
    same order and the resumed run computes the same weights as an uninterrupted one.
    When `fit()` completes, the backups are deleted.

    It already uses per-worker directories: pass it to `fit()` directly, not through
    `kpipe.distribute.chief_only`. One instance serves one model in one process; do not
    share it across threads.

    Args:
        backup_dir: Directory for the backups, the same for every worker of the job. Do
            not store other files there. Each worker uses `backup_dir/worker-<i>` under
            a multi-worker `TF_CONFIG`, else `backup_dir` itself.
        save_freq: When to back up; only `"epoch"` (after every epoch) is supported,
            since `fit()` can only resume at an epoch boundary. Defaults to `"epoch"`.
        keep: How many of the newest epochs to keep per worker, at least 1. Under
            multi-worker training at least 2 are kept (see the NOTE). Defaults to 2.
        loaders: A `kpipe.ProcessLoader` (or anything with `epoch` and
            `set_epoch(epoch)`), or a sequence of them, to move to the resumed epoch's
            shuffle plan; pass the same ones in the relaunched run. Defaults to `None`.

    Attributes:
        worker_dir: This worker's directory.
        restored_epoch: Epoch the last `fit()` resumed from (0: started from scratch),
            `None` before `fit()`.

    Raises:
        ValueError: `backup_dir` is empty, `save_freq` is not `"epoch"` or `keep` is not
            a positive integer.
        TypeError: An item of `loaders` has no `epoch` or no `set_epoch` method.

    `fit()` raises `ValueError` if `loaders` is given and the backup being restored
    recorded a different number of loaders.

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
    >>> history = model.fit(x, y, epochs=4, verbose=0, callbacks=[backup])
    >>> backup.restored_epoch, len(history.history["loss"])
    (2, 2)
    """

    def __init__(self, backup_dir, *, save_freq="epoch", keep: int = 2, loaders=None):
        super().__init__()
        if not backup_dir:
            raise ValueError(f"`backup_dir` must be a non-empty path. Received: "
                             f"backup_dir={backup_dir!r}. Pass a directory that this job "
                             "alone uses, the same on every worker.")
        if not isinstance(save_freq, str) or save_freq != "epoch":
            raise ValueError(
                f"`save_freq` must be 'epoch'. Received: save_freq={save_freq!r}. fit() "
                "resumes at an epoch boundary, so a backup taken inside an epoch would "
                "train part of that epoch twice. Use save_freq='epoch' (the default), or "
                "keras.callbacks.BackupAndRestore for per-batch backups.")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"`keep` must be an integer >= 1. Received: keep={keep!r}. "
                             "Use keep=1 to keep only the newest epoch.")
        self.backup_dir = os.fspath(backup_dir)
        self.worker_dir = per_worker_path(self.backup_dir)
        self.save_freq = save_freq
        self.keep = keep
        self.loaders = _check_loaders(loaders)
        self.restored_epoch: Optional[int] = None
        self._retain = keep
        self._set_initial_epoch = False

    # ------------------------------------------------------------------ Keras hooks
    def on_train_begin(self, logs=None):
        strategy = self.model.distribute_strategy
        workers = _num_workers(strategy)
        self._retain = max(self.keep, 2) if workers > 1 else self.keep
        local = complete_epochs(self.worker_dir)
        epoch = self._agree(strategy, workers, sorted(local))
        self._drop_epochs_after(epoch)
        self.restored_epoch = epoch
        if epoch == 0:
            logger.info("BackupAndRestore: no backup held by every worker in %s; "
                        "training from the start.", self.backup_dir)
            return
        loader_epochs = self._loader_epochs(epoch, local[epoch])
        self._restore(strategy, epoch, local[epoch])
        self.model._initial_epoch = epoch  # noqa: SLF001 -- how Keras's callback resumes
        self._set_initial_epoch = True
        for loader, loader_epoch in zip(self.loaders, loader_epochs):
            loader.set_epoch(loader_epoch)
        logger.info("BackupAndRestore: resuming at epoch %d from %s (newest complete "
                    "backup of this worker: epoch %d).", epoch, self.worker_dir, max(local))

    def on_epoch_end(self, epoch, logs=None):
        self._save(epoch + 1)

    def on_train_end(self, logs=None):
        if self._set_initial_epoch:  # Keras never resets it: the next fit() would skip epochs
            self.model._initial_epoch = None  # noqa: SLF001
            self._set_initial_epoch = False
        for epoch in _epoch_dirs(self.worker_dir):
            _remove_epoch(self._epoch_dir(epoch))
        _rmdir_if_empty(self.worker_dir)
        if self.backup_dir != self.worker_dir:  # the others' worker dirs may still be there
            _rmdir_if_empty(self.backup_dir)

    # ------------------------------------------------------------------ saving
    def _save(self, epoch: int) -> None:
        epoch_dir = self._epoch_dir(epoch)
        os.makedirs(epoch_dir, exist_ok=True)
        _remove_file(os.path.join(epoch_dir, _METADATA_FILE))  # an older copy is void now
        state = os.path.join(epoch_dir, _STATE_FILE)
        self.model.save_weights(state, overwrite=True)
        _fsync_file(state)
        metadata = {
            "format": _FORMAT,
            "epoch": epoch,
            "step": _optimizer_step(self.model),
            "files": {_STATE_FILE: os.path.getsize(state)},
            "loader_epochs": [int(loader.epoch) for loader in self.loaders],
        }
        self._commit(epoch_dir, metadata)
        self._prune(epoch)

    def _commit(self, epoch_dir: str, metadata: Dict) -> None:
        path = os.path.join(epoch_dir, _METADATA_FILE)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(epoch_dir)

    def _prune(self, newest: int) -> None:
        kept = sorted(e for e in complete_epochs(self.worker_dir) if e <= newest)[-self._retain:]
        for epoch in _epoch_dirs(self.worker_dir):
            if epoch not in kept:
                _remove_epoch(self._epoch_dir(epoch))

    # ------------------------------------------------------------------ restoring
    def _agree(self, strategy, workers: int, local: Sequence[int]) -> int:
        epochs = int(self.params.get("epochs") or 0) if self.params else 0
        held = np.zeros(epochs + 1, np.float32)
        held[0] = 1.0  # "nothing trained" is held by everyone
        held[np.array([e for e in local if e <= epochs], dtype=np.int64)] = 1.0
        if workers > 1:
            counts = _sum_over_replicas(strategy, held)
            everyone = counts > strategy.num_replicas_in_sync - 0.5
        else:
            everyone = held > 0.5
        return int(np.flatnonzero(everyone).max())

    def _restore(self, strategy, epoch: int, metadata: Dict) -> None:
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with strategy.scope():  # slot variables must be created as mirrored ones
                optimizer.build(self.model.trainable_variables)
        self.model.load_weights(os.path.join(self._epoch_dir(epoch), _STATE_FILE))
        step = _optimizer_step(self.model)
        if metadata.get("step") is not None and step != metadata["step"]:
            logger.warning("BackupAndRestore: epoch %d was saved at optimizer step %s but "
                           "the restored optimizer is at step %s; its variables may not "
                           "have been restored.", epoch, metadata["step"], step)

    def _loader_epochs(self, epoch: int, metadata: Dict) -> List[int]:
        saved = metadata.get("loader_epochs", [])
        if self.loaders and len(saved) != len(self.loaders):
            raise ValueError(
                f"BackupAndRestore was given {len(self.loaders)} loader(s) but the backup of "
                f"epoch {epoch} in {self.worker_dir} recorded {len(saved)}. Received: "
                f"loaders={[type(loader).__name__ for loader in self.loaders]}. Pass the "
                "same `loaders` as the run that wrote the backup (or delete the backup to "
                "start over).")
        return saved

    def _drop_epochs_after(self, epoch: int) -> None:
        for other in _epoch_dirs(self.worker_dir):
            if other > epoch:
                _remove_epoch(self._epoch_dir(other))

    def _epoch_dir(self, epoch: int) -> str:
        return os.path.join(self.worker_dir, f"epoch-{epoch:06d}")


def complete_epochs(worker_dir: str) -> Dict[int, Dict]:
    """Returns `{epoch: metadata}` for the completely saved epochs under `worker_dir`."""
    complete = {}
    for epoch in _epoch_dirs(worker_dir):
        epoch_dir = os.path.join(worker_dir, f"epoch-{epoch:06d}")
        try:
            with open(os.path.join(epoch_dir, _METADATA_FILE)) as f:
                metadata = json.load(f)
            files_ok = all(os.path.getsize(os.path.join(epoch_dir, name)) == size
                           for name, size in metadata["files"].items())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if files_ok and metadata.get("format") == _FORMAT and metadata.get("epoch") == epoch:
            complete[epoch] = metadata
    return complete


def _check_loaders(loaders) -> List:
    if loaders is None:
        return []
    if hasattr(loaders, "set_epoch"):
        loaders = [loaders]
    loaders = list(loaders)
    for i, loader in enumerate(loaders):
        if not (callable(getattr(loader, "set_epoch", None)) and hasattr(loader, "epoch")):
            raise TypeError(f"`loaders` must hold objects with an `epoch` attribute and a "
                            "`set_epoch(epoch)` method, such as kpipe.ProcessLoader. "
                            f"Received: loaders[{i}]="
                            f"{str(loader)[:100]} of type {type(loader).__name__}. Remove it "
                            "from `loaders` (fit() input without a shuffle plan needs none).")
    return loaders


def _num_workers(strategy) -> int:
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
    return int(keras.ops.convert_to_numpy(optimizer.iterations))


def _epoch_dirs(worker_dir: str) -> List[int]:
    try:
        names = os.listdir(worker_dir)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_EPOCH_DIR.match, names) if m)


def _remove_epoch(epoch_dir: str) -> None:
    # Metadata first: an epoch whose removal is interrupted is incomplete, not damaged.
    _remove_file(os.path.join(epoch_dir, _METADATA_FILE))
    shutil.rmtree(epoch_dir, ignore_errors=True)


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
