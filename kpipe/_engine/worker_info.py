"""`kpipe.worker_info()`: which worker am I, and with what seed."""

import dataclasses
import threading
from typing import Optional


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """Describes the worker process (or thread) that is loading batches.

    Attributes:
        id: The worker's index, `0 <= id < num_workers`.
        num_workers: How many workers the loader runs.
        seed: This worker's seed, derived from the loader's `seed` and `id`; `random`
            and `numpy.random` are seeded with it when the worker starts.
        pid: The worker's process id.
        mode: `"process"` or `"thread"`.
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
