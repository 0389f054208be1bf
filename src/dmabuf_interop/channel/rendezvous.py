"""Rendezvous: independently started processes find each other on an AF_UNIX address.

An address is a filesystem path (the socket is created owner-only, mode
0600, and never clobbers a file that is not a socket) or a Linux abstract name
``"@name"`` (no file; any local user could bind the name first, which the
connector's ``SO_PEERCRED`` check catches). Every accepted connection is
checked with ``SO_PEERCRED`` before a byte is read from it, then both sides
exchange a JSON ``hello`` (protocol and library versions, visible GPUs, the
kernel's boot id). A refusal sends a ``refuse`` message with the reason and
closes; the refused side raises :class:`~..errors.PeerRefusedError`.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
import time
import weakref
from typing import Any, Iterable

from .._time import deadline_after, remaining
from ..errors import InvalidArgumentError, PeerRefusedError, SyscallError, WaitTimeoutError
from ._autopool import join
from .channel import Channel, PeerInfo
from .handshake import ListenerBase, hello, recv_hello, refuse
from .pool import SharedPool
from .protocol import visible_gpu_uuids
from .wire import send_frame, shut_down

__all__ = ["listen", "connect", "Listener"]

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def _sockaddr(address: str | os.PathLike[str]) -> tuple[str, bool]:
    """(address for bind/connect, is_abstract)."""
    address = os.fspath(address)
    if not isinstance(address, str) or not address or address == "@":
        raise InvalidArgumentError(f"address must be a path or '@name', got {address!r}")
    if address.startswith("@"):
        return "\0" + address[1:], True
    return address, False


def _remote(address: Any, options: dict[str, Any]) -> bool:
    """``tcp://`` addresses go to :mod:`.remote`; its options are refused for local addresses."""
    if isinstance(address, str) and address.startswith("tcp://"):
        return True
    if options:
        raise InvalidArgumentError(f"{sorted(options)} only apply to tcp:// addresses")
    return False


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``getsockopt(SO_PEERCRED)``: the peer's (pid, uid, gid) as the kernel recorded them at connect.

    Raises:
        SyscallError: the getsockopt failed.
    """
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError as exc:
        raise SyscallError("getsockopt(SO_PEERCRED)", exc) from exc
    return _UCRED.unpack(raw)


def _allowed(uid: int, gid: int, allow_uids: Iterable[int] | None, allow_gids: Iterable[int] | None) -> bool:
    uids = set(allow_uids) if allow_uids is not None else {os.geteuid()}
    return uid in uids or (allow_gids is not None and gid in set(allow_gids))


def _check_hello(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """Why ``theirs`` is unacceptable, or ``None``."""
    if theirs["protocol"] != mine["protocol"]:
        return (f"protocol version mismatch: this side speaks {mine['protocol']}, "
                f"the peer {theirs['protocol']} (library {theirs['library']})")
    if theirs["boot_id"] != mine["boot_id"]:
        return (f"peer is on another host (boot id {theirs['boot_id']!r}, ours {mine['boot_id']!r}): "
                f"fds and shared memory cannot cross hosts")
    return None


def _unlink_if_ours(path: str, ino: tuple[int, int]) -> None:
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == ino:
            os.unlink(path)
    except OSError:
        pass


class Listener(ListenerBase):
    """A listening channel address; :meth:`accept` hands out one :class:`Channel` per consumer.

    Created by :func:`listen`; close it (or leave a ``with`` block) to stop
    listening and unlink the socket file (only if it is still ours).
    """

    def __init__(self, sock: socket.socket, address: str, path: str | None, *, pool: SharedPool | None,
                 allow_uids: Iterable[int] | None, allow_gids: Iterable[int] | None, ordering: str,
                 device: int | None, hello_overrides: dict[str, Any] | None) -> None:
        self.address = address
        self.pool = pool
        self._sock = sock
        self._allow_uids = None if allow_uids is None else frozenset(allow_uids)
        self._allow_gids = None if allow_gids is None else frozenset(allow_gids)
        self._ordering = ordering
        self._device = device
        self._hello_overrides = hello_overrides
        self._auto = join(self) if pool is None else None  # pools made on first need, shared by its channels
        ino = None
        if path is not None:
            st = os.lstat(path)
            ino = (st.st_dev, st.st_ino)
        self._finalizer = weakref.finalize(self, Listener._cleanup, sock, path, ino)

    @staticmethod
    def _cleanup(sock: socket.socket, path: str | None, ino: tuple[int, int] | None) -> None:
        shut_down(sock)  # wakes a thread waiting in accept()
        sock.close()
        if path is not None and ino is not None:
            _unlink_if_ours(path, ino)

    def accept(self, timeout: float | None = 60.0) -> Channel:
        """Wait for the next consumer and return its channel.

        Checks the peer's ``SO_PEERCRED`` (uid in ``allow_uids``, default this
        process's effective uid, or gid in ``allow_gids``), then exchanges
        ``hello`` messages. A refused peer gets a ``refuse`` message and this
        call raises; the listener stays open for the next one.

        A connection whose peer left before or during the handshake (a client
        that gave up waiting, the liveness check of a second :func:`listen` on
        the same path) is closed and skipped: the wait goes on for the next one.

        Raises:
            WaitTimeoutError: no consumer (or no complete hello) within ``timeout`` seconds.
            PeerRefusedError: the peer's credentials, protocol version or host were refused,
                or the peer refused us.
            ProtocolError: the peer's hello was malformed.
            InvalidArgumentError: the listener is closed.
        """
        return super().accept(timeout)

    def _accept_one(self, conn: socket.socket, deadline: float | None) -> Channel:
        pid, uid, gid = peer_credentials(conn)
        if not _allowed(uid, gid, self._allow_uids, self._allow_gids):
            reason = (f"uid {uid} (gid {gid}, pid {pid}) is not allowed on {self.address}: "
                      f"allowed uids {sorted(self._allow_uids) if self._allow_uids is not None else [os.geteuid()]}"
                      f", gids {sorted(self._allow_gids) if self._allow_gids else []}")
            refuse(conn, reason)
            raise PeerRefusedError(f"refused a connection: {reason}")
        mine = hello(self._hello_overrides, visible_gpu_uuids())
        send_frame(conn, mine)
        theirs = recv_hello(conn, remaining(deadline))
        why = _check_hello(mine, theirs)
        if why is not None:
            refuse(conn, why)
            raise PeerRefusedError(f"refused a connection: {why}")
        peer = PeerInfo(pid, uid, gid, tuple(theirs["gpus"]), theirs["library"])
        return Channel(conn, peer, pool=self.pool, device=self._device, ordering=self._ordering,
                       auto_pools=self._auto)

    def close(self) -> None:
        """Stop listening; unlink the socket file if it is still the one we created. Idempotent. Pools made
        on first need for its channels (``pool=None``) are closed once those channels are closed too."""
        self._finalizer()
        if self._auto is not None:
            self._auto.leave()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive


def listen(address: str | os.PathLike[str], *, pool: SharedPool | None = None,
           allow_uids: Iterable[int] | None = None, allow_gids: Iterable[int] | None = None,
           ordering: str = "event", device: int | None = None, backlog: int = 64,
           hello_overrides: dict[str, Any] | None = None, **remote: Any) -> Listener:
    """Listen for channel consumers on ``address`` (``socket(AF_UNIX, SOCK_STREAM)``, ``bind``, ``listen``).

    ``"tcp://HOST:PORT"`` listens for consumers on other hosts instead (NIXL; ``token=`` /
    ``token_file=`` / ``xfer_timeout=`` in ``remote``): see :func:`.remote.listen_remote`.

    Args:
        address: a filesystem path (created mode 0600 under a 0177 umask; a stale
            socket file nobody listens on is replaced) or ``"@name"`` (Linux abstract namespace).
        pool: the pool channels copy into when sending (see :meth:`Channel.send`).
        allow_uids: uids that may connect (default: only this process's effective uid).
        allow_gids: gids that may connect as well.
        ordering: device pools: ``"event"`` or ``"sync"`` (see :meth:`Channel.send`).
        device: where received device chunks are mapped (default: their own GPU).
        backlog: ``listen(2)`` backlog.
        hello_overrides: fields replacing this side's ``hello`` (tests use it to
            fake another protocol version or host).

    Raises:
        InvalidArgumentError: a bad address, a path that exists and is not a
            socket, or a socket someone is listening on.
        SyscallError: ``socket``, ``bind``, ``chmod`` or ``listen`` failed (the message names the address).
    """
    if ordering not in ("event", "sync"):
        raise InvalidArgumentError(f"ordering must be 'event' or 'sync', got {ordering!r}")
    if _remote(address, remote):
        from .remote import listen_remote

        return listen_remote(address, pool=pool, device=device, backlog=backlog, **remote)  # type: ignore[return-value]
    addr, abstract = _sockaddr(address)
    path = None if abstract else os.path.abspath(addr)
    if path is not None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise SyscallError("lstat", exc) from exc
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise InvalidArgumentError(f"{path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
                live = True
            except OSError as exc:
                live = exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
            finally:
                probe.close()
            if live:
                raise InvalidArgumentError(f"{path} is a socket someone is listening on")
            os.unlink(path)  # stale: its listener is gone
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as exc:
        raise SyscallError("socket(AF_UNIX)", exc) from exc
    step = "bind"
    try:
        if path is not None:
            # The umask makes bind() create the file 0600 from the start; chmod states it again.
            old = os.umask(0o177)
            try:
                sock.bind(path)
            finally:
                os.umask(old)
            step = "chmod"
            os.chmod(path, 0o600)
        else:
            sock.bind(addr)
        step = "listen"
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if step != "bind" and path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass
        if step == "bind" and exc.errno == errno.EADDRINUSE:
            raise InvalidArgumentError(f"address {address!r} is in use") from exc
        raise SyscallError(step, exc, os.fspath(address)) from exc
    return Listener(sock, os.fspath(address), path, pool=pool, allow_uids=allow_uids, allow_gids=allow_gids,
                    ordering=ordering, device=device, hello_overrides=hello_overrides)


def _connect_socket(addr: Any, address: Any, deadline: float | None, timeout: float | None,
                    wait: bool) -> socket.socket:
    """A connected AF_UNIX socket, ``wait``: retried while nothing listens (see :func:`connect`)."""
    while True:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:
            raise SyscallError("socket(AF_UNIX)", exc) from exc
        try:
            sock.settimeout(None if deadline is None else timeout)  # (None also for math.inf: deadline_after)
            sock.connect(addr)
            return sock
        except OSError as exc:  # ENOENT / ECONNREFUSED: nothing listens on that address (yet)
            sock.close()
            left = remaining(deadline)
            if not wait or exc.errno not in (errno.ENOENT, errno.ECONNREFUSED):
                raise SyscallError(f"connect({str(address)!r})", exc) from exc
            if left is not None and left <= 0:
                raise WaitTimeoutError(f"nothing listened at {str(address)!r} within {timeout} s") from exc
            time.sleep(0.05 if left is None else min(0.05, left))


def connect(address: str | os.PathLike[str], *, timeout: float | None = 10.0, pool: SharedPool | None = None,
            device: int | None = None, ordering: str = "event", allow_uids: Iterable[int] | None = None,
            allow_gids: Iterable[int] | None = None, hello_overrides: dict[str, Any] | None = None,
            wait: bool = False, **remote: Any) -> Channel:
    """Connect to a :func:`listen` address and complete the handshake.

    ``"tcp://HOST:PORT"`` connects to a listener on another host (NIXL; ``token=`` /
    ``token_file=`` / ``xfer_timeout=`` in ``remote``): see :func:`.remote.connect_remote`.

    Args:
        address: as for :func:`listen`.
        timeout: seconds for the connection and the handshake.
        pool: the pool this side copies into when it sends (a consumer needs none).
        device: CUDA ordinal that received device chunks are mapped on (default:
            the chunk's own GPU, found by UUID; another GPU needs peer access).
        ordering: as for :func:`listen`.
        allow_uids, allow_gids: who may be the listener (``SO_PEERCRED``; default this
            process's effective uid), so that a squatter on an abstract name is refused.
        hello_overrides: as for :func:`listen`.
        wait: while nothing listens at a local address (``ENOENT``, ``ECONNREFUSED``), try again
            every 50 ms within ``timeout``: for a consumer started before its producer.

    Raises:
        SyscallError: ``socket`` or ``connect`` failed (``ENOENT``, ``ECONNREFUSED``: nobody listens).
        PeerRefusedError: the listener refused us (``str()`` has its reason), or we refused it.
        WaitTimeoutError: no hello within ``timeout``; with ``wait``, nothing listened within it.
        InvalidArgumentError: ``wait`` with a ``tcp://`` address.
        ProtocolError: a malformed hello. PeerClosedError: the listener left during the handshake.
    """
    if ordering not in ("event", "sync"):
        raise InvalidArgumentError(f"ordering must be 'event' or 'sync', got {ordering!r}")
    deadline = deadline_after(timeout)  # also checks it: a number of seconds >= 0, or None
    if _remote(address, remote):
        if wait:
            raise InvalidArgumentError("wait= is for local addresses; a tcp:// connect fails at once")
        from .remote import connect_remote

        return connect_remote(address, timeout=timeout, pool=pool, device=device, **remote)
    addr, _ = _sockaddr(address)
    sock = _connect_socket(addr, address, deadline, timeout, wait)
    try:
        sock.settimeout(None)
        pid, uid, gid = peer_credentials(sock)
        try:
            theirs = recv_hello(sock, remaining(deadline))  # what the connection left of the timeout
        except WaitTimeoutError as exc:
            raise WaitTimeoutError(f"connected to {str(address)!r}, but no hello within {timeout} s: is the "
                                   f"listening process calling accept()?") from exc
        if not _allowed(uid, gid, allow_uids, allow_gids):
            why = f"the listener on {address!r} runs as uid {uid} (gid {gid}, pid {pid}), which is not allowed"
            refuse(sock, why)
            raise PeerRefusedError(why)
        mine = hello(hello_overrides, visible_gpu_uuids(initialise=device is not None))
        why = _check_hello(mine, theirs)
        if why is not None:
            refuse(sock, why)
            raise PeerRefusedError(why)
        send_frame(sock, mine)
    except BaseException:
        sock.close()
        raise
    peer = PeerInfo(pid, uid, gid, tuple(theirs["gpus"]), theirs["library"])
    return Channel(sock, peer, pool=pool, device=device, ordering=ordering)
