"""Passing file descriptors between processes over AF_UNIX sockets (``SCM_RIGHTS``).

Built on the stdlib's :func:`socket.send_fds` and ``socket.recvmsg``
(``sendmsg``/``recvmsg`` with ``SCM_RIGHTS``, see unix(7) and cmsg(3)).

Wire format of one message (:func:`send_message` / :func:`recv_message`): a
4-byte big-endian length ``n`` (at most :data:`MAX_MESSAGE`), then ``n`` bytes
of UTF-8 JSON holding one object. At most one fd rides on the first byte.
Nothing is ever unpickled from a peer. :func:`send_token` /
:func:`recv_token` move single bytes ("go", "ack"), as the CUDA sample does.

Every send and receive takes a ``timeout`` in seconds, :data:`DEFAULT_TIMEOUT`
(60 s) unless given; ``None`` waits forever. Past it
:class:`~.errors.WaitTimeoutError` is raised; EOF is
:class:`~.errors.PeerClosedError` and a malformed message
:class:`~.errors.ProtocolError`. Received fds are close-on-exec
(``MSG_CMSG_CLOEXEC``). The control buffer has room for every control message
the kernel may add beside ``SCM_RIGHTS`` (``SCM_CREDENTIALS`` under
``SO_PASSCRED``, ``SCM_SECURITY`` under ``SO_PASSSEC``, ``SCM_PIDFD`` under
``SO_PASSPIDFD``; unix(7), socket(7)); every fd the kernel installed that is not
handed to the caller is closed, so nothing leaks. A message rejected after its
whole frame was read leaves the connection in step; one rejected in the middle
of its frame (a bad length, a timeout, EOF) marks the connection broken, and
every later call on that socket raises at once with the first reason.
"""

from __future__ import annotations

import array
import errno
import json
import os
import resource
import select
import _socket
import socket
import struct
import time
import weakref
from typing import Any, Sequence

from ._time import deadline_after as _deadline
from .fd import fd_is_open
from .errors import (
    DmaBufError,
    FdLimitError,
    FdsInFlightError,
    InvalidArgumentError,
    PeerClosedError,
    ProtocolError,
    SyscallError,
    WaitTimeoutError,
)

