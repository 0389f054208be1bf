"""Channels across hosts: a TCP control connection, bytes moved by NIXL ``READ``.

``listen("tcp://HOST:PORT", token=...)`` / ``connect(...)`` give a
:class:`RemoteChannel`, a :class:`.channel.Channel` whose chunks are not fds but
NIXL registrations. The control connection is authenticated with a shared
secret (:mod:`.auth`), then both sides exchange ``hello`` (protocol version)
and their NIXL agent metadata (``get_agent_metadata``, base64 in JSON). The
producer registers each pool chunk it lends with its agent once
(``register_memory``: ``"DRAM"`` for host pools, ``"VRAM"`` for device pools)
and announces it with a ``region`` message carrying the chunk's partial agent
metadata; array descriptors then name blocks inside announced regions. The
consumer reads each array into a block of its own pool with one NIXL ``READ``
(``initialize_xfer``, ``transfer``, ``check_xfer_state``), then releases the
producer's lease at once: a :class:`~.channel.Received` from a remote channel is
local memory. NIXL's descriptor pickling (``get_serialized_descs``) is never used.

See ``docs/remote.md`` for deployment, security and the support matrix.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import functools
import os
import socket
import threading
from typing import Any

from ..._time import check_timeout, deadline_after, remaining
from ...errors import (AddressInUseError, InvalidArgumentError, PeerClosedError, PeerRefusedError, ProtocolError,
                       SyscallError, TransferError, WaitTimeoutError)
from ..auth import authenticate_connector, authenticate_listener, load_secret
from ..channel import Channel, PeerInfo
from ..handshake import HANDSHAKE_TIMEOUT, ListenerBase, hello, recv_handshake_frame, recv_hello, refuse
from ..pool import SharedPool
from ..protocol import MAX_METADATA_BYTES, PROTOCOL_VERSION, parse_nixl, visible_gpu_uuids
from ..sending import inspect_array
from ..wire import send_frame
from ._nixl import NIXL_EXTRA, Agent, is_remote, nixl_module, parse_address, ucx_read_transports
from .carrier import EOF_GRACE, NixlCarrier

__all__ = ["RemoteChannel", "RemoteListener", "listen_remote", "connect_remote", "is_remote", "nixl_module",
           "ucx_read_transports", "NIXL_EXTRA", "MAX_METADATA_BYTES", "EOF_GRACE"]


class RemoteChannel(Channel):
    """A channel to a peer on another host (or another process that shares no fd): NIXL moves the bytes.

    A :class:`.channel.Channel` whose carrier is :class:`.carrier.NixlCarrier`; this class only adds what
    ``tcp://`` alone offers (:meth:`recv_into`, :attr:`transport`, :attr:`xfer_timeout`,
    :attr:`peer_address`). Differences: device pools always use ``ordering="sync"`` (the producer
    synchronises the stream before announcing the array: no IPC event crosses hosts); :meth:`recv`
    copies each array into a block of this side's pool (the ``pool`` given to ``listen``/``connect``, or
    a private pool on ``device``) with a NIXL ``READ`` and releases the producer's lease at once;
    ``peer.uid``/``peer.gid`` are ``-1`` (no ``SO_PEERCRED`` over TCP) and ``peer.pid`` is the peer's own claim.

    Attributes:
        transport: ``{"mechanism": "nixl", "backend": ..., "ucx_tls": ..., "ucx_net_devices": ...}``;
            ``backend`` is ``query_xfer_backend`` of the last READ (``None`` before the first).
        xfer_timeout: seconds a READ may take before :class:`WaitTimeoutError` (``None``: no limit).
    """

    def __init__(self, sock: socket.socket, peer: PeerInfo, agent: Agent, remote_agent: str, *,
                 pool: SharedPool | None, device: int | None, xfer_timeout: float | None) -> None:
        self._nixl = NixlCarrier(agent, remote_agent, pool=pool, device=device, xfer_timeout=xfer_timeout)
        self._peer_address = ""
        super().__init__(sock, peer, pool=pool, device=device, ordering="sync", carrier=self._nixl)

    @property
    def transport(self) -> dict[str, Any]:
        return self._nixl.transport_info

    @property
    def xfer_timeout(self) -> float | None:
        return self._nixl.xfer_timeout

    @xfer_timeout.setter
    def xfer_timeout(self, value: float | None) -> None:
        self._nixl.xfer_timeout = value

    def recv_into(self, out: Any, timeout: float | None = 60.0) -> dict[str, Any] | None:
        """Read the next array straight into ``out`` with one NIXL ``READ``, then release the producer's lease.

        ``out`` is the caller's C-contiguous array of the sent array's shape and dtype: host
        memory (NumPy, or anything with ``__array_interface__``) or device memory (DLPack or
        ``__cuda_array_interface__``). It is registered with NIXL (``"DRAM"`` / ``"VRAM"``) for
        this READ only, so :meth:`recv` into this side's pool is faster for repeated reads.

        Returns:
            The sender's ``meta`` (``None`` when it gave none).

        Raises:
            InvalidArgumentError: ``out`` differs in shape or dtype, or either array is not
                C-contiguous (the array is dropped and its lease released).
            WaitTimeoutError: nothing within ``timeout``, or the READ not done within :attr:`xfer_timeout`.
            PeerClosedError: the producer has gone (before or during the READ).
            TransferError: NIXL could not register ``out`` or read.
            ProtocolError: as :meth:`recv`; the next message is a batch: use :meth:`recv_many`.
        """
        try:
            q = self._next(timeout, want_batch=False)
            lease_id, d = q.event.lease, q.event.descs[0]
        except BaseException as exc:
            self._interrupted_taking(exc)  # (Note [interrupted handling], in .._reader)
            raise
        self._conn.taking = 0
        nixl = self._nixl
        try:
            dst = inspect_array(out)
            if tuple(dst.shape) != d.shape or dst.dtype != d.dtype:
                raise InvalidArgumentError(f"out is {dst.dtype}{list(dst.shape)}, the array sent is "
                                           f"{d.dtype}{list(d.shape)}")
            if not (d.is_c_contiguous() and dataclasses.replace(d, strides=tuple(dst.strides)).is_c_contiguous()):
                raise InvalidArgumentError("recv_into needs C-contiguous arrays on both sides; recv() reads any layout")
            region = nixl.region(q.chunks, d.chunk)
            if d.nbytes:
                mem, dev = ("DRAM", 0) if dst.device < 0 else ("VRAM", dst.device)
                with nixl.xfer_lock:
                    reg = nixl.agent.call("register_memory", [(dst.ptr, d.nbytes, dev, "")], mem)
                    try:
                        nixl.read(self, [(dst.ptr, d.nbytes, dev)], mem,
                                   [(region.addr + d.block_offset + d.byte_offset, d.nbytes, region.device)],
                                   region.mem)
                    finally:
                        try:
                            nixl.agent.call("deregister_memory", reg)
                        except (TransferError, PeerClosedError):
                            pass  # the channel ended meanwhile: its agent is gone with the registration
        finally:
            self._release_lease(lease_id)  # the READ is over (or will not happen): the producer may have it back
        return d.meta

    def __repr__(self) -> str:
        return f"<RemoteChannel peer={self.peer_address} {'closed' if self.closed else 'open'}>"

    @property
    def peer_address(self) -> str:
        """``tcp://HOST:PORT`` of the peer (``""`` where it reset the connection during the handshake)."""
        return self._peer_address


