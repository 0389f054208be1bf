"""`Channel`: one connection over which arrays travel as descriptors into a shared pool.

Either end may send (with a :class:`.pool.SharedPool`) and receive. This module is the channel's I/O:
the socket and its framing, the reader and flusher threads, and the locks; what a message means is
decided by the sans-I/O :class:`._state.ConnectionState`, how a chunk crosses by the carrier
(:class:`._carrier.FdCarrier`, or NIXL for ``tcp://``), what is sent by :mod:`.sending`, what
arrives by :mod:`.received`. The reading side (reading and handling messages, the queue of arrived
arrays and its bound, ending the connection) is in :mod:`._reader`; the lending side (announcing chunks,
lending arrays under leases, defining and repeating layouts by the socket or the shared-memory ring, retiring
chunks) in :mod:`._lending`.

Who reads the socket: a channel that has only received reads it in the caller's thread, inside
:meth:`Channel.recv`, so an array reaches the caller without a hand-over between threads. Once a
channel has lent a block (its first ``send``) a background reader thread takes over the socket for
good, so that releases and the peer's death are seen while the caller does something else: when the
peer goes (EOF, even by SIGKILL) it completes every lease at once and the blocks return to the pool.

Note [channel threads and fork]
-------------------------------
Threads. The caller's threads send (``send``/``send_many``), receive (``recv``) and release. At most
two threads of the channel's own: the *reader* (started by the first ``send``, or at once on
``tcp://``), which from then on alone reads the socket, handles every message and ends the connection;
and the *flusher* (started by the first release that cannot go out inline), which sends ``release``
messages gathered for :data:`RELEASE_DELAY`. Both are daemon threads and exit when the connection ends.
Neither holds the :class:`Channel`: the reader holds the parts of the connection (:class:`._reader._Conn`) and a
weak reference, and waits for the socket (``poll``) with no strong one, so a channel dropped unclosed is
collected, as a ``socket.socket`` is (see Finalizers).

Flow. The reader queues arrived arrays for ``recv``; at :attr:`Channel.max_queued` of them it parks the
next array message (already read) and stops reading the socket, so the peer's socket buffer fills and
its ``send`` waits, then times out with none of its message sent. It waits, holding no lock, on an
eventfd that ``recv`` writes when it takes an array from a full queue (only then: ``parked`` is set under
``_state``), and on the socket's hang-up (``POLLRDHUP``/``POLLHUP``): the peer's end, or this end's
shutdown, which is seen at once, and then everything left is read whatever the bound (the peer can send
no more). Releases and retires that the peer sent behind those arrays wait for room too (one ordered
stream).

Who owns what. ``_read_lock``: whoever reads the socket (``recv`` in the caller's thread, or the reader
for good); it alone touches ``_frames``, ``_imports`` (``chunk id -> imported chunk``) and
``_layout_views``. ``_send_lock`` (the :class:`._link.Link`'s lock): every write to the socket, and the
half of the protocol state that says what this end lent (chunks announced, layouts defined:
:meth:`ConnectionState.choose_layout` and :meth:`~ConnectionState.layout_sent` are called under it, so
layouts reach the peer in the order they are defined; ``send_failed``), and the memo table. ``_state`` (a
Condition): the other half of the protocol state (phase, leases lent and held, the peer's chunks and
layouts: :meth:`ConnectionState.receive` is called under it), the queue of arrived arrays and the
:class:`._releases.ReleaseQueue`'s pending ids; waiters in ``recv`` sleep on it. ``_state_lock`` is the RLock
``_state`` is over, held directly (the same lock) on the paths every hand-off takes.

The shared-memory ring (:mod:`._ring`; both ends offered it at the handshake). Its four kinds of calls are
serialised by the locks above: ``push_repeat`` (a repeat without meta, :meth:`._lending.Lending._push`) under
``_send_lock``, so a slot takes its place among the socket messages in the lock's order (it records
:attr:`._link.Link.sent`, the messages that went out whole before it);
``peek_sock_seq``/``take``/``sleep_begin``/``sleep_end`` by whoever holds ``_read_lock``
(:meth:`._reader.Reading._arrived` merges the slots with the socket messages in the peer's order); and
``push_releases``, ``take_releases`` and ``want_releases`` under ``_state`` (the importer's releases, from any
thread; the exporter takes them in its reader after each wake-up, in a ``send`` before it places anything new
(:meth:`._lending.Lending._take_ring_releases`; a placement lent again needs no room and takes none unless they
fill half the peer's release ring), and in
whatever thread waits for a lease or for pool room
(:class:`._reader.ReleaseWaits`: Note [waking for releases], in :mod:`._ring`)). The peer's ``ring`` message is
attached, and the rings closed at the end of the connection, under ``_state`` (the end also holds ``_send_lock``).
Every wait of the reader (the background reader's, and ``recv``'s in its own thread) is a ``poll`` of the socket
and the ring's wake socket, between ``sleep_begin`` and ``sleep_end``; ``recv`` may first spin on the ring
(:attr:`Channel.spin`).

Lock order: ``_read_lock`` -> ``_send_lock`` -> ``_state`` -> a chunk's own lock or the holds' lock
(``received._COUNTS``). Nothing is taken the other way: the release path takes ``_state``, lets it go, and only
then tries ``_send_lock`` without blocking (the flusher sends it otherwise). A pool that retires a chunk
(``SharedPool.empty`` making room, ``trim``, ``close``) never waits for ``_send_lock`` either: the ``retire`` goes
out now if the lock is free, else in the thread that holds it, once it lets go (:meth:`._link.Link.defer`).

Finalizers. A :class:`~.received.Hold` collected with items unreleased (its ``__del__``, possibly inside
the garbage collector, in whatever thread allocated) releases the peer's lease: it takes ``_state``, may
start the flusher thread, and never blocks on the send lock. It can run in a thread that already holds
``_state`` (the reader allocates while handling a message), which is why ``_state`` is a Condition over
a re-entrant lock (the default) and why :class:`ConnectionState` tolerates ``released()`` between two
steps of ``receive()``. A view's :class:`~.arrays.ChunkRef` dropped last unmaps its chunk (``munmap``,
``cuMemUnmap``) in whatever thread drops it. A :class:`Channel` collected unclosed (``weakref.finalize``:
:func:`._reader._collected`; not at interpreter exit) warns (``ResourceWarning``), marks itself closed under
``_state``, shuts the socket down (the peer sees the end at once; no ``bye``, which would be a send) and,
when no reader runs, starts a thread that ends the connection; else the reader, woken by the shutdown,
finds the channel gone and ends it with the parts it holds. A finalizer never sends, never waits on the
socket, and never takes ``_read_lock`` or ``_send_lock`` blocking.

Signals. Python runs a signal handler in the main thread between two bytecodes, possibly inside that
thread's own ``send`` (holding ``_send_lock``, waiting in ``poll`` for a peer that stopped reading), its
``recv`` (holding ``_read_lock``) or a step under ``_state``. A ``close()`` in the handler must not wait
for those: the send lock (an RLock, :class:`._link.Link`) and the state's RLock know the thread that holds
them, and ``recv`` records the one that reads (``_read_owner``). Then ``close()`` marks the channel closed,
shuts the socket down (the interrupted call fails at once when the handler returns, with
:class:`~..errors.ClosedError`; no ``bye``: the stream may be mid-message) and leaves the end to the
reader (started if need be) or to the interrupted ``recv``, which runs it once the interrupted call lets go.

fork(). Nothing here runs at fork: a child has none of the channel's threads, nor the ring's mappings
(``MADV_DONTFORK``; its ``close()`` there closes only the fds), and its locks may be
held by threads that are gone. Channels, pools and NIXL agents record the pid that made them
(:data:`.._forks.pid`, kept current by an at-fork hook: no ``getpid`` per message). In another process
``send``/``recv``/``alloc`` raise :class:`~..errors.ForkedResourceError` naming the owner; ``close()``
takes no lock, sends no ``bye``, shuts nothing down and only closes this process's copies of the fds; a
:class:`~.received.Hold` released or collected there sends no release, a pool closed there retires
nothing on the parent's channels. At fork the child forgets the registries: ``LIVE_POOLS`` (an inherited
pool gets a new lock and releases nothing at the child's exit), the segment chunks, the NIXL agents
(closed without a NIXL call and never destroyed there). A forked child opens its own (``connect`` after
the fork). A child forked after ``cuInit`` cannot use CUDA (:class:`~..errors.ForkedAfterInitError`);
host pools, and channels that map no device chunk, never initialise CUDA, so a process that forks
workers should make them before any device pool.

Speed tricks here, measured and load-bearing: the ring (a repeat without meta costs a slot and, only when the
peer sleeps, one ``send`` of a wake-up; a release one ring entry), measured with a host pool on the 2-core CPU
machine in one process (send, recv, release: 10, 15, 18 us, against 49, 65, 38 us on the socket); the inline
release (:data:`RELEASE_GAP`, :data:`RELEASE_BATCH`: the exporter reads a release before its next send, not
during it); reading in the caller's thread on a receive-only channel (no hand-over between threads); notifying
``_state`` only when a ``recv`` waits on it; the flusher's own ``Event`` (it never competes with ``recv`` for
the GIL). Per message, the fork check, the send lock's hold and the queue bound cost a few attribute
reads and stores (under a microsecond). The reader polls before it reads when nothing is buffered: a message
that finds it waiting costs ``poll`` + ``recvmsg`` (it was ``recvmsg`` -> ``EAGAIN``, ``poll``, ``recvmsg``),
one already waiting a ``poll`` more.
"""

