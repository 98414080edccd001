"""`ProcessLoader(dataset, workers=kpipe.RayWorkers(...))`: loader workers as Ray actors
(kpipe/_engine/_ray.py), on a real multi-node Ray cluster started on this machine
(`ray.cluster_utils.Cluster`: a head node and two nodes with a "preprocess" resource), one
per module (Ray's start-up is slow on 2 cores). Compared with the same loader's local
workers and with plain Keras; actors killed and a node removed mid-pass; states restored
across backends; nothing left running."""

import os
import signal
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kpipe[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

import kpipe  # noqa: E402
from _ahead_datasets import Reshuffles  # noqa: E402
from _datasets import Failing, InSlot, MallocEnv, Squares, Stalls, Versioned  # noqa: E402
from conftest import reader_of  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.multiprocess, pytest.mark.timeout(300)]
TAGGED = {"preprocess": 1}  # actors on the two other nodes: batches through the object store
HERE = {"trainer": 1}  # actors on this process's node: batches in shared-memory slots


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"trainer": 2}})
    nodes = [cluster.add_node(num_cpus=2, resources={"preprocess": 2}) for _ in range(2)]
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


def _ids(batch):
    return int(batch[0][0, 0]) // 10  # Squares: batch i holds i*10 + arange


def _reference(n, passes, **kw):
    with kpipe.ProcessLoader(Squares(n=n), workers=0, **kw) as loader:
        return [_ids(loader[i]) for _ in range(passes) for i in range(n)]


def test_actors_run_on_the_tagged_nodes_and_load_what_local_workers_load(cluster):
    _, nodes = cluster
    with kpipe.ProcessLoader(Squares(n=9), workers=kpipe.RayWorkers(3, resources=TAGGED), shuffle=True, seed=4) as loader:
        backend = reader_of(loader).backend
        assert set(backend.nodes()) <= {node.node_id for node in nodes}  # never on the head node
        assert len(loader.stats()["pids"]) == 3
        got = [_ids(loader[i]) for _ in range(3) for i in range(9)]
    assert got == _reference(9, 3, shuffle=True, seed=4)


def test_fit_takes_the_batches_plain_keras_takes(cluster):
    import keras

    def model():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        m.compile(keras.optimizers.SGD(1e-4), "mse")
        return m

    class Plain(keras.utils.PyDataset):  # the same batches, for plain Keras
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return Squares(n=6)[i]

    want = model()
    want.fit(Plain(), epochs=2, shuffle=False, verbose=0)
    got = model()
    with kpipe.ProcessLoader(Squares(n=6), workers=kpipe.RayWorkers(2)) as loader:
        got.fit(loader, epochs=2, verbose=0, shuffle=False)  # (the loader follows fit's shuffle)
        assert loader.stats()["loads"] == 12  # each batch once per epoch
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def _small_model():
    import keras

    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    m.compile(keras.optimizers.SGD(1e-4), "mse")
    return m


def test_fit_shuffle_through_actors_trains_as_loading_in_process(cluster):
    # shuffle=None follows fit(shuffle=True): the same seeded permutations through actors
    weights, shuffled = [], []
    for workers in (0, kpipe.RayWorkers(2)):
        model = _small_model()
        with kpipe.ProcessLoader(Squares(n=6), workers=workers) as loader:
            model.fit(loader, epochs=2, verbose=0)
            shuffled.append(reader_of(loader).state_after((1, 0), 0)["shuffle"])
        weights.append(model.get_weights())
    assert shuffled == [True, True]
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def _fit(workers, *, steps=None, shuffle=False, epochs=3, callbacks=()):
    """Final weights and loads of `fit` on a 6-batch Squares loader with `workers`."""
    model = _small_model()
    with kpipe.ProcessLoader(Squares(n=6), workers=workers, shuffle=shuffle, seed=9) as loader:
        model.fit(loader, epochs=epochs, steps_per_epoch=steps, verbose=0,
                  callbacks=[c(loader) for c in callbacks])
        loads = loader.stats()["loads"]
    return model.get_weights(), loads


