"""The shared-memory ring primitive (``channel._ring``) and its C atomics, on real memfds, sockets,
forks and processes.

A "forged peer" is a region this test writes at will: a memfd mapped writable before its seals (as an owner
maps its own), so the test plays a peer that writes anything, at any time, into the memory the ring reads.
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import mmap
import multiprocessing
import os
import random
import select
import socket
import struct
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dmabuf_interop import _atomic, fdpass
from dmabuf_interop.channel import _ring
from dmabuf_interop.channel._ring import (ASLEEP, IN_HEAD, LEASE_LIMIT, MAGIC, ORDERINGS, OUT_TAIL, REL_HEAD,
                                          REL_TAIL, REQUIRED_SEALS, SLEEP_ALL, SLEEP_SLOTS, SLOT_BYTES, SLOTS_OFFSET,
                                          RingSlot, Rings, check_offer, region_bytes)
from dmabuf_interop.errors import ForkedResourceError, InvalidArgumentError, ProtocolError, SyscallError
from dmabuf_interop.fd import open_fds

pytestmark = pytest.mark.ring

EVENT = bytes(range(64))
_SLOT = struct.Struct("<QQQIBB2x64s")
_Q = struct.Struct("<Q")


def _pair(a_slots: int = 256, a_rel: int = 1024, b_slots: int = 256, b_rel: int = 1024) -> tuple[Rings, Rings]:
    a, b = Rings(a_slots, a_rel), Rings(b_slots, b_rel)
    ma, fa = a.offer()
    mb, fb = b.offer()
    a.attach(mb, fb)
    b.attach(ma, fa)
    return a, b


def _drain(rings: Rings) -> list[RingSlot]:
    out = []
    while rings.peek_sock_seq() is not None:
        out.append(rings.take())
    return out


def _check_slot(slot: RingSlot) -> None:
    """What the ring promises of every slot it returns, whatever the peer wrote."""
    assert 0 <= slot.sock_seq < 1 << 64
    assert 1 <= slot.lease < LEASE_LIMIT
    assert 0 <= slot.layout < 1 << 32
    assert slot.ordering in ORDERINGS
    if slot.ordering == "event":
        assert isinstance(slot.event, bytes) and len(slot.event) == 64
    else:
        assert slot.event is None


class ForgedPeer:
    """A peer's region written by this test: mapped read-write before the seals, so writable after them
    (and, being a Python mmap without MADV_DONTFORK, in a forked child too)."""

    def __init__(self, slots: int = 4, release_slots: int = 8, *, seals: int = REQUIRED_SEALS | fcntl.F_SEAL_SEAL,
                 size: int | None = None, header: tuple | None = None, wake: int | None = None) -> None:
        self.slots, self.release_slots = slots, release_slots
        self.nbytes = region_bytes(slots, release_slots)
        self.fd = os.memfd_create("forged-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size if size is not None else self.nbytes)
        self.map = mmap.mmap(self.fd, size if size is not None else self.nbytes)
        struct.pack_into("<8sIIII", self.map, 0, *(header or (MAGIC, 1, SLOT_BYTES, slots, release_slots)))
        if seals:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
        # The wake socket the victim gets (one end of a datagram socketpair; this test keeps the other).
        self.pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.wake = wake if wake is not None else self.pair[1].fileno()
        self.msg = {"kind": "ring", "version": 1, "bytes": self.nbytes, "slots": slots,
                    "release_slots": release_slots}
        self.fds = [self.fd, self.wake]

    def counter(self, off: int, value: int) -> None:
        _Q.pack_into(self.map, off, value)

    def slot(self, index: int, seq: int | None = None, sock_seq: int = 0, lease: int = 1, layout: int = 1,
             ordering: int = 0, has_event: int | None = None, event: bytes = b"") -> None:
        has_event = (ordering == 1) if has_event is None else has_event
        event = event or (EVENT if has_event else b"")
        _SLOT.pack_into(self.map, SLOTS_OFFSET + (index % self.slots) * SLOT_BYTES,
                        index + 1 if seq is None else seq, sock_seq, lease, layout, ordering, has_event, event)

    def release(self, index: int, lease: int) -> None:
        _Q.pack_into(self.map, SLOTS_OFFSET + self.slots * SLOT_BYTES + (index % self.release_slots) * 8, lease)

    def reader(self) -> Rings:
        r = Rings(4, 8)
        r.attach(self.msg, self.fds)
        return r

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)
        for sock in self.pair:
            sock.close()


@pytest.fixture
def forged():
    made: list[ForgedPeer] = []

    def make(*args, **kw) -> ForgedPeer:
        made.append(ForgedPeer(*args, **kw))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _readable(fd: int, timeout: float = 0.0) -> bool:
    return bool(select.select([fd], [], [], timeout)[0])


# --- the C extension -------------------------------------------------------------------------------------

def test_the_ring_cursors_hold_their_regions_until_closed_and_check_what_they_are_given():
    """A SlotReader and a SlotWriter (what an attached Rings reads and publishes through) hold a buffer of each
    region while open, so neither mapping can be unmapped under them; closed, they refuse every call. A ring
    that does not fit its region, or a field out of a slot's range, is refused before anything is written."""
    a, b = _pair(4, 8, 4, 8)
    try:
        assert b.spin_peek(1000) is None  # nothing published: a bounded spin, then None
        assert a.push_host(0, 7, 3) and b.spin_peek(1000) == 0
        assert b.take_fields() == (0, 7, 3, "none", None)
        writer, reader = a._writer, b._reader
        assert writer.tail == 1 and reader.head == 1 and reader.last_sock_seq == 0 and not reader.pending
        for bad in ((0, 0, 3), (0, LEASE_LIMIT, 3)):
            with pytest.raises(ValueError):
                a.push_host(*bad)
        with pytest.raises(OverflowError):
            a.push_host(0, 1, 2**32)
        with pytest.raises(OverflowError):
            a.push_host(-1, 1, 1)
        assert writer.tail == 1  # (refused before anything was written)
        with pytest.raises(BufferError):
            a._held.mine.close()  # the writer, and the peer's reader, hold buffers of it
        forked = lambda: ForkedResourceError("test", 1)  # noqa: E731
        big = 2**63 - 8  # (an offset whose end overflows a signed size)
        for slots, layout in ((1 << 20, _ring._LAYOUT), (3, _ring._LAYOUT), (4, (4096, 8, 64, 192, 320)),
                              (4, (4096, 128, 64, 192, 1 << 30)), (4, (4096, 128, big, 192, 320)),
                              (4, (4096, 128, 64, 192, big)), (4, (big, 128, 64, 192, 320)), (4, (4096, 128, -8, 192, 320))):
            with pytest.raises((ValueError, OverflowError)):
                _atomic.SlotReader(b._peer, b._mine, slots, layout, ORDERINGS, ProtocolError, InvalidArgumentError,
                                   forked)
            with pytest.raises((ValueError, OverflowError)):
                _atomic.SlotWriter(a._mine, a._peer, slots, layout, ProtocolError, forked, 0, lambda e: OSError(e))
        with pytest.raises((TypeError, ValueError)):  # (error classes that are not exception classes)
            _atomic.SlotReader(b._peer, b._mine, 4, _ring._LAYOUT, ORDERINGS, ProtocolError, "no", forked)
        with pytest.raises((TypeError, ValueError)):
            _atomic.SlotWriter(a._mine, a._peer, 4, _ring._LAYOUT, len, forked, 0, lambda e: OSError(e))
        extra = _atomic.SlotReader(b._peer, b._mine, 4, _ring._LAYOUT, ORDERINGS, ProtocolError,
                                   InvalidArgumentError, forked)
        extra.close()
        extra.close()  # (idempotent)
        for call in (extra.peek, extra.take, lambda: extra.spin_peek(1)):
            with pytest.raises(ValueError, match="closed"):
                call()
    finally:
        a.close()
        b.close()
    assert a._held.mine is None and b._held.peer is None  # unmapped once the cursors let go
    assert a.peek_sock_seq() is None and not a.push_host(0, 1, 1)  # closed: the class's own answers