from __future__ import annotations

import collections
import numbers
import operator
import os
import socket
import threading
import weakref
from typing import Any, Mapping, Sequence

from .. import _forks
from .._time import check_timeout, deadline_after, remaining
from ..errors import ClosedError, DmaBufError, InvalidArgumentError, PeerClosedError
from ._autopool import Membership, join
from ._carrier import FdCarrier, mechanism_for
from ._lending import Lending
from ._link import SEND_TIMEOUT, Link
from ._reader import (Reading, ReleaseWaits, _check_max_queued, _collected, _Conn, _drop_queue, _Queued,
                      _read_loop)
from ._releases import RELEASE_BATCH, RELEASE_DELAY, RELEASE_GAP, ReleaseQueue
from ._spin import AUTO
from ._state import MAX_CHUNKS, ConnectionState
from ._torch_views import BatchViews, LayoutViews
from .arrays import device_index
from .lease import Lease, PeerInfo
from .pool import SharedPool
from .protocol import MAX_LAYOUTS, MAX_SINGLE_LAYOUTS
from .received import Received, as_tensors, release_all
from .sending import MemoTable, batch_items, stream_handle
from .wire import frame_reader, shut_down

__all__ = ["Channel", "Lease", "Received", "PeerInfo", "as_tensors", "mechanism_for", "release_all", "MAX_CHUNKS",
           "MAX_QUEUED", "MAX_SPIN", "RELEASE_BATCH", "RELEASE_DELAY", "RELEASE_GAP", "SETTLE_TIMEOUT", "check_spin"]

