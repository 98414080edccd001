"""Local multi-worker launcher: N processes of one command, each with its own `TF_CONFIG`.

Nothing here imports TensorFlow; `kpipe launch` and notebooks call `launch()` directly.

NOTE [ Launcher shutdown ]
--------------------------
Every child is started in a new session (`start_new_session=True`), so it leads its own
process group and a terminal's Ctrl-C reaches only the launcher. The launcher then decides
who gets which signal::

    terminal Ctrl-C / SIGTERM --> launcher handler sets a flag
                                   |
    poll loop (every 50 ms) <------+
      |- a child exited 0, others run -> remember it (`left_first`: if the job then fails,
      |                                 its leaving is what broke the others' collectives)
      |- a child exited non-zero    -> remember the first such code; SIGTERM the other groups
      |- the flag is set             -> forward the same signal to every group
      |- `timeout_s` passed          -> SIGTERM every group
      |- grace period over           -> SIGKILL every group still alive
      '- all children exited         -> leave the loop
    finally: SIGKILL every group (also reaps grandchildren such as loader workers that
             outlived their parent), wait() every child, join the output threads.

Signals go to process *groups* (`os.killpg`), so a command started through a shell or one
that runs its own worker processes is stopped as a whole. Output threads read each child's
merged stdout/stderr line by line and write it with a `[worker i] ` prefix; they end when
the last holder of the pipe exits, which the final SIGKILL guarantees.
"""

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from typing import IO, Callable, Dict, List, Optional, Sequence, Tuple

from kpipe.distribute._ports import OpenPortsWarning, free_ports, open_ports_message, outside_interfaces, wildcard_listeners