def test_a_wake_up_to_a_peer_whose_wake_socket_went_is_no_error():
    """The peer's end of its wake socket closed (it died): the first send finds ECONNREFUSED, every later one
    ENOTCONN; neither is this end's failure (the channel socket's hang-up ends the connection), so a publish to a
    sleeping peer still succeeds, as often as it is tried."""
    a, b = _pair(4, 8, 4, 8)
    try:
        b._wake_sock.close()  # (the end b polls, which a's duplicate of b's other end sends to)
        b._for_peer.close()
        _Q.pack_into(memoryview(b._held.mine), ASLEEP, SLEEP_ALL)  # (b says it sleeps: every publish wakes it)
        writer = a._writer
        for i in range(4):
            assert writer.push_plain(0, i + 1, 1)
            b.take_fields()
        a._wake()
        a._wake()  # (the release ring's wake-up, from Python: the same errnos are no error)
    finally:
        a.close()
        b.close()


def test_atomic_checks_bounds_alignment_and_writability():
    from dmabuf_interop import _atomic

    fd = _memfd(8192)
    buf = _atomic.Mapping(fd, 8192, True)
    os.close(fd)  # the mapping holds no fd, and outlives it
    try:
        _atomic.store(buf, 8, 2**64 - 1)
        assert _atomic.load(buf, 8) == 2**64 - 1 == _atomic.load_seq(buf, 8)
        _atomic.store_seq(buf, 8192 - 8, 7)
        assert _atomic.load(buf, 8192 - 8) == 7
        for off in (-8, 8192 - 4, 8192, 1 << 40):
            with pytest.raises(ValueError, match="outside"):
                _atomic.load(buf, off)
        for off in (1, 4, 12):
            with pytest.raises(ValueError, match="aligned"):
                _atomic.store(buf, off, 1)
        with pytest.raises(TypeError):
            _atomic.store(bytes(64), 0, 1)  # read-only
        with pytest.raises(OverflowError):
            _atomic.store(buf, 0, -1)
        with pytest.raises(OverflowError):
            _atomic.store(buf, 0, 2**64)
        with pytest.raises(TypeError):
            _atomic.load(buf)
        # publish: the body first, the seq last; a read-only source is fine, a read-only target is not.
        _atomic.publish(buf, 128, (5).to_bytes(8, "little") + b"x" * 24)
        assert bytes(memoryview(buf)[128:160]) == (5).to_bytes(8, "little") + b"x" * 24
        with pytest.raises(ValueError):
            _atomic.publish(buf, 128, b"short")
        with pytest.raises(ValueError, match="outside"):
            _atomic.publish(buf, 8192 - 16, bytes(24))
        assert _atomic.load(bytes(16), 8) == 0  # loads take read-only buffers
        # store_load: the store, then the peer's word (a read-only peer is fine); a bad offset on either side
        # does neither.
        peer = (11).to_bytes(8, "little") + (22).to_bytes(8, "little")
        assert _atomic.store_load(buf, 16, 9, peer, 8) == 22 and _atomic.load(buf, 16) == 9
        with pytest.raises(ValueError, match="outside"):
            _atomic.store_load(buf, 16, 10, peer, 16)
        with pytest.raises(ValueError, match="aligned"):
            _atomic.store_load(buf, 20, 10, peer, 0)
        with pytest.raises(TypeError):
            _atomic.store_load(peer, 0, 10, buf, 0)  # the store's buffer must be writable
        assert _atomic.load(buf, 16) == 9
        view = memoryview(buf)
        with pytest.raises(BufferError):
            buf.close()
        view.release()
    finally:
        buf.close()
    buf.close()  # idempotent
    assert buf.closed and len(buf) == 0
    with pytest.raises(ValueError, match="closed"):
        _atomic.load(buf, 0)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sock_seq=st.integers(0, 2**64 - 1), lease=st.integers(1, LEASE_LIMIT - 1), layout=st.integers(0, 2**32 - 1),
       code=st.integers(0, len(ORDERINGS) - 1), event=st.binary(min_size=64, max_size=64))