__all__ = [
    "MAX_MESSAGE",
    "DEFAULT_TIMEOUT",
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
# Room for SCM_MAX_FD (253, the most one sendmsg carries), so that every fd sent is seen and
# closed rather than truncated.
_MAX_FDS = 253
#: Seconds a send or receive waits by default (``timeout=None`` waits forever).
DEFAULT_TIMEOUT = 60.0
# include/uapi/asm-generic/socket.h (Linux 6.5+); Python's socket module names them from 3.13 only.
SO_PASSPIDFD = getattr(socket, "SO_PASSPIDFD", 76)
SCM_PIDFD = getattr(socket, "SCM_PIDFD", 4)
# Room for what the kernel adds on its own beside SCM_RIGHTS: SCM_CREDENTIALS (struct ucred,
# 12 bytes), SCM_PIDFD (one int) and SCM_SECURITY (an LSM label, at most a page).
_EXTRA_CMSG = socket.CMSG_SPACE(12) + socket.CMSG_SPACE(4) + socket.CMSG_SPACE(4096)
_CMSG_BUFSIZE = socket.CMSG_SPACE(_MAX_FDS * 4) + _EXTRA_CMSG

# Stream sockets left mid-frame by a rejected message, with the first reason; weak keys, so a
# closed and collected socket is forgotten.
_broken_recv: "weakref.WeakKeyDictionary[socket.socket, str]" = weakref.WeakKeyDictionary()
_broken_send: "weakref.WeakKeyDictionary[socket.socket, str]" = weakref.WeakKeyDictionary()


def _check_in_step(sock: socket.socket, table: "weakref.WeakKeyDictionary[socket.socket, str]",
                   direction: str) -> None:
    reason = table.get(sock)
    if reason is not None:
        raise ProtocolError(f"this connection cannot {direction} any more: an earlier message was cut off in "
                            f"the middle of its frame ({reason}); open a new connection")


def _check_unix(sock: socket.socket) -> None:
    if not isinstance(sock, socket.socket):
        raise InvalidArgumentError(f"expected a socket.socket, got {type(sock).__name__}")
    if sock.fileno() == -1:
        raise InvalidArgumentError("the socket is closed")
    if _family(sock) != socket.AF_UNIX:
        raise InvalidArgumentError(
            f"fds can only pass over AF_UNIX sockets (SCM_RIGHTS); this socket is {sock.family!r}")


def _timeout_mode(sock: socket.socket) -> bool:
    """True for a socket given ``settimeout(t > 0)``: CPython then waits up to ``t`` inside every
    call before it tries, so such a socket is polled first (with this module's deadline) and
    only called once ready; other sockets are called first and polled only on ``EAGAIN``."""
    t = sock.gettimeout()
    return t is not None and t > 0


# Plain ints: socket's flags are enums, and combining enums costs more than the syscall.
_DONTWAIT = int(socket.MSG_DONTWAIT)
# Every send: a peer that has gone is EPIPE (PeerClosedError), never a SIGPIPE that kills the process
# under the default disposition; the process's signal dispositions are left as the host program set them.
_SEND_FLAGS = int(socket.MSG_DONTWAIT) | int(socket.MSG_NOSIGNAL)
_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_CTRUNC = int(socket.MSG_CTRUNC)
_STREAM = int(socket.SOCK_STREAM)
# The C-level family and type (ints): socket.socket.family / .type convert to an enum on every read.
_family = _socket.socket.family.__get__
_type = _socket.socket.type.__get__
#: One encoder for every message (``json.dumps`` with options builds a new one per call).
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
# Speed trick: the C encoder behind _ENCODER, made once (JSONEncoder.encode makes one per call: a
# repeat encoded in 1.6 us instead of 2.2 us, measured on the 2-core CI machine, Python 3.11), with the
# same options and output. It has no circular-reference check (markers None): a circular object raises
# RecursionError, which encode_message refuses as not serialisable (InvalidArgumentError), as it does a
# nesting too deep.
_make_encoder = json.encoder.c_make_encoder  # type: ignore[attr-defined]
_C_ENCODE = (None if _make_encoder is None else
             _make_encoder(None, _ENCODER.default, json.encoder.encode_basestring_ascii, None, ":", ",", False,
                           False, False))
# Speed trick: the decoder's C scanner, called directly on a body that begins with "{" (json.loads adds
# two whitespace matches and its checks: 2.0 us -> 1.0 us a repeat, measured as above).
_SCAN = json.JSONDecoder().scan_once

#: A poll that returned sooner than this (seconds) found data already waiting (:meth:`FrameReader._recv`).
_WAITED = 10e-6
_monotonic = time.monotonic

#: poll(2) takes a C int of milliseconds (about 24.8 days); longer waits are done in slices.
_MAX_POLL_MS = 2**31 - 1


def _wait(sock: socket.socket, events: int, deadline: float | None, timed_out: str) -> float:
    """``poll(2)`` ``sock`` for ``events`` until ``deadline``; past it raise WaitTimeoutError(``timed_out``).
    Returns the seconds spent inside ``poll`` (about 0: the socket was ready when asked)."""
    poller = select.poll()
    poller.register(sock, events)
    began = now = _monotonic()
    while True:
        if deadline is None:
            timeout_ms = -1
        else:
            remaining = deadline - now
            if remaining <= 0:
                # Zero means "do not wait", not "fail": what is ready already is taken (one poll(0)).
                if poller.poll(0):
                    return now - began
                raise WaitTimeoutError(timed_out)
            # Compare as floats first: int() of an infinite or huge timeout overflows poll().
            timeout_ms = _MAX_POLL_MS if remaining * 1000 >= _MAX_POLL_MS else max(1, int(remaining * 1000))
        ready = poller.poll(timeout_ms)  # PEP 475: EINTR is retried for us
        now = _monotonic()
        if ready:
            return now - began
        # Empty: a slice of a long wait ended, or rounding woke us early; the deadline decides.


def _wait_readable(sock: socket.socket, deadline: float | None, what: str) -> float:
    return _wait(sock, select.POLLIN | select.POLLHUP | select.POLLERR, deadline, f"timed out waiting for {what}")


def encode_message(obj: dict[str, Any], max_bytes: int = MAX_MESSAGE) -> bytes:
    """Frame a JSON object: 4-byte big-endian length, then UTF-8 JSON of at most ``max_bytes``.

    Raises:
        InvalidArgumentError: not a dict, not JSON-serialisable, or too large.
    """
    if not isinstance(obj, dict):
        raise InvalidArgumentError(f"a message is a dict, got {type(obj).__name__}")
    try:
        body = ("".join(_C_ENCODE(obj, 0)) if _C_ENCODE is not None else _ENCODER.encode(obj)).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgumentError(f"message is not JSON-serialisable: {exc}") from exc
    if len(body) > max_bytes:
        raise InvalidArgumentError(f"message body is {len(body)} bytes, more than {max_bytes}")
    return _HEADER.pack(len(body)) + body


def decode_message(frame: bytes | bytearray, max_bytes: int = MAX_MESSAGE) -> dict[str, Any]:
    """Inverse of :func:`encode_message` for one complete frame.

    Raises:
        ProtocolError: wrong length, bad UTF-8/JSON, or not a JSON object.
    """
    if len(frame) < _HEADER.size:
        raise ProtocolError(f"frame of {len(frame)} bytes is shorter than its {_HEADER.size}-byte header")
    (n,) = _HEADER.unpack_from(frame)
    if n > max_bytes:
        raise ProtocolError(f"frame announces {n} bytes, more than {max_bytes}")
    if len(frame) != _HEADER.size + n:
        raise ProtocolError(f"frame announces {n} bytes but carries {len(frame) - _HEADER.size}")
    try:
        text = frame[_HEADER.size:].decode()
        if text[:1] == "{":
            # What json.loads does for a body with no whitespace before its value: its raw_decode calls
            # the same scanner at 0. Whitespace after the value, and a scanner's StopIteration (a value
            # missing, which raw_decode words), are left to json.loads.
            try:
                obj, end = _SCAN(text, 0)
            except StopIteration:
                end = -1
            if end == len(text):
                return obj  # (a dict: the value began with "{")
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:  # (and UnicodeDecodeError); deep nesting: RecursionError
        raise ProtocolError(f"message body is not UTF-8 JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"message body is a JSON {type(obj).__name__}, not an object")
    return obj


def _wait_writable(sock: socket.socket, deadline: float | None) -> None:
    _wait(sock, select.POLLOUT, deadline, "timed out sending a message: the peer is not reading (socket buffer full)")


def _send_all(sock: socket.socket, data: bytes, fds: list[int] | None, deadline: float | None,
              rest_timeout: float | None = None) -> None:
    """Send ``data`` (``fds`` on its first byte) between ``poll(POLLOUT)`` waits; a message cut off
    after its first byte marks a stream connection broken for sending. ``rest_timeout``: once part of
    the message has gone, the rest has that many seconds of its own instead of ``deadline``."""
    _check_in_step(sock, _broken_send, "send")
    view = memoryview(data)
    pending_fd = fds or None
    poll_first = _timeout_mode(sock)
    # From a send call until its count is taken: bytes may have left that ``view`` does not show yet. An
    # exception a signal handler raises there (KeyboardInterrupt, right after the call returns) leaves the
    # stream in an unknown step, as a message cut off does.
    in_flight = False
    try:
        while view:
            if poll_first:
                _wait_writable(sock, deadline)
            try:  # a socket with room costs one send, no poll
                in_flight = True
                if pending_fd is not None:
                    rights = array.array("i", pending_fd)
                    sent = sock.sendmsg([view], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)],
                                       _SEND_FLAGS)
                    pending_fd = None
                else:
                    sent = sock.send(view, _SEND_FLAGS)
            except BlockingIOError:
                in_flight = False  # (nothing left)
                _wait_writable(sock, deadline)
                continue
            view = view[sent:]
            in_flight = False
            if view and rest_timeout is not None:  # begun: the rest has its own time
                deadline, rest_timeout = _deadline(rest_timeout), None
    except BaseException as exc:
        if (len(view) < len(data) or (in_flight and not isinstance(exc, Exception))) and _type(sock) == _STREAM:
            _broken_send[sock] = (f"{len(data) - len(view)} of {len(data)} bytes sent, then {exc}" if not in_flight
                                  else f"{type(exc).__name__} right after a send of {len(view)} bytes")
        if isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            raise PeerClosedError(f"peer closed the socket while sending: {exc}") from exc
        if isinstance(exc, OSError) and not isinstance(exc, DmaBufError):
            if fds and exc.errno == errno.EBADF:
                raise InvalidArgumentError(f"fd(s) {fds}: not open: {exc}") from exc
            if exc.errno == errno.ETOOMANYREFS:
                soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                raise FdsInFlightError(
                    f"sendmsg -> ETOOMANYREFS: the kernel refused to queue another fd: this user already has "
                    f"more fds in flight (sent over AF_UNIX sockets, not yet received by the peer) than the "
                    f"sender's RLIMIT_NOFILE soft limit of {soft}; the peer is not reading its messages. "
                    f"The caller still owns fd(s) {fds}") from exc
            raise SyscallError("sendmsg", exc) from exc
        raise


