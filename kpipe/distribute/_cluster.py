"""`cluster_info()` and `default_shard()`: who am I in a multi-worker job, from `TF_CONFIG`.

Nothing here imports TensorFlow: the launcher, the loader and worker processes may call it.
"""

import dataclasses
import json
import os
import threading
from typing import Mapping, Optional, Tuple

TF_CONFIG_ENV = "TF_CONFIG"

# Task types TensorFlow's `TFConfigClusterResolver` knows. `chief` and `worker` train;
# `ps` serves variables (ParameterServerStrategy); `evaluator` evaluates side by side.
_TRAINING_TYPES = ("chief", "worker")
_KNOWN_TYPES = ("chief", "worker", "ps", "evaluator")


class TFConfigError(ValueError):
    """`TF_CONFIG` is not a valid cluster description.

    Raised by `cluster_info()` (and so by everything that reads the cluster:
    `auto_strategy()`, `default_shard()`, `chief_only()`) with what is wrong and an
    example of a valid value.

    Example:

    >>> import kpipe.distribute
    >>> try:
    ...     kpipe.distribute.cluster_info(
    ...         '{"cluster": {"worker": ["h1:2222"]}, "task": {"type": "worker", "index": 3}}')
    ... except kpipe.distribute.TFConfigError as e:
    ...     print(str(e)[:83])
    Invalid `TF_CONFIG`: `task.index` 3 is out of range for the 1 'worker' address(es).
    """


@dataclasses.dataclass(frozen=True)
class ClusterInfo:
    """This process's place in a (possibly one-process) training cluster.

    Instances are immutable and may be shared across threads and processes.

    Attributes:
        cluster: Task type -> tuple of `"host:port"` addresses; empty without `TF_CONFIG`.
        task_type: `"chief"`, `"worker"`, `"ps"`, `"evaluator"`, or `None` without
            `TF_CONFIG`.
        task_index: Index of this task among the tasks of its type.
        num_workers: How many processes train (chief plus workers); 1 without `TF_CONFIG`.
        worker_index: This process's rank among the training processes, in the order
            `MultiWorkerMirroredStrategy` uses for input pipelines (the chief is 0, then
            the workers); `None` for `ps` and `evaluator` tasks.
        is_chief: Whether this process writes checkpoints, logs and saved models: the
            `chief` task, or worker 0 when the cluster has no chief, or the only process.
        rpc_layer: The `rpc_layer` of `TF_CONFIG`, `None` when absent.

    Example:

    >>> import kpipe.distribute
    >>> info = kpipe.distribute.cluster_info(
    ...     '{"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},'
    ...     ' "task": {"type": "worker", "index": 1}}')
    >>> info.num_workers, info.worker_index, info.is_chief, info.address
    (3, 2, False, 'h2:2222')
    """

    cluster: Mapping[str, Tuple[str, ...]]
    task_type: Optional[str]
    task_index: int
    num_workers: int
    worker_index: Optional[int]
    is_chief: bool
    rpc_layer: Optional[str] = None

    @property
    def is_multi_worker(self) -> bool:
        """Whether more than one process trains together."""
        return self.num_workers > 1

    @property
    def address(self) -> Optional[str]:
        """This task's `"host:port"`, `None` without `TF_CONFIG` or outside `cluster`."""
        if self.task_type not in self.cluster:
            return None
        return self.cluster[self.task_type][self.task_index]


_SINGLE_PROCESS = ClusterInfo(
    cluster={}, task_type=None, task_index=0, num_workers=1, worker_index=0, is_chief=True
)

_cache_lock = threading.Lock()
_cache: Tuple[Optional[str], Optional[ClusterInfo]] = (None, None)


def cluster_info(tf_config: Optional[str] = None) -> ClusterInfo:
    """Parses `TF_CONFIG` (or `tf_config`) into a `ClusterInfo`.

    The environment variable is parsed once and the result cached until its value
    changes. Does not import TensorFlow.

    Args:
        tf_config: A `TF_CONFIG` JSON string to parse instead of the environment
            variable. Defaults to `None` (read `os.environ["TF_CONFIG"]`).

    Returns:
        A `ClusterInfo`. Without `TF_CONFIG` (unset or empty), a single process that is
        its own chief: `num_workers=1`, `worker_index=0`, `is_chief=True`.

    Raises:
        TFConfigError: `TF_CONFIG` is not JSON, lacks `cluster` or `task`, names an
            unknown task type, has an index out of range, an address that is not
            `"host:port"`, two tasks with the same address, or a dict-form task list
            whose keys are not the indices 0..n-1. The message names the task and
            quotes the value received.

    Example:

    >>> info = cluster_info('{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},'
    ...                     ' "task": {"type": "worker", "index": 1}}')
    >>> info.num_workers, info.worker_index, info.is_chief
    (2, 1, False)
    """
    global _cache
    if tf_config is not None:
        return _parse(tf_config)
    raw = os.environ.get(TF_CONFIG_ENV, "")
    with _cache_lock:
        cached_raw, cached_info = _cache
        if cached_info is not None and cached_raw == raw:
            return cached_info
        info = _parse(raw)
        _cache = (raw, info)
        return info


