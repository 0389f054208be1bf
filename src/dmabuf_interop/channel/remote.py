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

import atexit
import base64
import binascii
import dataclasses
import logging
import os
import re
import secrets
import socket
import threading
import time
import types
import urllib.parse
import weakref
from typing import Any

from .._time import check_timeout, deadline_after, remaining
from ..errors import (InvalidArgumentError, NotSupportedError, PeerClosedError, PeerRefusedError, ProtocolError,
                      SyscallError, TransferError, WaitTimeoutError)
from .auth import authenticate_connector, authenticate_listener, load_secret
from .channel import MAX_CHUNKS, Channel, PeerInfo, Received, _Hold
from .handshake import ListenerBase, hello, recv_hello, refuse
from .pool import Block, SharedPool, chunk_ids
from .protocol import PROTOCOL_VERSION, ArrayDescriptor, _int, _keys, visible_gpu_uuids
from .wire import recv_frame, send_frame, shut_down

__all__ = ["RemoteChannel", "RemoteListener", "listen_remote", "connect_remote", "is_remote", "nixl_module",
           "ucx_read_transports", "NIXL_EXTRA"]

#: What a user installs to get the remote path.
NIXL_EXTRA = "pip install 'dmabuf-interop[nixl]'"
#: Largest NIXL metadata blob accepted from a peer, bytes.
MAX_METADATA_BYTES = 1 << 20
#: After the control connection ends, how long an in-flight READ may still finish, seconds.
EOF_GRACE = 1.0


def is_remote(address: Any) -> bool:
    """Whether ``address`` is a ``tcp://HOST:PORT`` channel address."""
    return isinstance(address, str) and address.startswith("tcp://")


def nixl_module() -> Any:
    """The NIXL Python API module (``nixl_cu13``, ``nixl_cu12`` or ``nixl``); its ``nixl`` logger is set to
    ``WARNING`` unless ``$NIXL_LOG_LEVEL`` says otherwise.

    Raises:
        NotSupportedError: NIXL is not installed (the message names the extra to install).
    """
    import importlib

    errors = []
    for name in ("nixl_cu13", "nixl_cu12", "nixl._api"):
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if "NIXL_LOG_LEVEL" not in os.environ:  # NIXL logs each agent at INFO on standard output, the caller's
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return module
    raise NotSupportedError(f"tcp:// channels need NIXL, which is not importable ({'; '.join(errors)}): "
                            f"{NIXL_EXTRA}")