#: Held while an agent is made: NIXL/UCX set-up is not known to be safe from several threads at once.
_AGENT_LOCK = threading.Lock()


def _handshake(sock: socket.socket, secret: bytes, timeout: float | None, listener: bool, pool: SharedPool | None,
               device: int | None, xfer_timeout: float | None) -> RemoteChannel:
    """Authenticate, exchange hello and NIXL metadata; the listener speaks first at each step."""
    deadline = deadline_after(timeout)

    def left() -> float | None:
        return remaining(deadline)

    (authenticate_listener if listener else authenticate_connector)(sock, secret, left())
    mine = hello(None, visible_gpu_uuids())
    if listener:
        send_frame(sock, mine, timeout=left())
    theirs = recv_hello(sock, left())
    if theirs["protocol"] != PROTOCOL_VERSION:  # the boot ids differ by design: no fd crosses
        why = f"protocol version mismatch: this side speaks {PROTOCOL_VERSION}, the peer {theirs['protocol']}"
        refuse(sock, why)
        raise PeerRefusedError(why)
    if not listener:
        send_frame(sock, mine, timeout=left())
    with _AGENT_LOCK:  # a listener's handshakes run in threads of their own: one agent made at a time
        agent = Agent()
    try:
        own = {"kind": "nixl", "agent": agent.name,
               "metadata": base64.b64encode(agent.call("get_agent_metadata")).decode()}
        if listener:
            send_frame(sock, own, timeout=left())
        msg, fds = recv_handshake_frame(sock, left())
        if fds:
            from ...fdpass import close_fds

            close_fds(fds)
            raise ProtocolError("the handshake carried an fd")
        if msg.get("kind") == "refuse":
            raise PeerRefusedError(f"the peer refused this connection: {str(msg.get('reason'))[:512]}")
        if msg.get("kind") != "nixl":
            raise ProtocolError(f"expected a nixl message, got {msg.get('kind')!r}")
        name = agent.call("add_remote_agent", parse_nixl(msg, agent.name))
        name = name.decode() if isinstance(name, bytes) else name
        agent.remotes.add(name)
        if name != msg["agent"]:
            raise ProtocolError(f"the peer's metadata names agent {name!r}, not {msg['agent']!r}")
        if not listener:
            send_frame(sock, own, timeout=left())
    except BaseException:
        agent.close()
        raise
    peer = PeerInfo(theirs["pid"], -1, -1, tuple(theirs["gpus"]), theirs["library"])
    # Read before the channel is made: its reader may end the connection (the peer closed at once) and close
    # the socket before the next line runs.
    try:
        host, port = sock.getpeername()[:2]
        address = f"tcp://{host}:{port}"
    except OSError:  # the peer reset the connection: the channel it gets has ended
        address = ""
    ch = RemoteChannel(sock, peer, agent, name, pool=pool, device=device, xfer_timeout=xfer_timeout)
    ch._peer_address = address
    return ch


