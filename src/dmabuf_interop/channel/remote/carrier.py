"""The NIXL carrier of ``tcp://`` channels: chunks registered with NIXL and announced as ``region``
messages; arrays read into this side's pool with one NIXL ``READ``. Like every carrier it returns
messages and never sends (:mod:`.._carrier`)."""

from __future__ import annotations

import base64
import contextlib
import os
import threading
import time
from typing import Any, Iterator

from ..._time import deadline_after
from ...errors import PeerClosedError, ProtocolError, TransferError, WaitTimeoutError
from .._state import ChunkAnnounced
from ..pool import Block, SharedPool, chunk_ids
from ..protocol import ArrayDescriptor
from ..received import Hold, Received
from ._nixl import Agent

__all__ = ["NixlCarrier", "EOF_GRACE"]

#: After the control connection ends, how long an in-flight READ may still finish, seconds.
EOF_GRACE = 1.0


class _Region:
    """A producer chunk as the consumer knows it: NIXL address, size, device, memory type."""

    def __init__(self, addr: int, size: int, device: int, mem: str) -> None:
        self.addr, self.size, self.device, self.mem = addr, size, device, mem
        self.is_host = mem == "DRAM"
        self.retired = False  # retired by the producer, or the connection ended: no READ of it now

    # The channel calls these on queueing, retire and end: nothing is mapped here.
    def retain(self) -> None:
        pass

    def release(self) -> None:
        pass

    def retire(self) -> None:
        self.retired = True


class _LocalBlock:
    """A block of this side's pool that a ``READ`` filled; back to the pool when its batch's
    :class:`Received` are all released or gone.

    Offers what :class:`Received` reads from an imported chunk (``id``, ``size``, ``device``, ``ptr``, ``read_only``,
    ``mapping``, ``buf.ptr``).
    """

    def __init__(self, block: Block) -> None:
        self.block = block
        self.buf = self
        self.id = next(chunk_ids)  # its own: torch views of a batch are made per chunk (_BatchViews)
        self.size = block.size
        self.ptr = block.ptr
        self.read_only = False  # (this side's own block)
        self.device = -1 if block.pool.is_host else block.pool.device
        # (what a host view holds, as an imported chunk's mmap)
        self.mapping = block.chunk.host_keepalive(block.offset, block.size) if block.pool.is_host else None
        self._refs = 0  # the hold's and each view's (arrays.ChunkRef): the block goes back at 0
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