def _parse_address(address: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(address)
    try:
        port = parts.port
    except ValueError as exc:
        raise InvalidArgumentError(f"bad port in {address!r}: {exc}") from exc
    if parts.scheme != "tcp" or not parts.hostname or port is None or parts.path not in ("", "/") \
            or parts.query or parts.username:
        raise InvalidArgumentError(f"a remote address is tcp://HOST:PORT, got {address!r}")
    return parts.hostname, port


def ucx_read_transports(proto_info: str) -> list[str]:
    """The UCX transports (``"tcp/lo"``, ``"cuda_copy/cuda"``, ...) that ``UCX_PROTO_INFO=y`` output shows for
    ``ucp_get`` (NIXL ``READ``), in the order first seen.

    UCX prints its protocol tables to standard output when ``UCX_PROTO_INFO=y``
    is set before the agent is created; pass that text here.
    """
    found: list[str] = []
    in_get = False
    for line in proto_info.splitlines():
        if "remote memory read by ucp_get" in line:
            in_get = True
            continue
        if not in_get:
            continue
        cells = [c.strip() for c in line.split("|")]
        if len(cells) >= 5 and cells[1] and cells[1] != "Range":
            for t in re.split(r",\s*|\s+", cells[3]):
                m = re.match(r"(\d+%\s+on\s+)?([a-z_0-9]+/[\w:.\-]+)", t)
                if m and m.group(2) not in found:
                    found.append(m.group(2))
        elif len(cells) == 3 and cells[1] and "ucp_get" not in cells[1] and not cells[1].startswith("+"):
            in_get = False  # the title of the next table
    return found


def _b64_field(msg: dict[str, Any], key: str, limit: int) -> bytes:
    v = msg.get(key)
    if not isinstance(v, str) or len(v) > 4 * limit // 3 + 4:
        raise ProtocolError(f"field {key!r} must be base64 of at most {limit} bytes")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(f"field {key!r} is not base64: {exc}") from exc


class _Agent:
    """A NIXL agent for one channel, its registrations (chunk id -> descriptor list), and a lock around it.

    NIXL agents are created without a listener thread (``NIXL_THREAD_SYNC_NONE``), so
    every call into one goes through ``lock``.
    """

    def __init__(self) -> None:
        nixl = nixl_module()
        self.name = f"dmabuf-interop-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}"
        self.lock = threading.Lock()
        self.registered: dict[int, Any] = {}
        self.remotes: set[str] = set()
        self.closed = False
        self.agent = self._call("nixl_agent", nixl.nixl_agent, self.name, nixl.nixl_agent_config(backends=["UCX"]))
        _LIVE_AGENTS.add(self)
        if "UCX" not in self.agent.backends:
            raise NotSupportedError(f"NIXL has no UCX backend here (plugins: {self.agent.plugin_list})")

    @staticmethod
    def _call(what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own exception types for every status
            raise TransferError(f"{what} failed: {type(exc).__name__}: {exc}") from exc

    def call(self, what: str, *args: Any) -> Any:
        with self.lock:
            if self.closed:
                raise PeerClosedError("the channel is closed")
            return self._call(what, getattr(self.agent, what), *args)

    def register(self, chunk: Any, host: bool) -> bytes | None:
        """Register a pool chunk once; returns its partial agent metadata when newly registered."""
        with self.lock:
            if self.closed:
                raise PeerClosedError("the channel is closed")
            if chunk.id in self.registered:
                return None
            mem, dev = ("DRAM", 0) if host else ("VRAM", chunk.device)
            descs = self._call("register_memory", self.agent.register_memory, [(chunk.ptr, chunk.size, dev, "")], mem)
            self.registered[chunk.id] = descs
            return self._call("get_partial_agent_metadata", self.agent.get_partial_agent_metadata, descs, False)

    def deregister(self, chunk_id: int) -> None:
        with self.lock:
            descs = self.registered.pop(chunk_id, None)
            if descs is not None and not self.closed:
                self._call("deregister_memory", self.agent.deregister_memory, descs)

    def close(self) -> None:
        """Deregister everything, forget the peers and destroy the agent (idempotent)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            regs, self.registered = self.registered, {}
            remotes, self.remotes = self.remotes, set()
            for descs in regs.values():
                try:
                    self.agent.deregister_memory(descs)
                except Exception:  # noqa: BLE001 - deregister everything even if one fails
                    pass
            for name in remotes:
                try:
                    self.agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001
                    pass
            # Destroy the agent now, while the interpreter is whole: left to interpreter exit, its
            # progress thread can still be running when the C++ runtime tears down (std::terminate).
            self.agent = None


#: Agents not closed yet: closed at interpreter exit (atexit runs before the interpreter is torn down),
#: so a channel its owner never closed does not leave NIXL's progress thread to the C++ runtime's exit.
_LIVE_AGENTS: "weakref.WeakSet[_Agent]" = weakref.WeakSet()


@atexit.register
def _close_live_agents() -> None:
    for agent in list(_LIVE_AGENTS):
        agent.close()


class _Region:
    """A producer chunk as the consumer knows it: NIXL address, size, device, memory type."""

    def __init__(self, addr: int, size: int, device: int, mem: str) -> None:
        self.addr, self.size, self.device, self.mem = addr, size, device, mem
        self.is_host = mem == "DRAM"

    # The base channel calls these on queueing, retire and end: nothing is mapped here.
    def retain(self) -> None:
        pass

    def release(self) -> None:
        pass

    def retire(self) -> None:
        pass


class _LocalBlock:
    """A block of this side's pool that a ``READ`` filled; back to the pool when its batch's
    :class:`Received` are all released or gone.

    Offers what :class:`Received` reads from an imported chunk (``id``, ``size``, ``device``, ``buf.ptr``,
    ``buf._mapping``).
    """

    def __init__(self, block: Block) -> None:
        self.block = block
        self.buf = self
        self.id = next(chunk_ids)  # its own: torch views of a batch are made per chunk (_BatchViews)
        self.size = block.size
        self.ptr = block.ptr
        self.device = -1 if block.pool.is_host else block.pool.device
        self._mapping = (types.SimpleNamespace(map=block.chunk.host_keepalive(block.offset, block.size))
                         if block.pool.is_host else None)
        self._refs = 0  # the hold's and each view's (channel._ChunkRef): the block goes back at 0
        self._lock = threading.Lock()

    def retain(self) -> None:
        with self._lock:
            self._refs += 1

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            self.block.pool._unref(self.block)


class RemoteChannel(Channel):
    """A channel to a peer on another host (or another process that shares no fd): NIXL moves the bytes.

    Same API as :class:`.channel.Channel`. Differences: device pools always use
    ``ordering="sync"`` (the producer synchronises the stream before announcing
    the array: no IPC event crosses hosts); :meth:`recv` copies each array into
    a block of this side's pool (the ``pool`` given to ``listen``/``connect``, or
    a private pool on ``device``) with a NIXL ``READ`` and releases the producer's
    lease at once; ``peer.uid``/``peer.gid`` are ``-1`` (no ``SO_PEERCRED`` over
    TCP) and ``peer.pid`` is the peer's own claim.

    Attributes:
        transport: ``{"mechanism": "nixl", "backend": ..., "ucx_tls": ..., "ucx_net_devices": ...}``;
            ``backend`` is ``query_xfer_backend`` of the last READ (``None`` before the first).
        xfer_timeout: seconds a READ may take before :class:`WaitTimeoutError` (``None``: no limit).
    """

    share_segments = False  # NIXL reads registered pool chunks only: torch's pages are copied into the pool
    _views_follow_layout = False  # each item is read into a block of its own (_make_received)

    def __init__(self, sock: socket.socket, peer: PeerInfo, agent: _Agent, remote_agent: str, *,
                 pool: SharedPool | None, device: int | None, xfer_timeout: float | None) -> None:
        self._agent = agent
        self._remote = remote_agent
        self._own_pool: SharedPool | None = None
        self._xfer_lock = threading.Lock()
        self.xfer_timeout = xfer_timeout  # checked by listen_remote / connect_remote: None is no limit
        self.transport: dict[str, Any] = {"mechanism": "nixl", "backend": None,
                                          "ucx_tls": os.environ.get("UCX_TLS", "all"),
                                          "ucx_net_devices": os.environ.get("UCX_NET_DEVICES", "all")}
        super().__init__(sock, peer, pool=pool, device=device, ordering="sync")
        # A background reader from the start: a READ that fails must learn at once whether the
        # producer's control connection ended (EOF), even on a channel that only receives.
        self._start_reader()

    # --- producer side ---------------------------------------------------------------

    def _send_chunk_locked(self, block: Block) -> None:
        """A ``region`` message instead of an fd: the chunk registered with this channel's agent."""
        chunk = block.chunk
        md = self._agent.register(chunk, block.pool.is_host)
        if md is None:  # registered as a READ target already: its metadata is needed now
            md = self._agent.call("get_partial_agent_metadata", self._agent.registered[chunk.id], False)
        self._send_locked({"kind": "region", "chunk": chunk.id, "addr": chunk.ptr, "size": chunk.size,
                           "device": 0 if block.pool.is_host else chunk.device,
                           "mem": "DRAM" if block.pool.is_host else "VRAM", "metadata": base64.b64encode(md).decode()})

    def _retire_chunk(self, chunk_id: int) -> None:
        # Deregister first: from here on NIXL refuses reads of this chunk, whatever the peer does.
        try:
            self._agent.deregister(chunk_id)
        except TransferError:
            pass
        super()._retire_chunk(chunk_id)

    def _send_items(self, names: list[str | None], arrays: list[Any], stream: Any, meta: dict[str, Any] | None,
                    timeout: float | None, ordering: str | None, batch: str | None) -> Any:
        return super()._send_items(names, arrays, stream, meta, timeout, "sync", batch)

    # --- reader thread ---------------------------------------------------------------------

    def _handle(self, msg: dict[str, Any], fds: list[int]) -> None:
        if fds:
            raise ProtocolError("a message on a tcp:// channel carried an fd")
        if msg.get("kind") != "region":
            super()._handle(msg, fds)
            return
        _keys(msg, {"kind", "chunk", "addr", "size", "device", "mem", "metadata"}, "region message")
        cid = _int(msg, "chunk", 1)
        addr, size = _int(msg, "addr"), _int(msg, "size", 1)
        device = _int(msg, "device", 0, 1 << 16)
        if msg["mem"] not in ("DRAM", "VRAM"):
            raise ProtocolError(f"region memory type must be DRAM or VRAM, got {msg['mem']!r}")
        md = _b64_field(msg, "metadata", MAX_METADATA_BYTES)
        if cid in self._imports:
            raise ProtocolError(f"region {cid} announced twice")
        if len(self._imports) >= MAX_CHUNKS:
            raise ProtocolError(f"the peer announced more than {MAX_CHUNKS} regions")
        name = self._agent.call("add_remote_agent", md)
        name = name.decode() if isinstance(name, bytes) else name
        if name != self._remote:
            raise ProtocolError(f"region metadata names agent {name!r}, not the peer's {self._remote!r}")
        self._imports[cid] = _Region(addr, size, device, msg["mem"])

    def _release_lease(self, lease_id: int, *, inline: bool = False) -> None:
        pass  # the lease was released right after the READ; a Received holds only local memory

    def _end(self) -> None:
        super()._end()
        with self._xfer_lock:  # a READ in flight sees the end and stops within EOF_GRACE
            self._agent.close()

    # --- consumer side ---------------------------------------------------------------------

    def _recv_pool(self) -> SharedPool:
        if self.pool is not None:
            return self.pool
        if self._own_pool is None:
            self._own_pool = SharedPool(self.device)
            self._own_pool._register_channel(self)
        return self._own_pool

    def _make_received(self, lease_id: int, descs: list[ArrayDescriptor], stream: int,
                       ordering: str | None, chunks: dict[int, Any]) -> list[Received]:
        pool = self._recv_pool()
        blocks: list[Block] = []
        try:
            with self._xfer_lock:
                groups: dict[tuple[str, str], tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]] = {}
                for d in descs:
                    region = self._region(d.chunk)
                    span = d.extent() - d.byte_offset if d.extent() else 0
                    block = pool.alloc(span, timeout=self.xfer_timeout)
                    pool._ref(block)
                    blocks.append(block)
                    if span:
                        self._agent.register(block.chunk, pool.is_host)
                        local_mem = "DRAM" if pool.is_host else "VRAM"
                        local, remote = groups.setdefault((local_mem, region.mem), ([], []))
                        local.append((block.ptr, span, 0 if pool.is_host else pool.device))
                        remote.append((region.addr + d.block_offset + d.byte_offset, span, region.device))
                for (local_mem, remote_mem), (local, remote) in groups.items():
                    self._read(local, local_mem, remote, remote_mem)
        except BaseException:
            for b in blocks:
                pool._unref(b)
            raise
        self._consumed(lease_id)
        local_blocks = [_LocalBlock(block) for block in blocks]
        hold = _Hold(self, lease_id, local_blocks, len(descs))
        out = []
        for d, block, lb in zip(descs, blocks, local_blocks):
            local = ArrayDescriptor(lb.id, 0, block.size, 0, d.shape, d.strides, d.dtype,
                                    "none" if pool.is_host else "sync", None, d.name, d.meta)
            out.append(Received(hold, local, lb))
        return out

    def _consumed(self, lease_id: int) -> None:
        """The READ of the producer's lease is over: release it (sent by the flusher thread, so that
        the next READ need not wait for this send). The channel's own release, which this class turns
        off for the Received (they hold only local memory)."""
        super()._release_lease(lease_id)

    def _region(self, chunk_id: int) -> "_Region":
        region = self._imports.get(chunk_id)
        if not isinstance(region, _Region):
            raise PeerClosedError(f"region {chunk_id} was retired before its array was read")
        return region

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
        from .channel import _inspect

        _, lease_id, descs, *_ = self._next(timeout, want_batch=False)
        d = descs[0]
        try:
            dst = _inspect(out)
            if tuple(dst.shape) != d.shape or dst.dtype != d.dtype:
                raise InvalidArgumentError(f"out is {dst.dtype}{list(dst.shape)}, the array sent is "
                                           f"{d.dtype}{list(d.shape)}")
            if not (d.is_c_contiguous() and dataclasses.replace(d, strides=tuple(dst.strides)).is_c_contiguous()):
                raise InvalidArgumentError("recv_into needs C-contiguous arrays on both sides; recv() reads any layout")
            region = self._region(d.chunk)
            if d.nbytes:
                mem, dev = ("DRAM", 0) if dst.device < 0 else ("VRAM", dst.device)
                with self._xfer_lock:
                    reg = self._agent.call("register_memory", [(dst.ptr, d.nbytes, dev, "")], mem)
                    try:
                        self._read([(dst.ptr, d.nbytes, dev)], mem,
                                   [(region.addr + d.block_offset + d.byte_offset, d.nbytes, region.device)],
                                   region.mem)
                    finally:
                        try:
                            self._agent.call("deregister_memory", reg)
                        except (TransferError, PeerClosedError):
                            pass  # the channel ended meanwhile: its agent is gone with the registration
        finally:
            self._consumed(lease_id)
        return d.meta

    def _read(self, local: list[tuple[int, int, int]], local_mem: str, remote: list[tuple[int, int, int]],
              remote_mem: str) -> None:
        """One NIXL READ of ``remote`` into ``local``, waited for with :attr:`xfer_timeout`.

        A NIXL failure while the control connection ends (within :data:`EOF_GRACE`) is the
        producer going away: :class:`PeerClosedError`.
        """
        try:
            self._read_once(local, local_mem, remote, remote_mem)
        except TransferError as exc:
            with self._state:
                self._state.wait_for(lambda: self._eof, EOF_GRACE)
            if self._eof:
                raise PeerClosedError(f"the producer went while a NIXL READ was in flight ({exc})") from exc
            raise

    def _read_once(self, local: list[tuple[int, int, int]], local_mem: str, remote: list[tuple[int, int, int]],
                   remote_mem: str) -> None:
        a = self._agent
        ldescs = a.call("get_xfer_descs", local, local_mem)
        rdescs = a.call("get_xfer_descs", remote, remote_mem)
        handle = a.call("initialize_xfer", "READ", ldescs, rdescs, self._remote)
        try:
            state = a.call("transfer", handle)
            deadline = deadline_after(self.xfer_timeout)
            eof_at = None
            spins = 0
            while state == "PROC":
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    raise WaitTimeoutError(f"NIXL READ of {sum(n for _, n, _ in local)} bytes not done within "
                                           f"{self.xfer_timeout} s")
                if self._eof and eof_at is None:
                    eof_at = now
                if eof_at is not None and now - eof_at > EOF_GRACE:
                    raise PeerClosedError("the producer went while a NIXL READ was in flight")
                spins += 1
                if spins > 50:  # short transfers finish while spinning; the peer may need the core to serve the READ
                    time.sleep(0.0002)
                state = a.call("check_xfer_state", handle)
            if state != "DONE":
                raise PeerClosedError(f"NIXL READ failed (state {state}): the producer went or retired the "
                                      f"memory" if self._eof else f"NIXL READ failed (state {state})")
            self.transport["backend"] = a.call("query_xfer_backend", handle)
        finally:
            try:
                a.call("release_xfer_handle", handle)
            except (TransferError, PeerClosedError):
                pass

    def close(self, timeout: float = 5.0) -> None:
        """As :meth:`.channel.Channel.close`; also deregisters every NIXL registration of this channel."""
        super().close(timeout)
        with self._xfer_lock:
            self._agent.close()

    def __repr__(self) -> str:
        return f"<RemoteChannel peer={self.peer_address} {'closed' if self.closed else 'open'}>"

    @property
    def peer_address(self) -> str:
        return self._peer_address

    def _set_peer_address(self, sock: socket.socket) -> None:
        host, port = sock.getpeername()[:2]
        self._peer_address = f"tcp://{host}:{port}"