def default_shard() -> Optional[Tuple[int, int]]:
    """Returns `(num_shards, shard_index)` for this process under a multi-worker `TF_CONFIG`.

    Loaders call it to load only this worker's share of every epoch: shard `w` of `W`
    gets the batches at positions `w, w + W, ...` of the epoch plan. The index follows
    `MultiWorkerMirroredStrategy`'s input-pipeline order (chief first). Does not import
    TensorFlow.

    Returns:
        `(num_workers, worker_index)` when more than one process trains and this one is
        a chief or worker; `None` otherwise (no `TF_CONFIG`, one worker, `ps` or
        `evaluator` tasks), meaning "load everything".

    Raises:
        TFConfigError: `TF_CONFIG` is malformed (see `cluster_info`).

    Example:

    >>> import os
    >>> os.environ["TF_CONFIG"] = ('{"cluster": {"chief": ["127.0.0.1:2222"], '
    ...     '"worker": ["127.0.0.1:2223"]}, "task": {"type": "worker", "index": 0}}')
    >>> default_shard()
    (2, 1)
    >>> del os.environ["TF_CONFIG"]
    """
    info = cluster_info()
    if info.num_workers > 1 and info.worker_index is not None:
        return info.num_workers, info.worker_index
    return None


def _fail(problem: str, raw: str, fix: str) -> TFConfigError:
    shown = raw if len(raw) <= 300 else raw[:300] + "..."
    return TFConfigError(f"Invalid `TF_CONFIG`: {problem}. Received: TF_CONFIG={shown!r}. {fix}")


def _parse(raw: str) -> ClusterInfo:
    if not raw.strip():
        return _SINGLE_PROCESS
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise _fail(f"it is not valid JSON ({e})", raw,
                    'Expected e.g. {"cluster": {"worker": ["host:port", ...]}, '
                    '"task": {"type": "worker", "index": 0}}.') from None
    if not isinstance(config, dict):
        raise _fail("it must be a JSON object", raw, 'Expected {"cluster": ..., "task": ...}.')
    cluster = _parse_cluster(config.get("cluster"), raw)
    rpc_layer = config.get("rpc_layer")
    task = config.get("task")
    num_tasks = sum(len(addresses) for addresses in cluster.values())
    if task is None or task == {}:
        if num_tasks > 1:
            raise _fail("`task` is missing but the cluster has several tasks", raw,
                        'Add "task": {"type": "worker", "index": i} naming this process.')
        if num_tasks == 0:
            return _SINGLE_PROCESS
        task = {"type": next(iter(cluster)), "index": 0}
    task_type, task_index = _parse_task(task, cluster, raw)
    num_chiefs = len(cluster.get("chief", ()))
    num_workers = num_chiefs + len(cluster.get("worker", ()))
    if task_type == "chief":
        worker_index = 0
    elif task_type == "worker":
        worker_index = num_chiefs + task_index
    else:
        worker_index = None
    is_chief = task_type == "chief" or (task_type == "worker" and num_chiefs == 0
                                        and task_index == 0)
    return ClusterInfo(cluster=cluster, task_type=task_type, task_index=task_index,
                       num_workers=max(num_workers, 1), worker_index=worker_index,
                       is_chief=is_chief, rpc_layer=rpc_layer)