class NixlCarrier:
    """Chunks by NIXL on a ``tcp://`` channel: the producer registers each pool chunk it lends with its
    agent once and announces it with a ``region`` message; the consumer reads each array into a block of
    its own pool with one NIXL ``READ`` and releases the producer's lease at once (a Received from a
    ``tcp://`` channel holds local memory only).

    Attributes:
        transport_info: ``{"mechanism": "nixl", "backend": ..., "ucx_tls": ..., "ucx_net_devices": ...}``
            (:attr:`.RemoteChannel.transport`).
        xfer_timeout: seconds a READ may take (``None``: no limit).
    """

    transport = "nixl"
    share_segments = False  # NIXL reads registered pool chunks only: torch's pages are copied into the pool
    views_follow_layout = False  # each item is read into a block of its own (make_received)
    forced_ordering: str | None = "sync"  # no IPC event crosses hosts: the producer synchronises its stream
    # A background reader from the start: a READ that fails must learn at once whether the
    # producer's control connection ended (EOF), even on a channel that only receives.
    reader_at_start = True

    def __init__(self, agent: Agent, remote_agent: str, *, pool: SharedPool | None, device: int | None,
                 xfer_timeout: float | None) -> None:
        self.agent = agent
        self.remote = remote_agent
        self.pool = pool
        self.device = device
        self.own_pool: SharedPool | None = None
        self.xfer_lock = threading.Lock()
        self.xfer_timeout = xfer_timeout  # checked by listen_remote / connect_remote: None is no limit
        self.transport_info: dict[str, Any] = {"mechanism": "nixl", "backend": None,
                                               "ucx_tls": os.environ.get("UCX_TLS", "all"),
                                               "ucx_net_devices": os.environ.get("UCX_NET_DEVICES", "all")}

    # --- producer side ---------------------------------------------------------------

    @contextlib.contextmanager
    def announce(self, block: Block) -> Iterator[tuple[dict[str, Any], None]]:
        """A ``region`` message instead of an fd: the chunk registered with this channel's agent."""
        chunk = block.chunk
        md = self.agent.register(chunk, block.pool.is_host)
        if md is None:  # registered as a READ target already: its metadata is needed now
            md = self.agent.call("get_partial_agent_metadata", self.agent.registered[chunk.id], False)
        yield ({"kind": "region", "chunk": chunk.id, "addr": chunk.ptr, "size": chunk.size,
                "device": 0 if block.pool.is_host else chunk.device,
                "mem": "DRAM" if block.pool.is_host else "VRAM", "metadata": base64.b64encode(md).decode()}, None)

    def retire(self, chunk_id: int) -> None:
        """Deregister first: from here on NIXL refuses reads of this chunk, whatever the peer does."""
        try:
            self.agent.deregister(chunk_id)
        except TransferError:
            pass

    # --- consumer side ---------------------------------------------------------------

    def import_chunk(self, event: ChunkAnnounced, fds: list[int]) -> _Region:
        """Load the region's partial agent metadata (``add_remote_agent``); it must name the peer's agent.

        Raises:
            ProtocolError: the metadata names another agent. TransferError: NIXL refused it.
        """
        msg = event.msg
        name = self.agent.call("add_remote_agent", base64.b64decode(msg["metadata"]))
        name = name.decode() if isinstance(name, bytes) else name
        if name != self.remote:
            raise ProtocolError(f"region metadata names agent {name!r}, not the peer's {self.remote!r}")
        return _Region(msg["addr"], msg["size"], msg["device"], msg["mem"])

    def _recv_pool(self, channel: Any) -> SharedPool:
        if self.pool is not None:
            return self.pool
        if self.own_pool is None:
            self.own_pool = SharedPool(self.device)
            self.own_pool._register_channel(channel)
        return self.own_pool

    @staticmethod
    def region(chunks: dict[int, Any], chunk_id: int) -> _Region:
        region = chunks.get(chunk_id)
        if not isinstance(region, _Region) or region.retired:
            raise PeerClosedError(f"region {chunk_id} was retired before its array was read")
        return region

    def make_received(self, channel: Any, lease_id: int, descs: list[ArrayDescriptor], stream: int,
                      ordering: str | None, chunks: dict[int, Any]) -> list[Received]:
        """READ each array into a block of this side's pool (one READ per pair of memory types), release
        the producer's lease (sent by the flusher thread, so that the next READ need not wait for this
        send), and hand out Received over the local blocks."""
        pool = self._recv_pool(channel)
        blocks: list[Block] = []
        try:
            with self.xfer_lock:
                groups: dict[tuple[str, str], tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]] = {}
                for d in descs:
                    region = self.region(chunks, d.chunk)
                    span = d.extent() - d.byte_offset if d.extent() else 0
                    block = pool.alloc(span, timeout=self.xfer_timeout)
                    pool._ref(block)
                    blocks.append(block)
                    if span:
                        self.agent.register(block.chunk, pool.is_host)
                        local_mem = "DRAM" if pool.is_host else "VRAM"
                        local, remote = groups.setdefault((local_mem, region.mem), ([], []))
                        local.append((block.ptr, span, 0 if pool.is_host else pool.device))
                        remote.append((region.addr + d.block_offset + d.byte_offset, span, region.device))
                for (local_mem, remote_mem), (local, remote) in groups.items():
                    self.read(channel, local, local_mem, remote, remote_mem)
        except BaseException:
            for b in blocks:
                pool._unref(b)
            raise
        channel._release_lease(lease_id)  # the READ is over: the producer may have its blocks back
        local_blocks = [_LocalBlock(block) for block in blocks]
        hold = Hold(channel, lease_id, local_blocks, len(descs), owes=False)
        out = []
        for d, block, lb in zip(descs, blocks, local_blocks):
            local = ArrayDescriptor(lb.id, 0, block.size, 0, d.shape, d.strides, d.dtype,
                                    "none" if pool.is_host else "sync", None, d.name, d.meta)
            out.append(Received(hold, local, lb))
        return out

    def read(self, channel: Any, local: list[tuple[int, int, int]], local_mem: str,
             remote: list[tuple[int, int, int]], remote_mem: str) -> None:
        """One NIXL READ of ``remote`` into ``local``, waited for with :attr:`xfer_timeout` (the caller
        holds :attr:`xfer_lock`).

        A NIXL failure while the control connection ends (within :data:`EOF_GRACE`) is the
        producer going away: :class:`PeerClosedError`.
        """
        try:
            self._read_once(channel.protocol_state, local, local_mem, remote, remote_mem)
        except TransferError as exc:
            if channel._wait_ended(EOF_GRACE):
                raise PeerClosedError(f"the producer went while a NIXL READ was in flight ({exc})") from exc
            raise

    def _read_once(self, proto: Any, local: list[tuple[int, int, int]], local_mem: str,
                   remote: list[tuple[int, int, int]], remote_mem: str) -> None:
        a = self.agent
        ldescs = a.call("get_xfer_descs", local, local_mem)
        rdescs = a.call("get_xfer_descs", remote, remote_mem)
        handle = a.call("initialize_xfer", "READ", ldescs, rdescs, self.remote)
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
                if proto.ended and eof_at is None:
                    eof_at = now
                if eof_at is not None and now - eof_at > EOF_GRACE:
                    raise PeerClosedError("the producer went while a NIXL READ was in flight")
                spins += 1
                if spins > 50:  # short transfers finish while spinning; the peer may need the core to serve the READ
                    time.sleep(0.0002)
                state = a.call("check_xfer_state", handle)
            if state != "DONE":
                raise PeerClosedError(f"NIXL READ failed (state {state}): the producer went or retired the "
                                      f"memory" if proto.ended else f"NIXL READ failed (state {state})")
            self.transport_info["backend"] = a.call("query_xfer_backend", handle)
        finally:
            try:
                a.call("release_xfer_handle", handle)
            except (TransferError, PeerClosedError):
                pass

    def on_end(self) -> None:
        """The connection ended: a READ in flight sees the end and stops within :data:`EOF_GRACE`; then
        every registration goes with the agent."""
        with self.xfer_lock:
            self.agent.close()

    def close(self) -> None:
        """Deregister every NIXL registration of this channel and destroy its agent."""
        with self.xfer_lock:
            self.agent.close()
