"""The reading side of a :class:`.channel.Channel`'s connection: reading the socket, handling each message
through the protocol state, the queue of arrived arrays and its bound (the eventfd a full queue parks the
reader on), and the end of the connection, also for a channel collected unclosed.

The background reader (:func:`_read_loop`) holds the parts of the connection (:class:`_Conn`) and only a weak
reference to the channel; :class:`Reading` holds the channel's methods that read, which ``recv`` in the caller's
thread and the background reader share. Threads, locks, the queue bound and finalizers: Note [channel threads
and fork], in :mod:`.channel`.

Where the peer's shared-memory ring is attached (:mod:`._ring`), messages come from two sources, handled in the
peer's order (:meth:`Reading._arrived`): a ring slot that the peer published after ``n`` socket messages is
handled after the peer's socket messages ``0..n-1`` and before its message ``n``. Socket messages are counted
from the first after the handshake (``_Conn.sock_next``); the next socket message, once read, waits in
``_Conn.ahead`` while slots before it are handled. Every wait is on the socket AND the ring's wake socket, with the
ring's ``asleep`` flag set around it (:meth:`._ring.Rings.sleep_begin`), so the peer's death (the socket's
hang-up) is still seen at once and a slot published while this end sleeps wakes it.

Note [interrupted handling]. A signal handler that raises (``KeyboardInterrupt`` at Ctrl-C, in the main thread)
may do so between any two steps of Python, and no step of handling a message can be undone: a chunk announced
to the protocol state and not yet imported, a slot taken from the ring and not yet queued, an arrival taken
(from the queue, or by the recv lane) that no :class:`~.received.Received` holds yet, whose lease nobody would
ever release. So an exception that is not an ``Exception`` and lands in such a window ends the connection
(a :class:`~..errors.LocalError` that names it is kept as the cause; the peer completes its leases as it sees
the end) and goes on up to the caller: what was handled before stays as it was, and every later call on the
channel says how it ended instead of failing on state that was left half made. One that lands while the
channel waits (in ``poll``, the spin, a lock) leaves it as it was: nothing had been taken. The windows, each
marked before its first step and cleared after its last (an interrupt at either edge ends a connection that
did not need it, never the other way round):
* bytes between ``recvmsg`` and the frame reader's buffer, and a message out of the buffer and not yet
  handled nor kept in ``_Conn.ahead``: :attr:`.fdpass.FrameReader.in_flight`, read by :meth:`Reading._read_one`;
* the handling of a socket message or a slot: :meth:`Reading._take` and :meth:`Reading._take_slot` catch it;
* an arrival taken (from the queue, or by the recv lane) and no Received made yet: ``_Conn.taking``, the
  thread's ident, read by :meth:`Reading._interrupted_taking`, which shuts the socket down (the next read turns
  that into the end: the reader thread may hold the read lock);
* releases taken from the peer's release ring and not yet counted: :func:`_ring_releases` (counted ones are
  completed still, as is a lease whose completion was claimed: :meth:`.lease.Lease._complete`);
* on the lending side, a slot or a message that may have gone out before its lease, chunk or layout was
  recorded (:meth:`._lending.Lending._lend_again`, ``_lend_out``, ``_announce``, ``_send_batch``: they end it by
  :meth:`._lending.Lending._end_unrecorded`), and bytes that may have left by a send call whose count was not
  taken (:func:`.fdpass._send_all` marks the socket out of step); an interrupt in the wait for the send lock or
  for room before any byte left (:meth:`._link.Link.was_unsent`) leaves the channel as it was;
* a release forgotten here and not yet out (:class:`._releases.ReleaseQueue`).
Those that hold the read lock end the connection at once; the others record the ``LocalError`` first, and from
then on nothing more is handed out (:attr:`._state.ConnectionState.failed_here`: the peer takes back the blocks
of what is queued as soon as it sees the end). What is left: a chunk reference or an fd that the interrupted step
held may stay taken (a mapping, or an fd, until the process exits: counted twice, a reference would unmap memory
a Received still uses), and a few steps inside the completion of a lease and the pool's accounting, where an
interrupt can leave a lease out for good (its ``wait`` then times out). An interrupt in a send's wait for room
after part of its message left ends the connection (the stream is out of step), as a cut-off send does.
"""

from __future__ import annotations

import base64
import collections
import numbers
import os
import select
import socket
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

from .. import _forks
from .._time import deadline_after, remaining
from ..errors import (DmaBufError, ForkedResourceError, InvalidArgumentError, LocalError, PeerClosedError,
                      PeerRefusedError, ProtocolError, WaitTimeoutError)
from ..fdpass import _broken_recv, close_fds
from ._link import Link
from ._releases import ReleaseQueue
from ._state import (ArraysArrived, ChunkAnnounced, ChunkRetired, ConnectionState, EmptyBatch, Event,
                     LayoutForgotten, LeasesReleased, PeerClosed, PeerRefused, RingOffered)
from ._spin import AdaptiveSpin
from ._torch_views import LayoutViews
from .handshake import HANDSHAKE_MAX_FRAME
from .protocol import parse_message
from .received import Hold, Received
from .sending import MemoTable
from .wire import shut_down


