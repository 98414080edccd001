"""`kpipe.worker_info()`: which worker am I, and with what seed."""

import dataclasses
import threading
from typing import Optional


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """Describes the worker process (or thread) that is loading batches.

    Attributes:
        id: The worker's index, `0 <= id < num_workers`.
        num_workers: How many workers the loader runs (with `workers="auto"`: the
            most it may run; ids stay below it except briefly while a retired worker
            is still finishing).
        seed: This worker's seed, derived from the loader's `seed` and `id`; `random`
            and `numpy.random` are seeded with it when the worker starts. A
            `ProcessLoader` then reseeds both before each batch from `(seed, pass,
            position)`, so the draws in `__getitem__` do not depend on the worker count.
        pid: The worker's process id.
        mode: `"process"` or `"thread"`.

    Instances are immutable and may be shared across threads and processes.

    Example:

    >>> import numpy as np, kpipe
    >>> kpipe.worker_info() is None   # the main process is no worker
    True
    >>> class WhoLoads:
    ...     def __len__(self):
    ...         return 2
    ...     def __getitem__(self, i):
    ...         info = kpipe.worker_info()
    ...         return np.array([info.id, info.num_workers])
    >>> with kpipe.ProcessLoader(WhoLoads(), workers=1) as loader:
    ...     loader[0].tolist()
    [0, 1]
    """

    id: int
    num_workers: int
    seed: int
    pid: int
    mode: str = "process"


_CURRENT: Optional[WorkerInfo] = None  # set once in a worker process
_THREAD = threading.local()  # set per thread in thread mode


def worker_info() -> Optional[WorkerInfo]:
    """Returns the `WorkerInfo` of the calling worker, or `None` outside workers.

    Use it in `__getitem__` to open per-worker resources or draw per-worker randomness.

    Example:

    >>> import kpipe
    >>> kpipe.worker_info() is None   # the main process is no worker
    True
    """
    return getattr(_THREAD, "info", None) or _CURRENT


def _set(info: Optional[WorkerInfo]) -> None:
    global _CURRENT
    _CURRENT = info


def _set_thread(info: Optional[WorkerInfo]) -> None:
    _THREAD.info = info


def derive_seed(seed: int, worker_id: int) -> int:
    """A 32-bit seed for worker `worker_id` of a loader seeded with `seed`."""
    import numpy as np

    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, worker_id]).generate_state(1)[0])


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def batch_seed(seed: int, pass_: int, position: int) -> int:
    """A 32-bit seed for the batch at `position` of pass `pass_` (cheap: ~1 us).

    Worker processes reseed `random` and `numpy.random` with it before loading that batch,
    so a batch's randomness depends on the loader's seed and where the batch stands in the
    sequence -- not on which worker loads it, nor on how many workers there are.
    """
    x = _splitmix64(int(seed) & _MASK64)
    x = _splitmix64(x ^ (int(pass_) & _MASK64))
    return _splitmix64(x ^ (int(position) & _MASK64)) & 0xFFFFFFFF
