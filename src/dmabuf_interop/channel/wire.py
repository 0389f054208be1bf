"""Framing for channel connections: the library's message format with a larger body limit.

Frames are those of :mod:`..fdpass` (a 4-byte big-endian length, then UTF-8
JSON, the fds of a ``chunk`` message by ``SCM_RIGHTS`` on the first byte), sent and received
by :func:`..fdpass.send_message` / :func:`..fdpass.recv_message` themselves;
``tcp://`` control connections (:mod:`.remote`) carry the same frames with no fd.
Array batches with caller ``meta`` can exceed fdpass's default 64 KiB, so
bodies here may be up to :data:`MAX_FRAME` bytes.
"""

from __future__ import annotations

import socket
from typing import Any

from .._time import deadline_after
from ..errors import InvalidArgumentError
from ..fdpass import FrameReader, _family, _send_all, encode_message, recv_message, send_message
from .protocol import MAX_PARTS

__all__ = ["MAX_FRAME", "send_frame", "recv_frame", "frame_reader", "shut_down"]

#: Largest JSON body of one channel message, in bytes.
MAX_FRAME = 16 * 1024 * 1024
#: Seconds the rest of a message may take once its first byte has arrived.
REST_TIMEOUT = 60.0


def send_frame(sock: socket.socket, obj: dict[str, Any], timeout: float | None = 60.0,
               rest_timeout: float | None = None) -> None:
    """Send one message with no fd (``rest_timeout``: as for :func:`..fdpass.send_message`).

    Raises:
        InvalidArgumentError: not JSON-serialisable or over :data:`MAX_FRAME`.
        PeerClosedError: the peer has gone (``EPIPE`` / ``ECONNRESET``).
        WaitTimeoutError: the peer stopped reading for ``timeout`` seconds.
    """
    if _family(sock) == socket.AF_UNIX:
        send_message(sock, obj, timeout=timeout, max_bytes=MAX_FRAME, rest_timeout=rest_timeout)
    else:  # fdpass's public calls refuse sockets that cannot carry an fd; this frame carries none
        _send_all(_tcp(sock), encode_message(obj, MAX_FRAME), None, deadline_after(timeout), rest_timeout)


def recv_frame(sock: socket.socket, timeout: float | None, *, whole: bool = False,
               max_bytes: int = MAX_FRAME) -> tuple[dict[str, Any], list[int]]:
    """Receive one message and the fds on it, if any (at most :data:`.protocol.MAX_PARTS`; ``recvmsg``
    with ``MSG_CMSG_CLOEXEC``); the caller owns the fds. ``timeout`` bounds the wait for the message
    to begin; once begun, the rest has :data:`REST_TIMEOUT` seconds, so a short ``timeout`` never
    cuts a large message in two. With ``whole``, ``timeout`` bounds the whole message (a handshake:
    a peer that sends one byte and stops is not given :data:`REST_TIMEOUT`). ``max_bytes``: the largest
    body accepted (at most :data:`MAX_FRAME`).

    Raises:
        PeerClosedError: EOF. WaitTimeoutError: nothing within ``timeout`` seconds, or the rest of a
            message not within :data:`REST_TIMEOUT` (``whole``: not within ``timeout``).
        ProtocolError: a truncated control message, bad framing, or a body that is not a JSON object
            (every fd that arrived is closed first).
    """
    rest = None if whole else REST_TIMEOUT  # None: the rest shares the deadline of the wait that began it
    if _family(sock) == socket.AF_UNIX:
        return recv_message(sock, timeout, max_fds=MAX_PARTS, max_bytes=max_bytes, rest_timeout=rest)
    # One message and nothing of the next (bufsize=0): the socket may be handed to a buffered reader after.
    return FrameReader(_tcp(sock), max_fds=0, max_bytes=max_bytes, rest_timeout=rest, bufsize=0).read(timeout)


def frame_reader(sock: socket.socket) -> FrameReader:
    """A buffered reader of the messages on ``sock`` (:class:`..fdpass.FrameReader`), with the limits of
    :func:`recv_frame`: at most :data:`.protocol.MAX_PARTS` fds on an AF_UNIX socket, none on TCP. Once
    it has read, only it may read ``sock``."""
    if _family(sock) == socket.AF_UNIX:
        return FrameReader(sock, max_fds=MAX_PARTS, max_bytes=MAX_FRAME, rest_timeout=REST_TIMEOUT)
    return FrameReader(_tcp(sock), max_fds=0, max_bytes=MAX_FRAME, rest_timeout=REST_TIMEOUT)


def _tcp(sock: socket.socket) -> socket.socket:
    if sock.fileno() == -1:
        raise InvalidArgumentError("the socket is closed")
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        raise InvalidArgumentError(f"a channel connection is an AF_UNIX or TCP stream socket, not {sock!r}")
    return sock


def shut_down(sock: socket.socket) -> None:
    """``shutdown(SHUT_RDWR)`` of ``sock``, if it is still open, ignoring a connection already gone: a
    thread waiting in ``poll`` on it (``accept``, a send to a peer that stopped reading, a reader)
    wakes, which closing the fd would not do, and a connected peer sees the end at once."""
    if sock.fileno() >= 0:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
