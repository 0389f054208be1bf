"""The per-process broker that lends shared memory by handle: the producer's side (the consumer's
:class:`~.client.Client` that borrows from it is in :mod:`dmabuf_interop.integrations.torch_sharing.client`).

Torch-free: the torch layer (:mod:`dmabuf_interop.integrations.torch_sharing`) registers *shares* here
and puts their :class:`~.ShareHandle` bytes into the pickled tuple; CPU tests
register memfd chunks the same way.

A producer's :class:`Broker` listens on an AF_UNIX path socket in an
owner-only folder (``0700``; the socket itself ``0600``), accepts only peers
whose ``SO_PEERCRED`` uid it allows (default: its own effective uid), and
serves each connection in a thread of its own. A consumer's :class:`~.client.Client`
(one per broker address, per process) sends ``open`` with a share's id and
secret token; the broker answers ``lease`` with the chunk's fds
(``SCM_RIGHTS``) the first time that connection asks for that chunk, and only
the id afterwards. A lease ends when the consumer sends ``release`` or its
connection ends (exit, SIGKILL: the kernel closes the socket and the broker's
reader sees EOF).

Wire: :func:`~dmabuf_interop.fdpass.send_message` frames (4-byte length, JSON).
Nothing is unpickled; every field is checked before use.

consumer -> broker: ``open`` {share, token, wait}; ``wait`` {lease};
``release`` {leases}; ``drop`` {chunks}. broker -> consumer: ``lease``
{lease, chunk, offset, nbytes, retired, event, [size, parts, mechanism,
device_uuid] + fds when new to this connection}; ``waited``; ``refuse``
{reason}.

Lifecycle (threads): the listening thread starts with the broker
(:func:`broker`, made on the first share) and a reader thread per accepted
connection; :meth:`Broker.close` (or :func:`shutdown`) shuts the sockets
down, which wakes every thread, joins them, and unlinks the socket. They are
daemon threads, so an exiting process does not wait for them; the socket file
is unlinked at exit. A forked child inherits neither: at fork the child
forgets the parent's broker and clients without touching their sockets or
memory (see ``os.register_at_fork`` below), and makes its own on first use.
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import os
import secrets
import socket
import stat
import tempfile
import threading
import weakref
from typing import Any, Callable, Protocol

from ...errors import DmaBufError, InvalidArgumentError, ProtocolError, SyscallError
from ...fdpass import recv_message, send_message
from . import client as _client
from ._handle import _BOOT_ID, MAGIC, ShareHandle, _ints, peer_uid
# the consumer's names, importable from here as before the split
from .client import MAX_IDLE_IMPORTS, Client, client_for, default_importer, iter_clients  # noqa: F401

__all__ = ["ShareHandle", "Broker", "Client", "broker", "client_for", "shutdown", "MAGIC", "Lent",
           "default_importer", "configure"]

#: Most unopened shares a broker holds strongly; beyond it the oldest are demoted to weak.
MAX_UNOPENED = 1 << 16
#: Seconds a broker waits for room to send a reply before it drops the connection.
SEND_TIMEOUT = 10.0


# --- what a broker lends -----------------------------------------------------------------------

class Lent(Protocol):
    """A chunk of exportable memory: ``parts`` bytes each, one fd per part from :meth:`fds`."""

    id: int
    size: int
    parts: list[int]
    mechanism: str
    device_uuid: str

    def fds(self) -> Any: ...  # a context manager yielding the fds, closed when it exits


@dataclasses.dataclass(slots=True, eq=False)
class _Share:
    id: int
    token: str
    chunk: Any
    offset: int
    nbytes: int
    hold: Any  # keeps the memory from being reused; None once given back
    give_back: Callable[[Any], None]
    relend: Callable[[], tuple[Any, int, Any] | None] | None  # (chunk, offset, hold) again, or None
    alive: Callable[[], bool] | None  # whether relend could still succeed (a cheap check for sweeps)
    event: Any  # what a ``wait`` synchronises on, or None
    wait: Callable[[Any], None] | None
    event_handle: str  # hex of the IPC event handle the consumer's stream waits on, or ""

    leases: int = 0
    opened: bool = False


class _Conn:
    __slots__ = ("sock", "pid", "leases", "sent", "thread")

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.thread: threading.Thread | None = None
        self.leases: dict[int, _Share] = {}
        self.sent: dict[int, Any] = {}  # chunk id -> chunk whose fds went on this connection


def _runtime_dir() -> str:
    base = os.environ.get("DMABUF_INTEROP_SOCKET_DIR")
    if not base:
        base = os.path.join(tempfile.gettempdir(), f"dmabuf-interop-{os.geteuid()}")
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise SyscallError("mkdir", exc, base) from exc
    st = os.lstat(base)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise InvalidArgumentError(f"{base} must be a folder owned by uid {os.geteuid()} with mode 0700 "
                                   f"(found mode {stat.S_IMODE(st.st_mode):o}, uid {st.st_uid})")
    return base


class Broker:
    """Lends registered shares to allowed peers (see the module docstring).

    Args:
        allow_uids: uids that may connect (``SO_PEERCRED``), default: this process's effective uid.

    Raises:
        SyscallError: ``socket``, ``bind``, ``chmod`` or ``listen`` failed.
        InvalidArgumentError: the socket folder is not owner-only.
    """

    def __init__(self, allow_uids: Any = None) -> None:
        self.allow_uids = frozenset({os.geteuid()} if allow_uids is None else allow_uids)
        self.pid = os.getpid()
        folder = _runtime_dir()
        self.address = os.path.join(folder, f"torch-{self.pid}-{secrets.token_hex(4)}.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.address)  # the folder is 0700: nobody else can reach the socket meanwhile
            os.chmod(self.address, 0o600)
            sock.listen(64)
        except OSError as exc:
            sock.close()
            raise SyscallError("bind/listen", exc, self.address) from exc
        self._sock = sock
        self._lock = threading.Lock()
        self._shares: dict[int, _Share] = {}
        self._unopened: dict[int, None] = {}  # insertion-ordered ids of shares not yet opened
        self._conns: set[_Conn] = set()
        self._ids = itertools.count(1)
        self._sweep_at = 4096
        self._leases = itertools.count(1)
        self._closed = False
        self._finalizer = weakref.finalize(self, _unlink, self.address, self.pid)
        self._thread = threading.Thread(target=self._accept_loop, name="dmabuf-interop-broker", daemon=True)
        self._thread.start()

    # -- producer side
    def register(self, chunk: Lent, offset: int, nbytes: int, hold: Any, give_back: Callable[[Any], None], *,
                 relend: Callable[[], tuple[Any, int, Any] | None] | None = None,
                 alive: Callable[[], bool] | None = None, event: Any = None,
                 wait: Callable[[Any], None] | None = None, event_handle: bytes = b"") -> ShareHandle:
        """Register ``nbytes`` at ``offset`` in ``chunk`` as a new share; ``hold`` keeps it alive until
        ``give_back(hold)`` is called (every lease taken on it ended, or :meth:`close`). ``relend()``
        lends it again after that, for a handle opened once more (``None``: it is gone); ``alive()``
        says cheaply whether it still could, so that given-back shares are forgotten in sweeps.
        ``event_handle`` (IPC event bytes) goes to the consumer with the lease; a consumer that cannot
        open it sends ``wait``, and the broker calls ``wait(event)`` before answering.

        Raises:
            InvalidArgumentError: the broker is closed.
        """
        token = secrets.token_hex(16)
        demoted: list[_Share] = []
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("the broker is closed")
            sid = next(self._ids)
            self._shares[sid] = _Share(sid, token, chunk, offset, nbytes, hold, give_back, relend, alive, event,
                                       wait, event_handle.hex())
            self._unopened[sid] = None
            if len(self._shares) > self._sweep_at:  # as torch's SharedCache: amortised, bounded
                for old in [s for s in self._shares.values() if s.hold is None]:
                    if old.alive is None or not old.alive():
                        del self._shares[old.id]
                self._sweep_at = max(4096, 2 * len(self._shares))
            while len(self._unopened) > MAX_UNOPENED:
                old = self._shares[next(iter(self._unopened))]
                del self._unopened[old.id]
                demoted.append(self._end_hold(old))
        for share in demoted:
            self._give_back(share)
        return ShareHandle(self.address, self.pid, sid, token, _BOOT_ID, chunk.device_uuid)

    def __len__(self) -> int:
        """Shares registered and not forgotten."""
        with self._lock:
            return len(self._shares)

    @property
    def outstanding(self) -> int:
        """Leases out on every connection."""
        with self._lock:
            return sum(len(c.leases) for c in self._conns)

    def _end_hold(self, share: _Share) -> _Share:
        """Under the lock: the share no longer holds its memory; forget it unless it can be lent again."""
        if share.relend is None:
            self._shares.pop(share.id, None)
        return share

    @staticmethod
    def _give_back(share: _Share) -> None:
        hold, share.hold = share.hold, None
        if hold is not None:
            share.give_back(hold)

    # -- the threads
    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # shut down by close()
            try:
                pid, uid = peer_uid(conn)
            except SyscallError:
                conn.close()
                continue
            if uid not in self.allow_uids:
                try:
                    send_message(conn, {"kind": "refuse", "reason": f"uid {uid} is not allowed"}, timeout=1)
                except DmaBufError:
                    pass
                conn.close()
                continue
            c = _Conn(conn, pid)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(c)
            c.thread = threading.Thread(target=self._serve, args=(c,), name=f"dmabuf-interop-broker-{pid}",
                                        daemon=True)
            c.thread.start()

    def _serve(self, c: _Conn) -> None:
        try:
            while True:
                msg, _ = recv_message(c.sock, None, max_fds=0)
                kind = msg.get("kind")
                if kind == "open" and set(msg) == {"kind", "share", "token", "wait"}:
                    self._open(c, msg)
                elif kind == "wait" and set(msg) == {"kind", "lease"} and type(msg["lease"]) is int:  # noqa: E721
                    with self._lock:
                        share = c.leases.get(msg["lease"])
                    if share is not None and share.wait is not None and share.event is not None:
                        share.wait(share.event)
                    send_message(c.sock, {"kind": "waited"}, timeout=SEND_TIMEOUT)
                elif kind == "release" and set(msg) == {"kind", "leases"} and _ints(msg["leases"]):
                    self._release(c, msg["leases"])
                elif kind == "drop" and set(msg) == {"kind", "chunks"} and _ints(msg["chunks"]):
                    with self._lock:
                        for cid in msg["chunks"]:
                            c.sent.pop(cid, None)
                else:
                    raise ProtocolError(f"unexpected message {str(kind)[:32]!r}")
        except DmaBufError:  # EOF (the consumer exited or was killed), garbage, a reply that did not go
            pass
        finally:
            self._drop(c)

    def _open(self, c: _Conn, msg: dict[str, Any]) -> None:
        sid, token, wait = msg["share"], msg["token"], msg["wait"]
        if type(sid) is not int or not isinstance(token, str) or type(wait) is not bool:  # noqa: E721
            raise ProtocolError("bad open message")
        relend = None
        with self._lock:
            share = self._shares.get(sid)
            if share is None:
                why = f"no share {sid}: never made here, or released"
            elif not hmac.compare_digest(share.token.encode(), token.encode()[:64]):
                why, share = f"the token does not match share {sid}", None
            else:
                why = ""
                if share.hold is None:
                    relend = share.relend
        if share is not None and relend is not None:  # opened again after its leases ended: lend anew
            again = relend()
            with self._lock:
                if again is None:
                    self._shares.pop(sid, None)
                    share, why = None, f"share {sid} was released and its memory is no longer the producer's"
                elif share.hold is None:
                    share.chunk, share.offset, share.hold = again
                else:
                    share.give_back(again[2])
        if share is None:
            send_message(c.sock, {"kind": "refuse", "reason": why}, timeout=SEND_TIMEOUT)
            return
        if wait and share.wait is not None and share.event is not None:
            share.wait(share.event)  # ordering without IPC events: the producer's writes are done now
        with self._lock:
            lease = next(self._leases)
            share.leases += 1
            share.opened = True
            self._unopened.pop(sid, None)
            c.leases[lease] = share
            chunk = share.chunk
            new = chunk.id not in c.sent
            retired = [cid for cid, ch in c.sent.items() if getattr(ch, "stale", False)]
            for cid in retired:
                del c.sent[cid]
            if new:
                c.sent[chunk.id] = chunk
        reply = {"kind": "lease", "lease": lease, "chunk": chunk.id, "offset": share.offset,
                 "nbytes": share.nbytes, "retired": retired, "event": share.event_handle}
        try:
            if new:
                reply.update(size=chunk.size, parts=list(chunk.parts), mechanism=chunk.mechanism,
                             device_uuid=chunk.device_uuid)
                with chunk.fds() as fds:
                    send_message(c.sock, reply, fds, timeout=SEND_TIMEOUT)
            else:
                send_message(c.sock, reply, timeout=SEND_TIMEOUT)
        except BaseException:
            if new:
                with self._lock:
                    c.sent.pop(chunk.id, None)
            raise  # the lease is on c: _drop ends it

    def _release(self, c: _Conn, leases: list[int]) -> None:
        done = []
        with self._lock:
            for lease in leases:
                share = c.leases.pop(lease, None)
                if share is not None:
                    share.leases -= 1
                    if share.leases == 0:
                        done.append(self._end_hold(share))
        for share in done:
            self._give_back(share)

    def _drop(self, c: _Conn) -> None:
        with self._lock:
            self._conns.discard(c)
        self._release(c, list(c.leases))
        try:
            c.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        c.sock.close()

    def close(self, timeout: float = 10.0) -> None:
        """Stop serving: refuse new opens, end every connection (their leases end), give back every
        share's memory, join the threads, unlink the socket. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)  # wakes its reader, which ends its leases
            except OSError:
                pass
        self._thread.join(timeout)
        for c in conns:
            if c.thread is not None:
                c.thread.join(timeout)
        self._sock.close()
        self._finalizer()
        with self._lock:
            shares = list(self._shares.values())
            self._shares.clear()
            self._unopened.clear()
        for share in shares:
            self._give_back(share)

    def _forget_after_fork(self) -> None:
        """In a forked child: close our copies of the fds (not shut down: the sockets are the
        parent's too) and never give anything back."""
        self._finalizer.detach()
        for c in self._conns:
            c.sock.close()
        self._sock.close()


