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


def _outcome(call):
    try:
        got = call()
    except Exception as exc:
        return type(exc), str(exc)
    return got.shape, got.dtype, got.tobytes()


def test_a_generator_gets_what_numpy_gives_it(in_slot):
    arrays = _big()
    got = _outcome(lambda: np.stack(a for a in arrays))
    assert got == _outcome(lambda: _alloc._np_stack(a for a in arrays))
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0":
        assert got[0] is TypeError  # NumPy 2 refuses it


@pytest.mark.parametrize("case", ["dtype", "mixed", "tuple", "casting"])
def test_dtypes_tuples_and_casting_as_numpy(in_slot, case):
    arrays = _big(dtype="float64") if case != "mixed" else _big(2, dtype="int32") + _big(2, dtype="float32")
    kwargs = {"dtype": "float32"} if case in ("dtype", "casting") else {}
    if case == "casting":
        kwargs["casting"] = "same_kind"
    given = tuple(arrays) if case == "tuple" else arrays
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


def _numpys_shape_base_tests():
    import importlib

    for name in ("numpy._core.tests.test_shape_base", "numpy.core.tests.test_shape_base"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip("NumPy's own tests are not installed with this NumPy")


def test_numpys_own_stack_tests_pass_through_the_interception(in_slot, monkeypatch):
    """NumPy's `test_stack` and `test_stack_out_and_dtype`, with every stack (however
    small) intercepted: it accepts, returns and raises what NumPy does."""
    module = _numpys_shape_base_tests()
    monkeypatch.setattr(_alloc, "STACK_MIN_BYTES", 0)
    monkeypatch.setattr(module, "stack", _alloc._stack)  # (their module binds `stack` by name)
    placed = []
    real_empty = in_slot.empty

    def empty(shape, dtype):
        arr = real_empty(shape, dtype)
        placed.append(arr.nbytes)
        return arr

    monkeypatch.setattr(in_slot, "empty", empty)
    module.test_stack()
    cases = 0
    for out_dtype in ("c8", "f4", "f8", ">f8", "i8"):
        for casting in ("no", "equiv", "safe", "same_kind", "unsafe"):
            module.test_stack_out_and_dtype(0, out_dtype, casting)
            cases += 1
    assert cases == 25 and len([n for n in placed if n]) >= 10  # the interception did place results in the slot


def test_the_interception_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("KPIPE_STACK_INTO_SLOT", "0")
    segment = Segment.create(0, "test-stack-off")
    alloc = _alloc.begin(segment)
    try:
        with _alloc.stacking_into():
            got = np.stack(_big())
        assert alloc.offset_of(got) is None and got.flags.owndata
    finally:
        _alloc.end()
        segment.close()