@pytest.mark.parametrize("steps", [None, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_fit_with_or_without_steps_per_epoch_trains_and_loads_as_local_workers(cluster, steps, shuffle):
    want, want_loads = _fit(2, steps=steps, shuffle=shuffle)
    got, loads = _fit(kpipe.RayWorkers(2, resources=TAGGED), steps=steps, shuffle=shuffle)
    assert loads == want_loads  # the same bounded loads: nothing past the last step
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_an_actor_killed_during_fit_changes_no_weight(cluster):
    import keras

    class KillOnce(keras.callbacks.Callback):
        def __init__(self, loader):
            super().__init__()
            self.loader, self.killed = loader, None

        def on_train_batch_end(self, batch, logs=None):
            if batch == 2 and self.killed is None:  # mid-epoch, with batches queued on it
                self.killed = self.loader.stats()["pids"][0]
                os.kill(self.killed, signal.SIGKILL)

    want, _ = _fit(kpipe.RayWorkers(2, resources=TAGGED), shuffle=True)
    got, _ = _fit(kpipe.RayWorkers(2, resources=TAGGED), shuffle=True, callbacks=[KillOnce])
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("where", ["other nodes", "this node"])
def test_a_killed_actor_is_replaced_and_every_batch_arrives_once_in_order(cluster, where):
    spec = kpipe.RayWorkers(2, resources=TAGGED) if where == "other nodes" else kpipe.RayWorkers(2, num_cpus=0.5, resources=HERE)
    with kpipe.ProcessLoader(Squares(n=12), workers=spec, shuffle=True, seed=7) as loader:
        held = loader[0]
        got = [_ids(held)] + [_ids(loader[i]) for i in range(1, 3)]
        pids = loader.stats()["pids"]
        os.kill(pids[0], signal.SIGKILL)  # mid-pass, with batches queued on it
        got += [_ids(loader[i]) for i in range(3, 12)]
        got += [_ids(loader[i]) for i in range(12)]
        assert loader.stats()["pids"][0] != pids[0]
        assert _ids(held) == got[0]  # a batch held across its actor's death is intact
    assert got == _reference(12, 2, shuffle=True, seed=7)


def test_actors_on_this_node_hand_batches_over_in_shared_memory_slots_they_reuse(cluster):
    with kpipe.ProcessLoader(Squares(n=8), workers=kpipe.RayWorkers(2, num_cpus=0.5, resources=HERE),
                             shuffle=True, seed=6) as loader:
        backend = reader_of(loader).backend
        held = [loader[i] for i in range(8)]  # a whole pass held at once: 8 slots
        assert backend.slots_reachable and backend.local_slots() >= 8
        assert all(b[0].flags.writeable for b in held)  # (object-store arrays are read-only)
        got = [_ids(b) for b in held]
        del held
        for _ in range(3):  # one batch held at a time: the released slots are reused
            loader.on_epoch_end()
            got += [_ids(loader[i]) for i in range(8)]
        slots = backend.local_slots()
    assert got == _reference(8, 4, shuffle=True, seed=6)
    assert slots <= 8 + loader.max_queue_size  # the held pass and what was in flight, not 8 more per pass


def test_a_slot_this_process_cannot_open_falls_back_to_the_object_store(cluster, monkeypatch, caplog):
    import logging

    real_open = os.open

    def no_proc(path, *args, **kwargs):
        if str(path).startswith("/proc/"):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, *args, **kwargs)

    caplog.set_level(logging.WARNING, logger="kpipe")
    monkeypatch.setattr(os, "open", no_proc)
    with kpipe.ProcessLoader(Squares(n=6), workers=kpipe.RayWorkers(2, num_cpus=0.5, resources=HERE)) as loader:
        got = [_ids(loader[i]) for i in range(6)] + [_ids(loader[i]) for i in range(6)]
        backend = reader_of(loader).backend
        assert not backend.slots_reachable and backend.local_slots() == 0
    assert got == list(range(6)) * 2
    assert sum("cannot open the shared memory" in r.getMessage() for r in caplog.records) == 1  # said once


def test_a_removed_node_moves_its_actors_and_loading_goes_on(cluster):
    ray_cluster, _ = cluster
    movers = [ray_cluster.add_node(num_cpus=1, resources={"mover": 2}) for _ in range(2)]
    try:
        with kpipe.ProcessLoader(Squares(n=10), workers=kpipe.RayWorkers(2, num_cpus=0.5, resources={"mover": 1}),
                                 shuffle=True, seed=1) as loader:
            got = [_ids(loader[i]) for i in range(2)]
            backend = reader_of(loader).backend
            victim = next(n for n in movers if n.node_id == backend.nodes()[0])
            ray_cluster.remove_node(victim)  # mid-pass: its actors and their queued batches are lost
            movers.remove(victim)
            got += [_ids(loader[i]) for i in range(2, 10)] + [_ids(loader[i]) for i in range(10)]
            assert set(backend.nodes()) == {movers[0].node_id}
        assert got == _reference(10, 2, shuffle=True, seed=1)
    finally:
        for node in movers:
            ray_cluster.remove_node(node)


def test_a_state_saved_with_local_workers_restores_on_ray_and_back(cluster):
    full = _reference(8, 2, shuffle=True, seed=3)
    with kpipe.ProcessLoader(Squares(n=8), workers=2, shuffle=True, seed=3) as local:
        got = [_ids(local[i]) for i in range(5)]
        state = local.state()
    with kpipe.ProcessLoader(Squares(n=8), workers=kpipe.RayWorkers(2), shuffle=True, seed=3) as remote:
        remote.restore(state)
        got += [_ids(remote[i]) for i in range(5, 8)] + [_ids(remote[i]) for i in range(3)]
        state = remote.state()
    with kpipe.ProcessLoader(Squares(n=8), workers=0, shuffle=True, seed=3) as local:
        local.restore(state)
        got += [_ids(local[i]) for i in range(3, 8)]
    assert got == full


def _passes(loader, passes):
    """Every batch of `passes` passes as lists, with `on_epoch_end()` after each (a manual loop)."""
    out = []
    for _ in range(passes):
        out += [loader[i].tolist() for i in range(len(loader))]
        loader.on_epoch_end()
    return out


@pytest.mark.parametrize("shuffle", [False, True])
def test_epoch_end_ahead_on_actors_loads_what_local_workers_load(cluster, shuffle):
    with kpipe.ProcessLoader(Reshuffles(n=6), workers=2, seed=5, shuffle=shuffle) as local:
        want = _passes(local, 4)
    with kpipe.ProcessLoader(Reshuffles(n=6), workers=kpipe.RayWorkers(2), seed=5, shuffle=shuffle,
                             epoch_end_ahead=True) as remote:
        got = _passes(remote, 4)
        ahead = remote.stats()["ahead"]
    assert got == want
    assert [row[0] for row in got] == [p for p in range(4) for _ in range(6)]  # each pass after its hook
    assert ahead["kept"] >= 3 and ahead["missed"] == ahead["skipped"] == 0 and ahead["off"] is None


def test_a_replaced_actor_loads_each_batch_under_the_state_it_was_submitted_under(cluster, tmp_path):
    from kpipe._engine._ray import RayBackend

    gate = str(tmp_path / "gate")
    backend = RayBackend(Versioned(0, gate), workers=kpipe.RayWorkers(1), timeout=120, seed=0, name="versioned")
    try:
        seqs = [backend.submit(0), backend.submit(1)]
        backend.send_state(*backend.dump(Versioned(1, gate))[:2])  # queued behind them, not waited for
        seqs += [backend.submit(2), backend.submit(3)]
        deadline = time.monotonic() + 60
        while not os.path.exists(gate + ".inside") and time.monotonic() < deadline:  # batch 0 is loading
            time.sleep(0.01)
        victim = backend.pids[0]
        os.kill(victim, signal.SIGKILL)  # four tasks pending, under two states
        open(gate, "w").close()
        got = [int(backend.get(seq)[0][0]) for seq in seqs]
        assert backend.pids[0] != victim
        assert got == [0, 1, 102, 103]
        backend.submit(0)  # the replacement ends on the newest state
        assert int(backend.get(4)[0][0]) == 100
    finally:
        backend.close()


def test_each_actor_limits_its_thread_pools_to_its_cpus(cluster):
    for num_cpus, threads, want in ((1, None, 1), (0.5, None, 1), (1, 2, 2)):
        with kpipe.ProcessLoader(Squares(n=4), workers=kpipe.RayWorkers(2, num_cpus=num_cpus),
                                 worker_threads=threads) as loader:
            loader[0]
            stats = loader.stats()
        assert stats["worker_threads"] == want
        reports = stats["worker_thread_pools"]
        assert [r["worker"] for r in reports] == [0, 1] and [r["pid"] for r in reports] == stats["pids"]
        assert all(r["threads"] == want and r["not_limited"] == [] for r in reports), reports
        assert all(p["threads"] <= want for r in reports for p in r["pools"]), reports


def test_as_dataset_and_the_profiler_read_actors_like_local_workers(cluster):
    import keras

    from kpipe.callbacks import InputProfiler

    with kpipe.ProcessLoader(Squares(n=5), workers=kpipe.RayWorkers(2), shuffle=True, seed=2) as loader:
        got = [_ids(batch) for _ in range(2) for batch in loader.as_dataset().as_numpy_iterator()]
    assert got == _reference(5, 2, shuffle=True, seed=2)

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    profiler = InputProfiler(warn_above=None)
    with kpipe.ProcessLoader(Squares(n=10, batch=4, last=3), workers=kpipe.RayWorkers(2)) as loader:
        history = model.fit(loader, epochs=2, verbose=0, callbacks=[profiler])
        assert loader.stats()["loads"] == 20
    assert len(history.history["samples_per_sec"]) == 2
    assert profiler.epochs[1]["steps"] == 10 and profiler.epochs[1]["samples"] == 39


def test_auto_adds_actors_up_to_what_the_cluster_places_and_retires_them_when_the_consumer_slows(cluster):
    from conftest import gone

    _, nodes = cluster
    n = 40
    with kpipe.ProcessLoader(Stalls(n=n, every=1, stall_s=0.03), workers=kpipe.RayWorkers("auto", resources=TAGGED)) as loader:
        backend = reader_of(loader).backend
        assert backend.capacity() == (4.0, 4)  # 2 nodes x {"preprocess": 2, CPU: 2}; the head has no "preprocess"
        assert loader.num_workers == 2 and loader.stats()["cpu_limit"] == 4.0

        def decided(grew):
            return [d for d in loader.stats()["auto_decisions"] if (d["workers_to"] > d["workers_from"]) == grew]

        got, want, seen, pause, deadline = [], [], set(), 0.0, time.monotonic() + 120
        while not (decided(True) and decided(False)) and time.monotonic() < deadline:
            for i in range(n):  # I/O-bound batches: a fast consumer waits, then a slow one does not
                got.append(int(loader[i][0, 0]))
                want.append(i)
                time.sleep(pause)
            loader.on_epoch_end()
            seen |= set(loader.stats()["pids"])
            if decided(True) and len(loader.stats()["pids"]) == 4:  # the added actors started and took tasks
                assert loader.num_workers == 4
                pause = 0.1
        grown, retired = decided(True)[0], decided(False)[0]
        assert (grown["workers_from"], grown["workers_to"]) == (2, 4) and retired["workers_to"] < 4
        for i in range(n):  # the retired actors' last batches arrive; then they are stopped
            got.append(int(loader[i][0, 0]))
            want.append(i)
            time.sleep(pause)  # (still the slow consumer)
        pids_left = loader.stats()["pids"]
        assert len(pids_left) == loader.num_workers < 4
        assert set(backend.nodes()) <= {node.node_id for node in nodes}
        stopped = [pid for pid in seen if pid not in pids_left]
    assert got == want  # every batch once per pass, in order, at every actor count
    assert stopped and gone(stopped)


def test_kpipe_empty_batches_held_together_stay_whole_and_actors_get_the_allocator_settings(cluster):
    with kpipe.ProcessLoader(InSlot(), workers=kpipe.RayWorkers(2)) as loader:
        held = [loader[i] for i in range(6)] + [loader[i] for i in range(6)]  # the actors' buffers reused 6 times
    with kpipe.ProcessLoader(MallocEnv(), workers=kpipe.RayWorkers(1)) as env_loader:
        settings = env_loader[0].tolist()
    for k, (big, row, strided, tail, small) in enumerate(held):
        i = k % 6
        want = np.full((3, 1000), i, "int32")
        want[1] += 1
        np.testing.assert_array_equal(big, want)
        np.testing.assert_array_equal(row, want[1])
        np.testing.assert_array_equal(strided, want[:, ::7])
        np.testing.assert_array_equal(tail, np.arange(5) * i)
        np.testing.assert_array_equal(small, np.full(3, i, "uint8"))
    assert settings == [True, True, True]  # MALLOC_MMAP_THRESHOLD_, _TRIM_THRESHOLD_, _MMAP_MAX_


@pytest.mark.multiworker
@pytest.mark.slow
def test_each_worker_of_a_tf_config_job_loads_its_shard_on_the_cluster(cluster, tmp_path):
    import io
    import sys

    from kpipe._engine._planner import EpochPlanner
    from kpipe.distribute import launch

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "programs"))
    import _outputs
    from passes_train import N_BATCHES, SEED

    ray_cluster, nodes = cluster
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(here), os.environ.get("PYTHONPATH")])),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = [sys.executable, os.path.join(here, "programs", "passes_train.py"), "--out", str(tmp_path), "--epochs", "2",
               "--loader-workers", "2", "--ray-address", ray_cluster.address]
    result = launch(command, workers=2, env=env, output=io.StringIO(), timeout_s=240, warn_open_ports=False)
    assert result.returncode == 0, "\n".join(result.tails)
    records = [_outputs.read(tmp_path, w)[0] for w in range(2)]
    shard_len = N_BATCHES // 2
    for w, record in enumerate(records):
        assert record["shard"] == [2, w]
        planner = EpochPlanner(N_BATCHES, shuffle=True, seed=SEED, num_shards=2, shard_index=w)
        assert record["ids"] == [i for p in range(2) for i in planner.plan(p)]  # its shard, each pass whole
        assert record["train_loads"] == 2 * shard_len  # each batch once per epoch, nothing after
        assert len(record["loader_pids"]) == 2 and set(record["actor_nodes"]) <= {n.node_id for n in nodes}
    assert set(records[0]["ids"][:shard_len]).isdisjoint(records[1]["ids"][:shard_len])


