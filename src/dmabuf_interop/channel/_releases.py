"""The importer's releases: a lease released here goes out at once in the caller's thread, or gathered
with others of its burst by a flusher thread (see Note [channel threads and fork] in :mod:`.channel`).

Measured and load-bearing: a release that goes out inline when none went out within :data:`RELEASE_GAP`
reaches the exporter before its next send, not during it; a busy consumer's releases gather
(:data:`RELEASE_BATCH` at a time, or within :data:`RELEASE_DELAY`) into one ``release`` message.

Where the connection has the shared-memory ring (:mod:`._ring`), a release goes into the release ring at once,
in the releasing thread: no syscall, unless the exporter's reader sleeps and asked to be woken for releases (then
one ``send`` on its wake socket wakes it right after the release, before the exporter's next send rather than
inside it; Note [waking for releases] in :mod:`._ring`); only what does not fit in the ring goes as a ``release``
message, by the rules above.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import DmaBufError, LocalError, ProtocolError
from ._ring import LEASE_LIMIT
from .wire import encode_release, shut_down

__all__ = ["ReleaseQueue", "RELEASE_DELAY", "RELEASE_GAP", "RELEASE_BATCH"]

#: How long a released block may wait to be batched with others before its ``release`` message goes out, seconds.
RELEASE_DELAY = 0.002
#: A release this long after the last ``release`` message goes out at once, in the caller's thread, seconds.
RELEASE_GAP = 0.0002
#: This many releases waiting go out at once, in the caller's thread (a busy consumer's batch).
RELEASE_BATCH = 16


class ReleaseQueue:
    """The releases of one channel waiting to go out, and the flusher thread that sends them.

    Args:
        link: the channel's :class:`._link.Link` (its writer, whose lock is the send lock).
        cond: the channel's state Condition, under which ``pending`` changes.
        lock: the lock ``cond`` is over, held directly by :meth:`add`, which every release takes (a
            Condition's ``with`` is one Python call more).
        proto: the channel's :class:`._state.ConnectionState` (nothing is due once it is over).
        rings: the channel's :class:`._ring.Rings` (``None``: no ring), used once the peer's is attached.
    """

    def __init__(self, link: Any, cond: threading.Condition, lock: Any, proto: Any, rings: Any = None) -> None:
        self._link = link
        self._rings = rings
        self._cond = cond
        self._lock = lock
        self._proto = proto
        self.pending: list[int] = []  # lease ids (changed under cond)
        self._last_flush = 0.0  # time.monotonic() of the last release message
        self._flusher: threading.Thread | None = None
        # The flusher has its own wake-up, so that it never competes with recv() for the GIL when an array arrives.
        self._wake = threading.Event()

    def add(self, lease_id: int, *, inline: bool = False) -> None:
        """The peer's lease ``lease_id`` was released here: the state forgets it held it
        (:meth:`._state.ConnectionState.released`, under the same hold of the state lock), and its release
        goes out: through the release ring, or with ``inline``, now, in the caller's thread, when no
        release went out within :data:`RELEASE_GAP` (so the exporter reads it before its next send,
        not during it) or :data:`RELEASE_BATCH` are waiting; otherwise the flusher thread sends it
        with the others of its burst, within :data:`RELEASE_DELAY`, or ``recv`` does when it is
        about to wait and nothing has arrived."""
        with self._lock:
            if not self._proto.released(lease_id):
                return  # over: the peer completes every lease itself
            try:
                rings = self._rings
                if rings is not None and not self.pending and rings.attached and lease_id < LEASE_LIMIT:
                    try:
                        if not rings.push_releases([lease_id]):
                            return  # in the release ring (under the state lock: one writer at a time)
                    except ProtocolError as exc:  # the peer's rel_head is out of step: end the connection
                        self._proto.fail(exc)
                        shut_down(self._link.sock)  # (the reader sees it and ends the connection; no send here)
                        return
                    except (DmaBufError, OSError):
                        pass  # (the wake-up's send failed): by the socket, as below
                self.pending.append(lease_id)
            except BaseException as exc:  # an interrupt with the release forgotten here and maybe not out
                self._interrupted(exc)
                raise
            n = len(self.pending)
            inline = inline and (n >= RELEASE_BATCH or (n == 1 and time.monotonic() - self._last_flush >= RELEASE_GAP))
        # Non-blocking: while another thread sends, the flusher takes this one.
        if inline:
            with self._link.held_if_free() as got:
                if got:
                    self.flush(send_lock_held=True)
                    return
        self._start_flusher()

    def _start_flusher(self) -> None:
        """Wake the flusher thread, which sends the pending releases (started at its first need)."""
        with self._cond:
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name="dmabuf-interop-channel-release",
                                                 daemon=True)
                self._flusher.start()
        self._wake.set()

    def flush(self, *, send_lock_held: bool = False, timeout: float | None = None) -> None:
        """Send every pending release now, in one message (essential: one the peer took none of ends the
        connection). A connection that has ended releases everything on the peer's side anyway."""
        with self._cond:
            ids, self.pending = self.pending, []
            if ids:
                self._last_flush = time.monotonic()
        if ids and not send_lock_held and self._link.held_here():
            # This thread's own send holds the lock (a recv or release in a signal handler): the flusher sends
            # them once it lets go; a send here would be refused, and the releases lost.
            with self._cond:
                self.pending[:0] = ids
            self._start_flusher()
            return
        if ids:
            link = self._link
            try:
                msg = encode_release(ids)
                link.clear_unsent()
                if send_lock_held:
                    link.send_locked(msg, timeout=timeout, essential=True)
                else:
                    link.send(msg, essential=True)
            except (DmaBufError, OSError):
                pass  # the connection has ended (or broke, or was ended here): the exporter releases everything
            except BaseException as exc:
                if link.was_unsent(exc):  # an interrupt in the wait, nothing sent: they go with the next flush
                    with self._cond:
                        self.pending[:0] = ids
                else:
                    self._interrupted(exc)
                raise

    def _interrupted(self, exc: BaseException) -> None:
        """``exc`` (an interrupt, KeyboardInterrupt, or a failure no check foresaw) came between a release
        forgotten here and its going out: the peer would hold the lease for good. End the connection (the peer
        completes every lease); Note [interrupted handling], in :mod:`._reader`."""
        self._proto.fail(LocalError(f"{type(exc).__name__} cut a release short: the connection was ended"))
        shut_down(self._link.sock)

    def wake(self) -> None:
        """Wake the flusher (it exits once the connection is over)."""
        self._wake.set()

    def _flush_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()  # a release after this is flushed below or wakes us again
            if self._proto.over:
                return
            time.sleep(RELEASE_DELAY)  # let a burst of releases share one message
            self.flush()
