"""ProcessLoader: delivery, order, determinism, structures, state, sharing."""

import numpy as np
import pytest

import kpipe
from _datasets import BigArray, Info, Infinite, MissingValues, Reshuffling, Squares, Structured, serial
from conftest import reader_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

MODES = [
    pytest.param(dict(workers=0), id="inline"),
    pytest.param(dict(workers=1), id="forkserver-1"),
    pytest.param(dict(workers=2), id="forkserver-2"),
    pytest.param(dict(workers=1, start_method="spawn"), id="spawn-1"),
    pytest.param(dict(workers=2, start_method="spawn"), id="spawn-2"),
    pytest.param(dict(workers=2, use_threads=True), id="threads-2"),
]


def equal_batches(a, b):
    fa, fb = _leaves(a), _leaves(b)
    return len(fa) == len(fb) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(fa, fb))


def _leaves(batch):
    from kpipe._engine._tree import flatten

    return flatten(batch)[1]


@pytest.mark.parametrize("kw", MODES)
def test_every_batch_once_per_epoch_equal_to_serial_read(kw, no_leaks):
    ds = Squares(n=10, batch=4, last=3)
    expected = serial(ds)
    with kpipe.ProcessLoader(ds, max_queue_size=3, **kw) as loader:
        assert len(loader) == 10
        for _ in range(2):
            got = [loader[i] for i in range(len(loader))]
            assert all(equal_batches(g, e) for g, e in zip(got, expected))
            loader.on_epoch_end()
        assert loader.stats()["batches"] == 20
        assert loader.stats()["samples"] == 2 * (9 * 4 + 3)


