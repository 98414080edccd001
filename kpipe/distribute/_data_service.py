"""tf.data service: move `tf.data` preprocessing to CPU-only processes or hosts.

Thin helpers over TensorFlow's own servers (`tf.data.experimental.service`): a
dispatcher hands out work, workers run the input pipeline, the trainer reads batches
over gRPC. `kpipe data-service dispatcher|worker` wraps the two servers; `distribute`
sends a `tf.data.Dataset` (for example a `kpipe.data.pipeline`) through them.

TensorFlow's servers listen on every interface of their host, and cannot be told
otherwise: `GrpcDataServerBase::Start` (tensorflow/core/data/service/server_lib.cc)
listens on `"0.0.0.0:" + port`, and `DispatcherConfig`/`WorkerConfig` have no bind
address (`WorkerConfig.worker_address` is only what the worker *advertises* to the
dispatcher and to readers). The pip build registers one protocol, insecure `"grpc"`
(asking for `"grpc+local"` fails: "No credentials factory has been registered for
protocol grpc+local. The available types are: [ grpc ]"). kpipe advertises `127.0.0.1` unless an address is
given, and `start_dispatcher`/`start_worker` issue an `OpenPortsWarning` naming the port
when the server listens on every interface; fence it with a firewall (docs/security.md).
Imports TensorFlow lazily, inside the functions.
"""

import os
import warnings
from typing import Optional

from kpipe.distribute._ports import (OpenPortsWarning, open_ports_message, outside_interfaces,
                                        wildcard_listeners)

_PROCESSING_MODES = ("parallel_epochs", "distributed_epoch")


def start_dispatcher(port: int = 0, *, work_dir: Optional[str] = None):
    """Starts a tf.data service dispatcher in this process.

    Args:
        port: TCP port; 0 picks a free one. Defaults to 0.
        work_dir: Directory where the dispatcher journals its state, so a restarted
            dispatcher resumes its jobs. Defaults to `None` (state kept in memory).

    Returns:
        The running `tf.data.experimental.service.DispatchServer`; its `target` is
        `"grpc://localhost:<port>"`. It stops when garbage-collected or at exit.

    Raises:
        ValueError: `port` is out of range.

    Warns:
        OpenPortsWarning: The server listens on every network interface (it always
            does with TensorFlow's gRPC server; see the module docstring).

    Example:

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     d = start_dispatcher()
    >>> d.target.startswith("grpc://"), [type(w.message).__name__ for w in caught]
    (True, ['OpenPortsWarning'])
    """
    _check_port(port)
    import tensorflow as tf

    config = tf.data.experimental.service.DispatcherConfig(
        port=port, protocol="grpc", work_dir=work_dir, fault_tolerant_mode=work_dir is not None)
    server = tf.data.experimental.service.DispatchServer(config)
    _warn_if_open("tf.data service dispatcher", int(server.target.rsplit(":", 1)[1]))
    return server


def start_worker(dispatcher: str, port: int = 0, *, host: str = "127.0.0.1"):
    """Starts a tf.data service worker in this process and registers it.

    Args:
        dispatcher: The dispatcher's `"host:port"` (a `"grpc://"` prefix is accepted).
        port: TCP port of this worker; 0 picks a free one. Defaults to 0.
        host: Address under which the dispatcher and trainers reach this worker. The
            server listens on every interface whatever it is. Defaults to `"127.0.0.1"`.

    Returns:
        The running `tf.data.experimental.service.WorkerServer`.

    Raises:
        ValueError: `dispatcher` is not `host:port`, or `port` is out of range.

    Warns:
        OpenPortsWarning: The server listens on every network interface.

    Example:

    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", OpenPortsWarning)  # fenced off by a firewall
    ...     d = start_dispatcher()
    ...     w = start_worker(d.target)
    """
    _check_port(port)
    address = _strip_protocol(dispatcher)
    import tensorflow as tf

    if port == 0:
        from kpipe.distribute._ports import free_ports

        port = free_ports(1, host)[0]
    config = tf.data.experimental.service.WorkerConfig(
        dispatcher_address=address, worker_address=f"{host}:{port}", port=port,
        protocol="grpc")
    server = tf.data.experimental.service.WorkerServer(config)
    _warn_if_open("tf.data service worker", port, host)
    return server


def _warn_if_open(what: str, port: int, host: str = "127.0.0.1") -> None:
    """Issues an `OpenPortsWarning` if this process listens on `port` on every interface."""
    if any(p == port for _, _, p in wildcard_listeners([os.getpid()])):
        interfaces = outside_interfaces()
        if interfaces:
            warnings.warn(OpenPortsWarning(open_ports_message(what, [port], host, interfaces)),
                          stacklevel=3)


def via_data_service(dataset, service: str, *, processing_mode: str = "distributed_epoch",
               job_name: Optional[str] = None):
    """Sends `dataset` through a tf.data service.

    The service workers run `dataset`'s pipeline; the returned dataset reads their
    output. Build the pipeline (including `batch`) before calling this.

    Args:
        dataset: A `tf.data.Dataset`, e.g. from `kpipe.data.pipeline`.
        service: The dispatcher's `"host:port"` or `"grpc://host:port"`.
        processing_mode: `"distributed_epoch"` (each element produced once per epoch,
            split over the service workers) or `"parallel_epochs"` (each service worker
            produces the whole dataset). Defaults to `"distributed_epoch"`.
        job_name: Readers with the same job name share one job, so elements are split
            among them (e.g. one job for all training workers). Defaults to `None`
            (each reader gets its own job).

    Returns:
        A `tf.data.Dataset` with the same element spec. Its cardinality is unknown; pass
        `steps_per_epoch` to `fit()` if needed.

    Raises:
        ValueError: `processing_mode` is unknown or `service` is not `host:port`.

    On a cluster, pass the dispatcher's `"host:port"` (e.g. `"10.0.0.5:5050"`) and give the
    result to `fit()`.

    Example (a dispatcher and a worker in this process):

    >>> import warnings, numpy as np, kpipe
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", kpipe.distribute.OpenPortsWarning)
    ...     d = kpipe.distribute.start_dispatcher()
    ...     w = kpipe.distribute.start_worker(d.target)
    >>> ds = kpipe.data.pipeline(kpipe.data.from_numpy(np.arange(8)), batch_size=4)
    >>> ds = kpipe.distribute.via_data_service(ds, d.target)
    >>> [b.tolist() for b in ds.as_numpy_iterator()]
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    if processing_mode not in _PROCESSING_MODES:
        raise ValueError(f"`processing_mode` must be one of {_PROCESSING_MODES}. "
                         f"Received: processing_mode={processing_mode!r}.")
    address = _strip_protocol(service)
    import tensorflow as tf

    return dataset.apply(tf.data.experimental.service.distribute(
        processing_mode=processing_mode, service=f"grpc://{address}", job_name=job_name))


def _strip_protocol(address: str) -> str:
    address = str(address)
    if address.startswith("grpc://"):
        address = address[len("grpc://"):]
    host, sep, port = address.rpartition(":")
    if not (sep and host and port.isdigit()):
        raise ValueError(f"Expected a tf.data service address like 127.0.0.1:5050. "
                         f"Received: {address!r}.")
    return address


def _check_port(port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"`port` must be an integer in [0, 65535]. Received: port={port!r}. "
                         "Use 0 to pick a free port.")
