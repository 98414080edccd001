"""Argument checks shared by kpipe's public constructors: each error names the argument,
the value received and the fix (the house style's error rule)."""

import math
import os
import warnings

import numpy as np

from kpipe import _devices
from kpipe._engine import _autoscale
from kpipe._engine._ray_cluster import RayWorkers


def check_int(name, value, minimum, fix):
    """`value` as an int `>= minimum`; a TypeError or ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an integer. Received: {name}={value!r} of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}. Received: {name}={value}. {fix}".rstrip())
    return int(value)


def check_timeout(timeout):
    """Seconds as a float, or None for no timeout (also for `float("inf")`)."""
    if timeout is None or (isinstance(timeout, float) and math.isinf(timeout) and timeout > 0):
        return None
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0 or math.isnan(timeout):
        raise ValueError(
            f"`timeout` must be a positive number of seconds, or None for no timeout. Received: timeout={timeout!r}."
        )
    return float(timeout)


def check_dataset(dataset):
    """Refuses what cannot be a batch dataset (a str, a dict, a generator...)."""
    if isinstance(dataset, (str, bytes, bytearray, dict)) or not hasattr(dataset, "__getitem__"):
        raise TypeError(
            "`dataset` must have __getitem__(i) returning batch i and __len__ (a keras.utils.PyDataset "
            f"or Sequence). Received: {str(dataset)[:100]!s} of type {type(dataset).__name__}. For a Python "
            "generator, pass it to model.fit directly; for arrays, use kpipe.data.from_numpy."
        )


def check_start_method(start_method):
    """`start_method` as given, or this platform's default when None."""
    if start_method not in (None, "forkserver", "spawn", "fork"):
        raise ValueError(
            f"Invalid value for argument `start_method`. Received: start_method={start_method!r}. "
            "Expected 'forkserver' (default), 'spawn' or 'fork'; for threads pass use_threads=True."
        )
    return start_method or default_start_method()


def default_start_method():
    return "forkserver" if hasattr(os, "fork") and hasattr(os, "memfd_create") else "spawn"


def check_shards(num_shards, shard_index, num_batches, shuffle, seed):
    """`(num_shards, shard_index)`, `(1, 0)` for none; errors for a split that would
    give a shard no batch or overlap shards."""
    if num_shards is None and shard_index is None:
        return 1, 0
    if num_shards is None or shard_index is None:
        raise ValueError(
            f"Pass both `num_shards` and `shard_index` or neither. Received: num_shards={num_shards!r}, "
            f"shard_index={shard_index!r}."
        )
    num_shards = check_int("num_shards", num_shards, 1, "")
    shard_index = check_int("shard_index", shard_index, 0, "")
    if shard_index >= num_shards:
        raise ValueError(
            f"`shard_index` must be < num_shards. Received: shard_index={shard_index}, num_shards={num_shards}."
        )
    if num_batches is not None and num_batches < num_shards:
        raise ValueError(
            f"The dataset has {num_batches} batches, fewer than num_shards={num_shards}: some shards "
            "would get none. Use smaller batches or fewer shards."
        )
    if shuffle and seed is None and num_shards > 1:
        raise ValueError(
            "`shuffle=True` across shards needs a `seed`: with a different random order on each "
            "worker, shards would overlap (samples duplicated and dropped). Received: seed=None. "
            "Pass the same seed=... on every worker."
        )
    return num_shards, shard_index


def check_device(device):
    """`device` as TensorFlow's canonical name, or a ValueError listing the devices."""
    name = _devices.local_device(device)
    if name is not None:
        return name
    raise ValueError(
        f"`device` must name a device of this process. Received: device={device!r}. "
        f"Available: {', '.join(_devices.available())}. Pass one of them (e.g. '/gpu:0'), or device=None to "
        "leave batches on the host."
    )


def check_epochs(epochs):
    """`as_dataset(epochs=...)`: a positive int or None."""
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise ValueError(f"`epochs` must be a positive int (the iterations the dataset will run) or None. Received: epochs={epochs!r}.")
    return epochs


