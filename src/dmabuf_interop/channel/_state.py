"""The channel protocol's state, sans-I/O: parsed messages in, events out, every state-dependent rule.

:class:`ConnectionState` is one end of one connection as the protocol sees it,
and nothing else: no socket, lock, thread, CUDA or ``/proc``. It holds

* the phase (:class:`Phase`: handshake, open, closing, ended) and why the connection ended
  (:class:`EndReason`, and the first error);
* what this end lent: the chunks the peer has been told of, the layouts defined to it
  (batches' and single arrays', each first in, first out), the leases out (``id -> token``,
  the token being whatever the I/O side wants back when the lease completes);
* what this end holds of the peer's: its chunks as facts (:class:`ChunkFact`: id, size, host or
  device; never an import), its layouts (:class:`Layout`: validated descriptors and the very chunk
  facts they lie in), the peer's leases held here.

:meth:`ConnectionState.receive` takes one message that :func:`.protocol.parse_message` (or
:func:`.protocol.parse_region`) accepted and returns what it means as events
(:class:`ChunkAnnounced`, :class:`ChunkRetired`, :class:`ArraysArrived`, :class:`EmptyBatch`,
:class:`LayoutForgotten`, :class:`LeasesReleased`, :class:`HelloReceived`, :class:`RingOffered`,
:class:`PeerClosed`, :class:`PeerRefused`); a message that breaks a rule raises :class:`~..errors.ProtocolError` and
ends the connection (:attr:`ConnectionState.end_reason` is then ``PROTOCOL_ERROR``). The sending
side asks :meth:`ConnectionState.choose_layout` whether a placement defines a layout or repeats
one, and reports a definition that went out with :meth:`ConnectionState.layout_sent`.

Not thread-safe: its owner serialises the calls on each half. The channel makes the calls about what it
lends (``is_announced``, ``chunk_announced``, ``retire_chunk``, ``choose_layout``, ``layout_sent``,
``send_failed``) under its send lock, and every other call under its state lock (see Note [channel
threads and fork] in :mod:`.channel`). The I/O side keeps its ``id -> object``
maps (imported chunks, what a layout's tensors share) in step from the events. The golden
vectors in ``spec/vectors/`` drive this class; ``spec/vectors/README.md`` describes them.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Hashable

from ..errors import PeerClosedError, PeerRefusedError, ProtocolError
from .protocol import MAX_CHUNKS, MAX_LAYOUTS, MAX_SINGLE_LAYOUTS, ArrayDescriptor, parse_message, parse_region

__all__ = [
    "Phase", "EndReason", "ChunkFact", "Layout", "LayoutChoice", "ConnectionState",
    "HelloReceived", "ChunkAnnounced", "ChunkRetired", "ArraysArrived", "EmptyBatch", "LayoutForgotten",
    "LeasesReleased", "RingOffered", "PeerClosed", "PeerRefused", "MAX_CHUNKS",
]


class Phase(enum.Enum):
    """Where the connection is. ``HANDSHAKE``: before the peer's ``hello``; ``OPEN``; ``CLOSING``: this
    end closed (arrays that still arrive are dropped; the peer releases everything at the end);
    ``ENDED``: the connection is over, for :attr:`ConnectionState.end_reason`."""

    HANDSHAKE = "handshake"
    OPEN = "open"
    CLOSING = "closing"
    ENDED = "ended"


# Speed trick, measured: an Enum member read through its class costs 0.1-0.2 us (Python 3.11, the 2-core CI
# machine); receive() reads them from these names, once per message.
_HANDSHAKE, _OPEN, _CLOSING = Phase.HANDSHAKE, Phase.OPEN, Phase.CLOSING


class EndReason(enum.Enum):
    """Why the connection ended: the peer said ``bye`` or went (EOF), the peer refused us, the peer broke
    the protocol, this process failed (a send cut off part-way, an import that failed here, a bug),
    or this end closed it."""

    PEER_CLOSED = "peer-closed"
    PEER_REFUSED = "peer-refused"
    PROTOCOL_ERROR = "protocol-error"
    LOCAL_ERROR = "local-error"
    CLOSED = "closed"


@dataclass(frozen=True, eq=False, slots=True)
class ChunkFact:
    """A peer chunk as the protocol knows it. Compared by identity: an id retired and announced again
    is another chunk (a layout defined over the first must not be repeated over the second)."""

    id: int
    size: int
    host: bool


@dataclass(frozen=True, eq=False, slots=True)
class Layout:
    """A layout the peer defined: its validated descriptors, ``mapping`` (``True``/``False`` for a
    batch, ``None`` for one array) and the chunks they lie in, by id.

    ``plain``: for one array defined with no event and no ``meta``, its ordering and its chunk's ``(id, fact)``,
    what a repeat of it as defined has (:meth:`ConnectionState.receive_slot_as_defined`); else ``None``."""

    id: int
    descs: list[ArrayDescriptor]
    mapping: bool | None
    chunks: dict[int, ChunkFact]
    plain: tuple[str, tuple[int, ChunkFact]] | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        d = self.descs[0] if self.descs else None
        plain = None
        if self.mapping is None and d is not None and d.event is None and d.meta is None and len(self.chunks) == 1:
            plain = (d.ordering, next(iter(self.chunks.items())))
        object.__setattr__(self, "plain", plain)  # (frozen: set once, here)


@dataclass(frozen=True, slots=True)
class LayoutChoice:
    """:meth:`ConnectionState.choose_layout`'s answer: ``define`` the layout ``id`` (an ``array`` or
    ``arrays`` message with a ``layout`` field), or send a ``repeat`` of it."""

    id: int
    define: bool
    key: Hashable
    single: bool


# --- events ---------------------------------------------------------------------------
# Not frozen, a measured speed trick: a frozen dataclass's __init__ sets each field through
# object.__setattr__, which made ArraysArrived (one per array message) cost 1.6-2.4 us instead of
# 0.4-0.5 us (Python 3.11, this project's 2-core CI machine). Nothing changes an event once made.

@dataclass(slots=True)
class HelloReceived:
    """The peer's ``hello`` (checked by :func:`.protocol.parse_message`); the connection is open."""

    hello: dict[str, Any]


