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
    whoever holds it (a ``with`` block of :meth:`held_by`, :meth:`held_within` or :meth:`held_if_free`) may call
    :meth:`send_locked`; :meth:`send` takes it. It knows the thread that holds it
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
        # An RLock for the owner it records as it is taken (in C, in one step); never held twice (Note [the send
        # lock's owner]). Taken only through held_by, held_within and held_if_free (and the steady-state lane's
        # inline take).
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
    # takes it without a limit, would hang. So the send lock is taken only by a ``with`` block (:meth:`held_by`,
    # :meth:`held_within`, :meth:`held_if_free`), whose ``__exit__`` the interpreter runs once ``__enter__`` has
    # returned; ``__enter__`` takes it inside a ``try`` (its return too) that lets it go on any exception, and knows
    # whether it did because the RLock records its owner as it is taken, in one step in C. A thread that holds
    # it already is refused before any take, and lets go of nothing: a send made from inside this thread's own
    # send (a signal handler's) would interleave its message with the one half sent, and a ``finally`` of the
    # nested call that let go would free the outer send's hold while it writes. The steady-state lane
    # (``Lending._lend_again``) makes the same steps inline, for speed: the refusal, then ``acquire(False)`` or
    # :meth:`wait_by` inside a ``try`` whose ``finally`` lets go where this thread holds the lock.

    def held_by(self, deadline: float | None) -> "_Held":
        """``with link.held_by(deadline):`` holds the send lock for the block, waiting at most :meth:`wait_for`
        ``deadline`` for it (Note [the send lock's owner]).

        Raises (entering the block):
            WaitTimeoutError: another thread's send held it past that.
            InvalidArgumentError: this thread holds it already: a send from inside its own send (a signal
                handler's), which would interleave the two messages.
        """
        return _Held(self, deadline, _BY)

    def held_within(self, timeout: float | None) -> "_Held":
        """``with link.held_within(timeout) as got:`` holds the send lock for the block if ``got``: taken within
        ``timeout`` seconds (``None``: as long as it takes); False when another thread held it past that or this
        thread holds it already (then nothing is let go at the end of the block)."""
        return _Held(self, timeout, _WITHIN)

    def held_if_free(self) -> "_Held":
        """``with link.held_if_free() as got:`` as :meth:`held_within`, with no wait."""
        return _Held(self, 0.0, _WITHIN)

    def wait_by(self, deadline: float | None) -> None:
        """Wait for the send lock until :meth:`wait_for` ``deadline`` (after ``lock.acquire(False)`` failed). Only
        inside a ``try`` whose ``finally`` lets go where :meth:`held_here`, entered when this thread did not hold
        it: a :class:`_Held` block, or the inline take of the steady-state lane (Note [the send lock's owner]).

        Raises:
            WaitTimeoutError: another thread's send held it past that.
        """
        if not self.wait_within(self.wait_for(deadline)):
            raise WaitTimeoutError("another thread's send held the connection past the timeout")

    def wait_within(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds (-1: no limit) for the send lock, as :meth:`wait_by`; whether it was
        taken. An interrupt in the wait is marked as leaving nothing sent (:meth:`was_unsent`)."""
        try:
            return self.lock.acquire(True, timeout)
        except BaseException as exc:
            self._unsent.id = id(exc)
            raise

    def clear_unsent(self) -> None:
        """Forget, for this thread, which exception last left nothing sent: call it before a send whose
        interruption :meth:`was_unsent` will judge."""
        self._unsent.id = 0

    def was_unsent(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised in this thread since its :meth:`clear_unsent`, left nothing of its message sent
        (a wait for the send lock, or for room before any byte left): the connection is as it was."""
        return getattr(self._unsent, "id", 0) == id(exc)

    def release(self) -> None:
        """Let go of the send lock (this thread holds it: a :class:`_Held` block's end); then, once it is free,
        run what :meth:`defer` left."""
        self.lock.release()
        if self.due:  # (after the release: a job deferred while this thread held the lock runs now)
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
        while self.due:
            if lock._is_owned():
                return  # this thread's hold: its release runs them
            try:  # (not owned here before the take: owned in the finally means taken here)
                if not lock.acquire(False):
                    return  # another thread's hold: its release runs them
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
        with self.held_within(timeout) as got:
            if not got:
                if self.held_here():
                    raise nested_send_error()
                raise WaitTimeoutError(f"another thread's send held the connection for {timeout} s")
            self.send_locked(obj, fd, timeout, essential=essential)

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


_BY, _WITHIN = 0, 1


def nested_send_error() -> InvalidArgumentError:
    """The refusal of a send made from inside this thread's own send (Note [the send lock's owner])."""
    return InvalidArgumentError("a send from inside this thread's own send (a signal handler's?) would interleave "
                                "the two messages: send after it returns")


class _Held:
    """One ``with`` block's hold of a :class:`Link`'s send lock (Note [the send lock's owner]): ``mode`` ``_BY``
    (``wait``: a deadline; raises where not taken) or ``_WITHIN`` (``wait``: seconds, ``None`` for no limit; the
    block gets whether it was taken)."""

    __slots__ = ("_link", "_wait", "_mode", "_taken")

    def __init__(self, link: Link, wait: float | None, mode: int) -> None:
        self._link = link
        self._wait = wait
        self._mode = mode
        self._taken = False

    def __enter__(self) -> bool:
        link = self._link
        lock = link.lock
        if lock._is_owned():  # this thread's own send holds it: refused, nothing taken (nothing let go at the end)
            if self._mode == _BY:
                raise nested_send_error()
            return False
        try:  # (not owned before: owned in the except means taken here)
            if lock.acquire(False):  # (a free lock: no wait computed)
                self._taken = True
                return True
            if self._mode == _BY:
                link.wait_by(self._wait)
            else:
                wait = self._wait
                if wait == 0 or not link.wait_within(-1 if wait is None else wait):
                    return False
            self._taken = True
            return True
        except BaseException:
            if lock._is_owned():  # an interrupt right after the take, before __exit__ was due to let it go
                self._taken = False
                lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        if self._taken:
            self._taken = False
            self._link.release()
