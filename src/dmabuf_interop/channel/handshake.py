"""How every channel connection begins, local (:mod:`.rendezvous`) or ``tcp://`` (:mod:`.remote`).

``hello`` carries the protocol and library versions, the kernel's boot id, the
GPUs this process sees, its pid and the shared-memory ring it offers (local channels only); ``refuse`` carries the reason a side will
not go on, after which it closes the connection. :class:`ListenerBase` is what
both kinds of listener share: the accept loop, the handshakes in flight, and closing.

Note [concurrent handshakes]
----------------------------
A listener must not let one connection hold up the next: a client that connects and says nothing (or
half a hello, or an HTTP request to a ``tcp://`` port) would otherwise keep every consumer queued
behind it waiting. So :meth:`ListenerBase.accept` only *takes* connections (``accept(2)``, non-blocking,
as many as the backlog holds, at most :data:`MAX_HANDSHAKES` in flight or waiting to be taken) and
hands each to a thread of its own that runs the handshake under the listener's ``handshake_timeout``,
whatever the caller's ``accept`` timeout. A completed handshake's channel (or, for
``accept(raise_refused=True)``, a refusal) goes to a queue; ``accept`` returns the first in the queue,
waiting on the listening socket and an eventfd the threads signal, and raises
:class:`~..errors.WaitTimeoutError` at its own deadline. A peer that fails its handshake is told why
(``refuse``, best effort), dropped, counted (:attr:`ListenerBase.refused`) and logged on the
``dmabuf_interop.channel`` logger; a peer that simply left is dropped quietly. Nothing but ``accept`` ever
calls ``accept(2)``: a listener nobody accepts on leaves its connections in the kernel's backlog.

``close()`` shuts the listening socket and every connection in flight down (which wakes their threads
out of ``poll``), joins the threads, closes the channels nobody took, and closes the fds once no
``accept`` call is inside any more: no handshake thread outlives ``close()``.

At ``RLIMIT_NOFILE`` (``accept(2)`` -> ``EMFILE``/``ENFILE``) the listener closes a spare fd it holds for
this, accepts the pending connection, refuses it naming the limit, closes it and reopens the spare
(libuv's trick), raises :class:`~..errors.SyscallError` once, and backs off (0.1 s, doubling to 1 s)
before it calls ``accept(2)`` again: the consumer learns why at once and a retrying serve loop does not spin.

fork(): only the process that created a listener may use it or shut it down. In a forked child
``accept`` raises :class:`~..errors.ForkedResourceError` and ``close()`` (also at the child's exit) only
closes the child's copies of the fds: no ``shutdown``, no unlink, no lock taken (a lock may be held by a
thread that does not exist in the child).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import select
import socket
import threading
import time
import weakref
from typing import Any, Callable

from .._time import check_timeout, deadline_after
from ..errors import (DmaBufError, ForkedResourceError, InvalidArgumentError, PeerClosedError, PeerRefusedError,
                      ProtocolError, SyscallError, WaitTimeoutError)
from .protocol import MAX_METADATA_BYTES, PROTOCOL_VERSION, host_boot_id, parse_message
from .wire import recv_frame, send_frame, shut_down

__all__ = ["hello", "refuse", "recv_hello", "recv_handshake_frame", "ListenerBase", "HANDSHAKE_TIMEOUT",
           "MAX_HANDSHAKES", "HANDSHAKE_MAX_FRAME"]

#: Seconds an accepted connection has to complete its handshake (the default of ``listen(handshake_timeout=)``).
HANDSHAKE_TIMEOUT = 10.0
#: Handshakes a listener runs at once, plus channels completed and not yet taken by ``accept``; further
#: connections wait in the kernel's backlog.
MAX_HANDSHAKES = 32
#: Largest body of a handshake message, bytes (a ``nixl`` message carries up to 1 MiB of metadata in base64).
HANDSHAKE_MAX_FRAME = MAX_METADATA_BYTES * 4 // 3 + 4096
#: Seconds a refusal may take to send: it is best effort, to a peer that may not read.
REFUSE_TIMEOUT = 1.0
#: Back-off after ``accept(2)`` failed for want of fds or memory: first, longest (seconds).
ACCEPT_BACKOFF = (0.1, 1.0)
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

log = logging.getLogger("dmabuf_interop.channel")


def hello(overrides: dict[str, Any] | None, gpus: list[str], ring: int | None = None) -> dict[str, Any]:
    """This side's ``hello`` (``overrides`` replace fields, for tests of the refusals); ``ring``: the
    shared-memory ring format this side offers (:data:`._ring.RING_VERSION`), or ``None``."""
    from .. import __version__

    msg = {"kind": "hello", "protocol": PROTOCOL_VERSION, "library": __version__,
           "boot_id": host_boot_id(), "gpus": gpus, "pid": os.getpid(), "ring": ring}
    if overrides:
        msg.update(overrides)
    return msg


def refuse(sock: socket.socket, reason: str) -> None:
    """Tell the peer why (best effort, within :data:`REFUSE_TIMEOUT`: it may have gone or stopped
    reading), then close ``sock``."""
    try:
        send_frame(sock, {"kind": "refuse", "reason": reason}, timeout=REFUSE_TIMEOUT)
    except (DmaBufError, OSError):
        pass
    sock.close()


def recv_handshake_frame(sock: socket.socket, timeout: float | None) -> tuple[dict[str, Any], list[int]]:
    """One handshake message: the whole of it within ``timeout`` (a peer that sends part of one and stops
    is not given more), at most :data:`HANDSHAKE_MAX_FRAME` bytes. Raises as :func:`.wire.recv_frame`."""
    return recv_frame(sock, timeout, whole=True, max_bytes=HANDSHAKE_MAX_FRAME)


def recv_hello(sock: socket.socket, timeout: float | None) -> dict[str, Any]:
    """The peer's validated ``hello``, all of it within ``timeout`` seconds.

    Raises:
        PeerRefusedError: the peer refused us (its reason is in the message).
        ProtocolError: another message, a malformed one, or one that carried an fd (closed).
        PeerClosedError, WaitTimeoutError: the peer left, or did not send its hello within ``timeout`` seconds.
    """
    msg, fds = recv_handshake_frame(sock, timeout)
    if fds:
        from ..fdpass import close_fds

        close_fds(fds)
        raise ProtocolError("the handshake carried an fd")
    kind, _ = parse_message(msg)
    if kind == "refuse":
        raise PeerRefusedError(f"the peer refused this connection: {msg['reason']}")
    if kind != "hello":
        raise ProtocolError(f"expected a hello message, got {kind!r}")
    return msg


class Acceptor:
    """What a listener owns apart from its address: the listening socket, the handshakes in flight and the
    channels they completed (Note [concurrent handshakes]). It holds no reference to its listener, so a
    listener dropped without ``close()`` is collected and its finalizer closes this.

    ``handshake(conn, deadline)`` runs in a thread per connection and returns the channel, or raises
    (having sent ``refuse`` where it had a reason to give); ``describe(conn, addr)`` names the peer in logs.
    """

    def __init__(self, sock: socket.socket, address: str, handshake: Callable[[socket.socket, float | None], Any],
                 describe: Callable[[socket.socket, Any], str], handshake_timeout: float | None) -> None:
        self.owner = os.getpid()
        self.address = address
        self.sock = sock
        self.handshake = handshake
        self.describe = describe
        self.handshake_timeout = check_timeout(handshake_timeout)
        self.mutex = threading.Lock()
        self.channels: collections.deque[tuple[int, Any]] = collections.deque()  # (seq, completed channel)
        self.refusals: collections.deque[tuple[int, BaseException]] = collections.deque(maxlen=MAX_HANDSHAKES)
        self.seq = 0
        self.inflight: dict[int, tuple[socket.socket, threading.Thread]] = {}
        self.refused = 0
        self.stopped = False
        self.inside = 0  # accept() calls that may still use the fds
        self.fds_closed = False
        self.signalled = False
        self.backoff = 0.0
        self.retry_at = 0.0
        sock.setblocking(False)  # accept(2) is called only when poll says a connection waits; never blocks
        try:
            self.wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except OSError as exc:
            raise SyscallError("eventfd", exc) from exc
        self.spare = _open_spare()

    # -- accept
    def accept(self, timeout: float | None, raise_refused: bool) -> Any:
        if os.getpid() != self.owner:
            raise ForkedResourceError(f"the listener on {self.address}", self.owner)
        deadline = deadline_after(timeout)
        with self.mutex:
            if self.stopped:
                raise InvalidArgumentError(f"the listener on {self.address} is closed")
            self.inside += 1
        try:
            while True:
                got = self._take_ready(raise_refused)
                if got is not None:
                    return got
                self._take_connections()
                if not self._wait(deadline):
                    got = self._take_ready(raise_refused)
                    if got is not None:
                        return got
                    raise WaitTimeoutError(f"no channel consumer completed its handshake on {self.address} "
                                           f"within {timeout} s")
        finally:
            with self.mutex:
                self.inside -= 1
                last = self.stopped and self.inside == 0
            if last:
                self._release_fds()

    def _take_ready(self, raise_refused: bool) -> Any:
        """The first completed channel (or, with ``raise_refused``, an earlier refusal, raised); None if none."""
        with self.mutex:
            if self.stopped:
                raise InvalidArgumentError(f"the listener on {self.address} was closed")
            got: Any = None
            error: BaseException | None = None
            if raise_refused and self.refusals and (not self.channels or self.refusals[0][0] < self.channels[0][0]):
                error = self.refusals.popleft()[1]
            else:
                if not raise_refused:
                    self.refusals.clear()
                if self.channels:
                    got = self.channels.popleft()[1]
            if not self.channels and not (raise_refused and self.refusals):
                self._clear_signal()
        if error is not None:
            raise error
        return got

    def _room(self) -> bool:
        return len(self.inflight) + len(self.channels) < MAX_HANDSHAKES

    def _take_connections(self) -> None:
        """``accept(2)`` every connection waiting (non-blocking), up to :data:`MAX_HANDSHAKES`, each handed to
        a handshake thread. At the fd limit: refuse the pending one, back off, raise SyscallError."""
        if time.monotonic() < self.retry_at:
            return
        while True:
            with self.mutex:
                if self.stopped or not self._room():
                    return
            try:
                conn, addr = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if self.stopped:
                    raise InvalidArgumentError(f"the listener on {self.address} was closed") from exc
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # that connection went before it was taken: the next one
                if exc.errno in _RESOURCE_ERRNOS:
                    raise self._at_limit(exc) from exc
                raise SyscallError(f"accept on {self.address}", exc) from exc
            self.backoff = 0.0
            self._start_handshake(conn, addr)

    def _at_limit(self, exc: OSError) -> SyscallError:
        """``accept(2)`` failed for want of fds (or memory): refuse the pending connection with the reason,
        using the spare fd, and back off before the next ``accept(2)``."""
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        want = "file descriptors" if exc.errno in (errno.EMFILE, errno.ENFILE) else "memory"
        reason = (f"the listener on {self.address} is out of {want} (accept -> {name}; "
                  f"RLIMIT_NOFILE soft limit {soft}): try again later")
        with self.mutex:
            spare, self.spare = self.spare, None
        if spare is not None:
            os.close(spare)
            try:
                conn, _ = self.sock.accept()
            except OSError:
                pass
            else:
                refuse(conn, reason)
            spare = _open_spare()
            with self.mutex:
                if self.fds_closed or self.spare is not None:
                    if spare is not None:
                        os.close(spare)
                else:
                    self.spare = spare
        self.backoff = min(max(self.backoff * 2, ACCEPT_BACKOFF[0]), ACCEPT_BACKOFF[1])
        self.retry_at = time.monotonic() + self.backoff
        log.warning("%s; the pending connection was refused; accept(2) again in %.1f s", reason, self.backoff)
        return SyscallError(f"accept on {self.address} (RLIMIT_NOFILE soft limit {soft}; the pending connection "
                            f"was refused, next accept(2) in {self.backoff:g} s)", exc)

    def _wait(self, deadline: float | None) -> bool:
        """``poll`` the eventfd (a handshake ended) and, while there is room and no back-off, the listening
        socket, until ``deadline``; False once it has passed."""
        poller = select.poll()
        poller.register(self.wake, select.POLLIN)
        now = time.monotonic()
        until = deadline
        with self.mutex:
            room = self._room()
        if room and now >= self.retry_at:
            poller.register(self.sock, select.POLLIN | select.POLLHUP | select.POLLERR)
        elif room:  # backing off: wake when it ends
            until = self.retry_at if deadline is None else min(deadline, self.retry_at)
        if until is None:
            ms = -1
        else:
            left = until - now
            if left <= 0:
                return deadline is None or deadline > now
            ms = min(2**31 - 1, max(1, int(left * 1000 + 0.999)))
        poller.poll(ms)  # PEP 475: EINTR is retried for us
        return deadline is None or time.monotonic() < deadline

    def _signal(self) -> None:  # (under mutex) wake every accept() waiting: something is ready or a slot is free
        if not self.signalled and not self.fds_closed:
            os.eventfd_write(self.wake, 1)
            self.signalled = True

    def _clear_signal(self) -> None:  # (under mutex)
        if self.signalled and not self.fds_closed:
            try:
                os.eventfd_read(self.wake)
            except BlockingIOError:
                pass
            self.signalled = False

    # -- the handshake threads
    def _start_handshake(self, conn: socket.socket, addr: Any) -> None:
        t = threading.Thread(target=self._run_handshake, args=(conn, addr), daemon=True,
                             name=f"dmabuf-interop handshake {self.address}")
        with self.mutex:
            self.inflight[id(conn)] = (conn, t)
        try:
            t.start()
        except BaseException:
            with self.mutex:
                self.inflight.pop(id(conn), None)
            refuse(conn, "the listener could not start a handshake")
            raise

    def _run_handshake(self, conn: socket.socket, addr: Any) -> None:
        result: Any = None
        error: BaseException | None = None
        peer = "a peer"
        try:
            peer = self.describe(conn, addr)
            result = self.handshake(conn, deadline_after(self.handshake_timeout))
        except BaseException as exc:  # noqa: BLE001 - every failure is the peer's end, logged and counted
            error = exc
        if isinstance(error, WaitTimeoutError):
            error = WaitTimeoutError(f"no complete handshake within {self.handshake_timeout} s ({error})")
        quiet = isinstance(error, PeerClosedError)  # it left (gave up, or a liveness probe): not a refusal
        with self.mutex:
            self.inflight.pop(id(conn), None)
            stopped = self.stopped
            if not stopped:
                self.seq += 1
                if error is None:
                    self.channels.append((self.seq, result))
                elif not quiet:
                    self.refused += 1
                    self.refusals.append((self.seq, error))
                self._signal()
        if error is None:
            if stopped:
                _close_quietly(result)
            return
        if conn.fileno() >= 0:
            if quiet or stopped or isinstance(error, PeerRefusedError):
                conn.close()  # (a refusal of ours was sent already; the peer's own needs no answer)
            else:
                refuse(conn, f"handshake failed: {error}")
        if stopped:
            return
        if quiet:
            log.debug("a connection from %s on %s left during its handshake: %s", peer, self.address, error)
        elif isinstance(error, DmaBufError):
            log.warning("dropped a connection from %s on %s: %s", peer, self.address, error)
        else:
            log.error("a handshake with %s on %s failed", peer, self.address, exc_info=error)

    # -- closing
    def close(self) -> None:
        """Stop: wake and join every handshake thread, close the channels nobody took, the fds once no
        ``accept`` is inside. In a forked child: close this process's copies of the fds, nothing else."""
        if os.getpid() != self.owner:
            self._close_inherited()
            return
        with self.mutex:
            if self.stopped:
                return
            self.stopped = True
            inflight = list(self.inflight.values())
            ready = [ch for _, ch in self.channels]
            self.channels.clear()
            self.refusals.clear()
            self._signal()  # wakes accept() callers waiting on the eventfd
            release = self.inside == 0
        shut_down(self.sock)  # ... and those polling the listening socket
        for conn, _ in inflight:
            shut_down(conn)  # wakes the handshake thread out of poll
        me = threading.current_thread()
        for _, t in inflight:
            if t is not me:
                t.join(HANDSHAKE_JOIN)
                if t.is_alive():
                    log.error("a handshake thread on %s did not end within %s s of close()", self.address,
                              HANDSHAKE_JOIN)
        for ch in ready:
            _close_quietly(ch)
        if release:
            self._release_fds()

    def _release_fds(self) -> None:
        with self.mutex:
            if self.fds_closed:
                return
            self.fds_closed = True
            os.close(self.wake)
            if self.spare is not None:
                os.close(self.spare)
                self.spare = None
        self.sock.close()

    def _close_inherited(self) -> None:
        # No lock, no shutdown, no thread: this child has none of its parent's threads, and a lock may be
        # held by one of them forever. Closing our copies of the fds touches nothing of the parent's.
        if self.fds_closed:
            return
        self.fds_closed = True
        self.stopped = True
        for conn, _ in list(self.inflight.values()):
            conn.close()
        self.inflight.clear()
        for fd in (self.wake, self.spare):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.spare = None
        self.sock.close()


