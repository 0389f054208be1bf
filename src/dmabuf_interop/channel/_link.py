"""The write side of a channel's socket: one message at a time under the send lock, each waiting at most
:data:`SEND_TIMEOUT` for the peer to take it; a message cut off part-way ends the connection, since the
stream is out of step for good (:meth:`ConnectionState.send_failed <._state.ConnectionState.send_failed>`).
"""

from __future__ import annotations

import copy
import socket
import threading
from typing import Any, Sequence

from ..errors import DmaBufError, PeerClosedError, WaitTimeoutError
from ..fdpass import _broken_send, send_message
from ._state import ConnectionState
from .wire import send_frame, shut_down

__all__ = ["Link", "SEND_TIMEOUT"]

#: Seconds a message may wait for the peer to take it (a full socket buffer) before the send fails; one cut
#: off part-way ends the connection.
SEND_TIMEOUT = 60.0


class Link:
    """Sends on one connected socket (AF_UNIX, or TCP with no fd). ``lock`` is the channel's send lock:
    whoever holds it may call :meth:`send_locked`; :meth:`send` takes it.

    Args:
        sock: the socket (the channel owns it and closes it).
        proto: the connection's state: nothing goes out once it is over or a send broke the stream.
        send_timeout: the default of ``timeout`` (:data:`SEND_TIMEOUT`).
    """

    def __init__(self, sock: socket.socket, proto: ConnectionState, send_timeout: float = SEND_TIMEOUT) -> None:
        self.sock = sock
        self.proto = proto
        self.send_timeout = send_timeout
        self.lock = threading.Lock()

    def send(self, obj: dict[str, Any], fd: int | Sequence[int] | None = None, *, essential: bool = False) -> None:
        with self.lock:
            self.send_locked(obj, fd, essential=essential)

    def send_locked(self, obj: dict[str, Any], fd: int | Sequence[int] | None = None,
                    timeout: float | None = None, *, essential: bool = False) -> None:
        """Send one message (the caller holds the send lock), waiting at most ``timeout`` seconds
        (default :attr:`send_timeout`) for the peer to take it. ``essential``: a ``release`` or
        ``retire``, which the peer must not miss while the connection lasts (its blocks would stay
        lent, or its mapping kept): one the peer took none of ends the connection too."""
        if not self.proto.can_send or self.sock in _broken_send:
            raise self.ended()
        wait = self.send_timeout if timeout is None else timeout
        try:
            if fd is None:
                send_frame(self.sock, obj, wait)
            else:
                send_message(self.sock, obj, fd, timeout=wait)
        except BaseException as exc:
            cut = self.sock in _broken_send
            if not (cut or (essential and isinstance(exc, WaitTimeoutError))):
                raise  # nothing of the message went out: the connection is as it was
            # Cut off after its first byte (a peer that stopped reading, or an interrupt), the stream
            # is out of step for good; or an essential message could not go. End it: the peer sees the
            # end at once, our reader ends the channel. Kept without its traceback (a copy): that would
            # hold the sender's frames, and with them its arrays and their pool chunks.
            self.proto.send_failed(copy.copy(exc))
            shut_down(self.sock)  # (we hold the send lock, under which _end closes the socket)
            if not isinstance(exc, DmaBufError):
                raise  # (KeyboardInterrupt and the like stay what they are)
            what = "was cut off" if cut else "could not go"
            raise PeerClosedError(f"the {obj.get('kind')!r} message to the peer {what} ({exc}): the connection is "
                                  f"ended") from exc

    def ended(self) -> PeerClosedError:
        """The error for a call on a channel that has ended, saying how it ended, chained to the cause."""
        err = self.proto.error
        if self.proto.closed_here:
            why = "the channel is closed"
        elif err is None or isinstance(err, PeerClosedError):
            why = "the peer closed the channel"
        else:  # a failure here (no fd left to map a chunk, a message cut off), not the peer's doing
            why = f"the connection ended on an error: {type(err).__name__}: {err}"
        exc = PeerClosedError(why)
        exc.__cause__ = err
        return exc
