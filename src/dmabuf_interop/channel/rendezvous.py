"""Rendezvous: independently started processes find each other on an AF_UNIX address.

An address is a filesystem path, bound as given (the socket file is created owner-only, mode
0600, by ``fchmod`` of the socket before ``bind``; it never clobbers a file that is not a socket, and a
stale one is replaced under ``flock`` of its directory) or a Linux abstract name
``"@name"`` (no file; any local user could bind the name first, which the
connector's ``SO_PEERCRED`` check catches). Every accepted connection is
checked with ``SO_PEERCRED`` before a byte is read from it, then both sides
exchange a JSON ``hello`` (protocol and library versions, visible GPUs, the
kernel's boot id, the shared-memory ring offered), in a handshake thread of the listener's (Note
[concurrent handshakes] in :mod:`.handshake`). A refusal sends a ``refuse`` message with the reason and
closes; the refused side raises :class:`~..errors.PeerRefusedError`. When both hellos offer the ring, each
side sends its ``ring`` message (:mod:`._ring`: the region's memfd and a wake socket, by ``SCM_RIGHTS``) as
its first message after the handshake, then reads and attaches the peer's before it hands the channel out
(``connect`` returns, ``accept`` sees it): a channel holds every fd of its connection from the start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from .._checks import as_int, id_set
from .._time import check_timeout, deadline_after, remaining
from ..errors import (AddressInUseError, DmaBufError, InvalidArgumentError, PeerClosedError, PeerRefusedError,
                      SyscallError, WaitTimeoutError)
from ..fdpass import send_message
from ._autopool import Membership, join
from ._ring import RING_VERSION, Rings, ring_unavailable
from .channel import Channel, PeerInfo, check_spin
from .handshake import HANDSHAKE_TIMEOUT, ListenerBase, hello, log, recv_hello, refuse
from .pool import SharedPool
from .protocol import visible_gpu_uuids
from .wire import MAX_FRAME, send_frame, shut_down

__all__ = ["listen", "connect", "Listener", "local_address_ok", "MAX_ADDRESS_BYTES"]

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
#: Message slots and release slots of each channel's ring (read when a ring is made, so a test may make them small).
RING_SLOTS = 256
RING_RELEASE_SLOTS = 1024


#: The longest local address, in bytes as the file system encodes it: ``sun_path`` holds 108, a path's NUL included.
MAX_ADDRESS_BYTES = 107


def local_address_ok(address: Any) -> bool:
    """Whether ``address`` can be a local channel address (a path or ``@name``): a non-empty str without NUL, of at
    most :data:`MAX_ADDRESS_BYTES` bytes (``sun_path`` counts bytes, not characters). For addresses a peer names
    (a placeholder, an init message), checked before anything binds or connects."""
    return (isinstance(address, str) and bool(address) and "\0" not in address
            and len(os.fsencode(address)) <= MAX_ADDRESS_BYTES)


def _sockaddr(address: str | os.PathLike[str]) -> tuple[str, bool]:
    """(address for bind/connect, is_abstract)."""
    try:
        address = os.fspath(address)
    except TypeError:  # (not a str, bytes or os.PathLike: the check below names it)
        pass
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


def _check_pool(pool: Any) -> None:
    """Refuse a ``pool=`` that is not a :class:`SharedPool` at the call, not later in each handshake."""
    if pool is not None and not isinstance(pool, SharedPool):
        raise InvalidArgumentError(f"pool must be a SharedPool or None, got {type(pool).__name__}")


def _allowed(uid: int, gid: int, allow_uids: frozenset[int] | None, allow_gids: frozenset[int] | None) -> bool:
    """``allow_uids``/``allow_gids`` as :func:`.._checks.id_set` made them at the call."""
    return uid in (allow_uids if allow_uids is not None else (os.geteuid(),)) or (
        allow_gids is not None and gid in allow_gids)


def _check_hello(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """Why ``theirs`` is unacceptable, or ``None``."""
    if theirs["protocol"] != mine["protocol"]:
        return (f"protocol version mismatch: this side speaks {mine['protocol']}, "
                f"the peer {theirs['protocol']} (library {theirs['library']})")
    if theirs["boot_id"] != mine["boot_id"]:
        return (f"peer is on another host (boot id {theirs['boot_id']!r}, ours {mine['boot_id']!r}): "
                f"fds and shared memory cannot cross hosts")
    return None


def _new_rings(wanted: bool) -> Rings | None:
    """This side's shared-memory rings to offer (``None``: not wanted, not available here, or they could not
    be made: then the hello offers none and the channel uses the socket alone)."""
    if not wanted:
        return None
    why = ring_unavailable()
    if why is not None:
        log.debug("no shared-memory ring offered: %s", why)
        return None
    try:
        return Rings(RING_SLOTS, RING_RELEASE_SLOTS)
    except (DmaBufError, OSError) as exc:  # out of fds or memory: the socket alone still works
        log.debug("no shared-memory ring offered: %s", exc)
        return None


def _agree_ring(rings: Rings | None, mine: dict[str, Any], theirs: dict[str, Any]) -> Rings | None:
    """The rings to use: both hellos offered :data:`._ring.RING_VERSION` (else ``rings`` is closed)."""
    if rings is not None and not (mine["ring"] == theirs["ring"] == RING_VERSION):
        rings.close()
        return None
    return rings


def _ready(ch: Channel, deadline: float | None) -> Channel:
    """``ch`` once the peer's ``ring`` message is read and attached (when the ring was agreed): the
    handshake's last step, so that the channel holds every fd of its connection when it is handed out and
    its first repeat and release can take the ring. Closes ``ch`` when that fails.

    Raises:
        WaitTimeoutError: the peer's ring message did not come by ``deadline``.
    """
    if ch.ring:
        try:
            ch._attach_peer_ring(deadline)
        except BaseException:
            ch.close(0.0)
            raise
    return ch


def _offer_ring(sock: socket.socket, rings: Rings, timeout: float | None) -> None:
    """Send this side's ``ring`` message with its fds (memfd, wake socket): the first message after the handshake.
    A peer that has gone already (it may close as soon as its own side of the handshake is done) is not an
    error here: the channel is made all the same and sees the end at once, as it would without a ring."""
    msg, fds = rings.offer()
    try:
        send_message(sock, msg, fds, timeout=timeout, max_bytes=MAX_FRAME)
    except PeerClosedError:
        pass


@dataclass(slots=True)
class _Place:
    """Where a path listener's socket file is: its directory (an fd, so that a relative name is found again
    whatever the working directory is by then) and name, and the file's (st_dev, st_ino)."""

    dir_fd: int
    lockable: bool  # opened O_RDONLY: flock() works on it (else O_PATH)
    name: str
    ino: tuple[int, int] = (0, 0)