@pytest.mark.parametrize("where", ["other nodes", "this node"])
@pytest.mark.parametrize("keep", ["array", "empty"])
def test_np_stack_batches_in_actors_and_memory_a_dataset_keeps_is_never_reused(cluster, where, keep):
    from _datasets import Stacked

    spec = kpipe.RayWorkers(1, resources=TAGGED) if where == "other nodes" else kpipe.RayWorkers(1, num_cpus=0.5, resources=HERE)
    with kpipe.ProcessLoader(Stacked(n=8, keep=keep), workers=spec) as loader:
        reports = []
        for _ in range(2):  # (each pass on a fresh copy of the dataset, sent after its hook)
            for i in range(8):  # one batch held at a time: a few slots, reused within the pass
                x, report = loader[i]
                assert float(x[0, 0, 0, 0]) == float(x[-1, -1, -1, -1]) == i + 100 * (len(reports) // 8)
                reports.append(report.tolist())
            loader.on_epoch_end()
    assert all(intact for _, intact, _ in reports), reports
    assert all(owndata == 0 for owndata, _, _ in reports)  # built in the actor's slot or buffer


def test_a_dataset_exception_keeps_its_type_and_names_the_batch(cluster):
    with kpipe.ProcessLoader(Failing("raise", bad=2), workers=kpipe.RayWorkers(2)) as loader:
        loader[0], loader[1]
        with pytest.raises(ValueError, match="cannot decode record 2") as info:
            loader[2]
        assert info.value.kpipe_batch_index == 2
        assert float(loader[3][0][0, 0]) == 3.0  # the actors stay usable


def test_resources_the_cluster_lacks_are_a_named_error_within_the_timeout(cluster):
    t0 = time.monotonic()
    with pytest.raises(kpipe.BatchTimeoutError, match=r"did not start within timeout=3.0 s: they need num_cpus=1 and "
                                                      r"resources=\{'gpu_decoder': 1\}"):
        kpipe.ProcessLoader(Squares(n=4), workers=kpipe.RayWorkers(1, resources={"gpu_decoder": 1}), timeout=3.0)
    assert time.monotonic() - t0 < 60  # (a hang check, not a timing claim)


def test_dropped_and_closed_loaders_leave_no_actor(cluster):
    import gc

    pids = []
    for _ in range(10):  # ten fits on loaders dropped without close()
        model = _small_model()
        loader = kpipe.ProcessLoader(Squares(n=4), workers=kpipe.RayWorkers(1, num_cpus=0.5))
        model.fit(loader, epochs=1, verbose=0)
        pids += loader.stats()["pids"]
        del loader, model
    for _ in range(3):
        loader = kpipe.ProcessLoader(Squares(n=4), workers=kpipe.RayWorkers(2))
        loader[0]
        pids += loader.stats()["pids"]
        del loader  # a re-run notebook cell: no close()
    with kpipe.ProcessLoader(Squares(n=4), workers=kpipe.RayWorkers(1)) as loader:
        loader[0]
        pids += loader.stats()["pids"]
    gc.collect()
    from conftest import gone

    assert gone(pids)


_NOTEBOOK_SETUP = """
import gc, os, time, keras, numpy as np, kpipe

class Cell(keras.utils.PyDataset):  # defined in a cell, as users do: it travels to the actors by value
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return np.full((8, 3), i, "float32"), np.zeros((8, 1), "float32")

model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
pids = []
"""
_NOTEBOOK_CELL = """loader = kpipe.ProcessLoader(Cell(), workers=kpipe.RayWorkers(1, num_cpus=0.5))
model.fit(loader, epochs=1, verbose=0)
pids += loader.stats()["pids"]"""
_NOTEBOOK_COUNT = """del loader
gc.collect()
def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
deadline = time.monotonic() + 60
while any(alive(p) for p in pids) and time.monotonic() < deadline:  # (a hang deadline)
    time.sleep(0.05)
print(len(set(pids)), sum(alive(p) for p in set(pids)))"""


@pytest.mark.notebook
@pytest.mark.slow
def test_rerunning_a_notebook_fit_cell_leaves_no_actor(cluster, tmp_path, monkeypatch):
    import sys

    import nbformat
    from nbclient import NotebookClient

    ray_cluster, _ = cluster
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster.address)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    cells = [_NOTEBOOK_SETUP] + [_NOTEBOOK_CELL] * 10 + [_NOTEBOOK_COUNT]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, kernel_name="python3", timeout=240, startup_timeout=180,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream").split()
    assert printed == ["10", "0"], f"actors started, left: {printed} after 10 runs of a fit cell"


