"""Parameter-server roles from `TF_CONFIG`: the chief's strategy, and the servers (imports TensorFlow).

NOTE [ Parameter-server roles and server lifetime ]
---------------------------------------------------
A parameter-server job runs one script in every role; `auto_strategy()` sends each task
its own way::

    chief   -> ParameterServerStrategy + ClusterCoordinator, returned (ps_fit trains)
    worker  -> tf.distribute.Server(job "worker"), serve_until_chief_exits()  (no return)
    ps      -> tf.distribute.Server(job "ps"),     serve_until_chief_exits()  (no return)

Workers and parameter servers hold no state of their own beyond the variables the chief
places on them, so they serve until the job ends. TensorFlow gives a server no way to
learn that (`Server.join()` blocks forever), so a server process watches the chief's
address instead: the chief's eager context listens on its `TF_CONFIG` port once it
connects to the cluster. The watcher connects every `_CHIEF_POLL_S`; after it has seen
the chief once, `_CHIEF_GONE_CHECKS` refused connections in a row end the process with
exit status 0 (`os._exit`, so no thread of TensorFlow's can keep it alive). A chief that
never appears ends it after `KPIPE_PS_CHIEF_WAIT_S` seconds (default 600) with status 1.
`kpipe launch` also stops the servers as soon as the chief exits.

Thread pools: a worker's server runs the closures of the coordinator's function on its
inter-op pool, and each running closure blocks a thread while it waits for variable
reads and writes of other tasks. With fewer than `workers + 1` inter-op threads the
servers deadlock (measured: `inter_op_parallelism_threads=1`, 2 workers, nothing runs),
and TensorFlow's default is the number of cores, 2 on a small machine. Servers get
`max(cores, workers + 1)`.
"""

import logging
import os
import socket
import sys
import time

import tensorflow as tf

from kpipe.distribute._cluster import ClusterInfo, cluster_info

logger = logging.getLogger("kpipe.distribute")

_CHIEF_POLL_S = 1.0
_CHIEF_GONE_CHECKS = 3
_CONNECT_TIMEOUT_S = 2.0
_CHIEF_WAIT_ENV = "KPIPE_PS_CHIEF_WAIT_S"
_CHIEF_WAIT_DEFAULT_S = 600.0


def is_ps_cluster(info: ClusterInfo) -> bool:
    """Whether `info` describes a parameter-server job (its cluster lists `ps` tasks)."""
    return bool(info.cluster.get("ps"))


def check_ps_cluster(info: ClusterInfo) -> None:
    """Raises `ValueError` when a cluster with `ps` tasks cannot run parameter-server training."""
    problems = []
    if len(info.cluster.get("chief", ())) != 1:
        problems.append(("it has no `chief` task", 'Add "chief": ["host:port"]: the chief '
                         "coordinates parameter-server training (kpipe launch --ps M adds one)."))
    if not info.cluster.get("worker"):
        problems.append(("it has no `worker` task", 'Add "worker": ["host:port", ...].'))
    if problems:
        what, fix = problems[0]
        raise ValueError(f"TF_CONFIG lists `ps` tasks but {what}. Received: cluster="
                         f"{dict((k, list(v)) for k, v in info.cluster.items())}. {fix}")


def server_thread_count(num_workers: int) -> int:
    """Inter-op threads for a worker or ps server: `max(cores, num_workers + 1)` (see NOTE)."""
    return max(os.cpu_count() or 1, num_workers + 1)


def start_server(info: ClusterInfo) -> "tf.distribute.Server":
    """Starts this worker's or parameter server's `tf.distribute.Server` with enough threads."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    config = tf.compat.v1.ConfigProto()
    config.inter_op_parallelism_threads = server_thread_count(len(info.cluster["worker"]))
    return tf.distribute.Server(resolver.cluster_spec(), job_name=info.task_type,
                                task_index=info.task_index,
                                protocol=info.rpc_layer or "grpc", config=config, start=True)


def _reachable(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


def watch_chief(address: str, *, poll_s: float = _CHIEF_POLL_S,
                gone_checks: int = _CHIEF_GONE_CHECKS, wait_s: float = _CHIEF_WAIT_DEFAULT_S,
                reachable=_reachable, clock=time.monotonic, sleep=time.sleep) -> int:
    """Blocks while the chief at `address` runs; returns 0 once it is gone, 1 if it never came.

    `reachable`, `clock` and `sleep` are injectable for tests.
    """
    started = clock()
    seen, misses = False, 0
    while True:
        if reachable(address):
            seen, misses = True, 0
        elif seen:
            misses += 1
            if misses >= gone_checks:
                return 0
        elif clock() - started > wait_s:
            return 1
        sleep(poll_s)


def serve_until_chief_exits(info: ClusterInfo):
    """Runs this `worker`/`ps` task's server until the chief is gone, then ends the process."""
    server = start_server(info)
    chief = info.cluster["chief"][0]
    wait_s = float(os.environ.get(_CHIEF_WAIT_ENV, _CHIEF_WAIT_DEFAULT_S))
    logger.info("auto_strategy: %s %d serves parameter-server training at %s (%d inter-op "
                "threads) until the chief at %s exits.", info.task_type, info.task_index,
                server.target, server_thread_count(len(info.cluster["worker"])), chief)
    status = watch_chief(chief, wait_s=wait_s)
    if status:
        print(f"kpipe: {info.task_type} {info.task_index}: the chief at {chief} did not start "
              f"within {wait_s:.0f} s ({_CHIEF_WAIT_ENV}); stopping.", file=sys.stderr)
    else:
        logger.info("auto_strategy: the chief at %s is gone; %s %d stops.", chief,
                    info.task_type, info.task_index)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # noqa: SLF001 -- TensorFlow's server threads must not keep it alive


def chief_strategy(info: ClusterInfo):
    """The chief's `tf.distribute.ParameterServerStrategy`, with `.coordinator` set."""
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    strategy.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    logger.info("auto_strategy: ParameterServerStrategy with a ClusterCoordinator, because "
                "TF_CONFIG lists %d ps and %d worker task(s); train with "
                "kpipe.distribute.ps_fit().", len(info.cluster["ps"]), len(info.cluster["worker"]))
    return strategy


def ps_strategy_for_this_task():
    """What `auto_strategy()` does in a cluster with `ps` tasks (see NOTE)."""
    info = cluster_info()
    check_ps_cluster(info)
    if info.task_type == "chief":
        return chief_strategy(info)
    if info.task_type in ("worker", "ps"):
        serve_until_chief_exits(info)
    raise ValueError(
        f"auto_strategy() has nothing to run for task type {info.task_type!r} in a "
        "parameter-server cluster. Received: task="
        f"{{'type': {info.task_type!r}, 'index': {info.task_index}}}. Run side-by-side "
        "evaluation yourself (load the chief's checkpoints), or drop the evaluator task.")