#: Seconds ``close()`` waits for a handshake thread it has woken (a NIXL agent being made may take a while).
HANDSHAKE_JOIN = 10.0


def _open_spare() -> int | None:
    """The fd kept to be closed when ``accept(2)`` hits the fd limit (``None`` where ``/dev/null`` is missing)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _close_quietly(ch: Any) -> None:
    try:
        ch.close()
    except Exception:  # noqa: BLE001 - a channel nobody took: its peer sees the end either way
        log.debug("closing an untaken channel failed", exc_info=True)


class ListenerBase:
    """What both kinds of listener share: :meth:`accept`, :attr:`refused`, closing. A subclass calls
    :meth:`_start` with its listening socket, its handshake (run in a thread per connection) and how to
    name a peer, and may pass ``cleanup(owner)`` (run after the socket is closed; ``owner`` is false in a
    process that inherited the listener through ``fork()``)."""

    address: str

    def _start(self, sock: socket.socket, address: str, handshake: Callable[[socket.socket, float | None], Any],
               describe: Callable[[socket.socket, Any], str], handshake_timeout: float | None,
               cleanup: Callable[[bool], None] | None = None) -> None:
        self.address = address
        self._acceptor = Acceptor(sock, address, handshake, describe, handshake_timeout)
        self._finalizer = weakref.finalize(self, _close_listener, self._acceptor, cleanup)

    def fileno(self) -> int:
        """The listening socket's fd (for a caller's own ``poll``: readable when a consumer connects)."""
        return self._acceptor.sock.fileno()

    def accept(self, timeout: float | None = 60.0, *, raise_refused: bool = False) -> Any:
        """The next channel whose handshake completed (Note [concurrent handshakes]); the subclass names its
        errors."""
        return self._acceptor.accept(timeout, raise_refused)

    @property
    def refused(self) -> int:
        """How many connections failed their handshake and were dropped so far (a peer that just left is
        not counted)."""
        return self._acceptor.refused

    @property
    def handshaking(self) -> int:
        """Connections taken by ``accept(2)`` whose handshake has not ended yet (their peers' ``connect``
        may have returned already: a peer is done once it has sent its hello, the listener once it has
        checked it)."""
        with self._acceptor.mutex:
            return len(self._acceptor.inflight)

    @property
    def handshake_timeout(self) -> float | None:
        """Seconds each accepted connection has to complete its handshake (``None``: no limit)."""
        return self._acceptor.handshake_timeout

    def close(self) -> None:
        """Stop listening (idempotent): a thread waiting in :meth:`accept` is woken, every handshake in flight
        is ended and its thread joined, channels completed but not taken are closed. In a process that
        inherited the listener through ``fork()`` it only closes that process's copies of the fds."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "ListenerBase":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.address!r} {'closed' if self.closed else 'open'}>"


def _close_listener(acceptor: Acceptor, cleanup: Callable[[bool], None] | None) -> None:
    acceptor.close()
    if cleanup is not None:
        cleanup(os.getpid() == acceptor.owner)