_LOCAL_INSTANCE = """
import os, sys, time, psutil, ray, kpipe
sys.path.insert(0, sys.argv[1])
from _datasets import Squares

first = kpipe.ProcessLoader(Squares(n=4), workers=kpipe.RayWorkers(1, num_cpus=0.5))
second = kpipe.ProcessLoader(Squares(n=4), workers=kpipe.RayWorkers(1, num_cpus=0.5))
first[0], second[0]
started = ray.is_initialized()
first.close()
after_first = ray.is_initialized()
second.close()
after_last = ray.is_initialized()
deadline = time.monotonic() + 60
while psutil.Process().children(recursive=True) and time.monotonic() < deadline:  # (a hang deadline)
    time.sleep(0.1)
print(started, after_first, after_last, len(psutil.Process().children(recursive=True)))
"""


@pytest.mark.slow
def test_a_local_instance_kpipe_started_stops_with_the_last_loader_and_a_users_cluster_runs_on(cluster):
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(here), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _LOCAL_INSTANCE, here], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-4:] == ["True", "True", "False", "0"]  # Ray's processes went with the last loader
    with kpipe.ProcessLoader(Squares(n=4), workers=kpipe.RayWorkers(1)) as loader:  # the module's cluster (address)
        loader[0]
    assert ray.is_initialized()  # a cluster kpipe connected to is left running