def _parse_cluster(cluster, raw: str) -> Mapping[str, Tuple[str, ...]]:
    if cluster is None:
        raise _fail("`cluster` is missing", raw,
                    'Add "cluster": {"worker": ["host:port", ...]}.')
    if not isinstance(cluster, dict):
        raise _fail(f"`cluster` must be an object, got {type(cluster).__name__}", raw,
                    'Expected "cluster": {"worker": ["host:port", ...]}.')
    parsed = {}
    for task_type, addresses in cluster.items():
        if task_type not in _KNOWN_TYPES:
            raise _fail(f"unknown task type {task_type!r} in `cluster`", raw,
                        f"Use only {', '.join(map(repr, _KNOWN_TYPES))}.")
        if isinstance(addresses, dict):  # TF also accepts {"0": "host:port", ...}
            addresses = _dict_addresses(task_type, addresses, raw)
        if not isinstance(addresses, list):
            raise _fail(f"`cluster[{task_type!r}]` must be a list of \"host:port\" strings", raw,
                        f'Expected "{task_type}": ["host:port", ...].')
        for address in addresses:
            _check_address(address, f"cluster[{task_type!r}]", raw)
        parsed[task_type] = tuple(addresses)
    if len(parsed.get("chief", ())) > 1:
        raise _fail(f"a cluster has at most one chief, got {len(parsed['chief'])}", raw,
                    'Move the extra addresses to "worker".')
    _check_distinct(parsed, raw)
    return parsed


def _dict_addresses(task_type: str, addresses: dict, raw: str) -> list:
    """The dict form `{"0": "host:port", "1": ...}` as a list in index order."""
    by_index = {}
    for key, address in addresses.items():
        index = int(key) if isinstance(key, str) and key.strip().isdigit() else None
        if index is None:
            raise _fail(f"`cluster[{task_type!r}]` has the key {key!r}, which is not a task "
                        "index", raw,
                        f'In the dict form, keys are task indices: "{task_type}": '
                        '{"0": "host:port", "1": "host:port"}; or use a list.')
        if index in by_index:
            raise _fail(f"`cluster[{task_type!r}]` names task {index} twice (keys "
                        f"{by_index[index][0]!r} and {key!r})", raw,
                        "Give each task index one address.")
        by_index[index] = (key, address)
    missing = sorted(set(range(len(by_index))) - set(by_index))
    if missing:
        raise _fail(f"`cluster[{task_type!r}]` has task indices {sorted(by_index)} with "
                    f"{missing[0]} missing", raw,
                    f"Number the {task_type!r} tasks 0 to {len(by_index) - 1} without gaps.")
    return [by_index[i][1] for i in range(len(by_index))]


def _check_distinct(cluster: Mapping[str, Tuple[str, ...]], raw: str) -> None:
    """Every task runs its own server, so no two tasks may share a `host:port`."""
    seen = {}
    for task_type, addresses in cluster.items():
        for index, address in enumerate(addresses):
            where = f"{task_type} {index}"
            if address in seen:
                raise _fail(f"tasks {seen[address]} and {where} both have the address "
                            f"{address!r}", raw,
                            "Give every task its own host:port (each one starts a server "
                            "on its port).")
            seen[address] = where


def _check_address(address, where: str, raw: str) -> None:
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise _fail(f"{where} holds {address!r}, which is not a \"host:port\" address", raw,
                    'Write addresses like "10.0.0.1:2222".')


def _parse_task(task, cluster, raw: str) -> Tuple[str, int]:
    if not isinstance(task, dict):
        raise _fail(f"`task` must be an object, got {type(task).__name__}", raw,
                    'Expected "task": {"type": "worker", "index": 0}.')
    task_type, task_index = task.get("type"), task.get("index", 0)
    if task_type not in _KNOWN_TYPES:
        raise _fail(f"unknown task type {task_type!r}", raw,
                    f"Use one of {', '.join(map(repr, _KNOWN_TYPES))}.")
    if task_type == "evaluator" and task_type not in cluster:
        # TensorFlow's side-by-side evaluator is not part of the training cluster.
        return _checked_index(task_index, None, task_type, raw)
    if task_type not in cluster:
        raise _fail(f"task type {task_type!r} has no addresses in `cluster`", raw,
                    f'Add "{task_type}": ["host:port", ...] to "cluster".')
    return _checked_index(task_index, len(cluster[task_type]), task_type, raw)


def _checked_index(task_index, count: Optional[int], task_type: str, raw: str):
    if isinstance(task_index, str) and task_index.isdigit():
        task_index = int(task_index)
    if isinstance(task_index, bool) or not isinstance(task_index, int):
        raise _fail(f"`task.index` must be an integer, got {task_index!r}", raw,
                    'Expected "index": 0.')
    if task_index < 0 or (count is not None and task_index >= count):
        upper = "" if count is None else f" for the {count} {task_type!r} address(es)"
        valid = "a non-negative index" if count is None else f"an index in [0, {count - 1}]"
        raise _fail(f"`task.index` {task_index} is out of range{upper}", raw, f"Use {valid}.")
    return task_type, task_index
