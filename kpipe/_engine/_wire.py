"""The control sockets between the main process and its workers: messages and descriptors.

Messages use `multiprocessing.connection.Connection` framing (a 4-byte big-endian length,
or -1 and an 8-byte length for payloads over 2 GiB, then a pickle), so a worker reads
them with `Connection.recv`. File descriptors follow their message as SCM_RIGHTS
ancillary data on a one-byte write, the format of `multiprocessing.reduction.sendfds`.

The main process never blocks on a worker: `send` writes without blocking and waits for
room in the socket buffer with `poll`, up to a deadline. A worker stuck in `__getitem__`
stops reading its socket; a dataset of a few MB then fills the buffer, and a blocking
write would hang the main process however small its `timeout` (a worker that never
reads must fail the deadline, not freeze the caller). Socket objects are wrapped around
the connection's descriptor without duplicating it (a `dup` per message would cost a
descriptor exactly when they run out).
"""

import array
import errno
import os
import select
import socket
import struct
import time
from multiprocessing.reduction import ForkingPickler

_MSG_FLAGS = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)


class SendTimeout(TimeoutError):
    """The peer did not take a message before the deadline; the stream is now unusable
    (part of the message may have been written)."""


def deadline_after(timeout):
    """`time.monotonic()` deadline for `timeout` seconds; None for no limit (None or inf)."""
    if timeout is None or timeout == float("inf"):
        return None
    return time.monotonic() + timeout


def remaining(deadline):
    """Seconds left before `deadline` (None: no limit; never negative)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _socket_of(conn):
    sock = socket.socket(fileno=conn.fileno())
    if sock.gettimeout() is not None:  # socket.setdefaulttimeout() made it non-blocking
        sock.settimeout(None)
    return sock


def _wait_writable(sock, deadline):
    left = remaining(deadline)
    if left is not None and left <= 0:
        raise SendTimeout("the peer did not read its socket before the deadline")
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    poller.poll(None if left is None else max(1, int(left * 1000)))


def send(conn, obj, fds=(), deadline=None):
    """Sends `obj` (as `conn.send` would) and then `fds`, never blocking past `deadline`.

    An exception other than these (Ctrl-C while waiting for room) gets the attribute
    `kpipe_torn = True` if part of the message was already written: the stream is then
    unusable. Without it, nothing was written.

    Raises:
        SendTimeout: the deadline passed (the stream is then unusable).
        BrokenPipeError, ConnectionResetError: the peer is gone.
    """
    payload = ForkingPickler.dumps(obj)
    n = len(payload)
    header = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!i", -1) + struct.pack("!Q", n)
    sock = _socket_of(conn)
    written = False
    try:
        # Header and payload in one system call where the socket has room (one wake-up
        # of the reader, not one for the header and one for the rest), then what is left.
        views = [memoryview(header), memoryview(payload)]
        while views:
            try:
                sent = sock.sendmsg(views, (), _MSG_FLAGS)
            except (BlockingIOError, InterruptedError):
                _wait_writable(sock, deadline)
                continue
            written = True
            while views and sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            if views:
                views[0] = views[0][sent:]
        if fds:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", list(fds)))]
            marker = bytes([len(fds) % 256])
            while True:
                try:
                    sock.sendmsg([marker], ancillary, _MSG_FLAGS)
                    break
                except (BlockingIOError, InterruptedError):
                    _wait_writable(sock, deadline)
    except BaseException as exc:
        if written and not isinstance(exc, (SendTimeout, OSError)):
            exc.kpipe_torn = True
        raise
    finally:
        sock.detach()


def send_fds(conn, fds):
    """Sends `fds` after a message written with `conn.send` (blocking; worker side)."""
    if not fds:
        return
    sock = _socket_of(conn)
    try:
        sock.sendmsg([bytes([len(fds) % 256])], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", list(fds)))])
    finally:
        sock.detach()


def recv_fds(conn, count):
    """Receives `count` descriptors sent with `send`/`send_fds` (blocking)."""
    if not count:
        return []
    sock = _socket_of(conn)
    try:
        fds = array.array("i")
        msg, ancdata, flags, _ = sock.recvmsg(1, socket.CMSG_SPACE(count * fds.itemsize))
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    finally:
        sock.detach()
    if not msg and not ancdata:
        raise EOFError("the control socket closed while file descriptors were expected")
    if len(fds) != count or flags & socket.MSG_CTRUNC:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        raise OSError(
            errno.EMFILE if flags & socket.MSG_CTRUNC else errno.EPROTO,
            f"expected {count} file descriptors from the main process, received {len(fds)}"
            + (" (this process is out of file descriptors)" if flags & socket.MSG_CTRUNC else ""),
        )
    return list(fds)