_UNREACHABLE = """
import socket, sys, time, kpipe
sys.path.insert(0, sys.argv[1])
from _datasets import Squares

s = socket.socket()
s.bind(("127.0.0.1", 0))
port = s.getsockname()[1]
s.close()  # (nothing listens there now)
t0 = time.monotonic()
try:
    kpipe.ProcessLoader(Squares(n=2), workers=kpipe.RayWorkers(1, address=f"127.0.0.1:{port}"), timeout=5)
except kpipe.LoaderError as exc:
    print(type(exc).__name__, round(time.monotonic() - t0), port, str(exc))
"""


def test_an_unreachable_cluster_is_a_named_error_within_the_timeout():
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(here), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", _UNREACHABLE, here], capture_output=True, text=True, timeout=120, env=env)
    kind, seconds, port, message = proc.stdout.strip().split("\n")[-1].split(" ", 3)
    assert kind == "LoaderError" and int(seconds) < 60, proc.stdout + proc.stderr[-2000:]  # (a hang check)
    assert f"Could not connect to the Ray cluster at address='127.0.0.1:{port}': nothing answers" in message


def test_bad_ray_arguments_are_refused_with_what_was_received():
    with pytest.raises(ValueError, match=r"`count` must be an int >= 1 \(actors\) or 'auto'. Received: count=0"):
        kpipe.RayWorkers(0)
    with pytest.raises(ValueError, match=r"`count` must be an int >= 1 \(actors\) or 'auto'. Received: count='many'"):
        kpipe.RayWorkers("many")
    with pytest.raises(ValueError, match=r"`max_count` bounds count='auto' and must be an int >= 1. Received: count=2, max_count=3"):
        kpipe.RayWorkers(2, max_count=3)
    with pytest.raises(ValueError, match=r"Received: count='auto', max_count=0"):
        kpipe.RayWorkers("auto", max_count=0)
    with pytest.raises(ValueError, match=r"`resources` must map resource names to positive amounts"):
        kpipe.RayWorkers(2, resources={"preprocess": 0})
    with pytest.raises(ValueError, match="cannot go with workers=RayWorkers"):
        kpipe.ProcessLoader(Squares(n=4), workers=kpipe.RayWorkers(2), use_threads=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_ray_quick_run_reports_every_row_and_its_target(tmp_path):
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "ray.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, os.path.join(root, "scripts", "bench_ray.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=560, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = ("b", "c", "blas@1", "blas@2", "blas@auto", "fit")
    assert {(r["row"], r["arm"].split()[0]) for r in result["table"]} == {(row, arm) for row in rows for arm in ("process", "ray")}
    assert all(r["best"] > 0 for r in result["table"])
    assert [r["arm"] for r in result["table"] if r["row"] == "b"] == [
        "process workers=2", "ray actors=2 (this node)", "ray actors=2 (object store)"]
    assert [c[0].split(")")[0] for c in result["checks"]] == ["(b", "(c", "(blas", "(blas", "(blas", "(fit", "(shrink",
                                                              "(shrink"]
    shrunk = result["shrink"]  # a node lost at full capacity and added back: every figure measured
    assert all(shrunk[k] > 0 for k in ("only_left", "before", "left", "back", "longest_wait_s", "placed_after_s"))
    # the dip's length: within the 24 batches read after the loss (that window lasts lost_s + 24 / left)
    assert 0 <= shrunk["dip_s"] <= shrunk["lost_s"] + 24 / shrunk["left"] + 1e-6
    c_actors = [r for r in result["results"] if r["row"] == "c" and r["arm"].startswith("ray")]
    assert all(len(r["actor_nodes"]) == 2 for r in c_actors)  # spread over the two "io" nodes


_DRIVER = """
import sys, time, psutil, kpipe
sys.path.insert(0, sys.argv[1])
from _datasets import Squares

loaders = [kpipe.ProcessLoader(Squares(n=8), workers=kpipe.RayWorkers(2, num_cpus=0.5, **kw)) for kw in eval(sys.argv[2])]
for loader in loaders:
    loader[0], loader[1]  # batches queued on every actor when the process is killed
print("ACTORS", *[p for loader in loaders for p in loader.stats()["pids"]], flush=True)
print("TREE", *[p.pid for p in psutil.Process().children(recursive=True)], flush=True)
time.sleep(600)
"""


def _killed_driver(address, placements):
    """Starts a training process with a loader per placement, SIGKILLs it once its actors
    have loaded, and returns (its actors' pids, every process it had started)."""
    import subprocess
    import sys

    from conftest import killed_at_exit

    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(here), env.get("PYTHONPATH")]))
    if address:
        env["RAY_ADDRESS"] = address
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER, here, repr(placements)], stdout=subprocess.PIPE, text=True, env=env)
    with killed_at_exit(proc):
        printed = {}
        for line in proc.stdout:
            key, *pids = line.split()
            printed[key] = [int(p) for p in pids]
            if key == "TREE":
                break
        assert "TREE" in printed, f"the training process ended early (exit {proc.wait(60)})"
        proc.kill()  # SIGKILL: no close(), no atexit, no finalizer runs
        proc.wait(60)
    return printed["ACTORS"], printed["TREE"]