def test_the_cursors_code_slots_as_the_slot_format_does(sock_seq, lease, layout, code, event):
    """The ring's C coding of a slot (SlotWriter.push, SlotReader.take) is the spec's struct (SLOT), both ways;
    a copy that fails a check is refused with what was wrong; a field out of range is refused before anything is
    written."""
    from dmabuf_interop.channel._ring_region import EVENT_CODE, SLOT

    assert _atomic.SLOT_FORMAT == SLOT.format and SLOT.size <= SLOT_BYTES
    has = code == EVENT_CODE
    nbytes = region_bytes(4, 8)
    mine, theirs = bytearray(nbytes), bytearray(nbytes)  # this end's region; the peer's (its in_head, asleep)
    _Q.pack_into(theirs, ASLEEP, 0)
    forked = lambda: ForkedResourceError("test", 1)  # noqa: E731
    w = _atomic.SlotWriter(mine, theirs, 4, _ring._LAYOUT, ProtocolError, forked, 0, lambda e: OSError(e))
    assert w.push(sock_seq, lease, layout, code, event if has else None) and w.tail == 1
    assert _Q.unpack_from(mine, OUT_TAIL)[0] == 1
    assert SLOT.unpack_from(mine, SLOTS_OFFSET) == (1, sock_seq, lease, layout, code, has, event if has else bytes(64))

    def reader(region):
        return _atomic.SlotReader(bytes(region), bytearray(nbytes), 4, _ring._LAYOUT, ORDERINGS, ProtocolError,
                                  InvalidArgumentError, forked)

    assert reader(mine).take() == (sock_seq, lease, layout, ORDERINGS[code], event if has else None)
    forged = bytearray(mine)
    forged[SLOTS_OFFSET + 28] = code ^ EVENT_CODE if code != 2 else 3  # ordering and has_event disagree, or no code
    with pytest.raises(ProtocolError, match="has ordering"):
        reader(forged).peek()
    forged = bytearray(mine)
    _Q.pack_into(forged, SLOTS_OFFSET, 2)
    with pytest.raises(ProtocolError, match="has seq 2, not 1"):
        reader(forged).peek()
    _Q.pack_into(forged, OUT_TAIL, 5)
    with pytest.raises(ProtocolError, match="out_tail 5 is outside"):
        reader(forged).peek()
    # Out of range: refused before anything is written.
    for bad in ((0, layout, code), (LEASE_LIMIT, layout, code), (lease, layout, 3)):
        with pytest.raises(ValueError):
            w.push(sock_seq, bad[0], bad[1], bad[2], event if has else None)
    with pytest.raises(ValueError):
        w.push(sock_seq, lease, layout, code, None if has else event)
    with pytest.raises(OverflowError):
        w.push(sock_seq, lease, 2**32, code, event if has else None)
    assert w.tail == 1 and not any(mine[SLOTS_OFFSET + SLOT_BYTES:SLOTS_OFFSET + 2 * SLOT_BYTES])
    w.close()


def test_atomic_address_is_numpys_data_pointer():
    import numpy as np

    from dmabuf_interop import _atomic

    a = np.arange(120, dtype=np.float32)
    for view in (a, a[7:], a[::-3], a.reshape(10, 12).T, a.reshape(10, 12)[2:, 3:], a[:0], np.zeros((3, 0)),
                 a.view(np.uint8)[1:], np.frombuffer(bytes(16), np.uint8)):
        assert _atomic.address(view) == view.ctypes.data
    with pytest.raises(TypeError):
        _atomic.address(5)


def test_atomic_span_holds_its_owners_while_any_view_lives_and_a_read_only_one_refuses_writes():
    import weakref

    import numpy as np

    from dmabuf_interop import _atomic

    class Owner:
        pass

    backing = np.arange(64, dtype=np.uint8)
    owner = Owner()
    gone = weakref.ref(owner)
    span = _atomic.span(backing.ctypes.data, 64, (owner, backing))
    assert len(span) == 64 and span.keep[0] is owner
    arr = np.ndarray((8, 8), np.dtype(np.uint8), span, 0, (8, 1))
    assert arr.base is span and arr.flags.writeable
    assert arr[1].tolist() == list(range(8, 16))
    arr[0, 0] = 99
    assert backing[0] == 99  # the same bytes, no copy
    view = arr[2:4, ::2]
    del owner, span, arr
    gc.collect()
    assert gone() is not None  # a view of the array still holds the span, so its owners
    del view
    gc.collect()
    assert gone() is None
    with pytest.raises(ValueError):
        np.ndarray((9, 8), np.uint8, _atomic.span(backing.ctypes.data, 64, None), 0, (8, 1))  # past its bytes
    with pytest.raises(ValueError):
        _atomic.span(0, 8, None)
    with pytest.raises(ValueError):
        _atomic.span(backing.ctypes.data, -1, None)
    with pytest.raises(TypeError):
        _atomic.span(backing.ctypes.data, 8)
    frozen = np.ndarray((8,), np.uint8, _atomic.span(backing.ctypes.data, 8, None, True), 0, (1,))
    assert not frozen.flags.writeable and frozen.base.readonly and frozen[1] == 1
    with pytest.raises(ValueError):
        frozen[0] = 5  # a read-only span exports no writable buffer
    with pytest.raises(TypeError):
        memoryview(frozen.base)[0:1] = b"x"
    looped = Owner()
    looped.span = _atomic.span(backing.ctypes.data, 8, looped)  # a cycle through keep is collected
    probe = weakref.ref(looped)
    del looped
    gc.collect()
    assert probe() is None


def _memfd(size: int) -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def test_atomic_mapping_read_only_and_errors():
    from dmabuf_interop import _atomic

    fd = _memfd(4096)
    try:
        rw = _atomic.Mapping(fd, 4096, writable=True)
        ro = _atomic.Mapping(fd, 4096)
        assert ro.readonly and not rw.readonly
        _atomic.store(rw, 64, 42)
        assert _atomic.load(ro, 64) == 42  # the same shared pages
        with pytest.raises(TypeError):
            _atomic.store(ro, 64, 1)
        with pytest.raises(TypeError):
            memoryview(ro)[0:1] = b"x"
        rw.close()
        ro.close()
        with pytest.raises(OSError) as info:
            _atomic.Mapping(-1, 4096)
        assert info.value.filename == "mmap"
        with pytest.raises(ValueError):
            _atomic.Mapping(fd, 0)
    finally:
        os.close(fd)


# --- availability ----------------------------------------------------------------------------------------

