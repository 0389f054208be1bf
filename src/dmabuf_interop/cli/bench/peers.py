"""The producer and consumer processes: one class per mechanism, and the child entry point.

Started by :mod:`.runner` as ``python -m dmabuf_interop.cli.bench.peers ROLE CTL PC AUX``
(fresh interpreters, never forked from a process that touched CUDA); the
three numbers are the inherited socket fds of :mod:`.protocol`, which also
describes every message and one latency cell. Timestamps are
``time.monotonic_ns()`` (``CLOCK_MONOTONIC`` on Linux), one clock for both
processes; the parent turns them into phases.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
import sys
import time
from typing import Any, Callable

from ... import _driver as driver
from ...descriptor import ShareDescriptor
from ...errors import CudaError, DmaBufError, NotSupportedError, ProtocolError, WaitTimeoutError
from ...fdpass import close_fds, recv_message, send_message
from . import bandwidth
from .catalog import CACHED_RING, MECHANISMS
from .iceoryx import peers as iceoryx_peers
from .overhead import CallTimer
from .protocol import check, make, take_fd
from .reader import Reader
from .torch_sharing import peers as torch_sharing_peers
from .weight_sync_backends import settle_gc

__all__ = ["main", "PEERS"]

now = time.monotonic_ns  # CLOCK_MONOTONIC on Linux (time.get_clock_info("monotonic"))


class NotInstalled(Exception):
    """A peer library is missing in this interpreter."""


def _hex(msg: dict[str, Any], key: str) -> bytes:
    try:
        return bytes.fromhex(msg[key])
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(f"bench protocol: handoff.{key} must be hex bytes") from None


class Peer:
    """One mechanism, either role: set-up, then per cell and repetition the hooks below."""

    uses_cuda = True
    #: The consumer measures its CPU time while it waits with nothing sent (:meth:`idle`), after the last cell.
    measures_idle = False

    def __init__(self, role: str, pc: socket.socket, aux: socket.socket, cfg: dict[str, Any]) -> None:
        self.role = role
        self.pc = pc
        self.aux = aux
        self.cfg = cfg
        self.producer_device, self.consumer_device = cfg["devices"]
        self.device = self.producer_device if role == "producer" else self.consumer_device
        self.timeout = float(cfg["timeout"])
        self.readers: dict[int, Reader] = {}
        self.import_status = "ok"
        self.size = 0

    def setup(self) -> dict[str, Any]:
        """Create the CUDA context and warm the kernels before timing. Returns library versions."""
        import numpy  # noqa: F401 - every mechanism's first hand-off alike: no module import in it

        if self.uses_cuda:
            driver.set_current(self.device)
            if self.role == "consumer":
                self.reader(self.device)
        return {}

    def reader(self, device: int) -> Reader:
        r = self.readers.get(device)
        if r is None:
            r = self.readers[device] = Reader(device)
        return r

    def cell(self, size: int) -> None:
        self.size = size

    def cell_end(self) -> dict[str, Any]:
        """Release per-cell state; extra fields for the ``cell`` message."""
        return {}

    def close(self) -> None:
        pass

    def produce(self, rep: int) -> dict[str, Any]:
        """Hand one buffer off; the ``rec`` fields (``t`` = t0, t_exp, t_send)."""
        raise NotImplementedError

    def release_producer(self) -> None:
        pass

    def consume(self, rep: int) -> dict[str, Any]:
        """Receive, import, read; the ``rec`` fields (``t`` = t_recv, t_imp, t_read)."""
        raise NotImplementedError

    def release_consumer(self) -> None:
        pass

    def idle(self, seconds: float) -> tuple[int, int]:
        """Consumer: wait ``seconds`` for a hand-off that does not come, as :meth:`consume` waits;
        ``(process CPU ns, wall ns)`` over the wait (:attr:`measures_idle` peers only).

        Raises:
            ProtocolError: something arrived.
        """
        raise NotImplementedError

    # helpers shared by the library's own mechanisms
    def recv_handoff(self, max_fds: int = 1) -> tuple[dict[str, Any], list[int]]:
        msg, fds = recv_message(self.pc, self.timeout, max_fds=max_fds)
        try:
            return check(msg, "handoff"), fds
        except ProtocolError:
            close_fds(fds)
            raise

    def share(self, rep: int, export: Callable[[], Any]) -> list[int]:
        """Time ``export()``, keep the ExportedBuffer, send its fd and descriptor: ``[t0, t_exp, t_send]``."""
        t0 = now()
        self.exported = export()
        t_exp = now()
        t_send = now()
        send_message(self.pc, make("handoff", rep=rep, descriptor=self.exported.describe().to_json()),
                     self.exported.fd)
        return [t0, t_exp, t_send]

    def receive(self) -> tuple[ShareDescriptor, int]:
        """The next hand-off's validated descriptor and fd (kept for :meth:`release_received`), then t_recv."""
        msg, fds = self.recv_handoff()
        self.fd = take_fd(fds)
        return ShareDescriptor.from_json(msg.get("descriptor", {})), now()

    def release_exported(self) -> None:
        self.exported.close()

    def release_received(self) -> None:
        self.imported.close()
        self.fd.close()