@pytest.mark.slow
def test_a_killed_training_process_leaves_no_actor_on_a_users_cluster_which_runs_on(cluster):
    from conftest import gone

    ray_cluster, _ = cluster
    actors, _ = _killed_driver(ray_cluster.address, [{"resources": HERE}, {"resources": TAGGED}])
    assert len(set(actors)) == 4
    assert gone(actors)  # Ray ends the actors of a job whose driver died
    with kpipe.ProcessLoader(Squares(n=4), workers=kpipe.RayWorkers(2, resources=TAGGED)) as loader:
        assert [_ids(loader[i]) for i in range(4)] == [0, 1, 2, 3]  # the cluster itself runs on


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_training_process_takes_the_local_instance_kpipe_started_with_it():
    from conftest import gone, live_pids

    actors, tree = _killed_driver(None, [{}])
    assert len(set(actors)) == 2 and set(actors) <= set(tree)
    # The actors, the raylet and the GCS end at once; Ray's two agents (DashboardAgent,
    # RuntimeEnvAgent) first try to tell the dead GCS that the raylet died, which Ray
    # waits 60 s for (`publish_error_to_driver`), then exit: the deadline allows that.
    assert gone(actors), f"actors left: {live_pids(actors)}"
    assert gone(tree, within_s=180), f"processes of the local Ray instance left: {live_pids(tree)}"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["other nodes", "this node"])