class RemoteListener(ListenerBase):
    """A listening ``tcp://`` address; :meth:`accept` hands out one :class:`RemoteChannel` per consumer.

    Handshakes (authentication, ``hello``, NIXL metadata) run concurrently, each within
    :attr:`handshake_timeout` (Note [concurrent handshakes] in :mod:`..handshake`): a stray HTTP request,
    a wrong token or a client that says nothing is refused, counted in :attr:`refused` and logged, and
    never holds up or ends a serve loop.
    """

    def __init__(self, sock: socket.socket, secret: bytes, *, pool: SharedPool | None, device: int | None,
                 xfer_timeout: float | None, handshake_timeout: float | None = HANDSHAKE_TIMEOUT) -> None:
        self.pool = pool
        host, port = sock.getsockname()[:2]
        address = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"
        run = functools.partial(_accept_handshake, secret, pool, device, xfer_timeout)
        self._start(sock, address, run, _describe_tcp, handshake_timeout)

    def accept(self, timeout: float | None = 60.0, *, raise_refused: bool = False) -> RemoteChannel:
        """The next consumer that authenticated and completed its handshake, as a :class:`RemoteChannel`.

        A peer that fails (wrong shared secret, malformed or stray bytes such as an HTTP request, a
        protocol mismatch, NIXL refusing its metadata, silence past ``handshake_timeout``) is told why,
        dropped, counted in :attr:`refused` and logged (``WARNING`` on the ``dmabuf_interop.channel``
        logger, naming ``host:port``); it is raised here only with ``raise_refused=True``. A peer that left
        during its handshake is dropped quietly.

        Raises:
            WaitTimeoutError: no consumer completed its handshake within ``timeout`` seconds.
            PeerRefusedError, ProtocolError, TransferError, WaitTimeoutError: with ``raise_refused``, the
                next refusal, in the order handshakes ended.
            SyscallError: ``accept(2)`` failed (at the fd limit the pending connection is refused and the
                listener backs off).
            ForkedResourceError: this process inherited the listener through ``fork()``.
            InvalidArgumentError: the listener is closed.
        """
        return self._acceptor.accept(timeout, raise_refused)


