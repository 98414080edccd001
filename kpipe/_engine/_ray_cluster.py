"""What `kpipe.RayWorkers(...)` asks for, and how a loader reaches the Ray cluster: an
`address` (or `RAY_ADDRESS`) it connects to and leaves running, or a local instance it
starts and shuts down with the last loader using it (the NOTE in `_ray.py`)."""

import dataclasses
import os
import socket
import threading
from typing import Optional, Union

from kpipe.errors import LoaderError

_CONNECT_LOCK = threading.Lock()
_STARTED = {"count": 0, "by_kpipe": False}  # loaders using a Ray instance kpipe started
_WORKERS_PER_CPU = 8  # actors reserving no resource, per CPU of a node (as `_autoscale.WORKERS_PER_CPU`)


@dataclasses.dataclass(frozen=True)
class RayWorkers:
    """Loader workers as Ray actors, for `ProcessLoader(dataset, workers=RayWorkers(...))`.

    Args:
        count: Actors loading batches, or `"auto"`: kpipe starts 2 and adds or retires
            actors from measured timings, as `workers="auto"` does with processes (the
            NOTE in `_autoscale.py`), within what the cluster's live nodes can place for
            `num_cpus`/`resources` and `max_count`.
        address: The Ray cluster to connect to (`"auto"`, `"ray://host:10001"`, ...).
            Defaults to None: `RAY_ADDRESS` if set, else a local Ray instance that kpipe
            starts for the loader and shuts down with the last loader using it.
        num_cpus: CPUs each actor reserves. Defaults to 1.
        resources: Custom resources each actor needs, e.g. `{"preprocess": 1}` to place
            actors only on nodes started with that resource. Defaults to None.
        max_count: With `count="auto"`, the most actors. Defaults to None: what the
            cluster can place (at most 64).

    Example (needs `pip install "kpipe[ray]"` and nodes started with the resource):

        # The Ray this process initialized is used, else `address=` or RAY_ADDRESS, else a new
        # local instance; CPU nodes started with `ray start --resources='{"preprocess": 4}'`:
        loader = kpipe.ProcessLoader(Images(...), workers=kpipe.RayWorkers(4, resources={"preprocess": 1}))
        model.fit(loader, epochs=2)
        loader.close()
    """

    count: Union[int, str]
    address: Optional[str] = None
    num_cpus: float = 1
    resources: Optional[dict] = None
    max_count: Optional[int] = None

    def __post_init__(self):
        if self.count != "auto" and (isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1):
            raise ValueError(f"`count` must be an int >= 1 (actors) or 'auto'. Received: count={self.count!r}.")
        if self.max_count is not None and (isinstance(self.max_count, bool) or not isinstance(self.max_count, int)
                                           or self.max_count < 1 or self.count != "auto"):
            raise ValueError(f"`max_count` bounds count='auto' and must be an int >= 1. Received: count={self.count!r}, "
                             f"max_count={self.max_count!r}.")
        if not isinstance(self.num_cpus, (int, float)) or isinstance(self.num_cpus, bool) or self.num_cpus < 0:
            raise ValueError(f"`num_cpus` must be a number >= 0. Received: num_cpus={self.num_cpus!r}.")
        if self.resources is not None and (not isinstance(self.resources, dict) or not all(
                isinstance(k, str) and isinstance(v, (int, float)) and v > 0 for k, v in self.resources.items())):
            raise ValueError(f"`resources` must map resource names to positive amounts, e.g. {{'preprocess': 1}}. "
                             f"Received: resources={self.resources!r}.")


def ray_module():
    try:
        import ray
    except ImportError:
        raise LoaderError("RayWorkers needs Ray: pip install 'kpipe[ray]' (or `pip install ray`).") from None
    return ray


def connect(address, timeout):
    """Connects this process to Ray (or starts a local instance). Returns whether kpipe
    started it (then `disconnect` shuts it down with its last user)."""
    ray = ray_module()
    with _CONNECT_LOCK:
        if ray.is_initialized():
            if _STARTED["by_kpipe"]:
                _STARTED["count"] += 1
            return _STARTED["by_kpipe"]
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            _check_reachable(address, timeout)  # (ray.init retries an unreachable address for minutes)
        try:
            if address:
                ray.init(address=address, logging_level="WARNING", log_to_driver=False)
            else:
                # "local": a new instance, not one `ray.init()` would find on this machine (a
                # `ray start` cluster is used only when asked for: address= or RAY_ADDRESS)
                ray.init(address="local", logging_level="WARNING", log_to_driver=False, include_dashboard=False)
        except Exception as exc:
            where = f"the Ray cluster at address={address!r}" if address else "a local Ray instance"
            raise LoaderError(f"Could not connect to {where}: {type(exc).__name__}: {exc}. Start it "
                              "(`ray start --head` on the trainer host) or pass RayWorkers(address=...).") from exc
        _STARTED["by_kpipe"] = not address
        _STARTED["count"] = 1 if not address else 0
        return _STARTED["by_kpipe"]


def _check_reachable(address, timeout):
    """A `LoaderError` within `timeout` (10 s at most) where nothing answers at the
    address's host and port (Ray's GCS port, 6379 when none is given)."""
    if address in ("auto", "local"):
        return  # (Ray finds the local cluster itself, or says at once that there is none)
    where = address.split("://", 1)[-1].rstrip("/")
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit():
        host, port = where, "6379"
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=min(timeout or 10.0, 10.0)).close()
    except OSError as exc:
        raise LoaderError(
            f"Could not connect to the Ray cluster at address={address!r}: nothing answers at {host}:{port} "
            f"({type(exc).__name__}: {exc}). Start it (`ray start --head` on that host), or check the address "
            "(`ray status` on the head node prints it)."
        ) from None


def disconnect(started):
    if not started:
        return
    ray = ray_module()
    with _CONNECT_LOCK:
        _STARTED["count"] -= 1
        if _STARTED["count"] <= 0 and _STARTED["by_kpipe"] and ray.is_initialized():
            ray.shutdown()
            _STARTED["by_kpipe"] = False


def capacity(spec):
    """`(cpus, actors)`: the CPUs of the live nodes where actors of `spec` (a
    `RayWorkers`: `num_cpus`, `resources`) fit, and how many of them those nodes hold in
    all -- what `RayWorkers("auto")` may use (see the NOTE in `_autoscale.py`). Actors
    that reserve nothing count 8 per CPU, as I/O-bound processes do."""
    need = dict(spec.resources or {})
    if spec.num_cpus:
        need["CPU"] = spec.num_cpus
    cpus, actors = 0.0, 0
    for node in ray_module().nodes():
        have = node.get("Resources") or {}
        if not node.get("Alive") or any(have.get(k, 0) < v for k, v in need.items()):
            continue
        node_cpus = float(have.get("CPU", 0))
        fit = min((int(have.get(k, 0) // v + 1e-9) for k, v in need.items()), default=None)
        if fit is None:
            fit = int(_WORKERS_PER_CPU * max(1.0, node_cpus))
        actors += fit
        cpus += min(node_cpus, fit * max(1.0, float(spec.num_cpus)))
    return cpus, actors


def describe(resources):
    """Ray resources as `CPU=2, spot=1` (the per-node `node:...` markers left out)."""
    return ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items()) if not k.startswith("node:")) or "nothing"