_ARRAY_KINDS = frozenset(("array", "arrays", "repeat"))  # the messages that queue an array for recv
_POLLIN = select.POLLIN
_HANGUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR
_get_ident = threading.get_ident
_monotonic = time.monotonic
_RING = object()  # (Reading._arrived) the next message is the peer ring's next slot
_UNSET = object()  # (Reading._next) no deadline given
#: Checks of the socket while a ``recv`` spins on the ring: one ``poll(0)`` every this many calls of Rings.spin_peek.
_SPIN_SOCKET_EVERY = 4
#: A spinning recv's looks at the peer's ring per call (Rings.spin_peek: 1-3 us on the machines measured)
_SPIN_LOADS = 64
#: Seconds a ring slot may wait for the socket messages the peer sent before it (they are in this end's socket
#: already when the peer is sound; a peer whose slot names messages it never sent has broken the protocol).
ORDER_WAIT = 1.0
#: Seconds the background reader sleeps at most while it tells the peer not to wake it for releases
#: (``asleep`` 2: Note [waking for releases], in :mod:`._ring`), which it does only within this long of a
#: ``send``; then it takes them. The bound on how late an idle producer's leases complete when nothing waits for
#: them. Read at each sleep (a test may change it).
SLOTS_ONLY_SLEEP = 0.002


@dataclass(slots=True)
class _Queued:
    """An array message waiting for ``recv``: the state's event, the chunks it names (retained while it
    waits), and what the tensors of its layout share (``None`` without a layout)."""

    event: ArraysArrived
    chunks: dict[int, Any]
    views: LayoutViews | None


@dataclass(slots=True, eq=False)
class _Conn:
    """The parts of a connection that ending it needs, without the :class:`Channel`: the reader thread
    holds these and only a weak reference to the channel, so that a channel dropped unclosed is
    collected, and then ends the connection itself (see Note [channel threads and fork])."""

    sock: socket.socket
    frames: Any  # FrameReader
    proto: ConnectionState
    state: threading.Condition
    link: Link
    releases: ReleaseQueue
    memos: MemoTable
    carrier: Any
    read_lock: Any
    owner: int  # the pid that made the channel
    name: str
    max_queued: int
    queue: collections.deque = field(default_factory=collections.deque)
    imports: dict = field(default_factory=dict)  # the peer's chunks as imported here (the reader's)
    layout_views: dict = field(default_factory=dict)  # the peer's layouts' shared tensor runs (the reader's)
    parked: bool = False  # the next message (a ring slot, or ``ahead``) is an array and the queue was full
    wake_fd: int = -1  # an eventfd: recv() wakes a reader parked for room (made on the first park)
    rings: Any = None  # this connection's shared-memory rings (._ring.Rings), or None: the socket alone
    poller: Any = None  # (the reader's) poll of the socket and the ring's wake socket, made when the ring attaches
    ahead: tuple | None = None  # the next socket message, read and not yet handled: (msg, fds)
    sock_next: int = 0  # the number of the next socket message to handle (the peer's first after the handshake: 0)
    unbounded: bool = False  # the peer hung up (or this end shut down): take what is left whatever the bound
    has_reader: bool = False
    finish_here: bool = False  # whoever ends the connection also drops the queue and closes the carrier
    sent_at: float = -1e9  # time.monotonic() of the last send that lent something (Note [waking for releases])
    release_waiters: int = 0  # threads waiting for a release of this end's leases (changed under ``state``)
    adaptive: Any = None  # the recv's AdaptiveSpin (spin "auto"), made at its first wait; the reading thread's
    state_lock: Any = None  # the RLock under ``state``, held directly on the paths every hand-off takes
    settled: threading.Event = field(default_factory=threading.Event)  # set once the end has completed every lease
    taking: int = 0  # the thread taking an arrival that no Received holds yet (Note [interrupted handling])


def _poll_ms(deadline: float | None) -> int:
    """``poll(2)``'s timeout for ``deadline`` (``time.monotonic()``; ``None``: -1, no limit), rounded up."""
    if deadline is None:
        return -1
    left = (deadline - _monotonic()) * 1000
    return 0 if left <= 0 else min(2**31 - 1, int(left) + 1)


def _fail_and_shut(conn: _Conn, exc: BaseException) -> None:
    """End the connection for ``exc`` from a thread that may not hold the read lock: keep it as the first cause
    (under the state lock), then shut the socket down; whoever reads next sees that and ends the connection."""
    with conn.state:
        conn.proto.fail(exc)
    shut_down(conn.sock)


def _ring_releases(conn: _Conn) -> None:
    """Complete the leases the peer released through its release ring (under the state lock: the reader and
    the senders take them). Raises ProtocolError for an id not lent, or a ring out of step."""
    tokens = None
    done = 0
    try:
        with conn.state_lock:
            if conn.proto.ended:
                return
            ids = conn.rings.take_releases()
            if not ids:
                return
            tokens = conn.proto.peer_released(ids).tokens
        for lease in tokens:
            lease._complete("released")
            done += 1
    except BaseException as exc:  # (Note [interrupted handling])
        if tokens is not None:  # counted: the rest are completed still (_complete is idempotent)
            for lease in tokens[done:]:
                lease._complete("released")
        elif not isinstance(exc, Exception):  # a signal handler's, with ids maybe taken and not counted: the end
            _fail_and_shut(conn, LocalError(f"{type(exc).__name__} interrupted the taking of the peer's releases: "
                                            f"the connection was ended"))
        raise


