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
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Dict, List, Optional, Sequence, Tuple

_POLL_S = 0.05
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
    """

    returncode: int
    returncodes: Tuple[int, ...]
    failed_worker: Optional[int]
    timed_out: bool
    interrupted: bool
    tails: Tuple[str, ...]


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


def parse_addresses(text: str) -> List[str]:
    """Splits `"host:port,host:port,..."` into validated addresses.

    Args:
        text: Comma-separated `host:port` pairs.

    Returns:
        The addresses, in order.

    Raises:
        ValueError: An entry is not `host:port` with a port in 1..65535, or an address
            repeats.

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
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"Addresses must be distinct. Received: {text!r}.")
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
    port: Optional[int] = None,
    host: str = "127.0.0.1",
    env: Optional[Dict[str, str]] = None,
    output: Optional[IO[str]] = None,
    timeout_s: Optional[float] = None,
    grace_s: float = 10.0,
) -> LaunchResult:
    """Runs `command` as `workers` local processes, each with its own `TF_CONFIG`.

    Worker `i` listens on `host:port+i` (or a free port) and sees
    `TF_CONFIG={"cluster": {"worker": [...]}, "task": {"type": "worker", "index": i}}`,
    `KPIPE_LAUNCH_WORKER=i` and `PYTHONUNBUFFERED=1`. Output lines are prefixed with
    `[worker i] `. When a worker fails, the others get SIGTERM, then SIGKILL after
    `grace_s`. SIGINT/SIGTERM received by the launcher (in the main thread) are forwarded.
    No process outlives the call. Safe to call from a notebook or from a thread (signals
    are then not forwarded).

    Args:
        command: The program and its arguments, e.g. `[sys.executable, "train.py"]`.
        workers: Number of processes. Must be >= 1. Defaults to 2.
        port: First port; workers use `port, port+1, ...`. Defaults to `None` (free
            ports picked on `host`).
        host: Address the workers listen on. Defaults to `"127.0.0.1"`.
        env: Extra environment variables for every worker, on top of `os.environ`.
            Defaults to `None`.
        output: Text stream for the prefixed output lines. Defaults to `None`
            (`sys.stdout`); pass `open(os.devnull, "w")` to discard.
        timeout_s: Stop every worker after this many seconds and return 124. Defaults
            to `None` (no limit).
        grace_s: Seconds between SIGTERM (or a forwarded Ctrl-C) and SIGKILL. Defaults
            to 10.0.

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
    if port is not None and not 0 < port <= 65536 - workers:
        raise ValueError(f"`port` must leave room for {workers} ports below 65536. "
                         f"Received: port={port}. Omit it to pick free ports.")
    ports = free_ports(workers, host) if port is None else [port + i for i in range(workers)]
    configs = tf_configs([f"{host}:{p}" for p in ports])
    job = _Job(output if output is not None else sys.stdout)
    with _forwarded_signals(job):
        try:
            for i, config in enumerate(configs):
                child_env = dict(os.environ)
                child_env.update(env or {})
                child_env.update(TF_CONFIG=config, KPIPE_LAUNCH_WORKER=str(i),
                                 PYTHONUNBUFFERED="1")
                job.start(i, command, child_env)
            job.supervise(timeout_s, grace_s)
        finally:
            job.reap()
    return job.result()


class _Job:
    """The children of one `launch()` call and their output threads."""

    def __init__(self, output: IO[str]):
        self._output = output
        self._write_lock = threading.Lock()
        self.procs: List[subprocess.Popen] = []
        self._readers: List[threading.Thread] = []
        self._tails: List[collections.deque] = []
        self.signal_received: Optional[int] = None  # the last SIGINT/SIGTERM received
        self.signal_count = 0  # how many were received
        self._forwarded_count = 0
        self._failed: Optional[int] = None
        self._timed_out = False

    def start(self, index: int, command: List[str], env: Dict[str, str]) -> None:
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        tail = collections.deque(maxlen=_TAIL_LINES)
        self._tails.append(tail)
        reader = threading.Thread(target=self._pump, args=(index, proc.stdout, tail),
                                  name=f"kpipe-launch-output-{index}", daemon=True)
        reader.start()
        self._readers.append(reader)

    def _pump(self, index: int, stream, tail) -> None:
        prefix = f"[worker {index}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            tail.append(line)
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
            if self._failed is None and self.signal_count == 0 and not self._timed_out:
                failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    self._failed = failed[0]
                    self._signal_all(signal.SIGTERM)
                    kill_at = time.monotonic() + grace_s
            if all(c is not None for c in codes):
                return
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
        else:
            returncode = next((_exit_status(c) for c in codes if c), 0)
        return LaunchResult(
            returncode=returncode, returncodes=codes, failed_worker=self._failed,
            timed_out=self._timed_out, interrupted=self.signal_received is not None,
            tails=tuple("\n".join(t) for t in self._tails))


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