def test_without_the_extension_the_ring_is_not_offered_and_says_why():
    """In a process where ``dmabuf_interop._atomic`` cannot be imported (as after an install without a
    compiler), ring_unavailable() gives the reason and Rings() raises NotSupportedError."""
    code = """if True:
        import sys
        class Hide:
            def find_spec(self, name, path=None, target=None):
                if name == "dmabuf_interop._atomic":
                    raise ImportError("hidden by the test")
        sys.meta_path.insert(0, Hide())
        from dmabuf_interop.channel._ring import Rings, ring_unavailable
        from dmabuf_interop.errors import NotSupportedError
        why = ring_unavailable()
        assert why and "not built" in why and "hidden by the test" in why, why
        try:
            Rings()
        except NotSupportedError as exc:
            assert str(exc) == why
        else:
            raise AssertionError("Rings() without the extension")
        print("ok")
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# --- round trips -----------------------------------------------------------------------------------------

def test_round_trip_in_one_process_with_rings_of_different_lengths():
    a, b = _pair(8, 16, 2, 4)
    try:
        sent = [RingSlot(0, 1, 7, "sync", None), RingSlot(0, 2, 8, "event", EVENT), RingSlot(3, 3, 2**32 - 1, "none",
                                                                                             None)]
        for s in sent:
            assert a.try_push(s)
        assert b.peek_sock_seq() == 0 and b.peek_sock_seq() == 0  # peeking twice takes nothing
        assert [b.take() for _ in sent] == sent
        assert b.peek_sock_seq() is None
        with pytest.raises(InvalidArgumentError):
            b.take()
        # b's ring has 2 slots, a's release ring 16, b's 4.
        assert b.try_push(RingSlot(1, 10, 1, "sync", None)) and b.try_push(RingSlot(1, 11, 1, "sync", None))
        assert not b.try_push(RingSlot(1, 12, 1, "sync", None))
        assert [s.lease for s in _drain(a)] == [10, 11]
        assert a.push_releases([10, 11]) == []
        assert b.take_releases() == [10, 11] and b.take_releases() == []
        assert b.push_releases([1, 2, 3, 4, 5, 6]) == [5, 6]
        assert a.take_releases() == [1, 2, 3, 4]
        assert b.push_releases([5, 6, 7]) == [] and a.take_releases() == [5, 6, 7]  # wrapped around
    finally:
        a.close()
        b.close()


def test_full_message_ring_refuses_at_exactly_slots_and_has_room_after_take():
    a, b = _pair(4, 8, 4, 8)
    try:
        for i in range(4):
            assert a.try_push(RingSlot(i, i + 1, 1, "sync", None))
        assert not a.try_push(RingSlot(4, 5, 1, "sync", None))
        assert not a.try_push(RingSlot(4, 5, 1, "sync", None))
        assert b.peek_sock_seq() == 0
        assert not a.try_push(RingSlot(4, 5, 1, "sync", None))  # peeked is not taken
        assert b.take().lease == 1
        assert a.try_push(RingSlot(4, 5, 1, "sync", None))
        assert not a.try_push(RingSlot(5, 6, 1, "sync", None))
        assert [s.lease for s in _drain(b)] == [2, 3, 4, 5]
        for round_ in range(50):  # many laps
            for i in range(3):
                assert a.try_push(RingSlot(10 + round_, 100 + i, 1, "sync", None))
            assert [s.lease for s in _drain(b)] == [100, 101, 102]
    finally:
        a.close()
        b.close()


def test_full_release_ring():
    a, b = _pair(4, 8, 4, 8)
    try:
        assert a.push_releases(list(range(1, 12))) == [9, 10, 11]
        assert a.push_releases([12]) == [12]
        assert b.take_releases() == list(range(1, 9))
        assert a.push_releases(list(range(20, 28))) == []
        assert b.take_releases() == list(range(20, 28))
    finally:
        a.close()
        b.close()


def test_not_attached_and_closed_fall_back_to_the_socket():
    a = Rings(4, 8)
    try:
        assert not a.attached
        assert a.try_push(RingSlot(0, 1, 1, "sync", None)) is False
        assert a.push_releases([1, 2]) == [1, 2]
        assert a.peek_sock_seq() is None and a.take_releases() == []
        assert a.sleep_begin() is True
        a.sleep_end()
    finally:
        a.close()
    a.close()
    assert a.closed and a.try_push(RingSlot(0, 1, 1, "sync", None)) is False and a.push_releases([3]) == [3]
    for call in (a.sleep_begin, a.sleep_end, a.offer):
        with pytest.raises(InvalidArgumentError):
            call()


def test_our_own_bad_slots_and_ids_are_refused_before_anything_is_published():
    a, b = _pair(4, 8, 4, 8)
    try:
        for bad in (RingSlot(0, 0, 1, "sync", None), RingSlot(0, LEASE_LIMIT, 1, "sync", None),
                    RingSlot(-1, 1, 1, "sync", None), RingSlot(2**64, 1, 1, "sync", None),
                    RingSlot(0, 1, 2**32, "sync", None), RingSlot(0, 1, 1, "sometimes", None),
                    RingSlot(0, 1, 1, "event", None), RingSlot(0, 1, 1, "event", b"x" * 63),
                    RingSlot(0, 1, 1, "sync", EVENT)):
            with pytest.raises(InvalidArgumentError):
                a.try_push(bad)
        for bad_ids in ([0], [LEASE_LIMIT], [1, "2"], [True], [1.0]):
            with pytest.raises(InvalidArgumentError):
                a.push_releases(bad_ids)
        assert b.peek_sock_seq() is None and b.take_releases() == []
        with pytest.raises(InvalidArgumentError):
            Rings(3)
        with pytest.raises(InvalidArgumentError):
            Rings(4, 0)
        with pytest.raises(InvalidArgumentError):
            Rings(1 << 17)
    finally:
        a.close()
        b.close()


# --- across processes ------------------------------------------------------------------------------------

def _exchange(sock: socket.socket, rings: Rings) -> None:
    """Each end sends its ring message with its two fds, and attaches the other's."""
    msg, fds = rings.offer()
    fdpass.send_message(sock, msg, fds, timeout=30)
    peer, peer_fds = fdpass.recv_message(sock, timeout=30, max_fds=2)
    try:
        rings.attach(peer, peer_fds)
    finally:
        fdpass.close_fds(peer_fds)


def _spawned_peer(sock: socket.socket, n: int) -> None:
    """The other end, in a spawned process: takes n slots, returns their leases as releases, then pushes n
    slots of its own."""
    with Rings(8, 16) as rings:
        _exchange(sock, rings)
        got = 0
        deadline = time.monotonic() + 60
        while got < n and time.monotonic() < deadline:
            if rings.peek_sock_seq() is None:
                if rings.sleep_begin():
                    select.select([rings.wake_fd], [], [], 1.0)
                    rings.sleep_end()
                continue
            slot = rings.take()
            assert slot.sock_seq == got and slot.lease == got + 1, slot
            pending = [slot.lease]
            while pending and time.monotonic() < deadline:
                pending = rings.push_releases(pending)
            got += 1
        for i in range(n):
            while not rings.try_push(RingSlot(i, 1000 + i, 5, "event", EVENT)) and time.monotonic() < deadline:
                time.sleep(0.0001)
        fdpass.send_message(sock, {"kind": "done", "got": got}, timeout=30)
        fdpass.recv_message(sock, timeout=30)  # the parent has read everything: the region may go


def test_round_trip_across_a_spawned_process_with_fds_by_scm_rights():
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    n = 300
    proc = ctx.Process(target=_spawned_peer, args=(theirs, n))
    proc.start()
    theirs.close()
    try:
        with Rings(8, 16) as rings:
            _exchange(mine, rings)
            released: list[int] = []
            deadline = time.monotonic() + 60
            for i in range(n):
                while not rings.try_push(RingSlot(i, i + 1, 3, "sync", None)):
                    assert time.monotonic() < deadline and proc.is_alive(), proc.exitcode
                    released += rings.take_releases()
                    time.sleep(0.0001)
                released += rings.take_releases()
            got: list[RingSlot] = []
            while len(got) < n or len(released) < n:
                assert time.monotonic() < deadline and proc.is_alive(), proc.exitcode
                released += rings.take_releases()
                got += _drain(rings)
                if rings.sleep_begin():
                    select.select([rings.wake_fd], [], [], 1.0)
                    rings.sleep_end()
            done, _ = fdpass.recv_message(mine, timeout=60)
            assert done == {"kind": "done", "got": n}
            assert released == list(range(1, n + 1))
            assert [(s.sock_seq, s.lease, s.layout, s.ordering, s.event) for s in got] == [
                (i, 1000 + i, 5, "event", EVENT) for i in range(n)]
            fdpass.send_message(mine, {"kind": "bye"}, timeout=30)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        mine.close()
        if proc.is_alive():
            proc.kill()
            proc.join()