_POLL_S = 0.05
# Listening sockets are looked at every _PORT_CHECK_S during the first _PORT_FAST_S of a
# job (servers start with the strategy), then every _PORT_CHECK_SLOW_S: one look costs
# ~20 ms of CPU for a tree of 10 processes.
_PORT_CHECK_S = 0.5
_PORT_FAST_S = 60.0
_PORT_CHECK_SLOW_S = 5.0
_PORT_SETTLE_S = 3.0
_READER_JOIN_S = 5.0
_TAIL_LINES = 200
_EXIT_TIMEOUT = 124
_EXIT_INTERRUPTED = 130


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What a `launch()` did.

    Attributes:
        returncode: The first non-zero exit status of a worker (a signal `s` reads as
            `128 + s`), 124 when `timeout_s` ran out, 130 after Ctrl-C, else 0.
        returncodes: Each worker's raw `Popen.returncode` (negative: killed by a signal).
        failed_worker: Index of the worker whose failure stopped the job, or `None`.
        timed_out: Whether `timeout_s` ran out.
        interrupted: Whether the launcher received SIGINT or SIGTERM.
        tails: The last lines of each worker's output, for error messages.
        tasks: Each process's task, `"worker 0"`, `"chief"`, `"ps 0"`, in the order of
            `returncodes` (chief first, then workers, then ps tasks).
        left_first: When the job failed or timed out after a process exited with status
            0 while others still ran, that process's index (in the order of
            `returncodes`), else `None`. Under multi-worker training its leaving is what
            made the others' collectives fail: it started the shutdown, while
            `failed_worker` names the first process that then failed.

    Example:

    >>> import sys, kpipe.distribute
    >>> result = kpipe.distribute.launch([sys.executable, "-c", "import sys; sys.exit(0)"], workers=2)
    >>> result.returncode, result.returncodes, result.tasks
    (0, (0, 0), ('worker 0', 'worker 1'))
    """

    returncode: int
    returncodes: Tuple[int, ...]
    failed_worker: Optional[int]
    timed_out: bool
    interrupted: bool
    tails: Tuple[str, ...]
    tasks: Tuple[str, ...] = ()
    left_first: Optional[int] = None


def parse_addresses(text: str) -> List[str]:
    """Splits `"host:port,host:port,..."` into validated addresses.

    Args:
        text: Comma-separated `host:port` pairs.

    Returns:
        The addresses, in order.

    Raises:
        ValueError: An entry is not `host:port` with a port in 1..65535, or an address
            repeats (the message names both workers).

    Example:

    >>> parse_addresses("10.0.0.1:2222, 10.0.0.2:2222")
    ['10.0.0.1:2222', '10.0.0.2:2222']
    """
    addresses = [a.strip() for a in text.split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"Expected comma-separated host:port addresses. Received: {text!r}.")
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"{address!r} is not a host:port address (in {text!r}). "
                             "Write addresses like 10.0.0.1:2222.")
    for i, address in enumerate(addresses):
        if address in addresses[:i]:
            first = addresses.index(address)
            raise ValueError(f"Workers {first} and {i} both have the address {address!r} (in "
                             f"{text!r}). Give every worker its own host:port.")
    return addresses


def tf_configs(addresses: Sequence[str]) -> List[str]:
    """Returns the `TF_CONFIG` JSON of each worker of a cluster of `addresses`.

    Worker 0 is the chief (it writes checkpoints and logs).

    Args:
        addresses: One `"host:port"` per worker, in rank order.

    Returns:
        A list of JSON strings; entry `i` is for the process at `addresses[i]`.

    Example:

    >>> tf_configs(["127.0.0.1:2222"])[0]
    '{"cluster": {"worker": ["127.0.0.1:2222"]}, "task": {"type": "worker", "index": 0}}'
    """
    cluster = {"worker": list(addresses)}
    return [json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
            for i in range(len(addresses))]


def role_tf_configs(workers: Sequence[str], *, chief: Optional[str] = None,
                    ps: Sequence[str] = ()) -> List[Tuple[str, int, str]]:
    """Returns `(task_type, task_index, TF_CONFIG)` for every task of a cluster with roles.

    Args:
        workers: `"host:port"` of each worker.
        chief: `"host:port"` of the chief, or `None` for none. Defaults to `None`.
        ps: `"host:port"` of each parameter server. Defaults to `()`.

    Returns:
        The chief first, then the workers, then the ps tasks.

    Example:

    >>> [(t, i) for t, i, _ in role_tf_configs(["h:2"], chief="h:1", ps=["h:3"])]
    [('chief', 0), ('worker', 0), ('ps', 0)]
    """
    cluster = {}
    if chief is not None:
        cluster["chief"] = [chief]
    cluster["worker"] = list(workers)
    if ps:
        cluster["ps"] = list(ps)
    return [(task_type, index, json.dumps({"cluster": cluster,
                                           "task": {"type": task_type, "index": index}}))
            for task_type, addresses in cluster.items() for index in range(len(addresses))]


def split_roles(addresses: Sequence[str], *, chief: bool, ps: int) -> Tuple[
        Optional[str], List[str], List[str]]:
    """Splits addresses into `(chief, workers, ps)`: chief first, ps tasks last."""
    addresses = list(addresses)
    chief_address = addresses.pop(0) if chief else None
    ps_addresses = addresses[len(addresses) - ps:] if ps else []
    return chief_address, addresses[:len(addresses) - ps], ps_addresses


def format_role_tf_configs(addresses: Sequence[str], *, chief: bool, ps: int) -> str:
    """Shell lines setting each host's `TF_CONFIG` for a job with a chief and/or ps tasks.

    Args:
        addresses: `"host:port"` of the chief (first, when `chief`), the workers, then
            the `ps` parameter servers (last).
        chief: Whether the first address is the chief's.
        ps: How many of the last addresses are parameter servers.

    Returns:
        For each task, a comment naming it and an `export TF_CONFIG='...'` line.

    Raises:
        ValueError: The addresses leave no worker.

    Example:

    >>> print(format_role_tf_configs(["h:1", "h:2", "h:3"], chief=True, ps=1).splitlines()[2])
    # worker 0 on h:2
    """
    chief_address, workers, ps_addresses = split_roles(addresses, chief=chief, ps=ps)
    if not workers:
        raise ValueError(f"{len(addresses)} address(es) leave no worker once the chief and "
                         f"{ps} ps task(s) are taken. Received: {list(addresses)}. List the "
                         "chief first, then the workers, then the ps tasks.")
    lines = []
    by_task = {("chief", 0): chief_address, **{("worker", i): a for i, a in enumerate(workers)},
               **{("ps", i): a for i, a in enumerate(ps_addresses)}}
    for task_type, index, config in role_tf_configs(workers, chief=chief_address,
                                                    ps=ps_addresses):
        name = "chief" if task_type == "chief" else f"{task_type} {index}"
        lines += [f"# {name} on {by_task[(task_type, index)]}", f"export TF_CONFIG='{config}'"]
    return "\n".join(lines)


def format_tf_configs(addresses: Sequence[str]) -> str:
    """Shell lines that set each host's `TF_CONFIG` for a real multi-host job.

    Args:
        addresses: One `"host:port"` per worker, in rank order.

    Returns:
        For each worker, a comment naming it and an `export TF_CONFIG='...'` line.

    Example:

    >>> print(format_tf_configs(["10.0.0.1:2222"]).splitlines()[0])
    # worker 0 (chief) on 10.0.0.1:2222
    """
    lines = []
    for i, (address, config) in enumerate(zip(addresses, tf_configs(addresses))):
        role = " (chief)" if i == 0 else ""
        lines += [f"# worker {i}{role} on {address}", f"export TF_CONFIG='{config}'"]
    return "\n".join(lines)


def launch(
    command: Sequence[str],
    *,
    workers: int = 2,
    ps: int = 0,
    chief: Optional[bool] = None,
    port: Optional[int] = None,
    host: str = "127.0.0.1",
    env: Optional[Dict[str, str]] = None,
    output: Optional[IO[str]] = None,
    timeout_s: Optional[float] = None,
    grace_s: float = 10.0,
    warn_open_ports: bool = True,
    line_filter: Optional[Callable[[str], bool]] = None,
) -> LaunchResult:
    """Runs `command` as `workers` local processes, each with its own `TF_CONFIG`.

    Worker `i` listens on `host:port+i` (or a free port) and sees
    `TF_CONFIG={"cluster": {"worker": [...]}, "task": {"type": "worker", "index": i}}`,
    `KPIPE_LAUNCH_WORKER=i` and `PYTHONUNBUFFERED=1`. Output lines are prefixed with
    `[worker i] `. When a worker fails, the others get SIGTERM, then SIGKILL after
    `grace_s`. SIGINT/SIGTERM received by the launcher (in the main thread) are forwarded.
    No process outlives the call. Safe to call from a notebook or from a thread (signals
    are then not forwarded).

    With `chief=True` a `chief` task runs first (prefix `[chief] `); with `ps > 0` (which
    implies a chief) `ps` parameter-server tasks run too (`[ps i] `), and the job follows
    parameter-server rules: the chief's exit ends the job (its status is the job's; the
    servers are stopped), a worker's death is reported and tolerated (the chief re-runs its
    steps elsewhere) unless no worker is left, and a ps task's death gives the chief
    `grace_s` to report it before every process is stopped. Ports go in the order chief,
    workers, ps tasks.

    `host` is only the address written into `TF_CONFIG`: TensorFlow's gRPC server listens
    on every interface whatever it is (see NOTE [ Open ports ]). When a worker's process
    tree listens on a wildcard address and the host has a network interface besides
    loopback, an `OpenPortsWarning` naming the ports is issued once per call.

    Args:
        command: The program and its arguments, e.g. `[sys.executable, "train.py"]`.
        workers: Number of worker processes. Must be >= 1. Defaults to 2.
        ps: Number of parameter-server tasks. Defaults to 0.
        chief: Whether to run a `chief` task besides the workers. Defaults to `None`
            (a chief exactly when `ps > 0`).
        port: First port; workers use `port, port+1, ...`. Defaults to `None` (free
            ports picked on `host`).
        host: Address written into `TF_CONFIG`, under which the workers reach each
            other. It does not restrict where TensorFlow's servers listen (every
            interface). Defaults to `"127.0.0.1"`.
        env: Extra environment variables for every worker, on top of `os.environ`.
            Defaults to `None`.
        output: Text stream for the prefixed output lines. Defaults to `None`
            (`sys.stdout`); pass `open(os.devnull, "w")` to discard.
        timeout_s: Stop every worker after this many seconds and return 124. Defaults
            to `None` (no limit).
        grace_s: Seconds between SIGTERM (or a forwarded Ctrl-C) and SIGKILL. Defaults
            to 10.0.
        warn_open_ports: Watch the workers' listening sockets and warn
            (`OpenPortsWarning`) when one is bound to every interface. Defaults to True.
        line_filter: Called with each output line (without its newline); lines for
            which it returns True are not written to `output` (they are still kept in
            `LaunchResult.tails`). `kpipe launch` uses it to drop TensorFlow's start-up
            log. Defaults to `None` (write every line).

    Returns:
        A `LaunchResult`; `returncode` is what `kpipe launch` exits with.

    Raises:
        ValueError: `command` is empty or `workers`/`port` are out of range.
        OSError: The command cannot be started (after stopping those already started).

    Example:

    >>> import sys, io
    >>> out = io.StringIO()
    >>> r = launch([sys.executable, "-c", "import os; print(os.environ['KPIPE_LAUNCH_WORKER'])"],
    ...            workers=2, output=out)
    >>> r.returncode, sorted(out.getvalue().splitlines())
    (0, ['[worker 0] 0', '[worker 1] 1'])
    """
    command = [str(c) for c in command]
    if not command:
        raise ValueError("`command` is empty. Pass the program to run, e.g. "
                         "[sys.executable, 'train.py'].")
    if workers < 1:
        raise ValueError(f"`workers` must be >= 1. Received: workers={workers}.")
    if ps < 0:
        raise ValueError(f"`ps` must be >= 0. Received: ps={ps}.")
    if chief is None:
        chief = ps > 0
    if ps and not chief:
        raise ValueError(f"Parameter-server training needs a chief. Received: ps={ps}, "
                         "chief=False. Leave `chief` unset (or True) with ps > 0.")
    count = int(chief) + workers + ps
    if port is not None and not 0 < port <= 65536 - count:
        raise ValueError(f"`port` must leave room for {count} ports below 65536. "
                         f"Received: port={port}. Omit it to pick free ports.")
    ports = free_ports(count, host) if port is None else [port + i for i in range(count)]
    addresses = [f"{host}:{p}" for p in ports]
    if chief or ps:
        chief_address, worker_addresses, ps_addresses = split_roles(addresses, chief=chief,
                                                                    ps=ps)
        tasks = role_tf_configs(worker_addresses, chief=chief_address, ps=ps_addresses)
    else:
        tasks = [("worker", i, config) for i, config in enumerate(tf_configs(addresses))]
    job = _Job(output if output is not None else sys.stdout, line_filter,
               host if warn_open_ports else None, ps_rules=ps > 0)
    with _forwarded_signals(job):
        try:
            for i, (task_type, index, config) in enumerate(tasks):
                child_env = dict(os.environ)
                child_env.update(env or {})
                child_env.update(TF_CONFIG=config, PYTHONUNBUFFERED="1",
                                 KPIPE_LAUNCH_TASK=f"{task_type}:{index}")
                if task_type == "worker":
                    child_env["KPIPE_LAUNCH_WORKER"] = str(index)
                label = "chief" if task_type == "chief" else f"{task_type} {index}"
                job.start(i, command, child_env, label=label)
            job.supervise(timeout_s, grace_s)
        finally:
            job.reap()
    return job.result()


class _Job:
    """The children of one `launch()` call and their output threads."""

    def __init__(self, output: IO[str], line_filter: Optional[Callable[[str], bool]] = None,
                 watch_host: Optional[str] = None, ps_rules: bool = False):
        self._output = output
        self._ps_rules = ps_rules
        self.labels: List[str] = []
        self._reported: set = set()
        self._chief_deadline: Optional[float] = None
        self._line_filter = line_filter
        self._watch_host = watch_host  # None: do not look at listening sockets
        self._next_port_check = 0.0
        self._started_at = time.monotonic()
        self._ports_first_seen: Optional[float] = None
        self._write_lock = threading.Lock()
        self.procs: List[subprocess.Popen] = []
        self._readers: List[threading.Thread] = []
        self._tails: List[collections.deque] = []
        self.signal_received: Optional[int] = None  # the last SIGINT/SIGTERM received
        self.signal_count = 0  # how many were received
        self._forwarded_count = 0
        self._failed: Optional[int] = None
        self._timed_out = False
        self._left_first: Optional[int] = None  # exited with 0 while others ran (see LaunchResult)

    def start(self, index: int, command: List[str], env: Dict[str, str],
              label: Optional[str] = None) -> None:
        self.labels.append(label or f"worker {index}")
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        tail = collections.deque(maxlen=_TAIL_LINES)
        self._tails.append(tail)
        reader = threading.Thread(target=self._pump, args=(self.labels[-1], proc.stdout, tail),
                                  name=f"kpipe-launch-output-{index}", daemon=True)
        reader.start()
        self._readers.append(reader)

    def _pump(self, label: str, stream, tail) -> None:
        prefix = f"[{label}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            tail.append(line)
            if self._line_filter is not None and self._line_filter(line):
                continue
            with self._write_lock:
                try:
                    self._output.write(prefix + line + "\n")
                    self._output.flush()
                except (ValueError, OSError):  # output closed under us: keep draining
                    pass
        stream.close()

    def supervise(self, timeout_s: Optional[float], grace_s: float) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        kill_at = None
        while True:
            codes = [p.poll() for p in self.procs]
            if self._ps_rules and self._failed is None and self.signal_count == 0 \
                    and not self._timed_out:
                if self._apply_ps_rules(codes, grace_s):
                    kill_at = time.monotonic() + grace_s
            elif self._failed is None and self.signal_count == 0 and not self._timed_out:
                if self._left_first is None and None in codes:
                    self._left_first = next((i for i, c in enumerate(codes) if c == 0), None)
                failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    self._failed = failed[0]
                    if self._left_first is not None:
                        self._note(f"{self.labels[self._left_first]} exited with status 0 while the others "
                                   f"were still running; then {self.labels[failed[0]]} exited with status "
                                   f"{_exit_status(codes[failed[0]])}.")
                    self._signal_all(signal.SIGTERM)
                    kill_at = time.monotonic() + grace_s
            if all(c is not None for c in codes):
                return
            self._check_ports()
            if self.signal_count > self._forwarded_count:
                now = time.monotonic()
                # The first signal is forwarded; a second one means "stop now".
                kill_at = now if self._forwarded_count else min(kill_at or now + grace_s,
                                                                 now + grace_s)
                self._forwarded_count = self.signal_count
                self._signal_all(self.signal_received)
            if deadline is not None and not self._timed_out and time.monotonic() > deadline:
                self._timed_out = True
                self._signal_all(signal.SIGTERM)
                kill_at = time.monotonic() + grace_s
            if kill_at is not None and time.monotonic() > kill_at:
                self._signal_all(signal.SIGKILL)
            time.sleep(_POLL_S)

    def _apply_ps_rules(self, codes, grace_s: float) -> bool:
        """Parameter-server job rules (see `launch`); True when every process must stop."""
        chief = codes[0]
        if chief is not None:
            if chief != 0:
                self._failed = 0
            self._signal_all(signal.SIGTERM)
            return True
        now = time.monotonic()
        for i, code in enumerate(codes):
            if code is None or i in self._reported:
                continue
            self._reported.add(i)
            if self.labels[i].startswith("worker"):
                self._note(f"{self.labels[i]} exited with status {_exit_status(code)}; the "
                           "chief runs its steps on the other workers.")
            else:
                self._note(f"{self.labels[i]} exited with status {_exit_status(code)}; waiting "
                           f"up to {grace_s:g} s for the chief to report it.")
                if self._chief_deadline is None:
                    self._chief_deadline = now + grace_s
        workers = [i for i, label in enumerate(self.labels) if label.startswith("worker")]
        if all(codes[i] is not None for i in workers):
            self._failed = next(i for i in workers if codes[i] != 0) if any(
                codes[i] for i in workers) else workers[0]
            self._note("no worker is left; stopping the job.")
            self._signal_all(signal.SIGTERM)
            return True
        if self._chief_deadline is not None and now > self._chief_deadline:
            self._failed = next(i for i in range(1, len(codes))
                                if codes[i] not in (None, 0) and not
                                self.labels[i].startswith("worker"))
            self._signal_all(signal.SIGTERM)
            return True
        return False

    def _note(self, text: str) -> None:
        with self._write_lock:
            try:
                self._output.write(f"[kpipe launch] {text}\n")
                self._output.flush()
            except (ValueError, OSError):
                pass

    def _check_ports(self) -> None:
        """Warns once when workers' process trees listen on a wildcard address.

        The first sighting waits up to `_PORT_SETTLE_S` for the other workers' servers,
        so that one line names them all.
        """
        now = time.monotonic()
        if self._watch_host is None or now < self._next_port_check:
            return
        fast = now - self._started_at < _PORT_FAST_S
        self._next_port_check = now + (_PORT_CHECK_S if fast else _PORT_CHECK_SLOW_S)
        alive = [i for i, p in enumerate(self.procs) if p.poll() is None]
        found = {i: wildcard_listeners([self.procs[i].pid]) for i in alive}
        found = {i: sockets for i, sockets in found.items() if sockets}
        if not found:
            return
        if self._ports_first_seen is None:
            self._ports_first_seen = now
        if len(found) < len(alive) and now - self._ports_first_seen < _PORT_SETTLE_S:
            return
        host, self._watch_host = self._watch_host, None
        interfaces = outside_interfaces()
        if not interfaces:  # a loopback-only network namespace: nothing is exposed
            return
        workers = sorted(found)
        if all(self.labels[i] == f"worker {i}" for i in workers):
            what = ("worker " if len(workers) == 1 else "workers ") + ", ".join(map(str, workers))
        else:
            what = ", ".join(self.labels[i] for i in workers)
        ports = [port for i in workers for _, _, port in found[i]]
        warnings.warn(OpenPortsWarning(open_ports_message(what, ports, host, interfaces)),
                      stacklevel=4)

    def _signal_all(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                _signal_group(proc.pid, signum)

    def reap(self) -> None:
        for proc in self.procs:
            _signal_group(proc.pid, signal.SIGKILL)  # also leftovers of exited leaders
        for proc in self.procs:
            proc.wait()
        for reader in self._readers:
            reader.join(_READER_JOIN_S)

    def result(self) -> LaunchResult:
        codes = tuple(p.returncode for p in self.procs)
        if self._failed is not None:
            returncode = _exit_status(codes[self._failed])
        elif self._timed_out:
            returncode = _EXIT_TIMEOUT
        elif self.signal_received is not None:
            returncode = _EXIT_INTERRUPTED
        elif self._ps_rules and codes and codes[0] == 0:
            returncode = 0  # the chief finished; the servers were stopped
        else:
            returncode = next((_exit_status(c) for c in codes if c), 0)
        left_first = self._left_first if returncode != 0 and self.signal_received is None else None
        return LaunchResult(
            returncode=returncode, returncodes=codes, failed_worker=self._failed,
            timed_out=self._timed_out, interrupted=self.signal_received is not None,
            tails=tuple("\n".join(t) for t in self._tails), tasks=tuple(self.labels),
            left_first=left_first)


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class _forwarded_signals:
    """Routes SIGINT/SIGTERM to `job` while the launcher runs (main thread only)."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, job: _Job):
        self._job = job
        self._previous = {}

    def _handle(self, signum, frame):
        self._job.signal_received = signum
        self._job.signal_count += 1

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self._SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False
