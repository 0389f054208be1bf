"""How every channel connection begins, local (:mod:`.rendezvous`) or ``tcp://`` (:mod:`.remote`).

``hello`` carries the protocol and library versions, the kernel's boot id, the
GPUs this process sees and its pid; ``refuse`` carries the reason a side will
not go on, after which it closes the connection. :class:`ListenerBase` is what
both kinds of listener share: the accept loop and closing.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from .._time import deadline_after
from ..errors import InvalidArgumentError, PeerClosedError, PeerRefusedError, ProtocolError, SyscallError
from .protocol import PROTOCOL_VERSION, host_boot_id, parse_message
from .wire import recv_frame, send_frame

__all__ = ["hello", "refuse", "recv_hello", "ListenerBase"]


def hello(overrides: dict[str, Any] | None, gpus: list[str]) -> dict[str, Any]:
    """This side's ``hello`` (``overrides`` replace fields, for tests of the refusals)."""
    from .. import __version__

    msg = {"kind": "hello", "protocol": PROTOCOL_VERSION, "library": __version__,
           "boot_id": host_boot_id(), "gpus": gpus, "pid": os.getpid()}
    if overrides:
        msg.update(overrides)
    return msg


def refuse(sock: socket.socket, reason: str) -> None:
    """Tell the peer why (best effort: it may have gone already), then close ``sock``."""
    try:
        send_frame(sock, {"kind": "refuse", "reason": reason})
    except (PeerClosedError, OSError):
        pass
    sock.close()


def recv_hello(sock: socket.socket, timeout: float | None) -> dict[str, Any]:
    """The peer's validated ``hello``.

    Raises:
        PeerRefusedError: the peer refused us (its reason is in the message).
        ProtocolError: another message, a malformed one, or one that carried an fd (closed).
        PeerClosedError, WaitTimeoutError: the peer left, or said nothing within ``timeout`` seconds.
    """
    msg, fds = recv_frame(sock, timeout)
    if fds:
        from ..fdpass import close_fds

        close_fds(fds)
        raise ProtocolError("the handshake carried an fd")
    kind, _ = parse_message(msg)
    if kind == "refuse":
        raise PeerRefusedError(f"the peer refused this connection: {msg['reason']}")
    if kind != "hello":
        raise ProtocolError(f"expected a hello message, got {kind!r}")
    return msg


class ListenerBase:
    """The accept loop and closing of a listener; a subclass sets ``address`` and ``_sock`` and
    implements :meth:`_accept_one` (the handshake on one accepted connection) and :meth:`close`."""

    address: str
    _sock: socket.socket

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self, timeout: float | None = 60.0) -> Any:
        """Wait for the next consumer and return its channel.

        A connection whose peer left before or during the handshake (a client
        that gave up waiting, the liveness check of a second ``listen`` on the
        same address) is closed and skipped: the wait goes on for the next one.
        The subclass's :meth:`_accept_one` names the other errors.

        Raises:
            InvalidArgumentError: the listener is closed.
        """
        if self.closed:
            raise InvalidArgumentError(f"the listener on {self.address} is closed")
        deadline = deadline_after(timeout)
        while True:
            conn = self._next_connection(deadline)
            try:
                return self._accept_one(conn, deadline)  # the channel owns conn from here
            except PeerClosedError:
                conn.close()  # that peer is gone; the deadline still bounds the wait
            except BaseException:
                conn.close()
                raise

    def _next_connection(self, deadline: float | None) -> socket.socket:
        """The next connected socket (``poll`` then ``accept``).

        Raises:
            WaitTimeoutError: none by ``deadline``. SyscallError: ``accept`` failed.
            InvalidArgumentError: the listener was closed meanwhile.
        """
        from ..fdpass import _wait_readable

        _wait_readable(self._sock, deadline, "a channel consumer to connect")
        if self.closed:  # close() from another thread woke the wait
            raise InvalidArgumentError(f"the listener on {self.address} was closed")
        try:
            conn, _ = self._sock.accept()
        except OSError as exc:
            if self.closed:
                raise InvalidArgumentError(f"the listener on {self.address} was closed") from exc
            raise SyscallError("accept", exc) from exc
        return conn

    def _accept_one(self, conn: socket.socket, deadline: float | None) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        raise NotImplementedError

    def __enter__(self) -> "ListenerBase":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.address!r} {'closed' if self.closed else 'open'}>"