def _pause(rnd: random.Random) -> None:
    if rnd.random() < 0.3:
        time.sleep(rnd.random() * 100e-6)


def _stress_child(sock: socket.socket, n: int, seed: int) -> int:
    """Producer: pushes n slots with random short pauses, waits for every lease back through the release
    ring (sleeping on its wake socket). Returns the number of waits that timed out."""
    rnd = random.Random(seed)
    timeouts = 0
    deadline = time.monotonic() + 120
    with Rings(16, 16) as rings:
        _exchange(sock, rings)
        back = 0
        for i in range(n):
            _pause(rnd)
            while not rings.try_push(RingSlot(i, i + 1, 1, "sync", None)):
                assert time.monotonic() < deadline
                back += len(rings.take_releases())
                time.sleep(20e-6)
            back += len(rings.take_releases())
            # Half the time (and at the end) wait for every lease back, asleep: with nothing else to wake
            # either side, a lost wake-up on either would stall the pair until the timeout.
            while back < (i + 1 if rnd.random() < 0.5 or i == n - 1 else 0):
                ids = rings.take_releases()
                if ids:
                    back += len(ids)
                    continue
                _pause(rnd)  # found nothing: the peer may publish before sleep_begin (it must see that)
                if rings.sleep_begin():
                    if not select.select([rings.wake_fd], [], [], 5.0)[0]:
                        timeouts += 1
                        assert timeouts < 3 and time.monotonic() < deadline
                    rings.sleep_end()
        fdpass.send_message(sock, {"kind": "done", "timeouts": timeouts, "back": back}, timeout=30)
        fdpass.recv_message(sock, timeout=30)
    return timeouts


def test_no_lost_wake_ups_between_two_processes():
    """A producer and a consumer in two processes, random short pauses on both sides; the consumer sleeps
    (sleep_begin / poll / sleep_end) whenever the ring is empty, the producer whenever it waits for the last
    releases. Every slot arrives in order, every release comes back, and no wait runs into its 5 s timeout
    (a lost wake-up would)."""
    n = 4000
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            mine.close()
            code = 0 if _stress_child(theirs, n, 1234) == 0 else 3
        except BaseException as exc:
            print(f"stress child: {exc!r}", file=sys.stderr)
        finally:
            os._exit(code)
    theirs.close()
    rnd = random.Random(99)
    timeouts = sleeps = 0
    try:
        with Rings(16, 16) as rings:
            _exchange(mine, rings)
            expect = 0
            while expect < n:
                if rings.peek_sock_seq() is None:
                    _pause(rnd)  # found nothing: the peer may publish before sleep_begin (it must see that)
                    if rings.sleep_begin():
                        sleeps += 1
                        if not select.select([rings.wake_fd], [], [], 5.0)[0]:
                            timeouts += 1
                            break  # a lost wake-up (or the producer died): fail below
                        rings.sleep_end()
                    continue
                slot = rings.take()
                assert (slot.sock_seq, slot.lease) == (expect, expect + 1)
                expect += 1
                _pause(rnd)
                pending = [slot.lease]
                while pending:  # the producer takes them before each push: at most 16 wait (16 slots)
                    pending = rings.push_releases(pending)
            assert timeouts == 0 and expect == n, (timeouts, expect)
            done, _ = fdpass.recv_message(mine, timeout=60)
            fdpass.send_message(mine, {"kind": "bye"}, timeout=30)
        assert done == {"kind": "done", "timeouts": 0, "back": n}
        assert sleeps > 0  # the consumer did sleep, so the wake path was exercised
    finally:
        mine.close()
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


# --- forged slots and counters ---------------------------------------------------------------------------

def test_forged_slots_are_protocol_errors(forged):
    cases = {
        "wrong seq": lambda p: (p.slot(0, seq=7), p.counter(OUT_TAIL, 1)),
        "stale seq": lambda p: (p.slot(0, seq=0), p.counter(OUT_TAIL, 1)),
        "tail past head+slots": lambda p: ([p.slot(i) for i in range(4)], p.counter(OUT_TAIL, 5)),
        "huge tail": lambda p: (p.slot(0), p.counter(OUT_TAIL, 2**64 - 1)),
        "ordering 3": lambda p: (p.slot(0, ordering=3, has_event=0), p.counter(OUT_TAIL, 1)),
        "event without has_event": lambda p: (p.slot(0, ordering=1, has_event=0), p.counter(OUT_TAIL, 1)),
        "has_event with sync": lambda p: (p.slot(0, ordering=0, has_event=1), p.counter(OUT_TAIL, 1)),
        "has_event 2": lambda p: (p.slot(0, ordering=1, has_event=2), p.counter(OUT_TAIL, 1)),
        "lease 0": lambda p: (p.slot(0, lease=0), p.counter(OUT_TAIL, 1)),
        "lease 2**53": lambda p: (p.slot(0, lease=LEASE_LIMIT), p.counter(OUT_TAIL, 1)),
        "sock_seq backwards": lambda p: (p.slot(0, sock_seq=5), p.slot(1, sock_seq=4), p.counter(OUT_TAIL, 2)),
    }
    for name, forge in cases.items():
        peer = forged()
        forge(peer)
        with peer.reader() as r:
            with pytest.raises(ProtocolError, match="ring"):
                while True:  # a legitimate first slot may come before the forged one
                    assert r.peek_sock_seq() is not None, name
                    r.take()


def test_a_tail_going_backwards_is_a_protocol_error(forged):
    peer = forged()
    for i in range(3):
        peer.slot(i, sock_seq=i, lease=i + 1)
    peer.counter(OUT_TAIL, 3)
    with peer.reader() as r:
        assert [s.lease for s in (r.take(), r.take(), r.take())] == [1, 2, 3]
        peer.counter(OUT_TAIL, 2)
        with pytest.raises(ProtocolError, match="out_tail 2"):
            r.peek_sock_seq()


def test_a_slot_rewritten_after_publication_is_caught_by_its_seq(forged):
    peer = forged()
    peer.slot(0, lease=5)
    peer.counter(OUT_TAIL, 1)
    with peer.reader() as r:
        peer.slot(0, seq=5, lease=6)  # the peer reuses slot 0 as if it were lap 2
        with pytest.raises(ProtocolError, match="seq 5"):
            r.peek_sock_seq()


