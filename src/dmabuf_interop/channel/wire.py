"""Framing for channel connections: the library's message format with a larger body limit.

Frames are those of :mod:`..fdpass` (a 4-byte big-endian length, then UTF-8
JSON, the fds of a ``chunk`` message by ``SCM_RIGHTS`` on the first byte), sent and received
by :func:`..fdpass.send_message` / :func:`..fdpass.recv_message` themselves;
``tcp://`` control connections (:mod:`.remote`) carry the same frames with no fd.
Array batches with caller ``meta`` can exceed fdpass's default 64 KiB, so
bodies here may be up to :data:`MAX_FRAME` bytes. The two messages of every hand-off, ``repeat`` and
``release``, are framed from templates (:func:`encode_repeat`, :func:`encode_release`): the encoder's
bytes exactly, for less.
"""

from __future__ import annotations

import socket
from json.encoder import encode_basestring_ascii as _json_str  # type: ignore[attr-defined]
from typing import Any

from .._time import deadline_after
from ..errors import DmaBufError, InvalidArgumentError
from ..fdpass import (_HEADER, FrameReader, _family, _send_all, decode_message, encode_message, recv_message,
                      send_message)
from .protocol import MAX_PARTS

__all__ = ["MAX_FRAME", "send_frame", "recv_frame", "frame_reader", "shut_down", "encode_repeat", "encode_release",
           "frame_kind"]

#: Largest JSON body of one channel message, in bytes.
MAX_FRAME = 16 * 1024 * 1024
#: Seconds the rest of a message may take once its first byte has arrived.
REST_TIMEOUT = 60.0


def send_frame(sock: socket.socket, obj: dict[str, Any] | bytes, timeout: float | None = 60.0,
               rest_timeout: float | None = None) -> None:
    """Send one message with no fd (``rest_timeout``: as for :func:`..fdpass.send_message`): a JSON object,
    or a message framed already (bytes: :func:`encode_repeat`, :func:`encode_release`).

    Raises:
        InvalidArgumentError: not JSON-serialisable or over :data:`MAX_FRAME`; a closed socket.
        PeerClosedError: the peer has gone (``EPIPE`` / ``ECONNRESET``).
        WaitTimeoutError: the peer stopped reading for ``timeout`` seconds.
    """
    if type(obj) is bytes:  # framed already: straight to the socket
        if _family(sock) == socket.AF_UNIX:
            if sock.fileno() == -1:
                raise InvalidArgumentError("the socket is closed")
        else:
            _tcp(sock)
        _send_all(sock, obj, None, deadline_after(timeout), rest_timeout)
    elif _family(sock) == socket.AF_UNIX:
        send_message(sock, obj, timeout=timeout, max_bytes=MAX_FRAME, rest_timeout=rest_timeout)
    else:  # fdpass's public calls refuse sockets that cannot carry an fd; this frame carries none
        _send_all(_tcp(sock), encode_message(obj, MAX_FRAME), None, deadline_after(timeout), rest_timeout)


# Speed trick, measured: the repeat (one per hand-off of an array sent again) framed from a template,
# 0.5 us instead of 2.4 us through the JSON encoder (2-core CI machine, Python 3.11): the same bytes,
# field for field in the order of the dict it stands for (tests/channel/test_fastpath.py).
_REPEAT = b'{"kind":"repeat","lease":%d,"layout":%d,"ordering":%s,"event":%s,"meta":null}'
_ORDERINGS = {"none": b'"none"', "sync": b'"sync"', "event": b'"event"'}


def encode_repeat(lease: int, layout: int, ordering: str, event: str | None, meta: dict[str, Any] | None) -> bytes:
    """The framed ``repeat`` message (as :func:`..fdpass.encode_message` frames the dict
    ``{"kind": "repeat", "lease": ..., "layout": ..., "ordering": ..., "event": ..., "meta": ...}``, byte
    for byte): from a template when ``meta`` is ``None`` and the fields are what a sender makes (ints,
    a known ordering, an event string or ``None``), else through the encoder.

    Raises:
        InvalidArgumentError: ``meta`` not JSON-serialisable, or the message over :data:`MAX_FRAME`.
    """
    order = _ORDERINGS.get(ordering) if type(ordering) is str else None
    if meta is None and order is not None and type(lease) is int and type(layout) is int and (
            event is None or type(event) is str):
        body = _REPEAT % (lease, layout, order, b"null" if event is None else _json_str(event).encode())
        if len(body) <= MAX_FRAME:
            return _HEADER.pack(len(body)) + body
    return encode_message({"kind": "repeat", "lease": lease, "layout": layout, "ordering": ordering,
                           "event": event, "meta": meta}, MAX_FRAME)


def encode_release(leases: list[int]) -> bytes:
    """The framed ``release`` message of ``leases`` (lease ids, ints), as :func:`..fdpass.encode_message`
    frames ``{"kind": "release", "leases": leases}``, byte for byte (a template: 0.5 us instead of 1.7 us
    for one lease, measured as :func:`encode_repeat`; anything but a list of ints goes through the encoder).

    Raises:
        InvalidArgumentError: not JSON-serialisable, or the message over :data:`MAX_FRAME`.
    """
    if type(leases) is list and all(type(x) is int for x in leases):
        body = b'{"kind":"release","leases":[%s]}' % ",".join(map(str, leases)).encode()
        if len(body) <= MAX_FRAME:
            return _HEADER.pack(len(body)) + body
    return encode_message({"kind": "release", "leases": leases}, MAX_FRAME)


def frame_kind(obj: dict[str, Any] | bytes) -> Any:
    """The ``kind`` of a message given to :func:`send_frame` (for an error that names it)."""
    if type(obj) is bytes:
        try:
            return decode_message(obj, MAX_FRAME).get("kind")
        except DmaBufError:
            return None
    return obj.get("kind")


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