def send_message(sock: socket.socket, obj: dict[str, Any], fd: int | Sequence[int] | None = None, *,
                 timeout: float | None = DEFAULT_TIMEOUT, max_bytes: int = MAX_MESSAGE,
                 rest_timeout: float | None = None) -> None:
    """Send one framed JSON message, with ``fd`` attached (``SCM_RIGHTS``) when given.

    ``fd`` may also be a sequence of up to 253 fds (``SCM_MAX_FD``), all riding on
    the message's first byte in order. The sender keeps its own fds: the kernel
    installs a new descriptor for each same open file in the receiver (the caller
    may close its copies afterwards).
    Sends are non-blocking (``MSG_DONTWAIT``) between ``poll(POLLOUT)`` waits,
    so a peer that stops reading cannot hold the sender past ``timeout``.

    Args:
        timeout: seconds the whole message may take to leave (default
            :data:`DEFAULT_TIMEOUT`, 60 s); ``None`` waits forever.
        max_bytes: the largest JSON body allowed (default :data:`MAX_MESSAGE`, 64 KiB).
        rest_timeout: when given, ``timeout`` bounds only the wait for the message to begin to
            leave, and the rest, once begun, has ``rest_timeout`` seconds of its own; so a
            ``WaitTimeoutError`` within ``timeout`` means none of the message went out.

    Send flags are ``MSG_DONTWAIT | MSG_NOSIGNAL``: a peer that has gone is ``PeerClosedError``,
    never a ``SIGPIPE``, whatever the process's signal disposition.

    Raises:
        InvalidArgumentError: not an AF_UNIX socket, bad message, a bad fd, or more than 253 fds.
        PeerClosedError: the peer has closed its end (EPIPE / ECONNRESET).
        WaitTimeoutError: the socket stayed full past ``timeout``; the fd was not sent
            if no byte of the message was.
        FdsInFlightError: ``sendmsg`` -> ``ETOOMANYREFS``: more fds are queued unread
            than the sender's ``RLIMIT_NOFILE``.
        ProtocolError: an earlier message on this connection was cut off mid-frame.
        SyscallError: any other ``sendmsg`` failure.
    """
    _check_unix(sock)
    data = encode_message(obj, max_bytes)
    fds = None
    if fd is not None:
        if not isinstance(fd, (int, list, tuple)):
            raise InvalidArgumentError(f"fd must be an int or a list of ints, got {type(fd).__name__}")
        fds = [fd] if isinstance(fd, int) else list(fd)
        if len(fds) > _MAX_FDS:
            raise InvalidArgumentError(f"{len(fds)} fds in one message: SCM_RIGHTS carries at most {_MAX_FDS}")
        bad = next((f for f in fds if isinstance(f, bool) or not isinstance(f, int) or f < 0), None)
        if bad is not None or not fds:
            raise InvalidArgumentError(f"fd {fd!r} is not a valid file descriptor")
    _send_all(sock, data, fds, _deadline(timeout), rest_timeout)


