"""`Channel`: one connection over which arrays travel as descriptors into a shared pool.

Either end may send (with a :class:`.pool.SharedPool`) and receive. A
background reader thread per channel reads every incoming message: chunk
announcements (imported, i.e. mapped, once and kept until retired or the
connection ends), arrays (queued for :meth:`Channel.recv`), and release batches
(which complete :class:`Lease` objects and return blocks to the pool). When the
peer goes (EOF, even by SIGKILL) the reader completes every lease it held at
once, so the blocks return to the pool.
"""

from __future__ import annotations

import base64
import collections
import itertools
import math
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..errors import (DmaBufError, InvalidArgumentError, PeerClosedError, PeerRefusedError, ProtocolError,
                      WaitTimeoutError)
from ..fd import OwnedFd
from ..fdpass import close_fds, send_message
from .pool import LIVE_POOLS, Block, HostView, SharedPool, c_strides, numpy_dtype
from .protocol import DTYPES, MAX_META_BYTES, ArrayDescriptor, parse_message
from .wire import send_frame, recv_frame

__all__ = ["Channel", "Lease", "Received", "PeerInfo", "mechanism_for"]

#: Most chunks a peer may have mapped in this process at once (a bound on what a peer can make us map).
MAX_CHUNKS = 4096
#: How long a released block may wait to be batched with others before its ``release`` message goes out, seconds.
RELEASE_DELAY = 0.002

_lease_ids = itertools.count(1)


def mechanism_for(chunk_device_uuid: str, importer_gpus: Sequence[str]) -> str:
    """The mechanism an importer uses for a chunk: ``memfd`` (host), ``posix-fd`` (device).

    dma-buf import (``cuImportExternalMemory`` of ``DMABUF_FD``) would be the
    hook for device pairs where it works; the drivers measured so far answer
    ``CUDA_ERROR_NOT_SUPPORTED``, so device chunks use POSIX-fd handles.
    """
    if not chunk_device_uuid:
        return "memfd"
    return "posix-fd"


@dataclass(frozen=True)
class PeerInfo:
    """Who is on the other end.

    Attributes:
        pid, uid, gid: from ``SO_PEERCRED`` (the kernel's word, not the peer's).
        gpus: GPU UUIDs the peer can see (its ``hello``).
        library: the peer's dmabuf-interop version.
    """

    pid: int
    uid: int
    gid: int
    gpus: tuple[str, ...]
    library: str


class Lease:
    """A block lent to the peer; done once the peer released it (or went away).

    Attributes:
        id: the lease id on the wire.
        reason: ``"released"`` (the peer released it), ``"disconnected"`` or ``"closed"``; ``None`` while out.
    """

    def __init__(self, lease_id: int, blocks: list[Block], event: tuple[Any, bytes] | None) -> None:
        self.id = lease_id
        self._blocks = blocks
        self._event = event
        self._done = threading.Event()
        self.reason: str | None = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = 60.0) -> None:
        """Wait until the peer has released the block(s).

        Raises:
            WaitTimeoutError: still lent out after ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise WaitTimeoutError(f"lease {self.id} still held by the peer after {timeout} s")

    def _complete(self, reason: str) -> None:
        if self._done.is_set():
            return
        self.reason = reason
        for b in self._blocks:
            b.pool._unref(b)
        if self._event is not None:
            self._blocks[0].pool._give_event(self._event)
        self._blocks = []
        self._done.set()

    def __repr__(self) -> str:
        return f"<Lease {self.id} {'done: ' + str(self.reason) if self.done else 'out'}>"


class _ImportedChunk:
    """An importer's mapping of one peer chunk; unmapped when retired and no Received uses it."""

    def __init__(self, chunk_id: int, size: int, buf: Any) -> None:
        self.id = chunk_id
        self.size = size
        self.buf = buf  # ImportedBuffer
        self.refs = 0
        self.retired = False
        self.lock = threading.Lock()

    def retain(self) -> None:
        with self.lock:
            self.refs += 1

    def release(self) -> None:
        with self.lock:
            self.refs -= 1
            close = self.retired and self.refs <= 0
        if close:
            self.buf.close()

    def retire(self) -> None:
        with self.lock:
            self.retired = True
            close = self.refs <= 0
        if close:
            self.buf.close()


