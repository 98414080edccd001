"""`auto_strategy()` and the repaired `MultiWorkerMirroredStrategy` (imports TensorFlow).

NOTE [ Keras 3 fit() under MultiWorkerMirroredStrategy ]
--------------------------------------------------------
Keras 3 (checked up to 3.15, keras-team/keras#20585, tensorflow/tensorflow#72388) calls
`Strategy.reduce` in two ways that `tf.distribute.MultiWorkerMirroredStrategy` rejects:

1. `TensorFlowTrainer._maybe_symbolic_build` builds the model from the first batch with
   `strategy.reduce("MEAN", <tuple/dict of PerReplica>, axis=None)`. MWMS converts its
   argument to one tensor and fails ("Attempt to convert a value (PerReplica...)").
   The batch is only used for its shapes, so a nest is answered with each leaf's first
   local value, without communication.
2. `reduce_per_replica(..., "mean")` reduces every per-step log with
   `strategy.reduce("MEAN", v, axis=0)`; the logs are scalars ("Invalid reduction
   dimension 0 for input with 0 dimensions"). A scalar has no batch axis, so `axis=0`
   on a rank-0 value is treated as `axis=None`: the mean over replicas, which is what
   Keras computes for one machine.

Both overrides only act where the stock method raises, so they are inert once Keras
stops making these calls. `tests/test_distribute_multiworker.py` keeps a strict xfail on
the stock strategy: when it starts passing, upstream is fixed.

Under more than one worker, each replica's training loss is weighted so that a step's
gradient is its global batch's however unevenly its rows are split over the replicas
(a short last batch, a shard's pad): see the NOTE in `_global_batch.py`.

The subclass also (a) feeds *presharded* inputs (see `_sharding.py`) to this worker's
replicas without auto-sharding or splitting the global batch across workers, (b) raises
a clear error for an unseeded shuffle that every worker would draw differently, and
(c) raises a clear error for a step traced inside a `tf.while_loop` under multi-worker
training. From Keras 3.7, `steps_per_execution=k > 1` with a `tf.data` input is such a
loop over `get_next_as_optional` of the distributed iterator, and TensorFlow fails in it
("You must feed a value for placeholder tensor 'while/cond/Placeholder'", TF 2.16-2.21).
kpipe's epoch iterator (`kpipe/_keras_hook.py`, `_StepsInPython`) gives Keras a Python
iterator there instead, so Keras runs the k steps as k calls of its compiled one-step
function -- the loop Keras < 3.7 always ran, and the one a `ProcessLoader` feed takes:
the same steps, the same weights. The error is left for a caller that drives Keras's
in-graph loop itself (`model.train_function(iter(distributed_dataset))`).
"""

import logging
from typing import Optional, Sequence

import tensorflow as tf

from kpipe import _compat, _devices, _keras_hook
from kpipe.distribute import _global_batch, _sharding
from kpipe.distribute._cluster import cluster_info

_keras_hook.install()
_compat.install_keras_fixes()  # Keras < 3.8 loss per replica, < 3.10 epoch logs (kpipe/_compat.py)
_global_batch.install()  # short and missing batches weighted to the global batch's loss

logger = logging.getLogger("kpipe.distribute")

