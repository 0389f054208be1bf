"""The shared-memory ring's region format and the ``ring`` message's checks (no mapping, no atomics here).

What both ends agree on, as ``docs/protocol.md`` ("Shared-memory ring") specifies it: the format version, the
region's header and counter offsets, the message slot's encoding (:data:`SLOT`) and what it carries
(:class:`RingSlot`), the release entries, the seals a peer's region must carry, and the checks of a peer's
``ring`` message and of the two fds it carries (:func:`check_offer`, :func:`check_memfd`,
:func:`open_wake`). The object that owns the fds and the mappings and moves the counters is
:class:`._ring.Rings`; :mod:`.protocol` checks a ``ring`` message's fields with :func:`check_offer`.

Note [the wake fd]. A sleeping end is woken through a socket, not an eventfd. An fd passed by ``SCM_RIGHTS``
shares its open file description with the sender, so its flags are the sender's too: a peer can clear
``O_NONBLOCK`` on an eventfd it made, or on one it was given, at any moment, and then an ``eventfd_read`` of an
empty counter, or an ``eventfd_write`` to a full one, waits forever (outside every timeout, and a write does it
under the channel's send lock). Each end makes an ``AF_UNIX`` ``SOCK_DGRAM`` ``socketpair``, polls one end and
gives the peer the other; every wake is a one-byte ``send`` with ``MSG_DONTWAIT`` and every drain a ``recv`` with
``MSG_DONTWAIT``, which never wait whatever the description's flags say. A full socket means wake-ups are pending
already; a peer's end that went (``ECONNREFUSED``, ``ECONNRESET``) is seen as the channel socket's hang-up. At
most :data:`._ring._DRAIN` datagrams are read per drain, so a peer that floods the socket costs this end a loop
turn per flood, not a hang.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import ProtocolError, SyscallError
from ..fd import fd_kind

__all__ = ["RING_VERSION", "MAGIC", "SLOT_BYTES", "SLOTS_OFFSET", "MAX_SLOTS", "MAX_RELEASE_SLOTS", "LEASE_LIMIT",
           "ORDERINGS", "ORDER_CODE", "EVENT_CODE", "EVENT_BYTES", "OUT_TAIL", "REL_TAIL", "IN_HEAD", "REL_HEAD",
           "ASLEEP", "AWAKE", "SLEEP_ALL", "SLEEP_SLOTS", "HEADER", "SLOT", "F_SEAL_FUTURE_WRITE", "REQUIRED_SEALS", "OWN_SEALS",
           "RingSlot", "region_bytes", "check_size", "check_memfd", "open_wake", "check_offer"]

#: The ring format this implementation speaks (the ``ring`` key of ``hello``, the ``version`` of ``ring``).
RING_VERSION = 1
#: The first 8 bytes of a region.
MAGIC = b"DMABRING"
#: Bytes of one message slot.
SLOT_BYTES = 128
#: Offset of the first message slot: the header and the counters fill the first 4096 bytes.
SLOTS_OFFSET = 4096
#: Most message slots a region may have (a power of two, as is every ring's length).
MAX_SLOTS = 1 << 16
#: Most release slots a region may have.
MAX_RELEASE_SLOTS = 1 << 20
#: Lease ids on the ring are in [1, 2**53): exact in a double, for peers that parse JSON into one.
LEASE_LIMIT = 1 << 53
#: The ``ordering`` byte of a slot names these (the code is the index).
ORDERINGS = ("sync", "event", "none")
#: The code of each ordering name.
ORDER_CODE = {name: code for code, name in enumerate(ORDERINGS)}
#: The ordering code that carries an event.
EVENT_CODE = 1
#: Bytes of a ``CUipcEventHandle``.
EVENT_BYTES = 64

# Counters, each on its own 64-byte line (no false sharing between the writer's and the reader's).
OUT_TAIL, REL_TAIL, IN_HEAD, REL_HEAD, ASLEEP = 64, 128, 192, 256, 320
#: ``asleep`` values. AWAKE: the owner reads without being woken. SLEEP_ALL: it sleeps; wake it for a slot or a
#: release. SLEEP_SLOTS: it sleeps; wake it for a slot only (releases wait until it looks, which it does within
#: a bound). A writer of releases treats every other nonzero value as SLEEP_ALL (Note [waking for releases], in
#: :mod:`._ring`).
AWAKE, SLEEP_ALL, SLEEP_SLOTS = 0, 1, 2

#: The header at offset 0: magic, version, slot_bytes, slots, release_slots.
HEADER = struct.Struct("<8sIIII")
#: A message slot: seq, sock_seq, lease, layout, ordering, has_event, 2 pad bytes, event; the slot's other 32
#: bytes are zero.
SLOT = struct.Struct("<QQQIBB2x64s")

# include/uapi/linux/fcntl.h (Linux 5.1+); Python's fcntl module names it from 3.12 only. With it no new
# writable mapping (nor write(2)) of the memfd is possible: the peer maps this end's region read-only.
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)
#: The seals a peer's region must carry (no SIGBUS from a shrink, no write by anyone but its owner).
REQUIRED_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE
#: The seals an owner puts on its region (the required ones, and no more seals after them).
OWN_SEALS = REQUIRED_SEALS | fcntl.F_SEAL_SEAL
_OFFER_KEYS = frozenset({"kind", "version", "bytes", "slots", "release_slots"})


def region_bytes(slots: int, release_slots: int) -> int:
    """Size in bytes of a region with ``slots`` message slots and ``release_slots`` release slots: the
    4096-byte header, the slots, the release entries (8 bytes each), rounded up to a multiple of 4096."""
    end = SLOTS_OFFSET + slots * SLOT_BYTES + release_slots * 8
    return (end + 4095) // 4096 * 4096


@dataclass(frozen=True, slots=True)
class RingSlot:
    """What one message slot carries: a ``repeat`` without ``meta``.

    Attributes:
        sock_seq: socket messages the writer had sent (counted from the first after the handshake) when it
            published the slot: the slot comes after its socket messages ``0 .. sock_seq - 1`` and before
            message ``sock_seq``. A u64.
        lease: the lease the repeat lends under, in ``[1, 2**53)``.
        layout: the layout id repeated, a u32 (the channel's state machine checks that it knows it).
        ordering: ``"sync"``, ``"event"`` or ``"none"`` (as in a ``repeat``).
        event: the 64-byte ``CUipcEventHandle`` when ``ordering == "event"``, else ``None``.
    """

    sock_seq: int
    lease: int
    layout: int
    ordering: str
    event: bytes | None


def check_size(value: Any, limit: int, what: str, error: type[Exception]) -> int:
    """``value``, a ring's length: a power of two in ``[1, limit]``; else ``error`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit or value & (value - 1):
        raise error(f"{what} must be a power of two in [1, {limit}], got {value!r}")
    return value


def check_memfd(fd: Any, nbytes: int) -> None:
    """The peer's region: a memfd of exactly ``nbytes`` with :data:`REQUIRED_SEALS` (ProtocolError)."""
    kind = fd_kind(fd)
    if kind != "memfd":
        raise ProtocolError(f"ring: the region fd is a {kind}, not a memfd")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise ProtocolError(f"ring: the region memfd has seals {seals:#x}, not F_SEAL_GROW|F_SEAL_SHRINK|"
                            f"F_SEAL_FUTURE_WRITE ({REQUIRED_SEALS:#x})")
    size = os.fstat(fd).st_size
    if size != nbytes:
        raise ProtocolError(f"ring: the region memfd is {size} bytes, the message says {nbytes}")


def open_wake(fd: Any) -> socket.socket:
    """The peer's wake fd, checked and duplicated: a connected ``AF_UNIX`` ``SOCK_DGRAM`` socket (one end of
    the peer's ``socketpair``), returned as a socket object that owns the duplicate (ProtocolError if it is
    anything else; SyscallError if ``dup`` fails).

    Why a socket and not an eventfd: Note [the wake fd], above."""
    if isinstance(fd, bool) or not isinstance(fd, int) or fd_kind(fd) != "socket":
        raise ProtocolError(f"ring: the wake fd is a {fd_kind(fd)}, not a socket")
    try:
        dup = os.dup(fd)
    except OSError as exc:
        raise SyscallError("dup", exc) from exc
    try:
        sock = socket.socket(fileno=dup)
    except OSError as exc:
        os.close(dup)
        raise ProtocolError(f"ring: the wake fd is not a usable socket ({exc})") from exc
    try:
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_DGRAM:
            raise ProtocolError(f"ring: the wake socket is {sock.family!r} {sock.type!r}, not AF_UNIX SOCK_DGRAM")
        try:
            sock.getpeername()
        except OSError as exc:
            raise ProtocolError("ring: the wake socket is not connected (one end of a socketpair is)") from exc
    except BaseException:
        sock.close()
        raise
    return sock


def check_offer(msg: Any) -> tuple[int, int, int]:
    """Check a ``ring`` message's fields; returns ``(bytes, slots, release_slots)``.

    Raises:
        ProtocolError: not the ``ring`` message of version :data:`RING_VERSION` with power-of-two ``slots``
            (at most :data:`MAX_SLOTS`) and ``release_slots`` (at most :data:`MAX_RELEASE_SLOTS`) and
            ``bytes == region_bytes(slots, release_slots)``.
    """
    if not isinstance(msg, dict) or msg.keys() != _OFFER_KEYS or msg["kind"] != "ring":
        raise ProtocolError(f"ring: the message must have exactly the keys {sorted(_OFFER_KEYS)} and kind 'ring'")
    version = msg["version"]
    if isinstance(version, bool) or version != RING_VERSION or not isinstance(version, int):
        raise ProtocolError(f"ring: version {version!r}, this end speaks {RING_VERSION}")
    slots = check_size(msg["slots"], MAX_SLOTS, "ring: slots", ProtocolError)
    release_slots = check_size(msg["release_slots"], MAX_RELEASE_SLOTS, "ring: release_slots", ProtocolError)
    nbytes = msg["bytes"]
    if isinstance(nbytes, bool) or nbytes != region_bytes(slots, release_slots) or not isinstance(nbytes, int):
        raise ProtocolError(f"ring: bytes {nbytes!r}, a region of {slots} slots and {release_slots} release slots "
                            f"is {region_bytes(slots, release_slots)}")
    return nbytes, slots, release_slots
