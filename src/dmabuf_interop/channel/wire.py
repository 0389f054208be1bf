"""Framing for channel connections: the library's message format with a larger body limit.

Frames are those of :mod:`..fdpass` (a 4-byte big-endian length, then UTF-8
JSON, at most one fd by ``SCM_RIGHTS`` on the first byte); messages that carry
an fd (``chunk``) go through :func:`..fdpass.send_message` itself. Array
batches with caller ``meta`` can exceed fdpass's 64 KiB, so bodies here may be
up to :data:`MAX_FRAME` bytes.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from ..errors import InvalidArgumentError, PeerClosedError, ProtocolError
from .._time import deadline_after as _deadline
from ..fdpass import _recv_exact, _recv_fds, _wait_readable, close_fds

__all__ = ["MAX_FRAME", "send_frame", "recv_frame"]

#: Largest JSON body of one channel message, in bytes.
MAX_FRAME = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    """Send one message with no fd (``sendall``).

    Raises:
        InvalidArgumentError: not JSON-serialisable or over :data:`MAX_FRAME`.
        PeerClosedError: the peer has gone (``EPIPE`` / ``ECONNRESET``).
    """
    try:
        body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"message is not JSON-serialisable: {exc}") from exc
    if len(body) > MAX_FRAME:
        raise InvalidArgumentError(f"message body is {len(body)} bytes, more than {MAX_FRAME}")
    try:
        sock.sendall(_HEADER.pack(len(body)) + body)
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise PeerClosedError(f"peer closed the connection while sending: {exc}") from exc


def recv_frame(sock: socket.socket, timeout: float | None) -> tuple[dict[str, Any], list[int]]:
    """Receive one message and the fds on it (``recvmsg`` with ``MSG_CMSG_CLOEXEC``); the caller owns the fds.

    Raises:
        PeerClosedError: EOF. WaitTimeoutError: nothing within ``timeout`` seconds.
        ProtocolError: a truncated control message, bad framing, or a body that is not a JSON object
            (every fd that arrived is closed first).
    """
    deadline = _deadline(timeout)
    _wait_readable(sock, deadline, "a channel message")
    try:
        data, fds, flags = _recv_fds(sock, _HEADER.size, 8)
    except (ConnectionResetError, BrokenPipeError) as exc:
        raise PeerClosedError(f"peer reset the connection: {exc}") from exc
    try:
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError("control message truncated (MSG_CTRUNC): too many fds, or RLIMIT_NOFILE reached")
        if not data:
            if fds:
                raise ProtocolError("fds arrived with no message bytes")
            raise PeerClosedError("peer closed the connection")
        if len(data) < _HEADER.size:
            data += _recv_exact(sock, _HEADER.size - len(data), deadline, fds)
        (n,) = _HEADER.unpack_from(data)
        if n > MAX_FRAME:
            raise ProtocolError(f"frame announces {n} bytes, more than {MAX_FRAME}")
        body = _recv_exact(sock, n, deadline, fds) if n else b""
        try:
            obj = json.loads(body.decode())
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ProtocolError(f"message body is not UTF-8 JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise ProtocolError(f"message body is a JSON {type(obj).__name__}, not an object")
        return obj, fds
    except BaseException:
        close_fds(fds)
        raise