def check_worker_threads(worker_threads, workers, use_threads):
    """`worker_threads` (checked), with a warning where no worker process would use it."""
    if worker_threads is not None and (workers == 0 or use_threads):
        warnings.warn(
            f"`worker_threads` has no effect with {'workers=0' if workers == 0 else 'use_threads=True'}: batches load "
            f"in this process, whose thread pools kpipe leaves alone. Received: worker_threads={worker_threads}. "
            "Drop it, or use worker processes.", stacklevel=3,
        )
    return worker_threads


def autoscale_for(workers, max_queue_size, start_method, use_threads):
    """`(AutoscaleDriver or None, max_queue_size)`: the controller of `workers="auto"` (or
    `RayWorkers("auto")`), and the default `max_queue_size` it implies."""
    remote_auto = isinstance(workers, RayWorkers) and workers.count == "auto"
    if not remote_auto and not (isinstance(workers, str) and workers == "auto"):
        return None, max_queue_size
    if not remote_auto:  # (RayWorkers with use_threads: refused by check_workers)
        _autoscale.AutoscaleDriver.check_arguments(start_method, use_threads)
    if max_queue_size is not None:
        max_queue_size = check_int("max_queue_size", max_queue_size, 1, "It bounds the batches loaded ahead; use at least 1.")
    autoscale = (_autoscale.AutoscaleDriver.for_remote(workers.max_count, max_queue_size) if remote_auto
                 else _autoscale.AutoscaleDriver(max_queue_size))
    return autoscale, autoscale.default_max_queue_size


def check_workers(workers, use_threads, autoscale=None):
    """`(count, remote)`: a worker count >= 0, or `RayWorkers(...)` (its count -- with
    `"auto"`, the controller's first count -- and itself)."""
    if isinstance(workers, str) and workers == "auto" and autoscale is not None:
        return autoscale.start_workers, None
    if isinstance(workers, RayWorkers):
        if use_threads:
            raise ValueError("`use_threads=True` runs threads in this process; it cannot go with workers=RayWorkers(...). "
                             f"Received: workers={workers!r}, use_threads=True. Drop one of them.")
        return (autoscale.start_workers if workers.count == "auto" else workers.count), workers
    return check_int("workers", workers, 0, "Use 0 to load batches in the calling thread, workers='auto', or "
                     "workers=kpipe.RayWorkers(n) for Ray actors."), None


# `ProcessLoader.from_samples` with the default `max_queue_size`, worker processes: small
# batches may have up to this many batches in flight (the window still deepens only when
# workers idled behind slower batches, `_engine/_window.py`'s `deepen`) ...
SMALL_BATCH_QUEUE = 16
# ... while the bytes in flight stay under this (the last batch's size times the window).
SMALL_BATCH_QUEUE_BYTES = 32 << 20


def small_batch_queue(dataset, max_queue_size, workers, *, use_threads, remote, autoscale):
    """`(max_queue_size, (base, max_bytes))` of a `from_samples` loader left at the default
    `max_queue_size` (`dataset.default_queue`; `max_queue_size`: that default, `max(4, 2 *
    workers)`): with worker processes, up to `SMALL_BATCH_QUEUE` batches in flight where
    `SMALL_BATCH_QUEUE_BYTES` hold that many of the last batch, never fewer than the default
    (`base`); `(max_queue_size, None)` (no change) with threads, `workers=0`, `"auto"` or Ray
    actors, which keep their own defaults.

    Small batches hand over in a fraction of a millisecond of worker time, so a window of
    two per worker leaves workers idle while the consumer waits for a batch of a longer
    bucket (issue 46: text batches of 32 rows, 0.82x bare processes at 4 in flight, 1.01x at
    16). A bound in bytes keeps large batches (audio, images) at the default."""
    if not getattr(dataset, "default_queue", False) or use_threads or remote is not None or autoscale is not None \
            or workers == 0:
        return max_queue_size, None
    return max(SMALL_BATCH_QUEUE, max_queue_size), (max_queue_size, SMALL_BATCH_QUEUE_BYTES)
