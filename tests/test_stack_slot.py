"""Big `np.stack` results built in a worker's shared-memory slot (the NOTE in
kpipe/_engine/_alloc.py): the same arrays as NumPy's, no copy, and slots a dataset keeps
memory of are never reused."""

import numpy as np
import pytest

import kpipe
from _datasets import Stacked
from kpipe._engine import _alloc
from kpipe._engine._shm import Segment


@pytest.fixture
def in_slot():
    """`numpy.stack` as it is inside a worker's `__getitem__`, over a fresh segment."""
    segment = Segment.create(0, "test-stack")
    alloc = _alloc.begin(segment)
    try:
        with _alloc.stacking_into():
            yield alloc
    finally:
        _alloc.end()
        segment.close()


def _big(n=4, shape=(256, 300), dtype="float32", start=0):
    return [np.full(shape, start + k, dtype) for k in range(n)]


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_big_stacks_land_in_the_slot_and_equal_numpy(in_slot, axis):
    arrays = _big()
    got = np.stack(arrays, axis=axis)
    want = _alloc._np_stack(arrays, axis=axis)
    assert in_slot.offset_of(got) is not None and not got.flags.owndata
    assert got.shape == want.shape and got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize("case", ["dtype", "mixed", "generator", "casting"])
def test_dtypes_generators_and_casting_as_numpy(in_slot, case):
    arrays = _big(dtype="float64") if case != "mixed" else _big(2, dtype="int32") + _big(2, dtype="float32")
    kwargs = {"dtype": "float32"} if case in ("dtype", "casting") else {}
    if case == "casting":
        kwargs["casting"] = "same_kind"
    given = (a for a in arrays) if case == "generator" else arrays
    got = np.stack(given, **kwargs)
    want = _alloc._np_stack(arrays, **kwargs)
    assert in_slot.offset_of(got) is not None
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_what_is_not_a_big_plain_stack_is_numpys_own(in_slot):
    small = np.stack([np.zeros(10), np.ones(10)])
    assert small.flags.owndata  # under STACK_MIN_BYTES
    out = np.empty((4, 256, 300), "float32")
    assert np.stack(_big(), out=out) is out  # the caller's `out=`
    masked = np.stack([np.ma.masked_array(a) for a in _big()])
    assert isinstance(masked, np.ma.MaskedArray)  # subclasses dispatch as NumPy does
    objects = np.stack([np.full((300, 600), None, object)] * 2)
    assert objects.dtype == object and objects.flags.owndata
    with pytest.raises(ValueError, match="all input arrays must have the same shape"):
        np.stack([np.zeros((512, 512)), np.zeros((512, 511))])
    with pytest.raises(ValueError, match="need at least one array to stack"):
        np.stack([])
    with pytest.raises(np.exceptions.AxisError if hasattr(np, "exceptions") else np.AxisError):
        np.stack(_big(), axis=5)


def test_outside_a_task_numpy_stack_is_untouched():
    assert np.stack is _alloc._np_stack
    with _alloc.stacking_into():
        assert np.stack(_big()).flags.owndata  # no current slot
    assert np.stack is _alloc._np_stack


def test_other_threads_of_a_dataset_get_numpys_own_memory(in_slot):
    import threading

    got = {}

    def work():
        got["stack"] = np.stack(_big())
        got["empty"] = kpipe.empty((1 << 20,), "uint8")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    assert in_slot.offset_of(got["stack"]) is None and got["stack"].flags.owndata
    assert in_slot.offset_of(got["empty"]) is None and in_slot.used == 0  # the task's slot untouched
    assert in_slot.offset_of(np.stack(_big())) is not None  # (the task's own thread still does)


def test_kept_sees_arrays_and_views_that_outlive_the_task(in_slot):
    x = np.stack(_big())
    view = x[1:, ::3]
    del x
    assert in_slot.kept()  # the view still references the slot's memory
    del view
    assert not in_slot.kept()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_workers_build_np_stack_batches_in_their_slots(no_leaks):
    with kpipe.ProcessLoader(Stacked(n=6), workers=2) as loader:
        got = [loader[i] for _ in range(2) for i in range(6)]
    with kpipe.ProcessLoader(Stacked(n=6), workers=0) as loader:
        want = [loader[i] for i in range(6)] * 2
    for (x, report), (wx, wreport) in zip(got, want):
        assert np.array_equal(x, wx)
        assert report[0] == 0 and wreport[0] == 1  # placed in the slot by workers; NumPy's own inline


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("keep", ["array", "view", "empty"])
def test_a_dataset_keeping_slot_memory_never_sees_it_overwritten(no_leaks, keep):
    with kpipe.ProcessLoader(Stacked(n=6, keep=keep), workers=1) as loader:
        reports = []
        for _ in range(4):  # each batch dropped at once: free slots are reused pass after pass
            reports += [loader[i][1].tolist() for i in range(6)]
            loader.on_epoch_end()
    assert all(intact for _, intact, _ in reports), reports
    assert reports[-1][2] == 6  # it kept one per batch index
