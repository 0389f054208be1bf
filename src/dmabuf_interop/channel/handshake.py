"""The messages every channel connection begins with, local (:mod:`.rendezvous`) or ``tcp://`` (:mod:`.remote`).

``hello`` carries the protocol and library versions, the kernel's boot id, the
GPUs this process sees and its pid; ``refuse`` carries the reason a side will
not go on, after which it closes the connection.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ..errors import PeerClosedError, PeerRefusedError, ProtocolError
from .protocol import PROTOCOL_VERSION, host_boot_id, parse_message
from .wire import recv_frame, send_frame

__all__ = ["hello", "refuse", "recv_hello"]


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