def test_forged_heads_and_release_tails_are_protocol_errors(forged):
    # in_head past this end's tail, and going backwards (seen when the ring is full).
    peer = forged()
    with peer.reader() as r:
        for i in range(4):
            assert r.try_push(RingSlot(i, i + 1, 1, "sync", None))
        peer.counter(IN_HEAD, 9)
        with pytest.raises(ProtocolError, match="in_head 9"):
            r.try_push(RingSlot(4, 5, 1, "sync", None))
        peer.counter(IN_HEAD, 2)
        assert r.try_push(RingSlot(4, 5, 1, "sync", None)) and r.try_push(RingSlot(5, 6, 1, "sync", None))
        peer.counter(IN_HEAD, 1)
        with pytest.raises(ProtocolError, match="in_head 1"):
            r.try_push(RingSlot(6, 7, 1, "sync", None))
    # rel_head past rel_tail, and backwards.
    peer = forged()
    with peer.reader() as r:
        assert r.push_releases(list(range(1, 9))) == []
        peer.counter(REL_HEAD, 20)
        with pytest.raises(ProtocolError, match="rel_head 20"):
            r.push_releases([9])
        peer.counter(REL_HEAD, 4)
        assert r.push_releases([9, 10, 11, 12]) == []
        peer.counter(REL_HEAD, 3)
        with pytest.raises(ProtocolError, match="rel_head 3"):
            r.push_releases([13])
    # release ring: a tail too far, ids out of range, a tail going backwards.
    for forge, match in ((lambda p: p.counter(REL_TAIL, 9), "rel_tail 9"),
                         (lambda p: (p.release(0, 0), p.counter(REL_TAIL, 1)), "release id"),
                         (lambda p: (p.release(0, 3), p.release(1, LEASE_LIMIT), p.counter(REL_TAIL, 2)), "release id")):
        peer = forged()
        forge(peer)
        with peer.reader() as r:
            with pytest.raises(ProtocolError, match=match):
                r.take_releases()
    peer = forged()
    for i in range(3):
        peer.release(i, 40 + i)
    peer.counter(REL_TAIL, 3)
    with peer.reader() as r:
        assert r.take_releases() == [40, 41, 42]
        peer.counter(REL_TAIL, 2)
        with pytest.raises(ProtocolError, match="rel_tail 2"):
            r.take_releases()


def _garbage_writer(fd_map: mmap.mmap, stop_fd: int, seed: int) -> None:  # pragma: no cover - forked child
    """Rewrite slot 0 as fast as possible, alternating two valid slots with different fields, until stop_fd
    is readable."""
    a = _SLOT.pack(1, 1, 10, 1, 0, 0, b"")
    b = _SLOT.pack(1, 2**40, 20, 2, 1, 1, EVENT)
    n = 0
    while True:
        fd_map[SLOTS_OFFSET:SLOTS_OFFSET + len(a)] = a if n & 1 else b
        n += 1
        if n % 1024 == 0 and _readable(stop_fd):
            return


def test_a_torn_slot_is_validated_as_copied_never_half_trusted(forged):
    """Another process rewrites the slot while it is read. Every read is a copy: either refused (the copy mixes
    an ordering and a has_event that disagree) or a slot whose every field passed the checks; the RingSlot
    never changes afterwards, however the memory does."""
    peer = forged()
    peer.slot(0, sock_seq=1, lease=10)
    peer.counter(OUT_TAIL, 1)
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _garbage_writer(peer.map, stop_r, 1)
        finally:
            os._exit(0)
    outcomes = {"refused": 0}
    kept = []
    try:
        with peer.reader() as r:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                # Slot 0 read again, as if first seen (the tail says it is published): a fresh cursor of the ring's
                # kind over the same regions, whose take() gives the peeked copy.
                cursor = _atomic.SlotReader(r._peer, r._mine, peer.slots, _ring._LAYOUT, ORDERINGS, ProtocolError,
                                            InvalidArgumentError, lambda: None)
                try:
                    cursor.peek()
                    slot = RingSlot(*cursor.take())  # (the copy peek() made and checked)
                except ProtocolError:
                    outcomes["refused"] += 1
                    continue
                finally:
                    cursor.close()
                _check_slot(slot)
                key = (slot.sock_seq, slot.lease, slot.layout, slot.ordering)
                outcomes[key] = outcomes.get(key, 0) + 1
                if len(kept) < 1000:
                    kept.append((slot, (slot.sock_seq, slot.lease, slot.layout, slot.ordering, slot.event)))
    finally:
        os.write(stop_w, b"x")
        os.waitpid(pid, 0)
        os.close(stop_r)
        os.close(stop_w)
    assert sum(outcomes.values()) > 1000
    for slot, seen in kept:  # copies: unchanged though the slot was rewritten thousands of times since
        assert (slot.sock_seq, slot.lease, slot.layout, slot.ordering, slot.event) == seen
    # Both writes were seen whole at least once (the fields mix only in copies that still passed the checks).
    assert any(k[1] == 10 for k in outcomes if k != "refused") and any(k[1] == 20 for k in outcomes if k != "refused")


_u64 = st.one_of(st.integers(0, 20), st.integers(0, 2**64 - 1))


@st.composite
def _region(draw):
    slots = [(draw(st.one_of(st.just(i + 1), _u64)), draw(_u64), draw(st.one_of(st.integers(1, 5), _u64)),
              draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 255)), draw(st.integers(0, 255)),
              draw(st.binary(min_size=0, max_size=64)))
             for i in range(4)]
    releases = [draw(st.one_of(st.integers(1, 100), _u64)) for _ in range(8)]
    counters = {off: draw(_u64) for off in (OUT_TAIL, REL_TAIL, IN_HEAD, REL_HEAD, ASLEEP)}
    junk = draw(st.one_of(st.none(), st.binary(min_size=4096, max_size=4096)))
    return slots, releases, counters, junk


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(region=_region())
def test_garbage_in_the_peer_region_never_crashes_nor_yields_out_of_range_values(region):
    peer = ForgedPeer()
    try:
        _garbage_round(peer, *region)
    finally:
        peer.close()