#: Seconds listen() and close() wait for another listener's lock on the socket's directory before going on
#: without it.
DIR_LOCK_WAIT = 5.0


def _open_dir(dirname: str, address: str) -> _Place:
    try:
        return _Place(os.open(dirname, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), True, "")
    except PermissionError:  # a directory we may enter but not list: no lock, still an anchor
        pass
    except OSError as exc:
        raise SyscallError("bind", exc, address) from exc  # what bind would say (ENOENT: no such folder)
    try:
        return _Place(os.open(dirname, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC), False, "")
    except OSError as exc:
        raise SyscallError("bind", exc, address) from exc


@contextlib.contextmanager
def _dir_lock(place: _Place) -> Iterator[None]:
    """``flock(LOCK_EX)`` on the socket's directory: listeners of this library replacing a stale socket file
    (check, unlink, bind, listen) and unlinking their own at close take turns, so exactly one of two
    racing ``listen`` calls wins. Bounded: past :data:`DIR_LOCK_WAIT` (someone else holds a lock on the
    directory), or where the directory cannot be locked, it goes on without."""
    locked = False
    if place.lockable:
        give_up = time.monotonic() + DIR_LOCK_WAIT
        while True:
            try:
                fcntl.flock(place.dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if time.monotonic() >= give_up:
                    break
                time.sleep(0.005)
            except OSError:  # (a file system without flock)
                break
    try:
        yield
    finally:
        if locked:
            fcntl.flock(place.dir_fd, fcntl.LOCK_UN)


def _lstat_at(place: _Place) -> os.stat_result | None:
    try:
        return os.stat(place.name, dir_fd=place.dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SyscallError("lstat", exc, place.name) from exc


def _unlink_if_ours(place: _Place, owner: bool) -> None:
    """At close: unlink the socket file if it is still the one we bound (in the creating process only)."""
    try:
        if owner:
            with _dir_lock(place):
                st = _lstat_at(place)
                if st is not None and (st.st_dev, st.st_ino) == place.ino:
                    os.unlink(place.name, dir_fd=place.dir_fd)
    except OSError:
        pass
    finally:
        os.close(place.dir_fd)


def _describe_local(conn: socket.socket, addr: Any) -> str:
    try:
        pid, uid, gid = peer_credentials(conn)
    except SyscallError:
        return "a local peer"
    return f"pid {pid} (uid {uid}, gid {gid})"


@dataclass(slots=True)
class _Local:
    """What a local listener's handshakes need (no reference to the listener: see :class:`.handshake.Acceptor`)."""

    address: str
    pool: SharedPool | None
    allow_uids: frozenset[int] | None
    allow_gids: frozenset[int] | None
    ordering: str
    device: int | None
    hello_overrides: dict[str, Any] | None
    auto: Membership | None  # the listener's pools made on first need, shared by its channels
    ring: bool = True
    spin: float | str = 0.0

    def handshake(self, conn: socket.socket, deadline: float | None) -> Channel:
        pid, uid, gid = peer_credentials(conn)
        if not _allowed(uid, gid, self.allow_uids, self.allow_gids):
            reason = (f"uid {uid} (gid {gid}, pid {pid}) is not allowed on {self.address}: "
                      f"allowed uids {sorted(self.allow_uids) if self.allow_uids is not None else [os.geteuid()]}"
                      f", gids {sorted(self.allow_gids) if self.allow_gids else []}")
            refuse(conn, reason)
            raise PeerRefusedError(f"refused a connection: {reason}")
        rings = _new_rings(self.ring)
        try:
            mine = hello(self.hello_overrides, visible_gpu_uuids(), RING_VERSION if rings is not None else None)
            send_frame(conn, mine, timeout=remaining(deadline))
            theirs = recv_hello(conn, remaining(deadline))
            why = _check_hello(mine, theirs)
            if why is not None:
                refuse(conn, why)
                raise PeerRefusedError(f"refused a connection from pid {pid}: {why}")
            rings = _agree_ring(rings, mine, theirs)
            if rings is not None:
                _offer_ring(conn, rings, remaining(deadline))
            peer = PeerInfo(pid, uid, gid, tuple(theirs["gpus"]), theirs["library"])
            ch = Channel(conn, peer, pool=self.pool, device=self.device, ordering=self.ordering,
                         auto_pools=self.auto, rings=rings, spin=self.spin)
        except BaseException:
            if rings is not None:
                rings.close()
            raise
        return _ready(ch, deadline)  # (the channel owns the rings now)


class Listener(ListenerBase):
    """A listening channel address; :meth:`accept` hands out one :class:`Channel` per consumer.

    Created by :func:`listen`. Handshakes run concurrently, each within :attr:`handshake_timeout`
    (Note [concurrent handshakes] in :mod:`.handshake`). Close it (or leave a ``with`` block) to stop
    listening and unlink the socket file (only if it is still ours, and only in the process that created it).
    """

    def __init__(self, sock: socket.socket, address: str, place: _Place | None, *, pool: SharedPool | None,
                 allow_uids: Iterable[int] | None, allow_gids: Iterable[int] | None, ordering: str,
                 device: int | None, hello_overrides: dict[str, Any] | None,
                 handshake_timeout: float | None = HANDSHAKE_TIMEOUT, ring: bool = True,
                 spin: float | str = 0.0) -> None:
        self.pool = pool
        if ring:
            ring_unavailable()  # probed (a memfd made and sealed) and remembered now, not in the first handshake
        local = _Local(address, pool, None if allow_uids is None else frozenset(allow_uids),
                       None if allow_gids is None else frozenset(allow_gids), ordering, device, hello_overrides, None,
                       bool(ring), spin)
        self._auto = local.auto = join(self) if pool is None else None  # pools made on first need (_autopool)
        cleanup = None if place is None else functools.partial(_unlink_if_ours, place)
        self._start(sock, address, local.handshake, _describe_local, handshake_timeout, cleanup)

    def accept(self, timeout: float | None = 60.0, *, raise_refused: bool = False) -> Channel:
        """The next consumer whose handshake completed, as a :class:`Channel`.

        Connections are taken (``accept(2)``), and their handshakes started, only during calls of this method: the
        listener runs no thread of its own, so keep a thread calling it. Each accepted connection is checked
        with ``SO_PEERCRED`` (uid in ``allow_uids``, default this process's effective uid, or gid in
        ``allow_gids``), then both sides exchange ``hello``, in a thread of its own within the listener's
        ``handshake_timeout``: a client that connects and says nothing holds up nobody. A peer that fails
        (credentials, protocol version, host, a malformed or late hello) is told why, dropped, counted in :attr:`refused` and logged (``WARNING`` on the
        ``dmabuf_interop.channel`` logger); it is raised here only with ``raise_refused=True``. A peer
        that left before or during its handshake is dropped quietly.

        Raises:
            WaitTimeoutError: no consumer completed its handshake within ``timeout`` seconds.
            PeerRefusedError, ProtocolError, WaitTimeoutError: with ``raise_refused``, the next refusal
                (credentials, version or host refused, or the peer refused us; a malformed hello; a hello
                not complete within ``handshake_timeout``), in the order handshakes ended.
            SyscallError: ``accept(2)`` failed (``EMFILE``/``ENFILE``: at the fd limit; the pending
                connection was refused, naming the limit, and the listener backs off up to 1 s).
            ForkedResourceError: this process inherited the listener through ``fork()``.
            InvalidArgumentError: the listener is closed.
        """
        return self._acceptor.accept(timeout, raise_refused)

    def close(self) -> None:
        """As :meth:`.handshake.ListenerBase.close`; pools made on first need for its channels (``pool=None``)
        are closed once those channels are closed too."""
        super().close()
        if self._auto is not None:
            self._auto.leave()  # the last member closes the pools


def listen(address: str | os.PathLike[str], *, pool: SharedPool | None = None,
           allow_uids: Iterable[int] | None = None, allow_gids: Iterable[int] | None = None,
           ordering: str = "event", device: int | None = None, backlog: int = 64,
           hello_overrides: dict[str, Any] | None = None, handshake_timeout: float | None = HANDSHAKE_TIMEOUT,
           ring: bool = True, spin: float | str = 0.0, **remote: Any) -> Listener:
    """Listen for channel consumers on ``address`` (``socket(AF_UNIX, SOCK_STREAM)``, ``bind``, ``listen``).

    ``"tcp://HOST:PORT"`` listens for consumers on other hosts instead (NIXL; ``token=`` /
    ``token_file=`` / ``xfer_timeout=`` in ``remote``): see :func:`.remote.listen_remote`.

    Args:
        address: a filesystem path, bound as given (a relative name relative to the working directory now,
            which also gets round the 108-byte ``sun_path`` limit; the file is created mode 0600:
            ``fchmod`` of the socket before ``bind``, the process umask untouched; a stale socket file
            nobody listens on is replaced) or ``"@name"`` (Linux abstract namespace).
        pool: the pool channels copy into when sending (see :meth:`Channel.send`).
        allow_uids: uids that may connect (default: only this process's effective uid).
        allow_gids: gids that may connect as well.
        ordering: device pools: ``"event"`` or ``"sync"`` (see :meth:`Channel.send`).
        device: where received device chunks are mapped (default: their own GPU).
        backlog: ``listen(2)`` backlog.
        hello_overrides: fields replacing this side's ``hello`` (tests use it to
            fake another protocol version or host).
        handshake_timeout: seconds each accepted connection has to complete its handshake (``None``: no limit).
        ring: offer the shared-memory ring (:mod:`._ring`) to each consumer: used when the consumer offers it
            too; not offered where :func:`._ring.ring_unavailable` gives a reason (then the socket alone is used).
        spin: each channel's :attr:`Channel.spin` (seconds a ``recv`` polls the ring before it sleeps, or ``"auto"``).

    Raises:
        AddressInUseError: another listener holds the address (a live socket answered, or ``bind`` lost a
            race: ``EADDRINUSE``). Of two ``listen`` calls racing over one stale file, exactly one wins.
        InvalidArgumentError: a bad address or timeout, a path that exists and is not a socket, a ``pool``
            that is not a :class:`SharedPool`, ``allow_uids``/``allow_gids`` that are not iterables of ids, or a
            ``backlog`` that is not an int >= 0.
        SyscallError: ``socket``, ``bind``, ``chmod`` or ``listen`` failed (the message names the address).
    """
    if ordering not in ("event", "sync"):
        raise InvalidArgumentError(f"ordering must be 'event' or 'sync', got {ordering!r}")
    spin = check_spin(spin)
    _check_pool(pool)
    allow_uids, allow_gids = id_set(allow_uids, "allow_uids"), id_set(allow_gids, "allow_gids")
    if as_int(backlog, "backlog") < 0:  # listen(2) would take -1 as 0
        raise InvalidArgumentError(f"backlog must be an int >= 0, got {backlog!r}")
    if _remote(address, remote):
        from .remote import listen_remote

        return listen_remote(address, pool=pool, device=device, backlog=backlog,  # type: ignore[return-value]
                             handshake_timeout=handshake_timeout, **remote)
    check_timeout(handshake_timeout, "handshake_timeout")
    addr, abstract = _sockaddr(address)
    shown = os.fspath(address)
    if abstract:
        sock = _bind(addr, shown, backlog, None)
        return Listener(sock, shown, None, pool=pool, allow_uids=allow_uids, allow_gids=allow_gids,
                        ordering=ordering, device=device, hello_overrides=hello_overrides,
                        handshake_timeout=handshake_timeout, ring=ring, spin=spin)
    dirname, name = os.path.split(addr)
    if not name:
        raise InvalidArgumentError(f"address {shown!r} names a directory, not a socket file")
    place = _open_dir(dirname or ".", shown)
    place.name = name
    sock = None
    try:
        with _dir_lock(place):
            _clear_stale(addr, place, shown)
            sock = _bind(addr, shown, backlog, place)
        return Listener(sock, shown, place, pool=pool, allow_uids=allow_uids, allow_gids=allow_gids,
                        ordering=ordering, device=device, hello_overrides=hello_overrides,
                        handshake_timeout=handshake_timeout, ring=ring, spin=spin)
    except BaseException:
        if sock is None:
            os.close(place.dir_fd)
        else:  # bound, but the listener could not be made (no fd left for its eventfd, say)
            sock.close()
            _unlink_if_ours(place, True)  # (closes the directory's fd)
        raise


def _clear_stale(addr: str, place: _Place, shown: str) -> None:
    """(Under the directory lock.) Refuse an address in use or a file that is not a socket; unlink a
    stale socket file nobody listens on."""
    st = _lstat_at(place)
    if st is None:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise InvalidArgumentError(f"{shown} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.setblocking(False)  # a live listener with a full backlog answers EAGAIN, not a wait
        probe.connect(addr)
        live = True
    except OSError as exc:
        live = exc.errno not in (errno.ECONNREFUSED, errno.ENOENT)
    finally:
        probe.close()
    if live:
        raise AddressInUseError(f"{shown} is a socket someone is listening on")
    try:
        os.unlink(place.name, dir_fd=place.dir_fd)  # stale: its listener is gone
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise SyscallError("unlink", exc, shown) from exc


def _bind(addr: str, shown: str, backlog: int, place: _Place | None) -> socket.socket:
    """A listening socket bound to ``addr``. A path's file is 0600 from its creation on: ``fchmod`` of the
    socket before ``bind`` (Linux creates the file with the socket inode's mode, less the umask), never a
    change of the process umask."""
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as exc:
        raise SyscallError("socket(AF_UNIX)", exc) from exc
    step = "bind"
    bound = False
    try:
        if place is not None:
            step = "fchmod"
            os.fchmod(sock.fileno(), 0o600)
            step = "bind"
        sock.bind(addr)
        bound = True
        if place is not None:
            step = "chmod"
            st = os.stat(place.name, dir_fd=place.dir_fd, follow_symlinks=False)
            place.ino = (st.st_dev, st.st_ino)
            if stat.S_IMODE(st.st_mode) != 0o600:  # a umask that took the owner's bits too
                os.chmod(place.name, 0o600, dir_fd=place.dir_fd)
        step = "listen"
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if bound and place is not None:
            try:
                os.unlink(place.name, dir_fd=place.dir_fd)  # (under the directory lock: ours)
            except OSError:
                pass
        if step == "bind" and exc.errno == errno.EADDRINUSE:
            raise AddressInUseError(f"address {shown!r} is in use") from exc
        raise SyscallError(step, exc, shown) from exc
    return sock


def _connect_socket(addr: Any, address: Any, deadline: float | None, timeout: float | None,
                    wait: bool) -> socket.socket:
    """A connected AF_UNIX socket. A full backlog (``EAGAIN``: the listener exists but has not taken the
    connections queued before us) is retried within ``timeout``, as is, with ``wait``, nothing listening
    (``ENOENT``, ``ECONNREFUSED``): see :func:`connect`."""
    pause = 0.005
    while True:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError as exc:
            raise SyscallError("socket(AF_UNIX)", exc) from exc
        try:
            sock.settimeout(None if deadline is None else timeout)  # (None also for math.inf: deadline_after)
            sock.connect(addr)
            return sock
        except OSError as exc:
            sock.close()
            left = remaining(deadline)
            full = exc.errno == errno.EAGAIN
            if not full and not (wait and exc.errno in (errno.ENOENT, errno.ECONNREFUSED)):
                raise SyscallError(f"connect({str(address)!r})", exc) from exc
            if left is not None and left <= 0:
                if full:
                    raise WaitTimeoutError(f"the listen backlog of {str(address)!r} stayed full for {timeout} s: "
                                           f"is the listening process calling accept()?") from exc
                raise WaitTimeoutError(f"nothing listened at {str(address)!r} within {timeout} s") from exc
            time.sleep(pause if left is None else min(pause, left))
            pause = min(pause * 2, 0.05)


def connect(address: str | os.PathLike[str], *, timeout: float | None = 10.0, pool: SharedPool | None = None,
            device: int | None = None, ordering: str = "event", allow_uids: Iterable[int] | None = None,
            allow_gids: Iterable[int] | None = None, hello_overrides: dict[str, Any] | None = None,
            wait: bool = False, ring: bool = True, spin: float | str = 0.0, **remote: Any) -> Channel:
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
            every 50 ms within ``timeout``: for a consumer started before its producer. (A full listen
            backlog, ``EAGAIN``, is retried within ``timeout`` with or without ``wait``.)
        ring: offer the shared-memory ring (:mod:`._ring`): used when the listener offers it too; not offered
            where :func:`._ring.ring_unavailable` gives a reason (then the socket alone is used).
        spin: the channel's :attr:`Channel.spin` (seconds a ``recv`` polls the ring before it sleeps, or ``"auto"``).

    Raises:
        SyscallError: ``socket`` or ``connect`` failed (``ENOENT``, ``ECONNREFUSED``: nobody listens).
        PeerRefusedError: the listener refused us (``str()`` has its reason), or we refused it.
        WaitTimeoutError: no hello within ``timeout``; the listen backlog stayed full; with ``wait``,
            nothing listened within it.
        InvalidArgumentError: ``wait`` with a ``tcp://`` address; a ``pool`` that is not a :class:`SharedPool`;
            ``allow_uids``/``allow_gids`` that are not iterables of ids (a bare ``1000`` or ``"1000"`` included).
        ProtocolError: a malformed hello. PeerClosedError: the listener left during the handshake.
    """
    if ordering not in ("event", "sync"):
        raise InvalidArgumentError(f"ordering must be 'event' or 'sync', got {ordering!r}")
    deadline = deadline_after(timeout)  # also checks it: a number of seconds >= 0, or None
    spin = check_spin(spin)
    _check_pool(pool)
    allow_uids, allow_gids = id_set(allow_uids, "allow_uids"), id_set(allow_gids, "allow_gids")
    if _remote(address, remote):
        if wait:
            raise InvalidArgumentError("wait= is for local addresses; a tcp:// connect fails at once")
        from .remote import connect_remote

        return connect_remote(address, timeout=timeout, pool=pool, device=device, **remote)
    addr, _ = _sockaddr(address)
    sock = _connect_socket(addr, address, deadline, timeout, wait)
    rings = None
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
        rings = _new_rings(ring and theirs["ring"] == RING_VERSION)
        mine = hello(hello_overrides, visible_gpu_uuids(initialise=device is not None),
                     RING_VERSION if rings is not None else None)
        why = _check_hello(mine, theirs)
        if why is not None:
            refuse(sock, why)
            raise PeerRefusedError(why)
        send_frame(sock, mine)
        rings = _agree_ring(rings, mine, theirs)
        if rings is not None:
            _offer_ring(sock, rings, remaining(deadline))
    except BaseException:
        if rings is not None:
            rings.close()
        sock.close()
        raise
    peer = PeerInfo(pid, uid, gid, tuple(theirs["gpus"]), theirs["library"])
    ch = Channel(sock, peer, pool=pool, device=device, ordering=ordering, rings=rings, spin=spin)
    try:
        return _ready(ch, deadline)
    except WaitTimeoutError as exc:
        raise WaitTimeoutError(f"connected to {str(address)!r}, but the listener's ring message did not come "
                               f"within {timeout} s") from exc