@pytest.mark.parametrize("kw", MODES)
def test_shuffle_is_a_seeded_permutation_independent_of_workers(kw, no_leaks):
    ds = Squares(n=12)
    ref = kpipe.ProcessLoader(ds, workers=0, shuffle=True, seed=7)
    with kpipe.ProcessLoader(ds, shuffle=True, seed=7, **kw) as loader:
        orders = []
        for _ in range(3):
            got = [int(loader[i][0][0, 0]) // 10 for i in range(12)]
            want = [int(ref[i][0][0, 0]) // 10 for i in range(12)]
            assert got == want
            assert sorted(got) == list(range(12))
            orders.append(got)
            loader.on_epoch_end()
            ref.on_epoch_end()
        assert orders[0] != orders[1] != orders[2]


@pytest.mark.parametrize("kw", [dict(workers=2), dict(workers=2, use_threads=True)], ids=["processes", "threads"])
def test_the_next_epoch_loads_ahead_only_without_epoch_hooks(kw, no_leaks):
    ds = Squares(n=6)
    ref = kpipe.ProcessLoader(ds, workers=0, shuffle=True, seed=3)
    with kpipe.ProcessLoader(ds, shuffle=True, seed=3, max_queue_size=4, **kw) as loader:
        for epoch in range(4):
            steps = 4 if epoch == 1 else 6  # epoch 1 is cut short, as steps_per_epoch < len does
            got = [int(loader[i][0][0, 0]) for i in range(steps)]
            assert got == [int(ref[i][0][0, 0]) for i in range(steps)]
            if steps == 6:  # the pass ended with its last batch: the next one is loading
                assert loader.epoch == epoch + 1
                assert reader_of(loader).window.queue and min(reader_of(loader).window.queue) >= (epoch + 1, 0)
            loader.on_epoch_end()  # ends the pass cut short; a no-op after a full one
            ref.on_epoch_end()
            assert loader.epoch == ref.epoch == epoch + 1
    # on_epoch_end may change what the batches hold: nothing of the next pass is loaded
    # before the consumer called the dataset's on_epoch_end (or reads the pass) and its
    # new state reached the workers. kpipe calls no hook itself.
    with kpipe.ProcessLoader(Reshuffling(n=6, big=False), max_queue_size=4, **kw) as loader:
        first = [loader[i] for i in range(5)]
        assert all(k[0] == 0 for k in reader_of(loader).window.queue)
        first.append(loader[5])  # the pass ends; the dataset's hook waits for the consumer
        assert loader.dataset.epochs_seen == 0 and not reader_of(loader).window.queue and loader.epoch == 1
        loader.on_epoch_end()  # runs the hook now; then pass 1 loads
        assert loader.dataset.epochs_seen == 1 and min(reader_of(loader).window.queue) == (1, 0)
        assert all(int(b[1][0]) == 0 for b in first) and int(loader[0][1][0]) == 1


def test_different_seeds_give_different_orders():
    a = kpipe.ProcessLoader(Squares(n=12), workers=0, shuffle=True, seed=1)
    b = kpipe.ProcessLoader(Squares(n=12), workers=0, shuffle=True, seed=2)
    assert [int(a[i][0][0, 0]) for i in range(12)] != [int(b[i][0][0, 0]) for i in range(12)]


def test_random_access_and_rewinds_return_the_right_batch(no_leaks):
    ds = Squares(n=20)
    with kpipe.ProcessLoader(ds, workers=2, max_queue_size=4) as loader:
        for i in [0, 1, 0, 1, 2, 7, 3, 19, 18, 5, 6, 7, 0]:
            assert equal_batches(loader[i], ds[i]), i
        assert equal_batches(loader[-1], ds[19])
        with pytest.raises(IndexError, match="out of range"):
            loader[20]


def test_structures_dtypes_and_variable_shapes(no_leaks):
    ds = Structured()
    with kpipe.ProcessLoader(ds, workers=2) as loader:
        for i in range(len(ds)):
            got, want = loader[i], ds[i]
            assert isinstance(got, tuple) and isinstance(got[0], dict) and isinstance(got[0]["meta"], list)
            assert equal_batches(got, want)
            assert got[0]["meta"][1].dtype == np.bool_


def test_held_batches_never_change_while_loading_continues(no_leaks):
    ds = Squares(n=40)
    with kpipe.ProcessLoader(ds, workers=2, max_queue_size=2) as loader:
        held = [loader[i] for i in range(5)]  # the consumer keeps these (zero-copy views)
        view = loader[5][0][1:]  # a view keeps its batch alive too
        for i in range(6, 40):
            loader[i]
        for i, batch in enumerate(held):
            assert equal_batches(batch, ds[i])
        np.testing.assert_array_equal(view, ds[5][0][1:])
        held[0][0][:] = -1  # batches are writable and private to the consumer
        assert equal_batches(loader[1], ds[1])


def test_worker_info_seeds_and_no_tensorflow_in_workers(no_leaks):
    with kpipe.ProcessLoader(Info(), workers=2, seed=123) as loader:
        rows = [loader[i] for i in range(8)]
    ids = {int(r[0][1]) for r in rows}
    assert ids == {0, 1}
    seeds = {int(r[0][1]): int(r[0][2]) for r in rows}
    assert seeds[0] != seeds[1]
    assert not any(bool(r[1][0]) for r in rows), "a worker imported TensorFlow"
    with kpipe.ProcessLoader(Info(), workers=2, seed=123) as again:
        draws = [int(again[i][2][0]) for i in range(8)]
    assert draws == [int(r[2][0]) for r in rows], "same seed and workers -> same per-worker randomness"
    assert kpipe.worker_info() is None


def test_thread_mode_sets_worker_info():
    with kpipe.ProcessLoader(Info(), workers=2, use_threads=True, seed=5) as loader:
        info = {int(loader[i][0][1]) for i in range(8)}
    assert info <= {0, 1} and info


@pytest.mark.parametrize("kw", [dict(workers=2), dict(workers=2, use_threads=True), dict(workers=0)])
def test_on_epoch_end_state_reaches_workers_before_next_epoch(kw, no_leaks):
    ds = Reshuffling()
    mirror = Reshuffling()
    with kpipe.ProcessLoader(ds, **kw) as loader:
        for epoch in range(3):
            for i in range(len(loader)):
                got = loader[i]
                np.testing.assert_array_equal(got[0], mirror[i][0])
                assert list(got[1]) == [epoch, epoch]
            loader.on_epoch_end()
            mirror.on_epoch_end()
        assert ds.epochs_seen == 3  # on_epoch_end ran in this process


def test_big_arrays_are_shared_once_not_pickled(no_leaks):
    from kpipe._engine import _pickling

    ds = BigArray()
    store = _pickling.SharedArrays()
    payload, keys = _pickling.dumps(ds, store)
    store.close()
    assert len(payload) < 10_000 < ds.data.nbytes and len(keys) == 1
    with kpipe.ProcessLoader(ds, workers=2) as loader:
        for i in range(4):
            chunk, (writeable, total) = loader[i]
            np.testing.assert_array_equal(chunk, ds[i][0])
            assert writeable == 0.0, "shared dataset arrays are read-only in workers"
            assert total == float(ds.data.sum())


@pytest.mark.parametrize("a, b, same", [
    (np.arange(1001, dtype="uint8"), np.arange(1001, dtype="uint8"), True),  # not a multiple of 8 bytes
    (np.array([np.nan, 1.0] * 40, "float32"), np.array([np.nan, 1.0] * 40, "float32"), True),  # NaN: the same bytes
    (np.zeros(80, "float32"), -np.zeros(80, "float32"), False),  # -0.0: equal by value, other bytes
    (np.arange(4000, dtype="int64"), np.concatenate([np.arange(3999), [-1]]).astype("int64"), False),  # the last chunk's last item
    (np.arange(24.0).reshape(6, 4)[:, ::2], np.arange(24.0).reshape(6, 4)[:, ::2].copy(), True),  # a strided view
    (np.arange(24.0).reshape(6, 4)[:, ::2], np.where(np.arange(12).reshape(6, 2) == 11, -1.0, np.arange(24.0).reshape(6, 4)[:, ::2]),
     False),
    (np.zeros((2, 3), "uint8"), np.zeros((3, 2), "uint8"), False),  # shapes differ
    (np.zeros(8, "uint8"), np.zeros(8, "int8"), False),  # dtypes differ
])
def test_same_bytes_compares_bytes_a_chunk_at_a_time(a, b, same, monkeypatch):
    from kpipe._engine import _pickling

    monkeypatch.setattr(_pickling, "_COMPARE_CHUNK_BYTES", 64)  # many chunks
    assert _pickling.same_bytes(a, b) is same
    assert _pickling.same_bytes(b, a) is same


def test_a_pass_end_reads_each_shared_array_once_and_sends_byte_edits_only(monkeypatch, no_leaks):
    # np.array_equal called an array with NaNs changed at every pass end (its copy was
    # rewritten and the state re-sent), and missed an in-place edit of 0.0 to -0.0; the
    # state's fingerprint read every shared array a second time
    from kpipe._engine import _pickling

    compared = []
    real = _pickling.same_bytes
    monkeypatch.setattr(_pickling, "same_bytes", lambda a, b: compared.append(a.nbytes) or real(a, b))
    ds = MissingValues()
    with kpipe.ProcessLoader(ds, workers=2) as loader:
        shared = reader_of(loader).backend.shared
        for epoch in range(4):
            for i in range(len(loader)):
                x, (seen_epoch, index) = loader[i]
                assert (seen_epoch, index) == (epoch, i)
                assert np.isnan(x[0]) and x[1] == 0.0 and np.signbit(x[1]) == (epoch > 0), (epoch, x)
            compared.clear()
            loader.on_epoch_end()
            assert compared == [ds.data.nbytes], f"pass end {epoch}: {compared}"
        assert shared.rewrites == 1  # the -0.0, once; never the NaNs


def test_modules_under_a_site_packages_folder_added_to_sys_path_are_libraries(tmp_path, monkeypatch):
    # A user module that imports Keras is pickled by value (its workers then need no
    # TensorFlow); a library's is not. The library folders are cached per sys.path.
    import sys

    from kpipe._engine import _pickling

    source = "import keras\n\nclass Data(keras.utils.PyDataset):\n    def __len__(self):\n        return 1\n"
    for folder, name in (("mine", "kpipe_test_user_mod"), ("site-packages", "kpipe_test_lib_mod")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / f"{name}.py").write_text(source)
    try:
        monkeypatch.syspath_prepend(str(tmp_path / "mine"))
        import kpipe_test_user_mod as user

        assert _pickling._by_value_modules(user.Data()) == [user]
        assert _pickling._by_value_modules(user.Data()) == [user]  # (cached)
        monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
        import kpipe_test_lib_mod as lib

        assert _pickling._by_value_modules(lib.Data()) == []
        assert _pickling._by_value_modules(user.Data()) == [user]
    finally:
        for name in ("kpipe_test_user_mod", "kpipe_test_lib_mod"):
            sys.modules.pop(name, None)


def test_infinite_dataset_with_steps(no_leaks):
    with kpipe.ProcessLoader(Infinite(), workers=2) as loader:
        assert loader.num_batches is None
        for i in [0, 1, 2, 3, 100]:
            assert loader[i][0][0, 0] == i
        with pytest.raises(TypeError, match="infinite"):
            len(loader)


def test_sharding_splits_each_epoch_disjointly_and_completely():
    n, shards = 14, 3
    for shuffle in (False, True):
        for epoch in range(2):
            seen = []
            for w in range(shards):
                loader = kpipe.ProcessLoader(Squares(n=n), workers=0, shuffle=shuffle, seed=3, num_shards=shards, shard_index=w)
                assert len(loader) == -(-n // shards)  # equal steps on every shard: 5, 5, 5
                for _ in range(epoch):
                    loader.on_epoch_end()
                batches = [loader[i][0] for i in range(len(loader))]
                if w == shards - 1:  # 14 = 3 * 5 - 1: the last shard ends with a pad, no rows
                    assert batches[-1].shape == (0, 1) and batches[-1].dtype == np.float32
                seen += [int(x[0, 0]) // 10 for x in batches if len(x)]
            assert sorted(seen) == list(range(n))


def test_as_dataset_of_a_shard_yields_its_pad_without_rows(no_leaks):
    # 5 batches over 2 shards: shard 1 holds batches 1, 3 and a pad (the last step's).
    with kpipe.ProcessLoader(Squares(n=5), workers=1, num_shards=2, shard_index=1) as loader:
        got = [x.numpy() for x, _ in loader.as_dataset()]
    assert [g.shape for g in got] == [(4, 1), (4, 1), (0, 1)]
    assert [int(g[0, 0]) // 10 for g in got[:2]] == [1, 3]


def test_as_dataset_yields_one_epoch_per_iteration(no_leaks):
    import tensorflow as tf

    ds = Squares(n=5, batch=4, last=2)
    with kpipe.ProcessLoader(ds, workers=2) as loader:
        tfds = loader.as_dataset()
        assert tfds.element_spec[0].shape.as_list() == [None, 1]
        for epoch in range(2):
            got = [x.numpy() for x, _ in tfds]
            assert len(got) == 5 and all(np.array_equal(g, ds[i][0]) for i, g in enumerate(got))
        assert loader.epoch == 2
        assert isinstance(tfds, tf.data.Dataset)


def test_multi_worker_tf_config_shards_by_default(monkeypatch):
    import json

    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    seen = []
    for index in range(2):
        monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        loader = kpipe.ProcessLoader(Squares(n=9), workers=0, shuffle=True, seed=4)
        assert (loader.num_shards, loader.shard_index, len(loader)) == (2, index, 5)
        seen += [int(x[0, 0]) for x in (loader[i][0] for i in range(5)) if len(x)]
        assert len(kpipe.ProcessLoader(Squares(n=9), workers=0, num_shards=1, shard_index=0)) == 9
    assert len(set(seen)) == len(seen) == 9
    with pytest.raises(ValueError, match="needs a `seed`"):
        kpipe.ProcessLoader(Squares(n=9), workers=0, shuffle=True)


def test_max_queue_bytes_limits_batches_in_flight(no_leaks):
    ds = Squares(n=30, batch=256)  # 2 KiB per batch (two float32 leaves of 256)
    # (shuffle=False: the order is known at once, so the window fills as the loader is built)
    with kpipe.ProcessLoader(ds, workers=2, max_queue_size=10, max_queue_bytes=2048 * 3, shuffle=False) as loader:
        assert len(reader_of(loader).window.queue) == 2  # one per worker until a batch size is known
        loader[0]
        assert loader.stats()["queue_depth"] == 3  # 6 KiB / 2 KiB per batch
        for i in range(1, 30):
            assert equal_batches(loader[i], ds[i])
            assert len(reader_of(loader).window.queue) <= 3
    with pytest.raises(ValueError, match="`max_queue_bytes` must be >= 1"):
        kpipe.ProcessLoader(ds, workers=0, max_queue_bytes=0)


@pytest.mark.parametrize("kw", [dict(workers=2), dict(workers=2, use_threads=True)], ids=["processes", "threads"])
def test_queue_deepens_only_when_a_worker_idles_behind_a_slow_batch(kw, no_leaks):
    from _datasets import Stalls

    with kpipe.ProcessLoader(Squares(n=12), max_queue_size=9, shuffle=False, **kw) as loader:  # (fills at once)
        assert loader.stats()["queue_depth"] == 4  # two per worker
        # threads need no slots; processes start one batch per worker, each in a new slot,
        # and take a second slot only once one of them idles (test_slots_are_...)
        assert len(reader_of(loader).window.queue) == (4 if kw.get("use_threads") else 2)
        assert all(equal_batches(loader[i], Squares(n=12)[i]) for i in range(12))
    # Every 4th batch takes 0.3 s: the other worker finishes its two batches and idles
    # while the consumer waits, so the loader allows more in flight -- up to the bound.
    with kpipe.ProcessLoader(Stalls(n=16, every=4, stall_s=0.3), max_queue_size=9, **kw) as loader:
        got = []
        for i in range(16):
            got.append(int(loader[i][0, 0]))
            assert len(reader_of(loader).window.queue) <= 9
        assert got == list(range(16))
        assert 4 < loader.stats()["queue_depth"] <= 9


def test_slot_pool_prefers_the_slots_a_worker_already_maps():
    from kpipe._engine._shm import SlotPool

    pool = SlotPool(keep_idle=8)
    try:
        a, b, c = (pool.acquire()[0] for _ in range(3))
        for slot in (a, b, c):
            pool.release(slot)
        assert pool.acquire(prefer={a})[0] == a  # not the most recently freed (c)
        assert pool.acquire(prefer={42})[0] == c  # none preferred is free: the newest
        assert pool.acquire()[0] == b
        assert pool.acquire() == (3, True)  # none free: a new slot
    finally:
        pool.close()


def test_writer_mappings_are_populated_up_front():
    import mmap
    import resource

    from kpipe._engine import _shm

    try:
        mmap.mmap(-1, mmap.PAGESIZE).madvise(_shm._MADV_POPULATE_WRITE)
    except (OSError, TypeError):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux >= 5.14)")
    seg = _shm.Segment.create(0)
    try:
        seg.reserve(32 << 20)  # as a worker does before writing a batch
        view = np.frombuffer(seg.mapping, dtype=np.uint8)[: 32 << 20]  # (the rest is headroom)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        view[:: mmap.PAGESIZE] = 1  # one write per page: 8192 pages
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < 500, f"{faults} page faults writing a populated 32 MiB slot"
    finally:
        del view
        seg.close()


def test_a_later_writer_maps_the_existing_pages_writable_up_front():
    """A worker writing a slot another one filled populates it with read faults (16
    pages each); the pages must then take its writes without faulting again."""
    import mmap
    import os
    import resource

    from kpipe._engine import _shm

    try:
        mmap.mmap(-1, mmap.PAGESIZE).madvise(_shm._MADV_POPULATE_READ)
    except (OSError, TypeError):
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux >= 5.14)")
    first = _shm.Segment.create(0)
    second = _shm.Segment(os.dup(first.fd))
    try:
        first.reserve(32 << 20)
        first.mapping[: 32 << 20] = 7  # the first worker's batch
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        second.reserve(32 << 20)  # the next worker to get this slot
        populate = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        view = np.frombuffer(second.mapping, dtype=np.uint8)[: 32 << 20]
        assert int(view[:: mmap.PAGESIZE].min()) == 7  # the same pages, not new ones
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        view[:: mmap.PAGESIZE] = 1  # one write per page: 8192 pages
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        assert faults < 500, f"{faults} page faults writing a slot populated for reading ({populate} while populating)"
        assert int(first.mapping[: 32 << 20 : mmap.PAGESIZE].max()) == 1  # shared, not copied
    finally:
        del view
        first.close()
        second.close()


def test_the_process_that_grows_a_slot_allocates_the_reserved_pages_only(monkeypatch):
    import os

    from kpipe._engine import _shm

    if _shm._fallocate is None:
        pytest.skip("this Python has no os.posix_fallocate")
    monkeypatch.setattr(_shm, "_MADV_POPULATE_WRITE", None)  # so that only fallocate allocates
    monkeypatch.setattr(_shm, "_MADV_POPULATE_READ", None)
    first = _shm.Segment.create(0)
    second = _shm.Segment(os.dup(first.fd))
    try:
        first.reserve(8 << 20)
        allocated = os.fstat(first.fd).st_blocks * 512
        assert first.size > 8 << 20  # with headroom ...
        assert 8 << 20 <= allocated < first.size  # ... that stays unallocated until written
        second.reserve(first.size)  # a later writer does not grow it, so allocates nothing
        assert os.fstat(first.fd).st_blocks * 512 == allocated
        size = first.size
        second.reserve(size + 1)  # but one that grows it allocates all it reserved
        assert size < os.fstat(first.fd).st_blocks * 512 < first.size
    finally:
        first.close()
        second.close()


def test_a_task_goes_to_an_idle_worker_that_has_mapped_a_free_slot(no_leaks):
    from kpipe._engine._pool import ProcessBackend

    backend = ProcessBackend(Squares(n=8), num_workers=2, mode="dataset", start_method="forkserver",
                             timeout=60.0, seed=0, name="Squares", keep_idle=8)
    try:
        first = backend.submit(0)
        writer = backend._tasks[first].worker
        backend.get(first)  # dropped at once: its slot is free again, mapped by `writer` only
        second = backend.submit(1)  # both workers idle: round-robin alone would pick the other
        assert backend._tasks[second].worker is writer and not backend._tasks[second].fresh
        third = backend.submit(2)  # `writer` is busy now: the other one, in a new slot
        assert backend._tasks[third].worker is not writer and backend._tasks[third].fresh
        assert [int(backend.get(s)[0][0].flat[0]) for s in (second, third)] == [10, 20]
    finally:
        backend.close()


def test_a_worker_idle_behind_a_slots_first_use_prepares_a_slot_instead_of_deepening(no_leaks):
    from _datasets import Stalls

    # Batches 0 and 4 take 0.3 s. Batch 0 is also its worker's first use of its slot (a
    # delay that does not recur): the other worker loads 1, 2 and 3 meanwhile, then idles.
    with kpipe.ProcessLoader(Stalls(n=8, every=4, stall_s=0.3), workers=2, max_queue_size=9) as loader:
        backend = reader_of(loader).backend
        assert int(loader[0][0, 0]) == 0
        assert loader.stats()["queue_depth"] == 4  # not deepened ...
        assert len(backend._slots) == 5  # ... the idle worker made the slot the window needs,
        assert not backend.is_first_use(reader_of(loader).window.queue[(0, 4)].seq)  # and batch 4 is not a first use
        # batch 4 is slow again, in a slot its worker has written before: deepening helps
        assert [int(loader[i][0, 0]) for i in range(1, 8)] == list(range(1, 8))
        assert loader.stats()["queue_depth"] > 4


def test_setup_seconds_count_what_reserve_set_up_and_nothing_else():
    import os

    from kpipe._engine import _shm

    first = _shm.Segment.create(0)
    second = _shm.Segment(os.dup(first.fd))
    try:
        before = _shm.setup_seconds()
        first.reserve(8 << 20)  # grown, mapped, allocated and paged in: a new slot
        grown = _shm.setup_seconds()
        assert grown > before
        first.reserve(8 << 20)  # the same size again, as each later batch in this slot
        first.reserve(1 << 20)
        assert _shm.setup_seconds() == grown  # nothing to do, nothing counted
        second.reserve(8 << 20)  # another process's first use of the slot: mapped and paged in
        assert _shm.setup_seconds() > grown
    finally:
        first.close()
        second.close()


def test_workers_report_what_a_new_slot_cost_them(no_leaks):
    from _datasets import Sized

    from kpipe._engine._pool import ProcessBackend

    backend = ProcessBackend(Sized(n=4, nbytes=4 << 20), num_workers=1, mode="dataset", start_method="forkserver",
                             timeout=60.0, seed=0, name="Sized", keep_idle=8)
    try:
        assert backend.slot_setup_s() == 0.0  # nothing measured yet
        backend.get(backend.submit(0))  # dropped at once: its slot is free again
        seconds, nbytes = backend._setup
        assert seconds > 0 and nbytes >= 4 << 20  # the new slot's set-up, as the worker timed it
        assert backend.slot_setup_s(8 << 20) == pytest.approx(2 * backend.slot_setup_s(4 << 20))
        backend.get(backend.submit(1))  # the same slot, the same size: nothing to set up
        assert backend._setup == [seconds, nbytes]
        assert backend.mean_batch_s() > 0
    finally:
        backend.close()


@pytest.mark.parametrize("price_s,deepens", [(0.35, True), (100.0, False)], ids=["idle-pays-for-slots", "slots-too-dear"])
def test_the_window_deepens_only_once_workers_idled_longer_than_its_new_slots_cost(price_s, deepens, no_leaks):
    """Rent before buying: each batch in flight holds a slot, and a new slot costs its
    worker a one-time set-up, so the window deepens only once workers have idled behind
    slow batches for longer than the slots it would add cost (see kpipe/_engine/_window.py: deepen, Window.starved)."""
    from _datasets import Stalls

    # Every 4th batch takes 0.5 s: the other worker idles behind it for about that long.
    with kpipe.ProcessLoader(Stalls(n=32, every=4, stall_s=0.5), workers=2, max_queue_size=9) as loader:
        backend = reader_of(loader).backend
        backend.slot_setup_s = lambda nbytes=None: price_s  # a slot of this price: 2 workers x price_s per step
        got = [int(loader[i][0, 0]) for i in range(8)]  # two stalls: 0 (a first use, never counted) and 4
        assert loader.stats()["queue_depth"] == 4  # one wait behind a slow batch (<= 0.5 s) pays for neither
        assert reader_of(loader).window.idle_behind_s <= 0.6  # (0 if batch 4 was its worker's first use of its slot)
        got += [int(loader[i][0, 0]) for i in range(8, 32)]
        assert got == list(range(32))
        if deepens:  # 7 more waits of ~0.5 s: from the second one counted on, the idle time paid for 0.7 s
            assert loader.stats()["queue_depth"] > 4
        else:
            assert loader.stats()["queue_depth"] == 4
            assert reader_of(loader).window.idle_behind_s > 0.7  # idle behind slow batches, though not enough to buy slots
            assert len(backend._slots) <= 5  # the window's 4, and the one the consumer holds


def test_slots_are_made_for_idle_workers_only(no_leaks):
    """A consumer that holds its previous batch while it reads the next one: every batch
    in flight has a slot, plus the one it holds -- never one more (a slot for a batch that
    would only queue behind a busy worker waits for the consumer to release one)."""
    with kpipe.ProcessLoader(Squares(n=40), workers=2) as loader:
        slots = reader_of(loader).backend._slots
        for epoch in range(3):
            for i in range(len(loader)):
                x, y = loader[i]  # the previous x, y are dropped only now
                assert len(slots) <= loader.stats()["queue_depth"] + 1
                assert equal_batches((x, y), Squares(n=40)[i])
            loader.on_epoch_end()


def test_set_epoch_replays_the_plan_of_that_epoch(no_leaks):
    ds = Squares(n=10)
    with kpipe.ProcessLoader(ds, workers=2, shuffle=True, seed=9) as a, kpipe.ProcessLoader(ds, workers=1, shuffle=True, seed=9) as b:
        for _ in range(3):
            [a[i] for i in range(10)]
            a.on_epoch_end()
        b.set_epoch(3)
        assert [int(a[i][0][0, 0]) for i in range(10)] == [int(b[i][0][0, 0]) for i in range(10)]


@pytest.mark.parametrize("kw", MODES)
def test_arrays_from_kpipe_empty_are_handed_over_intact(kw, no_leaks):
    from _datasets import InSlot

    ds = InSlot()
    with kpipe.ProcessLoader(ds, **kw) as loader:
        for i in range(len(ds)):
            assert equal_batches(loader[i], ds[i])


def test_slot_allocator_finds_arrays_in_the_slot_only():
    from kpipe._engine import _alloc
    from kpipe._engine._shm import Segment

    seg = Segment.create(0)
    alloc = _alloc.begin(seg)
    try:
        a = kpipe.empty((10, 10), "float32")
        b = kpipe.empty(1 << 20, "uint8")  # grows (and remaps) the slot
        assert alloc.offset_of(a) == 0 and alloc.offset_of(b) == 448  # 400 bytes, 64-aligned
        assert alloc.offset_of(a[3]) == 3 * 40
        assert alloc.offset_of(a[:, ::2]) is None  # not contiguous: copied instead
        assert alloc.offset_of(np.zeros(3)) is None
    finally:
        _alloc.end()
        seg.close()
    assert type(kpipe.empty(3)) is np.ndarray and kpipe.empty(3).dtype == np.float32


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_workers_run_with_glibc_keeping_freed_buffers_for_reuse(start_method, no_leaks):
    from _datasets import MallocEnv

    with kpipe.ProcessLoader(MallocEnv(), workers=1, start_method=start_method) as loader:
        flags = loader[0]
    assert flags.tolist() == [True, True, True]  # mmap threshold, trim threshold, and no mmap for big buffers


_COLLECTOR_UNDER_THE_LOCK = """
import gc
from kpipe._engine._shm import SlotPool

pool = SlotPool(keep_idle=4)
slot, _ = pool.acquire()

class Collecting(list):  # the collector runs while the pool's lock is held, as any allocation there may make it
    def __iter__(self):
        gc.collect()
        return super().__iter__()

pool._free = Collecting(pool._free)
gc.disable()

class Holder:
    pass

h = Holder()
h.me, h.lease = h, pool.lease(slot)  # a batch's lease in a cycle: only the collector frees it
del h
print(sorted(pool.free_ids()), pool.lease_releases)
"""


def test_a_lease_the_collector_releases_inside_the_slot_pool_does_not_deadlock_it():
    # Seen once in a fresh-clone run: a collection inside `free_ids()` freed an exception's
    # frames holding a batch, whose lease took the pool's (then non-re-entrant) lock again.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _COLLECTOR_UNDER_THE_LOCK], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[0]", "1"]  # released inside the call, and counted once
