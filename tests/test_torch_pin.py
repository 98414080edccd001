"""kpipe/_torch_pin.py: the ahead copy's thread on the CPU -- order, bounding, buffer reuse,
slot release after the copy completed, errors in order, the thread's stop -- with a copier
that makes host memory the "device" and completes each copy later (as a DMA would): its
copy reads the pinned buffer only when the test (or a wait) completes it, so a buffer
reused before its copy completed would show as wrong bytes. The CUDA calls themselves run
in scripts/gpu_check_torch.py."""

import gc
import threading
import time
import weakref

import numpy as np
import pytest

from kpipe import _torch_feed, _torch_pin


def make(i):
    rng = np.random.default_rng(i)
    x = rng.random((4, 3), dtype=np.float32) * (i + 1)
    y = rng.integers(0, 9, size=(4,)).astype("int64")
    frozen = np.arange(3, dtype="float32") + i
    frozen.flags.writeable = False  # torch cannot wrap it: handed over as it is
    return x, {"y": y, "frozen": frozen, "none": None}


class LaterCopier(_torch_pin._NumpyCopier):
    """Copies complete when `complete(k)` is called (by the test, a `wait` or `hand`)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pending = []  # [views, outs, done-event]
        self.handed = []  # (event, thread name) of each hand-over

    def send(self, buffer, places):
        views = [self.view(buffer, *place) for place in places]
        outs = [np.empty(v.shape, v.dtype) for v in views]
        with self.lock:
            self.pending.append((views, outs, threading.Event()))
            return outs, len(self.pending) - 1

    def complete(self, k):
        with self.lock:
            views, outs, done = self.pending[k]
            if not done.is_set():
                for v, o in zip(views, outs):
                    o[...] = v
                done.set()

    def query(self, event):
        return event is None or self.pending[event][2].is_set()

    def wait(self, event):
        if event is not None:
            self.complete(event)

    def hand(self, leaves, event):
        self.handed.append((event, threading.current_thread().name))
        self.wait(event)  # the step's stream waits for the copy


def until(condition, what, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def same(a, b):
    if b is None:
        return a is None
    return a.dtype == b.dtype and a.shape == b.shape and np.asarray(a).tobytes() == b.tobytes()


def pin_threads():
    return [t for t in threading.enumerate() if t.name == "kpipe-torch-pin"]


def test_batches_come_in_order_equal_the_dataset_and_an_error_after_the_batches_before_it():
    def source():
        for i in range(7):
            if i == 5:
                raise KeyError("batch 5 is broken")
            yield make(i)

    ahead = _torch_pin.AheadCopy(source(), LaterCopier(), depth=2, wrap=_torch_feed.wrappable)
    got = []
    with pytest.raises(KeyError, match="batch 5 is broken"):
        for batch in ahead:
            got.append(batch)
    assert len(got) == 5
    for i, (x, d) in enumerate(got):
        ex, ed = make(i)
        assert same(x, ex) and same(d["y"], ed["y"]) and same(d["frozen"], ed["frozen"]) and d["none"] is None
        assert d["frozen"].flags.writeable is False  # not copied: passed through to Keras's conversion
    assert not ahead.alive() and next(ahead, "end") == "end"


def test_reads_are_bounded_buffers_reused_and_each_slot_released_only_once_its_copy_completed():
    copier, depth, n = LaterCopier(), 2, 12
    reads, alive, early = [], {}, []

    def released(k):
        if not copier.query(k):
            early.append(k)  # given back before its copy completed
        alive.pop(k)

    def source():
        for i in range(n):
            reads.append(i)
            batch = make(i)
            alive[i] = True
            weakref.finalize(batch[0], released, i)  # stands for the slot's lease
            yield batch

    ahead = _torch_pin.AheadCopy(source(), copier, depth=depth)
    until(lambda: len(reads) == depth + 1, "the thread reads ahead")
    time.sleep(0.2)
    assert len(reads) == depth + 1  # two in the queue, one waiting to be put
    assert sorted(alive) == [0, 1, 2] and ahead.stats["released"] == 0
    got = []
    for taken in range(n):
        got.append(next(ahead))
        # the step's stream made to wait for each batch's own copy, in the consumer's thread
        assert copier.handed == [(k, threading.current_thread().name) for k in range(taken + 1)]
        assert len(reads) <= taken + 1 + depth + 1
        assert ahead.stats["buffers"] <= depth + 1
    assert next(ahead, "end") == "end" and not ahead.alive()
    gc.collect()
    assert early == [] and alive == {}
    assert ahead.stats["released"] == n and ahead.stats["buffers"] <= depth + 1
    for i, (x, d) in enumerate(got):
        ex, ed = make(i)
        assert same(x, ex) and same(d["y"], ed["y"]) and same(d["frozen"], ed["frozen"])


def test_a_slot_is_kept_while_its_copy_runs_and_given_back_when_it_completed():
    copier, alive = LaterCopier(), set()

    def source():
        for i in range(6):
            batch = make(i)
            alive.add(i)
            weakref.finalize(batch[0], alive.discard, i)
            yield batch

    ahead = _torch_pin.AheadCopy(source(), copier, depth=2)
    until(lambda: len(copier.pending) == 3, "three copies started")
    gc.collect()
    assert alive == {0, 1, 2}  # no copy completed: every slot kept
    copier.complete(0)
    assert same(next(ahead)[0], make(0)[0])  # the thread now stages batch 3 and reclaims batch 0's buffer
    until(lambda: 0 not in alive, "batch 0's slot given back once its copy completed")
    assert {1, 2} <= alive
    ahead.close()
    assert not ahead.alive() and pin_threads() == []


def test_the_thread_stops_when_closed_or_dropped_and_closes_its_source():
    closed = []

    def source():
        try:
            for i in range(100):
                yield make(i)
        finally:
            closed.append(threading.current_thread().name)

    ahead = _torch_pin.AheadCopy(source(), LaterCopier(), depth=2)
    next(ahead)
    ahead.close()
    assert not ahead.alive() and closed == ["kpipe-torch-pin"]

    # as Keras's torch DataLoader reads it: a generator over the feed, dropped mid-epoch
    batches = (batch for batch in _torch_pin.AheadCopy(source(), LaterCopier(), depth=2))
    next(batches)
    assert len(pin_threads()) == 1
    del batches
    gc.collect()
    assert pin_threads() == []  # the drop waited for the thread
    assert len(closed) == 2

    ahead = _torch_pin.AheadCopy(source(), LaterCopier(), depth=2)
    next(ahead)
    del ahead
    gc.collect()
    assert pin_threads() == []
    assert len(closed) == 3


def test_the_switch_and_the_copier_for_a_device(monkeypatch):
    monkeypatch.delenv("KPIPE_TORCH_PIN", raising=False)
    assert _torch_pin.mode() == "auto" and _torch_pin.copier_for("cpu") is None  # a CPU device: nothing changes
    monkeypatch.setenv("KPIPE_TORCH_PIN", "0")
    assert _torch_pin.mode() == "off" and _torch_pin.copier_for("cuda") is None
    monkeypatch.setenv("KPIPE_TORCH_PIN", "cpu")
    assert isinstance(_torch_pin.copier_for("cpu"), _torch_pin.CpuCopier)
    monkeypatch.setenv("KPIPE_TORCH_PIN", "maybe")
    with pytest.raises(ValueError, match=r"KPIPE_TORCH_PIN='maybe'.*expected 1 .* 0 \(off"):
        _torch_pin.mode()
    with pytest.raises(ValueError, match=r"AheadCopy\(depth=0\)"):
        _torch_pin.AheadCopy(iter([]), LaterCopier(), depth=0)
    with pytest.raises(ValueError, match=r"AheadCopy\(batches=NoneType, loader_ref=None\): give one of them"):
        _torch_pin.AheadCopy(None, LaterCopier())


def test_the_cuda_copiers_torch_views_of_a_buffer_are_its_leaves_bytes():
    """`host_view` (what CudaCopier copies to the device from), on a torch CPU buffer: each
    leaf's tensor is the buffer's memory at its place, its dtype and shape, bytes equal."""
    torch = pytest.importorskip("torch")
    leaves = [np.arange(12, dtype="float32").reshape(3, 4), np.array([True, False]), np.zeros((0, 2), "int64"),
              np.arange(5, dtype="uint8"), np.arange(6, dtype="int16").reshape(2, 3, 1), np.float64(2.5) * np.ones(())]
    places, nbytes = _torch_pin._places(leaves)
    handle = torch.zeros(nbytes, dtype=torch.uint8)
    copier = _torch_pin._NumpyCopier()
    buffer = _torch_pin._Buffer(handle, handle.numpy())
    for place, leaf in zip(places, leaves):
        copier.view(buffer, *place)[...] = leaf
    for (offset, dtype, shape), leaf in zip(places, leaves):
        view = _torch_pin.host_view(handle, offset, dtype, shape)
        assert offset % 64 == 0 and (view.numel() == 0 or view.data_ptr() == handle.data_ptr() + offset)
        assert tuple(view.shape) == leaf.shape and view.numpy().dtype == leaf.dtype
        assert view.numpy().tobytes() == leaf.tobytes()