_COMMUNICATION = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """`tf.distribute.MultiWorkerMirroredStrategy` that Keras 3 `fit()` can train with.

    A drop-in subclass (`isinstance(s, tf.distribute.MultiWorkerMirroredStrategy)` holds);
    see the NOTE in this module for what it changes. Create it at program start, before
    any other TensorFlow operation, on every worker, like the stock class. Not to be
    shared across processes.

    Args:
        cluster_resolver: Defaults to `None` (read `TF_CONFIG`).
        communication_options: A `tf.distribute.experimental.CommunicationOptions`.
            Defaults to `None` (TensorFlow's choice).

    Example (run one copy per worker, e.g. with `kpipe launch --workers 2 -- python t.py`):

        keras.utils.set_random_seed(0)  # the same on every worker: fit()'s shuffle draws one order
        strategy = kpipe.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = build_model()
            model.compile("sgd", "mse")
        model.fit(x, y, batch_size=64)   # 64 = global batch, split over the workers
    """

    def __init__(self, cluster_resolver=None, communication_options=None):
        super().__init__(cluster_resolver=cluster_resolver,
                         communication_options=communication_options)
        spec = self.cluster_resolver.cluster_spec().as_dict()
        self._kpipe_num_workers = max(1, len(spec.get("chief", ())) + len(spec.get("worker", ())))

    @property
    def num_workers(self) -> int:
        """Number of training processes (chief plus workers)."""
        return self._kpipe_num_workers

    def reduce(self, reduce_op, value, axis=None):
        if tf.nest.is_nested(value):  # Keras's symbolic build: shapes of the first batch
            return tf.nest.map_structure(self._first_local_value, value)
        if axis is not None and _static_rank(self._first_local_value(value)) == 0:
            axis = None  # a scalar log has no batch axis: average over replicas
        return super().reduce(reduce_op, value, axis)

    def run(self, fn, args=(), kwargs=None, options=None):
        if self._kpipe_num_workers > 1:
            _check_steps_per_execution(fn, self._kpipe_num_workers)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def experimental_distribute_dataset(self, dataset, options=None):
        if self._kpipe_num_workers > 1 and isinstance(dataset, tf.data.Dataset):
            # A sharded PyDataset arrives marked too: see kpipe/_keras_hook.py.
            if _sharding.dataset_is_marked_presharded(dataset):
                return self._distribute_presharded(dataset, options)
            _check_shuffles(dataset, self._kpipe_num_workers)
        return super().experimental_distribute_dataset(dataset, options)

    def _distribute_presharded(self, dataset, options):
        local_replicas = self.num_replicas_in_sync // self._kpipe_num_workers
        if local_replicas > 1:
            # Split each per-worker batch over this worker's replicas (and only those).
            from tensorflow.python.data.experimental.ops import distribute as tf_data_dist

            dataset = tf_data_dist._LegacyRebatchDataset(dataset, local_replicas)  # noqa: SLF001
        return self.distribute_datasets_from_function(lambda _: dataset, options)

    def _first_local_value(self, value):
        if isinstance(value, tf.distribute.DistributedValues):
            return self.experimental_local_results(value)[0]
        return value


def _keras_version() -> str:
    try:
        from importlib.metadata import version

        return version("keras")
    except Exception:  # noqa: BLE001 -- only for the log line
        return "?"


def _static_rank(value) -> Optional[int]:
    shape = getattr(value, "shape", None)
    return None if shape is None else shape.rank


def _check_steps_per_execution(fn, num_workers: int) -> None:
    owner = getattr(fn, "__self__", None)  # Keras passes `model.train_step` & co.
    steps = getattr(owner, "steps_per_execution", 1)
    if isinstance(steps, int) and steps > 1 and _in_while_loop():
        raise ValueError(
            f"This step runs inside a tf.while_loop over a distributed iterator, which "
            f"fails in TensorFlow under multi-worker training ({num_workers} workers). "
            f"Received: steps_per_execution={steps} and an iterator of a "
            "`tf.distribute.DistributedDataset` passed to Keras's compiled function "
            "directly. Call fit()/evaluate()/predict(), which run the steps as a Python "
            "loop under kpipe's strategy, or compile with steps_per_execution=1.")