#: The most array messages a channel keeps received and not yet taken by ``recv``/``recv_many`` (the
#: default of :attr:`Channel.max_queued`). Beyond it the reader takes no more arrays from the socket, so
#: a producer whose consumer stops receiving is pushed back (its ``send`` waits, then times out).
MAX_QUEUED = 1024
#: The longest :attr:`Channel.spin`, seconds (a spin is a busy wait: longer is a sleep's job).
MAX_SPIN = 1.0
#: The longest a ``send`` that found the connection ended waits for the leases lent before it to be completed
#: (by the thread that ends the connection) before it raises, seconds.
SETTLE_TIMEOUT = 2.0


def check_spin(value: Any) -> float | str:
    """A spin (seconds a ``recv`` polls the shared-memory ring before it sleeps): a real in [0, :data:`MAX_SPIN`], or
    ``"auto"``: as long as the last waits suggest, at most :data:`._spin.AUTO_SPIN_MAX`, and not at all on a machine
    with fewer than :data:`._spin.AUTO_SPIN_MIN_CPUS` CPUs (Note [adaptive spin], in :mod:`._spin`).

    Raises:
        InvalidArgumentError: not ``"auto"`` nor a real number in that range.
    """
    if value.__class__ is str and value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= MAX_SPIN:
        raise InvalidArgumentError(f"spin must be a number of seconds in [0, {MAX_SPIN:g}] or \"auto\", got {value!r}")
    return float(value)

