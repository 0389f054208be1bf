"""The consumer's side of the torch-sharing broker: a :class:`Client` per producer's broker (per
process, from :func:`client_for`) that takes leases on shares by :class:`~.ShareHandle` and maps
each lent chunk once per device (:func:`default_importer`). The broker, the wire and the lifecycle
are described in :mod:`dmabuf_interop.integrations.torch_sharing.broker`. Torch-free.

A forked child inherits no client: at fork the child forgets the parent's connections without
touching their sockets or mappings (see ``os.register_at_fork`` below), and connects anew on first use.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any, Callable, Iterator

from ...errors import (DmaBufError, InvalidArgumentError, PeerClosedError, ProtocolError, StaleHandleError,
                       SyscallError)
from ...fdpass import close_fds, recv_message, send_message
from ._handle import _BOOT_ID, ShareHandle, _ints, peer_uid

__all__ = ["Client", "client_for", "default_importer", "iter_clients", "MAX_IDLE_IMPORTS"]

#: Idle imported chunks a client keeps mapped per broker (the oldest idle are unmapped beyond it).
MAX_IDLE_IMPORTS = 64
_MAX_PARTS = 253  # SCM_MAX_FD


class _Import:
    """A chunk mapped in this process; ``refs`` leases use it."""

    __slots__ = ("chunk", "buf", "refs", "retired", "__weakref__")

    def __init__(self, chunk: int, buf: Any) -> None:
        self.chunk = chunk
        self.buf = buf  # an ImportedBuffer: close() unmaps
        self.refs = 0
        self.retired = False


class Client:
    """This process's connection to one producer's broker (see :func:`client_for`).

    ``importer(mechanism, fds, parts, device, device_uuid)`` maps a new chunk and returns an object
    with ``ptr`` and ``close()``.

    Raises:
        StaleHandleError: the broker is gone (nothing listens at the address), or refused us.
        PeerRefusedError: the broker runs as a uid that is not allowed.
    """

    def __init__(self, handle: ShareHandle, importer: Callable[..., Any], *, timeout: float | None = 60.0,
                 allow_uids: Any = None) -> None:
        self.address = handle.address
        self.producer = handle.producer
        self.timeout = timeout
        self._importer = importer
        self._lock = threading.Lock()
        self._imports: dict[tuple[int, int], _Import] = {}  # (chunk, device) -> mapping
        self._pending: list[int] = []  # leases released while another thread held the lock
        self._drops: list[int] = []
        if handle.boot_id != _BOOT_ID:
            raise StaleHandleError(self.producer, "the handle comes from another host (boot id differs)")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(self.address)
            sock.settimeout(None)
        except OSError as exc:
            sock.close()
            raise StaleHandleError(self.producer, f"its broker is gone: connect -> {exc.strerror or exc}") from exc
        _, uid = peer_uid(sock)
        allowed = {os.geteuid()} if allow_uids is None else set(allow_uids)
        if uid not in allowed:
            sock.close()
            from ...errors import PeerRefusedError

            raise PeerRefusedError(f"the broker at {self.address} runs as uid {uid}, which is not allowed")
        self._sock = sock
        self.pid = os.getpid()
        self.broken: BaseException | None = None

    def open(self, handle: ShareHandle, device: int, *, wait: bool) -> tuple[int, _Import, int, int, bytes]:
        """Take a lease on ``handle``'s share, mapped on ``device``: ``(lease, import, offset, nbytes,
        event)``, ``event`` the IPC event handle to wait on (``b""``: none; with ``wait``, the broker
        has waited for it already). The lease counts in the import's ``refs`` until :meth:`release`.

        Raises:
            StaleHandleError: the broker refused (unknown share, bad token, released), or went away.
            ProtocolError: the broker's reply broke the protocol (the connection is then ended).
        """
        with self._lock:
            try:
                for _ in range(2):  # a second time only when the chunk is mapped here for another device
                    got = self._ask(handle, device, wait)
                    if got is not None:
                        return got
                raise ProtocolError(f"the broker of {self.producer} did not send a chunk's fds again")
            finally:
                self._flush_quietly()

    def wait(self, lease: int) -> None:
        """Ask the broker to wait for ``lease``'s event (where this process cannot open IPC events).

        Raises:
            StaleHandleError: the broker went away. ProtocolError: a malformed reply.
        """
        with self._lock:
            try:
                send_message(self._sock, {"kind": "wait", "lease": lease}, timeout=self.timeout)
                msg, fds = recv_message(self._sock, self.timeout, max_fds=0)
            except (PeerClosedError, ProtocolError, SyscallError) as exc:
                self._break(exc)
                raise StaleHandleError(self.producer, f"its broker went away: {exc}") from exc
            if msg != {"kind": "waited"}:
                err = ProtocolError(f"a malformed reply from the broker of {self.producer}")
                self._break(err)
                raise err

    def _ask(self, handle: ShareHandle, device: int, wait: bool) -> tuple[int, _Import, int, int, bytes] | None:
        if self.broken is not None:
            raise StaleHandleError(self.producer, f"the connection to its broker ended ({self.broken})")
        try:
            self._flush()
            send_message(self._sock, {"kind": "open", "share": handle.share, "token": handle.token,
                                      "wait": wait}, timeout=self.timeout)
            msg, fds = recv_message(self._sock, self.timeout, max_fds=_MAX_PARTS)
        except (PeerClosedError, ProtocolError, SyscallError) as exc:
            why = self._refusal()
            self._break(exc)
            raise StaleHandleError(self.producer, why or f"its broker went away or broke the protocol: {exc}"
                                   ) from exc
        try:
            return self._take(msg, fds, device)
        finally:
            close_fds(fds)  # an import keeps no fd (cuMemImportFromShareableHandle, mmap)

    def _refusal(self) -> str | None:
        """The reason of a ``refuse`` the broker sent before it closed (a uid it does not allow)."""
        try:
            msg, fds = recv_message(self._sock, 0.5, max_fds=0)
        except DmaBufError:
            return None
        if msg.get("kind") == "refuse" and isinstance(msg.get("reason"), str):
            return "refused: " + msg["reason"][:512]
        return None

    def _take(self, msg: dict[str, Any], fds: list[int], device: int
              ) -> tuple[int, _Import, int, int, bytes] | None:
        """Check the broker's reply and map what it lent (under the lock)."""
        kind = msg.get("kind")
        if kind == "refuse" and set(msg) == {"kind", "reason"} and isinstance(msg["reason"], str) and not fds:
            raise StaleHandleError(self.producer, msg["reason"][:512])
        base = {"kind", "lease", "chunk", "offset", "nbytes", "retired", "event"}
        new = set(msg) == base | {"size", "parts", "mechanism", "device_uuid"}
        ok = (kind == "lease" and (new or set(msg) == base) and _ints(msg["retired"])
              and all(type(msg[k]) is int and msg[k] >= 0 for k in ("lease", "chunk", "offset", "nbytes"))  # noqa: E721
              and isinstance(msg["event"], str) and len(msg["event"]) in (0, 128))
        if ok and new:
            parts = msg["parts"]
            ok = (_ints(parts) and 0 < len(parts) == len(fds) and all(p > 0 for p in parts)
                  and sum(parts) == msg["size"] and msg["mechanism"] in ("posix-fd", "memfd")
                  and isinstance(msg["device_uuid"], str) and len(msg["device_uuid"]) < 128)
        elif ok:
            ok = not fds
        if not ok:
            err = ProtocolError(f"a malformed reply from the broker of {self.producer}")
            self._break(err)
            raise err
        for cid in msg["retired"]:  # chunks the producer no longer lends: unmap once unused
            for key in [k for k in self._imports if k[0] == cid]:
                self._imports[key].retired = True
                if self._imports[key].refs == 0:
                    self._unmap(key)
        key = (msg["chunk"], device)
        imp = self._imports.get(key)
        if new:
            if imp is not None:  # mapped here already (for this device): the new fds are not needed
                pass
            else:
                imp = self._imports[key] = _Import(msg["chunk"], self._importer(
                    msg["mechanism"], fds, msg["parts"], device, msg["device_uuid"]))
        elif imp is None:  # the fds went on this connection for another device: ask again with them
            self._drops.append(msg["chunk"])
            self._pending.append((msg["lease"], None))
            return None
        if msg["offset"] + msg["nbytes"] > imp.buf.size:
            self._pending.append((msg["lease"], None))
            err = ProtocolError(f"the broker of {self.producer} lent bytes beyond its chunk")
            self._break(err)
            raise err
        imp.refs += 1
        self._trim()
        return msg["lease"], imp, msg["offset"], msg["nbytes"], bytes.fromhex(msg["event"])

    def _trim(self) -> None:
        idle = [k for k, imp in self._imports.items() if imp.refs == 0]
        for key in idle[:max(0, len(idle) - MAX_IDLE_IMPORTS)]:
            self._unmap(key)

    def _unmap(self, key: tuple[int, int]) -> None:
        imp = self._imports.pop(key)
        if not imp.retired:
            self._drops.append(imp.chunk)  # the broker sends its fds again if it is lent again
        imp.buf.close()

    def release(self, lease: int, imp: _Import) -> None:
        """End ``lease`` (its storage was freed). Safe from a finalizer in any thread: when another
        thread holds the connection (or this one, re-entered by the garbage collector), the release
        goes with that holder's next message instead."""
        if os.getpid() != self.pid:
            return  # a forked child: the lease is the parent's
        self._pending.append((lease, imp))  # list.append is atomic; whoever holds the lock sends it
        if self._lock.acquire(blocking=False):
            try:
                self._flush_quietly()
            finally:
                self._lock.release()

    def _flush(self) -> None:
        """Under the lock: send the pending releases and drops, and unmap retired chunks now unused."""
        while self._pending or self._drops:
            pending, self._pending = self._pending, []
            for _, imp in pending:
                if imp is not None:
                    imp.refs -= 1
                    if imp.refs == 0 and (imp.retired or self.broken is not None):
                        key = next((k for k, v in self._imports.items() if v is imp), None)
                        if key is not None:
                            self._unmap(key)
            drops, self._drops = self._drops, []
            if self.broken is not None:
                continue
            if drops:
                send_message(self._sock, {"kind": "drop", "chunks": drops}, timeout=self.timeout)
            if pending:
                send_message(self._sock, {"kind": "release", "leases": [lease for lease, _ in pending]},
                             timeout=self.timeout)

    def _flush_quietly(self) -> None:
        try:
            self._flush()
        except DmaBufError as exc:  # the broker is gone: its leases ended with the connection
            self._break(exc)

    def _break(self, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = exc
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @property
    def mapped(self) -> int:
        """Chunks mapped here from this broker."""
        with self._lock:
            return len(self._imports)

    def close(self) -> None:
        """End the connection (the broker ends our leases); mappings still used stay until freed."""
        with self._lock:
            self._flush_quietly()
            self._break(PeerClosedError("closed by this process"))
            self._sock.close()
            for key in [k for k, imp in self._imports.items() if imp.refs == 0]:
                self._unmap(key)
            for imp in self._imports.values():
                imp.retired = True


def default_importer(mechanism: str, fds: list[int], parts: list[int], device: int, device_uuid: str) -> Any:
    """Map a lent chunk: POSIX-fd parts back to back on ``device``
    (:func:`~dmabuf_interop.mechanisms.posix_fd.import_posix_fd_parts`), or one memfd
    (:func:`~dmabuf_interop.mechanisms.memfd.import_memfd`, host memory: ``device`` is not used).

    Raises:
        InvalidArgumentError: several memfd parts; what the import functions raise.
    """
    if mechanism == "memfd":
        if len(fds) != 1:
            raise InvalidArgumentError(f"a memfd chunk is one part, got {len(fds)}")
        from ...mechanisms.memfd import import_memfd

        return import_memfd(fds[0], parts[0])
    from ...mechanisms.posix_fd import import_posix_fd_parts

    return import_posix_fd_parts(fds, parts, device)


# --- process-wide state --------------------------------------------------------------------------

_state_lock = threading.Lock()
_allow_uids: Any = None  # the uids whose brokers this process borrows from (None: its effective uid)
_clients: dict[str, Client] = {}
_forked_leftovers: list[Any] = []  # a forked child's copies of the parent's clients: never finalised


def client_for(handle: ShareHandle, importer: Callable[..., Any], *, timeout: float | None = 60.0) -> Client:
    """This process's :class:`Client` of ``handle``'s broker, connected on first use (and again after
    that connection ended).

    Raises:
        StaleHandleError: the broker is gone. PeerRefusedError: it runs as another uid.
    """
    c = _clients.get(handle.address)
    if c is None or c.broken is not None:
        with _state_lock:
            c = _clients.get(handle.address)
            if c is None or c.broken is not None:
                if c is not None:
                    c.close()
                c = _clients[handle.address] = Client(handle, importer, timeout=timeout,
                                                     allow_uids=_allow_uids)
    return c


def iter_clients() -> Iterator[Client]:
    return iter(list(_clients.values()))


def _configure(allow_uids: frozenset[int] | None) -> None:
    """Set by :func:`.broker.configure`: the uids a client connected from now on accepts."""
    global _allow_uids
    _allow_uids = allow_uids


def _close_all() -> None:
    """Close this process's client connections (their brokers end our leases)."""
    with _state_lock:
        clients = list(_clients.values())
        _clients.clear()
    for c in clients:
        c.close()


def _after_fork_in_child() -> None:
    global _state_lock
    _state_lock = threading.Lock()
    for c in _clients.values():
        c._sock.close()
        _forked_leftovers.append(c)
    _clients.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
