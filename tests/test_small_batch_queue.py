"""`from_samples` at the default `max_queue_size` (issue 46): small batches may go deeper
than the default window (up to `_args.SMALL_BATCH_QUEUE` batches in flight, while they
take at most `_args.SMALL_BATCH_QUEUE_BYTES`); large batches, an explicit
`max_queue_size`, threads and PyDatasets keep the default. Asserts on depths and counts,
never on timings."""

import time

import numpy as np
import pytest

import kpipe
from kpipe import _args
from kpipe._engine._position import Position
from kpipe._engine._window import _UNSET, Window


class _Marked:
    default_queue = True


class _Backend:
    """Just enough of a backend for `Window.limit` and `fill`."""

    closed = False

    def batches_per_call(self):
        return 1

    def needs_new_slot(self, for_idle_worker=True):
        return False

    def submit(self, index, seed=None):
        return index


def _window(small_batches, max_queue_size=16, workers=2):
    position = Position(100)
    stats = {"loads": 0, "discards": 0, "wait_s": 0.0, "last_batch_bytes": 0}

    def next_key(after=_UNSET):
        last = window.last_key()
        return position.head if last is None else position.successor(last, cross_passes=False)

    window = Window(position, stats, max_queue_size=max_queue_size, max_queue_bytes=None, workers=workers,
                    next_key=next_key, before_submit=lambda key: None, small_batches=small_batches)
    window.backend = _Backend()
    return window, stats


def test_the_ceiling_is_the_default_until_a_batch_is_known_then_what_the_bytes_bound_holds():
    window, stats = _window((4, 3000))
    window.depth = 16
    assert window.ceiling() == 4 and window.limit() == 4  # no batch seen yet
    stats["last_batch_bytes"] = 100  # 30 fit: up to max_queue_size
    assert window.ceiling() == 16 and window.limit() == 16
    stats["last_batch_bytes"] = 300  # 10 fit
    assert window.ceiling() == 10 and window.limit() == 10
    window.fill()
    assert window.in_flight() == 10
    stats["last_batch_bytes"] = 2000  # one fits: never below the default
    assert window.ceiling() == 4 and window.limit() == 4


def test_without_the_small_batch_bound_the_ceiling_is_max_queue_size():
    window, stats = _window(None, max_queue_size=6)
    stats["last_batch_bytes"] = 1 << 30
    window.depth = 6
    assert window.ceiling() == 6 and window.limit() == 6


@pytest.mark.parametrize("kwargs, want", [
    (dict(workers=2), (16, (4, _args.SMALL_BATCH_QUEUE_BYTES))),
    (dict(workers=12, max_queue_size=24), (24, (24, _args.SMALL_BATCH_QUEUE_BYTES))),  # never below the default
    (dict(workers=2, use_threads=True), (4, None)),
    (dict(workers=0), (4, None)),
    (dict(workers=2, remote=object()), (4, None)),
    (dict(workers=2, autoscale=object()), (4, None)),
    (dict(workers=2, dataset=object()), (4, None)),  # a PyDataset, or an explicit max_queue_size
])
def test_only_worker_processes_at_from_samples_default_get_the_deeper_ceiling(kwargs, want):
    kwargs = {"dataset": _Marked(), "max_queue_size": 4, "use_threads": False, "remote": None, "autoscale": None, **kwargs}
    dataset, max_queue_size, workers = kwargs.pop("dataset"), kwargs.pop("max_queue_size"), kwargs.pop("workers")
    assert _args.small_batch_queue(dataset, max_queue_size, workers, **kwargs) == want


class Tokens:
    """Token rows of 8 int32; every 4th batch of 4 (samples 16k..16k+3) sleeps: the
    consumer waits behind it while the other worker runs out of work at 4 in flight."""

    def __init__(self, n=96, width=8):
        self.n, self.width = n, width

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        if j % 16 < 4:
            time.sleep(0.02)
        return np.full(self.width, j, np.int32), np.int32(j % 2)


def _deepest(loader):
    deepest = 0
    for i in range(len(loader)):
        x, y = loader[i]
        assert x[:, 0].tolist() == list(range(4 * i, 4 * i + len(y)))  # (in order: shuffle is off)
        deepest = max(deepest, loader.stats()["queue_depth"])
    return deepest


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_small_batches_behind_slow_ones_deepen_past_the_default_window():
    with kpipe.ProcessLoader.from_samples(Tokens(), 4, workers=2, timeout=60) as loader:
        assert loader.max_queue_size == 4 and loader._reader.max_queue_size == 16
        assert 4 < _deepest(loader) <= 16


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_explicit_max_queue_size_wins():
    with kpipe.ProcessLoader.from_samples(Tokens(), 4, workers=2, max_queue_size=4, timeout=60) as loader:
        assert loader._reader.window.small_batches is None
        assert _deepest(loader) <= 4


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_queue_size", [None, 16])
def test_batches_too_large_for_the_bytes_bound_keep_the_default_window(max_queue_size):
    # rows of 4 x 2 MiB: 8 MiB a batch, so 32 MiB hold 4, the default window; an explicit
    # max_queue_size=16 (no bytes bound) lets the same batches deepen past it
    width = (8 << 20) // 4 // 4
    with kpipe.ProcessLoader.from_samples(Tokens(n=48, width=width), 4, workers=2, timeout=60,
                                          max_queue_size=max_queue_size) as loader:
        # idle slots kept: what the window may use as its backend starts (no batch known
        # yet: the default), not the 16 of the small-batch ceiling
        assert loader._reader.backend._slots._keep_idle == (4 if max_queue_size is None else 16) + 2
        deepest = _deepest(loader)
    assert deepest == 4 if max_queue_size is None else 4 < deepest <= 16