def _in_while_loop() -> bool:
    """Whether the graph being traced is, or is called from, a `tf.while_loop` body."""
    try:
        from tensorflow.python.ops.control_flow_util_v2 import WhileBodyFuncGraph
    except ImportError:  # pragma: no cover -- present in every supported TensorFlow
        return False
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if isinstance(graph, WhileBodyFuncGraph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _check_shuffles(dataset, num_workers: int) -> None:
    policy = dataset.options().experimental_distribute.auto_shard_policy
    off_or_hint = (tf.data.experimental.AutoShardPolicy.OFF,
                   tf.data.experimental.AutoShardPolicy.HINT)
    if policy in off_or_hint:
        return
    if policy == tf.data.experimental.AutoShardPolicy.AUTO and _sharding.reads_files(dataset):
        return
    problems = _sharding.unseeded_shuffles(dataset)
    if problems:
        raise ValueError(
            f"The input pipeline shuffles without a seed: {'; '.join(sorted(set(problems)))}. "
            f"Under multi-worker training ({num_workers} workers) each worker takes its "
            "share of one common order; unseeded, every worker draws a different order, so "
            "samples are repeated and dropped. Call `keras.utils.set_random_seed(seed)` "
            "with the same seed on every worker before building the input (or pass "
            "`seed=` to the shuffle), or shard the input yourself (kpipe.ProcessLoader "
            "with num_shards/shard_index, or kpipe.distribute.mark_presharded).")


def auto_strategy(*, devices: Optional[Sequence[str]] = None, communication: str = "auto"):
    """Picks the distribution strategy for this process and logs why.

    * `TF_CONFIG` lists `ps` tasks: parameter-server training. On the `chief`, a
      `tf.distribute.ParameterServerStrategy` whose `coordinator` attribute holds its
      `ClusterCoordinator` (train with `kpipe.distribute.ps_fit`); on `worker` and `ps`
      tasks, this starts the task's TensorFlow server and serves until the chief exits,
      then ends the process: it does not return, so one script runs in every role.
    * `TF_CONFIG` lists more than one training process: kpipe's repaired
      `MultiWorkerMirroredStrategy` (one replica per local GPU, or the CPU).
    * `devices` given, or more than one GPU visible: `tf.distribute.MirroredStrategy`.
    * otherwise: TensorFlow's default strategy (no distribution).

    Call it at program start, before other TensorFlow work (multi-worker collectives
    must be configured before the runtime starts).

    Args:
        devices: Devices for `MirroredStrategy`, e.g. `["/cpu:0", "/cpu:1"]`. Defaults
            to `None` (all GPUs when there are several).
        communication: Multi-worker all-reduce: `"auto"`, `"ring"` (gRPC ring, works on
            CPUs) or `"nccl"` (GPUs). Defaults to `"auto"`. Ignored on one machine,
            where `MirroredStrategy` picks NCCL on GPUs itself.

    Returns:
        A `tf.distribute.Strategy`.

    Raises:
        kpipe.distribute.DeviceNotFoundError: `devices` names a device this process does
            not have (the message lists those found and how to create logical devices).
        ValueError: `communication` is unknown, `devices` is given under a multi-worker
            `TF_CONFIG`, or a cluster with `ps` tasks lacks a chief or workers (or this
            task is its evaluator).
        kpipe.distribute.TFConfigError: `TF_CONFIG` is malformed.

    Example:

    >>> import kpipe
    >>> strategy = kpipe.distribute.auto_strategy()   # no TF_CONFIG, one device
    >>> strategy.num_replicas_in_sync
    1
    """
    if communication not in _COMMUNICATION:
        raise ValueError(f"`communication` must be one of {sorted(_COMMUNICATION)}. "
                         f"Received: communication={communication!r}.")
    info = cluster_info()
    if info.cluster.get("ps"):
        from kpipe.distribute import _ps

        return _ps.ps_strategy_for_this_task()
    if info.is_multi_worker and info.worker_index is not None:
        if devices is not None:
            raise ValueError(f"`devices` cannot be chosen under a multi-worker TF_CONFIG. "
                             f"Received: devices={list(devices)}. Each worker uses all its "
                             "GPUs (or its CPU); limit them with CUDA_VISIBLE_DEVICES.")
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=_COMMUNICATION[communication])
        strategy = MultiWorkerMirroredStrategy(communication_options=options)
        logger.info("auto_strategy: MultiWorkerMirroredStrategy (kpipe-repaired for Keras "
                    "%s fit()), communication=%s, because TF_CONFIG lists %d training "
                    "processes; this is %s %d (worker %d of %d), %d replica(s) in sync.",
                    _keras_version(), communication,
                    info.num_workers, info.task_type, info.task_index, info.worker_index,
                    info.num_workers, strategy.num_replicas_in_sync)
        return strategy
    if devices is not None:
        devices = _devices.check_devices(devices)  # (a missing device makes fit() hang, not fail)
        strategy = tf.distribute.MirroredStrategy(devices=devices)
        logger.info("auto_strategy: MirroredStrategy over the devices given: %s.",
                    list(devices))
        return strategy
    gpus = tf.config.list_logical_devices("GPU")
    if len(gpus) > 1:
        strategy = tf.distribute.MirroredStrategy()
        logger.info("auto_strategy: MirroredStrategy because %d GPUs are visible.", len(gpus))
        return strategy
    why = "the TF_CONFIG task is not a training task" if info.task_type else "no TF_CONFIG"
    logger.info("auto_strategy: default strategy (%s, %d GPU(s) visible).", why, len(gpus))
    return tf.distribute.get_strategy()
