"""The reading side of a :class:`.channel.Channel`'s connection: reading the socket, handling each message
through the protocol state, the queue of arrived arrays and its bound (the eventfd a full queue parks the
reader on), and the end of the connection, also for a channel collected unclosed.

The background reader (:func:`_read_loop`) holds the parts of the connection (:class:`_Conn`) and only a weak
reference to the channel; :class:`Reading` holds the channel's methods that read, which ``recv`` in the caller's
thread and the background reader share. Threads, locks, the queue bound and finalizers: Note [channel threads
and fork], in :mod:`.channel`.
"""

from __future__ import annotations

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
from ._state import (ArraysArrived, ChunkAnnounced, ChunkRetired, ConnectionState, EmptyBatch, LayoutForgotten,
                     LeasesReleased, PeerClosed, PeerRefused)
from ._torch_views import LayoutViews
from .protocol import parse_message
from .sending import MemoTable
from .wire import shut_down


_ARRAY_KINDS = frozenset(("array", "arrays", "repeat"))  # the messages that queue an array for recv
_POLLIN = select.POLLIN
_HANGUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR
_get_ident = threading.get_ident


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
    parked: tuple | None = None  # an array message read while the queue was full: (msg, fds)
    wake_fd: int = -1  # an eventfd: recv() wakes a reader parked for room (made on the first park)
    unbounded: bool = False  # the peer hung up (or this end shut down): take what is left whatever the bound
    has_reader: bool = False
    finish_here: bool = False  # whoever ends the connection also drops the queue and closes the carrier