def _unlink(path: str, pid: int) -> None:
    if os.getpid() == pid:
        try:
            os.unlink(path)
        except OSError:
            pass


# --- process-wide state --------------------------------------------------------------------------

_state_lock = threading.Lock()
_broker: Broker | None = None
_broker_uids: Any = None
_forked_leftovers: list[Any] = []  # a forked child's copies of the parent's broker: never finalised


def broker(allow_uids: Any = None) -> Broker:
    """This process's broker, started on first use (``allow_uids`` applies when it starts)."""
    global _broker
    b = _broker
    if b is None:
        with _state_lock:
            if _broker is None:
                _broker = Broker(allow_uids if allow_uids is not None else _broker_uids)
            b = _broker
    return b


def configure(allow_uids: Any) -> None:
    """The uids a broker started from now on allows, and whose brokers a client connected from now on
    accepts (``None``: this process's effective uid)."""
    global _broker_uids
    _broker_uids = None if allow_uids is None else frozenset(allow_uids)
    _client._configure(_broker_uids)


def shutdown() -> None:
    """Close this process's broker (every share given back) and its client connections."""
    global _broker
    with _state_lock:
        b, _broker = _broker, None
    if b is not None:
        b.close()
    _client._close_all()


def _after_fork_in_child() -> None:
    global _broker, _state_lock
    _state_lock = threading.Lock()
    if _broker is not None:
        _broker._forget_after_fork()
        _forked_leftovers.append(_broker)
        _broker = None


os.register_at_fork(after_in_child=_after_fork_in_child)
