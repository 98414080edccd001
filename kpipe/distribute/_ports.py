"""Which ports a local job's servers listen on, and free ports to give them.

NOTE [ Open ports ]
-------------------
TensorFlow's gRPC server cannot bind a chosen address: `GrpcServer::Init`
(tensorflow/core/distributed_runtime/rpc/grpc_server_lib.cc) listens on
`"0.0.0.0:" + port`, the port taken from this task's `TF_CONFIG` entry; the host part of
that entry only names the address under which the *other* tasks reach it, and no option
or environment variable changes the listening address (`TF_GRPC_REUSE_PORT` only sets
SO_REUSEPORT). gRPC turns that wildcard into a dual-stack socket, `*:port` in `ss -ltn`.
The tf.data service servers do the same (`GrpcDataServerBase::Start` in
tensorflow/core/data/service/server_lib.cc), and the servers accept any graph,
unauthenticated. So `host` cannot fence a job in; the launcher's supervise loop
(`_launcher.py`) looks at the
listening sockets of each worker's process tree (psutil, every `_PORT_CHECK_S` at first)
and warns once, with an `OpenPortsWarning` naming the ports, when one listens on a wildcard
address while the network namespace has an interface besides loopback
(`outside_interfaces`).
"""

import socket
from typing import Iterable, List, Optional, Sequence, Tuple

_WILDCARD_IPS = ("0.0.0.0", "::")


class OpenPortsWarning(UserWarning):
    """A server of a local job listens on every network interface, not only loopback.

    TensorFlow's gRPC servers and tf.data service servers cannot bind a chosen address
    (see docs/security.md); filter this warning once the ports are fenced
    off by a firewall or a private network.

    Issued by `start_dispatcher()`, `start_worker()` and `launch()` (for the servers of
    its processes).

    Example:

    >>> import warnings, kpipe.distribute
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     dispatcher = kpipe.distribute.start_dispatcher()
    >>> [w.category.__name__ for w in caught]
    ['OpenPortsWarning']
    >>> warnings.filterwarnings("ignore", category=kpipe.distribute.OpenPortsWarning)  # once fenced off
    """


def wildcard_listeners(pids: Iterable[int]) -> List[Tuple[int, str, int]]:
    """Returns the TCP sockets that `pids` (and their descendants) listen on for every interface.

    Args:
        pids: Process ids to inspect; processes that are gone are skipped.

    Returns:
        `(pid, ip, port)` for each listening socket bound to `0.0.0.0` or `::`, sorted.
        Sockets of processes this user may not inspect are not seen.

    Example:

    >>> import os, socket
    >>> s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen()
    >>> (os.getpid(), "0.0.0.0", s.getsockname()[1]) in wildcard_listeners([os.getpid()])
    True
    >>> s.close()
    """
    import psutil

    found = set()
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for proc in procs:
            try:
                conns = (proc.net_connections if hasattr(proc, "net_connections")
                         else proc.connections)(kind="tcp")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            for conn in conns:
                if conn.status == psutil.CONN_LISTEN and conn.laddr and \
                        conn.laddr.ip in _WILDCARD_IPS:
                    found.add((proc.pid, conn.laddr.ip, conn.laddr.port))
    return sorted(found)


def outside_interfaces() -> List[str]:
    """Names of this network namespace's interfaces with a non-loopback address.

    Empty inside a namespace that has only `lo` (e.g. `unshare --net`, `docker run
    --network none`): there a wildcard listener is reachable from this host alone.
    """
    import ipaddress

    import psutil

    names = []
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if not ipaddress.ip_address(address.address.split("%")[0]).is_loopback:
                    names.append(name)
                    break
            except ValueError:
                continue
    return sorted(names)


def open_ports_message(what: str, ports: Sequence[int], host: str,
                       interfaces: Optional[Sequence[str]] = None) -> str:
    """The one-line `OpenPortsWarning` text for `what` (e.g. "worker 0") on `ports`."""
    listed = ", ".join(f"*:{p}" for p in sorted(set(ports)))
    verb = "listen" if what.startswith("workers ") or "," in what else "listens"
    named = f" ({', '.join(interfaces)})" if interfaces else ""
    return (f"{what} {verb} on {listed}, on every network interface{named}, not only on {host}: "
            "TensorFlow's gRPC servers cannot bind one address, and they run any graph sent "
            "to them without authentication. Block these ports from other hosts (firewall, "
            "private network; docs/security.md).")


def free_ports(count: int, host: str = "127.0.0.1") -> List[int]:
    """Returns `count` distinct TCP ports on `host` that were free a moment ago.

    All sockets are held open together so the ports differ, then closed. Another
    program may take a port before it is used; `launch` reports that as a worker failure.

    Args:
        count: How many ports. Must be >= 1.
        host: The interface to probe. Defaults to `"127.0.0.1"`.

    Returns:
        A list of `count` port numbers.

    Example:

    >>> ports = free_ports(2)
    >>> len(set(ports))
    2
    """
    if count < 1:
        raise ValueError(f"`count` must be >= 1. Received: count={count}.")
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
