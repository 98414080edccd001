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
import subprocess
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'kpipe[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

import kpipe  # noqa: E402
from _datasets import Squares  # noqa: E402
from _ray_datasets import Ballasted, SlowSquares  # noqa: E402
from conftest import gone, reader_of  # noqa: E402

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


def _lose(cluster, node, backend=None):
    """SIGKILLs `node`'s raylet and processes, as a host that died, and waits (a deadline,
    not a timing) until Ray marked it dead and `backend`'s actors there have exited: from
    then on every call to them fails (before, one may still answer, as on a real host
    whose death takes a moment to show)."""
    pids = [a["pid"] for a in backend.actors() if a["node"] == node.node_id] if backend is not None else []
    cluster.remove_node(node, allow_graceful=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(n["Alive"] for n in ray.nodes() if n["NodeID"] == node.node_id):
        time.sleep(0.1)
    assert gone(pids)


def _remove_left(cluster, nodes):
    """A test's teardown: loses those of `nodes` still in the cluster."""
    for node in nodes:
        if node in cluster.worker_nodes:
            _lose(cluster, node)


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


def _placed(count, within_s=120.0):
    """Waits until `count` of kpipe's actors are alive in the cluster (placed and
    started; a deadline, not a timing): the loader takes them in at its next read."""
    from ray._private import state

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if sum(1 for a in state.actors().values() if a["ActorClassName"] == "Loader" and a["State"] == "ALIVE") >= count:
            return True
        time.sleep(0.2)
    return False


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
                    _lose(cluster, lost[0], backend)

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
        _remove_left(cluster, nodes)


def test_a_node_lost_with_spare_capacity_is_replaced_there_and_fit_goes_on(cluster):
    nodes = [_spot(cluster) for _ in range(2)]
    try:
        want = _plain_weights(8, epochs=3)
        model = _model()
        with kpipe.ProcessLoader(Squares(n=8), workers=kpipe.RayWorkers(2, resources=SPOT), timeout=60,
                                 max_queue_size=4) as loader:
            backend = reader_of(loader).backend
            lost = []

            def lose(epoch):
                if epoch == 0:  # (one actor or both were there: the other node has room for both)
                    lost.append(_node_of(nodes, backend))
                    _lose(cluster, lost[0], backend)

            model.fit(loader, epochs=3, verbose=0, shuffle=False, callbacks=[_on_epoch_end(lose)])
            assert loader.stats()["loads"] == 24
            assert _placed(2)
            loader[0]  # (a read takes in the actors placed since)
            assert _states(backend) == ["live", "live"]
            (kept,) = set(n.node_id for n in nodes) - {lost[0].node_id}
            assert set(backend.nodes()) == {kept}
        _assert_same(model.get_weights(), want)
        assert _loaders_actors() == 0
    finally:
        _remove_left(cluster, nodes)


def test_a_node_added_back_mid_fit_gets_the_replacements_which_take_batches(cluster):
    nodes = [_spot(cluster) for _ in range(2)]
    try:
        want = _plain_weights(8, epochs=5)
        model = _model()
        with kpipe.ProcessLoader(Squares(n=8), workers=kpipe.RayWorkers(4, resources=SPOT), timeout=60,
                                 max_queue_size=4) as loader:
            backend = reader_of(loader).backend
            added = []

            def shrink_and_grow(epoch):
                if epoch == 0:  # at full capacity: 2 actors lost, 2 replacements wait
                    _lose(cluster, _node_of(nodes, backend), backend)
                elif epoch == 2:
                    assert _states(backend).count("starting") == 2
                    added.append(_spot(cluster))  # (`ray start` again, or the autoscaler)
                    nodes.append(added[-1])  # (removed by the teardown, whatever happens)
                    assert _placed(4)  # the next pass's first read takes them in

            model.fit(loader, epochs=5, verbose=0, shuffle=False, callbacks=[_on_epoch_end(shrink_and_grow)])
            assert loader.stats()["loads"] == 40
            back = [a for a in backend.actors() if a["node"] == added[0].node_id]
            assert len(back) == 2 and all(a["loads"] > 0 for a in back), backend.actors()  # they took batches
            assert _states(backend) == ["live"] * 4
        _assert_same(model.get_weights(), want)
        assert _loaders_actors() == 0
    finally:
        _remove_left(cluster, nodes)


def test_auto_grows_back_to_what_the_cluster_places_when_a_lost_node_returns(cluster):
    nodes = [_spot(cluster) for _ in range(2)]
    try:
        want = _plain_weights(16, epochs=5)
        model = _model()
        # I/O-bound batches (0.2 s of waiting each) and a quick consumer: the controller adds actors up to what
        # the cluster places, and, as the consumer waits for them, never retires one
        with kpipe.ProcessLoader(SlowSquares(n=16, stall_s=0.2), workers=kpipe.RayWorkers("auto", resources=SPOT),
                                 timeout=60) as loader:
            backend = reader_of(loader).backend
            assert backend.capacity() == (4.0, 4) and backend.num_workers == 2  # 2 nodes x {"spot": 2, CPU: 2}
            seen, added = {}, []

            def shrink_and_grow(epoch):
                seen[epoch] = (_states(backend), backend.num_workers, backend.capacity()[1])
                if epoch == 0:
                    assert _placed(4)  # the 2 actors added (the next read takes them in)
                elif epoch == 1:  # the 4 actors hold every CPU of both nodes: no room for a replacement
                    _lose(cluster, _node_of(nodes, backend), backend)
                elif epoch == 2:
                    added.append(_spot(cluster))  # (`ray start` again, or the autoscaler)
                    nodes.append(added[-1])  # (removed by the teardown, whatever happens)
                    assert _placed(4)

            model.fit(loader, epochs=5, verbose=0, shuffle=False, callbacks=[_on_epoch_end(shrink_and_grow)])
            assert loader.stats()["loads"] == 80  # each batch delivered once per epoch, in order (the weights)
            assert seen[1] == (["live"] * 4, 4, 4)  # grown to what the cluster places
            assert seen[2] == (["live", "live", "starting", "starting"], 4, 2)  # fewer: 2 live, 2 replacements wait
            assert seen[4] == (["live"] * 4, 4, 4)  # back to what the cluster places
            back = [a for a in backend.actors() if a["node"] == added[0].node_id]
            assert len(back) == 2 and all(a["loads"] > 0 for a in back), backend.actors()  # they took batches
            changes = [(d["workers_from"], d["workers_to"]) for d in loader.stats()["auto_decisions"]]
            assert all(b > a for a, b in changes), changes  # (none retired: the count came back by the replacements)
        _assert_same(model.get_weights(), want)
        assert _loaders_actors() == 0
    finally:
        _remove_left(cluster, nodes)


def test_auto_grows_past_its_start_size_when_the_cluster_gains_a_node(cluster):
    nodes = [_spot(cluster)]
    try:
        epochs = 8
        want = _plain_weights(16, epochs=epochs)
        model = _model()
        with kpipe.ProcessLoader(SlowSquares(n=16, stall_s=0.2), workers=kpipe.RayWorkers("auto", resources=SPOT),
                                 timeout=60) as loader:
            backend = reader_of(loader).backend
            assert backend.capacity() == (2.0, 2)  # one node x {"spot": 2, CPU: 2}: what the loader starts with
            seen = {}

            def grow(epoch):
                seen[epoch] = backend.num_workers
                if epoch == 0:
                    nodes.append(_spot(cluster))  # (`ray start` on a new host, or the autoscaler)

            model.fit(loader, epochs=epochs, verbose=0, shuffle=False, callbacks=[_on_epoch_end(grow)])
            assert seen[0] == 2  # all the one node placed
            assert backend.num_workers == 4 and backend.capacity() == (4.0, 4), (seen, loader.stats()["auto_decisions"])
            new = [a for a in backend.actors() if a["node"] == nodes[1].node_id]
            assert len(new) == 2 and all(a["loads"] > 0 for a in new), backend.actors()  # the new node's actors loaded
            assert loader.stats()["loads"] == 16 * epochs  # each batch once per epoch, in order (the weights)
        _assert_same(model.get_weights(), want)
        assert _loaders_actors() == 0
    finally:
        _remove_left(cluster, nodes)


def test_a_node_lost_and_regained_every_epoch_keeps_actors_and_memory_flat_and_trains_as_local_workers(cluster):
    epochs = 6 if os.environ.get("KPIPE_SMALL") else 20
    ballast = 4 << 20  # the dataset's state weighs this much: each replacement is sent it
    nodes = [_spot(cluster) for _ in range(2)]
    try:
        want_model = _model()  # the loader's seeded shuffle, loaded in this process
        with kpipe.ProcessLoader(Ballasted(n=8, ballast_bytes=ballast), workers=0, shuffle=True, seed=3) as local:
            want_model.fit(local, epochs=epochs, verbose=0)
        model = _model()
        counts, memory = [], []
        with kpipe.ProcessLoader(Ballasted(n=8, ballast_bytes=ballast), workers=kpipe.RayWorkers(4, resources=SPOT),
                                 shuffle=True, seed=3, timeout=60, max_queue_size=4) as loader:
            backend = reader_of(loader).backend

            def churn(epoch):
                memory.append(_memory())
                live = [a for a in backend.actors() if a["state"] == "live"]
                victim = next(n for n in nodes if n.node_id == live[0]["node"])
                _lose(cluster, victim, backend)
                nodes.remove(victim)
                nodes.append(_spot(cluster))
                counts.append((len(backend.actors()), backend.local_slots(), _loaders_actors_at_most(4)))

            model.fit(loader, epochs=epochs, verbose=0, callbacks=[_on_epoch_end(churn)])
            assert loader.stats()["loads"] == 8 * epochs
        assert counts == [(4, 0, True)] * epochs, counts  # no actor, creation or slot more than at the start
        _assert_flat(memory, ballast)
        _assert_same(model.get_weights(), want_model.get_weights())
        assert _loaders_actors() == 0
    finally:
        _remove_left(cluster, nodes)


def _memory():
    """What a leak per lost actor would grow: this process's resident memory and open
    fds (counted after a collection: Ray's own clients close when collected) -- sockets
    apart: Ray's connections to the workers and nodes of the moment, which it closes
    lazily --, and the cluster's object store (objects and bytes, over its live nodes)."""
    import psutil
    from ray._private.internal_api import get_memory_info_reply
    from ray._private.state import state

    gc.collect()
    fds = sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # (the listing's own fd, closed)
        sockets += target.startswith("socket:")
        fds += not target.startswith("socket:")
    store = get_memory_info_reply(state).store_stats  # (this connection's own state: no new client)
    return {"rss": psutil.Process().memory_info().rss, "fds": fds, "sockets": sockets, "objects": store.num_local_objects,
            "store_bytes": store.object_store_bytes_used}


def _assert_flat(memory, ballast):
    """The later epochs' figures against the first ones', with bounds from what a leak
    would add per epoch (two actors lost and replaced each time): the dataset's state
    (`ballast` bytes) kept once more per epoch in this process or the object store, an
    object or an fd more per lost actor. Over the later half of the epochs such a leak
    exceeds each bound; a flat run stays within it (what the first epochs already
    hold is in the baseline). kpipe's fds (memfds, slot mappings, pipes, files) stay at
    the baseline; Ray's sockets to lost workers close on its own schedule (flat with
    plain Ray actors over the same churn; up to ~1 more per epoch seen here, with
    drops): bounded at 2 per epoch, one per lost actor. The object store holds at most a copy of the state on each
    of the 3 live nodes (the head's, and each spot node's once an actor started there)."""
    half = len(memory) // 2
    first, later = memory[1:half], memory[half:]  # (epoch 0 warms up)
    leak_epochs = len(later)
    top = {k: max(m[k] for m in first) for k in memory[0]}
    for m in later:
        assert m["rss"] - top["rss"] < ballast * leak_epochs / 2, (m, top)
        assert m["store_bytes"] <= 3 * (ballast + (64 << 10)), (m, memory)
        assert m["objects"] - top["objects"] < leak_epochs, (m, top)
        assert m["fds"] <= top["fds"], (m, top)
        assert m["sockets"] - top["sockets"] <= 2 * leak_epochs, (m, top)


def _loaders_actors_at_most(count, within_s=60.0):
    """Whether the cluster's kpipe actors alive or waiting to be placed fall to `count`
    within `within_s` (Ray marks a lost node's actors dead a moment after it)."""
    from ray._private import state

    deadline = time.monotonic() + within_s
    while True:
        alive = sum(1 for a in state.actors().values() if a["ActorClassName"] == "Loader" and a["State"] != "DEAD")
        if alive <= count or time.monotonic() > deadline:
            return alive <= count
        time.sleep(0.2)


def test_no_actor_live_for_timeout_is_the_named_error_and_leaves_no_actor(cluster):
    node = _spot(cluster)
    try:
        loader = kpipe.ProcessLoader(Squares(n=8), workers=kpipe.RayWorkers(2, resources=SPOT), timeout=120,
                                     max_queue_size=4)  # (a loaded machine may take more than 5 s to start them)
        assert [float(loader[i][0][0, 0]) for i in range(2)] == [0.0, 10.0]
        backend = reader_of(loader).backend
        backend.timeout = 5.0  # (from now on: how long no actor may be live)
        _lose(cluster, node, backend)  # every actor lost, and nowhere to place one
        t0 = time.monotonic()
        with pytest.raises(kpipe.BatchTimeoutError, match=r"did not start within timeout=5.0 s \(and none was live "
                                                          r"meanwhile: the others were lost\): they need num_cpus=1 and "
                                                          r"resources=\{'spot': 1\}"):
            for i in range(2, 24):  # (the first of them may have arrived before)
                loader[i % 8]
        assert time.monotonic() - t0 < 120  # (a hang check, not a timing claim)
        assert backend.closed
        assert _loaders_actors() == 0  # the pending creations cancelled
    finally:
        _remove_left(cluster, [node])


def test_a_loader_dropped_or_closed_while_replacements_wait_leaves_no_actor(cluster):
    nodes = [_spot(cluster) for _ in range(2)]
    try:
        for close in (True, False):
            loader = kpipe.ProcessLoader(Squares(n=8), workers=kpipe.RayWorkers(4, resources=SPOT), max_queue_size=4)
            [loader[i] for i in range(8)]
            backend = reader_of(loader).backend
            lost = _node_of(nodes, backend)
            _lose(cluster, lost, backend)
            nodes.remove(lost)
            [loader[i] for i in range(8)]
            assert _states(backend).count("starting") == 2
            if close:
                loader.close()
            del loader, backend  # (a re-run notebook cell: no close())
            gc.collect()
            assert _loaders_actors() == 0
            nodes.append(_spot(cluster))
    finally:
        _remove_left(cluster, nodes)


# ------------------------------------------------- a cluster started with `ray start`, as the README does
_CLI_DRIVER = r"""
import json, os, signal, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import keras, numpy as np, ray, kpipe
from ray._private import state
from _datasets import Squares
from conftest import gone, reader_of

victim_pgid, node_cmd, pgid_file = int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]

def model():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    m.compile(keras.optimizers.SGD(1e-4), "mse")
    return m

class Plain(keras.utils.PyDataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return Squares(n=8)[i]

def loaders_actors(state_name=None):
    return sum(1 for a in state.actors().values() if a["ActorClassName"] == "Loader"
               and (a["State"] == state_name if state_name else a["State"] != "DEAD"))

def until(check, within_s=120.0):
    deadline = time.monotonic() + within_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.2)
    return check()

ray.init(logging_level="ERROR")  # (RAY_ADDRESS; the loader uses this connection)
assert until(lambda: sum(n["Alive"] for n in ray.nodes()) == 3, 180), ray.nodes()
want = model()
want.fit(Plain(), epochs=4, shuffle=False, verbose=0)
got, out = model(), {}
with kpipe.ProcessLoader(Squares(n=8), workers=kpipe.RayWorkers(4, resources={"preprocess": 1}), max_queue_size=4,
                         timeout=120) as loader:  # (RAY_ADDRESS, as the README says)
    backend = reader_of(loader).backend

    class Churn(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:  # the node's raylet, workers and actors SIGKILLed: every CPU was held
                nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
                os.killpg(victim_pgid, signal.SIGKILL)
                lost = until(lambda: len({n["NodeID"] for n in ray.nodes() if n["Alive"]}) == len(nodes) - 1)
                out["lost"] = lost and gone([a["pid"] for a in backend.actors()
                                             if a["node"] not in {n["NodeID"] for n in ray.nodes() if n["Alive"]}])
            elif epoch == 1:  # `ray start` again: the replacements waiting are placed there
                out["starting_before_return"] = sorted(a["state"] for a in backend.actors()).count("starting")
                for attempt in range(2):  # (a node start may time out on a loaded machine: once more)
                    node = subprocess.Popen(node_cmd, start_new_session=True, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
                    with open(pgid_file, "a") as f:
                        f.write(f"{node.pid}\n")
                    out["placed"] = until(lambda: loaders_actors("ALIVE") == 4 or node.poll() is not None, 180)
                    out["placed"] = out["placed"] and node.poll() is None
                    if out["placed"]:
                        break

    got.fit(loader, epochs=4, verbose=0, shuffle=False, callbacks=[Churn()])
    out["loads"] = loader.stats()["loads"]
    out["states"] = sorted(a["state"] for a in backend.actors())
    out["new_actors_loaded"] = sorted(a["loads"] > 0 for a in backend.actors())
out["same_weights"] = all(np.allclose(a, b, rtol=1e-6) for a, b in zip(got.get_weights(), want.get_weights()))
out["actors_after"] = until(lambda: loaders_actors() == 0) and loaders_actors()
print("RESULT " + json.dumps(out), flush=True)
"""


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start_cmd(args):
    """`ray start --block ...` with free ports for what two nodes of one host would share."""
    ports = [f"--dashboard-agent-listen-port={_free_port()}", f"--metrics-export-port={_free_port()}",
             f"--runtime-env-agent-port={_free_port()}", f"--dashboard-agent-grpc-port={_free_port()}"]
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    return [ray_cli if os.path.exists(ray_cli) else "ray", "start", "--block", "--node-ip-address=127.0.0.1", *ports, *args]


def _ray_start(cmd, env, log):
    """Runs `cmd` in a session of its own: the node's processes (raylet, workers, actors)
    are in its process group, so that killing the group kills the node (as a host that
    died) and nothing else on this machine (never `ray stop`)."""
    return subprocess.Popen(cmd, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)


def _start_node(cmd, env, log_path, procs, within_s=180.0):
    """Starts a node (`_ray_start`) and waits until `ray start` says it runs; a start that
    failed (a loaded machine can time it out) is tried once more."""
    for _ in range(2):
        with open(log_path, "w") as log:
            proc = _ray_start(cmd, env, log)
        procs.append(proc)
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and proc.poll() is None:
            with open(log_path) as f:
                if "Ray runtime started" in f.read():
                    return
            time.sleep(0.5)
        if proc.poll() is None:
            return  # (not said within the deadline: the driver's wait for 3 nodes decides)
    with open(log_path) as f:
        raise AssertionError(f"`ray start` failed twice: {f.read()[-3000:]}")


def test_a_ray_start_cluster_with_token_auth_loses_a_node_at_full_capacity_and_gets_it_back(tmp_path):
    import json
    import shutil
    import signal
    import tempfile
    import uuid

    import psutil

    temp_dir = tempfile.mkdtemp(prefix="kpr", dir="/tmp")  # (short: Ray's socket paths have a length limit)
    port = _free_port()
    # Token authentication, as the README says: every host (and the trainer) RAY_AUTH_MODE=token and the token
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex, RAY_USAGE_STATS_ENABLED="0",
               # (Ray's notice of a dead node, shortened: about 15 s by default)
               RAY_health_check_initial_delay_ms="0", RAY_health_check_period_ms="500",
               RAY_health_check_failure_threshold="3")
    pgid_file = tmp_path / "pgids"
    procs = []
    try:
        _start_node(_ray_start_cmd(["--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false",
                                    f"--dashboard-port={_free_port()}", f"--ray-client-server-port={_free_port()}",
                                    f"--temp-dir={temp_dir}", "--disable-usage-stats"]), env, tmp_path / "head.log", procs)
        node_args = [f"--address=127.0.0.1:{port}", "--num-cpus=2", '--resources={"preprocess": 2}']
        for i in range(2):  # (one after the other: two at once time out on a loaded machine)
            _start_node(_ray_start_cmd(node_args), env, tmp_path / f"node{i}.log", procs)
        env_driver = dict(env, RAY_ADDRESS=f"127.0.0.1:{port}", TF_CPP_MIN_LOG_LEVEL="2")
        node_cmd = _ray_start_cmd(node_args)  # (what a returning node runs: the driver starts it)
        tests = os.path.dirname(os.path.abspath(__file__))
        driver = subprocess.run([sys.executable, "-c", _CLI_DRIVER, tests, str(procs[-1].pid), json.dumps(node_cmd),
                                 str(pgid_file)], env=dict(env_driver, PYTHONPATH=os.pathsep.join(
                                     [os.path.dirname(tests), os.environ.get("PYTHONPATH", "")])),
                                capture_output=True, text=True, timeout=420)
        result = [line for line in driver.stdout.splitlines() if line.startswith("RESULT ")]
        assert result, driver.stdout[-2000:] + driver.stderr[-4000:]
        out = json.loads(result[0][len("RESULT "):])
        assert out == {"lost": True, "starting_before_return": 2, "placed": True, "loads": 32,
                       "states": ["live"] * 4, "new_actors_loaded": [True] * 4, "same_weights": True,
                       "actors_after": 0}, out
    finally:
        pgids = [p.pid for p in procs] + ([int(x) for x in pgid_file.read_text().split()] if pgid_file.exists() else [])
        for pgid in pgids:  # this cluster's nodes, each a process group: nothing else on the machine
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait(timeout=30)
        mine = [p.pid for p in psutil.process_iter(["cmdline"]) if temp_dir in " ".join(p.info["cmdline"] or [])]
        for pid in mine:  # (anything of this cluster's session that left its group)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)