def close_fds(fds: list[int]) -> None:
    """Close every fd in ``fds``, ignoring ones already closed (for fds received in a message)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _recvmsg(sock: socket.socket, bufsize: int, fds: list[int], call_flags: int = 0) -> tuple[bytes, int]:
    """``recvmsg`` with ``MSG_CMSG_CLOEXEC``: ``(data, msg_flags)``; ``SCM_RIGHTS`` fds are appended
    to ``fds``, and every other fd the kernel installed (``SCM_PIDFD``) is closed at once.

    Not :func:`socket.recv_fds`: CPython's drops its ``flags`` argument
    (python/cpython#107898), so the fds would arrive inheritable.
    """
    try:
        data, ancdata, flags, _ = sock.recvmsg(bufsize, _CMSG_BUFSIZE, _CLOEXEC | call_flags)
    except BlockingIOError:
        raise  # MSG_DONTWAIT found nothing: the caller polls
    except ConnectionResetError as exc:
        raise PeerClosedError(f"peer reset the connection: {exc}") from exc
    except OSError as exc:
        raise SyscallError("recvmsg", exc) from exc
    for level, kind, cdata in ancdata:
        if level != socket.SOL_SOCKET or kind not in (socket.SCM_RIGHTS, SCM_PIDFD):
            continue  # SCM_CREDENTIALS, SCM_SECURITY: data only, nothing to close
        got = array.array("i")
        got.frombytes(cdata[:len(cdata) - len(cdata) % got.itemsize])
        if kind == socket.SCM_RIGHTS:
            fds.extend(got)
        else:
            close_fds(list(got))
    return data, flags


def _fd_limit_error(narrived: int) -> FdLimitError | None:
    """The :class:`FdLimitError` when this process is at its ``RLIMIT_NOFILE``, after the ``narrived``
    fds of a truncated message were closed; ``None`` when it is not (the sender sent too many)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        nopen = len(os.listdir("/proc/self/fd")) - 1
    except OSError:  # no /proc, or not one fd free: ask each number instead
        nopen = sum(1 for fd in range(min(soft, 1 << 20)) if fd_is_open(fd))
    nopen += narrived  # as at the truncation
    if nopen + 1 < soft:
        return None
    return FdLimitError(f"fds were dropped by the kernel (MSG_CTRUNC): this process has {nopen} fds open "
                        f"and its RLIMIT_NOFILE soft limit is {soft}; {narrived} fd(s) arrived and were closed")


def _truncated(fds: list[int]) -> None:
    """A read came back with ``MSG_CTRUNC``: close (and clear) the ``fds`` that arrived and raise
    :class:`FdLimitError` when this process is at its fd limit, else ProtocolError."""
    narrived = len(fds)
    close_fds(fds)  # first: at the limit, counting open fds needs a free one
    fds.clear()
    limit = _fd_limit_error(narrived)
    if limit is not None:
        raise limit
    raise ProtocolError(f"control message truncated (MSG_CTRUNC): the kernel had more control data "
                        f"than fits in {_CMSG_BUFSIZE} bytes; {narrived} fd(s) arrived and were closed")


def recv_message(sock: socket.socket, timeout: float | None = DEFAULT_TIMEOUT, *, max_fds: int = 1,
                 max_bytes: int = MAX_MESSAGE, rest_timeout: float | None = None) -> tuple[dict[str, Any], list[int]]:
    """Receive one framed message and the fds that rode on it.

    The whole frame is read before the message is judged, so a rejected message
    (too many fds, a truncated control message, bad JSON) never leaves its
    rest to be read as the next one.

    Args:
        sock: a connected AF_UNIX socket.
        timeout: seconds to wait for the whole message (default :data:`DEFAULT_TIMEOUT`,
            60 s); ``None`` waits forever.
        max_fds: how many fds the message may carry (more is a ProtocolError).
        max_bytes: the largest JSON body accepted (default :data:`MAX_MESSAGE`, 64 KiB);
            a larger announced length is a ProtocolError before any of it is read.
        rest_timeout: when given, ``timeout`` bounds only the wait for the first byte, and the
            rest of a message once begun gets ``rest_timeout`` seconds of its own; so a short
            ``timeout`` that ends while a large message is arriving does not cut it off (which
            would break the connection).

    Returns:
        ``(message, fds)``; the caller owns every fd in ``fds`` (close-on-exec).

    Raises:
        PeerClosedError: EOF before the first byte, or in the middle.
        WaitTimeoutError: nothing (or not all of it) within ``timeout``.
        FdLimitError: the kernel dropped fds at the receiver's ``RLIMIT_NOFILE``.
        ProtocolError: a truncated control message (``MSG_CTRUNC``), more fds
            than ``max_fds``, bad framing, or a connection already broken mid-frame.
            Every fd that arrived is closed.
        SyscallError: ``recvmsg`` failed otherwise.
    """
    _check_unix(sock)
    return _recv_framed(sock, _deadline(timeout), max_fds, max_bytes, rest_timeout)


def _recv_framed(sock: socket.socket, deadline: float | None, max_fds: int, max_bytes: int,
                 rest_timeout: float | None = None) -> tuple[dict[str, Any], list[int]]:
    """:func:`recv_message` on any connected socket (a TCP one carries no fd: ``max_fds=0``): one
    :class:`FrameReader` that reads exactly one message and nothing of the next (``bufsize=0``)."""
    reader = FrameReader(sock, max_fds=max_fds, max_bytes=max_bytes, rest_timeout=rest_timeout, bufsize=0)
    return reader.read_by(deadline)


class FrameReader:
    """Framed messages from one connected stream socket, read through a buffer: one ``recvmsg`` takes
    every message that has arrived, so a burst of pipelined messages costs one call rather than two
    per message (header, then body). Same frames, errors and fd rules as :func:`recv_message`.

    The fds of a message ride on its first byte. On an AF_UNIX stream socket Linux ends a
    ``recvmsg`` with the segment that carried fds (``unix_stream_read_generic``, net/unix/af_unix.c:
    it stops once ``scm.fp`` is set), and a sender's segment holds bytes of one message only; so the
    fds of a read belong to the last message that begins in it. Fds in a read in which no message
    begins are a ProtocolError. (A peer that puts fds on a later byte of a message may so have them
    taken as that message's: its receiver accepts fds only on messages that expect them, which the
    peer could have sent them with anyway.)

    Once a reader has read a socket, nothing else may read it: bytes of later messages may wait in
    the buffer (unless ``bufsize`` is 0: then it reads exactly one message at a time, the header
    first, and nothing of the next; :func:`recv_message` reads so). Not thread-safe: one reader at a
    time (the caller holds a lock). On a record socket (``SOCK_SEQPACKET``) a message is one record:
    bytes after its frame in the same record are a ProtocolError.

    Args:
        sock: a connected socket (AF_UNIX stream or seqpacket, or TCP with ``max_fds=0``).
        max_fds: the most fds one message may carry.
        max_bytes: the largest JSON body accepted.
        rest_timeout: seconds the rest of a message may take once its first byte is here (``None``: the
            rest shares the wait of the read that began it).
        bufsize: bytes asked of each ``recvmsg`` beyond the message being completed.
    """

    def __init__(self, sock: socket.socket, *, max_fds: int, max_bytes: int, rest_timeout: float | None,
                 bufsize: int = 16384) -> None:
        self.sock = sock
        self.max_fds = max_fds
        self.max_bytes = max_bytes
        self.rest_timeout = rest_timeout
        # A record socket returns one whole record per recvmsg: asking for less would cut it.
        self._records = _type(sock) != _STREAM
        self.bufsize = _HEADER.size + max_bytes if self._records else bufsize
        self._buf = bytearray()
        self._pos = 0  # where the next message begins in _buf
        # By the offset in _buf of the message they rode on: its fds, and the error to raise for it
        # when the kernel truncated them (MSG_CTRUNC), raised once the messages before it are delivered.
        self._fds: dict[int, tuple[list[int], DmaBufError | None]] = {}
        self._rest_deadline: float | None = None  # set while part of a message is here
        # The last read had to wait for the socket: the next polls first (see _recv).
        self._poll_first = False
        #: True while something taken from the socket may be lost to an exception that a signal handler raises
        #: (KeyboardInterrupt, between any two steps of Python): from just before each ``recvmsg`` until its bytes
        #: and fds are in the buffer, and from the moment a message begins to leave the buffer on. Cleared here
        #: after a read's bytes are stored, never after a message leaves: its caller clears it once it holds the
        #: message or has handled it. A caller that must tell an interrupted wait (nothing taken) from an
        #: interrupted hand-over reads it.
        self.in_flight = False
        # Buffered fds are plain ints: a reader dropped without discard() still closes them.
        self._finalizer = weakref.finalize(self, FrameReader._close_all, self._fds)

    @staticmethod
    def _close_all(table: dict[int, tuple[list[int], DmaBufError | None]]) -> None:
        for fds, _ in table.values():
            close_fds(fds)
        table.clear()

    def buffered(self) -> int:
        """Bytes read from the socket and not yet handed out (messages, or the beginning of one): while
        any are, the next :meth:`read` may not need the socket to be readable."""
        return len(self._buf) - self._pos

    def pending_fds(self) -> int:
        """Fds received and not yet handed out (they are closed by :meth:`discard`)."""
        return sum(len(fds) for fds, _ in self._fds.values())

    def discard(self) -> None:
        """Drop what is buffered and close the fds that came with it (the connection is over)."""
        FrameReader._close_all(self._fds)
        self._buf.clear()
        self._pos = 0

    def _complete(self) -> tuple[int, int] | None:
        """``(start, end)`` of the next message if all of it is buffered, else None; a length over
        ``max_bytes`` is a ProtocolError."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < _HEADER.size:
            return None
        (n,) = _HEADER.unpack_from(buf, pos)
        if n > self.max_bytes:
            raise ProtocolError(f"frame announces {n} bytes, more than {self.max_bytes}")
        end = pos + _HEADER.size + n
        return (pos, end) if len(buf) >= end else None

    def _last_start(self, since: int) -> int | None:
        """The offset of the last message that begins at or after ``since`` in the buffer."""
        buf, at, last = self._buf, self._pos, None
        while at < len(buf):
            if at >= since:
                last = at
            if len(buf) - at < _HEADER.size:
                break
            (n,) = _HEADER.unpack_from(buf, at)
            at += _HEADER.size + n
        return last

    def _recv(self, size: int, fds: list[int], deadline: float | None, what: str) -> tuple[bytes, int]:
        """:func:`_recvmsg` once the socket is readable, waiting until ``deadline`` for ``what``: tried at
        once (``MSG_DONTWAIT``: data already waiting costs one call, no ``poll``) and polled on ``EAGAIN``;
        polled first while reads find the socket empty, and on a socket in timeout mode (:func:`_timeout_mode`).

        Measured and load-bearing: a reader that waits for each message (a consumer ahead of its
        producer) paid ``recvmsg`` -> ``EAGAIN`` (and the exception), ``poll``, ``recvmsg`` per message;
        polled first it pays ``poll`` + ``recvmsg``, one syscall fewer per hand-off. It goes back to
        trying first when a read finds more than one message (a reader behind its producer: one call
        per burst again) or its poll found data waiting (returned within :data:`_WAITED`; a ``poll``
        that returns at once takes 1-3 us on the 2-core CI machine, 10-20 us in a process that slept
        for milliseconds, a wake-up tens of us: a cold reader may keep polling first, at one cheap
        call a message)."""
        sock = self.sock
        if self._poll_first or _timeout_mode(sock):
            # (A timeout leaves the mode as it is: the socket was empty.)
            waited = _wait_readable(sock, deadline, what)
            self.in_flight = True  # (after the wait: an interrupt there takes nothing)
            data, flags = _recvmsg(sock, size, fds)
            if waited < _WAITED:
                self._poll_first = False
            elif self._pos == len(self._buf) and len(data) >= _HEADER.size:  # a message begins the read
                self._poll_first = len(data) <= _HEADER.size + _HEADER.unpack_from(data)[0]
            return data, flags
        try:
            self.in_flight = True
            return _recvmsg(sock, size, fds, _DONTWAIT)
        except BlockingIOError:
            self.in_flight = False  # (nothing came)
            self._poll_first = True
            _wait_readable(sock, deadline, what)
            self.in_flight = True
            return _recvmsg(sock, size, fds)

    def _fill(self, deadline: float | None, need: int) -> None:
        """One ``recvmsg`` of at least ``need`` bytes' room (MSG_DONTWAIT first, then ``poll``)."""
        sock, fds = self.sock, []
        size = max(need, self.bufsize)
        began = self._pos < len(self._buf)
        what = "the rest of a message" if began else "a message"
        try:
            data, flags = self._recv(size, fds, deadline, what)
            if not data:
                if fds or flags & _CTRUNC:
                    raise ProtocolError("fds arrived with no message bytes")
                if began:
                    raise PeerClosedError("peer closed the socket in the middle of a message")
                raise PeerClosedError("peer closed the socket before sending a message")
            since = len(self._buf)
            self._buf += data  # first: messages complete before a truncated one are still delivered
            if fds or flags & _CTRUNC:
                err = None
                if flags & _CTRUNC:
                    try:
                        _truncated(fds)  # closes them now: at the fd limit every free fd counts
                    except DmaBufError as exc:
                        err = exc
                at = self._last_start(since)
                if at is None and self.bufsize:
                    raise err or ProtocolError("fds arrived after the first byte of a message; all were closed")
                if at is None:
                    # One message at a time (recv_message): on a later byte of the message being completed
                    # (``_fill`` runs only while the message at ``_pos`` is incomplete), refused once its whole
                    # frame is in, so the stream stays in step.
                    close_fds(fds)
                    fds = []
                    mine, _ = self._fds.get(self._pos, ([], None))
                    err = err or ProtocolError("fds arrived after the first byte of a message; all were closed")
                    self._fds[self._pos] = (mine, err)
                    self.in_flight = False
                    return
                self._fds[at] = (fds, err)
            self.in_flight = False  # (the read is in the buffer, its fds in the table)
        except BaseException as exc:
            close_fds(fds)
            if isinstance(exc, Exception):
                self.in_flight = False  # (an error, not an interrupt: it says itself what became of the read)
            raise

    def read(self, timeout: float | None) -> tuple[dict[str, Any], list[int]]:
        """The next message and the fds that rode on it (the caller owns them). ``timeout`` bounds
        the wait for a message to begin; once begun, its rest has ``rest_timeout`` seconds.

        Raises: as :func:`recv_message`; FdLimitError (or ProtocolError) for a message whose fds the
        kernel truncated (``MSG_CTRUNC``), after the messages before it. A failure in the middle of
        a message, or a bad length, marks the connection broken for reading (every later call raises).
        """
        return self.read_by(_deadline(timeout))

    def read_by(self, deadline: float | None) -> tuple[dict[str, Any], list[int]]:
        """:meth:`read` with ``deadline``, a ``time.monotonic()`` time (``None``: none), for a caller
        that holds one: no conversion to a timeout and back per message."""
        sock = self.sock
        _check_in_step(sock, _broken_recv, "receive")
        try:
            while True:
                span = self._complete()
                if span is not None:
                    break
                if self._pos < len(self._buf):  # part of a message is here: its rest has its own time
                    if self._rest_deadline is None:
                        self._rest_deadline = deadline if self.rest_timeout is None else _deadline(self.rest_timeout)
                    wait = self._rest_deadline
                else:
                    wait = deadline
                need = _HEADER.size
                if len(self._buf) - self._pos >= _HEADER.size:
                    need = _HEADER.size + _HEADER.unpack_from(self._buf, self._pos)[0]
                self._fill(wait, need - (len(self._buf) - self._pos))
        except BaseException as exc:
            # Only a message left part-read puts the stream out of step: a wait for one to begin that
            # timed out or was interrupted leaves the connection as it was. So does an interrupt (an exception
            # a signal handler raised, KeyboardInterrupt, not an Exception) in the wait for the rest of one, to a
            # reader that lives on (a channel's): what came of it stays in its buffer, and its next read goes on
            # from there. A reader of one message (``bufsize`` 0: recv_message's) dies with what it read.
            if self._pos < len(self._buf) and (isinstance(exc, Exception) or not self.bufsize):
                _broken_recv[sock] = f"{type(exc).__name__}: {exc}"
            raise
        start, end = span
        self.in_flight = True  # (first: see __init__)
        self._rest_deadline = None
        fds, err = self._fds.pop(start, None) or ([], None)
        frame = self._buf[start:end]  # (a copy: the buffer is cleared or moved on below)
        if self._records and end < len(self._buf):  # the rest of its record: not a message of its own
            extra = len(self._buf) - end
            self.discard()
            close_fds(fds)
            raise ProtocolError(f"{extra} unexpected bytes after a {end - start - _HEADER.size}-byte message")
        if end == len(self._buf):
            self._buf.clear()
            self._pos = 0
        elif end > (1 << 20):  # drop what was read, now and then, not on every message
            del self._buf[:end]
            moved = {at - end: entry for at, entry in self._fds.items()}
            self._fds.clear()  # in place: the finalizer holds this dict
            self._fds.update(moved)
            self._pos = 0
        else:
            self._pos = end
        try:
            if err is not None:
                raise err  # the kernel truncated this message's fds (those that came are closed)
            if len(fds) > self.max_fds:
                raise ProtocolError(f"message carried {len(fds)} fds, at most {self.max_fds} expected; "
                                    "all were closed")
            return decode_message(frame, self.max_bytes), fds
        except BaseException:
            close_fds(fds)
            raise


def send_fd(sock: socket.socket, fd: int, meta: dict[str, Any] | None = None, *,
            timeout: float | None = DEFAULT_TIMEOUT) -> None:
    """Send ``fd`` (and an optional JSON object ``meta``) over ``sock``.

    The caller keeps ownership of its ``fd``; see :func:`send_message` (same errors).
    """
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        raise InvalidArgumentError(f"fd {fd!r} is not a valid file descriptor")
    send_message(sock, meta or {}, fd, timeout=timeout)


def recv_fd(sock: socket.socket, timeout: float | None = DEFAULT_TIMEOUT) -> int:
    """Receive exactly one fd sent with :func:`send_fd`; the caller owns it.

    Raises:
        ProtocolError: the message carried no fd, or more than one (all closed).
        PeerClosedError, WaitTimeoutError, FdLimitError: see :func:`recv_message`.
    """
    _msg, fds = recv_message(sock, timeout, max_fds=1)
    if len(fds) != 1:
        raise ProtocolError("message carried no fd")
    return fds[0]


def send_token(sock: socket.socket, token: bytes, timeout: float | None = DEFAULT_TIMEOUT) -> None:
    """Send one byte (the sample's "go" and "ack").

    Raises:
        PeerClosedError: the peer has gone.
        WaitTimeoutError: the socket stayed full past ``timeout`` (default 60 s).
    """
    if len(token) != 1:
        raise InvalidArgumentError("a token is exactly one byte")
    _send_all(sock, bytes(token), None, _deadline(timeout))


def recv_token(sock: socket.socket, timeout: float | None = DEFAULT_TIMEOUT) -> bytes:
    """Receive one byte, waiting at most ``timeout`` seconds (default 60 s; ``None`` forever).

    Raises:
        PeerClosedError: EOF (the "skip" signal).
        WaitTimeoutError: no byte within ``timeout``.
    """
    _check_in_step(sock, _broken_recv, "receive")
    deadline = _deadline(timeout)
    _wait_readable(sock, deadline, "a one-byte token")
    try:
        data = sock.recv(1)
    except ConnectionResetError as exc:
        raise PeerClosedError(f"peer reset the connection: {exc}") from exc
    if not data:
        raise PeerClosedError("peer closed the socket")
    return data