def _check_max_queued(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidArgumentError(f"max_queued must be a positive int, got {value!r}")
    return int(value)


def _read_loop(ref: "weakref.ref[Reading]", conn: _Conn) -> None:
    """The background reader: it waits for the socket with no reference to the channel, then handles
    what arrived through it; a channel collected meanwhile (its finalizer shut the socket down) is ended
    here."""
    poller = select.poll()
    poller.register(conn.sock, _POLLIN)  # (POLLHUP, POLLERR: always)
    with conn.read_lock:  # waits for a recv() reading in its caller's thread to finish
        while not conn.proto.ended:
            if conn.parked is not None:
                _wait_for_room(conn)
            elif not conn.frames.buffered():
                poller.poll()  # PEP 475: an EINTR is retried
            ch = ref()
            if ch is None:
                _end_connection(conn)
                return
            if conn.parked is None:
                ch._read_one(None)
            elif conn.unbounded or len(conn.queue) < conn.max_queued or conn.proto.over:
                msg, fds = conn.parked
                conn.parked = None
                ch._take(msg, fds)
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
    link = conn.link
    link.acquire()
    try:
        conn.memos.clear()
        with conn.state:
            leases = conn.proto.end()
            parked, conn.parked = conn.parked, None
            if conn.wake_fd >= 0:  # (under the state lock, as recv() writes to it)
                os.close(conn.wake_fd)
                conn.wake_fd = -1
            conn.state.notify_all()
        conn.releases.wake()  # the flusher sees the end and exits
        try:
            conn.sock.close()
        except OSError:
            pass
    finally:
        link.release()
    if parked is not None:
        close_fds(parked[1])
    conn.frames.discard()
    for lease in leases:
        lease._complete("closed" if conn.proto.closed_here else "disconnected")
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

    def _next(self, timeout: float | None, want_batch: bool) -> _Queued:
        if self._owner != _forks.pid:
            raise ForkedResourceError("this channel", self._owner)
        deadline = deadline_after(timeout)  # checks it (math.inf: no deadline)
        drained = False  # past the deadline, reading goes on until a read finds nothing: timeout=0 takes what has arrived
        while True:
            if self._releases.pending and not self._queue:
                # About to wait: send the releases now rather than after RELEASE_DELAY, unless a
                # message has arrived already (a busy consumer lets its releases gather).
                if not (self._reader is None and self._read_arrived()):
                    self._releases.flush()
            with self._state:
                if self._queue:
                    if self._queue[0].event.kind == "arrays" and not want_batch:
                        raise InvalidArgumentError("the next message is a send_many batch: use recv_many()")
                    if self._conn.parked is not None:  # the reader waits for room (set under this lock)
                        os.eventfd_write(self._conn.wake_fd, 1)
                    return self._queue.popleft()
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
                drained = not self._read_one(deadline)  # in this thread: no hand-over between threads
            finally:
                self._read_owner = 0
                self._read_lock.release()
                if self._waiters:
                    with self._state:
                        self._state.notify_all()  # a thread waiting above may now read

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

    def _read_one(self, deadline: float | None) -> bool:
        """Read and handle one message (the caller holds ``_read_lock``); a message that ends the
        connection, or breaks the protocol, ends it here (:meth:`_end`). Returns False when
        nothing arrived by ``deadline`` (the caller's own deadline check raises), else True.
        The background reader parks an array message read while :attr:`max_queued` are queued
        (:func:`_read_loop` takes it once there is room)."""
        if self._proto.ended:
            return True
        try:
            msg, fds = self._frames.read_by(deadline)  # (no remaining() and deadline_after() back per message)
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
        conn = self._conn
        if len(self._queue) >= conn.max_queued and self._reader is not None and not conn.unbounded:
            if msg.get("kind") in _ARRAY_KINDS and not self._proto.over:
                with self._state:
                    if conn.wake_fd < 0:
                        try:
                            conn.wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
                        except OSError:  # no fd left (EMFILE): this one is queued beyond the bound
                            pass
                    if conn.wake_fd >= 0:
                        conn.parked = (msg, fds)  # the socket stays unread: the peer's sends wait
                        return True
        self._take(msg, fds)
        return True

    def _take(self, msg: dict[str, Any], fds: list[int]) -> None:
        """Handle one message read (its fds are closed after), ending the connection if it must."""
        try:
            self._handle(msg, fds)
        except (DmaBufError, OSError, ValueError) as exc:
            self._proto.fail(exc)
            self._end()
        except Exception as exc:  # noqa: BLE001 - a message no check foresaw must still end the channel
            # Our failure, not the peer's: the message passed every check of the protocol.
            self._proto.fail(LocalError(f"this process failed on the peer's {msg.get('kind')!r} message: "
                                        f"{type(exc).__name__}: {exc}"))
            self._end()
        finally:
            close_fds(fds)

    def _handle(self, msg: dict[str, Any], fds: list[int]) -> None:
        """Hand one message to the protocol state and act on its events: arrays are queued (under the
        state lock, with the state's own step, so that a ``close`` between them cannot lose a lease);
        chunks are imported, retired chunks unmapped once unused, released leases completed."""
        descs = None
        if not (self._carrier.transport == "nixl" and isinstance(msg, dict) and msg.get("kind") == "region"):
            _, descs = parse_message(msg)  # outside the state lock: a batch has thousands of descriptors
        with self._state:
            events = self._proto.receive(msg, len(fds), descs)
            for ev in events:
                if type(ev) is ArraysArrived:
                    chunks = {}
                    for cid in ev.chunks:
                        chunk = chunks[cid] = self._imports[cid]
                        chunk.retain()  # mapped until received, whatever comes after (make_received)
                    views = None
                    if ev.layout is not None:
                        views = self._layout_views.get(ev.layout)
                        if views is None:
                            views = self._layout_views[ev.layout] = LayoutViews()
                    self._queue.append(_Queued(ev, chunks, views))
                    if self._waiters:
                        self._state.notify_all()
                elif type(ev) is EmptyBatch:
                    self._releases.pending.append(ev.lease)  # nothing to hold
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
            elif t is PeerClosed:
                raise PeerClosedError("the peer closed the channel")
            elif t is PeerRefused:
                raise PeerRefusedError(f"the peer refused this connection: {ev.reason}")

    def _end(self) -> None:
        """The connection is over (:func:`_end_connection`). The caller holds ``_read_lock``."""
        _end_connection(self._conn)
