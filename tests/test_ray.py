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
from _datasets import Failing, Squares  # noqa: E402
from conftest import reader_of  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.multiprocess, pytest.mark.timeout(300)]
TAGGED = {"preprocess": 1}


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
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
        got.fit(loader, epochs=2, verbose=0)
        assert loader.stats()["loads"] == 12  # each batch once per epoch
    for a, b in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_a_killed_actor_is_replaced_and_every_batch_arrives_once_in_order(cluster):
    with kpipe.ProcessLoader(Squares(n=12), workers=kpipe.RayWorkers(2, resources=TAGGED), shuffle=True, seed=7) as loader:
        got = [_ids(loader[i]) for i in range(3)]
        pids = loader.stats()["pids"]
        os.kill(pids[0], signal.SIGKILL)  # mid-pass, with batches queued on it
        got += [_ids(loader[i]) for i in range(3, 12)]
        got += [_ids(loader[i]) for i in range(12)]
        assert loader.stats()["pids"][0] != pids[0]
    assert got == _reference(12, 2, shuffle=True, seed=7)


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


def test_bad_ray_arguments_are_refused_with_what_was_received():
    with pytest.raises(ValueError, match=r"`count` must be an int >= 1 \(actors\). Received: count=0"):
        kpipe.RayWorkers(0)
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
    assert {(r["row"], r["arm"].split()[0]) for r in result["table"]} == {(row, arm) for row in ("b", "c", "fit") for arm in ("process", "ray")}
    assert all(r["best"] > 0 for r in result["table"])
    assert [c[0].split(")")[0] for c in result["checks"]] == ["(b", "(c", "(fit"]
    c_actors = [r for r in result["results"] if r["row"] == "c" and r["arm"].startswith("ray")]
    assert all(len(r["actor_nodes"]) == 2 for r in c_actors)  # spread over the two "io" nodes
