"""The window (kpipe/_engine/_window.py) against a scripted backend, no processes: what it
submits, drops and keeps, and its deepening rule ("rent before buying") with numbers."""

import pytest

from kpipe._engine._backend import Backend
from kpipe._engine._position import Position
from kpipe._engine._window import _UNSET, Window, deepen


class FakeBackend(Backend):
    """Answers at once; records what it was asked. With `slots`, it plays a process
    backend whose workers can idle (`idle`), with a slot price and batch time."""

    def __init__(self, slots=False, price_s=0.0, batch_s=0.0, first_use=False):
        self.has_slots = slots
        self.price_s, self.batch_s, self.first_use = price_s, batch_s, first_use
        self.submitted, self.discarded, self.prepared = [], [], []
        self.idle = 0
        self.starve = 0  # how many times get() reports an idle worker before answering
        self.timeout = None

    def submit(self, key, inputs=None, seed=None):
        self.submitted.append(key)
        return len(self.submitted) - 1

    def get(self, seq, on_starved=None):
        for _ in range(self.starve):
            if on_starved is None or not on_starved():
                break
        key = self.submitted[seq]
        return key, None, [("<f4", (2,))]

    def discard(self, seq):
        self.discarded.append(self.submitted[seq])

    def reset_target(self, target, dumped=None):
        pass

    def close(self, force=False):
        self.closed = True

    # a process backend's slot answers, scripted
    def slot_setup_s(self, nbytes=None):
        return self.price_s

    def mean_batch_s(self):
        return self.batch_s

    def is_first_use(self, seq):
        return self.first_use

    def idle_workers(self):
        return self.idle

    def prepare_slots(self, up_to):
        self.prepared.append(up_to)
        return 1


def _window(n=10, workers=2, max_queue_size=6, backend=None, stop=None, max_queue_bytes=None):
    """A window over an n-batch pass that loads in order from the head, up to `stop`."""
    position = Position(n)
    stats = {"loads": 0, "discards": 0, "wait_s": 0.0, "last_batch_bytes": 0}

    def next_key(after=_UNSET):
        last = window.last_key()
        key = (position.head if after is _UNSET else after) if last is None else position.successor(last, cross_passes=False)
        return None if key is None or (stop is not None and key >= stop) else key

    window = Window(position, stats, max_queue_size=max_queue_size, max_queue_bytes=max_queue_bytes, workers=workers,
                    next_key=next_key, before_submit=lambda key: None)
    window.backend = backend or FakeBackend()
    return window, stats


@pytest.mark.parametrize("idle_s, price_s, batch_s, want", [
    (0.5, 0.7, 0.02, False),  # one wait behind a slow batch does not pay for two 77 MB slots
    (0.8, 0.7, 0.02, True),  # ... the idle time since the last deepening does
    (0.0, 0.0001, 0.02, True),  # small batches: a slot costs less than loading a batch
    (0.0, 0.0, 0.0, True),  # threads: no slot to buy
    (100.0, 200.0, 0.05, False),
])
def test_the_window_deepens_once_idle_worker_seconds_pay_for_the_new_slots(idle_s, price_s, batch_s, want):
    assert deepen(idle_behind_s=idle_s, slot_price_s=price_s, mean_batch_s=batch_s) is want


def test_it_fills_two_per_worker_and_counts_loads_and_discards():
    window, stats = _window()
    window.fill()
    assert list(window.queue) == [(0, 0), (0, 1), (0, 2), (0, 3)] and window.depth == 4
    window.drop((0, 0))
    assert stats == {"loads": 4, "discards": 1, "wait_s": 0.0, "last_batch_bytes": 0}
    assert window.backend.discarded == [0]  # (the backend is given dataset indices)


def test_a_real_read_drops_what_it_skipped_and_a_probe_keeps_it():
    window, _ = _window()
    window.fill()
    entry = window.seek((0, 2), probe=True)
    assert list(window.queue)[:3] == [(0, 0), (0, 1), (0, 2)] and entry.index == 2
    window.seek((0, 2), probe=False)
    assert min(window.queue) == (0, 2) and window.backend.discarded == [0, 1]


def test_a_read_before_the_queue_submits_the_keys_in_between():
    window, _ = _window(stop=(0, 10))
    window.fill(after=(0, 3))
    assert min(window.queue) == (0, 3)
    window.seek((0, 1), probe=False)  # a new stream replays the start of the pass
    assert list(window.queue)[:2] == [(0, 1), (0, 2)] and window.backend.discarded == []


def test_max_queue_bytes_bounds_the_batches_in_flight():
    window, stats = _window(max_queue_size=10, max_queue_bytes=3 * 1000)
    assert window.limit() == 2  # one per worker until a batch size is known
    stats["last_batch_bytes"] = 1000
    assert window.limit() == 3


def test_a_wait_behind_a_slow_batch_deepens_when_the_idle_time_pays_for_it():
    backend = FakeBackend(slots=True, price_s=0.7, batch_s=0.02)
    backend.idle = 1
    window, _ = _window(backend=backend)
    window.fill()
    window.idle_behind_s = 1.5  # (idle worker-seconds counted over earlier waits)
    backend.starve = 1
    window.wait((0, 0), window.seek((0, 0), probe=False))
    assert window.depth == 6 and window.idle_behind_s == 0.0  # two more (one per worker), up to max_queue_size
    assert backend.prepared == []


def test_a_wait_that_does_not_pay_prepares_a_slot_and_counts_its_idle_time():
    backend = FakeBackend(slots=True, price_s=0.7, batch_s=0.02)
    backend.idle = 1
    window, _ = _window(backend=backend)
    window.fill()
    backend.starve = 1
    window.wait((0, 0), window.seek((0, 0), probe=False))
    assert window.depth == 4
    assert backend.prepared == [5]  # a slot for the window's 4 and the one the consumer holds
    assert window.idle_behind_s > 0.0  # this wait's idle worker-seconds count towards the price


def test_a_wait_behind_a_first_use_of_a_slot_never_deepens():
    backend = FakeBackend(slots=True, price_s=0.0, batch_s=0.02, first_use=True)
    window, _ = _window(backend=backend)
    window.fill()
    backend.starve = 1
    window.wait((0, 0), window.seek((0, 0), probe=False))
    assert window.depth == 4 and backend.prepared == [5]