_NAME = operator.attrgetter("name")
_get_ident = threading.get_ident


class Channel(Lending, Reading):
    """A connected channel (from :func:`.connect` or :meth:`.Listener.accept`).

    Attributes:
        share_segments: lend device memory that is already shareable (torch's expandable
            segments: :mod:`.segments`) in place instead of copying it into the pool
            (default ``True``; set it ``False`` to always copy).
        ring: whether this connection uses the shared-memory ring beside the socket (both ends offered it;
            :mod:`._ring`): a ``send`` that repeats a layout without ``meta`` goes through it, and releases
            come back through it.

    The rendezvous makes it and gives these arguments; callers do not.

    Args:
        sock: the connected AF_UNIX stream socket (owned from now on).
        peer: who is on the other end.
        pool: the pool that :meth:`send` copies into (``None``: pools made on first need, :mod:`._autopool`).
        device: the CUDA ordinal that device chunks are mapped on when
            receiving (``None``: the chunk's own GPU, found by UUID).
        ordering: ``"event"`` (default) or ``"sync"`` for device pools.
        carrier: how chunks cross (default: fds, :class:`._carrier.FdCarrier`).
        auto_pools: without ``pool``, the listener's pools made on first need, shared by its channels
            (``None``: the channel's own).
        rings: this end's shared-memory rings (:class:`._ring.Rings`, owned from now on), whose ``ring``
            message went out as this end's first after the handshake; ``None``: the socket alone.
        spin: :attr:`spin`.
    """

    share_segments = True

    def __init__(self, sock: socket.socket, peer: PeerInfo, *, pool: SharedPool | None = None,
                 device: int | None = None, ordering: str = "event", carrier: Any = None,
                 max_queued: int | None = None, auto_pools: Membership | None = None, rings: Any = None,
                 spin: float | str = 0.0) -> None:
        if ordering not in ("event", "sync"):
            raise InvalidArgumentError(f"ordering must be 'event' or 'sync', got {ordering!r}")
        max_queued = MAX_QUEUED if max_queued is None else _check_max_queued(max_queued)
        self._spin = check_spin(spin)
        self.peer = peer
        self.pool = pool
        self.device = device_index(device, default="own")
        self.ordering = ordering
        self._carrier = carrier if carrier is not None else FdCarrier(self.device)
        if not self._carrier.share_segments:
            self.share_segments = False
        # The limits are read here, from this module, so that a test may make them small.
        self._proto = ConnectionState(self._carrier.transport, max_chunks=MAX_CHUNKS, max_layouts=MAX_LAYOUTS,
                                      max_single_layouts=MAX_SINGLE_LAYOUTS, ring=rings is not None)
        self._sock = sock
        # The limit is read here, from this module, so that a test may make it small.
        self._link = Link(sock, self._proto, SEND_TIMEOUT)
        self._rings = rings
        if rings is not None:
            self._link.sent = 1  # the ring message went out in the handshake: socket message 0
        self._send_lock = self._link.lock
        self._weak = weakref.ref(self)  # shared by every Hold, and the reader's only reference (see there)
        # A Condition over an RLock (Note [channel threads and fork]); the paths every hand-off takes hold the
        # lock itself (``_state_lock``: Condition.__enter__ is one Python call more), the others the Condition.
        self._state_lock = threading.RLock()
        self._state = threading.Condition(self._state_lock)
        self._memos = MemoTable(self._link)
        self._releases = ReleaseQueue(self._link, self._state, self._state_lock, self._proto, rings)
        self._waiters = 0  # recv() calls waiting on _state: notified only when one waits
        # Held by whoever reads the socket: recv() in the caller's thread, or the background
        # reader, which keeps it from its start to the end of the connection.
        self._read_lock = threading.Lock()
        self._read_owner = 0  # the thread in recv() that holds _read_lock (for close() in a signal handler)
        self._frames = frame_reader(sock)  # buffered: a burst of messages costs one recvmsg
        self._reader: threading.Thread | None = None
        self._owner = _forks.pid  # only this process may use the channel (Note [channel threads and fork])
        self._conn = _Conn(sock, self._frames, self._proto, self._state, self._link, self._releases, self._memos,
                           self._carrier, self._read_lock, self._owner, f"channel to peer pid {peer.pid}", max_queued,
                           rings=rings, state_lock=self._state_lock)
        # Ring releases for those who wait on a lease (Note [waking for releases], in ._ring); None: no ring.
        self._waits = ReleaseWaits(self._conn) if rings is not None else None
        self._queue: collections.deque[_Queued] = self._conn.queue
        self._imports: dict[int, Any] = self._conn.imports
        self._layout_views: dict[int, LayoutViews] = self._conn.layout_views
        # Collected unclosed: closed, with a ResourceWarning, as socket.socket is (not at interpreter exit).
        self._finalizer = weakref.finalize(self, _collected, self._conn)
        self._finalizer.atexit = False
        if pool is not None:
            pool._register_channel(self)
        self._auto = join(self, auto_pools) if pool is None else None  # pools made on first need (_autopool)
        if self._carrier.reader_at_start:
            self._start_reader()

    def _start_reader(self) -> None:
        """Start the background reader (idempotent): from now on it alone reads the socket. It holds the
        channel weakly (:func:`._reader._read_loop`)."""
        with self._state:
            if self._reader is not None:
                return
            reader = threading.Thread(target=_read_loop, args=(self._weak, self._conn),
                                      name="dmabuf-interop-channel-reader", daemon=True)
            self._conn.has_reader = True
            try:
                # Started under the state lock, which its first steps do not take (it waits for the read lock): a
                # close() in another thread finds no reader, or one it can join.
                reader.start()
            except BaseException:  # (RuntimeError: no thread could be started) the next call tries again
                self._conn.has_reader = False
                raise
            self._reader = reader

    @property
    def max_queued(self) -> int:
        """The most array messages kept received and not yet taken by :meth:`recv` / :meth:`recv_many`
        (default :data:`MAX_QUEUED`). At the bound the background reader leaves the rest in the socket,
        so the peer's sends wait, then raise ``WaitTimeoutError``; releases and the peer's end behind those
        arrays are read once ``recv`` makes room, or at once when the peer hangs up. May be changed."""
        return self._conn.max_queued

    @max_queued.setter
    def max_queued(self, value: int) -> None:
        value = _check_max_queued(value)
        with self._state:
            self._conn.max_queued = value
            if self._conn.wake_fd >= 0:
                os.eventfd_write(self._conn.wake_fd, 1)

    @property
    def spin(self) -> float | str:
        """Seconds a :meth:`recv` / :meth:`recv_many` that finds nothing polls the shared-memory ring (and, every
        few dozen looks, the socket) before it sleeps in ``poll`` (default 0.0: it sleeps at once). A slot
        that lands during the spin is taken without the 20-40 us of waking a sleeping thread, but the spinning
        thread burns one CPU for up to ``spin`` seconds per ``recv`` that waits (a consumer that waits 1 ms
        between messages with ``spin=0.001`` keeps a core busy). Use it where the consumer has a CPU of its
        own; it applies where ``recv`` reads in its own thread (a channel that has not sent) and only on a
        connection with the ring (:attr:`ring`). May be changed; ``recv(spin=)`` overrides it per call.

        ``"auto"``: each wait spins for about twice the recent waits of this channel's ``recv`` (a moving
        average), at most 200 us (:data:`._spin.AUTO_SPIN_MAX`), and not at all while they run longer than that
        or where this process has fewer than 4 CPUs (:data:`._spin.AUTO_SPIN_MIN_CPUS`); Note [adaptive spin] in
        :mod:`._spin`.

        Raises:
            InvalidArgumentError: (setting) not ``"auto"`` nor a number of seconds in [0, :data:`MAX_SPIN`].
        """
        return self._spin

    @spin.setter
    def spin(self, value: float | str) -> None:
        self._spin = check_spin(value)

    @property
    def ring(self) -> bool:
        """Whether this connection uses the shared-memory ring beside its socket (both ends offered it)."""
        return self._rings is not None

    @property
    def protocol_state(self) -> ConnectionState:
        """The connection's protocol state (read-only use: layouts, leases, phase, why it ended)."""
        return self._proto

    # --- sending (the lending itself: :class:`._lending.Lending`) -------------------------------------

    def send(self, array: Any, *, stream: Any = None, meta: dict[str, Any] | None = None,
             timeout: float | None = 10.0, ordering: str | None = None) -> Lease:
        """Lend an array to the peer.

        An array inside a pool block (from :meth:`SharedPool.empty`, or a view
        of one: any non-negative strides that are multiples of the itemsize)
        goes zero-copy, and so does a device array in torch's expandable
        segments on a channel without a host pool (its pages are lent in place:
        :mod:`.segments`, unless :attr:`share_segments` is false); any other
        array is first copied, C-contiguous, into a new block of this channel's
        pool (host: ``numpy.copyto``; device: ``cuMemcpyAsync`` on ``stream``).
        The first use of a chunk sends its fds (``SCM_RIGHTS``) once.

        Args:
            array: NumPy, torch, CuPy (or any ``__cuda_array_interface__`` exporter), ``StridedMemoryView``,
                a received :class:`.pool.DeviceView`, or anything ``numpy.asarray`` takes. (Send a received
                array on as its DeviceView, not as a CuPy view of it: the CUDA array interface names no
                device, and the driver answers with the GPU that holds the memory, not the one it is mapped for.)
            stream: device pools: the stream the writes were queued on (cuda.core / torch / CuPy
                stream or a raw handle; ``None``: the legacy default stream).
            meta: a JSON object (at most 64 KiB) delivered with the array.
            timeout: seconds to wait in all for pool room when copying and for the peer to take the
                message (a full socket: a peer that stopped receiving; at most :data:`SEND_TIMEOUT`
                whatever ``timeout``). Once the message has begun to leave, its rest has
                :data:`SEND_TIMEOUT`: a send never leaves half a message behind.
            ordering: device pools: ``"event"`` (record an interprocess event on
                ``stream``, ``cuEventRecord``; skipped, and sent as ``"sync"``, when
                ``cuStreamQuery`` finds nothing pending on ``stream``) or ``"sync"``
                (``cuStreamSynchronize``); default: the channel's.

        Returns:
            a :class:`Lease`, done when the peer has released the block.

        Raises:
            InvalidArgumentError: an unsupported dtype, meta too large or not JSON, a negative
                timeout, a torch tensor with its conjugate or negative bit set, or not one strided tensor on
                the CPU or a GPU (sparse, nested, ``meta``);
                a limit the peer would refuse: more than :data:`~.protocol.MAX_NDIM` dimensions, a block of
                a new chunk past the :data:`~.protocol.MAX_CHUNKS` the peer maps (nothing sent: the channel stays up).
            ClosedError: this end closed the channel.
            ForkedResourceError: this process inherited the channel through ``fork()``.
            PoolExhaustedError: no room within ``timeout``.
            PeerClosedError: the peer has gone, or the message was cut off part-way by a peer that
                stopped reading (the connection is then ended, and the peer sees its end). Every lease lent
                before is done by then, with its ``reason`` (the send waits up to :data:`SETTLE_TIMEOUT` for the
                thread that ends the connection to complete them).
            WaitTimeoutError: the peer took nothing of the message within ``timeout`` (or
                :data:`SEND_TIMEOUT`): none of it went out, the channel is as it was.
        """
        try:
            if meta is None and stream is None and ordering is None:
                lease = self._send_ready(array, timeout)  # the steady state: an array lent again, into the ring
                if lease is not None:
                    return lease
            return self._send_items([None], [array], stream, meta, timeout, ordering, batch=None)
        except (PeerClosedError, ClosedError):
            self._settle()
            raise

    def send_many(self, arrays: Mapping[str, Any] | Sequence[Any], *, stream: Any = None,
                  meta: dict[str, Any] | None = None, timeout: float | None = 10.0,
                  ordering: str | None = None) -> Lease:
        """Lend many arrays (a state dict, or a list) in ONE ``arrays`` message under one lease.

        ``meta`` rides on the first item. Arguments, result and errors as :meth:`send`;
        the lease is done when the peer has released every item.

        Raises:
            InvalidArgumentError: as :meth:`send`; also not a mapping, list or tuple, an empty batch, more than
                :data:`~.protocol.MAX_ITEMS` arrays, or a mapping key that is not a str (of at
                most 4096 characters): the peer would refuse the message and end the channel.
        """
        names, arrs, kind = batch_items(arrays)
        try:
            return self._send_items(names, arrs, stream, meta, timeout, ordering, batch=kind)
        except (PeerClosedError, ClosedError):
            self._settle()
            raise

    def _settle(self) -> None:
        """A send found the connection ended (or ending): wait, at most :data:`SETTLE_TIMEOUT`, until whoever ends
        it (the reader thread, a ``recv``, a ``close``) has completed every lease, so that the caller who catches
        the error finds each lease lent before it done, with its ``reason``. Nothing to wait for while nothing
        is lent and the end has not begun."""
        if self._proto.ended or self._proto.lent:
            self._conn.settled.wait(SETTLE_TIMEOUT)

    @property
    def outstanding(self) -> int:
        """Leases lent on this channel and not yet released (releases the peer put in the shared-memory ring
        are taken first)."""
        if self._waits is not None:
            self._waits.take()
        with self._state:
            return self._proto.lent

    # --- receiving ------------------------------------------------------------------

    def recv(self, timeout: float | None = 60.0, *, stream: Any = None, spin: float | str | None = None) -> Received:
        """The next array from the peer.

        Args:
            timeout: seconds to wait (``None``: forever).
            stream: device pools: the stream that will read the array; it is made to wait for the
                producer's event (``cuStreamWaitEvent``). ``None``: the legacy default stream.
            spin: seconds to poll the shared-memory ring before sleeping, or ``"auto"`` (default :attr:`spin`;
                see there for its CPU cost).

        Raises:
            WaitTimeoutError: nothing within ``timeout``.
            ClosedError: this end closed the channel.
            ForkedResourceError: this process inherited the channel through ``fork()``.
            PeerClosedError: the peer has gone (arrays it sent before are delivered first).
            ProtocolError: the peer broke the protocol, or stopped in the middle of a message for
                :data:`.wire.REST_TIMEOUT` seconds (the connection was closed).
            InvalidArgumentError: the next message is a batch (use :meth:`recv_many`); ``spin`` out of range.
        """
        h = 0 if stream is None else stream_handle(stream)  # before the message is taken: a bad stream must not lose it
        spin = self._spin if spin is None else check_spin(spin)
        deadline = deadline_after(timeout)  # checks it (math.inf: no deadline)
        try:
            out = self._recv_ready(deadline, spin, h)  # the steady state: one array's slot, taken as it lands
            if out is None:
                q = self._next(timeout, False, spin, deadline)
                ev = q.event
                out = self._carrier.make_received(self, ev.lease, ev.descs, h, ev.ordering, q.chunks)[0]
        except BaseException as exc:
            self._interrupted_taking(exc)  # (Note [interrupted handling], in ._reader)
            raise
        self._conn.taking = 0
        return out

    def recv_many(self, timeout: float | None = 60.0, *, stream: Any = None,
                  spin: float | str | None = None) -> dict[str, Received] | list[Received]:
        """The next ``send_many`` batch: a dict by name (for a mapping) or a list; a single array as a list of one.
        Arguments as :meth:`recv`.

        Raises: as :meth:`recv`.
        """
        h = stream_handle(stream)  # before the message is taken: a bad stream must not lose it
        try:
            q = self._next(timeout, True, self._spin if spin is None else check_spin(spin))
            ev = q.event
            out = self._carrier.make_received(self, ev.lease, ev.descs, h, ev.ordering, q.chunks)
        except BaseException as exc:
            self._interrupted_taking(exc)  # (Note [interrupted handling], in ._reader)
            raise
        self._conn.taking = 0
        if len(out) > 1 and out[0].device >= 0:
            views = BatchViews(q.views if self._carrier.views_follow_layout else None)
            for r in out:
                r._batch = views
        if ev.mapping:
            return dict(zip(map(_NAME, ev.descs), out))
        return out

    # --- releases (importer side) -----------------------------------------------------

    def _release_lease(self, lease_id: int, *, inline: bool = False) -> None:
        """Every item of the peer's lease ``lease_id`` was released here (:class:`~.received.Hold`);
        ``inline``: by the caller's ``release()``, so the message may go out in its thread."""
        if self._owner != _forks.pid:
            return  # a Received inherited through fork(): the parent holds the lease and releases it
        self._releases.add(lease_id, inline=inline)  # (the state forgets the lease there, under the same hold)

    # --- closing ------------------------------------------------------------------

    def close(self, timeout: float | None = 5.0) -> None:
        """Flush pending releases, say ``bye``, and end the connection (idempotent).

        Leases still out complete with reason ``"closed"``; arrays still held
        here stay readable until released; arrays that arrived and were not
        received are dropped. Opened IPC events are destroyed
        (``cuEventDestroy``). A send in progress in another thread (a peer
        that stopped reading) is waited for at most ``timeout`` seconds; then
        the connection is ended under it, and that send raises
        ``ClosedError``.

        Called inside this thread's own ``send``/``recv`` (a signal handler that interrupted it), it
        does not wait for that call: it marks the channel closed and shuts the socket down, so the
        interrupted call returns with an error once the handler is done (no ``bye``: the stream may be
        mid-message), and the reader ends the connection then. In a process that inherited the channel
        through ``fork()`` it only closes this process's copy of the socket: the parent's connection
        is left as it was.
        """
        if self._proto.closed_here:
            return
        if self._owner != _forks.pid:
            self._close_inherited()
            return
        # Another thread may be stuck sending to a peer that stopped reading: wait for it at most
        # ``timeout``, then end the connection under it (its send fails, and the peer sees the end).
        # (A negative one: none left; math.inf or one past what a lock takes: no limit.)
        if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) and timeout < 0:
            timeout = 0.0
        wait = check_timeout(timeout)
        deadline = deadline_after(wait)
        link = self._link
        # This thread's own interrupted send (or recv) holds a lock the end needs: waiting would never end.
        # (Or it holds the state lock, which the end takes: the Condition's RLock says whether this thread does.)
        interrupted = link.held_here() or self._state._is_owned()
        # (not taken where this thread holds it: Note [the send lock's owner], in ._link)
        with link.held_if_free() if interrupted else link.held_within(remaining(deadline)) as locked:
            if locked:  # the releases and the bye wait for the peer within the same timeout
                self._releases.flush(send_lock_held=True, timeout=remaining(deadline))
                try:
                    link.send_locked({"kind": "bye"}, timeout=remaining(deadline), whole=True)
                except (DmaBufError, OSError):
                    pass  # the peer is gone, or not reading, or the connection broke: ended below all the same
            with self._state:
                self._proto.close()
                interrupted = interrupted or (self._read_lock.locked() and self._read_owner == _get_ident())
                if interrupted:
                    self._conn.finish_here = True  # whoever ends the connection drops the queue, closes the carrier
            if not self._proto.ended:
                shut_down(self._sock)  # wakes the reader (and a stuck sender); the reader closes the socket
        self._finalizer.detach()
        self._releases.wake()
        with self._state:
            self._state.notify_all()
            reader = self._reader
        if interrupted:
            # The reader ends the connection once the interrupted call lets go (it sees the shutdown).
            if not self._proto.ended:
                self._start_reader()
            return
        if reader is None:
            # No background reader: end the connection here, once no recv() is reading.
            if self._read_lock.acquire(timeout=-1 if wait is None else wait):
                try:
                    if not self._proto.ended:
                        self._end()
                finally:
                    self._read_lock.release()
        elif threading.current_thread() is not reader:
            # Its own wait: the sends above may have used up the first; after the shutdown it ends at once.
            reader.join(wait)
        _drop_queue(self._conn)
        if self._auto is not None:
            self._auto.leave()  # the last member closes the pools made on first need
        self._carrier.close()

    def _close_inherited(self) -> None:
        """``close()`` in a process that inherited the channel through fork(): no lock (a thread of the parent
        may have held one at the fork), no ``bye``, no shutdown; this process's copies of the fds are closed."""
        self._proto.close()  # (this process's copy of the state: takes no lock)
        self._finalizer.detach()
        try:
            self._sock.close()
        except OSError:
            pass
        self._frames.discard()
        if self._rings is not None:
            self._rings.close()  # (inherited: only this process's copies of its fds; no mapping came with fork)

    @property
    def closed(self) -> bool:
        """True once this end has closed the channel, or has seen the connection end. (A channel
        that has only received reads the socket in :meth:`recv`, so it sees the peer's end there.)"""
        return self._proto.over

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Channel peer pid={self.peer.pid} {'closed' if self.closed else 'open'}>"
