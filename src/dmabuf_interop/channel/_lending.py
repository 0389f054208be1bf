"""The lending side of a :class:`.channel.Channel`: what its ``send`` and ``send_many`` do once they have their
arguments.

:class:`Lending` holds the channel's methods that lend (they use the channel's attributes, as
:class:`._reader.Reading` does for reading): announce a chunk to the peer the first time a block of it is
lent; place the arrays (:mod:`.sending`) and lend them under a new lease; send the message that defines a
layout, or repeat one the peer knows, by the socket or, without ``meta``, through the shared-memory ring
(:mod:`._ring`); take the releases the peer put in its release ring; and retire a chunk that its pool gives
back. Which lock guards which call, and the lock order: Note [channel threads and fork], in :mod:`.channel`.

Note [the steady-state lanes]. Most hand-offs of a long-lived channel are the same one: an array lent again where
it lay (a ring of pool blocks), repeated through the shared-memory ring, taken by a consumer that reads in its own
thread. Each Python step of it costs a process that was just woken (or that shares its core with a spinning peer)
two to three times what it costs warm, and the hand-off is a chain of such steps, so both ends take that case by a
lane of its own that goes straight through the same checks and the same state machine calls, and hands anything
else to the general path, which decides as before.

- ``send`` -> :meth:`Lending._send_ready`. A host array's repeat is published there, flat: the memo found by the
  array's address (:meth:`.sending.MemoTable.single_again`), the send lock taken inline, then under the state lock
  the slot published (the writing cursor's ``push_plain``, :mod:`._ring`) and the lease made and recorded after
  it, which a release of it needs; what can wait comes after the publish (the release ring's backlog, the time
  of the send, a deadline, made only where it is needed). A device array's goes by :meth:`Lending._lend_again`,
  which the general path shares; :meth:`Lending._lend_out` where the ring cannot take it.
- ``recv`` -> :meth:`._reader.Reading._recv_ready` (the slot next in the peer's order) -> its
  :meth:`._reader.Reading._take_ready`: a slot repeating one array's layout as defined is taken by
  :meth:`._state.ConnectionState.receive_slot_as_defined` and its Received made there; any other by
  :meth:`._state.ConnectionState.receive_slot`, its arrival kept out of the queue.

A lane decides nothing of its own: where its case does not hold it returns ``None`` having done nothing (``send``),
or having read what came instead under the same hold of the read lock (``recv``), and the general path goes on.
Measured with CPython 3.11.7 on the 2-core x86-64 CPU machine, both ends in one process, no reader thread, the 10th
percentile of 19,000 hand-offs of a 4 KiB host block: at 41bddd4 ``send`` up to the publish 2.85-2.88 us,
``recv`` 4.26-4.36 us, ``as_array`` 1.10-1.13 us; with these lanes, the rings' cursors in C (:mod:`._ring`) and an
imported chunk's references without a lock (:class:`._carrier.ImportedChunk`), 1.63 us, 2.34 us and 0.85 us;
between two processes with a spinning consumer (docs/benchmarks.md, "Host memory") the hand-off's median from
10.2-11.2 us to 5.9-7.0 us.
"""

from __future__ import annotations

import base64
import functools
import logging
import time
from typing import Any

from .. import _forks
from .._time import LONGEST, check_timeout, deadline_after
from ..errors import (ClosedError, DmaBufError, ForkedResourceError, InvalidArgumentError, LocalError, ProtocolError,
                      SyscallError)
from ._link import nested_send_error
from ._reader import _ring_releases
from ._ring_region import LEASE_LIMIT
from .lease import Lease, next_lease_id
from .pool import Block
from .sending import Memo, Placed, check_meta, order_writes, prepare, stream_handle, wire_descs
from .wire import encode_repeat, shut_down

__all__ = ["Lending"]

log = logging.getLogger("dmabuf_interop.channel")
_MAX_SLOT_LAYOUT = (1 << 32) - 1  # a ring slot's layout field is a u32
_monotonic = time.monotonic


