"""Passing file descriptors between processes over AF_UNIX sockets (``SCM_RIGHTS``).

Built on the stdlib's :func:`socket.send_fds` and ``socket.recvmsg``
(``sendmsg``/``recvmsg`` with ``SCM_RIGHTS``, see unix(7) and cmsg(3)).

Wire format of one message (:func:`send_message` / :func:`recv_message`): a
4-byte big-endian length ``n`` (at most :data:`MAX_MESSAGE`), then ``n`` bytes
of UTF-8 JSON holding one object. At most one fd rides on the first byte.
Nothing is ever unpickled from a peer. :func:`send_token` /
:func:`recv_token` move single bytes ("go", "ack"), as the CUDA sample does.

Every receive takes a ``timeout`` (seconds, ``None`` waits forever) and
raises :class:`~.errors.WaitTimeoutError` past it, :class:`~.errors.PeerClosedError`
on EOF and :class:`~.errors.ProtocolError` for a malformed message. Received
fds are close-on-exec (``MSG_CMSG_CLOEXEC``); when a message is rejected every
fd that did arrive is closed first, so nothing leaks.
"""

from __future__ import annotations

import array
import errno
import json
import os
import resource
import select
import socket
import struct
import time
from typing import Any

from ._time import deadline_after as _deadline
from .errors import FdLimitError, InvalidArgumentError, PeerClosedError, ProtocolError, WaitTimeoutError

__all__ = [
    "MAX_MESSAGE",
    "send_fd",
    "recv_fd",
    "send_message",
    "recv_message",
    "encode_message",
    "decode_message",
    "close_fds",
    "send_token",
    "recv_token",
]

#: Largest JSON body accepted, in bytes.
MAX_MESSAGE = 64 * 1024
_HEADER = struct.Struct(">I")
# Room for a few fds, so that "more than one fd" is seen and closed rather than truncated.
_MAX_FDS = 8


def _check_unix(sock: socket.socket) -> None:
    if not isinstance(sock, socket.socket):
        raise InvalidArgumentError(f"expected a socket.socket, got {type(sock).__name__}")
    if sock.fileno() == -1:
        raise InvalidArgumentError("the socket is closed")
    if sock.family != socket.AF_UNIX:
        raise InvalidArgumentError(
            f"fds can only pass over AF_UNIX sockets (SCM_RIGHTS); this socket is {sock.family!r}")


#: poll(2) takes a C int of milliseconds (about 24.8 days); longer waits are done in slices.
_MAX_POLL_MS = 2**31 - 1


def _wait_readable(sock: socket.socket, deadline: float | None, what: str) -> None:
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    while True:
        if deadline is None:
            timeout_ms = -1
        else:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WaitTimeoutError(f"timed out waiting for {what}")
            # Compare as floats first: int() of an infinite or huge timeout overflows poll().
            timeout_ms = _MAX_POLL_MS if remaining * 1000 >= _MAX_POLL_MS else max(1, int(remaining * 1000))
        if poller.poll(timeout_ms):  # PEP 475: EINTR is retried for us
            return
        # Empty: a slice of a long wait ended, or rounding woke us early; the deadline decides.


def encode_message(obj: dict[str, Any]) -> bytes:
    """Frame a JSON object: 4-byte big-endian length, then UTF-8 JSON.

    Raises:
        InvalidArgumentError: not a dict, not JSON-serialisable, or too large.
    """
    if not isinstance(obj, dict):
        raise InvalidArgumentError(f"a message is a dict, got {type(obj).__name__}")
    try:
        body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"message is not JSON-serialisable: {exc}") from exc
    if len(body) > MAX_MESSAGE:
        raise InvalidArgumentError(f"message body is {len(body)} bytes, more than {MAX_MESSAGE}")
    return _HEADER.pack(len(body)) + body


