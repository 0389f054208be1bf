"""Leases and peers: a :class:`Lease` is a block (or blocks) lent to the peer until it releases them;
:class:`PeerInfo` says who the peer is."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Any

from .._time import check_timeout
from ..errors import WaitTimeoutError
from .pool import Block

__all__ = ["Lease", "PeerInfo", "next_lease_id", "LEASE_SPIN"]

#: Seconds :meth:`Lease.wait` polls the shared-memory ring for the release before it sleeps.
LEASE_SPIN = 20e-6

_monotonic = time.monotonic
_lease_ids = itertools.count(1)
#: A new lease id, unique within the process.
next_lease_id = _lease_ids.__next__


@dataclass(frozen=True)
class PeerInfo:
    """Who is on the other end.

    Attributes:
        pid, uid, gid: from ``SO_PEERCRED`` (the kernel's word, not the peer's).
        gpus: GPU UUIDs the peer can see (its ``hello``).
        library: the peer's dmabuf-interop version.
    """

    pid: int
    uid: int
    gid: int
    gpus: tuple[str, ...]
    library: str


class Lease:
    """A block lent to the peer; done once the peer released it (or went away).

    Attributes:
        id: the lease id on the wire.
        reason: ``"released"`` (the peer released it), ``"disconnected"`` or ``"closed"``; ``None`` while out.
    """

    # (Slots: a lease is made per send, and its attributes are set without a dict to make.)
    __slots__ = ("id", "_blocks", "_event", "_events", "_waits", "_waiters", "_out", "_once", "reason", "__weakref__")

    def __init__(self, lease_id: int, blocks: list[Block], event: tuple[Any, bytes] | None,
                 events: Any = None, waits: Any = None) -> None:
        self.id = lease_id
        self._blocks = blocks
        self._event = event
        self._events = events  # the EventPool that ``event`` goes back to
        # The connection's ring releases (._reader.ReleaseWaits), or None (no ring): a wait takes them and
        # asks to be woken for them (Note [waking for releases], in ._ring). Dropped once complete.
        self._waits = waits
        self._waiters = 0  # threads in wait() counted in by ``waits`` (changed under the connection's state lock)
        # Held while the lease is out; released once on completion. A bare lock, not a
        # threading.Event: a lease is made per send, and an Event costs a Condition and two locks.
        self._out = threading.Lock()
        self._out.acquire()
        # Completed once: the first _complete pops the token (list.pop is atomic), a later one finds none. Not a
        # second lock: a lock's allocation costs a send 1-2 us in a process idle between sends.
        self._once = [None]
        self.reason: str | None = None

    @property
    def done(self) -> bool:
        """Whether the peer has released the block(s) (or the connection ended). On a connection with the
        shared-memory ring a lease still out first takes the releases the peer has published there."""
        if not self._out.locked():
            return True
        waits = self._waits
        if waits is None:
            return False
        waits.take()
        return not self._out.locked()

    def wait(self, timeout: float | None = 60.0) -> None:
        """Wait until the peer has released the block(s). On a connection with the shared-memory ring, the
        releases published there are taken first, and the ring is polled for up to :data:`LEASE_SPIN` seconds
        (20 µs) before the thread sleeps.

        Args:
            timeout: seconds (``None`` or ``math.inf``: forever).

        Raises:
            WaitTimeoutError: still lent out after ``timeout`` seconds.
            InvalidArgumentError: ``timeout`` is not a number >= 0 or ``None``.
        """
        limit = check_timeout(timeout)
        if not self._out.locked():
            return
        waits = self._waits
        if waits is not None:
            # The release is often in the ring already (a pipelined producer's: a send lent again takes none):
            # taken as done() takes it, one hold of the state lock, not the two of a waiter counted in and out.
            waits.take()
            if not self._out.locked():
                return
            # Load-bearing for a pipelined producer: the ring is polled up to LEASE_SPIN before the sleep. A sleep
            # costs both processes more than that: the peer's wake-up for each release it then publishes, the
            # reader's wake and this thread's.
            spin = LEASE_SPIN if limit is None else min(LEASE_SPIN, limit)
            if spin > 0:
                until = _monotonic() + spin
                while _monotonic() < until:
                    waits.take()
                    if not self._out.locked():
                        return
        counted = waits is not None and waits.begin(self)  # a wait for a release: the reader must be woken for it
        try:
            got = self._out.acquire(timeout=-1 if limit is None else limit)
        finally:
            if counted:
                waits.end(self)
        if not got:
            raise WaitTimeoutError(f"lease {self.id} still held by the peer after {timeout} s")
        self._out.release()

    def _complete(self, reason: str) -> None:
        try:
            self._once.pop()
        except IndexError:
            return
        except BaseException:
            # An exception a signal handler raised as the pop returned (the only place it can come from here):
            # the claim is this thread's, so the lease is completed still (Note [interrupted handling], in ._reader).
            self._finish(reason)
            raise
        self._finish(reason)

    def _finish(self, reason: str) -> None:
        self.reason = reason
        try:
            blocks = self._blocks
            pool = blocks[0].pool if blocks else None
            # (one block, a send()'s: no generator to check that they share a pool)
            if blocks and (len(blocks) == 1 or all(b.pool is pool for b in blocks)):
                pool._unref_many(blocks)  # one hold of the pool's lock for a whole state dict
            else:
                for b in blocks:
                    b.pool._unref(b)
            if self._event is not None:
                self._events.give(self._event)
        finally:  # whatever giving back raised, the lease is over
            try:
                self._blocks = []
                waits, self._waits = self._waits, None  # (the connection's: no cycle through its leases from now on)
                if waits is not None and self._waiters:
                    waits.completed(self)  # counted out before they wake: the reader may sleep for slots only at once
            finally:  # (an interrupt in the counting out, too: the waiters are woken, the lease is done)
                self._out.release()

    def __repr__(self) -> str:
        return f"<Lease {self.id} {'done: ' + str(self.reason) if self.done else 'out'}>"