@dataclass(slots=True)
class ChunkAnnounced:
    """The peer announced a chunk (``chunk`` with its fds, or ``region`` on ``tcp://``): import it.
    ``msg`` is the validated message (mechanism, parts, device UUID, or NIXL address and metadata)."""

    chunk: ChunkFact
    msg: dict[str, Any]


@dataclass(slots=True)
class ChunkRetired:
    """The peer retired chunk ``chunk_id``: unmap it once nothing here uses it."""

    chunk_id: int


@dataclass(slots=True)
class ArraysArrived:
    """The peer lent arrays under ``lease`` (now held here until released).

    ``kind``: ``"array"`` (one array: :meth:`Channel.recv`) or ``"arrays"`` (a batch); a repeat of a single
    array's layout arrives as ``"array"``. ``mapping``: the batch is by name. ``ordering``: a repeat's
    ordering (its descriptors keep their first), else ``None``. ``chunks``: the chunk ids the descriptors
    name. ``layout``: the layout the message defined or repeated, else ``None``."""

    kind: str
    lease: int
    descs: list[ArrayDescriptor]
    mapping: bool
    ordering: str | None
    chunks: tuple[int, ...]
    layout: int | None


@dataclass(slots=True)
class EmptyBatch:
    """The peer lent an empty batch under ``lease``: nothing to hold, release it at once."""

    lease: int


@dataclass(slots=True)
class LayoutForgotten:
    """The peer's layout ``layout`` fell out of the table (first in, first out), as the peer forgot it."""

    layout: int


@dataclass(slots=True)
class LeasesReleased:
    """The peer released these leases of ours; ``tokens`` are what :meth:`ConnectionState.lend` was given."""

    leases: tuple[int, ...]
    tokens: tuple[Any, ...]


@dataclass(slots=True)
class RingOffered:
    """The peer's ``ring`` message (its shared-memory region and wake socket, the two fds that came with it):
    attach it. ``msg`` is the validated message."""

    msg: dict[str, Any]


