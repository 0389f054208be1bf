"""The write side of a channel's socket: one message at a time under the send lock, each waiting at most
:data:`SEND_TIMEOUT` for the peer to take it; a message cut off part-way ends the connection, since the
stream is out of step for good (:meth:`ConnectionState.send_failed <._state.ConnectionState.send_failed>`).
"""

from __future__ import annotations

import collections
import copy
import logging
import socket
import threading
import time
from typing import Any, Callable, Sequence

from ..errors import ClosedError, DmaBufError, InvalidArgumentError, LocalError, PeerClosedError, WaitTimeoutError
from ..fdpass import _broken_send, send_message
from ._state import ConnectionState
from .wire import frame_kind, send_frame, shut_down

__all__ = ["Link", "SEND_TIMEOUT"]

#: Seconds a message may wait for the peer to take it (a full socket buffer) before the send fails; one cut
#: off part-way ends the connection.
SEND_TIMEOUT = 60.0

log = logging.getLogger("dmabuf_interop.channel")
_monotonic = time.monotonic


class Link:
    """Sends on one connected socket (AF_UNIX, or TCP with no fd). ``lock`` is the channel's send lock:
    whoever holds it may call :meth:`send_locked`; :meth:`send` takes it. It knows the thread that holds it
    (:meth:`held_here`), so that a ``close()`` called inside that thread's own send (a signal handler) knows
    not to wait for it, and an interrupt right after it was taken cannot leave it held (Note [the send lock's
    owner]). ``sent`` counts the messages that went out whole since the handshake (a shared-memory ring slot
    says how many came before it).

    Args:
        sock: the socket (the channel owns it and closes it).
        proto: the connection's state: nothing goes out once it is over or a send broke the stream.
        send_timeout: the default of ``timeout`` (:data:`SEND_TIMEOUT`).
    """

    def __init__(self, sock: socket.socket, proto: ConnectionState, send_timeout: float = SEND_TIMEOUT) -> None:
        self.sock = sock
        self.proto = proto
        self.send_timeout = send_timeout
        # An RLock for the owner it records as it is taken (in C, in one step), never to be taken twice: a
        # thread that holds it gets a level more and is refused (Note [the send lock's owner]).
        self.lock = threading.RLock()
        self.sent = 0  # messages gone out whole (changed under the lock)
        # Per thread, id() of the last exception a send raised with nothing of its message gone out (the connection
        # as it was): a caller that catches an interrupt tells one in the wait from one after the message left
        # (clear_unsent, then was_unsent). An id, not the exception: its traceback would hold the sender's frames
        # (its arrays, their chunks); per thread, so that another thread's send neither clears nor fakes it.
        self._unsent = threading.local()
        self.due: collections.deque[Callable[[], None]] = collections.deque()  # :meth:`defer`'s jobs not yet run

    # Note [the send lock's owner]. A signal handler runs between two bytecodes of the main thread, so a
    # KeyboardInterrupt can land right after ``acquire`` took a lock and before the ``try`` whose ``finally``
    # lets it go: the lock would stay held, every later send would time out, and the end of the connection, which
    # takes it without a limit, would hang. So every take of the send lock (:meth:`acquire`, :meth:`acquire_by`,
    # :meth:`try_acquire`) is made inside the ``try`` whose ``finally`` calls :meth:`release`, and
    # :meth:`release` lets go only if this thread holds the lock, which the RLock records as it is taken: an
    # interrupt before, in or after the take leaves the lock as it would be without the take. The send lock is
    # never held twice: a send made from inside this thread's own send (a signal handler's) would interleave its
    # message with the one half sent. Such a take gets the RLock's level more, which its ``finally`` gives back,
    # and is refused: :meth:`acquire_by` raises InvalidArgumentError, :meth:`acquire` and :meth:`try_acquire`
    # answer False.

    def _take(self, timeout: float) -> bool:
        """Take the send lock (``timeout``: seconds, -1 for no limit), or a level more of it where this thread
        holds it already, which is refused (False) and which the caller's :meth:`release` gives back."""
        lock = self.lock
        again = lock._is_owned()
        if lock.acquire(False) or lock.acquire(True, timeout):  # (a free lock: no wait; this thread's: a level)
            return not again
        return False

    def acquire(self, timeout: float | None = None) -> bool:
        """Take the send lock, waiting at most ``timeout`` seconds (``None``: as long as it takes); False when
        another thread held it past that or this thread holds it already. Call it inside a ``try`` whose
        ``finally`` calls :meth:`release`, whatever it answers (Note [the send lock's owner])."""
        return self._take(-1 if timeout is None else timeout)

    def acquire_by(self, deadline: float | None) -> None:
        """Take the send lock, waiting at most :meth:`wait_for` ``deadline``. Call it inside a ``try`` whose
        ``finally`` calls :meth:`release` (Note [the send lock's owner]).

        Raises:
            WaitTimeoutError: another thread's send held it past that.
            InvalidArgumentError: this thread holds it already: a send from inside its own send (a signal
                handler's), which would interleave the two messages.
        """
        lock = self.lock
        again = lock._is_owned()
        try:
            if lock.acquire(False) or lock.acquire(True, self.wait_for(deadline)):  # (a free lock: no wait computed)
                if again:
                    raise InvalidArgumentError("a send from inside this thread's own send (a signal handler's?) "
                                               "would interleave the two messages: send after it returns")
                return
        except BaseException as exc:  # an interrupt in the wait: nothing sent (see was_unsent)
            self._unsent.id = id(exc)
            raise
        raise WaitTimeoutError("another thread's send held the connection past the timeout")

    def clear_unsent(self) -> None:
        """Forget, for this thread, which exception last left nothing sent: call it before a send whose
        interruption :meth:`was_unsent` will judge."""
        self._unsent.id = 0

    def was_unsent(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised in this thread since its :meth:`clear_unsent`, left nothing of its message sent
        (a wait for the send lock, or for room before any byte left): the connection is as it was."""
        return getattr(self._unsent, "id", 0) == id(exc)

    def try_acquire(self) -> bool:
        """Take the send lock if it is free (False: another thread holds it, or this one does). Call it inside a
        ``try`` whose ``finally`` calls :meth:`release`, whatever it answers (Note [the send lock's owner])."""
        return self._take(0)

    def release(self) -> None:
        """Let go of this thread's hold of the send lock, if it has one (nothing otherwise: a take that failed or
        never happened); then, once it is free, run what :meth:`defer` left."""
        lock = self.lock
        if not lock._is_owned():
            return
        lock.release()
        if self.due and not lock._is_owned():  # (after the release: a job deferred meanwhile runs now)
            self._run_due()

    def defer(self, job: Callable[[], None]) -> None:
        """Run ``job`` under the send lock without waiting for it: now if the lock is free, else in the thread
        that holds it, right after it lets go (:meth:`release`). Jobs run in the order deferred. ``job`` must not
        take the lock again; one that raises is logged (``ERROR``), not raised into the unrelated call that let
        the lock go.

        Why: a caller with a timeout of its own (``SharedPool.empty`` retiring an idle chunk) must not wait,
        with no limit, for another thread's send, which may wait for a slow peer. A job appended while a holder
        lets go is not lost: either this call takes the lock after it, or the thread that holds the lock then
        looks at :attr:`due` after its own release."""
        self.due.append(job)
        self._run_due()

    def run_due_held(self) -> None:
        """(The caller holds the send lock.) Run the jobs :meth:`defer` left so far, in this thread: a holder that
        depends on them (the count of chunks a ``retire`` lowers) need not wait for the last holder's release."""
        due = self.due
        while due:
            try:
                due.popleft()()
            except Exception:  # noqa: BLE001 - our bug, not the caller's: logged, the next job runs
                log.exception("a job deferred to the channel's send lock failed")

    def _run_due(self) -> None:
        lock = self.lock
        if lock._is_owned():
            return  # this thread's hold: its release runs them
        while self.due:
            try:
                if not lock.acquire(False):
                    return
                self.run_due_held()
            finally:
                if lock._is_owned():
                    lock.release()

    def held_here(self) -> bool:
        """Whether this thread holds the send lock (a ``close()`` inside its own interrupted send)."""
        return self.lock._is_owned()

    def wait_for(self, deadline: float | None) -> float:
        """The wait for a message to begin to leave by ``deadline`` (``time.monotonic()``, ``None``: none),
        at most :attr:`send_timeout`."""
        if deadline is None:
            return self.send_timeout
        return max(0.0, min(deadline - _monotonic(), self.send_timeout))

    def send(self, obj: dict[str, Any] | bytes, fd: int | Sequence[int] | None = None, *, essential: bool = False,
             timeout: float | None = None) -> None:
        """:meth:`send_locked` under the lock; ``timeout`` bounds the wait for the lock as well.

        Raises: as :meth:`send_locked`; WaitTimeoutError: another thread's send held the lock past ``timeout``.
        """
        try:
            try:
                got = self.acquire(timeout)
            except BaseException as exc:  # an interrupt in the wait: nothing sent (see was_unsent)
                self._unsent.id = id(exc)
                raise
            if not got:
                if self.held_here():  # (a level more of this thread's hold, given back below)
                    raise InvalidArgumentError("a send from inside this thread's own send (a signal handler's?) "
                                               "would interleave the two messages: send after it returns")
                raise WaitTimeoutError(f"another thread's send held the connection for {timeout} s")
            self.send_locked(obj, fd, timeout, essential=essential)
        finally:
            self.release()

    def send_locked(self, obj: dict[str, Any] | bytes, fd: int | Sequence[int] | None = None,
                    timeout: float | None = None, *, essential: bool = False, whole: bool = False) -> None:
        """Send one message (the caller holds the send lock), waiting at most ``timeout`` seconds
        (default :attr:`send_timeout`) for it to begin to leave; once begun, the rest has
        :attr:`send_timeout` (``whole``: ``timeout`` bounds the whole message). So a ``WaitTimeoutError``
        means none of it went out, and the connection is as it was. ``essential``: a ``release`` or
        ``retire``, which the peer must not miss while the connection lasts (its blocks would stay
        lent, or its mapping kept): one the peer took none of ends the connection too. ``obj``: a JSON
        object, or a message framed already (:func:`.wire.encode_repeat`, :func:`.wire.encode_release`).

        Raises:
            ClosedError: this end closed the channel (also while the message was going out).
            PeerClosedError: the connection has ended, or the message was cut off (the connection is ended).
            WaitTimeoutError: none of the message went out within ``timeout``.
        """
        if not self.proto.can_send or self.sock in _broken_send:
            raise self.ended()
        wait = self.send_timeout if timeout is None else timeout
        rest = None if whole else self.send_timeout
        try:
            if fd is None:
                send_frame(self.sock, obj, wait, rest)
            else:
                send_message(self.sock, obj, fd, timeout=wait, rest_timeout=rest)
        except BaseException as exc:
            cut = self.sock in _broken_send
            if not (cut or (essential and isinstance(exc, WaitTimeoutError))):
                if self.proto.closed_here and isinstance(exc, DmaBufError):
                    raise ClosedError("this end closed the channel while the message was going out") from exc
                self._unsent.id = id(exc)  # (an interrupt too: the caller may tell it from one after the message left)
                raise  # nothing of the message went out: the connection is as it was
            # Cut off after its first byte (a peer that stopped reading, or an interrupt), the stream
            # is out of step for good; or an essential message could not go. End it: the peer sees the
            # end at once, our reader ends the channel. Kept without its traceback (a copy): that would
            # hold the sender's frames, and with them its arrays and their pool chunks.
            # (An interrupt is kept as a LocalError naming it: a copy of a KeyboardInterrupt says nothing.)
            self.proto.send_failed(copy.copy(exc) if isinstance(exc, Exception) else LocalError(
                f"{type(exc).__name__} cut off a {frame_kind(obj)!r} message to the peer: the connection was ended"))
            shut_down(self.sock)  # (we hold the send lock, under which _end closes the socket)
            if not isinstance(exc, DmaBufError):
                raise  # (KeyboardInterrupt and the like stay what they are)
            if self.proto.closed_here:
                raise ClosedError("this end closed the channel while the message was going out") from exc
            what = "was cut off" if cut else "could not go"
            raise PeerClosedError(f"the {frame_kind(obj)!r} message to the peer {what} ({exc}): the connection is "
                                  f"ended") from exc
        self.sent += 1

    def ended(self) -> DmaBufError:
        """The error for a call on a channel that has ended, saying how it ended, chained to the cause:
        :class:`ClosedError` when this end closed it, else :class:`PeerClosedError`."""
        err = self.proto.error
        if self.proto.closed_here:
            exc: DmaBufError = ClosedError("this end closed the channel")
        elif err is None or isinstance(err, PeerClosedError):
            exc = PeerClosedError("the peer closed the channel")
        else:  # a failure here (no fd left to map a chunk, a message cut off), not the peer's doing
            exc = PeerClosedError(f"the connection ended on an error: {type(err).__name__}: {err}")
        exc.__cause__ = err
        return exc