def test_50_epochs_of_a_replacing_dataset_stay_flat_on_actors(cluster, where):
    """The soak test of local workers (tests/test_soak.py) on actors: a dataset replacing
    its 8 MB index array in `on_epoch_end` (so its state travels to the actors at every
    pass end), 50 epochs: the same actors, descriptors and slot mappings at epoch 5 and
    epoch 50, no more objects in Ray's store once its frees have run, and private memory
    (RssAnon) of this process and the actors within a tolerance: a leaked state would add
    8 MB an epoch. (Not RSS: it counts the pages of Ray's shared object store a process
    has touched, which grow towards the store's size as objects land in new places.)"""
    import ctypes
    import gc

    import psutil
    from _engine_datasets import Replacing, fd_count, memfd_count

    def slot_mappings(pid):
        with open(f"/proc/{pid}/maps") as f:
            return len({line.split()[4] for line in f if "memfd:kpipe" in line})

    def rss_anon(pid):  # private memory: Ray's object store, mapped into every worker, is shared
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))

    def snapshot(loader):
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)  # free 8 MB blocks glibc keeps here (`want`'s) are not growth
        pids = loader.stats()["pids"]
        procs = [psutil.Process()] + [psutil.Process(p) for p in pids]
        return {"actors": sorted(pids), "fds": [fd_count(p.pid) for p in procs], "memfds": [memfd_count(p.pid) for p in procs],
                "maps": [slot_mappings(p.pid) for p in procs], "rss": [rss_anon(p.pid) for p in procs],
                "objects": _objects_in_store(at_most=snaps[6]["objects"] if snaps else None)}

    spec = kpipe.RayWorkers(2, resources=TAGGED) if where == "other nodes" else kpipe.RayWorkers(2, num_cpus=0.5, resources=HERE)
    want = Replacing(n=1_000_000, batches=8)  # the same dataset, advanced here, for the expected batches
    snaps = {}
    _objects_in_store(within_s=0)  # (the first call's imports and client are not growth)
    with kpipe.ProcessLoader(Replacing(n=1_000_000, batches=8), workers=spec) as loader:
        for epoch in range(51):
            for i in range(8):
                x, e = loader[i]
                assert x.tolist() == want.indexes[4 * i : 4 * i + 4].tolist() and int(e[0]) == epoch
            del x, e
            if epoch in (6, 50):  # (even epochs: this process holds one state or two, by parity)
                snaps[epoch] = snapshot(loader)
            loader.on_epoch_end()
            want.on_epoch_end()
        assert loader.stats()["restarts"] == 0
    start, end = snaps[6], snaps[50]
    for key in ("actors", "fds", "memfds", "maps"):
        assert end[key] == start[key], f"{key} after 6 epochs: {start[key]}, after 50: {end[key]}"
    assert end["objects"] <= start["objects"], f"objects in Ray's store after 6 epochs: {start['objects']}, after 50: {end['objects']}"
    growth = [(b - a) / (1 << 20) for a, b in zip(start["rss"], end["rss"])]
    assert max(growth) < 8, f"RssAnon growth over 44 epochs (this process, actors), MiB: {growth}"


def _objects_in_store(at_most=None, within_s=30.0):
    """Objects Ray's stores hold, cluster-wide (what `ray memory --stats-only` counts), once
    the count has settled: Ray frees objects asynchronously, so right after a pass the
    count still holds some of its batches. With `at_most`, waits (up to `within_s`) for
    the count to fall to it; else for two equal readings 1 s apart."""
    import re

    from ray._private.internal_api import memory_summary

    def count():
        summary = memory_summary(stats_only=True)
        found = re.search(r"(\d+) objects", summary)
        assert found, summary
        return int(found.group(1))

    deadline, last = time.monotonic() + within_s, count()
    while time.monotonic() < deadline:  # (a deadline: the count is read, whatever it is)
        time.sleep(1.0)
        now = count()
        if (now <= at_most) if at_most is not None else (now == last):
            return now
        last = now
    return last


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("steps", [None, 4, 5, 12, 13], ids=lambda s: f"steps_per_epoch={s}")
def test_fit_consumes_the_steps_plain_keras_takes(cluster, steps, shuffle, tmp_path):
    """tests/test_passes.py's comparison with plain Keras, on actors: the same number of
    steps, whole passes in plan order, the same ids as plain Keras when not shuffled, and
    one load per step (read-ahead stops where the last epoch does)."""
    from test_passes import BatchIds, consumed, loads, new_model, planned

    n, epochs = 12, 5
    keras_ids = consumed(new_model().fit, BatchIds(n), epochs=epochs, steps_per_epoch=steps, shuffle=False)[0]
    log = tmp_path / "loads"
    with kpipe.ProcessLoader(BatchIds(n, log=str(log)), workers=kpipe.RayWorkers(2, resources=TAGGED), shuffle=shuffle, seed=0) as loader:
        ids, _ = consumed(new_model().fit, loader, epochs=epochs, steps_per_epoch=steps)
        stats = loader.stats()
    assert len(ids) == len(keras_ids)
    assert ids == planned(n, len(ids), shuffle, seed=0)
    if not shuffle:
        assert ids == keras_ids
    assert stats["passes"] == len(ids) // n
    assert loads(log) == len(ids)


def _count_calls(loader):
    """The number of batches in each actor call the loader's backend sends from now on."""
    backend, calls = reader_of(loader).backend, []
    real = backend._load

    def counting(actor, items):
        calls.append(len(items))
        return real(actor, items)

    backend._load = counting
    return calls


@pytest.fixture
def every_batch_quick(monkeypatch):
    """Every batch counts as quick, so that small ones share calls whatever the machine's
    load (on a loaded one a batch's own time can pass `_CALL_COST_S`, and none shares): for
    the tests whose subject is what happens inside a shared call, not when batches share."""
    from kpipe._engine import _ray

    monkeypatch.setattr(_ray, "_CALL_COST_S", 1.0)