def _garbage_round(peer: ForgedPeer, slots: list, releases: list, counters: dict, junk: bytes | None) -> None:
    if junk is not None:  # everything after the header, raw
        peer.map[64:SLOTS_OFFSET] = junk[64:]
        peer.map[SLOTS_OFFSET:peer.nbytes] = (junk * 2)[:peer.nbytes - SLOTS_OFFSET]
    else:
        for i, s in enumerate(slots):
            _SLOT.pack_into(peer.map, SLOTS_OFFSET + i * SLOT_BYTES, *s)
        for i, v in enumerate(releases):
            peer.release(i, v)
        for off, v in counters.items():
            peer.counter(off, v)
    with peer.reader() as r:
        for _ in range(6):
            try:
                if r.peek_sock_seq() is None:
                    break
                _check_slot(r.take())
            except ProtocolError:
                break
        try:
            ids = r.take_releases()
            assert len(ids) <= 8 and all(1 <= i < LEASE_LIMIT for i in ids)
        except ProtocolError:
            pass
        for i in range(6):
            try:
                assert r.try_push(RingSlot(i, i + 1, 1, "sync", None)) in (True, False)
            except ProtocolError:
                break
        try:
            left = r.push_releases(list(range(1, 12)))
            assert left == list(range(1, 12))[len(range(1, 12)) - len(left):]
        except ProtocolError:
            pass
        assert r.sleep_begin() in (True, False)
        r.sleep_end()


# --- forged ring messages and fds ------------------------------------------------------------------------

@pytest.mark.parametrize("change", [
    {"kind": "rings"}, {"version": 2}, {"version": True}, {"version": "1"}, {"slots": 3}, {"slots": 0},
    {"slots": 1 << 17}, {"slots": True}, {"release_slots": 6}, {"release_slots": 1 << 21}, {"bytes": 8193},
    {"bytes": 4096}, {"bytes": 8192.0}, {"extra": 1}, None])
def test_forged_ring_messages_are_protocol_errors(change):
    msg = {"kind": "ring", "version": 1, "bytes": region_bytes(4, 8), "slots": 4, "release_slots": 8}
    if change is None:
        del msg["release_slots"]
    else:
        msg.update(change)
    with pytest.raises(ProtocolError, match="ring"):
        check_offer(msg)
    with Rings(4, 8) as r:
        with pytest.raises(ProtocolError):
            r.attach(msg, [0, 1])
        assert not r.attached


def test_forged_fds_are_protocol_errors(forged, tmp_path):
    good = forged()
    assert check_offer(good.msg) == (region_bytes(4, 8), 4, 8)
    r_pipe, w_pipe = os.pipe()
    s1, s2 = socket.socketpair()
    plain = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    os.ftruncate(plain, good.nbytes)
    eventfd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
    unconnected = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    epoll = select.epoll()
    closed = os.dup(plain)
    os.close(closed)
    bad_regions = {
        "a pipe": r_pipe, "a socket": s1.fileno(), "a regular file": plain, "an eventfd": eventfd,
        "a closed fd": closed,
        "no seals": forged(seals=0).fd,
        "no FUTURE_WRITE": forged(seals=fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK).fd,
        "no GROW": forged(seals=fcntl.F_SEAL_SHRINK | _ring.F_SEAL_FUTURE_WRITE).fd,
        "too small": forged(size=good.nbytes - 4096).fd,
        "too large": forged(size=good.nbytes + 4096).fd,
        "bad magic": forged(header=(b"DMABRONG", 1, 128, 4, 8)).fd,
        "other slots in the header": forged(header=(MAGIC, 1, 128, 8, 8)).fd,
        "other slot size": forged(header=(MAGIC, 1, 64, 4, 8)).fd,
        "other version": forged(header=(MAGIC, 2, 128, 4, 8)).fd,
    }
    bad_wakes = {"a pipe": w_pipe, "a stream socket": s2.fileno(), "a memfd": good.fd, "an eventfd": eventfd,
                 "an unconnected datagram socket": unconnected.fileno(),
                 "an epoll fd": epoll.fileno(), "a regular file": plain, "a closed fd": closed, "not an int": "3"}
    try:
        before = open_fds()
        for name, fd in bad_regions.items():
            with Rings(4, 8) as r:
                with pytest.raises(ProtocolError, match="ring"):
                    r.attach(good.msg, [fd, good.wake])
                assert not r.attached, name
        for name, fd in bad_wakes.items():
            with Rings(4, 8) as r:
                with pytest.raises(ProtocolError, match="ring"):
                    r.attach(good.msg, [good.fd, fd])
                assert not r.attached, name
        for fds in ([good.fd], [good.fd, good.wake, good.wake], (), "ab"):
            with Rings(4, 8) as r:
                with pytest.raises(ProtocolError):
                    r.attach(good.msg, fds)
        assert open_fds() == before  # a refused attach keeps nothing
        with Rings(4, 8) as r:  # and the good one still attaches, once
            r.attach(good.msg, good.fds)
            with pytest.raises(ProtocolError, match="second"):
                r.attach(good.msg, good.fds)
        assert _readable(eventfd) is False  # refused, never written
    finally:
        for fd in (r_pipe, w_pipe, plain, eventfd):
            os.close(fd)
        s1.close()
        s2.close()
        unconnected.close()
        epoll.close()


def test_the_peer_cannot_write_our_region():
    """F_SEAL_FUTURE_WRITE: the memfd we hand out maps read-only only; write(2), a writable mapping, a resize
    and a hole punch all fail, and more seals cannot be added (F_SEAL_SEAL)."""
    with Rings(4, 8) as r:
        msg, (memfd, wake) = r.offer()
        fd = os.dup(memfd)  # what the peer receives: another descriptor of the same file
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(fd, msg["bytes"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 64)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, msg["bytes"] * 2)
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.fallocate(fd, 0x01 | 0x02, ctypes.c_long(0), ctypes.c_long(4096)) == -1  # punch a hole
            assert ctypes.get_errno() == 1  # EPERM
            with pytest.raises(PermissionError):
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            assert seals & REQUIRED_SEALS == REQUIRED_SEALS and seals & fcntl.F_SEAL_SEAL
            ro = mmap.mmap(fd, msg["bytes"], mmap.MAP_SHARED, mmap.PROT_READ)
            assert ro[:8] == MAGIC
            ro.close()
        finally:
            os.close(fd)


# --- waking ----------------------------------------------------------------------------------------------

def test_the_wake_socket_is_rung_only_when_the_peer_said_it_sleeps():
    a, b = _pair(4, 8, 4, 8)
    try:
        assert a.try_push(RingSlot(0, 1, 1, "sync", None))
        assert not _readable(b.wake_fd)  # b is awake: no syscall, no wake-up
        assert b.sleep_begin() is False  # a slot is there: do not sleep
        assert b.take().lease == 1
        assert b.sleep_begin() is True
        assert not _readable(b.wake_fd)
        assert a.try_push(RingSlot(1, 2, 1, "sync", None))
        assert _readable(b.wake_fd)
        b.sleep_end()
        assert not _readable(b.wake_fd)  # drained
        assert b.sleep_begin() is False  # the slot is still there
        b.take()
        assert b.sleep_begin() is True  # releases wake the same way
        assert a.push_releases([7]) == []
        assert _readable(b.wake_fd)
        b.sleep_end()
        assert b.sleep_begin() is False
        assert b.take_releases() == [7]
        assert b.sleep_begin() is True
        b.sleep_end()
        assert a.try_push(RingSlot(2, 3, 1, "sync", None)) and not _readable(b.wake_fd)  # awake again
    finally:
        a.close()
        b.close()