class ReleaseWaits:
    """A connection's ring releases, for the threads that wait for them (Note [waking for releases], in
    :mod:`._ring`): :meth:`begin` before a wait for a lease of this end's to complete, :meth:`end` after it,
    :meth:`take` for a poll. A :class:`.lease.Lease` lent on a connection with the ring holds the one of its
    connection (not the channel: no cycle through the channel; the lease drops it once complete), and a
    :class:`.pool.SharedPool` reaches it through the channels it knows. A waiter on one lease is counted out by
    the lease's completion (:meth:`completed`, in the completing thread), so that the reader, which completes it,
    sleeps for slots only again at once rather than after the waiter has run. A peer's forged id found here ends
    the connection as in ``send`` (every lease then completes); nothing is raised to the waiter."""

    __slots__ = ("conn",)

    def __init__(self, conn: _Conn) -> None:
        self.conn = conn

    def begin(self, lease: Any = None) -> bool:
        """Count a waiter in (on ``lease``, or on any lease: ``None``), make this end's reader wakeable by
        releases, and take those already published. Returns False, counting nothing, in a process that
        inherited the connection through ``fork()`` (no lock is taken there: a thread of the parent may have
        held one at the fork)."""
        conn = self.conn
        if conn.owner != _forks.pid:
            return False
        tokens: Any = ()
        try:
            with conn.state:  # (one hold: counted in and the releases taken)
                conn.release_waiters += 1
                if lease is not None:
                    lease._waiters += 1
                tokens = self._take_locked()
        except ProtocolError as exc:
            self._fail(exc)
        for token in tokens:
            token._complete("released")
        return True

    def end(self, lease: Any = None) -> None:
        """The waiter counted in by :meth:`begin` is done (however its wait ended; one on a lease that completed
        was counted out then)."""
        conn = self.conn
        with conn.state:
            if lease is None:
                conn.release_waiters -= 1
            elif lease._waiters:
                lease._waiters -= 1
                conn.release_waiters -= 1

    def completed(self, lease: Any) -> None:
        """``lease`` completed: the threads waiting on it wait no more (before they are woken)."""
        conn = self.conn
        with conn.state:
            conn.release_waiters -= lease._waiters
            lease._waiters = 0

    def take(self) -> None:
        """Take the releases the peer has published, if any (a poll: ``Lease.done``)."""
        conn = self.conn
        if conn.owner != _forks.pid or not conn.rings.attached:
            return  # inherited through fork() (the parent's connection), or no peer ring yet
        try:
            _ring_releases(conn)
        except ProtocolError as exc:
            self._fail(exc)

    def _take_locked(self) -> Any:
        """(Under ``state``, for a waiter.) 1 over a 2, then the seq_cst load of the peer's ``rel_tail`` (the
        Dekker pair), then the releases published: the leases to complete."""
        conn = self.conn
        rings = conn.rings
        if conn.proto.ended or not rings.attached or not rings.want_releases():
            return ()
        ids = rings.take_releases()
        return conn.proto.peer_released(ids).tokens if ids else ()

    def _fail(self, exc: ProtocolError) -> None:
        """A forged id: the connection ends (the reader sees the shutdown and completes every lease)."""
        _fail_and_shut(self.conn, exc)


def _sleep_on_ring(conn: _Conn, rings: Any, poller: Any) -> None:
    """The background reader's sleep with nothing to read: ``poll`` of the socket and the ring's wake socket,
    between ``sleep_begin`` and ``sleep_end``. Woken for the peer's releases too (``asleep`` 1), unless this end
    sent within :data:`SLOTS_ONLY_SLEEP` and no thread waits for a release: then ``asleep`` 2, for at most
    :data:`SLOTS_ONLY_SLEEP` (Note [waking for releases], in :mod:`._ring`)."""
    bound = SLOTS_ONLY_SLEEP
    slots_only = not conn.release_waiters and _monotonic() - conn.sent_at < bound
    if not rings.sleep_begin(not slots_only):  # else a slot or a release arrived meanwhile: no sleep
        return
    try:
        # A waiter counted in after the choice above found 0 stored, or the 2: either way it is seen here, and
        # then 1 is stored and rel_tail loaded (seq_cst) before the sleep, as the waiter does.
        if slots_only and conn.release_waiters and rings.want_releases():
            return
        poller.poll(max(1, int(bound * 1000 + 0.5)) if slots_only else None)  # PEP 475: an EINTR is retried
    finally:
        try:
            rings.sleep_end()
        except ValueError:  # unmapped under this thread: their finalizer ran (interpreter exit)
            conn.rings = None  # the socket alone from here: its end ends the connection