class PosixFd(Peer):
    """Naive: a fresh exportable allocation and a fresh import for every hand-off.

    The checked driver calls inside the timed export and import are timed through
    ``set_observer`` (:class:`~.overhead.CallTimer`) for the cell's breakdown.
    """

    def setup(self) -> dict[str, Any]:
        out = super().setup()
        self.steps = CallTimer().__enter__()
        return out

    def produce(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.posix_fd import export_posix_fd

        self.steps.take()
        t = self.share(rep, lambda: export_posix_fd(self.size, self.producer_device))
        return {"t": t, "steps": self.steps.take()}

    release_producer = Peer.release_exported

    def consume(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.posix_fd import import_posix_fd

        desc, t_recv = self.receive()
        self.steps.take()
        self.imported = import_posix_fd(self.fd, desc.size, self.consumer_device, desc.offset, desc.export_size)
        t_imp = now()
        steps = self.steps.take()
        self.reader(self.consumer_device).read4(self.imported.ptr)
        return {"t": [t_recv, t_imp, now()], "steps": steps}

    release_consumer = Peer.release_received

    def close(self) -> None:
        if hasattr(self, "steps"):
            self.steps.__exit__()


class PosixFdCached(Peer):
    """Cached: a ring of exported allocations; the fd crosses once, the consumer keeps its imports.

    Producer: :data:`~.catalog.CACHED_RING` ``export_posix_fd`` allocations per
    size, made on first use and reused round-robin. A hand-off of an allocation
    the consumer already has names it (``alloc``, ``offset``, ``size``), no fd.
    Consumer: ``alloc id -> ImportedBuffer``, filled on first sight, so a
    hand-off costs a lookup. Warm-ups cover the first share of each ring slot;
    a rep that still pays it is flagged ``first_share``.
    """

    def cell(self, size: int) -> None:
        super().cell(size)
        self.ring: list[Any] = [None] * CACHED_RING
        self.sent: set[int] = set()
        self.cache: dict[str, Any] = {}

    def produce(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.posix_fd import export_posix_fd

        slot = rep % CACHED_RING
        t0 = now()
        exported = self.ring[slot]
        if exported is None:
            exported = self.ring[slot] = export_posix_fd(self.size, self.producer_device)
        t_exp = now()
        fields = {"rep": rep, "alloc": f"{os.getpid()}:{self.size}:{slot}", "offset": 0, "size": self.size}
        t_send = now()
        if slot in self.sent:
            send_message(self.pc, make("handoff", **fields))
        else:
            send_message(self.pc, make("handoff", **fields, export_size=exported.export_size), exported.fd)
            self.sent.add(slot)
        return {"t": [t0, t_exp, t_send]}

    def consume(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.posix_fd import import_posix_fd

        msg, fds = self.recv_handoff()
        fd = take_fd(fds) if fds else None
        try:
            t_recv = now()
            key = msg.get("alloc", "")
            imported = self.cache.get(key)
            first = imported is None
            if first:
                if fd is None or "export_size" not in msg:
                    raise ProtocolError("bench protocol: the first hand-off of an allocation needs its fd "
                                        "and export_size")
                imported = self.cache[key] = import_posix_fd(fd, self.size, self.consumer_device, 0,
                                                             msg["export_size"])
        finally:
            if fd is not None:
                fd.close()  # the import keeps the memory alive
        t_imp = now()
        offset = msg.get("offset", 0)
        if not 0 <= offset <= imported.size - 4:
            raise ProtocolError(f"bench protocol: handoff.offset {offset} outside the allocation")
        self.reader(self.consumer_device).read4(imported.ptr + offset)
        return {"t": [t_recv, t_imp, now()], "first_share": first}

    def cell_end(self) -> dict[str, Any]:
        for imported in self.cache.values():
            imported.close()
        for exported in self.ring:
            if exported is not None:
                exported.close()
        self.cache.clear()
        return {}


class DmaBufPeer(Peer):
    """dma-buf of an existing ``cuMemAlloc`` buffer; import where the driver supports it."""

    def cell(self, size: int) -> None:
        super().cell(size)
        if self.role == "producer":
            from ..._checks import page_size

            driver.set_current(self.producer_device)
            page = page_size()
            self.raw = driver.mem_alloc(size + 2 * page)
            self.ptr = (self.raw + page - 1) // page * page

    def cell_end(self) -> dict[str, Any]:
        if self.role == "producer":
            driver.set_current(self.producer_device)
            driver.mem_free(self.raw)
        return {"import": self.import_status}

    def produce(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.dmabuf import export_range

        return {"t": self.share(rep, lambda: export_range(self.ptr, self.size))}

    release_producer = Peer.release_exported

    def consume(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.dmabuf import import_dmabuf

        desc, t_recv = self.receive()
        self.imported = None
        if self.import_status != "ok":
            return {"t": [t_recv, None, None]}
        try:
            self.imported = import_dmabuf(self.fd.fd, desc.size, self.consumer_device, desc.offset)
        except NotSupportedError as exc:
            self.import_status = f"unsupported ({getattr(exc, 'result', exc)})"
            return {"t": [t_recv, None, None]}
        except CudaError as exc:
            self.import_status = f"failed ({exc})"
            return {"t": [t_recv, None, None]}
        t_imp = now()
        self.reader(self.consumer_device).read4(self.imported.ptr)
        return {"t": [t_recv, t_imp, now()]}

    def release_consumer(self) -> None:
        if self.imported is not None:
            self.imported.close()
        self.fd.close()


class MemfdPeer(Peer):
    """Host shared memory: a fresh memfd per hand-off; the first access is a CPU read."""

    uses_cuda = False

    def produce(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.memfd import export_memfd

        return {"t": self.share(rep, lambda: export_memfd(self.size))}

    release_producer = Peer.release_exported

    def consume(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.memfd import import_memfd

        desc, t_recv = self.receive()
        self.imported = import_memfd(self.fd.fd, desc.size, desc.offset)
        t_imp = now()
        ctypes.c_uint32.from_address(self.imported.ptr).value  # noqa: B018 - the first access
        return {"t": [t_recv, t_imp, now()]}

    release_consumer = Peer.release_received


class ChannelPeer(Peer):
    """A :class:`~dmabuf_interop.channel.SharedPool` exported once, blocks lent over a channel.

    Set-up: the producer creates the pool on its device (its first chunk exported at once), listens
    (``channel.listen``) on a fresh abstract address, ``@dmabuf-interop-bench/<pid>/<random>``, and sends it
    (``channel`` message): nothing in the file system, so a run that is interrupted (its peers killed) leaves
    nothing behind.
    The first hand-off of the run includes ``accept`` / ``connect``, the handshake and the chunk's fd,
    so it measures a fresh channel. Per cell the producer fills a ring of
    :data:`~.catalog.CACHED_RING` ``pool.empty`` arrays; before t0 it waits for the lease on the slot
    it reuses (released two repetitions earlier, so the wait is normally over). No export happens per
    hand-off: t_exp = t_send = t0 and ``Channel.send`` is timed as transport.

    The consumer's channel gets ``Channel.spin`` (seconds it polls before it sleeps) where the channel
    has the attribute: 0 for a blocking consumer, the configuration's ``spin`` for a spinning one; a
    spinning consumer on a channel without it is a ``NotSupportedError``.

    Both ends pass ``ring=`` :attr:`ring` to ``listen`` / ``connect``; each cell's ``cell`` message says
    whether the connection uses the shared-memory ring (``Channel.ring``), so a run that asked for the ring
    and got the socket alone (the extension not built, no memfd seals) is reported as such.
    """

    host = False
    #: Offer the shared-memory ring beside the socket (``False``: the socket alone, as a peer without it).
    ring = True
    measures_idle = True

    def setup(self) -> dict[str, Any]:
        from ...channel import SharedPool, listen
        from ..._checks import round_up

        out = super().setup()
        if self.role == "producer":
            biggest = round_up(max(self.cfg["sizes"]), 2 << 20)
            room = (CACHED_RING + 1) * biggest + (64 << 20)  # the ring, plus slack for first-fit placement
            self.pool = SharedPool(None if self.host else self.producer_device,
                                   chunk_bytes=min(64 << 20, room), max_bytes=room)
            self.pool.empty(1, "uint8")  # the first chunk is exported now, as a server would at start-up
            address = f"@dmabuf-interop-bench/{os.getpid()}/{secrets.token_hex(8)}"
            self.listener = listen(address, pool=self.pool, ring=self.ring)
            send_message(self.pc, make("channel", address=address))
        else:
            self.address = check(recv_message(self.pc, self.timeout, max_fds=0)[0], "channel")["address"]
            # Modules the first hand-off would load, loaded in set-up as torch-ipc's set-up imports torch:
            # the first hand-off measures a fresh channel, not a fresh interpreter.
            from ...mechanisms import memfd, posix_fd  # noqa: F401
        self.ch = None  # connected inside the first hand-off, which so measures a fresh channel
        return out

    def cell(self, size: int) -> None:
        super().cell(size)
        if self.role == "producer":
            self.blocks = [self.pool.empty(size, "uint8", timeout=self.timeout) for _ in range(CACHED_RING)]
            self.leases: list[Any] = [None] * CACHED_RING

    def produce(self, rep: int) -> dict[str, Any]:
        slot = rep % CACHED_RING
        if self.leases[slot] is not None:
            self.leases[slot].wait(self.timeout)
        t0 = now()
        if self.ch is None:  # the first hand-off: accept, handshake, the chunk's fd, then the block
            self.ch = self.listener.accept(timeout=self.timeout)
        self.leases[slot] = self.ch.send(self.blocks[slot], timeout=self.timeout)
        return {"t": [t0, t0, t0]}

    def consume(self, rep: int) -> dict[str, Any]:
        # the producer's event is waited on the stream read4 uses (and release() synchronises)
        stream = None if self.host else self.reader(self.consumer_device).stream
        if self.ch is None:
            from ...channel import connect

            self.ch = connect(self.address, timeout=self.timeout, device=None if self.host else self.consumer_device,
                              ring=self.ring)
            spin = self.cfg.get("spin", 0)
            spin = spin if spin == "auto" else float(spin)
            if hasattr(self.ch, "spin"):
                self.ch.spin = spin
            elif spin:
                raise NotSupportedError("this Channel has no spin attribute: its consumer cannot poll before it "
                                        "sleeps (it blocks in recv)")
        self.received = self.ch.recv(self.timeout, stream=stream)
        t_recv = now()
        view = self.received.as_array()
        t_imp = now()
        if self.host:
            # The first access: 4 bytes copied out through the buffer protocol (``ndarray.ctypes`` builds a helper
            # object first, 1-4 us that are NumPy's, not the hand-off's; iceoryx2 reads through a raw pointer too).
            int.from_bytes(view.data[:4], "little")
        else:
            self.reader(self.consumer_device).read4(int(view.ptr))
        return {"t": [t_recv, t_imp, now()]}

    def release_consumer(self) -> None:
        self.received.release()
        del self.received

    def idle(self, seconds: float) -> tuple[int, int]:
        cpu, t = time.process_time_ns(), now()
        try:
            received = self.ch.recv(seconds)
        except WaitTimeoutError:
            return time.process_time_ns() - cpu, now() - t
        received.release()
        raise ProtocolError("channel: an array arrived while the producer sent nothing")

    def cell_end(self) -> dict[str, Any]:
        if self.role == "producer":
            for lease in self.leases:
                if lease is not None:
                    lease.wait(self.timeout)
            del self.blocks, self.leases  # the blocks go back to the pool
        return {"ring": bool(getattr(self.ch, "ring", False))}  # a channel without the attribute has no ring

    def close(self) -> None:
        for name in ("ch", "listener", "pool"):
            if hasattr(self, name):
                getattr(self, name).close()


class ChannelHostPeer(ChannelPeer):
    """:class:`ChannelPeer` over a host pool (memfd chunks, NumPy arrays); no GPU."""

    uses_cuda = False
    host = True


class ChannelSocketPeer(ChannelPeer):
    """:class:`ChannelPeer` with the shared-memory ring refused: the socket alone."""

    ring = False


class ChannelHostSocketPeer(ChannelHostPeer):
    """:class:`ChannelHostPeer` with the shared-memory ring refused: the socket alone."""

    ring = False


class TorchIpc(Peer):
    """torch.multiprocessing sharing of a CUDA tensor, as ``Queue.put`` / ``Queue.get`` do it.

    ``Connection.send(obj)`` is ``send_bytes(ForkingPickler.dumps(obj))`` and
    ``recv()`` is ``ForkingPickler.loads(recv_bytes())``; the two halves are
    timed separately: ``dumps`` (torch's ``reduce_tensor``:
    ``cudaIpcGetMemHandle``, an IPC event, the ref counter) is the export,
    ``loads`` (``rebuild_cuda_tensor``: ``cudaIpcOpenMemHandle``, event wait)
    the import. The tensor is allocated (caching allocator) before t0. The
    unpickling is torch's own hand-off, the thing measured, between two
    processes of this benchmark on the AUX socket only.
    """

    def setup(self) -> dict[str, Any]:
        try:
            import torch
            import torch.multiprocessing  # noqa: F401 - registers the CUDA tensor reductions
        except ImportError as exc:
            raise NotInstalled(f"torch is not installed ({exc})") from exc
        from multiprocessing.connection import Connection
        from multiprocessing.reduction import ForkingPickler

        self.torch = torch
        self.pickler = ForkingPickler
        self.conn = Connection(os.dup(self.aux.fileno()))
        torch.cuda.set_device(self.device)
        torch.empty(1, device=f"cuda:{self.device}")
        torch.cuda.synchronize()
        return {**super().setup(), "torch": torch.__version__}

    def produce(self, rep: int) -> dict[str, Any]:
        torch = self.torch
        tensor = torch.empty(self.size, dtype=torch.uint8, device=f"cuda:{self.producer_device}")
        torch.cuda.synchronize()
        t0 = now()
        payload = self.pickler.dumps(tensor)
        t_exp = now()
        self.tensor = tensor
        t_send = now()
        self.conn.send_bytes(payload)
        return {"t": [t0, t_exp, t_send]}

    def release_producer(self) -> None:
        del self.tensor
        self.torch.cuda.ipc_collect()

    def consume(self, rep: int) -> dict[str, Any]:
        if not self.conn.poll(self.timeout):
            raise WaitTimeoutError(f"no tensor from the producer within {self.timeout:g} s")
        data = self.conn.recv_bytes()
        t_recv = now()
        tensor = self.pickler.loads(data)
        t_imp = now()
        self.reader(tensor.device.index).read4(tensor.data_ptr())
        self.tensor = tensor
        return {"t": [t_recv, t_imp, now()]}

    def release_consumer(self) -> None:
        del self.tensor

    def close(self) -> None:
        if hasattr(self, "conn"):
            self.conn.close()


class CupyIpc(Peer):
    """CuPy: ``cupy.cuda.runtime.ipcGetMemHandle`` / ``ipcOpenMemHandle`` of an array's allocation."""

    def setup(self) -> dict[str, Any]:
        try:
            import cupy
        except ImportError as exc:
            raise NotInstalled(f"cupy is not installed ({exc})") from exc
        self.cupy = cupy
        cupy.cuda.Device(self.device).use()
        cupy.empty(1, dtype=cupy.uint8)
        cupy.cuda.runtime.deviceSynchronize()
        return {**super().setup(), "cupy": cupy.__version__}

    def produce(self, rep: int) -> dict[str, Any]:
        cupy = self.cupy
        array = cupy.empty(self.size, dtype=cupy.uint8)
        cupy.cuda.runtime.deviceSynchronize()
        ptr = int(array.data.ptr)
        t0 = now()
        handle = cupy.cuda.runtime.ipcGetMemHandle(ptr)
        base, _ = driver.mem_address_range(ptr)  # the handle names the allocation, not the array
        t_exp = now()
        self.array = array
        t_send = now()
        send_message(self.pc, make("handoff", rep=rep, handle=bytes(handle).hex(), offset=ptr - base))
        return {"t": [t0, t_exp, t_send]}

    def release_producer(self) -> None:
        del self.array

    def consume(self, rep: int) -> dict[str, Any]:
        msg, _fds = self.recv_handoff(max_fds=0)
        handle = _hex(msg, "handle")
        t_recv = now()
        self.base = self.cupy.cuda.runtime.ipcOpenMemHandle(handle)
        t_imp = now()
        self.reader(self.consumer_device).read4(int(self.base) + int(msg.get("offset", 0)))
        return {"t": [t_recv, t_imp, now()]}

    def release_consumer(self) -> None:
        self.cupy.cuda.runtime.ipcCloseMemHandle(self.base)


class CudaCoreIpc(Peer):
    """cuda.core: an IPC-enabled ``DeviceMemoryResource`` shared once, buffers by descriptor.

    Before timing, the producer sends the pool's allocation handle (an fd) and
    the consumer maps the pool (``from_allocation_handle``). Per hand-off:
    ``Buffer.ipc_descriptor`` (``cuMemPoolExportPointer``), its payload bytes
    sent as hex, and ``Buffer.from_ipc_descriptor`` (``cuMemPoolImportPointer``).
    The buffer is allocated from the pool before t0.
    """

    def setup(self) -> dict[str, Any]:
        try:
            import cuda.core
            from cuda.core import Buffer, DeviceMemoryResource, DeviceMemoryResourceOptions
            # cuda.core 1.2 turns an IPCBufferDescriptor into bytes and back only through pickle
            # (__reduce__ gives (IPCBufferDescriptor._init, (payload, size))). This benchmark never
            # unpickles, so the consumer calls that private constructor on the validated payload:
            # the narrowest private use there is.
            from cuda.core._memory._ipc import IPCBufferDescriptor
        except ImportError as exc:
            raise NotInstalled(f"cuda.core lacks IPC memory resources ({exc})") from exc
        self.Buffer = Buffer
        self.descriptor_from_bytes = IPCBufferDescriptor._init
        out = super().setup()
        self.stream = driver.set_current(self.device).default_stream
        if self.role == "producer":
            gran = 2 << 20
            pool = (2 * max(self.cfg["sizes"]) + 64 * gran + gran - 1) // gran * gran
            self.mr = DeviceMemoryResource(self.device, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=pool))
            if self.consumer_device != self.producer_device:
                self.mr.peer_accessible_by = {self.consumer_device}
            send_message(self.pc, make("pool"), int(self.mr.allocation_handle.handle))
        else:
            msg, fds = recv_message(self.pc, self.timeout)
            with take_fd(fds) as fd:  # the pool lives on the producer's device
                check(msg, "pool")
                self.mr = DeviceMemoryResource.from_allocation_handle(self.producer_device, fd.fd)
            if self.consumer_device != self.producer_device:
                self.mr.peer_accessible_by = {self.consumer_device}
        return {**out, "cuda-core": cuda.core.__version__}

    def produce(self, rep: int) -> dict[str, Any]:
        buf = self.mr.allocate(self.size, stream=self.stream)
        self.stream.sync()
        t0 = now()
        desc = buf.ipc_descriptor
        t_exp = now()
        self.buf = buf
        t_send = now()
        _rebuild, (payload, size) = desc.__reduce__()
        send_message(self.pc, make("handoff", rep=rep, payload=bytes(payload).hex(), size=int(size)))
        return {"t": [t0, t_exp, t_send]}

    def release_producer(self) -> None:
        self.buf.close(self.stream)
        self.stream.sync()
        del self.buf

    def consume(self, rep: int) -> dict[str, Any]:
        msg, _fds = self.recv_handoff(max_fds=0)
        payload = _hex(msg, "payload")
        t_recv = now()
        desc = self.descriptor_from_bytes(payload, int(msg.get("size", 0)))
        buf = self.Buffer.from_ipc_descriptor(self.mr, desc, stream=self.stream)
        t_imp = now()
        self.reader(self.consumer_device).read4(int(buf.handle))
        self.buf = buf
        return {"t": [t_recv, t_imp, now()]}

    def release_consumer(self) -> None:
        self.buf.close(self.stream)
        self.stream.sync()
        del self.buf

    def close(self) -> None:
        mr = getattr(self, "mr", None)
        if mr is not None:
            mr.close()


PEERS: dict[str, type[Peer]] = {
    "posix-fd": PosixFd,
    "posix-fd-cached": PosixFdCached,
    "dmabuf": DmaBufPeer,
    "memfd": MemfdPeer,
    "channel": ChannelPeer,
    "channel-host": ChannelHostPeer,
    "channel-socket": ChannelSocketPeer,
    "channel-host-socket": ChannelHostSocketPeer,
    "torch-ipc": TorchIpc,
    "cuda-core-ipc": CudaCoreIpc,
    "cupy-ipc": CupyIpc,
}
PEERS.update(torch_sharing_peers(TorchIpc))
PEERS.update(iceoryx_peers(Peer))
assert set(PEERS) == set(MECHANISMS)


#: Seconds a consumer that :attr:`~Peer.measures_idle` waits with nothing sent, after the last cell's repetitions.
IDLE_SECONDS = 1.0


def _latency(peer: Peer, ctl: socket.socket) -> None:
    """Every cell of :mod:`.protocol`'s latency exchange, then the records to the parent.

    Beside the stamps, each side counts its process CPU time (``time.process_time_ns``: every thread, user
    and system) over the timed repetitions (``loop_ns``: the hand-offs and the benchmark's ``ack`` and
    releases) and inside ``produce`` / ``consume`` (``handoff_ns``: a consumer's wait included).
    """
    warm, reps = int(peer.cfg["warmup"]), int(peer.cfg["reps"])
    sizes = peer.cfg["sizes"]
    clock = time.process_time_ns
    first = None  # the very first hand-off of the run (first cell, first warm-up): reported on its own
    for size in sizes:
        peer.cell(size)
        records = []
        loop0 = inside = 0
        if peer.role == "producer":
            check(recv_message(peer.pc, peer.timeout, max_fds=0)[0], "ready")
            for rep in range(warm + reps):
                c = clock()
                rec = peer.produce(rep)
                if rep >= warm:
                    inside += clock() - c
                    loop0 = loop0 or c
                check(recv_message(peer.pc, peer.timeout, max_fds=0)[0], "ack")
                peer.release_producer()
                first = rec if first is None else first
                if rep >= warm:
                    records.append(rec)
        else:
            send_message(peer.pc, make("ready", size=size))
            for rep in range(warm + reps):
                c = clock()
                rec = peer.consume(rep)
                if rep >= warm:
                    inside += clock() - c
                    loop0 = loop0 or c
                peer.release_consumer()
                send_message(peer.pc, make("ack", rep=rep))
                first = rec if first is None else first
                if rep >= warm:
                    records.append(rec)
        cpu = {"loop_ns": clock() - loop0, "handoff_ns": inside}
        if peer.measures_idle and size == sizes[-1]:  # the wait of a consumer that nothing reaches
            if peer.role == "consumer":
                cpu_ns, wall_ns = peer.idle(IDLE_SECONDS)
                send_message(ctl, make("idle", cpu_ns=cpu_ns, wall_ns=wall_ns))
                send_message(peer.pc, make("idle"))
            else:
                check(recv_message(peer.pc, peer.timeout + IDLE_SECONDS, max_fds=0)[0], "idle")
        info = peer.cell_end()
        if first is not None and "t" in first:
            send_message(ctl, make("first", t=first["t"]))
            first = {}
        for rec in records:
            send_message(ctl, make("rec", **rec))
        send_message(ctl, make("cell", size=size, cpu=cpu, **info))


def run(role: str, ctl: socket.socket, pc: socket.socket, aux: socket.socket) -> int:
    """One child: read the config, set up, report ``hello``, run, report ``done`` or ``error``."""
    try:
        cfg = check(recv_message(ctl, 120, max_fds=0)[0], "config")
    except DmaBufError as exc:  # no valid config: nothing to report to, nothing was set up
        print(f"bench {role}: {exc}", file=sys.stderr)
        return 2
    name = cfg["mechanism"]
    peer: Peer | None = None
    try:
        versions: dict[str, Any] = {}
        if name == "_bandwidth":
            driver.set_current(cfg["devices"][0 if role == "producer" else 1])
        elif name in PEERS:
            peer = PEERS[name](role, pc, aux, cfg)
            versions = peer.setup()
        else:
            raise ProtocolError(f"bench protocol: unknown mechanism {name!r}")
    except NotInstalled as exc:
        send_message(ctl, make("hello", role=role, status="not installed", reason=str(exc)))
        return 0
    except NotSupportedError as exc:
        send_message(ctl, make("hello", role=role, status="unsupported", reason=str(exc)))
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the parent, one line
        send_message(ctl, make("hello", role=role, status="error", reason=f"set-up: {type(exc).__name__}: {exc}"))
        return 1
    send_message(ctl, make("hello", role=role, status="ok", versions=versions, pid=os.getpid()))
    try:
        if peer is None:
            bandwidth.run(role, ctl, pc, cfg)
        else:
            settle_gc()  # every mechanism alike: no full collection of the set-up's objects mid-cell
            _latency(peer, ctl)
        send_message(ctl, make("done", role=role))
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the parent, one line
        try:
            send_message(ctl, make("error", reason=f"{role}: {type(exc).__name__}: {exc}",
                                   unsupported=isinstance(exc, NotSupportedError)))
        except Exception:  # noqa: BLE001 - the parent is gone
            pass
        return 1
    finally:
        if peer is not None:
            try:
                peer.close()
            except Exception:  # noqa: BLE001 - the process ends; the driver frees what is left
                pass


def main(argv: list[str] | None = None) -> int:
    """``python -m dmabuf_interop.cli.bench.peers ROLE CTL PC AUX``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 4 or argv[0] not in ("producer", "consumer") or not all(a.isdigit() for a in argv[1:]):
        print("usage: python -m dmabuf_interop.cli.bench.peers producer|consumer CTL PC AUX", file=sys.stderr)
        return 2
    socks = [socket.socket(fileno=int(a)) for a in argv[1:]]
    try:
        return run(argv[0], *socks)
    finally:
        for s in socks:
            s.close()


if __name__ == "__main__":
    from ...procs import leave_interrupts_to_parent

    leave_interrupts_to_parent()
    sys.exit(main())