def _finalize_received(channel_ref: Any, lease_id: int, chunk: _ImportedChunk) -> None:
    ch = channel_ref()
    if ch is not None:
        ch._release_item(lease_id)
    chunk.release()


class Received:
    """One array from the peer, held until :meth:`release` (or collection).

    Attributes:
        shape: elements per dimension. dtype: the wire dtype name. strides: bytes per dimension.
        meta: the sender's JSON object or ``None``. name: the key in a ``send_many`` batch or ``None``.
        ordering: how the producer's writes were ordered: ``"none"`` (host), ``"event"`` or ``"sync"``.
        device: the importing CUDA ordinal, or ``-1`` for host memory.
    """

    def __init__(self, channel: "Channel", lease_id: int, desc: ArrayDescriptor, chunk: _ImportedChunk,
                 stream: int) -> None:
        self.descriptor = desc
        self.lease_id = lease_id
        self.shape = desc.shape
        self.dtype = desc.dtype
        self.strides = desc.strides
        self.meta = desc.meta
        self.name = desc.name
        self.ordering = desc.ordering
        self.device: int = chunk.buf.device
        self._stream = stream
        self._chunk = chunk
        self._ptr = chunk.buf.ptr + desc.block_offset + desc.byte_offset
        chunk.retain()
        self._fin = weakref.finalize(self, _finalize_received, weakref.ref(channel), lease_id, chunk)

    @property
    def released(self) -> bool:
        return not self._fin.alive

    def _check(self) -> None:
        if not self._fin.alive:
            raise InvalidArgumentError("this Received was released; its block may already hold other data")

    def _span(self) -> int:
        d = self.descriptor
        return max(d.extent() - d.byte_offset, 1)

    def as_array(self) -> Any:
        """The array, zero-copy.

        Returns:
            host: a writable NumPy array over the shared pages (bfloat16 needs ``ml_dtypes``);
            device: a ``cuda.core.utils.StridedMemoryView`` (DLPack producer). Either keeps
            this Received alive while it lives; its contents are valid until :meth:`release`.

        Raises:
            InvalidArgumentError: already released; bfloat16 on the host without ``ml_dtypes``.
        """
        self._check()
        import numpy as np

        d = self.descriptor
        if self.device < 0:
            dt = numpy_dtype(d.dtype)
            keep = (self, self._chunk.buf._mapping.map)
            return np.asarray(HostView(self._ptr, d.shape, d.strides, dt.str, keep))
        return self._device_view(np.dtype("uint16") if d.dtype == "bfloat16" else np.dtype(d.dtype))

    def _device_view(self, dt: Any) -> Any:
        from cuda.core.utils import StridedMemoryView

        from ..buffers import mapped_buffer

        d = self.descriptor
        buf = mapped_buffer(self._ptr, self._span(), self.device, self)
        return StridedMemoryView.from_buffer(buf, d.shape, tuple(s // d.itemsize for s in d.strides), dtype=dt)

    def as_tensor(self) -> Any:
        """A ``torch.Tensor`` over the block (``torch.from_dlpack`` / ``torch.from_numpy``; torch imported here).

        bfloat16 arrives as ``torch.bfloat16`` (read as int16 and re-viewed).
        """
        self._check()
        import numpy as np
        import torch

        d = self.descriptor
        if d.dtype == "bfloat16":
            if self.device < 0:
                keep = (self, self._chunk.buf._mapping.map)
                raw = np.asarray(HostView(self._ptr, d.shape, d.strides, "<i2", keep))
                return torch.from_numpy(raw).view(torch.bfloat16)
            return torch.from_dlpack(self._device_view(np.dtype("int16"))).view(torch.bfloat16)
        if self.device < 0:
            return torch.from_numpy(self.as_array())
        return torch.from_dlpack(self.as_array())

    def as_cupy(self) -> Any:
        """A ``cupy.ndarray`` over the block (``cupy.from_dlpack``; device pools only).

        Raises:
            InvalidArgumentError: the array is in host memory.
        """
        if self.device < 0:
            raise InvalidArgumentError("this array is in host memory: use as_array() (NumPy)")
        import cupy

        return cupy.from_dlpack(self.as_array())

    def release(self) -> None:
        """Give the block back to the producer (batched on the wire; idempotent).

        For device memory the stream given to ``recv`` is synchronised first
        (``cuStreamSynchronize``), so work queued on it that reads the block is done.
        """
        if not self._fin.alive:
            return
        if self.device >= 0 and self._stream is not None:
            from .. import _driver as driver

            driver.set_current(self.device)
            driver.stream_synchronize(self._stream)
        self._fin()

    def __enter__(self) -> "Received":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Received {self.dtype}{list(self.shape)} lease={self.lease_id} {state}>"


def _stream_handle(stream: Any) -> int:
    """A ``CUstream`` handle as an int from a cuda.core, torch or CuPy stream, an int, or ``None`` (0)."""
    if stream is None:
        return 0
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    handle = getattr(stream, "handle", None)  # cuda.core.Stream
    if handle is not None:
        return int(handle)
    raise InvalidArgumentError(f"cannot find a CUDA stream handle in {type(stream).__name__}")


@dataclass
class _Source:
    """What the sender needs to know about a caller's array."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # bytes
    dtype: str
    device: int  # -1: host
    obj: Any


def _inspect(array: Any) -> _Source:
    import numpy as np

    mod = type(array).__module__
    if mod.startswith("torch"):
        dtype = str(array.dtype).replace("torch.", "")
        es = array.element_size()
        dev = array.device.index if array.is_cuda else -1
        if array.is_cuda and dev is None:
            dev = 0
        return _Source(int(array.data_ptr()), tuple(array.shape), tuple(s * es for s in array.stride()), dtype,
                       dev, array)
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is not None:
        from .. import _driver as driver

        dt = np.dtype(cai["typestr"])
        shape = tuple(cai["shape"])
        ptr = int(cai["data"][0])
        strides = tuple(cai["strides"]) if cai.get("strides") else c_strides(shape, dt.itemsize)
        dev = driver.pointer_device_ordinal(ptr) if ptr else 0
        return _Source(ptr, shape, strides, dt.name, dev, array)
    if not isinstance(array, np.ndarray):
        from cuda.core.utils import StridedMemoryView

        if isinstance(array, StridedMemoryView):
            dt = np.dtype(array.dtype)
            shape = tuple(array.shape)
            strides = (tuple(s * dt.itemsize for s in array.strides) if array.strides is not None
                       else c_strides(shape, dt.itemsize))
            return _Source(int(array.ptr), shape, strides, dt.name, array.device_id if array.is_device_accessible
                           and not _is_host_ptr(array) else -1, array)
        array = np.asarray(array)
    if array.dtype.byteorder == ">":
        raise InvalidArgumentError("big-endian arrays cannot travel: convert with astype(dtype.newbyteorder('='))")
    name = array.dtype.name
    if name == "bfloat16" or (array.dtype.kind == "V" and "bfloat16" in str(array.dtype)):
        name = "bfloat16"
    return _Source(int(array.__array_interface__["data"][0]), array.shape, array.strides, name, -1, array)


def _is_host_ptr(view: Any) -> bool:
    """True for host memory CUDA knows (pinned or registered): ``CU_MEMORYTYPE_HOST`` from ``cuPointerGetAttributes``."""
    try:
        from .. import _driver as driver

        host = int(driver.bindings().CUmemorytype.CU_MEMORYTYPE_HOST)
        return driver.pointer_facts(int(view.ptr))["memory_type"] == host
    except DmaBufError:
        return False


class Channel:
    """A connected channel (from :func:`.connect` or :meth:`.Listener.accept`).

    Args (given by the rendezvous, not by callers):
        sock: the connected AF_UNIX stream socket (owned from now on).
        peer: who is on the other end.
        pool: the pool that :meth:`send` copies into (``None``: this end only
            receives, or sends arrays that already live in some pool).
        device: the CUDA ordinal that device chunks are mapped on when
            receiving (``None``: the chunk's own GPU, found by UUID).
        ordering: ``"event"`` (default) or ``"sync"`` for device pools.
    """

    def __init__(self, sock: socket.socket, peer: PeerInfo, *, pool: SharedPool | None = None,
                 device: int | None = None, ordering: str = "event") -> None:
        if ordering not in ("event", "sync"):
            raise InvalidArgumentError(f"ordering must be 'event' or 'sync', got {ordering!r}")
        self.peer = peer
        self.pool = pool
        self.device = device
        self.ordering = ordering
        self._sock = sock
        self._send_lock = threading.Lock()
        self._state = threading.Condition()
        self._queue: collections.deque[Any] = collections.deque()
        self._error: BaseException | None = None
        self._closed = False  # this end closed
        self._eof = False  # the connection is over (either end)
        self._announced: set[int] = set()  # our chunk ids the peer has
        self._leases: dict[int, Lease] = {}
        self._imports: dict[int, _ImportedChunk] = {}
        self._held: dict[int, int] = {}  # peer lease id -> items still held here
        self._pending: list[int] = []
        self._opened_events: dict[bytes, Any] = {}
        self._flusher: threading.Thread | None = None
        if pool is not None:
            pool._register_channel(self)
        self._reader = threading.Thread(target=self._read_loop, name="dmabuf-interop-channel-reader", daemon=True)
        self._reader.start()

    # --- sending --------------------------------------------------------------------

    def _send(self, obj: dict[str, Any], fd: int | None = None) -> None:
        with self._send_lock:
            if self._eof or self._closed:
                raise PeerClosedError("the channel is closed") from self._error
            if fd is None:
                send_frame(self._sock, obj)
            else:
                send_message(self._sock, obj, fd)

    def _announce(self, block: Block) -> None:
        chunk = block.chunk
        if chunk.id in self._announced:
            return
        self._send(chunk.describe(), chunk.fd)
        self._announced.add(chunk.id)
        block.pool._register_channel(self)

    def _retire_chunk(self, chunk_id: int) -> None:
        if chunk_id in self._announced:
            self._announced.discard(chunk_id)
            try:
                self._send({"kind": "retire", "chunk": chunk_id})
            except (PeerClosedError, OSError):
                pass

    def _place(self, array: Any, stream: int, timeout: float | None) -> tuple[Block, int, tuple[int, ...],
                                                                                tuple[int, ...], str, bool]:
        """Find (zero-copy) or make (copy) the block holding ``array``: (block, byte_offset, shape, strides,
        dtype, copied_from_device)."""
        src = _inspect(array)
        if src.dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype {src.dtype!r} cannot travel; accepted: {', '.join(DTYPES)}")
        itemsize = DTYPES[src.dtype]
        negative = any(st < 0 for st in src.strides)
        span = (0 if any(n == 0 for n in src.shape) else
                sum((n - 1) * st for n, st in zip(src.shape, src.strides)) + itemsize)
        block = None
        if not negative and span:
            for p in _live_pools(self.pool):
                block = p.find(src.ptr, span)
                if block is not None:
                    break
        if block is not None:
            if any(st % itemsize for st in src.strides):
                raise InvalidArgumentError(f"strides {src.strides} are not multiples of the itemsize {itemsize}: "
                                           f"DLPack cannot describe them")
            block.pool._ref(block)
            return block, src.ptr - block.ptr, src.shape, tuple(src.strides), src.dtype, False
        if self.pool is None:
            raise InvalidArgumentError("this channel has no pool to copy into: pass pool= to listen/connect, "
                                       "or send arrays from SharedPool.empty")
        nbytes = math.prod(src.shape) * itemsize
        block = self.pool.alloc(nbytes, timeout=timeout)
        block.pool._ref(block)
        try:
            strides = c_strides(src.shape, itemsize)
            from_device = self._copy_into(block, src, nbytes, strides, stream)
        except BaseException:
            block.pool._unref(block)
            raise
        return block, 0, src.shape, strides, src.dtype, from_device

    def _copy_into(self, block: Block, src: _Source, nbytes: int, strides: tuple[int, ...], stream: int) -> bool:
        import numpy as np

        if nbytes == 0:
            return False
        if block.pool.is_host and src.device < 0:
            obj = src.obj
            if type(obj).__module__.startswith("torch"):
                obj = obj.view(__import__("torch").int16).numpy() if src.dtype == "bfloat16" else obj.numpy()
            srcarr = np.asarray(obj)
            typestr = "<u2" if src.dtype == "bfloat16" else srcarr.dtype.str
            if src.dtype == "bfloat16":
                srcarr = srcarr.view(np.uint16)
            dst = np.asarray(HostView(block.ptr, src.shape, strides, typestr,
                                      (block.chunk.host_keepalive(block.offset, block.size),)))
            np.copyto(dst, srcarr, casting="no")
            return False
        # A device on either side: cuMemcpyAsync (unified addressing) of contiguous bytes on the caller's stream.
        contiguous = src.strides == c_strides(src.shape, DTYPES[src.dtype]) or math.prod(src.shape) <= 1
        if not contiguous:
            raise InvalidArgumentError("copying a non-contiguous array to or from GPU memory is not supported: "
                                       "send a contiguous array (e.g. tensor.contiguous()) or one from pool.empty")
        from .. import _driver as driver

        driver.set_current(block.pool.device if not block.pool.is_host else src.device)
        driver.memcpy_async(block.ptr, src.ptr, nbytes, stream)
        if block.pool.is_host:
            driver.stream_synchronize(stream)  # host pools carry no event: the bytes must be there now
        return src.device >= 0

    def send(self, array: Any, *, stream: Any = None, meta: dict[str, Any] | None = None,
             timeout: float | None = 10.0, ordering: str | None = None) -> Lease:
        """Lend an array to the peer.

        An array inside a pool block (from :meth:`SharedPool.empty`, or a view
        of one: any non-negative strides that are multiples of the itemsize)
        goes zero-copy; any other array is first copied, C-contiguous, into a
        new block of this channel's pool (host: ``numpy.copyto``; device:
        ``cuMemcpyAsync`` on ``stream``). The first use of a chunk sends its fd
        (``SCM_RIGHTS``) once.

        Args:
            array: NumPy, torch, CuPy, ``StridedMemoryView``, or anything ``numpy.asarray`` takes.
            stream: device pools: the stream the writes were queued on (cuda.core / torch / CuPy
                stream or a raw handle; ``None``: the legacy default stream).
            meta: a JSON object (at most 64 KiB) delivered with the array.
            timeout: seconds to wait for pool room when copying.
            ordering: device pools: ``"event"`` (record an interprocess event on
                ``stream``, ``cuEventRecord``) or ``"sync"`` (``cuStreamSynchronize``);
                default: the channel's.

        Returns:
            a :class:`Lease`, done when the peer has released the block.

        Raises:
            InvalidArgumentError: an unsupported dtype, negative strides in a zero-copy
                array, meta too large or not JSON, no pool to copy into.
            PoolExhaustedError: no room within ``timeout``.
            PeerClosedError: the peer has gone.
        """
        return self._send_items([(None, array)], stream, meta, timeout, ordering, batch=None)

    def send_many(self, arrays: Mapping[str, Any] | Sequence[Any], *, stream: Any = None,
                  meta: dict[str, Any] | None = None, timeout: float | None = 10.0,
                  ordering: str | None = None) -> Lease:
        """Lend many arrays (a state dict, or a list) in ONE ``arrays`` message under one lease.

        ``meta`` rides on the first item. Arguments, result and errors as :meth:`send`;
        the lease is done when the peer has released every item.
        """
        if isinstance(arrays, Mapping):
            items = [(str(k), v) for k, v in arrays.items()]
            return self._send_items(items, stream, meta, timeout, ordering, batch="mapping")
        return self._send_items([(None, v) for v in arrays], stream, meta, timeout, ordering, batch="list")

    def _send_items(self, items: list[tuple[str | None, Any]], stream: Any, meta: dict[str, Any] | None,
                    timeout: float | None, ordering: str | None, batch: str | None) -> Lease:
        import json

        if meta is not None:
            if not isinstance(meta, dict):
                raise InvalidArgumentError(f"meta must be a dict, got {type(meta).__name__}")
            try:
                size = len(json.dumps(meta, separators=(",", ":"), allow_nan=False).encode())
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(f"meta is not JSON-serialisable: {exc}") from exc
            if size > MAX_META_BYTES:
                raise InvalidArgumentError(f"meta is {size} bytes of JSON, more than {MAX_META_BYTES}")
        ordering = ordering or self.ordering
        if ordering not in ("event", "sync"):
            raise InvalidArgumentError(f"ordering must be 'event' or 'sync', got {ordering!r}")
        if self._eof or self._closed:
            raise PeerClosedError("the channel is closed") from self._error
        h = _stream_handle(stream)
        placed: list[tuple[str | None, Block, int, tuple[int, ...], tuple[int, ...], str]] = []
        try:
            device_blocks = False
            for name, arr in items:
                block, off, shape, strides, dtype, _ = self._place(arr, h, timeout)
                placed.append((name, block, off, shape, strides, dtype))
                device_blocks |= not block.pool.is_host
            event = None
            order = "none"
            if device_blocks:
                from .. import _driver as driver

                dev_pool = next(p[1].pool for p in placed if not p[1].pool.is_host)
                driver.set_current(dev_pool.device)
                if ordering == "sync":
                    driver.stream_synchronize(h)
                    order = "sync"
                else:
                    event = dev_pool._take_event()
                    driver.event_record(event[0], h)
                    order = "event"
            for _, block, *_ in placed:
                self._announce(block)
        except BaseException:
            for _, block, *_ in placed:
                block.pool._unref(block)
            raise
        lease = Lease(next(_lease_ids), [p[1] for p in placed], event)
        ev64 = base64.b64encode(event[1]).decode() if event is not None else None
        descs = []
        for i, (name, block, off, shape, strides, dtype) in enumerate(placed):
            descs.append(ArrayDescriptor(block.chunk.id, block.offset, block.size, off, tuple(shape), tuple(strides),
                                         dtype, order, ev64, name, meta if i == 0 else None).to_json())
        if batch is None:
            msg = {"kind": "array", "lease": lease.id, "desc": descs[0]}
        else:
            msg = {"kind": "arrays", "lease": lease.id, "items": descs, "mapping": batch == "mapping"}
        with self._state:
            self._leases[lease.id] = lease
        try:
            self._send(msg)
        except BaseException:
            with self._state:
                self._leases.pop(lease.id, None)
            lease._complete("closed")
            raise
        return lease

    @property
    def outstanding(self) -> int:
        """Leases lent on this channel and not yet released."""
        with self._state:
            return len(self._leases)

    # --- receiving ------------------------------------------------------------------

    def _next(self, timeout: float | None, want_batch: bool) -> Any:
        self._flush()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._state:
            while not self._queue:
                if self._eof or self._closed:
                    err = self._error
                    if isinstance(err, (ProtocolError, PeerRefusedError)):
                        raise type(err)(str(err)) from err
                    raise PeerClosedError("the peer closed the channel" if not self._closed
                                          else "the channel is closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise WaitTimeoutError(f"no array from the peer within {timeout} s")
                self._state.wait(remaining)
            item = self._queue[0]
            is_batch = item[0] == "arrays"
            if is_batch and not want_batch:
                raise InvalidArgumentError("the next message is a send_many batch: use recv_many()")
            return self._queue.popleft()

    def _make_received(self, lease_id: int, descs: list[ArrayDescriptor], stream: int) -> list[Received]:
        out = [Received(self, lease_id, d, self._imports[d.chunk], stream) for d in descs]
        for r in out:
            if r.ordering == "event":
                from .. import _driver as driver

                raw = r.descriptor.event_handle()
                driver.set_current(r.device)
                ev = self._opened_events.get(raw)
                if ev is None:
                    ev = driver.ipc_open_event_handle(raw)
                    self._opened_events[raw] = ev
                driver.stream_wait_event(stream, ev)
                break  # one event covers every item of the message
        return out

    def recv(self, timeout: float | None = 60.0, *, stream: Any = None) -> Received:
        """The next array from the peer.

        Args:
            timeout: seconds to wait (``None``: forever).
            stream: device pools: the stream that will read the array; it is made to wait for the
                producer's event (``cuStreamWaitEvent``). ``None``: the legacy default stream.

        Raises:
            WaitTimeoutError: nothing within ``timeout``.
            PeerClosedError: the peer has gone (arrays it sent before are delivered first).
            ProtocolError: the peer broke the protocol (the connection was closed).
            InvalidArgumentError: the next message is a batch (use :meth:`recv_many`).
        """
        _, lease_id, descs, _ = self._next(timeout, want_batch=False)
        return self._make_received(lease_id, descs, _stream_handle(stream))[0]

    def recv_many(self, timeout: float | None = 60.0, *, stream: Any = None) -> dict[str, Received] | list[Received]:
        """The next ``send_many`` batch: a dict by name (for a mapping) or a list; a single array as a list of one.

        Raises: as :meth:`recv`.
        """
        kind, lease_id, descs, mapping = self._next(timeout, want_batch=True)
        out = self._make_received(lease_id, descs, _stream_handle(stream))
        if mapping:
            return {r.name: r for r in out}
        return out

    # --- releases (importer side) -----------------------------------------------------

    def _release_item(self, lease_id: int) -> None:
        with self._state:
            left = self._held.get(lease_id, 0) - 1
            if left > 0:
                self._held[lease_id] = left
                return
            self._held.pop(lease_id, None)
            if self._eof or self._closed:
                return
            self._pending.append(lease_id)
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name="dmabuf-interop-channel-release",
                                                 daemon=True)
                self._flusher.start()
            self._state.notify_all()

    def _flush(self) -> None:
        with self._state:
            ids, self._pending = self._pending, []
        if ids:
            try:
                self._send({"kind": "release", "leases": ids})
            except (PeerClosedError, OSError):
                pass  # the exporter is gone: it has released everything already

    def _flush_loop(self) -> None:
        while True:
            with self._state:
                while not self._pending and not (self._eof or self._closed):
                    self._state.wait()
                if not self._pending:
                    return
            time.sleep(RELEASE_DELAY)  # let a burst of releases share one message
            self._flush()

    # --- the reader thread ---------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while True:
                msg, fds = recv_frame(self._sock, None)
                try:
                    self._handle(msg, fds)
                finally:
                    close_fds(fds)
        except PeerClosedError as exc:
            self._error = exc
        except (ProtocolError, PeerRefusedError) as exc:
            self._error = exc
        except (OSError, ValueError, DmaBufError) as exc:
            self._error = exc
        finally:
            self._end()

    def _handle(self, msg: dict[str, Any], fds: list[int]) -> None:
        kind, descs = parse_message(msg)
        if fds and kind != "chunk":
            raise ProtocolError(f"a {kind!r} message carried an fd")
        if kind == "chunk":
            if len(fds) != 1:
                raise ProtocolError("a chunk message must carry exactly one fd")
            self._import_chunk(msg, fds)
        elif kind == "retire":
            chunk = self._imports.pop(msg["chunk"], None)
            if chunk is None:
                raise ProtocolError(f"retire of unknown chunk {msg['chunk']}")
            chunk.retire()
        elif kind in ("array", "arrays"):
            lease_id = msg["lease"]
            for d in descs:
                chunk = self._imports.get(d.chunk)
                if chunk is None:
                    raise ProtocolError(f"descriptor names unknown chunk {d.chunk}")
                if d.block_offset + d.block_bytes > chunk.size:
                    raise ProtocolError(f"block [{d.block_offset}, {d.block_offset + d.block_bytes}) lies outside "
                                        f"chunk {d.chunk} of {chunk.size} bytes")
            with self._state:
                if lease_id in self._held:
                    raise ProtocolError(f"lease {lease_id} is already held")
                if descs:
                    self._held[lease_id] = len(descs)
                    self._queue.append((kind, lease_id, descs, kind == "arrays" and msg["mapping"]))
                    self._state.notify_all()
                elif not (self._eof or self._closed):
                    self._pending.append(lease_id)  # an empty batch: nothing to hold
        elif kind == "release":
            with self._state:
                leases = []
                for lid in msg["leases"]:
                    lease = self._leases.pop(lid, None)
                    if lease is None:
                        raise ProtocolError(f"release of unknown lease {lid}")
                    leases.append(lease)
            for lease in leases:
                lease._complete("released")
        elif kind == "bye":
            raise PeerClosedError("the peer closed the channel")
        elif kind == "refuse":
            raise PeerRefusedError(f"the peer refused this connection: {msg['reason']}")
        else:  # hello after the handshake
            raise ProtocolError(f"unexpected {kind!r} message after the handshake")

    def _import_chunk(self, msg: dict[str, Any], fds: list[int]) -> None:
        cid, size = msg["chunk"], msg["size"]
        if cid in self._imports:
            raise ProtocolError(f"chunk {cid} announced twice")
        if len(self._imports) >= MAX_CHUNKS:
            raise ProtocolError(f"the peer announced more than {MAX_CHUNKS} chunks")
        with OwnedFd(fds[0]) as fd:
            fds.clear()
            try:
                if msg["mechanism"] == "memfd":
                    if msg["device_uuid"]:
                        raise ProtocolError("a memfd chunk names a GPU")
                    from ..mechanisms.memfd import import_memfd

                    buf = import_memfd(fd, size)
                else:
                    from ..mechanisms.posix_fd import import_posix_fd

                    buf = import_posix_fd(fd, size, self._import_device(msg["device_uuid"]), 0, size)
            except InvalidArgumentError as exc:  # not a memfd, unsealed, smaller than announced, ...
                raise ProtocolError(f"chunk {cid} rejected: {exc}") from exc
        self._imports[cid] = _ImportedChunk(cid, size, buf)

    def _import_device(self, uuid: str) -> int:
        if self.device is not None:
            return self.device
        from .protocol import visible_gpu_uuids

        gpus = visible_gpu_uuids(initialise=True)
        if uuid not in gpus:
            raise ProtocolError(f"chunk lives on GPU {uuid}, which this process cannot see; "
                                f"connect with device=N to map it on another GPU")
        return gpus.index(uuid)

    def _end(self) -> None:
        """The connection is over: complete every lease, unmap idle chunks, wake waiters, close the socket."""
        with self._send_lock:
            with self._state:
                self._eof = True
                leases = list(self._leases.values())
                self._leases.clear()
                self._state.notify_all()
            try:
                self._sock.close()
            except OSError:
                pass
        for lease in leases:
            lease._complete("closed" if self._closed else "disconnected")
        for chunk in list(self._imports.values()):
            chunk.retire()  # stays mapped while a Received still uses it
        self._imports.clear()

    # --- closing ------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Flush pending releases, say ``bye``, and end the connection (idempotent).

        Leases still out complete with reason ``"closed"``; arrays still held
        here stay readable until released. Opened IPC events are destroyed
        (``cuEventDestroy``).
        """
        if self._closed:
            return
        self._flush()
        try:
            self._send({"kind": "bye"})
        except (PeerClosedError, OSError):
            pass
        self._closed = True
        with self._send_lock:
            if not self._eof:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader, which closes the socket
                except OSError:
                    pass
        with self._state:
            self._state.notify_all()
        if threading.current_thread() is not self._reader:
            self._reader.join(timeout)
        if self._opened_events:
            from .. import _driver as driver

            for ev in self._opened_events.values():
                try:
                    driver.event_destroy(ev)
                except DmaBufError:
                    pass
            self._opened_events.clear()

    @property
    def closed(self) -> bool:
        """True once either end has ended the connection."""
        return self._closed or self._eof

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Channel peer pid={self.peer.pid} {'closed' if self.closed else 'open'}>"


def _live_pools(pool: SharedPool | None) -> Iterable[SharedPool]:
    """The pools an array may already live in: the channel's, then every other pool alive in this process."""
    if pool is not None:
        yield pool
    for p in list(LIVE_POOLS):
        if p is not pool:
            yield p