def _check_max_queued(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidArgumentError(f"max_queued must be a positive int, got {value!r}")
    return int(value)


def _read_loop(ref: "weakref.ref[Reading]", conn: _Conn) -> None:
    """The background reader: it waits for the socket with no reference to the channel, then handles
    what arrived through it; a channel collected meanwhile (its finalizer shut the socket down) is ended
    here."""
    poller = select.poll()
    ring_polled = False
    with conn.read_lock:  # waits for a recv() reading in its caller's thread to finish
        if conn.proto.ended:
            return  # (ended before this thread ran, e.g. by a close() during the first send: the socket is closed)
        poller.register(conn.sock, _POLLIN)  # (POLLHUP, POLLERR: always; the socket is closed only under read_lock)
        while not conn.proto.ended:
            rings = conn.rings
            if conn.parked:
                _wait_for_room(conn)
            elif conn.frames.buffered() or conn.ahead is not None:
                pass
            elif rings is not None and rings.attached:
                if not ring_polled:
                    poller.register(rings.wake_fd, _POLLIN)
                    ring_polled = True
                _sleep_on_ring(conn, rings, poller)
            else:
                poller.poll()
            ch = ref()
            if ch is None:
                _end_connection(conn)
                return
            if conn.parked and (conn.unbounded or len(conn.queue) < conn.max_queued or conn.proto.over):
                conn.parked = False
            if not conn.parked:
                ch._read_one(_monotonic() if rings is not None else None)  # (waits for nothing more)
            ch = None  # not held while waiting


def _wait_for_room(conn: _Conn) -> None:
    """Wait, with the socket unread, until ``recv`` takes a queued array (the eventfd), the peer hangs up or
    this end shuts down (``POLLRDHUP``/``POLLHUP``: then everything left is read, whatever the bound)."""
    poller = select.poll()
    poller.register(conn.sock, _HANGUP)
    poller.register(conn.wake_fd, _POLLIN)
    while len(conn.queue) >= conn.max_queued and not conn.proto.over:
        for fd, _ in poller.poll():
            if fd == conn.wake_fd:
                try:
                    os.eventfd_read(fd)
                except BlockingIOError:
                    pass
            else:
                conn.unbounded = True
                return


def _end_connection(conn: _Conn) -> None:
    """The connection is over: complete every lease, unmap idle chunks, wake waiters, close the socket and
    the fds of messages read and not handled. The caller reads the socket (holds ``read_lock``) or no one
    can (the channel was collected)."""
    try:
        _end_steps(conn)
    finally:
        conn.settled.set()  # (a send that raised for the end waits for it: Channel._settle)


def _end_steps(conn: _Conn) -> None:
    link = conn.link
    released: tuple = ()
    # Without a limit: a send holds it at most SEND_TIMEOUT. Not taken where this thread holds it already (an end
    # inside its own interrupted send, whose next step fails on the closed socket): the end runs under that hold.
    with link.held_within(None):
        conn.memos.clear()
        with conn.state:
            rings = conn.rings
            if rings is not None:
                # Releases the peer made before it went are releases (a socket one would have been read too).
                if rings.attached and not isinstance(conn.proto.error, ProtocolError):
                    try:
                        released = conn.proto.peer_released(rings.take_releases()).tokens
                    except ProtocolError:
                        pass
                rings.close()  # (under the send and state locks: no push or take runs)
            leases = conn.proto.end()
            parked, conn.ahead, conn.parked = conn.ahead, None, False
            if conn.wake_fd >= 0:  # (under the state lock, as recv() writes to it)
                os.close(conn.wake_fd)
                conn.wake_fd = -1
            conn.state.notify_all()
        conn.releases.wake()  # the flusher sees the end and exits
        try:
            conn.sock.close()
        except OSError:
            pass
    if parked is not None:
        close_fds(parked[1])
    conn.frames.discard()
    for lease in released:
        lease._complete("released")
    for lease in leases:
        lease._complete("closed" if conn.proto.closed_here else "disconnected")
    if conn.proto.failed_here and not conn.finish_here:
        _drop_queue(conn)  # void (ConnectionState.failed_here); finish_here drops it below
    for chunk in list(conn.imports.values()):
        chunk.retire()  # stays mapped while a Received still uses it
    conn.imports.clear()
    conn.layout_views.clear()
    conn.carrier.on_end()
    if conn.finish_here:  # no close() will: arrays never received are dropped, the carrier closed
        _drop_queue(conn)
        conn.carrier.close()


def _drop_queue(conn: _Conn) -> None:
    with conn.state:  # arrays never received: this end will not take them now
        dropped = list(conn.queue)
        conn.queue.clear()
    for entry in dropped:
        for chunk in entry.chunks.values():
            chunk.release()  # the queue's reference (_handle)


def _collected(conn: _Conn) -> None:
    """A channel was collected unclosed (``weakref.finalize``; in whatever thread dropped it): as a finalizer
    may (Note [channel threads and fork]), warn, mark it closed and shut the socket down (the peer sees the
    end at once); the reader, woken by the shutdown, ends the connection, or a thread started here does."""
    if conn.owner != _forks.pid or conn.proto.closed_here:
        return  # inherited through fork(): the parent's; its fds go with this process
    if not conn.proto.ended:  # (one that ended holds no socket: only its queue and carrier are left)
        warnings.warn(f"unclosed {conn.name}", ResourceWarning, stacklevel=2)
    with conn.state:
        conn.proto.close()
        conn.finish_here = True
        conn.state.notify_all()
    shut_down(conn.sock)
    if conn.proto.ended or not conn.has_reader:
        try:
            threading.Thread(target=_end_unread, args=(conn,), name="dmabuf-interop-channel-end", daemon=True).start()
        except RuntimeError:  # interpreter shutdown: the process's exit closes the socket
            pass


def _end_unread(conn: _Conn) -> None:
    """End a collected channel that no reader will end: none ran, or the connection had ended already."""
    with conn.read_lock:
        if not conn.proto.ended:
            _end_connection(conn)
        else:
            _drop_queue(conn)
            conn.carrier.close()


class Reading:
    """The methods of a :class:`.channel.Channel` that read the socket and end the connection: ``recv`` in
    the caller's thread and the background reader share them (they use the channel's attributes)."""

    def _next(self, timeout: float | None, want_batch: bool, spin: float | str = 0.0,
              deadline: Any = _UNSET) -> _Queued:
        """The next array message (``recv``, ``recv_many``), waiting at most ``timeout`` seconds, or until
        ``deadline`` where given (``time.monotonic()``; ``None``: none): that of a :meth:`_recv_ready` that waited
        first."""
        if self._owner != _forks.pid:
            raise ForkedResourceError("this channel", self._owner)
        if deadline is _UNSET:
            deadline = deadline_after(timeout)  # checks it (math.inf: no deadline)
        drained = False  # past the deadline, reading goes on until a read finds nothing: timeout=0 takes what has arrived
        while True:
            if self._releases.pending and not self._queue:
                # About to wait: send the releases now rather than after RELEASE_DELAY, unless a
                # message has arrived already (a busy consumer lets its releases gather).
                if not (self._reader is None and self._read_arrived()):
                    self._releases.flush()
            with self._state_lock:  # (the Condition's own lock: its wait below works under it)
                if self._queue and self._proto.error is not None and self._proto.failed_here:
                    _drop_queue(self._conn)  # void: the peer takes their blocks back at the end (failed_here)
                if self._queue:
                    if self._queue[0].event.kind == "arrays" and not want_batch:
                        raise InvalidArgumentError("the next message is a send_many batch: use recv_many()")
                    self._conn.taking = _get_ident()  # (before the pop: Note [interrupted handling])
                    got = self._queue.popleft()
                    if self._conn.parked:  # the reader waits for room (set under this lock)
                        # After the pop: the write lets the GIL go, and a reader woken before it would find the
                        # queue still full, poll again and never be woken.
                        os.eventfd_write(self._conn.wake_fd, 1)
                    return got
                if self._proto.closed_here:
                    raise self._link.ended()  # ClosedError: not the peer's doing
                if self._proto.over:
                    err = self._proto.error
                    if isinstance(err, (ProtocolError, PeerRefusedError)):
                        raise type(err)(str(err)) from err
                    raise self._link.ended()
                left = remaining(deadline)
                expired = left is not None and left <= 0
                if expired and (drained or self._reader is not None):
                    raise WaitTimeoutError(f"no array from the peer within {timeout} s")
                if self._reader is not None or not self._read_lock.acquire(blocking=False):
                    # Another thread reads the socket: it queues what arrives and notifies.
                    if expired:
                        raise WaitTimeoutError(f"no array from the peer within {timeout} s")
                    self._waiters += 1
                    try:
                        self._state.wait(left)
                    finally:
                        self._waiters -= 1
                    continue
                self._read_owner = _get_ident()
            try:
                drained = not self._read_one(deadline, spin)  # in this thread: no hand-over between threads
            finally:
                self._read_owner = 0
                self._read_lock.release()
                if self._waiters:
                    with self._state:
                        self._state.notify_all()  # a thread waiting above may now read

    def _recv_ready(self, deadline: float | None, spin: float | str, stream: int) -> Any:
        """``recv()``'s steady state, in as few steps as it takes (Note [the steady-state lanes], in
        :mod:`._lending`): with nothing queued, no background reader and the peer's ring attached, wait for the
        ring's next slot as :meth:`_arrived` does (:meth:`_wait_both`: the socket too, ``spin``, the sleep) and,
        when it is next in the peer's order and repeats one array's layout, take it without queueing it: the
        :class:`.received.Received` of its array, ``stream`` (a raw handle) made to wait on its event
        (:meth:`_take_ready`). ``None``: anything else, read by :meth:`_read_one` here (a socket message first, a
        batch, the deadline passed, the end of the connection), or another thread reads: :meth:`_next` takes it
        from there, with the same deadline."""
        conn = self._conn
        rings = conn.rings
        if (rings is None or self._reader is not None or self._queue or self._releases.pending
                or not rings.attached or self._owner != _forks.pid or self._proto.error is not None):
            return None
        lock = self._read_lock
        if not lock.acquire(False):
            return None
        self._read_owner = _get_ident()
        try:
            proto, peek = self._proto, rings.peek_sock_seq
            seq = peek()
            while not proto.ended:
                if seq is None:
                    # (A socket message read, or bytes of one buffered, come first: poll would not show them.)
                    if conn.ahead is None and not self._frames.buffered() and self._wait_both(deadline, spin) is False:
                        seq = peek()  # the ring may hold something
                        continue
                elif seq == conn.sock_next:
                    return self._take_ready(stream)
                # Anything else is read here, under the same hold of the lock, as _next would read it (a socket
                # message handled or queued, the end of the connection ended in this thread); _next goes on.
                self._read_one(deadline, spin)
                break
            return None
        except (DmaBufError, OSError, ValueError) as exc:  # as _read_one: the connection ends
            self._proto.fail(exc)
            self._end()
            return None
        finally:
            self._read_owner = 0
            lock.release()
            if self._waiters:
                with self._state:
                    self._state.notify_all()

    def _attach_peer_ring(self, deadline: float | None) -> None:
        """Read the peer's first socket message, its ``ring`` message, and attach its region: the handshake's
        last step (:mod:`.rendezvous` hands the channel out after it), so that a channel holds every fd of
        its connection from the start (the peer's wake socket, kept by :meth:`._ring.Rings.attach`) and its
        first repeat and release can take the ring. A first message that is not a sound ``ring`` message ends
        the connection here and fails the handshake; the peer's end (it closed right after its hello) leaves
        the caller the channel, ended, as it would have seen it at its first read. No other thread reads yet.

        Raises:
            WaitTimeoutError: nothing came by ``deadline`` (``time.monotonic()``; ``None``: no limit).
            ProtocolError: the peer's first message was not a sound ``ring`` message (the connection is ended).
        """
        rings = self._conn.rings
        frames = self._frames
        # A handshake message: its rest shares the handshake's deadline (not REST_TIMEOUT), and it is no bigger
        # than the others (HANDSHAKE_MAX_FRAME): a peer that sends part of it and stops holds a handshake no longer.
        rest, biggest = frames.rest_timeout, frames.max_bytes
        frames.rest_timeout, frames.max_bytes = None, HANDSHAKE_MAX_FRAME
        try:
            with self._read_lock:
                while not rings.attached and not self._proto.ended:
                    if not self._read_one(deadline):
                        raise WaitTimeoutError("the peer's ring message did not come in time")
        finally:
            frames.rest_timeout, frames.max_bytes = rest, biggest
        err = self._proto.error
        if not rings.attached and isinstance(err, ProtocolError):
            raise ProtocolError(f"the peer's ring message was refused: {err}") from err

    def _read_arrived(self) -> bool:
        """Read one message if one has arrived, without waiting (no other thread reads the socket)."""
        if not self._read_lock.acquire(blocking=False):
            return False
        self._read_owner = _get_ident()
        try:
            return self._read_one(time.monotonic())
        finally:
            self._read_owner = 0
            self._read_lock.release()
            if self._waiters:
                with self._state:
                    self._state.notify_all()

    def _wait_ended(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the connection to end; returns whether it has."""
        with self._state:
            return self._state.wait_for(lambda: self._proto.ended, timeout)

    def _read_one(self, deadline: float | None, spin: float | str = 0.0) -> bool:
        """Read and handle one message, from the socket or the peer's ring (the caller holds ``_read_lock``);
        a message that ends the connection, or breaks the protocol, ends it here (:meth:`_end`). Returns
        False when nothing arrived by ``deadline`` (the caller's own deadline check raises), else True.
        ``spin``: seconds to poll the ring before sleeping, or ``"auto"`` (:mod:`._spin`). The background reader
        parks an array message (a socket message or a ring slot) while :attr:`max_queued` are queued
        (:func:`_read_loop` takes it once there is room)."""
        if self._proto.ended:
            return True
        try:
            return self._read_step(deadline, spin)
        except BaseException as exc:
            # A signal handler's exception (KeyboardInterrupt) with a socket message out of the frame reader
            # and not handled (nor kept in ahead): it may be lost. Note [interrupted handling].
            if self._frames.in_flight and not isinstance(exc, Exception) and not self._proto.ended:
                self._interrupted_here("socket", exc)
            raise

    def _read_step(self, deadline: float | None, spin: float | str) -> bool:
        conn = self._conn
        try:
            got = self._arrived(deadline, spin)  # (no remaining() and deadline_after() back per message)
        except WaitTimeoutError as exc:
            if self._sock not in _broken_recv:
                return False  # nothing began to arrive
            # A message began and its rest did not come within REST_TIMEOUT: out of step for good.
            self._proto.fail(ProtocolError(f"the peer stopped in the middle of a message: {exc}"))
            self._end()
            return True
        except (DmaBufError, OSError, ValueError) as exc:
            self._proto.fail(exc)
            self._end()
            return True
        if got is None:
            return False
        if len(self._queue) >= conn.max_queued and self._reader is not None and not conn.unbounded:
            if (got is _RING or got[0].get("kind") in _ARRAY_KINDS) and not self._proto.over:
                with self._state:
                    if conn.wake_fd < 0:
                        try:
                            conn.wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
                        except OSError:  # no fd left (EMFILE): this one is queued beyond the bound
                            pass
                    if conn.wake_fd >= 0:
                        conn.parked = True  # the socket (and the ring) stay unread: the peer's sends wait
                        return True
        if got is _RING:
            self._take_slot()
            return True
        msg, fds = got
        frames = self._frames
        frames.in_flight = True  # (from ahead until handled: Note [interrupted handling])
        conn.ahead = None
        conn.sock_next += 1
        self._take(msg, fds)
        frames.in_flight = False
        return True

    def _arrived(self, deadline: float | None, spin: float | str) -> Any:
        """The next message in the peer's order: ``_RING`` (the next slot of the peer's ring, not yet
        taken), or the next socket message ``(msg, fds)`` (kept in ``_Conn.ahead`` until handled), or
        ``None``: nothing by ``deadline``. A slot the peer published after ``n`` of its socket messages comes
        after those and before the next (its ``sock_seq``); one that claims fewer than were handled here
        broke the order (ProtocolError). Raises as :meth:`.fdpass.FrameReader.read_by`."""
        conn = self._conn
        rings = conn.rings
        if rings is None or not rings.attached:
            if conn.ahead is None:
                self._read_ahead(deadline)
            return conn.ahead
        while True:
            seq = rings.peek_sock_seq()
            if seq is not None and seq <= conn.sock_next:
                if seq < conn.sock_next:
                    raise ProtocolError(f"a ring slot published after {seq} socket messages arrived after "
                                        f"{conn.sock_next} of them were handled")
                return _RING
            if conn.ahead is not None:
                return conn.ahead
            if seq is not None:
                # The socket messages before this slot went out whole before it was published: they are in
                # this end's socket already (AF_UNIX queues them there), unless the peer lied.
                try:
                    self._read_ahead(_monotonic() + ORDER_WAIT)
                except WaitTimeoutError as exc:
                    if self._sock in _broken_recv:
                        raise
                    raise ProtocolError(f"a ring slot follows {seq} socket messages, and only {conn.sock_next} "
                                        f"came within {ORDER_WAIT} s") from exc
                continue
            if self._frames.buffered():
                self._read_ahead(deadline)
                continue
            readable = self._wait_both(deadline, spin)
            if readable is None:
                return None
            if readable:
                self._read_ahead(deadline)

    def _read_ahead(self, deadline: float | None) -> None:
        """Read the next socket message into ``_Conn.ahead``, where it is held until handled: no longer in
        flight (Note [interrupted handling]). Raises as :meth:`.fdpass.FrameReader.read_by`."""
        frames = self._frames
        self._conn.ahead = frames.read_by(deadline)
        frames.in_flight = False

    def _wait_both(self, deadline: float | None, spin: float | str) -> bool | None:
        """Wait for the socket or the peer's ring: True once the socket is readable (or hung up), False when
        the ring may hold something, ``None`` when ``deadline`` passed with nothing. Releases in the ring are
        taken first; ``spin`` seconds of looking at the ring (and, now and then, the socket) come before the
        sleep, which the peer is told of (``asleep``: its next publish sends a wake-up)."""
        conn = self._conn
        rings = conn.rings
        _ring_releases(conn)  # (ProtocolError: the caller ends the connection)
        poller = conn.poller
        if poller is None:
            poller = conn.poller = select.poll()
            poller.register(self._sock, _POLLIN)
            poller.register(rings.wake_fd, _POLLIN)
        events = poller.poll(0)
        if not events:
            left = remaining(deadline)
            if left is not None and left <= 0:
                return None
            adapt = None
            if spin.__class__ is str:  # "auto" (check_spin lets no other string through): Note [adaptive spin]
                adapt = conn.adaptive
                if adapt is None:
                    adapt = conn.adaptive = AdaptiveSpin()
                spin = adapt.budget()
                began = _monotonic()
            try:
                if spin > 0:  # load-bearing for latency: a consumer awake when the slot lands pays no wake-up
                    until = _monotonic() + (spin if left is None else min(spin, left))
                    peek = rings.spin_peek
                    n = 0
                    while True:
                        if peek(_SPIN_LOADS) is not None:
                            return False
                        n += 1
                        if n % _SPIN_SOCKET_EVERY == 0:
                            events = poller.poll(0)
                            if events or _monotonic() >= until:
                                break
                if not events:
                    if not rings.sleep_begin():
                        return False  # something arrived meanwhile
                    try:
                        events = poller.poll(_poll_ms(deadline))  # PEP 475: an EINTR is retried
                    finally:
                        # Load-bearing for a blocking consumer's latency: the wake-up is read at the next wait (the
                        # poll(0) at the top finds it), not between the wake and the slot (two recv and an exception).
                        rings.sleep_end(drain=False)
                    if not events:
                        left = remaining(deadline)
                        return None if left is not None and left <= 0 else False
                    # (not any() over a generator: a consumer just woken pays for each step on its way to the slot)
                    return len(events) > 1 or events[0][0] != rings.wake_fd  # the socket's, unless the wake fd's alone
            finally:
                # Every wait measured once, however it ended: a slot seen while spinning, a wake-up, the socket
                # readable, or the timeout (which counts as long).
                if adapt is not None:
                    adapt.observe(_monotonic() - began)
        # (poll reports each registered fd at most once: the socket and the wake fd)
        woken = any(fd == rings.wake_fd for fd, _ in events)
        if woken:
            rings.drain()  # a wake-up left by the last sleep, or sent without one: read here
        return len(events) > 1 or not woken

    def _take(self, msg: dict[str, Any], fds: list[int]) -> None:
        """Handle one socket message read (its fds are closed after), ending the connection if it must."""
        try:
            self._handle(msg, fds)
        except (DmaBufError, OSError, ValueError) as exc:
            self._proto.fail(exc)
            self._end()
        except Exception as exc:  # noqa: BLE001 - a message no check foresaw must still end the channel
            # Our failure, not the peer's: the message passed every check of the protocol.
            self._fail_here(msg.get("kind"), exc)
        except BaseException as exc:  # a signal handler's (KeyboardInterrupt): Note [interrupted handling]
            self._interrupted_here(msg.get("kind"), exc)
            raise
        finally:
            if fds:
                close_fds(fds)

    def _fail_here(self, kind: Any, exc: Exception) -> None:
        self._proto.fail(LocalError(f"this process failed on the peer's {kind!r} message: "
                                    f"{type(exc).__name__}: {exc}"))
        self._end()

    def _interrupted_taking(self, exc: BaseException) -> None:
        """``recv`` raises ``exc`` with an arrival taken in this thread and no Received made for it: if ``exc`` is
        not an ``Exception`` (a signal handler's), end the connection: shut the socket down, for the next read
        to end it (Note [interrupted handling]); else the Received, made first, gives the lease back when it
        is collected."""
        conn = self._conn
        if conn.taking != _get_ident():
            return
        conn.taking = 0
        if isinstance(exc, Exception) or self._proto.ended:
            return
        _fail_and_shut(conn, LocalError(f"{type(exc).__name__} interrupted recv() as it took an array: the "
                                        f"connection was ended"))

    def _interrupted_here(self, kind: Any, exc: BaseException) -> None:
        """(Under the read lock.) ``exc``, raised by a signal handler, cut the handling of the peer's ``kind``
        message short: end the connection (Note [interrupted handling])."""
        self._proto.fail(LocalError(f"{type(exc).__name__} interrupted the handling of the peer's {kind!r} "
                                    f"message: the connection was ended"))
        self._end()

    def _take_ready(self, stream: int) -> Any:
        """(:meth:`_recv_ready`, under the read lock.) Take the peer ring's next slot, one array's repeat, as
        :meth:`_take_slot` would and without the queue: its :class:`.received.Received`, ``stream`` made to wait
        on its event where it has one; ``None`` where the slot held no array (an arrival dropped while the
        connection closes) or broke the protocol (the connection has ended).

        Speed (load-bearing: a consumer pays each step between the slot's landing and ``recv``'s return): the
        layout repeated as defined is taken by :meth:`._state.ConnectionState.receive_slot_as_defined`, and its
        Received made here, with no event record, no base64 and no list between them; any other slot goes by
        :meth:`._state.ConnectionState.receive_slot` and the carrier's ``make_received``."""
        conn = self._conn
        try:
            conn.taking = _get_ident()  # (before the slot is taken: Note [interrupted handling])
            _, lease, layout, ordering, event = conn.rings.take_fields()
            with self._state_lock:
                found = self._proto.receive_slot_as_defined(lease, layout, ordering, event is not None)
                if found is not None:
                    d = found.descs[0]
                    chunk = self._imports[d.chunk]  # (a single array lies in one chunk)
                    chunk.retain()  # (the hold takes it over)
                else:  # (any other slot: as _take_slot, its arrival kept out of the queue)
                    events = self._slot_events(lease, layout, ordering, event)
                    if not (events and events[0].kind == "array"):  # (a slot's events: its arrival, or none)
                        self._queue_arrivals(events)
                        conn.taking = 0  # (nothing taken here: what was queued is the queue's)
                        return None
                    ev = events[0]
                    chunks = self._retain_chunks(ev)
        except (DmaBufError, OSError, ValueError) as exc:
            conn.taking = 0
            self._proto.fail(exc)
            self._end()
            return None
        except Exception as exc:  # noqa: BLE001 - as in _take
            conn.taking = 0
            self._fail_here("repeat", exc)
            return None
        except BaseException as exc:  # as in _take
            self._interrupted_here("repeat", exc)
            raise
        # (From here on as recv's make_received of a queued arrival: what it raises is recv's, Note [interrupted
        # handling].)
        if found is None:
            return self._carrier.make_received(self, lease, ev.descs, stream, ev.ordering, chunks)[0]
        # The carrier's make_received of one array with no event to wait on (receive_slot_as_defined takes no slot
        # that carries one).
        return Received(Hold(self, lease, [chunk], 1, stream, ordering, adopt=True), d, chunk)

    def _take_slot(self) -> None:
        """Take the peer ring's next slot (copied out and checked by :meth:`._ring.Rings.take_fields`) and hand
        it to the protocol state as the ``repeat`` it carries, queueing what arrived, as :meth:`_take` and
        :meth:`_handle` do for a socket message; a slot that breaks the protocol ends the connection.

        Speed (load-bearing: a consumer pays each call between its wake-up and ``recv``'s return): one call from
        the slot to the queue; no record made for the slot, no loop over a socket message's events (a repeat's
        are its arrival alone)."""
        try:
            _, lease, layout, ordering, event = self._conn.rings.take_fields()
            with self._state_lock:  # (the Condition's own lock: notify_all in _queue_arrivals works under it)
                self._queue_arrivals(self._slot_events(lease, layout, ordering, event))
        except (DmaBufError, OSError, ValueError) as exc:
            self._proto.fail(exc)
            self._end()
        except Exception as exc:  # noqa: BLE001 - as in _take
            self._fail_here("repeat", exc)
        except BaseException as exc:  # as in _take
            self._interrupted_here("repeat", exc)
            raise

    def _slot_events(self, lease: int, layout: int, ordering: str, event: bytes | None) -> list[Event]:
        """(Under the state lock.) What the protocol state makes of a slot's fields: the ``repeat`` it carries.
        Raises ProtocolError as :meth:`._state.ConnectionState.receive_slot` (the connection has ended)."""
        return self._proto.receive_slot(lease, layout, ordering,
                                        None if event is None else base64.b64encode(event).decode())

    def _retain_chunks(self, ev: ArraysArrived) -> dict[int, Any]:
        """(Under the state lock.) The chunks ``ev``'s arrays lie in, by id, each retained: mapped until received,
        whatever comes after (a ``retire``, the end of the connection; :meth:`make_received` takes them over)."""
        chunks = {}
        for cid in ev.chunks:
            chunk = chunks[cid] = self._imports[cid]
            chunk.retain()
        return chunks

    def _queue_arrivals(self, events: list[Event]) -> None:
        """(Under the state lock.) Queue the arrays that arrived among ``events``, their chunks retained
        (:meth:`_retain_chunks`). An empty batch holds nothing: its release is due at once."""
        for ev in events:
            if type(ev) is ArraysArrived:
                chunks = self._retain_chunks(ev)
                views = None
                if ev.layout is not None:
                    views = self._layout_views.get(ev.layout)
                    if views is None:
                        views = self._layout_views[ev.layout] = LayoutViews()
                self._queue.append(_Queued(ev, chunks, views))
                if self._waiters:
                    self._state.notify_all()
            elif type(ev) is EmptyBatch:
                self._releases.pending.append(ev.lease)

    def _handle(self, msg: dict[str, Any], fds: list[int]) -> None:
        """Hand one socket message to the protocol state and act on its events: arrays are queued
        (under the state lock, with the state's own step, so that a ``close`` between them cannot lose a
        lease); chunks are imported, retired chunks unmapped once unused, released leases completed."""
        descs = None
        if not (self._carrier.transport == "nixl" and isinstance(msg, dict) and msg.get("kind") == "region"):
            _, descs = parse_message(msg)  # outside the state lock: a batch has thousands of descriptors
        with self._state_lock:  # (the Condition's own lock: notify_all below works under it)
            events = self._proto.receive(msg, len(fds), descs)
            self._queue_arrivals(events)
        for ev in events:
            t = type(ev)
            if t is ChunkAnnounced:
                self._imports[ev.chunk.id] = self._carrier.import_chunk(ev, fds)
            elif t is ChunkRetired:
                self._imports.pop(ev.chunk_id).retire()
            elif t is LayoutForgotten:
                self._layout_views.pop(ev.layout, None)
            elif t is LeasesReleased:
                for lease in ev.tokens:
                    lease._complete("released")
            elif t is RingOffered:
                with self._state:  # (releases are pushed under it; the ring's other users wait for attached)
                    self._conn.rings.attach(ev.msg, fds)  # (ProtocolError: a bad region or fd; keeps its own dups)
            elif t is PeerClosed:
                raise PeerClosedError("the peer closed the channel")
            elif t is PeerRefused:
                raise PeerRefusedError(f"the peer refused this connection: {ev.reason}")

    def _end(self) -> None:
        """The connection is over (:func:`_end_connection`). The caller holds ``_read_lock``."""
        _end_connection(self._conn)