class Lending:
    """The methods of a :class:`.channel.Channel` that lend arrays to the peer (``send`` and ``send_many`` call
    :meth:`_send_items`) and retire the chunks its pools give back."""

    def _announce(self, block: Block, deadline: float | None) -> None:
        chunk = block.chunk
        if self._proto.is_announced(chunk.id):
            return
        link = self._link
        with link.held_by(deadline):  # checked again: two threads may lend blocks of a new chunk at once
            link.run_due_held()  # a retire deferred meanwhile is counted before the chunk limit is checked
            if not self._proto.is_announced(chunk.id):
                if not self._proto.can_announce():  # the peer would refuse it and end the connection
                    raise InvalidArgumentError(f"the peer maps at most {self._proto.max_chunks} chunks of this end "
                                               f"at once (MAX_CHUNKS): send from fewer, larger chunks")
                link.clear_unsent()
                try:
                    with self._carrier.announce(block) as (msg, fds):
                        link.send_locked(msg, fds, timeout=link.wait_for(deadline))
                    self._proto.chunk_announced(chunk.id)
                except BaseException as exc:
                    # An interrupt after the message may have gone out, before it was counted: a second
                    # announcement of the chunk would break the protocol. The end (Note [interrupted handling]).
                    if not (isinstance(exc, Exception) or link.was_unsent(exc)):
                        self._end_unrecorded(exc)
                    raise
        block.pool._register_channel(self)

    def _retire_chunk(self, chunk_id: int) -> None:
        """Chunk ``chunk_id`` of a pool of this channel's is gone: forget placements in it, and tell the peer
        (``retire``) under the send lock, now if it is free, else once the thread that holds it lets go
        (:meth:`._link.Link.defer`): the pool's caller may have a timeout, and a send may hold the lock while it
        waits for a slow peer. Until then the chunk counts as announced, and nothing is lent from it (its pool
        has dropped it)."""
        if self._owner != _forks.pid:
            return  # a pool inherited through fork(): the parent's channel is the parent's
        self._carrier.retire(chunk_id)  # (tcp://: deregistered first, so NIXL refuses reads of it from now on)
        self._link.defer(functools.partial(self._retire_locked, chunk_id))

    def _retire_locked(self, chunk_id: int) -> None:
        self._memos.forget_chunk(chunk_id)  # placements in the chunk are gone
        # Uncounted and told under one hold of the lock: no chunk announced in between reaches the peer before
        # this retire (it would count one chunk more than this end does).
        if self._proto.retire_chunk(chunk_id):
            try:
                self._link.send_locked({"kind": "retire", "chunk": chunk_id}, essential=True)
            except (DmaBufError, OSError):
                pass  # the connection has ended (or broke, or was ended here): the peer unmaps everything anyway

    def _send_ready(self, array: Any, timeout: Any) -> Lease | None:
        """``send(array)`` in its steady state, in as few steps as it takes (Note [the steady-state lanes]): an
        array lent again where it lay, with no ``meta``, no stream and the channel's ordering, on a connection whose
        ring is attached. ``None``: another case, nothing done (:meth:`_send_items` takes it). Raises as ``send``.

        A host array's repeat is published in as few steps as :meth:`_lend_again` takes for it, and whatever can
        wait comes after the slot is out (load-bearing: each step before it is the hand-off's): the deadline, made
        only where the send lock is taken or the ring is full; the releases the peer's ring holds, taken when
        it is half full (a full one would send them by the socket, behind this end's unread arrays); the time
        of the send. A device array's repeat goes by :meth:`_lend_again`, its releases taken first."""
        rings = self._rings
        if rings is None or not rings.attached or self._owner != _forks.pid or self._proto.over:
            return None
        t = timeout.__class__
        if not ((t is float or t is int) and 0 <= timeout < LONGEST):  # (deadline_after's own fast check)
            check_timeout(timeout)  # raises for one that is not a number of seconds >= 0 (or None)
        memo = self._memos.single_again(array)  # (its block referenced again)
        if memo is None:
            return None
        if memo.dev_pool is not None:
            if rings.releases_backlogged():
                try:
                    self._take_ring_releases()
                except BaseException:
                    memo.by_pool[0][0]._unref_many(memo.blocks)  # (nothing lent: the reference goes back)
                    raise
            return self._lend_again(memo, 0, self._carrier.forced_ordering or self.ordering, deadline_after(timeout))
        # _lend_again's ring path for host memory (ordering "none", no event), flat.
        lease = None
        pushing = published = recorded = False
        link = self._link
        try:
            lease_id = next_lease_id()
            lock = link.lock
            # The send lock's take as _lend_again's (Note [the send lock's owner], in ._link).
            if lock._is_owned():
                raise nested_send_error()
            try:
                if not lock.acquire(False):
                    link.wait_by(deadline_after(timeout))
                with self._state_lock:
                    if not self._proto.can_send:  # (_push's checks, then Rings.push_host's publish)
                        raise link.ended()
                    layout = memo.layout
                    pushing = True  # (from here the slot may be out)
                    # (MemoTable.is_current, inline)
                    if (memo.current and layout is not None and layout <= _MAX_SLOT_LAYOUT and lease_id < LEASE_LIMIT
                            and rings.push_host(link.sent, lease_id, layout)):
                        published = True  # (out: its lease is recorded next, or the connection ends)
                        # (the slot went out before the lease was made: the peer's work begins that much sooner)
                        lease = Lease(lease_id, memo.blocks, None, None, self._waits)
                        self._proto.lend(lease_id, lease)
                        recorded = True
            finally:
                if lock._is_owned():
                    link.release()
        except BaseException as exc:
            if recorded:
                raise  # (lent and recorded: the peer's release, or the end, completes it)
            self._unpublished(exc, published, pushing, memo)
            if isinstance(exc, ProtocolError):  # (push_host: the peer's in_head out of range)
                self._waits._fail(exc)
                raise link.ended() from exc
            raise
        finally:
            if self._reader is None:  # (as _lend_out: the end of a connection a failed send broke is seen too)
                self._reader_after_send()
        if lease is None:  # (the ring full, the memo's layout no longer the peer's: by the socket)
            return self._lend_out(memo.blocks, memo.placed, None, "none", None, None, None, memo,
                                  deadline_after(timeout))
        self._conn.sent_at = _monotonic()  # (the reader may sleep unwoken by releases: Note [waking for releases])
        if rings.releases_backlogged():
            try:
                self._take_ring_releases()
            except DmaBufError:
                pass  # (the peer broke its release ring: the connection is ending, and this lease completes then)
        return lease

    def _lend_again(self, memo: Memo, stream: int, ordering: str, deadline: float | None) -> Lease:
        """Lend ``memo``'s one array again (its block referenced again), its writes on ``stream`` ordered
        (:func:`.sending.order_writes`), as a repeat of its layout in the ring: the slot published first, then the
        lease made and recorded, under one hold of the send lock and the state lock (Note [the steady-state lanes]).
        Where the ring cannot take it (full, the memo's layout no longer the peer's), :meth:`_lend_out`. On failure
        the block's reference (and the event) is given back."""
        if memo.dev_pool is None:
            order, event, events = "none", None, None  # (order_writes' answer for host memory, without the call)
        else:
            try:
                order, event, events = order_writes(memo.dev_pool, stream, ordering)
            except BaseException:
                memo.by_pool[0][0]._unref_many(memo.blocks)
                raise
        if self._rings is not None:
            lease = None
            lease_id = next_lease_id()
            link = self._link
            self._conn.sent_at = _monotonic()  # (the reader may sleep unwoken by releases: Note [waking for releases])
            pushing = published = recorded = False
            lock = link.lock
            try:
                # Load-bearing for the steady state's speed: link.held_by's take, inline (its with block costs
                # 0.3-0.4 µs a send). Refused before any take where this thread's own send holds the lock; taken
                # inside the try whose finally lets go where this thread holds it, so that an interrupt right
                # after the take cannot leave it held (Note [the send lock's owner], in ._link).
                if lock._is_owned():
                    raise nested_send_error()
                try:
                    if not lock.acquire(False):
                        link.wait_by(deadline)
                    with self._state_lock:
                        pushing = True  # (from here to the record the slot may be out: see the except below)
                        # Load-bearing: the slot goes out before the lease is made and recorded, so the peer's work
                        # begins that much sooner; its release is taken under this lock, so only after the record.
                        if self._memos.is_current(memo) and self._push(lease_id, memo.layout, order,
                                                                       None if event is None else event[1]):
                            published = True  # (out: its lease is recorded next, or the connection ends)
                            lease = Lease(lease_id, memo.blocks, event, events, self._waits)
                            self._proto.lend(lease_id, lease)
                            recorded = True
                        pushing = False
                finally:
                    if lock._is_owned():
                        link.release()
            except BaseException as exc:
                if recorded:
                    raise  # (lent and recorded: the peer's release, or the end, completes it)
                self._unpublished(exc, published, pushing, memo, event, events)
                raise
            finally:
                if self._reader is None:  # (as _lend_out: the end of a connection a failed send broke is seen too)
                    self._reader_after_send()
            if lease is not None:
                return lease
        return self._lend_out(memo.blocks, memo.placed, None, order, event, events, None, memo, deadline)

    def _unpublished(self, exc: BaseException, published: bool, pushing: bool, memo: Memo, event: Any = None,
                     events: Any = None) -> None:
        """A lane's repeat of ``memo`` raised ``exc`` before its lease was recorded. Where its slot is out
        (``published``) or may be (``pushing``, and an interrupt, or the wake-up's send that failed after the
        publish: a SyscallError), a release of it would be a forged one here: the connection ends, and the block
        keeps its reference (the peer may be reading it). Otherwise nothing was lent: the block's reference, and
        the event, go back."""
        if published or (pushing and (not isinstance(exc, Exception) or isinstance(exc, SyscallError))):
            self._end_unrecorded(exc)
        else:
            memo.by_pool[0][0]._unref_many(memo.blocks)
            if event is not None:
                events.give(event)

    def _send_items(self, names: list[str | None], arrays: list[Any], stream: Any, meta: dict[str, Any] | None,
                    timeout: float | None, ordering: str | None, batch: str | None) -> Lease:
        """``batch``: ``"mapping"`` or ``"list"`` (:meth:`.channel.Channel.send_many`), ``None``
        (:meth:`.channel.Channel.send`)."""
        if self._carrier.forced_ordering is not None:
            ordering = self._carrier.forced_ordering
        if meta is not None:  # (a call saved per send without meta)
            check_meta(meta)
        ordering = ordering or self.ordering
        if ordering not in ("event", "sync"):
            raise InvalidArgumentError(f"ordering must be 'event' or 'sync', got {ordering!r}")
        if self._owner != _forks.pid:
            raise ForkedResourceError("this channel", self._owner)
        deadline = deadline_after(timeout)  # checks it: a number of seconds >= 0, or None
        if self._proto.over:
            raise self._link.ended()
        # The blocks of leases released come back before anything new is placed; a placement lent again takes
        # none (its blocks are there), which leaves them to a wait, a poll or the reader (Note [waking for
        # releases], in ._ring): fewer steps between the call and the slot. Unless the peer's release ring is
        # half full: a full one sends its releases by the socket, behind whatever arrays this end's reader has
        # not read (a reader parked at max_queued reads nothing), and a wait would then never see them.
        take = None
        rings = self._rings
        h = 0 if stream is None else stream_handle(stream)
        if rings is not None and rings.attached:
            take = self._take_ring_releases
            if rings.releases_backlogged():
                take()
                take = None
            if batch is None and meta is None:
                memo = self._memos.single_again(arrays[0])  # (its block referenced again)
                if memo is not None:
                    return self._lend_again(memo, h, ordering, deadline)
        prep = prepare(self.pool, self._memos, names, arrays, h, timeout, ordering, batch is not None,
                       self.share_segments, self._auto, take)
        if not prep.again:  # (a placement lent again lies in chunks the peer has: a retire forgets it)
            try:
                for block in prep.heads:
                    self._announce(block, deadline)
            except BaseException:
                prep.unref()
                raise
        return self._lend_out(prep.blocks, prep.placed, batch, prep.order, prep.event, prep.events, meta, prep.memo,
                              deadline)

    def _lend_out(self, blocks: list[Block], placed: list[Placed], batch: str | None, order: str, event: Any,
                  events: Any, meta: dict[str, Any] | None, memo: Memo | None, deadline: float | None) -> Lease:
        """Lend ``blocks`` (each referenced for the lease) under a new lease, and send the message that does:
        a ring slot for a placement lent again without ``meta`` (:meth:`_push_again`), else :meth:`_send_batch`,
        or an ``array`` message for one array copied into a new block (no ``memo``). On failure the lease is
        completed ``"closed"``."""
        lease = Lease(next_lease_id(), blocks, event, events, self._waits)
        with self._state_lock:
            self._proto.lend(lease.id, lease)
        self._conn.sent_at = _monotonic()  # (the reader may sleep unwoken by releases: Note [waking for releases])
        raw = None if event is None else event[1]
        link = self._link
        link.clear_unsent()
        try:
            if not (memo is not None and meta is None and self._push_again(lease.id, memo, order, raw, deadline)):
                ev64 = base64.b64encode(raw).decode() if raw is not None else None
                if batch is None and memo is None:  # copied into a new block: nothing to repeat, no layout
                    wait = link.wait_for(deadline)
                    link.send({"kind": "array", "lease": lease.id,
                               "desc": wire_descs(placed, order, ev64, meta)[0]}, timeout=wait)
                else:
                    self._send_batch(lease.id, placed, None if batch is None else batch == "mapping", order, ev64,
                                     meta, memo, deadline, raw)
        except BaseException as exc:
            if not (isinstance(exc, Exception) or link.was_unsent(exc)):
                # A signal handler's exception (KeyboardInterrupt) where the message may have gone out: the lease
                # stays lent, and the connection ends (Note [interrupted handling], in ._reader).
                self._end_unrecorded(exc)
                raise
            with self._state:
                self._proto.unlend(lease.id)
            lease._complete("closed")
            raise
        finally:
            if self._reader is None:  # (the end of a connection a failed send broke is seen by it too)
                self._reader_after_send()
        return lease

    def _end_unrecorded(self, exc: BaseException) -> None:
        """``exc`` cut a send short where its slot or message may have gone out without the lease recorded (or
        with it recorded and about to be given up): a release of it would then be a forged one to this end, and
        its block could be written again while the peer reads it. End the connection: keep a ``LocalError``
        naming ``exc`` as the cause, and shut the socket down (the reader ends it; every lease completes then)."""
        with self._state:  # (send_failed: nothing more goes out, so the next send says how the connection ended)
            self._proto.send_failed(LocalError(f"{type(exc).__name__} cut a send short after its message may have "
                                               f"gone out: the connection was ended"))
        shut_down(self._sock)

    def _reader_after_send(self) -> None:
        """Start the background reader after the channel's first message (from :meth:`_lend_out`): the release
        of its lease must be read even if ``recv()`` is never called, and the end of a connection a send broke
        seen. Started once the message is out, not before: the peer takes it while the thread starts (a thread
        start costs 0.1-0.7 ms); a release that comes first waits in the socket or the ring. Not on a connection
        that has ended (a ``close()`` during the send). A thread that cannot start is logged, not raised: the
        message is out and its lease lent, so the caller gets the lease; the next send tries again (a ``recv``
        reads the socket meanwhile, and ``Lease.wait`` takes the releases in the ring itself)."""
        if self._proto.ended:
            return
        try:
            self._start_reader()
        except RuntimeError as exc:  # "can't start new thread"
            log.warning("the channel's background reader could not start (%s): its releases are read by the "
                        "next send or recv", exc)

    def _push_again(self, lease_id: int, memo: Memo, order: str, event: bytes | None, deadline: float | None) -> bool:
        """Publish a repeat of ``memo``'s layout in the ring (:meth:`_push`, under the send lock); False: not
        published (no ring, the memo's layout no longer the peer's, the ring full), for :meth:`_send_batch`."""
        if self._rings is None:
            return False
        with self._link.held_by(deadline):
            return self._memos.is_current(memo) and self._push(lease_id, memo.layout, order, event)

    def _send_batch(self, lease_id: int, placed: list[Placed], mapping: bool | None, order: str, ev64: str | None,
                    meta: dict[str, Any] | None, memo: Memo | None = None, deadline: float | None = None,
                    event: bytes | None = None) -> None:
        """Send an ``arrays`` message (``mapping`` true or false), or an ``array`` message (``mapping``
        None: one remembered array), defining a layout, or a ``repeat`` of one the peer already has: the
        same names in the same blocks with the same shapes, strides and dtypes (a model's state dict
        sent every step, a ring of blocks), so the peer validates and rebuilds nothing. ``memo``: the
        placement came from it (a repeat of its layout) or is to be remembered in it. ``deadline``: by when
        the message must begin to leave (``None``: :data:`._link.SEND_TIMEOUT`). ``event``: the raw handle ``ev64``
        encodes. A repeat of ``memo``'s layout goes by the socket here (:meth:`_lend_out` offered it to the ring
        first); one of a layout found here without ``meta`` goes through the ring when it has room (:meth:`_push`),
        else by the socket."""
        link = self._link
        if memo is not None:
            with link.held_by(deadline):
                if self._memos.is_current(memo):
                    link.send_locked(encode_repeat(lease_id, memo.layout, order, ev64, meta),
                                     timeout=link.wait_for(deadline))
                    return
        key = (mapping, tuple((p.name, p.block.chunk.id, p.block.offset, p.block.size, p.offset, p.shape, p.strides,
                               p.dtype) for p in placed))
        # Chosen, sent and remembered under one hold of the send lock: layouts reach the peer in the
        # order they are defined, and one counts as known only once its definition has gone out.
        with link.held_by(deadline):
            choice = self._proto.choose_layout(key, single=mapping is None)
            if not choice.define:
                if memo is not None:
                    self._memos.remember(memo, choice.id)
                if meta is None and self._rings is not None and self._push(lease_id, choice.id, order, event):
                    return
                link.send_locked(encode_repeat(lease_id, choice.id, order, ev64, meta), timeout=link.wait_for(deadline))
                return
            descs = wire_descs(placed, order, ev64, meta)
            link.clear_unsent()
            try:
                try:
                    if mapping is None:
                        link.send_locked({"kind": "array", "lease": lease_id, "desc": descs[0], "layout": choice.id},
                                         timeout=link.wait_for(deadline))
                    else:
                        link.send_locked({"kind": "arrays", "lease": lease_id, "items": descs, "mapping": mapping,
                                          "layout": choice.id}, timeout=link.wait_for(deadline))
                except InvalidArgumentError as exc:  # over MAX_FRAME: nothing was sent
                    if isinstance(exc, ClosedError):
                        raise
                    raise InvalidArgumentError(f"{exc}: send the batch as several send_many calls") from exc
                gone = self._proto.layout_sent(choice)  # first in, first out: the peer forgets the same one
                if memo is not None:
                    self._memos.remember(memo, choice.id)
                if gone is not None:
                    self._memos.forget_layout(gone)
            except BaseException as exc:
                # An interrupt after the definition may have gone out, before it was counted: the next one would
                # define the same id again. The end (Note [interrupted handling], in ._reader).
                if not (isinstance(exc, Exception) or link.was_unsent(exc)):
                    self._end_unrecorded(exc)
                raise

    def _push(self, lease_id: int, layout: int, order: str, event: bytes | None) -> bool:
        """(Under the send lock.) Publish a repeat in the ring, after the :attr:`._link.Link.sent` socket
        messages that went out before it (the peer handles it between those and the next); False: the ring
        is full or not attached yet (the peer's ``ring`` message not read yet), so it goes by the socket.

        Raises:
            PeerClosedError: the connection has ended, or the peer broke the protocol in its ring header (its
                ``in_head`` out of range: the connection is ending, the ProtocolError kept as the cause).
        """
        link = self._link
        # (A message cut off by a send of this channel made can_send false under this lock: no need to ask
        # fdpass's table of broken sockets, a weak dictionary, whose lookup makes a weakref every call.)
        if not self._proto.can_send:
            raise link.ended()
        if layout > _MAX_SLOT_LAYOUT or lease_id >= LEASE_LIMIT:
            return False  # (past what a slot holds: by the socket)
        try:
            return self._rings.push_repeat(link.sent, lease_id, layout, order, event)
        except ProtocolError as exc:  # the peer's in_head out of range: it broke the protocol, the connection ends
            self._waits._fail(exc)
            raise link.ended() from exc

    def _take_ring_releases(self) -> None:
        """Complete the leases the peer released through its release ring. A forged one (an id not lent) ends
        the connection: the reader sees the shutdown and ends it with the ProtocolError kept as its cause.

        Raises:
            PeerClosedError: the peer broke the protocol in its release ring (the connection is ending).
        """
        try:
            _ring_releases(self._conn)
        except ProtocolError as exc:
            self._waits._fail(exc)
            raise self._link.ended() from exc