def _handshake(sock: socket.socket, secret: bytes, timeout: float | None, listener: bool, pool: SharedPool | None,
               device: int | None, xfer_timeout: float | None) -> RemoteChannel:
    """Authenticate, exchange hello and NIXL metadata; the listener speaks first at each step."""
    deadline = deadline_after(timeout)

    def left() -> float | None:
        return remaining(deadline)

    (authenticate_listener if listener else authenticate_connector)(sock, secret, left())
    mine = hello(None, visible_gpu_uuids())
    if listener:
        send_frame(sock, mine)
    theirs = recv_hello(sock, left())
    if theirs["protocol"] != PROTOCOL_VERSION:  # the boot ids differ by design: no fd crosses
        why = f"protocol version mismatch: this side speaks {PROTOCOL_VERSION}, the peer {theirs['protocol']}"
        refuse(sock, why)
        raise PeerRefusedError(why)
    if not listener:
        send_frame(sock, mine)
    agent = _Agent()
    try:
        own = {"kind": "nixl", "agent": agent.name,
               "metadata": base64.b64encode(agent.call("get_agent_metadata")).decode()}
        if listener:
            send_frame(sock, own)
        msg, fds = recv_frame(sock, left())
        if fds:
            from ..fdpass import close_fds

            close_fds(fds)
            raise ProtocolError("the handshake carried an fd")
        if msg.get("kind") == "refuse":
            raise PeerRefusedError(f"the peer refused this connection: {str(msg.get('reason'))[:512]}")
        if msg.get("kind") != "nixl":
            raise ProtocolError(f"expected a nixl message, got {msg.get('kind')!r}")
        _keys(msg, {"kind", "agent", "metadata"}, "nixl message")
        if not isinstance(msg["agent"], str) or not 0 < len(msg["agent"]) <= 256 or msg["agent"] == agent.name:
            raise ProtocolError("nixl message: agent must be a name of 1 to 256 characters, not ours")
        name = agent.call("add_remote_agent", _b64_field(msg, "metadata", MAX_METADATA_BYTES))
        name = name.decode() if isinstance(name, bytes) else name
        agent.remotes.add(name)
        if name != msg["agent"]:
            raise ProtocolError(f"the peer's metadata names agent {name!r}, not {msg['agent']!r}")
        if not listener:
            send_frame(sock, own)
    except BaseException:
        agent.close()
        raise
    peer = PeerInfo(theirs["pid"], -1, -1, tuple(theirs["gpus"]), theirs["library"])
    ch = RemoteChannel(sock, peer, agent, name, pool=pool, device=device, xfer_timeout=xfer_timeout)
    ch._set_peer_address(sock)
    return ch