@pytest.mark.parametrize("where", ["other nodes", "this node"])
def test_small_quick_batches_share_actor_calls_and_arrive_in_plan_order(cluster, where):
    spec = kpipe.RayWorkers(2, resources=TAGGED) if where == "other nodes" else kpipe.RayWorkers(2, num_cpus=0.5, resources=HERE)
    with kpipe.ProcessLoader(Squares(n=40), workers=spec, shuffle=True, seed=3) as loader:
        calls, loads = _count_calls(loader), loader.stats()["loads"]
        got = []
        for _ in range(3):
            got += [_ids(loader[i]) for i in range(40)]
            loader.on_epoch_end()
        backend = reader_of(loader).backend
        shared, unsent = backend.batches_per_call(), sum(len(a.outbox) for a in backend._actors)
        loads = loader.stats()["loads"] - loads
    assert got == _reference(40, 3, shuffle=True, seed=3)
    assert shared > 1 and max(calls) > 1  # Ray's cost per call is shared by several batches
    assert sum(calls) + unsent == loads  # each batch asked for once (the last ones wait to fill a call)


def test_big_batches_never_share_a_call(cluster):
    with kpipe.ProcessLoader(Squares(n=10, batch=600_000), workers=kpipe.RayWorkers(2, resources=TAGGED)) as loader:
        calls = _count_calls(loader)  # 4.8 MB batches: over the 4 MiB that may share a call
        got = [_ids(loader[i]) for _ in range(2) for i in range(10)]
        assert reader_of(loader).backend.batches_per_call() == 1
    assert got == list(range(10)) * 2
    assert calls and max(calls) == 1


def test_a_batch_failing_in_a_shared_call_raises_alone(cluster, every_batch_quick):
    with kpipe.ProcessLoader(Failing("raise", bad=30, n=40), workers=kpipe.RayWorkers(2)) as loader:
        calls = _count_calls(loader)
        got = [float(loader[i][0][0, 0]) for i in range(30)]
        with pytest.raises(ValueError, match="cannot decode record 30") as info:
            loader[30]
        assert info.value.kpipe_batch_index == 30
        assert "Original traceback from the worker" in str(info.value) and "_datasets.py" in str(info.value)
        got += [float(loader[i][0][0, 0]) for i in range(31, 40)]  # the other batches of its call arrive
    assert max(calls) > 1
    assert got == [float(i) for i in range(40) if i != 30]


@pytest.mark.parametrize("where", ["other nodes", "this node"])
def test_an_actor_killed_with_shared_calls_in_flight_is_replaced_and_every_batch_arrives_once_in_order(cluster, every_batch_quick, where):
    spec = kpipe.RayWorkers(2, resources=TAGGED) if where == "other nodes" else kpipe.RayWorkers(2, num_cpus=0.5, resources=HERE)
    with kpipe.ProcessLoader(Squares(n=40), workers=spec, shuffle=True, seed=8) as loader:
        calls = _count_calls(loader)
        got = [_ids(loader[i]) for i in range(40)]  # (calls are shared from here on)
        loader.on_epoch_end()
        held = loader[0]
        got += [_ids(held)] + [_ids(loader[i]) for i in range(1, 3)]
        pids = loader.stats()["pids"]
        os.kill(pids[0], signal.SIGKILL)  # with shared calls queued on it
        got += [_ids(loader[i]) for i in range(3, 40)]
        loader.on_epoch_end()
        got += [_ids(loader[i]) for i in range(40)]
        assert loader.stats()["pids"][0] != pids[0]
        assert _ids(held) == got[40]  # a batch held across its actor's death is intact
    assert max(calls) > 1
    assert got == _reference(40, 3, shuffle=True, seed=8)


@pytest.mark.parametrize("where", ["other nodes", "this node"])
def test_jumps_discard_batches_of_shared_calls_and_their_slots_come_back(cluster, every_batch_quick, where):
    spec = kpipe.RayWorkers(2, resources=TAGGED) if where == "other nodes" else kpipe.RayWorkers(2, num_cpus=0.5, resources=HERE)
    with kpipe.ProcessLoader(Squares(n=600), workers=spec) as loader:
        calls = _count_calls(loader)
        backend = reader_of(loader).backend
        got, want = [], []
        for start in range(0, 600, 10):  # read 3, skip 7: the window's batches in between are discarded
            for i in (start, start + 1, start + 2):
                got.append(_ids(loader[i]))
                want.append(i)
        stats = loader.stats()
        slots = backend.local_slots()
    assert got == want
    assert max(calls) > 1 and stats["discards"] > 0
    if where == "this node":  # discarded batches' slots were released and reused: not 7 more a jump
        assert slots <= 2 * loader.max_queue_size + 2  # (those in flight, and the discarded ones still loading)


@pytest.mark.parametrize("seed", [1, 2, 4, 14])
@pytest.mark.parametrize("where", ["here", "tagged"])
def test_generated_datasets_give_through_actors_what_they_give_serially(cluster, tmp_path, seed, where):
    """The differential suite's cases (tests/test_differential.py) through Ray actors: in
    shared-memory slots on this node (kept slot memory, pass-end checks) and through the
    object store on the other nodes."""
    from _differential import describe, normalise_errors, run_loader, run_serial, serial_errors, spec
    from test_differential import _memmap_file

    s = spec(seed)
    path = _memmap_file(tmp_path)
    want = serial_errors(run_serial(s, path)[0])
    workers = kpipe.RayWorkers(2, num_cpus=0.5, resources=HERE) if where == "here" else kpipe.RayWorkers(2, resources=TAGGED)
    (passes, held), _ = run_loader(s, path, workers=workers)
    assert normalise_errors(passes) == want, describe(s)
    assert all(held), describe(s)
