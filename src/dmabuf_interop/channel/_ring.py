"""The shared-memory ring beside a local channel's socket: `Rings`, one connection's pair of regions.

Each end owns one region (a sealed memfd, written only by its owner, mapped read-only by the peer) holding its
message ring (fixed-size slots that carry what a ``repeat`` carries), its release ring (lease ids) and the
counters both ends read. The format, the ordering with the socket, the wake protocol and what a reader must
check are specified in ``docs/protocol.md`` ("Shared-memory ring"); this module is that section in code, with
:mod:`._ring_region` (the region's format, the slot's encoding, :class:`RingSlot` and the checks of the peer's
``ring`` message and fds), whose names it re-exports. The memory orders come from the C extension
:mod:`dmabuf_interop._atomic` (acquire/release and seq_cst u64 loads and stores, and the ``MADV_DONTFORK``
mapping); where it is not built the ring is not offered (:func:`ring_unavailable`).

Note [the peer's region]. The peer may rewrite its region at any moment, so every value taken from it is
copied out exactly once (the peer ring's reading cursor, :class:`dmabuf_interop._atomic.SlotReader`, copies a
slot and checks the copy; release entries are copied by ``tolist()``) and only the copy is checked and used. A
slot torn by a concurrent rewrite is then a mix of field values, each checked like any other; a slot overwritten
after the tail said it was published shows a wrong ``seq``. Counters the peer publishes must move forward and stay
within a ring's length of what this end consumed; anything else is a :class:`~..errors.ProtocolError`. This end
never reads its own region back (its counters live in its cursors and in Python attributes); the peer cannot
write it (``F_SEAL_FUTURE_WRITE``).

Note [the wake fd] (in :mod:`._ring_region`): why a sleeping end is woken through a datagram socket.

Note [ring and fork]. Both mappings are made with ``MADV_DONTFORK``: a forked child has none of them. A
:class:`Rings` inherited through ``fork()`` may only be closed there: its methods raise
:class:`~..errors.ForkedResourceError`, and its ``close()`` (or its collection) closes this process's copies
of the fds and forgets the mappings without ``munmap`` (the child may have mapped something else at those
addresses since; :class:`dmabuf_interop._atomic.Mapping` checks the pid).

Note [waking for releases]. An end's ``asleep`` has two sleeping values (:data:`SLEEP_ALL` 1,
:data:`SLEEP_SLOTS` 2). A writer of slots wakes a sleeper on any nonzero value; a writer of releases only on
1 (and on any value other than 0 and 2: a peer's unknown value counts as 1). Why: an exporter's reader sleeps
almost all the time, and a release woke it at every hand-off (a ``send`` on the importer, a thread wake-up and
the GIL on the exporter), though a pipelined producer takes them itself (in a wait, in a ``send`` that places
something new, or in any ``send`` once they fill half the peer's release ring: :meth:`Rings.releases_backlogged`).
Only someone who WAITS for a release needs the wake-up. So the exporter's reader sleeps in 2 while no thread waits
for a release and it sent within the bound below (:func:`._reader._sleep_on_ring`), and a thread about to wait
(``Lease.wait``, ``SharedPool.alloc`` waiting for room: :class:`._reader.ReleaseWaits`) counts itself in, then
calls :meth:`Rings.want_releases`: it stores 1 over a 2 (seq_cst), then loads the peer's ``rel_tail``
(seq_cst) and takes what is there. That pair is the Dekker handshake with the peer's :meth:`push_releases` (its
seq_cst store of ``rel_tail``, then its seq_cst load of ``asleep``): in the single order of seq_cst operations
one of the two loads sees the other's store, so either the peer sends the wake-up (the reader takes the release
and completes the lease) or the waiter finds the release itself. The sleeper, after its store of 2, reads the
count of waiters again and, if one came, stores 1 and loads ``rel_tail`` the same way before it sleeps. Both
sides' steps are Python steps under the GIL, so they are ordered: a waiter counted in after the sleeper chose
2 either finds the 2 stored (and stores 1 itself) or is counted before the sleeper's second look (which does).
A waiter on a lease is counted out by the lease's completion, in the completing thread, so the reader that
completed it sleeps in 2 again at once. A sleep in 2 is bounded (:data:`._reader.SLOTS_ONLY_SLEEP`, 2 ms):
after it the sleeper takes the releases, and sleeps in 1 once it has not sent within the bound. The bound is
what makes the scheme safe whoever waits: an idle producer's leases and pool blocks come back within it with no
``send`` and no waiter counted in (a lease watched through ``reason``, a pool's caller that frees nothing
itself), at the cost of at most one wake-up per bound while a producer keeps sending. ``Lease.done`` and
``Channel.outstanding`` poll: they take the releases themselves, with no need to be woken.

Threads. A :class:`Rings` takes no lock. Its caller serialises the calls of each of four groups:
``try_push`` (and ``push_repeat``, ``push_host``); ``peek_sock_seq``, ``spin_peek``, ``take`` (``take_fields``),
``sleep_begin`` and ``sleep_end``; ``push_releases``;
``take_releases`` and ``want_releases``. Each group writes its own counters, so the four may run in four
threads (``sleep_begin`` reads ``take_releases``'s head: a stale value only makes it decline to sleep;
``releases_backlogged``, called by any sender, reads it too: a stale value only makes it take the releases a
call early or late).
``want_releases`` also stores ``asleep`` (1 over a 2) beside the sleeper: a store of 1 after the sleeper woke
leaves an awake end marked asleep until its next ``sleep_begin`` or ``sleep_end``, which costs the peer a
spare wake-up and nothing else. ``attach`` and ``close`` run alone.

Speed (load-bearing). The message rings' hot state lives in two C objects made by :meth:`Rings.attach`: this end's
ring's writing cursor (:class:`dmabuf_interop._atomic.SlotWriter`: its tail, the peer's head as last loaded) and
the peer ring's reading cursor (:class:`dmabuf_interop._atomic.SlotReader`: this end's head, the peer's tail as
last loaded, the slot peeked and not taken). Each holds a buffer of both regions for its life, so a publish (the
slot's body, its ``seq`` released, the tail and the Dekker step, the wake-up), a look (``peek``, or ``spin_peek``:
up to a given number of looks at the tail, a CPU pause between two) and a take are each one C call, bound on the
instance over this class's methods, with no Python frame between the channel and the shared memory. Measured with
CPython 3.11.7 on the 2-core x86-64 CPU machine, both ends of a channel in one process, a host pool's 4 KiB
blocks, 20,000 hand-offs, the 10th percentile of ``recv``: 2.97 us with the cursors in Python attributes before
(a slot copied and checked in one C call, ``read_slot``, and the rest in Python), 2.49 us with these. The tricks
kept from before: the peer's heads are cached and loaded again only
when the cache says full; a peeked slot is kept for ``take``; the release ring's atomics are ``METH_FASTCALL`` C
functions bound to module globals.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import os
import socket
import weakref
from typing import Any, Sequence

from .. import _forks
from ..errors import ForkedResourceError, InvalidArgumentError, NotSupportedError, ProtocolError, SyscallError
# The region's format and the ring message's checks; the names tests and callers import from here stay here.
from ._ring_region import (ASLEEP, AWAKE, EVENT_BYTES, EVENT_CODE, F_SEAL_FUTURE_WRITE, HEADER, IN_HEAD,
                           LEASE_LIMIT, MAGIC, MAX_RELEASE_SLOTS, MAX_SLOTS, ORDER_CODE, ORDERINGS, OUT_TAIL,
                           OWN_SEALS, REL_HEAD, REL_TAIL, REQUIRED_SEALS, RING_VERSION, SLEEP_ALL, SLEEP_SLOTS, SLOT,
                           SLOT_BYTES, SLOTS_OFFSET, RingSlot, check_memfd, check_offer, check_size, open_wake,
                           region_bytes)

try:
    from .. import _atomic
except ImportError as _exc:  # not built: no compiler where the package was installed
    _atomic = None  # type: ignore[assignment]
    _MISSING = (f"the C extension dmabuf_interop._atomic (the ring's atomics) is not built: it needs a C compiler "
                f"when the package is installed (`pip install -e .` builds it into a source tree) ({_exc})")
else:
    _MISSING = ""
if _atomic is not None and not hasattr(_atomic, "SlotWriter"):  # a build older than this source (built in place)
    _MISSING = ("the C extension dmabuf_interop._atomic was built from an older source (it lacks SlotWriter): "
                "rebuild it (`pip install -e .`, or `python setup.py build_ext --inplace`)")
    _atomic = None  # type: ignore[assignment]
if _atomic is not None:
    # Module globals: one dict lookup a call, not two (load-bearing on the hot paths below).
    _load, _store, _load_seq, _store_seq, _store_load = (
        _atomic.load, _atomic.store, _atomic.load_seq, _atomic.store_seq, _atomic.store_load)

__all__ = ["RING_VERSION", "RingSlot", "Rings", "ring_unavailable", "region_bytes", "MAX_SLOTS",
           "MAX_RELEASE_SLOTS", "ORDERINGS"]


@functools.cache
def ring_unavailable() -> str | None:
    """Why this process cannot offer the ring, or ``None`` when it can (asked once, then remembered).

    Reasons: the extension :mod:`dmabuf_interop._atomic` is not built; the ``os`` module lacks
    ``memfd_create``; the kernel refuses ``F_SEAL_FUTURE_WRITE`` (before Linux 5.1) or memfd
    seals at all. The probe makes a memfd, seals it and closes it.
    """
    if _atomic is None:
        return _MISSING
    if not hasattr(os, "memfd_create"):
        return "this Python has no os.memfd_create (Linux needed)"
    try:
        fd = os.memfd_create("dmabuf-interop-ring-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        return f"memfd_create failed: {SyscallError('memfd_create', exc)}"
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, OWN_SEALS)
    except OSError as exc:
        return f"the kernel refuses the ring's memfd seals (F_SEAL_FUTURE_WRITE needs Linux 5.1+): " \
               f"{SyscallError('fcntl(F_ADD_SEALS)', exc)}"
    finally:
        os.close(fd)
    return None




_DONTWAIT = socket.MSG_DONTWAIT
#: The region's layout as the cursors take it: (slots offset, slot bytes, out_tail, in_head, asleep).
_LAYOUT = (SLOTS_OFFSET, SLOT_BYTES, OUT_TAIL, IN_HEAD, ASLEEP)
def _wake_failed(err: int) -> SyscallError:
    """The error of a wake-up ``send`` that failed with ``err`` (a cursor's: Note [the wake fd])."""
    return SyscallError("send", err)


#: Wake-ups read from the wake socket at most per :meth:`Rings.sleep_end`.
_DRAIN = 64


class _Held:
    """What a :class:`Rings` owns, apart from it so that its ``weakref.finalize`` can close it."""

    __slots__ = ("mine", "peer", "cursors", "views", "fds", "socks")

    def __init__(self) -> None:
        self.mine: Any = None    # this end's region, mapped read-write
        self.peer: Any = None    # the peer's, mapped read-only
        self.cursors: list[Any] = []  # the message rings' SlotReader and SlotWriter: they hold buffers of both
        self.views: list[memoryview] = []
        self.fds: list[int] = []  # the memfd
        self.socks: list[socket.socket] = []  # this end's wake socketpair, a dup of the peer's wake socket

    def close(self) -> None:
        for cursor in self.cursors:
            cursor.close()  # (their buffers go first: a mapping with a buffer out refuses to close)
        self.cursors.clear()
        for view in self.views:
            view.release()
        self.views.clear()
        for mapping in (self.peer, self.mine):
            if mapping is not None:
                try:
                    mapping.close()  # munmap, only in the process that mapped it (Note [ring and fork])
                except BufferError:
                    pass  # a slice of a view is still alive: the mapping goes when it does
                except OSError:
                    pass  # munmap cannot fail on a range this process mapped; nothing to do if it did
        self.peer = self.mine = None
        fds, self.fds = self.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        socks, self.socks = self.socks, []
        for sock in socks:
            sock.close()  # (only this process's copy of the fd: no shutdown)




def _map(fd: int, size: int, writable: bool) -> Any:
    try:
        return _atomic.Mapping(fd, size, writable)
    except OSError as exc:
        raise SyscallError(exc.filename or "mmap", exc) from exc  # the C code names mmap or madvise



class Rings:
    """One connection's rings: this end's region (made here) and, once :meth:`attach`\\ ed, the peer's.

    Args:
        slots: message slots of this end's ring, a power of two in ``[1, MAX_SLOTS]``.
        release_slots: release slots of this end's ring, a power of two in ``[1, MAX_RELEASE_SLOTS]``.

    Attributes:
        attached: True once :meth:`attach` took the peer's region.
        wake_fd: this end's wake socket (one end of an ``AF_UNIX`` ``SOCK_DGRAM`` ``socketpair``; the peer
            gets the other, Note [the wake fd]): ``poll`` it with the channel's socket while
            :meth:`sleep_begin` .. :meth:`sleep_end`. Owned by this object.
        slots, release_slots: this end's rings' lengths.
        nbytes: this end's region size in bytes (:func:`region_bytes`).

    Raises:
        InvalidArgumentError: ``slots`` or ``release_slots`` not a power of two in range.
        NotSupportedError: :func:`ring_unavailable` gives a reason.
        SyscallError: ``memfd_create``, ``ftruncate``, ``mmap``, ``madvise``, ``fcntl(F_ADD_SEALS)`` or
            ``socketpair`` failed (names the call and the errno).
    """

    def __init__(self, slots: int = 256, release_slots: int = 1024) -> None:
        self.slots = check_size(slots, MAX_SLOTS, "slots", InvalidArgumentError)
        self.release_slots = check_size(release_slots, MAX_RELEASE_SLOTS, "release_slots", InvalidArgumentError)
        why = ring_unavailable()
        if why is not None:
            raise NotSupportedError(why)
        self.nbytes = region_bytes(slots, release_slots)
        self._held = held = _Held()
        try:
            self._make_region(held)
            try:
                wake, for_peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)  # (close-on-exec)
            except OSError as exc:
                raise SyscallError("socketpair", exc) from exc
            wake.setblocking(False)  # (every call passes MSG_DONTWAIT as well: Note [the wake fd])
            held.socks += (wake, for_peer)
            self._wake_sock, self._for_peer = wake, for_peer
            self.wake_fd = wake.fileno()
        except BaseException:
            held.close()
            raise
        self._finalizer = weakref.finalize(self, held.close)
        self._owner = _forks.pid  # Note [ring and fork]
        self._mine = held.mine
        self._rel_mask = release_slots - 1
        # This end's region as u64 entries: the release ring is written through it.
        self._mine_q = memoryview(held.mine).cast("Q")
        held.views.append(self._mine_q)
        self._rel_base = (SLOTS_OFFSET + slots * SLOT_BYTES) // 8
        # This end's release ring counters (the region holds copies for the peer; never read back). The message
        # rings' are their cursors' (made by attach: _atomic.SlotWriter for this end's, SlotReader for the peer's).
        self._rel_tail = 0      # release ids published
        self._rel_head = 0      # the peer's release ids consumed
        # What this end last saw of the peer's counters (they only move forward).
        self._peer_rel_head = 0
        self._asleep = AWAKE    # what this end last stored in its asleep
        self._reader: Any = None
        self._writer: Any = None
        self._peer: Any = None
        self._peer_q: memoryview | None = None
        self._peer_wake: socket.socket | None = None
        self.attached = False
        self.closed = False

    def _make_region(self, held: _Held) -> None:
        try:
            fd = os.memfd_create("dmabuf-interop-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise SyscallError("memfd_create", exc) from exc
        held.fds.append(fd)
        self._memfd = fd
        try:
            os.ftruncate(fd, self.nbytes)
        except OSError as exc:
            raise SyscallError("ftruncate", exc) from exc
        held.mine = _map(fd, self.nbytes, True)
        HEADER.pack_into(held.mine, 0, MAGIC, RING_VERSION, SLOT_BYTES, self.slots, self.release_slots)
        try:
            # After the writable mapping (FUTURE_WRITE spares mappings that exist), before the fd leaves.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, OWN_SEALS)
        except OSError as exc:
            raise SyscallError("fcntl(F_ADD_SEALS)", exc) from exc

    # --- set-up ---------------------------------------------------------------------------------------

    def offer(self) -> tuple[dict[str, Any], list[int]]:
        """The ``ring`` message for the peer and its two fds ``[memfd, wake socket]`` (still owned here: send
        them with ``SCM_RIGHTS``, do not close them).

        Raises:
            ForkedResourceError: called in a process that inherited this object through ``fork()``.
            InvalidArgumentError: after :meth:`close`.
        """
        self._check_usable()
        msg = {"kind": "ring", "version": RING_VERSION, "bytes": self.nbytes, "slots": self.slots,
               "release_slots": self.release_slots}
        return msg, [self._memfd, self._for_peer.fileno()]

    def attach(self, msg: dict[str, Any], fds: Sequence[int]) -> None:
        """Take the peer's ``ring`` message and its fds ``[memfd, wake socket]``: map its region read-only
        (``MAP_SHARED``, ``MADV_DONTFORK``) and keep a duplicate of its wake socket. The caller keeps ``fds``
        (and closes them).

        Raises:
            ProtocolError: a second ``ring`` message; bad fields (:func:`check_offer`); not two fds; the
                region fd not a memfd, not sealed with :data:`REQUIRED_SEALS`, of another size than
                ``bytes``, or not readable; its header not the message's; the wake fd not a connected
                ``AF_UNIX`` ``SOCK_DGRAM`` socket.
            SyscallError: ``mmap``, ``madvise`` or ``dup`` failed for this process's reasons (``ENOMEM``,
                ``EMFILE``).
            ForkedResourceError, InvalidArgumentError: inherited through ``fork()``; closed.
        """
        self._check_usable()
        if self.attached:
            raise ProtocolError("ring: a second ring message")
        nbytes, slots, release_slots = check_offer(msg)
        if not isinstance(fds, (list, tuple)) or len(fds) != 2:
            raise ProtocolError(f"ring: the message carries {len(fds) if isinstance(fds, (list, tuple)) else '?'} "
                                f"fds, not 2 (memfd, wake socket)")
        memfd, wake = fds
        check_memfd(memfd, nbytes)
        try:
            peer = _atomic.Mapping(memfd, nbytes, False)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.ENODEV, errno.EINVAL, errno.EPERM):
                raise ProtocolError(f"ring: the peer's region cannot be mapped read-only "
                                    f"({SyscallError(exc.filename or 'mmap', exc)})") from exc
            raise SyscallError(exc.filename or "mmap", exc) from exc
        try:
            header = HEADER.unpack_from(peer, 0)  # copied once
            if header != (MAGIC, RING_VERSION, SLOT_BYTES, slots, release_slots):
                raise ProtocolError(f"ring: the region's header (magic, version, slot_bytes, slots, release_slots) "
                                    f"= {header} is not the message's")
            peer_wake = open_wake(wake)  # checked, and a duplicate (close-on-exec) owned from now on
        except BaseException:
            peer.close()
            raise
        held = self._held
        try:  # (the cursors made before anything is kept: a failure leaves this object as it was)
            # (A plain function, not a bound method: no cycle through this object, whose collection closes it.)
            forked = functools.partial(ForkedResourceError, "a channel's shared-memory ring", self._owner)
            reader = _atomic.SlotReader(peer, held.mine, slots, _LAYOUT, ORDERINGS, ProtocolError,
                                        InvalidArgumentError, forked)
            try:
                writer = _atomic.SlotWriter(held.mine, peer, self.slots, _LAYOUT, ProtocolError, forked,
                                            peer_wake.fileno(), _wake_failed)
            except BaseException:
                reader.close()
                raise
        except BaseException:
            peer_wake.close()
            peer.close()
            raise
        held.cursors += (reader, writer)
        held.peer = peer
        held.socks.append(peer_wake)
        self._peer_wake = peer_wake
        self._peer_q = memoryview(peer).cast("Q")
        held.views.append(self._peer_q)
        self._reader, self._writer = reader, writer
        # Load-bearing: a consumer's look at the ring and its take, and the host lane's publish, are the cursors'
        # C methods, called with no Python frame between (bound over this class's methods, which answer for a ring
        # not attached; close() unbinds them).
        self.peek_sock_seq, self.spin_peek, self.take_fields = reader.peek, reader.spin_peek, reader.take
        self.push_host = writer.push_plain
        self._peer = peer
        self._peer_rel_mask = release_slots - 1
        self._peer_release_slots = release_slots
        self._peer_rel_base = (SLOTS_OFFSET + slots * SLOT_BYTES) // 8
        self.attached = True

    def _check_usable(self) -> None:
        if self._owner != _forks.pid:
            raise ForkedResourceError("a channel's shared-memory ring", self._owner)
        if self.closed:
            raise InvalidArgumentError("the shared-memory ring is closed")

    def _forked(self) -> ForkedResourceError:
        return ForkedResourceError("a channel's shared-memory ring", self._owner)

    # --- message ring ---------------------------------------------------------------------------------

    def try_push(self, slot: RingSlot) -> bool:
        """Publish ``slot`` in this end's message ring, and wake the peer if it said it sleeps
        (:meth:`push_repeat` of its fields).

        Returns False, publishing nothing, when the ring is full or no peer region is attached (send it by the
        socket then: its ``sock_seq`` keeps the order).

        Raises:
            InvalidArgumentError: a field out of the slot's range (``sock_seq`` not a u64, ``lease`` outside
                ``[1, 2**53)``, ``layout`` not a u32, an unknown ordering, an event missing, not 64 bytes, or
                given with another ordering than ``"event"``).
            ProtocolError: the peer's ``in_head`` went backwards or past this end's tail.
            SyscallError: ``send`` to the peer's wake socket failed.
            ForkedResourceError: inherited through ``fork()``.
        """
        return self.push_repeat(slot.sock_seq, slot.lease, slot.layout, slot.ordering, slot.event)

    def push_repeat(self, sock_seq: int, lease: int, layout: int, ordering: str, event: bytes | None) -> bool:
        """:meth:`try_push` of the slot with these fields (:class:`RingSlot`'s), with no record made: a sender's
        hot path. Returns and raises as :meth:`try_push`."""
        if self._owner != _forks.pid:
            raise self._forked()
        writer = self._writer
        if writer is None:
            return False
        code = ORDER_CODE.get(ordering)
        if code is None or type(lease) is not int or (event is not None and type(event) is not bytes):
            raise InvalidArgumentError(f"ring: cannot carry {RingSlot(sock_seq, lease, layout, ordering, event)!r}")
        try:
            # (the cursor: the cached peer head, loaded again when it says full; the slot's body, then its seq,
            # release; then the tail and the peer's asleep, seq_cst both, the Dekker step, and the wake-up; every
            # field checked before anything is written)
            return writer.push(sock_seq, lease, layout, code, event)
        except (ValueError, OverflowError, TypeError) as exc:
            raise InvalidArgumentError(f"ring: cannot carry {RingSlot(sock_seq, lease, layout, ordering, event)!r}: "
                                       f"{exc}") from exc

    def push_host(self, sock_seq: int, lease: int, layout: int) -> bool:
        """:meth:`push_repeat` of a repeat with ordering ``"none"`` and no event: the host lane's publish (the
        attached ring's is its cursor's ``push_plain``, bound over this method, which answers False: no peer region
        attached). Returns as :meth:`push_repeat`.

        Raises:
            ValueError, OverflowError: ``lease`` outside ``[1, 2**53)``, ``layout`` not a u32 (nothing written).
            ProtocolError: as :meth:`try_push`.
            SyscallError: the wake-up's ``send`` failed, after the slot went out.
            ForkedResourceError: inherited through ``fork()``.
        """
        if self._owner != _forks.pid:
            raise self._forked()
        return False

    # The peer ring's reads: the methods below answer while no peer region is attached (or after close());
    # attach() binds the attached ring's SlotReader methods over them (peek, spin_peek, take: one C call each,
    # which copy a slot out once, check the copy as Note [the peer's region] says, raise ProtocolError with what
    # was wrong, and refuse a forked child's call with ForkedResourceError).

    def peek_sock_seq(self) -> int | None:
        """``sock_seq`` of the next published slot of the peer's ring (copied out and validated, kept for
        :meth:`take`), or ``None`` when none is published or no peer region is attached.

        Raises:
            ProtocolError: the peer's ``out_tail`` went backwards or more than its ring's length past this end's
                head; the slot's ``seq`` is not the expected one; its ``sock_seq`` goes backwards; its lease,
                ordering or event byte is out of range (Note [the peer's region]).
            ForkedResourceError: inherited through ``fork()``.
        """
        if self._owner != _forks.pid:
            raise self._forked()
        return None

    def spin_peek(self, loads: int) -> int | None:
        """:meth:`peek_sock_seq`, after up to ``loads`` looks at the peer's ``out_tail`` (one C call, a CPU pause
        between two looks) while nothing is published: a spinning consumer's look, which sees a slot within
        nanoseconds of its publication. Raises as :meth:`peek_sock_seq`."""
        return self.peek_sock_seq()

    def take(self) -> RingSlot:
        """The next slot of the peer's ring (as :meth:`peek_sock_seq` checked it); marks it consumed
        (release-stores ``in_head``, which the peer reads for room).

        Raises:
            InvalidArgumentError: no slot is published (call :meth:`peek_sock_seq` first).
            ProtocolError, ForkedResourceError: as :meth:`peek_sock_seq`.
        """
        return RingSlot(*self.take_fields())

    def take_fields(self) -> tuple[int, int, int, str, bytes | None]:
        """:meth:`take`, with the slot's fields as a tuple ``(sock_seq, lease, layout, ordering, event)``: a
        reader's hot path (no record made). Raises as :meth:`take`."""
        if self._owner != _forks.pid:
            raise self._forked()
        raise InvalidArgumentError("ring: take() with no slot published")

    @property
    def _out_tail(self) -> int:
        """Slots this end published."""
        return 0 if self._writer is None else self._writer.tail

    @property
    def _in_head(self) -> int:
        """Slots of the peer's this end took."""
        return 0 if self._reader is None else self._reader.head

    # --- release ring ---------------------------------------------------------------------------------

    def push_releases(self, ids: Sequence[int]) -> list[int]:
        """Append lease ids to this end's release ring, in order, and wake the peer if it said it sleeps and
        wants releases (its ``asleep`` is neither 0 nor :data:`SLEEP_SLOTS`: Note [waking for releases]).

        Returns the ids that did not fit (all of them when no peer region is attached): send those in a
        ``release`` message.

        Raises:
            InvalidArgumentError: an id that is not an int in ``[1, 2**53)`` (nothing of the call published).
            ProtocolError: the peer's ``rel_head`` went backwards or past this end's ``rel_tail``.
            SyscallError: ``send`` to the peer's wake socket failed.
            ForkedResourceError: inherited through ``fork()``.
        """
        if self._owner != _forks.pid:
            raise self._forked()
        peer = self._peer
        if peer is None or not ids:
            return list(ids)
        tail = self._rel_tail
        room = self.release_slots - (tail - self._peer_rel_head)
        if room < len(ids):  # cached head says too little room: load the peer's (acquire)
            head = _load(peer, REL_HEAD)
            if not self._peer_rel_head <= head <= tail:
                raise ProtocolError(f"ring: the peer's rel_head {head} is outside [{self._peer_rel_head}, {tail}]")
            self._peer_rel_head = head
            room = self.release_slots - (tail - head)
        n = min(room, len(ids))
        if n == 0:
            return list(ids)
        q, base, mask = self._mine_q, self._rel_base, self._rel_mask
        for i in range(n):
            lease = ids[i]
            if type(lease) is not int or not 0 < lease < LEASE_LIMIT:
                raise InvalidArgumentError(f"ring: release id {lease!r} is not an int in [1, 2**53)")
            q[base + ((tail + i) & mask)] = lease  # plain stores: the tail's store below publishes them
        self._rel_tail = tail = tail + n
        asleep = _store_load(self._mine, REL_TAIL, tail, peer, ASLEEP)  # seq_cst both: the store before the load
        if asleep and asleep != SLEEP_SLOTS:  # Note [waking for releases]: 2 wants slots only
            self._wake()
        return list(ids[n:])

    def releases_backlogged(self) -> bool:
        """Whether the release ids the peer has published past this end's head fill half its release ring or
        more: one acquire load, unchecked and maybe stale (a hint for when to :meth:`take_releases`, which checks
        them); False when no peer region is attached."""
        peer = self._peer
        return peer is not None and _load(peer, REL_TAIL) - self._rel_head >= self._peer_release_slots >> 1

    def take_releases(self) -> list[int]:
        """The lease ids the peer published since the last call (at most its ``release_slots``), in order,
        each an int in ``[1, 2**53)``; ``[]`` when none or no peer region is attached. Marks them consumed.

        Raises:
            ProtocolError: the peer's ``rel_tail`` went backwards or more than its ring's length past this
                end's head; an id of 0 or from ``2**53`` on.
            ForkedResourceError: inherited through ``fork()``.
        """
        if self._owner != _forks.pid:
            raise self._forked()
        peer = self._peer
        if peer is None:
            return []
        head = self._rel_head
        tail = _load(peer, REL_TAIL)  # acquire: the entries it covers are read after it
        if tail == head:
            return []
        n = tail - head
        if not 0 < n <= self._peer_release_slots:
            raise ProtocolError(f"ring: the peer's rel_tail {tail} is outside ({head}, "
                                f"{head + self._peer_release_slots}]")
        q, base = self._peer_q, self._peer_rel_base
        start = base + (head & self._peer_rel_mask)
        end = start + n
        stop = base + self._peer_release_slots
        assert q is not None
        ids = q[start:end].tolist() if end <= stop else q[start:stop].tolist() + q[base:end - stop + base].tolist()
        if min(ids) < 1 or max(ids) >= LEASE_LIMIT:  # the copy, checked (Note [the peer's region])
            raise ProtocolError(f"ring: a release id outside [1, 2**53) among {ids[:8]}")
        self._rel_head = tail
        _store(self._mine, REL_HEAD, tail)  # release: the entries are copied before the peer may reuse them
        return ids

    # --- sleeping -------------------------------------------------------------------------------------

    def sleep_begin(self, releases: bool = True) -> bool:
        """Say this end is about to sleep (seq_cst store of ``asleep``: :data:`SLEEP_ALL`, or
        :data:`SLEEP_SLOTS` when not ``releases``), then look once more at the peer's tails (seq_cst loads;
        ``rel_tail`` only with ``releases``). Returns True: sleep now, ``poll`` :attr:`wake_fd` with the socket
        (with a timeout; a bounded one without ``releases``: Note [waking for releases]), then call
        :meth:`sleep_end`. Returns False, ``asleep`` cleared: something arrived, do not sleep. (With no peer
        region attached it returns True: nothing can arrive by the ring.)

        Args:
            releases: whether the peer's releases must wake this end (False: only its slots; releases it
                publishes meanwhile wait until this end looks).

        Raises:
            ForkedResourceError: inherited through ``fork()``.
            InvalidArgumentError: after :meth:`close`.
        """
        if self._owner != _forks.pid or self.closed:
            self._check_usable()
        mine = self._mine
        mode = SLEEP_ALL if releases else SLEEP_SLOTS
        _store_seq(mine, ASLEEP, mode)
        self._asleep = mode  # (after the store: want_releases reads it to know a 2 is stored)
        peer = self._peer
        if peer is None:
            return True
        reader = self._reader
        if (reader.pending or _load_seq(peer, OUT_TAIL) != reader.head
                or (releases and _load_seq(peer, REL_TAIL) != self._rel_head)):
            self._asleep = AWAKE
            _store(mine, ASLEEP, AWAKE)
            return False
        return True

    def want_releases(self) -> bool:
        """A thread is about to wait for a release of the peer's: if this end sleeps for slots only
        (:data:`SLEEP_SLOTS`), store :data:`SLEEP_ALL` (seq_cst), so that the peer's next release wakes it;
        then load the peer's ``rel_tail`` (seq_cst). Returns True when releases are waiting (take them with
        :meth:`take_releases`): the peer may have published them without a wake-up. Call it under the lock that
        serialises :meth:`take_releases`, or from the sleeper's thread (between :meth:`sleep_begin` and
        :meth:`sleep_end`: a head it reads stale only makes it say True). Returns False when closed or not
        attached. Note [waking for releases].

        Raises:
            ForkedResourceError: inherited through ``fork()``.
        """
        if self._owner != _forks.pid:
            raise self._forked()
        peer = self._peer
        if peer is None:
            return False
        if self._asleep == SLEEP_SLOTS:
            self._asleep = SLEEP_ALL
            _store_seq(self._mine, ASLEEP, SLEEP_ALL)
        return _load_seq(peer, REL_TAIL) != self._rel_head

    def sleep_end(self, drain: bool = True) -> None:
        """Clear ``asleep`` and, with ``drain``, drain :attr:`wake_fd` (``recv(MSG_DONTWAIT)``). Call it after
        every :meth:`sleep_begin` that returned True, however the sleep ended. Without ``drain`` the wake-ups
        stay on :attr:`wake_fd` for the caller to :meth:`drain` before it next waits (its next ``poll`` finds
        the socket readable).

        Raises:
            SyscallError: ``recv`` on the wake socket failed (other than ``EAGAIN``, or the peer's end gone).
            ForkedResourceError: inherited through ``fork()``.
            InvalidArgumentError: after :meth:`close`.
        """
        if self._owner != _forks.pid or self.closed:
            self._check_usable()
        self._asleep = AWAKE
        _store(self._mine, ASLEEP, AWAKE)
        if drain:
            self.drain()

    def drain(self) -> None:
        """Read the wake-ups waiting on :attr:`wake_fd` (``recv(MSG_DONTWAIT)``, at most :data:`_DRAIN`),
        e.g. after a ``poll`` that found it readable with no :meth:`sleep_begin` before it.

        Raises:
            SyscallError: ``recv`` failed (other than ``EAGAIN``, or the peer's end gone).
        """
        recv = self._wake_sock.recv
        for _ in range(_DRAIN):  # (bounded: a peer that floods the socket cannot keep this end here)
            try:
                recv(16, _DONTWAIT)
            except BlockingIOError:
                return
            except (ConnectionResetError, ConnectionRefusedError):
                return  # the peer's end went (reading the error clears it); its socket's hang-up ends the channel
            except OSError as exc:
                raise SyscallError("recv", exc) from exc

    def _wake(self) -> None:
        try:
            self._peer_wake.send(b"\1", _DONTWAIT)  # Note [the wake fd]: never waits, whatever O_NONBLOCK says
        except BlockingIOError:
            pass  # the peer's socket is full of wake-ups already
        except (ConnectionResetError, ConnectionRefusedError, BrokenPipeError):
            pass  # the peer's end went: its socket's hang-up ends the channel
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:  # (the peer's end went: ECONNREFUSED once, ENOTCONN after)
                return
            raise SyscallError("send", exc) from exc

    # --- the end --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap both regions and close the fds (this end's memfd and wake socketpair, the duplicate of the
        peer's wake socket).
        Idempotent. In a process that inherited this object through ``fork()`` it closes that process's
        copies of the fds and never touches the mappings (Note [ring and fork])."""
        self.closed = True
        self.attached = False
        self._peer = None
        self._reader = self._writer = None
        for name in ("peek_sock_seq", "spin_peek", "take_fields", "push_host"):  # (the class's own answer now)
            self.__dict__.pop(name, None)
        self._finalizer()

    def __enter__(self) -> "Rings":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "attached" if self.attached else "not attached"
        return (f"<Rings {state} slots={self.slots} release_slots={self.release_slots} "
                f"out_tail={self._out_tail} in_head={self._in_head}>")