class RemoteListener(ListenerBase):
    """A listening ``tcp://`` address; :meth:`accept` hands out one :class:`RemoteChannel` per consumer."""

    def __init__(self, sock: socket.socket, secret: bytes, *, pool: SharedPool | None, device: int | None,
                 xfer_timeout: float | None) -> None:
        self._sock = sock
        self._stopped = False  # set before the socket is shut down: accept() then knows why it woke
        self._secret = secret
        self.pool = pool
        self._device = device
        self._xfer_timeout = xfer_timeout
        host, port = sock.getsockname()[:2]
        self.address = f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"

    def accept(self, timeout: float | None = 60.0) -> RemoteChannel:
        """Wait for the next consumer, authenticate it and return its channel.

        Raises:
            WaitTimeoutError: no consumer (or no complete handshake) within ``timeout`` seconds.
            PeerRefusedError: wrong shared secret (the peer is told), a protocol mismatch, or the peer refused us.
            ProtocolError: a malformed handshake message.
            TransferError: NIXL could not create the agent or load the peer's metadata.
            InvalidArgumentError: the listener is closed.

        A connection whose peer left before or during the handshake is skipped.
        """
        return super().accept(timeout)

    def _accept_one(self, conn: socket.socket, deadline: float | None) -> RemoteChannel:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _handshake(conn, self._secret, remaining(deadline), True, self.pool, self._device,
                          self._xfer_timeout)

    def close(self) -> None:
        """Stop listening (idempotent); a thread waiting in :meth:`accept` is woken."""
        self._stopped = True
        shut_down(self._sock)  # wakes a thread waiting in accept()
        self._sock.close()

    @property
    def closed(self) -> bool:
        return self._stopped or self._sock.fileno() < 0


