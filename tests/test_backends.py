"""Every backend passes the same conformance checks (the protocol in
kpipe/_engine/_backend.py): results in any order of asking, discards, errors that keep
their type and name their batch, a new target, close; and a capability a backend lacks
answers with the base class's no-ops. A new backend joins `BACKENDS` (Ray's runs where Ray
is installed: marker `ray`)."""

import numpy as np
import pytest

from _datasets import Failing, Squares
from kpipe._engine._backend import Backend
from kpipe._engine._local import InlineBackend, ThreadBackend
from kpipe._engine._pool import ProcessBackend
from kpipe.errors import LoaderClosedError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _inline(target):
    return InlineBackend(target, mode="dataset", name=type(target).__name__)


def _threads(target):
    return ThreadBackend(target, num_workers=2, mode="dataset", timeout=60.0, seed=0, name=type(target).__name__)


def _processes(target):
    return ProcessBackend(target, num_workers=2, mode="dataset", start_method="forkserver", timeout=60.0, seed=0,
                          name=type(target).__name__, keep_idle=8, keep_payload=True, max_workers=3)


def _ray(target):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'kpipe[ray]')")
    from kpipe._engine._ray import RayBackend
    from kpipe._engine._ray_cluster import RayWorkers

    return RayBackend(target, workers=RayWorkers(2, num_cpus=0.5), timeout=120.0, seed=0, name=type(target).__name__,
                      max_workers=3)


BACKENDS = {"inline": _inline, "threads": _threads, "processes": _processes, "ray": _ray}
CAPABILITIES = ("keeps_copy", "has_slots", "can_send_state", "can_resize", "thread_budget")


@pytest.fixture(scope="module", params=[pytest.param(name, marks=[pytest.mark.ray] if name == "ray" else [])
                                        for name in sorted(BACKENDS)])
def kind(request):
    """A backend's name; for Ray's, one local Ray instance for all its tests, started before
    a test's `no_leaks` looks at this process's children (each RayBackend connects to it and
    leaves it running: starting and stopping one per test took about a third of the time)."""
    if request.param != "ray":
        yield request.param
        return
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kpipe[ray]')")
    # (no idle worker kept: one Ray started for an actor creation cancelled is ended, not pooled)
    ray.init(address="local", num_cpus=2, logging_level="WARNING", log_to_driver=False, include_dashboard=False,
             _system_config={"num_workers_soft_limit": 0})
    try:
        yield request.param
    finally:
        ray.shutdown()


@pytest.fixture
def make(kind):
    from conftest import gone, kpipe_children

    made, before = [], {p.pid for p in kpipe_children()}

    def make(target):
        backend = BACKENDS[kind](target)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.close()
    if kind == "ray":  # (a killed actor's process ends a moment later: then `no_leaks` finds none)
        assert gone([p.pid for p in kpipe_children() if p.pid not in before])


def _equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def test_results_come_for_any_order_of_asking(no_leaks, make):
    ds = Squares(n=6)
    backend = make(ds)
    assert isinstance(backend, Backend) and backend.num_workers in (0, 2)
    seqs = [backend.submit(i) for i in range(6)]
    for i in (3, 0, 5, 1, 2, 4):
        tree, treedef, meta = backend.get(seqs[i])
        assert _equal(tree, ds[i]) and [tuple(s) for _, s in meta] == [(4, 1), (4, 1)]


def test_a_discarded_task_is_forgotten_and_the_rest_arrive(no_leaks, make):
    ds = Squares(n=6)
    backend = make(ds)
    seqs = [backend.submit(i) for i in range(4)]
    backend.discard(seqs[1])
    assert [_equal(backend.get(seqs[i])[0], ds[i]) for i in (0, 2, 3)] == [True] * 3


def test_an_error_keeps_its_type_and_names_its_batch(no_leaks, make):
    backend = make(Failing("raise", bad=2))
    seqs = [backend.submit(i) for i in range(4)]
    with pytest.raises(ValueError, match="cannot decode record 2") as info:
        backend.get(seqs[2])
    assert info.value.kpipe_batch_index == 2
    assert _equal(backend.get(seqs[3])[0], Failing("raise", bad=2)[3])  # the backend stays usable


def test_a_new_target_serves_the_tasks_submitted_after_it(no_leaks, make):
    backend = make(Squares(n=6, batch=4))
    backend.get(backend.submit(1))
    backend.reset_target(Squares(n=6, batch=2))
    tree, _, _ = backend.get(backend.submit(1))
    assert tree[0].shape == (2, 1)


def test_close_is_idempotent_and_refuses_new_work(no_leaks, make):
    backend = make(Squares(n=6))
    backend.get(backend.submit(0))
    backend.close()
    backend.close()
    assert backend.closed
    with pytest.raises(LoaderClosedError):
        backend.submit(1)


def test_capabilities_are_declared_and_absent_ones_are_no_ops(no_leaks, make):
    backend = make(Squares(n=6))
    flags = {name: getattr(backend, name) for name in CAPABILITIES}
    assert all(isinstance(v, bool) for v in flags.values())
    assert len(backend.pids) == (backend.num_workers if flags["keeps_copy"] else 0)  # one per worker process
    if not flags["has_slots"]:
        assert (backend.needs_new_slot(), backend.slots_held(), backend.slot_releases, backend.is_first_use(0)) == (False, 0, 0, False)
        assert (backend.slot_setup_s(), backend.mean_batch_s(), backend.idle_workers(), backend.prepare_slots(9)) == (0.0, 0.0, 0, 0)
    else:
        backend.get(backend.submit(0))
        assert backend.mean_batch_s() > 0 and backend.slots_held() == 0  # the batch was dropped at once
    if not flags["thread_budget"]:
        assert backend.worker_threads is None and backend.thread_pools() == []
    else:
        assert backend.worker_threads >= 1 and len(backend.thread_pools()) == 2
    if flags["keeps_copy"]:
        payload, keys = backend.current_state()
        assert isinstance(payload, bytes) and keys == []


def test_a_state_sent_without_waiting_serves_the_tasks_after_it(no_leaks, make):
    backend = make(Squares(n=6))
    if not backend.can_send_state:
        pytest.skip("this backend does not declare can_send_state")
    before = backend.submit(0)
    payload, keys, _ = backend.dump(Squares(n=6, batch=2))
    backend.send_state(payload, keys)
    after = backend.submit(0)
    assert backend.get(after)[0][0].shape == (2, 1) and backend.get(before)[0][0].shape == (4, 1)


def test_workers_added_and_retired_while_tasks_run(no_leaks, make):
    backend = make(Squares(n=12))
    if not backend.can_resize:
        pytest.skip("this backend does not declare can_resize")
    first = [backend.submit(i) for i in range(4)]
    backend.add_worker(1)
    assert backend.num_workers == 3
    with pytest.raises(ValueError, match="Cannot run more than"):
        backend.add_worker(1)  # (its most workers: 3)
    more = [backend.submit(i) for i in range(4, 8)]
    assert backend.retire_worker() is not None and backend.num_workers == 2
    last = [backend.submit(i) for i in range(8, 12)]
    got = [backend.get(seq)[0] for seq in first + more + last]
    assert all(_equal(g, Squares(n=12)[i]) for i, g in enumerate(got))
    assert backend.retire_worker() is not None and backend.retire_worker() is None  # never the last one
    assert backend.num_workers == 1 and _equal(backend.get(backend.submit(3))[0], Squares(n=12)[3])