def decode_message(frame: bytes) -> dict[str, Any]:
    """Inverse of :func:`encode_message` for one complete frame.

    Raises:
        ProtocolError: wrong length, bad UTF-8/JSON, or not a JSON object.
    """
    if len(frame) < _HEADER.size:
        raise ProtocolError(f"frame of {len(frame)} bytes is shorter than its {_HEADER.size}-byte header")
    (n,) = _HEADER.unpack_from(frame)
    if n > MAX_MESSAGE:
        raise ProtocolError(f"frame announces {n} bytes, more than {MAX_MESSAGE}")
    if len(frame) != _HEADER.size + n:
        raise ProtocolError(f"frame announces {n} bytes but carries {len(frame) - _HEADER.size}")
    try:
        obj = json.loads(frame[_HEADER.size:].decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # deep nesting: RecursionError
        raise ProtocolError(f"message body is not UTF-8 JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"message body is a JSON {type(obj).__name__}, not an object")
    return obj


def _wait_writable(sock: socket.socket, deadline: float | None) -> None:
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    while True:
        if deadline is None:
            timeout_ms = -1
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeoutError("timed out sending a message: the peer is not reading (socket buffer full)")
            timeout_ms = _MAX_POLL_MS if left * 1000 >= _MAX_POLL_MS else max(1, int(left * 1000))
        if poller.poll(timeout_ms):
            return


def send_message(sock: socket.socket, obj: dict[str, Any], fd: int | None = None, *,
                 timeout: float | None = None) -> None:
    """Send one framed JSON message, with ``fd`` attached (``SCM_RIGHTS``) when given.

    The sender keeps its own fd: the kernel installs a new descriptor for the
    same open file in the receiver (the caller may close its copy afterwards).
    Sends are non-blocking (``MSG_DONTWAIT``) between ``poll(POLLOUT)`` waits,
    so a peer that stops reading cannot hold the sender past ``timeout``.

    Args:
        timeout: seconds the whole message may take to leave; ``None`` waits forever.

    Raises:
        InvalidArgumentError: not an AF_UNIX socket, bad message, or bad fd.
        PeerClosedError: the peer has closed its end (EPIPE / ECONNRESET).
        WaitTimeoutError: the socket stayed full past ``timeout``; the fd was not sent
            if no byte of the message was.
    """
    _check_unix(sock)
    data = encode_message(obj)
    deadline = _deadline(timeout)
    if fd is not None and (isinstance(fd, bool) or not isinstance(fd, int) or fd < 0):
        raise InvalidArgumentError(f"fd {fd!r} is not a valid file descriptor")
    view = memoryview(data)
    pending_fd = fd
    try:
        while view:
            _wait_writable(sock, deadline)
            try:
                if pending_fd is not None:
                    rights = array.array("i", [pending_fd])
                    sent = sock.sendmsg([view], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)],
                                       socket.MSG_DONTWAIT)
                    pending_fd = None
                else:
                    sent = sock.send(view, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            view = view[sent:]
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise PeerClosedError(f"peer closed the socket while sending: {exc}") from exc
    except OSError as exc:
        if fd is not None and exc.errno == errno.EBADF:
            raise InvalidArgumentError(f"fd {fd} is not open: {exc}") from exc
        raise


def close_fds(fds: list[int]) -> None:
    """Close every fd in ``fds``, ignoring ones already closed (for fds received in a message)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _recv_fds(sock: socket.socket, bufsize: int, maxfds: int) -> tuple[bytes, list[int], int]:
    """``recvmsg`` with ``MSG_CMSG_CLOEXEC``: (data, fds, msg_flags).

    Not :func:`socket.recv_fds`: CPython's drops its ``flags`` argument
    (python/cpython#107898), so the fds would arrive inheritable.
    """
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(bufsize, socket.CMSG_LEN(maxfds * fds.itemsize),
                                           socket.MSG_CMSG_CLOEXEC)
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(cdata[:len(cdata) - len(cdata) % fds.itemsize])
    return data, list(fds), flags


def _recv_exact(sock: socket.socket, n: int, deadline: float | None, fds: list[int]) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        _wait_readable(sock, deadline, "the rest of a message")
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerClosedError(f"peer closed the socket in the middle of a message ({len(buf)} of {n} bytes)")
        buf += chunk
    return bytes(buf)


def recv_message(sock: socket.socket, timeout: float | None = None, *, max_fds: int = 1
                 ) -> tuple[dict[str, Any], list[int]]:
    """Receive one framed message and the fds that rode on it.

    Args:
        sock: a connected AF_UNIX socket.
        timeout: seconds to wait for the whole message; ``None`` waits forever.
        max_fds: how many fds the message may carry (more is a ProtocolError).

    Returns:
        ``(message, fds)``; the caller owns every fd in ``fds`` (close-on-exec).

    Raises:
        PeerClosedError: EOF before the first byte, or in the middle.
        WaitTimeoutError: nothing (or not all of it) within ``timeout``.
        FdLimitError: the kernel dropped fds at the receiver's ``RLIMIT_NOFILE``.
        ProtocolError: a truncated control message (``MSG_CTRUNC``), more fds
            than ``max_fds``, or bad framing. Every fd that arrived is closed.
    """
    _check_unix(sock)
    deadline = _deadline(timeout)
    _wait_readable(sock, deadline, "a message")
    try:
        # On a stream socket read only the header first, so that the next message
        # (and any fd riding on it) is never swallowed together with this one.
        first = _HEADER.size if sock.type == socket.SOCK_STREAM else _HEADER.size + MAX_MESSAGE
        data, fds, flags = _recv_fds(sock, first, _MAX_FDS)
    except ConnectionResetError as exc:
        raise PeerClosedError(f"peer reset the connection: {exc}") from exc
    fds = list(fds)
    try:
        if flags & socket.MSG_CTRUNC:
            soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            # Close what arrived first: at the limit, listing /proc/self/fd needs a free fd.
            narrived = len(fds)
            close_fds(fds)
            fds.clear()
            try:
                nopen = len(os.listdir("/proc/self/fd")) - 1 + narrived  # as at the truncation
            except OSError as exc:
                if exc.errno != errno.EMFILE:
                    raise
                nopen = soft  # not one fd free: every fd below the limit is open
            if nopen + 1 >= soft:
                raise FdLimitError(
                    f"fds were dropped by the kernel (MSG_CTRUNC): this process has {nopen} fds open "
                    f"and its RLIMIT_NOFILE soft limit is {soft}; {narrived} fd(s) arrived and were closed")
            raise ProtocolError(
                f"control message truncated (MSG_CTRUNC): more than {_MAX_FDS} fds were sent; "
                f"{narrived} arrived and were closed")
        if not data:
            if fds:
                raise ProtocolError("fds arrived with no message bytes")
            raise PeerClosedError("peer closed the socket before sending a message")
        if len(fds) > max_fds:
            raise ProtocolError(f"message carried {len(fds)} fds, at most {max_fds} expected; all were closed")
        if len(data) < _HEADER.size:
            data += _recv_exact(sock, _HEADER.size - len(data), deadline, fds)
        (n,) = _HEADER.unpack_from(data)
        if n > MAX_MESSAGE:
            raise ProtocolError(f"frame announces {n} bytes, more than {MAX_MESSAGE}")
        want = _HEADER.size + n
        if len(data) < want:
            data += _recv_exact(sock, want - len(data), deadline, fds)
        if len(data) > want:
            raise ProtocolError(f"{len(data) - want} unexpected bytes after a {n}-byte message")
        return decode_message(data), fds
    except BaseException:
        close_fds(fds)
        raise


def send_fd(sock: socket.socket, fd: int, meta: dict[str, Any] | None = None) -> None:
    """Send ``fd`` (and an optional JSON object ``meta``) over ``sock``.

    The caller keeps ownership of its ``fd``; see :func:`send_message`.
    """
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        raise InvalidArgumentError(f"fd {fd!r} is not a valid file descriptor")
    send_message(sock, meta or {}, fd)


def recv_fd(sock: socket.socket, timeout: float | None = None) -> int:
    """Receive exactly one fd sent with :func:`send_fd`; the caller owns it.

    Raises:
        ProtocolError: the message carried no fd, or more than one (all closed).
        PeerClosedError, WaitTimeoutError, FdLimitError: see :func:`recv_message`.
    """
    _msg, fds = recv_message(sock, timeout, max_fds=1)
    if len(fds) != 1:
        raise ProtocolError("message carried no fd")
    return fds[0]


def send_token(sock: socket.socket, token: bytes) -> None:
    """Send one byte (the sample's "go" and "ack").

    Raises:
        PeerClosedError: the peer has gone.
    """
    if len(token) != 1:
        raise InvalidArgumentError("a token is exactly one byte")
    try:
        sock.sendall(token)
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise PeerClosedError(f"peer closed the socket: {exc}") from exc


def recv_token(sock: socket.socket, timeout: float | None = None) -> bytes:
    """Receive one byte. EOF raises :class:`PeerClosedError` (the "skip" signal)."""
    deadline = _deadline(timeout)
    _wait_readable(sock, deadline, "a one-byte token")
    try:
        data = sock.recv(1)
    except ConnectionResetError as exc:
        raise PeerClosedError(f"peer reset the connection: {exc}") from exc
    if not data:
        raise PeerClosedError("peer closed the socket")
    return data