def listen_remote(address: str, *, pool: SharedPool | None = None, device: int | None = None, backlog: int = 64,
                  token: str | bytes | None = None, token_file: str | os.PathLike[str] | None = None,
                  xfer_timeout: float | None = 60.0) -> RemoteListener:
    """Listen on ``tcp://HOST:PORT`` (port 0: any free port; :attr:`RemoteListener.address` has it).

    Args:
        pool: the pool arrays are lent from (and received into, when this side receives).
        device: the GPU of the private receive pool made when ``pool`` is ``None``.
        token, token_file: the shared secret (else ``$DMABUF_INTEROP_TOKEN``), at least 16 bytes.
        xfer_timeout: seconds a NIXL READ may take (``None`` or ``math.inf``: no limit; NaN or a
            negative one is ``InvalidArgumentError``).

    Raises:
        InvalidArgumentError: a bad address, secret or xfer_timeout. NotSupportedError: NIXL is not installed.
        SyscallError: ``socket``/``bind``/``listen`` failed.
    """
    host, port = _parse_address(address)
    secret = load_secret(token, token_file)
    xfer_timeout = check_timeout(xfer_timeout)  # refused here, not at the first READ; math.inf is None
    nixl_module()
    try:
        sock = socket.create_server((host, port), backlog=backlog)
    except OSError as exc:
        raise SyscallError(f"bind/listen on {address}", exc) from exc
    return RemoteListener(sock, secret, pool=pool, device=device, xfer_timeout=xfer_timeout)


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
    host, port = _parse_address(address)
    secret = load_secret(token, token_file)
    xfer_timeout = check_timeout(xfer_timeout)  # refused here, not at the first READ; math.inf is None
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