def _accept_handshake(secret: bytes, pool: SharedPool | None, device: int | None, xfer_timeout: float | None,
                      conn: socket.socket, deadline: float | None) -> RemoteChannel:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return _handshake(conn, secret, remaining(deadline), True, pool, device, xfer_timeout)


def _describe_tcp(conn: socket.socket, addr: Any) -> str:
    host, port = addr[:2]
    return f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"


def listen_remote(address: str, *, pool: SharedPool | None = None, device: int | None = None, backlog: int = 64,
                  token: str | bytes | None = None, token_file: str | os.PathLike[str] | None = None,
                  xfer_timeout: float | None = 60.0,
                  handshake_timeout: float | None = HANDSHAKE_TIMEOUT) -> RemoteListener:
    """Listen on ``tcp://HOST:PORT`` (port 0: any free port; :attr:`RemoteListener.address` has it).

    Args:
        pool: the pool arrays are lent from (and received into, when this side receives).
        device: the GPU of the private receive pool made when ``pool`` is ``None``.
        token, token_file: the shared secret (else ``$DMABUF_INTEROP_TOKEN``), at least 16 bytes.
        xfer_timeout: seconds a NIXL READ may take (``None`` or ``math.inf``: no limit; NaN or a
            negative one is ``InvalidArgumentError``).
        handshake_timeout: seconds each accepted connection has to authenticate and complete its handshake.

    Raises:
        AddressInUseError: the port is taken (``EADDRINUSE``).
        InvalidArgumentError: a bad address, secret or timeout. NotSupportedError: NIXL is not installed.
        SyscallError: ``socket``/``bind``/``listen`` failed.
    """
    host, port = parse_address(address)
    secret = load_secret(token, token_file)
    xfer_timeout = check_timeout(xfer_timeout, "xfer_timeout")  # refused here, not at the first READ; math.inf is None
    check_timeout(handshake_timeout, "handshake_timeout")
    nixl_module()
    try:
        sock = socket.create_server((host, port), backlog=backlog)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise AddressInUseError(f"address {address!r} is in use") from exc
        raise SyscallError(f"bind/listen on {address}", exc) from exc
    return RemoteListener(sock, secret, pool=pool, device=device, xfer_timeout=xfer_timeout,
                          handshake_timeout=handshake_timeout)


def connect_remote(address: str, *, timeout: float | None = 10.0, pool: SharedPool | None = None,
                   device: int | None = None, token: str | bytes | None = None,
                   token_file: str | os.PathLike[str] | None = None, xfer_timeout: float | None = 60.0) -> RemoteChannel:
    """Connect to a ``tcp://HOST:PORT`` listener, authenticate, and exchange NIXL metadata.

    Args:
        timeout: seconds for the TCP connection and the handshake.
        pool: the pool received arrays are read into (``None``: a private pool, host or on ``device``),
            and that :meth:`RemoteChannel.send` copies into.
        device: the GPU of that private pool.
        token, token_file, xfer_timeout: as for :func:`listen_remote`.

    Raises:
        SyscallError: ``connect`` failed (``ECONNREFUSED``: nobody listens).
        PeerRefusedError: wrong shared secret, either way. WaitTimeoutError: no handshake within ``timeout``.
        ProtocolError, PeerClosedError, TransferError, NotSupportedError: as :meth:`RemoteListener.accept`.
    """
    host, port = parse_address(address)
    secret = load_secret(token, token_file)
    xfer_timeout = check_timeout(xfer_timeout, "xfer_timeout")  # refused here, not at the first READ; math.inf is None
    nixl_module()
    try:
        sock = socket.create_connection((host, port), timeout=check_timeout(timeout))  # (math.inf: None)
    except socket.timeout as exc:
        raise WaitTimeoutError(f"connect to {address} took more than {timeout} s") from exc
    except OSError as exc:
        raise SyscallError(f"connect to {address}", exc) from exc
    try:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _handshake(sock, secret, timeout, False, pool, device, xfer_timeout)
    except BaseException:
        sock.close()
        raise