@dataclass(slots=True)
class PeerClosed:
    """The peer said ``bye``: the connection is over."""


@dataclass(slots=True)
class PeerRefused:
    """The peer refused this connection, for ``reason``: the connection is over."""

    reason: str


Event = Any  # one of the event classes above


class ConnectionState:
    """One end of a channel connection, sans-I/O (see the module docstring).

    Args:
        transport: ``"fd"`` (AF_UNIX: chunks are ``chunk`` messages with their fds) or ``"nixl"``
            (``tcp://``: chunks are ``region`` messages; no fd rides).
        phase: where to start: ``Phase.OPEN`` (the handshake is done) or ``Phase.HANDSHAKE``.
        max_chunks: most peer chunks known at once.
        max_layouts, max_single_layouts: layouts each end remembers, batches' and single arrays'.
        ring: both hellos offered the shared-memory ring: the peer's first message after the handshake
            must be its ``ring`` (or a ``refuse``); otherwise a ``ring`` message is refused.
    """

    def __init__(self, transport: str = "fd", *, phase: Phase = Phase.OPEN, max_chunks: int = MAX_CHUNKS,
                 max_layouts: int = MAX_LAYOUTS, max_single_layouts: int = MAX_SINGLE_LAYOUTS,
                 ring: bool = False) -> None:
        if transport not in ("fd", "nixl"):
            raise ValueError(f"transport must be 'fd' or 'nixl', got {transport!r}")
        self.transport = transport
        self.phase = phase
        self.end_reason: EndReason | None = None
        #: The first cause of the end (or of a send that broke the stream), if any.
        self.error: BaseException | None = None
        #: This end closed (whether or not the connection had ended before).
        self.closed_here = False
        #: A message to the peer was cut off part-way: nothing more may go out.
        self.send_broken = False
        # Speed trick: read several times per message (send, read, release), so plain attributes rather
        # than properties (a call each), set only where the phase, closed_here or send_broken change
        # (close, send_failed, _finish); nothing else may set them.
        #: The connection is over (either end): the phase is ENDED.
        self.ended = phase is Phase.ENDED
        #: Closed here or ended: nothing more goes out, no release is due.
        self.over = self.ended
        #: Neither over nor cut off by a broken send: a message may go out.
        self.can_send = not self.over
        self.max_chunks = max_chunks
        self.max_layouts = max_layouts
        self.max_single_layouts = max_single_layouts
        #: The peer's ``ring`` message is due as its first message after the handshake.
        self.ring_due = ring
        # What this end lent.
        self._announced: set[int] = set()
        self._layouts_sent: dict[Hashable, int] = {}
        self._single_layouts_sent: dict[Hashable, int] = {}
        self._layout_ids = itertools.count(1)
        self._lent: dict[int, Any] = {}
        # What this end holds of the peer's.
        self._chunks: dict[int, ChunkFact] = {}
        self._layouts: dict[int, Layout] = {}
        self._single_layouts: dict[int, Layout] = {}
        self._held: set[int] = set()

    # --- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """This end closes: arrays that arrive from now on are dropped (the peer releases its leases
        when the connection ends)."""
        self.closed_here = True
        self.over = True
        self.can_send = False
        if self.phase is not Phase.ENDED:
            self.phase = Phase.CLOSING

    def fail(self, exc: BaseException) -> None:
        """Keep ``exc`` as the first cause of the end (a later one, such as our own shutdown seen as an
        end of file, says less)."""
        if self.error is None:
            self.error = exc

    def send_failed(self, exc: BaseException) -> None:
        """A message to the peer was cut off part-way, or an essential one could not go: the stream is
        out of step for good; the connection ends (:meth:`end`) as soon as the I/O side sees it."""
        self.fail(exc)
        self.send_broken = True
        self.can_send = False

    def _finish(self, exc: BaseException | None = None) -> None:
        """The phase is ``ENDED`` now, for ``exc`` (the first cause kept); the tables wait for :meth:`end`."""
        if exc is not None:
            self.fail(exc)
        if self.end_reason is None:
            self.end_reason = self._reason_for(self.error)
        self.phase = Phase.ENDED
        self.ended = self.over = True
        self.can_send = False

    def end(self) -> list[Any]:
        """The connection is over: returns the tokens of the leases still lent (they complete now), and
        forgets the peer's chunks, layouts and held leases (the I/O side unmaps what nothing uses).
        Idempotent: a second call returns ``[]``."""
        self._finish()
        tokens = list(self._lent.values())
        self._lent.clear()
        self._chunks.clear()
        self._layouts.clear()
        self._single_layouts.clear()
        self._held.clear()
        return tokens

    @property
    def failed_here(self) -> bool:
        """An error seen here (the peer broke the protocol, or this process failed) ends, or has ended, the
        connection, which this end did not close. The peer completes its leases as it sees the end and may
        write its blocks again at once, so the arrays it lent that this end has not handed out yet are void:
        the I/O side drops them rather than deliver them."""
        err = self.error
        return (err is not None and not self.closed_here
                and self._reason_for(err) in (EndReason.PROTOCOL_ERROR, EndReason.LOCAL_ERROR))

    def _reason_for(self, err: BaseException | None) -> EndReason:
        if self.closed_here:
            return EndReason.CLOSED
        if err is None or isinstance(err, PeerClosedError):
            return EndReason.PEER_CLOSED
        if isinstance(err, PeerRefusedError):
            return EndReason.PEER_REFUSED
        if isinstance(err, ProtocolError):
            return EndReason.PROTOCOL_ERROR
        return EndReason.LOCAL_ERROR

    # --- what this end lends --------------------------------------------------------------

    def is_announced(self, chunk_id: int) -> bool:
        return chunk_id in self._announced

    def can_announce(self) -> bool:
        """Whether the peer takes one more chunk of ours: it refuses more than ``max_chunks`` announced and
        not retired, which this end counts as the peer does."""
        return len(self._announced) < self.max_chunks

    def chunk_announced(self, chunk_id: int) -> None:
        """The peer has been told of our chunk ``chunk_id`` (its message went out)."""
        self._announced.add(chunk_id)

    def retire_chunk(self, chunk_id: int) -> bool:
        """Our chunk ``chunk_id`` is gone; returns whether the peer knew it (a ``retire`` must go out)."""
        if chunk_id in self._announced:
            self._announced.discard(chunk_id)
            return True
        return False

    def lend(self, lease_id: int, token: Any) -> None:
        """A lease goes out; ``token`` comes back in :class:`LeasesReleased` or from :meth:`end`."""
        self._lent[lease_id] = token

    def unlend(self, lease_id: int) -> Any:
        """The lease's message did not go out: forget it; returns its token (or ``None``)."""
        return self._lent.pop(lease_id, None)

    @property
    def lent(self) -> int:
        """Leases out and not released."""
        return len(self._lent)

    def lent_ids(self) -> list[int]:
        """The ids of the leases out, oldest first."""
        return list(self._lent)

    def choose_layout(self, key: Hashable, single: bool) -> LayoutChoice:
        """Define a layout for this placement, or repeat the one the peer has for it. ``key`` says
        everything the peer's descriptors would hold but the ordering, event and meta (names, chunks,
        blocks, offsets, shapes, strides, dtypes); ``single``: one array (``array``) or a batch
        (``arrays``). A definition counts only once :meth:`layout_sent` says it went out."""
        sent = self._single_layouts_sent if single else self._layouts_sent
        found = sent.get(key)
        if found is not None:
            return LayoutChoice(found, False, key, single)
        return LayoutChoice(next(self._layout_ids), True, key, single)

    def layout_sent(self, choice: LayoutChoice) -> int | None:
        """The definition ``choice`` went out: the peer knows the layout now. Returns the id of the layout
        that fell out of the table for it (first in, first out, as the peer forgets the same), or ``None``."""
        sent, limit = ((self._single_layouts_sent, self.max_single_layouts) if choice.single
                       else (self._layouts_sent, self.max_layouts))
        sent[choice.key] = choice.id
        if len(sent) > limit:
            return sent.pop(next(iter(sent)))
        return None

    def layouts_sent(self, single: bool = False) -> list[int]:
        """The ids of the layouts the peer has from this end, oldest first."""
        return list((self._single_layouts_sent if single else self._layouts_sent).values())

    # --- what this end holds ----------------------------------------------------------------

    def layouts_held(self, single: bool = False) -> list[int]:
        """The ids of the peer's layouts known here, oldest first."""
        return list((self._single_layouts if single else self._layouts).keys())

    def chunk(self, chunk_id: int) -> ChunkFact | None:
        return self._chunks.get(chunk_id)

    def chunk_ids(self) -> list[int]:
        """The ids of the peer's chunks known here, in the order they were announced."""
        return list(self._chunks)

    @property
    def held(self) -> frozenset[int]:
        """The peer's leases held here."""
        return frozenset(self._held)

    def released(self, lease_id: int) -> bool:
        """Every item of the peer's lease ``lease_id`` was released here; returns whether a ``release``
        message is due (not once the connection is over: the peer then completes every lease itself)."""
        self._held.discard(lease_id)
        return not self.over

    # --- receiving ----------------------------------------------------------------------------

    def receive(self, msg: dict[str, Any], nfds: int = 0, descs: list[ArrayDescriptor] | None = None) -> list[Event]:
        """What one message from the peer means.

        Args:
            msg: the decoded JSON object (validated here with :func:`.protocol.parse_message`, unless
                ``descs`` is given: the caller parsed it and these are its descriptors).
            nfds: the fds that arrived with it (``SCM_RIGHTS``).

        Returns:
            the events, in order.

        Raises:
            ProtocolError: the message breaks the protocol, here and now; the connection has ended.
        """
        if self.ended:  # (the phase is ENDED; a plain attribute: see _HANDSHAKE)
            raise ProtocolError(f"a {msg.get('kind')!r} message after the end of the connection")
        # One call, not two (receive and a helper): this runs once per message.
        try:
            if self.transport == "nixl":
                if nfds:
                    raise ProtocolError("a message on a tcp:// channel carried an fd")
                if isinstance(msg, dict) and msg.get("kind") == "region":
                    return self._region(msg)
            if descs is None:
                kind, descs = parse_message(msg)
            else:
                kind = msg["kind"]
            if self.phase is _HANDSHAKE:
                if kind == "hello":
                    self.phase = Phase.OPEN
                    return [HelloReceived(msg)]
                if kind != "refuse":
                    raise ProtocolError(f"expected a hello message, got {kind!r}")
            if self.ring_due or kind == "ring":
                ring = self._ring(kind, msg, nfds)
                if ring is not None:
                    return ring
            if nfds and kind != "chunk":
                raise ProtocolError(f"the peer's {kind!r} message carried an fd")
            if kind == "chunk":
                return self._chunk(msg, nfds)
            if kind == "retire":
                if self._chunks.pop(msg["chunk"], None) is None:
                    raise ProtocolError(f"retire of unknown chunk {msg['chunk']}")
                return [ChunkRetired(msg["chunk"])]
            if kind in ("array", "arrays", "repeat"):
                return self._arrays(kind, msg, descs)
            if kind == "release":
                return [self.peer_released(msg["leases"])]
            if kind == "bye":
                self._finish(PeerClosedError("the peer closed the channel"))
                return [PeerClosed()]
            if kind == "refuse":
                self._finish(PeerRefusedError(f"the peer refused this connection: {msg['reason']}"))
                return [PeerRefused(msg["reason"])]
            raise ProtocolError(f"unexpected {kind!r} message after the handshake")
        except ProtocolError as exc:
            self._finish(exc)
            raise

    def peer_released(self, ids: list[int]) -> LeasesReleased:
        """The peer released these leases of ours (a ``release`` message, or its release ring). Every id is
        checked before any lease is taken out, so a refused list leaves every lease to :meth:`end`.

        Raises:
            ProtocolError: an id not lent (never, or released already, or twice in ``ids``); unlike
                :meth:`receive`, this does not end the connection: the caller does.
        """
        lent = self._lent
        if len(set(ids)) != len(ids) or not all(lid in lent for lid in ids):
            seen: set[int] = set()
            for lid in ids:
                if lid not in lent or lid in seen:
                    raise ProtocolError(f"release of unknown lease {lid}")
                seen.add(lid)
        return LeasesReleased(tuple(ids), tuple(lent.pop(lid) for lid in ids))

    def _ring(self, kind: str, msg: dict[str, Any], nfds: int) -> list[Event] | None:
        """The ``ring`` rule: the peer's first message after the handshake is its ``ring`` when both
        offered one (a ``refuse`` may come instead), and there is no ``ring`` otherwise."""
        if kind == "refuse":
            self.ring_due = False
            return None
        if kind != "ring":
            raise ProtocolError(f"expected the peer's ring message first, got {kind!r}")
        if not self.ring_due:
            raise ProtocolError("a ring message that was not negotiated, or a second one")
        if self.transport != "fd":
            raise ProtocolError("a ring message on a tcp:// channel")
        if nfds != 2:
            raise ProtocolError(f"a ring message carried {nfds} fd(s), not 2 (memfd, wake socket)")
        self.ring_due = False
        return [RingOffered(msg)]

    def _check_new(self, cid: int, what: str) -> None:
        if cid in self._chunks:
            raise ProtocolError(f"{what} {cid} announced twice")
        if len(self._chunks) >= self.max_chunks:
            raise ProtocolError(f"the peer announced more than {self.max_chunks} {what}s")

    def _new_chunk(self, cid: int, size: int, host: bool) -> ChunkFact:
        fact = self._chunks[cid] = ChunkFact(cid, size, host)
        return fact

    def _chunk(self, msg: dict[str, Any], nfds: int) -> list[Event]:
        if self.transport != "fd":
            raise ProtocolError("a chunk message on a tcp:// channel, which carries no fd")
        if nfds != len(msg["parts"]):
            raise ProtocolError(f"a chunk message of {len(msg['parts'])} part(s) carried {nfds} fd(s)")
        self._check_new(msg["chunk"], "chunk")
        host = msg["mechanism"] == "memfd"
        if host and msg["device_uuid"]:
            raise ProtocolError("a memfd chunk names a GPU")
        return [ChunkAnnounced(self._new_chunk(msg["chunk"], msg["size"], host), msg)]

    def _region(self, msg: dict[str, Any]) -> list[Event]:
        parse_region(msg)
        self._check_new(msg["chunk"], "region")
        return [ChunkAnnounced(self._new_chunk(msg["chunk"], msg["size"], msg["mem"] == "DRAM"), msg)]

    def receive_slot(self, lease: int, layout: int, ordering: str, event: str | None) -> list[Event]:
        """A ``repeat`` that came as a slot of the peer's shared-memory ring, whose fields
        :meth:`._ring.Rings.take_fields` checked: what :meth:`receive` makes of ``{"kind": "repeat", "lease": lease,
        "layout": layout, "ordering": ordering, "event": event, "meta": None}``, without the message.

        Raises:
            ProtocolError: as :meth:`receive` (the connection has ended).
        """
        if self.ended:
            raise ProtocolError("a ring slot after the end of the connection")
        try:
            if self.phase is _HANDSHAKE or self.ring_due:  # (the ring is attached after the peer's ring message)
                raise ProtocolError("a ring slot before the peer's ring message")
            return self._repeat(lease, layout, ordering, event, None)
        except ProtocolError as exc:
            self._finish(exc)
            raise

    def receive_slot_as_defined(self, lease: int, layout_id: int, ordering: str, has_event: bool) -> Layout | None:
        """:meth:`receive_slot` of the case a steady state repeats: one array's layout repeated as it was
        defined (the same ordering, no event, no ``meta``), over chunks still announced, under a lease not held,
        on an open connection. Returns the layout, the lease now held: the arrival :meth:`receive_slot` would
        make is ``ArraysArrived("array", lease, layout.descs, False, ordering, tuple(layout.chunks), layout.id)``.
        ``None``: another case, nothing done (:meth:`receive_slot` takes it, and decides). Raises nothing."""
        if self.phase is not _OPEN or self.ring_due or has_event:  # (ENDED, CLOSING, HANDSHAKE: receive_slot's)
            return None
        found = self._single_layouts.get(layout_id)
        if found is None or lease in self._held:
            return None
        plain = found.plain
        # (ordering as defined: so "event" is not over a host chunk, which the definition checked)
        if plain is None or ordering != plain[0] or self._chunks.get(plain[1][0]) is not plain[1][1]:
            return None
        self._held.add(lease)
        return found

    def _repeat(self, lease: int, layout_id: int, ordering: str, event: str | None,
                meta: dict[str, Any] | None) -> list[Event]:
        # (one array's layouts first: what the ring repeats most; the two tables never share an id)
        found = self._single_layouts.get(layout_id) or self._layouts.get(layout_id)
        if found is None:
            raise ProtocolError(f"repeat of unknown layout {layout_id}")
        for cid, fact in found.chunks.items():
            if self._chunks.get(cid) is not fact:
                raise ProtocolError(f"repeat of layout {layout_id} names chunk {cid}, retired since")
            if ordering == "event" and fact.host:
                raise ProtocolError(f"ordering 'event' for host chunk {cid}")
        descs = found.descs
        d = descs[0]
        if not (meta is None and d.meta is None and ordering == d.ordering and event == d.event):
            # Otherwise as defined (a ring of blocks sent again and again): the frozen descriptors are
            # shared, never a meta object (whose == would also equate 1, 1.0 and True).
            descs = [dataclasses.replace(d, ordering=ordering, event=event, meta=meta), *descs[1:]]
        # (a single array's layout arrives as one)
        return self._arrived("array" if found.mapping is None else "arrays", lease, descs, bool(found.mapping),
                             ordering, found.chunks, found.id, [])

    def _arrays(self, kind: str, msg: dict[str, Any], descs: list[ArrayDescriptor]) -> list[Event]:
        if kind == "repeat":
            return self._repeat(msg["lease"], msg["layout"], msg["ordering"], msg["event"], msg["meta"])
        events: list[Event] = []
        chunks = {}
        for d in descs:
            fact = chunks[d.chunk] = self._chunks.get(d.chunk)
            if fact is None:
                raise ProtocolError(f"descriptor names unknown chunk {d.chunk}")
            if d.block_offset + d.block_bytes > fact.size:
                raise ProtocolError(f"block [{d.block_offset}, {d.block_offset + d.block_bytes}) lies "
                                    f"outside chunk {d.chunk} of {fact.size} bytes")
            if d.ordering == "event" and fact.host:
                raise ProtocolError(f"ordering 'event' for host chunk {d.chunk}")
        mapping = kind == "arrays" and msg["mapping"]
        layout_id = None
        if "layout" in msg:
            layout_id = msg["layout"]
            events += self._define_layout(Layout(layout_id, descs, mapping if kind == "arrays" else None, chunks))
        return self._arrived(kind, msg["lease"], descs, mapping, None, chunks, layout_id, events)

    def _arrived(self, kind: str, lease: int, descs: list[ArrayDescriptor], mapping: bool, ordering: str | None,
                 chunks: dict[int, ChunkFact], layout_id: int | None, events: list[Event]) -> list[Event]:
        if lease in self._held:
            raise ProtocolError(f"lease {lease} is already held")
        if descs and self.phase is not _CLOSING:  # (closing: dropped; the peer releases at the end)
            self._held.add(lease)
            events.append(ArraysArrived(kind, lease, descs, mapping, ordering, tuple(chunks), layout_id))
        elif not descs and self.phase is _OPEN:
            events.append(EmptyBatch(lease))
        return events

    def _define_layout(self, layout: Layout) -> list[Event]:
        """Keep a layout the peer defined: a batch's among the last ``max_layouts``, one array's among
        the last ``max_single_layouts``, first in, first out, as the exporter forgets them."""
        if layout.id in self._layouts or layout.id in self._single_layouts:
            raise ProtocolError(f"layout {layout.id} defined twice")
        kept, limit = ((self._single_layouts, self.max_single_layouts) if layout.mapping is None
                       else (self._layouts, self.max_layouts))
        kept[layout.id] = layout
        if len(kept) > limit:
            gone = next(iter(kept))
            del kept[gone]
            return [LayoutForgotten(gone)]
        return []
