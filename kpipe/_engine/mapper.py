"""`ProcessMapper`: apply a NumPy function to a stream of items in worker processes.

Used by `kpipe.data` for Python preprocessing that must escape the GIL. Inputs and
outputs are trees of NumPy arrays that travel through shared memory; results come back
in input order.
"""

import collections

from kpipe._engine._local import InlineBackend
from kpipe._engine._pool import ProcessBackend

_DEFAULT_TIMEOUT_S = 120.0


class ProcessMapper:
    """Runs `fn(item)` in `workers` processes, yielding results in input order.

    Args:
        fn: A function taking and returning a tree (tuple/list/dict nesting) of numeric
            or bool NumPy arrays. Sent with cloudpickle (lambdas and notebook functions
            work). Batch items (many samples per call) to amortise the hand-off.
        workers: Worker processes; 0 runs `fn` in the calling thread. Defaults to 2.
        max_in_flight: Items submitted ahead of the consumer. Defaults to `2 * workers`.
        timeout: Seconds to wait for one item. Defaults to 120.
        seed: Seeds `random`/`numpy.random` in each worker (per worker id). Defaults
            to None (random).
        start_method: `"spawn"` or `"fork"` (see `ProcessLoader`). Defaults to spawn.
        worker_threads: Threads each worker's BLAS/OpenMP/OpenCV pools may use (see
            `ProcessLoader`). Defaults to None (`max(1, CPUs // workers)`).

    Use from one thread at a time. Example:

    >>> import numpy as np
    >>> from kpipe._engine.mapper import ProcessMapper
    >>> with ProcessMapper(lambda x: x * 2, workers=2) as m:
    ...     [int(y[0]) for y in m.imap(np.full((1,), i) for i in range(4))]
    [0, 2, 4, 6]
    """

    def __init__(self, fn, *, workers=2, max_in_flight=None, timeout=_DEFAULT_TIMEOUT_S, seed=None, start_method=None,
                 worker_threads=None):
        if not callable(fn):
            raise TypeError(f"`fn` must be callable. Received: fn={fn!r}.")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"`workers` must be an integer >= 0. Received: workers={workers!r}. Use 0 to run fn in this thread.")
        self.max_in_flight = max_in_flight or max(2, 2 * workers)
        name = getattr(fn, "__qualname__", type(fn).__name__)
        if workers == 0:
            self._backend = InlineBackend(fn, mode="function", name=name)
        else:
            import os

            self._backend = ProcessBackend(
                fn,
                num_workers=workers,
                mode="function",
                start_method=start_method or "spawn",
                timeout=float(timeout),
                seed=int.from_bytes(os.urandom(4), "little") if seed is None else int(seed),
                name=name,
                keep_idle=2 * self.max_in_flight + workers,
                worker_threads=worker_threads,
            )

    def imap(self, iterable):
        """Yields `fn(item)` for each item of `iterable`, in order."""
        queue = collections.deque()
        it = iter(iterable)
        exhausted = False
        try:
            while True:
                while not exhausted and len(queue) < self.max_in_flight:
                    try:
                        item = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    queue.append(self._backend.submit(None, inputs=item))
                if not queue:
                    return
                out, _, _ = self._backend.get(queue.popleft())
                yield out
        finally:
            if not self._backend.closed:
                for seq in queue:
                    self._backend.discard(seq)

    @property
    def closed(self):
        """True once `close()` ran or a fatal failure (dead worker, timeout) stopped it."""
        return self._backend.closed

    def close(self):
        """Stops the workers. Idempotent."""
        self._backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
