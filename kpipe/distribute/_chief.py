"""Side effects on the chief only: real paths there, throwaway paths on other workers.

Under `MultiWorkerMirroredStrategy` every worker must run the same saving code (reading
some variables is a collective operation), but only the chief's files are wanted, and
two workers writing one path corrupt it. So every worker saves, each to its own path:
the chief to the real one, the others to a private temporary directory removed at exit.
`BackupAndRestore` is the exception: every worker needs its own *persistent* directory
to resume from, which `per_worker_path` provides.

Nothing here imports TensorFlow; Keras is imported only by `chief_only`.
"""

import atexit
import copy
import os
import shutil
import tempfile
import threading
from typing import List, Optional

from kpipe.distribute._cluster import cluster_info

_SCRATCH_PREFIX = "kpipe-worker"
_scratch_lock = threading.Lock()
_scratch_dir: Optional[str] = None
_scratch_count = 0


def chief_path(path: str) -> str:
    """Returns `path` on the chief and a throwaway path on the other workers.

    Use it for anything the chief alone should keep: `model.save(chief_path(...))`,
    `ModelCheckpoint`, `TensorBoard`, `CSVLogger` (or pass those to `chief_only`).
    Throwaway paths live in a per-process temporary directory deleted at exit and keep
    the base name of `path` (so `{epoch}` templates and `.keras`/`.h5` suffixes work).

    Args:
        path: File or directory path, as you would pass it on one machine.

    Returns:
        `path` itself on the chief (and without `TF_CONFIG`), else a fresh path.

    Example:

    >>> chief_path("model.keras")   # no TF_CONFIG: this process is the chief
    'model.keras'
    """
    path = os.fspath(path)
    if cluster_info().is_chief:
        return path
    return _throwaway(path)


def per_worker_path(path: str) -> str:
    """Returns `path/worker-<i>` under a multi-worker `TF_CONFIG`, else `path`.

    For state each worker must keep for itself and find again after a restart, such as
    `keras.callbacks.BackupAndRestore(per_worker_path("backup"))`.

    Args:
        path: Directory shared by the job (e.g. on a network file system).

    Returns:
        A directory path unique to this worker and stable across restarts.

    Example:

    >>> per_worker_path("/tmp/backup")   # no TF_CONFIG
    '/tmp/backup'
    """
    path = os.fspath(path)
    info = cluster_info()
    if not info.is_multi_worker:
        return path
    return os.path.join(path, f"worker-{info.worker_index}")


def chief_only(*callbacks) -> List:
    """Adapts Keras callbacks so that only the chief's files are kept.

    On the chief (or without `TF_CONFIG`) the callbacks are returned unchanged. On other
    workers, copies are returned whose `ModelCheckpoint.filepath`, `TensorBoard.log_dir`
    and `CSVLogger.filename` point to throwaway paths (see `chief_path`): the callbacks
    still run everywhere, as multi-worker saving requires. A `BackupAndRestore` gets a
    per-worker directory on every worker, the chief included (see `per_worker_path`).
    Other callbacks pass through unchanged.

    Args:
        *callbacks: Keras callbacks, created with the paths you want on the chief.

    Returns:
        A list of callbacks for `model.fit(callbacks=...)`.

    Example:

    >>> import keras
    >>> cbs = chief_only(keras.callbacks.CSVLogger("log.csv"))
    >>> cbs[0].filename   # no TF_CONFIG: unchanged
    'log.csv'
    """
    import keras

    info = cluster_info()
    adapted = []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            adapted.append(_with_backup_dir(callback, per_worker_path(callback.backup_dir)))
        elif info.is_chief:
            adapted.append(callback)
        elif isinstance(callback, keras.callbacks.ModelCheckpoint):
            adapted.append(_replaced(callback, filepath=_throwaway(callback.filepath)))
        elif isinstance(callback, keras.callbacks.TensorBoard):
            log_dir = _throwaway(callback.log_dir)
            adapted.append(_replaced(callback, log_dir=log_dir, _log_write_dir=log_dir,
                                     _train_dir=os.path.join(log_dir, "train"),
                                     _val_dir=os.path.join(log_dir, "validation")))
        elif isinstance(callback, keras.callbacks.CSVLogger):
            adapted.append(_replaced(callback, filename=_throwaway(callback.filename)))
        else:
            adapted.append(callback)
    return adapted


def _with_backup_dir(callback, backup_dir: str):
    if backup_dir == callback.backup_dir:
        return callback
    new = copy.copy(callback)
    # Re-run __init__ with the options this Keras has (`double_checkpoint`: 3.7+).
    options = {name: getattr(callback, name) for name in
               ("save_freq", "double_checkpoint", "delete_checkpoint") if hasattr(callback, name)}
    new.__init__(backup_dir, **options)
    return new


def _replaced(callback, **attributes):
    new = copy.copy(callback)
    for name, value in attributes.items():
        setattr(new, name, value)
    return new


def _throwaway(path: str) -> str:
    global _scratch_dir, _scratch_count
    with _scratch_lock:
        if _scratch_dir is None:
            _remove_stale_scratch_dirs()
            index = cluster_info().worker_index
            _scratch_dir = tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{index}-pid{os.getpid()}-")
            atexit.register(shutil.rmtree, _scratch_dir, ignore_errors=True)
        _scratch_count += 1
        slot = os.path.join(_scratch_dir, str(_scratch_count))
    os.makedirs(slot, exist_ok=True)
    return os.path.join(slot, os.path.basename(os.fspath(path).rstrip("/\\")) or "out")


def _remove_stale_scratch_dirs() -> None:
    # A worker killed by a signal (SIGKILL, or SIGTERM from `kpipe launch` when another
    # worker failed) never runs its atexit cleanup. Its directory names its pid: remove
    # the directories of processes that no longer exist.
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(_SCRATCH_PREFIX) or "-pid" not in name:
            continue
        pid_text = name.split("-pid", 1)[1].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True
