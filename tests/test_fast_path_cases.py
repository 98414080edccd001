"""The fast paths give what the dataset gives when called directly: issue 49's seven
reproducers, each run serially (the dataset called in this process) and through a
`ProcessLoader`, batches compared by value.

The datasets are defined inside the tests, so that cloudpickle sends their classes (and the
globals their methods use) by value, as it does for a class defined in `__main__` or a
notebook cell -- the case users meet.
"""

import time

import numpy as np
import pytest

import kpipe
from conftest import reader_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def _wait_until_loaded(loader, batches, within_s=60.0):
    """Waits until the loader's workers finished `batches` loads, or every load it asked
    for when fewer (what a prefetch did), instead of sleeping a fixed time."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        reader = reader_of(loader)
        with reader.lock:
            reader.backend._pump(0.05)  # takes the workers' messages
            if reader.backend.timings[0] >= min(batches, reader.stats["loads"]) > 1:
                return
    raise AssertionError(f"the workers did not load {batches} batches within {within_s} s")


def test_a_kept_np_stack_result_refilled_with_out_never_changes_a_held_batch(no_leaks):
    class DS:
        def __init__(self):
            self.buf = None

        def __len__(self):
            return 4

        def __getitem__(self, i):
            rows = [np.full((256, 256), i, np.float32) for _ in range(8)]
            if self.buf is None:
                self.buf = np.stack(rows)
            else:
                np.stack(rows, out=self.buf)
            return self.buf

    with kpipe.ProcessLoader(DS(), workers=1, max_queue_size=3) as loader:
        b0 = loader[0]
        _wait_until_loaded(loader, 4)  # the worker refilled its buffer for batches 1-3 meanwhile
        assert float(b0[0, 0, 0]) == 0.0 and float(b0.max()) == 0.0
        b1, b2 = loader[1], loader[2]
        assert float(b1.min()) == float(b1.max()) == 1.0 and float(b2.min()) == float(b2.max()) == 2.0
        assert float(b0.max()) == 0.0
    with kpipe.ProcessLoader(DS(), workers=2, shuffle=True, seed=3) as loader:
        for _ in range(3):
            held = [loader[i] for i in range(4)]
            assert sorted(float(b.min()) for b in held) == [0.0, 1.0, 2.0, 3.0]
            assert all(float(b.min()) == float(b.max()) for b in held)
            loader.on_epoch_end()


def test_a_kept_kpipe_empty_buffer_refilled_each_call_never_changes_a_held_batch(no_leaks):
    class DS:
        def __init__(self):
            self.buf = None

        def __len__(self):
            return 4

        def __getitem__(self, i):
            if self.buf is None:
                self.buf = kpipe.empty((8, 256, 256), np.float32)
            self.buf[...] = i
            return self.buf

    with kpipe.ProcessLoader(DS(), workers=1, max_queue_size=3) as loader:
        held = []
        for p in range(3):
            held += [loader[i] for i in range(4)]
            _wait_until_loaded(loader, 4 * p + 7)  # (the next pass loads ahead: no hook)
            assert [float(b.min()) for b in held] == [0.0, 1.0, 2.0, 3.0] * (p + 1)
            assert [float(b.max()) for b in held] == [0.0, 1.0, 2.0, 3.0] * (p + 1)
            loader.on_epoch_end()


def _run_passes(get, end_pass, passes=2, n=4):
    out = []
    for _ in range(passes):
        row = []
        for i in range(n):
            try:
                row.append(float(get(i)[0, 0, 0]))
            except OSError:
                row.append("error")
        out.append(row)
        end_pass()
    return out


def test_a_cache_filled_before_an_exception_keeps_its_values(no_leaks):
    class DS:
        def __init__(self):
            self.cache, self.failed = {}, False

        def __len__(self):
            return 4

        def __getitem__(self, i):
            if i not in self.cache:
                self.cache[i] = np.stack([np.full((256, 256), i, np.float32) for _ in range(8)])
                if i == 0 and not self.failed:
                    self.failed = True
                    raise OSError("transient")
            return self.cache[i]

    serial = _run_passes(DS().__getitem__, lambda: None)
    assert serial == [["error", 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0]]
    with kpipe.ProcessLoader(DS(), workers=1) as loader:
        got = _run_passes(loader.__getitem__, loader.on_epoch_end, passes=3)
    assert got[:2] == serial and got[2] == serial[1], got
    # two workers: each has its own copy of the dataset (its own first failure), but no
    # batch ever holds another's values
    with kpipe.ProcessLoader(DS(), workers=2) as loader:
        got = _run_passes(loader.__getitem__, loader.on_epoch_end, passes=4)
    assert all(v == i or (v == "error" and i == 0) for row in got for i, v in enumerate(row)), got


def test_np_stack_of_a_generator_does_what_numpy_does(no_leaks):
    class DS:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            try:
                return np.stack(np.full(4, i, np.float32) for _ in range(2))
            except TypeError:
                return np.full((2, 4), -1, np.float32)

    serial = DS()[1].tolist()
    with kpipe.ProcessLoader(DS(), workers=1) as loader:
        assert loader[1].tolist() == serial


OFFSET = {"v": 0}


def test_a_hook_changing_class_attributes_and_globals_sent_by_value_reaches_the_workers(no_leaks):
    class DS:
        scale = 1

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.array([100 * type(self).scale + 10 * OFFSET["v"] + i])

        def on_epoch_end(self):
            type(self).scale += 1
            OFFSET["v"] += 1

    def run(get, hook):
        out = []
        for _ in range(3):
            out.append([int(get(i)[0]) for i in range(2)])
            hook()
        return out

    serial = run(DS().__getitem__, DS().on_epoch_end)
    assert serial == [[100, 101], [210, 211], [320, 321]]
    for ahead in (False, True):
        DS.scale, OFFSET["v"] = 1, 0
        with kpipe.ProcessLoader(DS(), workers=1, epoch_end_ahead=ahead) as loader:
            assert run(loader.__getitem__, loader.on_epoch_end) == serial, ahead


@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("edit", ["attribute", "shared-array", "small-array"])
def test_edits_between_passes_reach_the_workers_with_or_without_a_hook(no_leaks, hook, edit):
    class Plain:
        def __init__(self):
            self.offset = 0
            self.table = np.zeros(1 << 18 if edit == "shared-array" else 16, np.float32)  # 1 MiB: shared

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.array([self.offset + i + float(self.table[3])])

    class Hooked(Plain):
        def on_epoch_end(self):
            pass

    def edit_it(ds):
        if edit == "attribute":
            ds.offset = 100
        else:
            ds.table[3] = 100.0  # in place

    ds = (Hooked if hook else Plain)()
    serial = [float(ds[i][0]) for i in range(2)]
    edit_it(ds)
    serial += [float(ds[i][0]) for i in range(2)]
    assert serial == [0, 1, 100, 101]
    ds = (Hooked if hook else Plain)()
    with kpipe.ProcessLoader(ds, workers=1) as loader:
        got = [float(loader[i][0]) for i in range(2)]
        _wait_until_loaded(loader, 4)  # (without a hook the next pass was loaded ahead)
        edit_it(ds)
        loader.on_epoch_end()
        got += [float(loader[i][0]) for i in range(2)]
    assert got == serial
    # a manual loop that reads passes to their end without calling on_epoch_end
    ds = (Hooked if hook else Plain)()
    with kpipe.ProcessLoader(ds, workers=1) as loader:
        got = [float(loader[i][0]) for i in range(2)]
        _wait_until_loaded(loader, 4)
        edit_it(ds)
        got += [float(loader[i][0]) for i in range(2)]
    assert got == serial


CFG = {"scale": 1}


def test_epoch_end_ahead_leaves_the_users_class_and_globals_alone(no_leaks):
    class DS:
        bias = 0

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.array([i * CFG["scale"] + DS.bias])

        def on_epoch_end(self):
            pass

    getitem, hook = DS.__getitem__, DS.on_epoch_end
    ds = DS()
    with kpipe.ProcessLoader(ds, workers=1, epoch_end_ahead=True) as loader:
        seen = []
        for p in range(3):
            seen.append([int(loader[i][0]) for i in range(2)])
            DS.bias = 100 * (p + 1)
            loader.on_epoch_end()
    assert seen == [[0, 1], [100, 101], [200, 201]]
    assert DS.__getitem__ is getitem and DS.on_epoch_end is hook  # never rebound
    CFG["scale"] = 10
    try:
        assert ds[1].tolist() == [310]
    finally:
        CFG["scale"] = 1


@pytest.mark.parametrize("kind", ["class", "global"])
def test_state_the_workers_cannot_see_is_warned_once(no_leaks, caplog, kind):
    import logging

    import _unsent_datasets as mod

    mod.ClassState.scale, mod.OFFSET["v"] = 1, 0
    dataset = mod.ClassState() if kind == "class" else mod.GlobalState()
    try:
        with caplog.at_level(logging.WARNING, logger="kpipe"):
            with kpipe.ProcessLoader(dataset, workers=1) as loader:
                for _ in range(4):
                    [loader[i] for i in range(2)]
                    loader.on_epoch_end()
    finally:
        mod.ClassState.scale, mod.OFFSET["v"] = 1, 0
    warned = [r.getMessage() for r in caplog.records if "imported from its module" in r.getMessage()]
    assert len(warned) == 1, warned
    assert ("ClassState.scale (a class attribute" if kind == "class" else "_unsent_datasets.OFFSET (a global") in warned[0]


def test_state_sent_by_value_is_not_warned(no_leaks, caplog):
    import logging

    class ByValue:
        scale = 1

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return np.array([100 * self.scale + i])

        def on_epoch_end(self):
            type(self).scale += 1

    with caplog.at_level(logging.WARNING, logger="kpipe"):
        with kpipe.ProcessLoader(ByValue(), workers=1) as loader:
            got = []
            for _ in range(3):
                got.append([int(loader[i][0]) for i in range(2)])
                loader.on_epoch_end()
    assert got == [[100, 101], [200, 201], [300, 301]]
    assert not [r for r in caplog.records if "imported from its module" in r.getMessage()]


def test_slot_reuse_can_be_turned_off(no_leaks, monkeypatch):
    """`KPIPE_REUSE_SLOTS=0`: no batch is ever written into memory another batch used."""
    monkeypatch.setenv("KPIPE_REUSE_SLOTS", "0")

    class DS:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.stack([np.full((256, 256), i, np.float32) for _ in range(8)])

    with kpipe.ProcessLoader(DS(), workers=1) as loader:
        for _ in range(3):
            assert [float(loader[i].max()) for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
            loader.on_epoch_end()
        slots = reader_of(loader).backend._slots
        created = slots._next_id
        loads = loader.stats()["loads"]
    assert created == loads >= 12  # a new slot for every batch loaded


def _scaled(x):  # a helper a dataset's methods call: sent by value with them
    return x * 2


def test_epoch_end_ahead_keeps_passes_of_a_class_sent_by_value(no_leaks):
    """The copy is rebuilt with a class of its own, whose pickle differs from the user's in
    what pickle memoises (interned names): the check compares like with like (`repickled`),
    so a hook that changes only the dataset keeps every pass loaded ahead."""

    class Counts:
        def __init__(self):
            self.epoch = 0

        def __len__(self):
            return 3

        def __getitem__(self, i):
            return _scaled(np.array([self.epoch * 10 + i]))

        def on_epoch_end(self):
            self.epoch += 1

    with kpipe.ProcessLoader(Counts(), workers=2, epoch_end_ahead=True) as loader:
        got = []
        for _ in range(4):
            got.append([int(loader[i][0]) for i in range(3)])
            loader.on_epoch_end()
        ahead = loader.stats()["ahead"]
    assert got == [[0, 2, 4], [20, 22, 24], [40, 42, 44], [60, 62, 64]]
    assert ahead["kept"] >= 3 and ahead["missed"] == 0, ahead