def test_a_sleep_for_slots_only_is_woken_by_slots_and_not_by_releases():
    """``asleep`` 2 (Note [waking for releases]): the peer's releases neither wake this end nor stop its sleep; its
    slots do both; a waiter's ``want_releases`` turns the 2 into 1 and says whether releases wait."""
    a, b = _pair(4, 8, 4, 8)
    try:
        assert b.sleep_begin(releases=False) is True
        assert _ring._atomic.load(b._mine, ASLEEP) == SLEEP_SLOTS
        assert a.push_releases([7]) == []
        assert not _readable(b.wake_fd)  # a release: no wake-up
        b.sleep_end()
        assert b.sleep_begin(releases=False) is True  # a release waiting does not stop a sleep for slots
        assert b.sleep_begin(releases=True) is False  # ... it stops a sleep for everything
        assert b.sleep_begin(releases=False) is True
        assert b.want_releases() is True  # the waiter finds the release the peer published unwoken
        assert _ring._atomic.load(b._mine, ASLEEP) == SLEEP_ALL
        assert b.take_releases() == [7]
        assert b.want_releases() is False
        assert a.push_releases([8]) == []
        assert _readable(b.wake_fd)  # asleep 1 now: the release wakes it
        b.sleep_end()
        assert not _readable(b.wake_fd) and _ring._atomic.load(b._mine, ASLEEP) == 0
        assert b.take_releases() == [8]
        assert b.sleep_begin(releases=False) is True
        assert a.try_push(RingSlot(0, 1, 1, "sync", None))
        assert _readable(b.wake_fd)  # a slot wakes a sleep for slots
        b.sleep_end()
        assert b.sleep_begin(releases=False) is False  # the slot is there
        b.take()
        assert b.want_releases() is False  # awake: nothing stored
        assert _ring._atomic.load(b._mine, ASLEEP) == 0
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("value", [1, 3, 255, 2**63, 2**64 - 1])
def test_a_peers_other_nonzero_asleep_is_taken_as_wake_me_for_releases(forged, value):
    """A peer whose ``asleep`` holds any nonzero value but 2 is woken by a release as by a slot; 2 by a slot only."""
    peer = forged(4, 8)
    r = peer.reader()
    woken = peer.pair[0]
    try:
        for asleep, by_release in ((value, True), (SLEEP_SLOTS, False), (0, False)):
            peer.counter(ASLEEP, asleep)
            assert r.push_releases([5]) == []
            assert _readable(woken.fileno()) is by_release, asleep
            while _readable(woken.fileno()):
                woken.recv(16)
            peer.counter(REL_HEAD, r._rel_tail)  # the peer took it
        peer.counter(ASLEEP, SLEEP_SLOTS)
        assert r.try_push(RingSlot(0, 1, 1, "sync", None))
        assert _readable(woken.fileno())  # a slot wakes a 2
    finally:
        r.close()


# --- fork and fds ----------------------------------------------------------------------------------------

MAP_FIXED_NOREPLACE = 0x100000


def test_a_forked_child_has_no_mapping_and_its_close_leaves_the_parent_ring_working():
    """The child inherits two attached Rings. Its methods raise ForkedResourceError; the address range of the
    regions is free in the child (MADV_DONTFORK), and after the child maps its own memory there and closes
    and collects the Rings, that memory is still mapped (nothing was munmapped behind its back). The
    parent's rings work on."""
    import numpy as np

    a, b = _pair(4, 8, 4, 8)
    addr = np.frombuffer(a._held.mine, dtype=np.uint8).__array_interface__["data"][0]
    size = a.nbytes
    assert a.try_push(RingSlot(0, 1, 1, "sync", None))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            got = libc.mmap(addr, size, mmap.PROT_READ | mmap.PROT_WRITE,
                            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0)
            assert got == addr, (got, addr, ctypes.get_errno())  # free in the child: not inherited
            ctypes.memset(addr, 0x5A, size)
            for call in (lambda: a.try_push(RingSlot(1, 2, 1, "sync", None)), b.peek_sock_seq, b.take,
                         lambda: b.spin_peek(8), lambda: a.push_host(1, 3, 1), b.take_releases,
                         lambda: a.push_releases([1]), a.sleep_begin, a.sleep_end, a.offer):
                try:
                    call()
                except ForkedResourceError:
                    pass
                else:
                    raise AssertionError("a forked child used the ring")
            a.close()
            b.close()
            del a, b
            gc.collect()
            assert ctypes.string_at(addr, size) == b"\x5a" * size  # still ours: not munmapped
            code = 0
        except BaseException as exc:
            print(f"fork child: {exc!r}", file=sys.stderr)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    try:
        assert b.take().lease == 1
        assert a.try_push(RingSlot(1, 2, 1, "sync", None)) and b.take().lease == 2
        assert b.push_releases([1, 2]) == [] and a.take_releases() == [1, 2]
    finally:
        a.close()
        b.close()


def test_close_returns_every_fd_and_mapping():
    before = open_fds()
    for _ in range(3):
        a, b = _pair(4, 8, 4, 8)
        assert len(open_fds()) == len(before) + 8  # memfd + wake socketpair each, and a dup of the other's wake end
        a.try_push(RingSlot(0, 1, 1, "sync", None))
        b.take()
        a.close()
        b.close()
    assert open_fds() == before
    # Collected unclosed: the finalizer closes them.
    a, b = _pair(4, 8, 4, 8)
    del a, b
    gc.collect()
    assert open_fds() == before


def test_errors_name_the_syscall():
    err = SyscallError("memfd_create", OSError(24, "Too many open files"))
    assert "memfd_create" in str(err) and "EMFILE" in str(err)
    # Run out of fds: Rings() fails with a SyscallError naming the call, and leaks nothing.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    before = open_fds()
    for last_free in (0, 1):  # no fd left at all; one left (the memfd), none for the wake socketpair
        top = max(before)
        fillers = [os.dup(0) for _ in range(top + 1 - len(before))]  # no hole below top: the next fd is top + 1
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 1 + last_free, hard))
        try:
            with pytest.raises(SyscallError) as info:
                Rings(4, 8)
            assert info.value.call == ("memfd_create", "socketpair")[last_free] and info.value.errno == 24
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            for fd in fillers:
                os.close(fd)
        assert open_fds() == before

