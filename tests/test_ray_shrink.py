"""Ray workers on a cluster that shrinks and grows back (kpipe/_engine/_ray.py, the NOTE's
"Faults"): nodes SIGKILLed mid-fit (as a host dies or a spot instance is reclaimed) with
spare capacity and at full capacity, a node added back mid-fit, a node lost and regained
every epoch; `fit()` ends with plain Keras's weights in each; no actor and no pending
actor creation after each run or failure. On `ray.cluster_utils.Cluster` (a head node
and "spot" nodes of 2 CPUs added and removed by each test), then on a cluster started
with the `ray start` CLI as the README does."""

import gc
import logging
import os
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kpipe[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

import kpipe  # noqa: E402
from _datasets import Squares  # noqa: E402
from conftest import reader_of  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.multiprocess, pytest.mark.slow, pytest.mark.timeout(400)]
SPOT = {"spot": 1}  # actors only on the spot nodes (2 per node: a node's CPUs all held)
# Ray's own notice of a dead node, shortened (defaults: about 15 s) so that each loss is seen in seconds
FAST_HEALTH = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500, "health_check_failure_threshold": 3}


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": FAST_HEALTH})
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _spot(cluster):
    return cluster.add_node(num_cpus=2, resources={"spot": 2})


def _lose(cluster, node):
    cluster.remove_node(node, allow_graceful=False)  # SIGKILLed: its raylet and workers, as a host that died


def _loaders_actors(within_s=60.0):
    """Actors of kpipe's actor class alive or waiting to be placed in the cluster, once
    Ray has marked killed ones dead (within `within_s`: a deadline, not a timing)."""
    from ray._private import state

    def count():
        return sum(1 for a in state.actors().values() if a["ActorClassName"] == "Loader" and a["State"] != "DEAD")

    deadline = time.monotonic() + within_s
    while count() and time.monotonic() < deadline:
        time.sleep(0.2)
    return count()


def _model():
    import keras

    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    m.compile(keras.optimizers.SGD(1e-4), "mse")
    return m


def _plain_weights(n, epochs):
    """The weights plain Keras ends with on the same batches (a PyDataset, shuffle=False)."""
    import keras

    class Plain(keras.utils.PyDataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return Squares(n=n)[i]

    model = _model()
    model.fit(Plain(), epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


def _assert_same(got, want):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def _on_epoch_end(action):
    import keras

    class Act(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            action(epoch)

    return Act()


def _node_of(nodes, backend, worker=0):
    return next(n for n in nodes if n.node_id == backend.nodes()[worker])


def _states(backend):
    return sorted(a["state"] for a in backend.actors())


def _wait_live(backend, count, within_s=120.0):
    """Polls the loader's actors until `count` are live (a deadline, not a timing)."""
    deadline = time.monotonic() + within_s
    while _states(backend).count("live") < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return _states(backend)


def test_a_node_lost_at_full_capacity_costs_its_actors_not_the_run(cluster, caplog):
    nodes = [_spot(cluster) for _ in range(2)]
    try:
        want = _plain_weights(8, epochs=3)
        model = _model()
        with kpipe.ProcessLoader(Squares(n=8), workers=kpipe.RayWorkers(4, resources=SPOT), timeout=30,
                                 max_queue_size=4) as loader:  # (a short window: the lost actors hold batches)
            backend = reader_of(loader).backend
            lost = []

            def lose(epoch):
                if epoch == 0:  # every CPU of both nodes held: no room for a replacement
                    lost.append(_node_of(nodes, backend))
                    _lose(cluster, lost[0])

            with caplog.at_level(logging.WARNING, logger="kpipe"):
                model.fit(loader, epochs=3, verbose=0, shuffle=False, callbacks=[_on_epoch_end(lose)])
            assert loader.stats()["loads"] == 24  # each batch delivered once per epoch
            assert _states(backend) == ["live", "live", "starting", "starting"]  # replacements still wait
            assert {a["node"] for a in backend.actors() if a["state"] == "live"} == {n.node_id for n in nodes} - {lost[0].node_id}
        waits = [r.getMessage() for r in caplog.records if "waiting for Ray to place" in r.getMessage()]
        assert len(waits) == 1 and "resources={'spot': 1}" in waits[0], waits
        _assert_same(model.get_weights(), want)
        assert _loaders_actors() == 0  # the pending creations cancelled with the live actors
    finally:
        for node in nodes:
            if node in cluster.worker_nodes:
                _lose(cluster, node)
