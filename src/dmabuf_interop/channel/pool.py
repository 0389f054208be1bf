"""`SharedPool`: memory exported once, in chunks, and sub-allocated into blocks that channels lend out.

A host pool's chunks are memfds (``memfd_create``, sealed against shrink and
grow, mapped ``MAP_SHARED``: :func:`..memfd.export_memfd`); a device pool's are
CUDA VMM allocations exported as POSIX-fd shareable handles
(``cuMemCreate`` + ``cuMemExportToShareableHandle``: :func:`..vmm.export_posix_fd`).
Each chunk's fd crosses a connection once; afterwards arrays travel as
descriptors (chunk id, offset, layout).

Blocks are carved first-fit from a per-chunk free list with coalescing, at
:data:`ALIGN`-byte alignment. A block is in use while the caller holds the
array :meth:`SharedPool.empty` returned or while a lease on it is outstanding;
then it returns to its chunk's free list.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import operator
import os
import threading
import weakref
from typing import Any, Iterable, Iterator, Sequence

from .. import _forks
from .._time import deadline_after, remaining
from ..errors import ForkedResourceError, InvalidArgumentError, PoolExhaustedError
from .arrays import (STORAGE, DeviceView, HostView, c_strides, device_index, numpy_dtype, shown_dtype, storage_dtype,
                     wire_dtype)
from .events import EventPool
from .protocol import BLOCK_ALIGN, DTYPES

# DeviceView, HostView, EventPool, numpy_dtype and c_strides live in .arrays and .events; named here too.
__all__ = ["ALIGN", "SharedPool", "Block", "DeviceView", "EventPool", "HostView", "c_strides", "numpy_dtype"]

#: Block alignment inside a chunk, bytes (covers every dtype and CUDA's 256-byte allocation alignment).
ALIGN = BLOCK_ALIGN

#: Every open pool of this process (to recognise an array that already lives in one). Emptied in a forked
#: child: a pool inherited through fork() belongs to the parent (its blocks are the parent's to lend).
LIVE_POOLS: "weakref.WeakSet[SharedPool]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """The child has none of the parent's threads: a pool lock one of them held would never be let go, so
    each inherited pool gets a new one; and nothing of an inherited pool is released at the child's exit
    (its chunks are the parent's; a device pool's cannot be touched after fork anyway)."""
    for pool in list(LIVE_POOLS):
        pool._lock = threading.RLock()
        pool._cond = threading.Condition(pool._lock)
        pool._finalizer.atexit = False
    LIVE_POOLS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)

# Chunk ids are unique within the process, so any pool's blocks can travel over any channel.
chunk_ids = itertools.count(1)


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class _FreeList:
    """First-fit free list of ``[offset, offset+size)`` ranges, sorted by offset, coalesced on free."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.starts: list[int] = [0]
        self.sizes: list[int] = [size]

    def alloc(self, n: int) -> int | None:
        for i, sz in enumerate(self.sizes):
            if sz >= n:
                off = self.starts[i]
                if sz == n:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += n
                    self.sizes[i] -= n
                return off
        return None

    def free(self, off: int, n: int) -> None:
        i = bisect.bisect_left(self.starts, off)
        self.starts.insert(i, off)
        self.sizes.insert(i, n)
        if i + 1 < len(self.starts) and off + n == self.starts[i + 1]:  # merge with the next range
            self.sizes[i] += self.sizes.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == off:  # and with the previous one
            self.sizes[i - 1] += self.sizes.pop(i)
            self.starts.pop(i)

    @property
    def empty(self) -> bool:
        return self.sizes == [self.size]


class _Chunk:
    """One exported allocation: its fd (owned by ``export``), base address, size and free list."""

    def __init__(self, export: Any, mechanism: str) -> None:
        self.id = next(chunk_ids)
        self.export = export  # ExportedBuffer: owns the fd and the mapping
        self.mechanism = mechanism
        self.ptr = export.ptr
        self.size = export.export_size
        self.device = export.device
        self.device_uuid = export.device_uuid
        self.free = _FreeList(self.size)
        self.blocks: dict[int, Block] = {}  # offset -> live block
        self.offsets: list[int] = []  # the keys of ``blocks``, kept sorted for bisect in SharedPool.find

    def add(self, block: "Block") -> None:
        self.blocks[block.offset] = block
        bisect.insort(self.offsets, block.offset)
        block.live = True

    def remove(self, block: "Block") -> None:
        block.live = False
        del self.blocks[block.offset]
        del self.offsets[bisect.bisect_left(self.offsets, block.offset)]

    @property
    def fd(self) -> int:
        return self.export.fd

    def describe(self) -> dict[str, Any]:
        """The ``chunk`` message (its fd rides along by ``SCM_RIGHTS``): one part, the whole chunk."""
        return {"kind": "chunk", "chunk": self.id, "size": self.size, "mechanism": self.mechanism,
                "device_uuid": self.device_uuid, "parts": [self.size]}

    @contextlib.contextmanager
    def fds(self) -> Iterator[list[int]]:
        """The fds that go with :meth:`describe`: the export's own, kept open for the next connection."""
        yield [self.export.fd]

    def host_keepalive(self, offset: int, nbytes: int) -> Any:
        """A memoryview on the host mapping: while it lives ``mmap.close`` cannot unmap the pages."""
        return memoryview(self.export._mapping.map)[offset:offset + nbytes]


_LIVE = operator.attrgetter("live")


class Block:
    """``size`` bytes at ``offset`` inside a pool chunk; ``ptr`` is its address in this process."""

    __slots__ = ("pool", "chunk", "offset", "size", "refs", "live", "__weakref__")

    def __init__(self, pool: "SharedPool", chunk: _Chunk, offset: int, size: int) -> None:
        self.pool = pool
        self.chunk = chunk
        self.offset = offset
        self.size = size
        self.refs = 0  # the caller's array (pool.empty) + outstanding leases
        self.live = False  # allocated: in its chunk's blocks

    @property
    def ptr(self) -> int:
        return self.chunk.ptr + self.offset

    def __repr__(self) -> str:
        return f"<Block chunk={self.chunk.id} offset={self.offset} size={self.size} refs={self.refs}>"


class SharedPool:
    """Memory exported once and lent out block by block over channels.

    Args:
        device: ``None`` or ``"host"`` for a host pool (memfd); a CUDA ordinal
            for a device pool (VMM chunks exported as POSIX fds).
        chunk_bytes: bytes per chunk (default 64 MiB); device chunks are
            rounded up to the allocation granularity (2 MiB on H200). A request
            larger than a chunk gets a chunk of its own.
        max_bytes: most bytes the pool exports in all (default 1 GiB).

    Raises:
        InvalidArgumentError: a bad device, or sizes that are not positive ints
            or with ``chunk_bytes > max_bytes``.
        NoDriverError: a device pool where CUDA is unavailable (the reason says why).
    """

    def __init__(self, device: int | str | None = None, *, chunk_bytes: int = 64 << 20,
                 max_bytes: int = 1 << 30) -> None:
        device = device_index(device, default="host")
        for name, v in (("chunk_bytes", chunk_bytes), ("max_bytes", max_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidArgumentError(f"{name} must be a positive number of bytes, got {v!r}")
        if chunk_bytes > max_bytes:
            raise InvalidArgumentError(f"chunk_bytes {chunk_bytes} exceeds max_bytes {max_bytes}")
        if device is not None:  # a machine without CUDA, or a bad ordinal, says so now, not at the first send
            from .. import _driver as driver

            driver.set_current(device)
        self.device: int | None = device
        self.chunk_bytes = _round_up(chunk_bytes, ALIGN)
        self.max_bytes = max_bytes
        # ``with self._lock`` on the paths every hand-off takes (Condition.__enter__ is one Python call more);
        # ``_cond`` (over the same lock) where something waits or is woken.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._chunks: list[_Chunk] = []
        self._closed = False
        self._channels: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self.events = EventPool(device)  # device pools: the interprocess events leases order with
        self._finalizer = weakref.finalize(self, SharedPool._close_chunks, self._chunks, self.events.all,
                                           device)
        self._owner = _forks.pid  # only this process may allocate, trim and retire (Note in .channel)
        LIVE_POOLS.add(self)

    # --- introspection ---------------------------------------------------------

    @property
    def is_host(self) -> bool:
        return self.device is None

    @property
    def capacity(self) -> int:
        """Bytes exported so far (sum of chunk sizes)."""
        with self._cond:
            return sum(c.size for c in self._chunks)

    @property
    def used_bytes(self) -> int:
        """Bytes in blocks that are in use."""
        with self._cond:
            return self.used_bytes_locked()

    # --- chunks ------------------------------------------------------------------

    def _new_chunk(self, nbytes: int) -> _Chunk:
        if self.is_host:
            from ..mechanisms.memfd import export_memfd

            return _Chunk(export_memfd(nbytes, name="dmabuf-interop-pool"), "memfd")
        from ..mechanisms.posix_fd import export_posix_fd

        return _Chunk(export_posix_fd(nbytes, self.device), "posix-fd")

    def _chunk_size_for(self, nbytes: int) -> int:
        size = max(self.chunk_bytes, _round_up(nbytes, ALIGN))
        if not self.is_host:
            from ..mechanisms.posix_fd import granularity

            size = _round_up(size, granularity(self.device))
        return size

    def alloc(self, nbytes: int, *, timeout: float | None = 10.0) -> Block:
        """A block of at least ``nbytes`` bytes (rounded up to :data:`ALIGN`), with no user yet.

        Grows the pool by a chunk while under ``max_bytes``; at ``max_bytes``, idle
        chunks too small for the block are retired (:meth:`trim`) to make room for a
        larger one; otherwise waits up to ``timeout`` seconds (``None``: forever) for
        blocks to come back.

        A raw block is the caller's to give back with :meth:`free`: one dropped without it stays allocated,
        and its chunk cannot be trimmed, until :meth:`close`. For arrays to send, use :meth:`empty`, whose
        block is freed with its array.

        Raises:
            InvalidArgumentError: ``nbytes`` is negative or can never fit in ``max_bytes``; ``timeout``
                is not a number >= 0 or ``None`` (``math.inf`` waits forever, as ``None`` does).
            ForkedResourceError: this process inherited the pool through ``fork()``.
            PoolExhaustedError: no room within ``timeout``.
            SyscallError, CudaError: exporting a new chunk failed.
        """
        if self._owner != _forks.pid:
            raise ForkedResourceError("this pool", self._owner)
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be a non-negative int, got {nbytes!r}")
        n = _round_up(max(nbytes, 1), ALIGN)
        if n > self.max_bytes:
            raise InvalidArgumentError(f"a {nbytes}-byte block can never fit in a pool of max_bytes {self.max_bytes}")
        deadline = deadline_after(timeout)
        waits: list[Any] | None = None  # the channels' ring releases this call waits for, once it must wait
        begun: list[Any] = []
        try:
            while True:
                announce = False
                with self._cond:
                    while True:
                        if self._closed:
                            raise InvalidArgumentError("the pool is closed")
                        for chunk in self._chunks:
                            off = chunk.free.alloc(n)
                            if off is not None:
                                block = Block(self, chunk, off, n)
                                chunk.add(block)
                                return block
                        size = self._chunk_size_for(n)
                        total = sum(c.size for c in self._chunks)
                        if total + size <= self.max_bytes:
                            chunk = self._new_chunk(size)
                            self._chunks.append(chunk)
                            continue
                        idle = sum(c.size for c in self._chunks if not c.blocks)
                        if idle and total - idle + size <= self.max_bytes:
                            break  # idle chunks too small for this block: retire them (below) to make room
                        left = remaining(deadline)
                        if left is not None and left <= 0:
                            raise PoolExhaustedError(
                                f"no free {n}-byte block within {timeout} s: {self.used_bytes_locked()} of "
                                f"{self.max_bytes} bytes are in use or lent out")
                        if waits is None:
                            waits = [w for ch in self._channels if (w := ch._waits) is not None]
                            if waits:
                                announce = True
                                break  # outside this lock: the channels' state locks come before it
                        self._cond.wait(left)
                if announce:
                    # Blocks come back as leases complete: the channels' readers must be woken for releases
                    # (Note [waking for releases], in ._ring); releases already published are taken now (their
                    # blocks come back through _unref_many), then the loop looks for room again.
                    begun += [w for w in waits if w.begin()]
                    continue
                self.trim()  # outside the lock: retiring a chunk tells every channel that has it
        finally:
            for w in begun:
                w.end()

    def used_bytes_locked(self) -> int:
        return sum(b.size for c in self._chunks for b in c.blocks.values())

    def free(self, block: Block) -> None:
        """Give back a block from :meth:`alloc` that nothing else holds; nothing happens for one given back
        already, or after :meth:`close`.

        Raises:
            InvalidArgumentError: a block of another pool, or one still held (the array of :meth:`empty`
                made in it, or a lease on it: it is freed when they let go).
        """
        if not isinstance(block, Block) or block.pool is not self:
            raise InvalidArgumentError(f"free takes a Block of this pool, got {block!r}")
        with self._cond:
            if self._closed or not block.live:
                return
            if block.refs > 0:
                raise InvalidArgumentError(f"{block!r} is still held (an array of empty() or a lease): it is freed "
                                           f"when they let go")
            self._free_locked(block)
            self._cond.notify_all()

    @staticmethod
    def _free_locked(block: Block) -> None:
        """(Under the pool's lock.) ``block`` leaves its chunk and its bytes go back to the chunk's free list."""
        block.chunk.remove(block)
        block.chunk.free.free(block.offset, block.size)

    def _ref(self, block: Block) -> None:
        with self._cond:
            block.refs += 1

    def _ref_live(self, blocks: Sequence[Block]) -> bool:
        """:meth:`_ref` each of ``blocks`` under one hold of the lock if every one is still allocated
        (a lease's blocks lent again); else ref none and return False."""
        with self._lock:
            if self._closed:
                return False
            if len(blocks) == 1:  # (a send()'s: no map and all)
                b = blocks[0]
                if not b.live:
                    return False
                b.refs += 1
                return True
            if not all(map(_LIVE, blocks)):
                return False
            for b in blocks:
                b.refs += 1
        return True

    def _unref(self, block: Block) -> None:
        self._unref_many((block,))

    def _unref_many(self, blocks: Iterable[Block]) -> None:
        """Drop one reference on each block under one hold of the lock; a block no one holds is freed."""
        with self._lock:
            freed = False
            for block in blocks:
                block.refs -= 1
                if block.refs <= 0 and block.live:
                    self._free_locked(block)
                    freed = True
            if freed:
                self._cond.notify_all()

    def find(self, ptr: int, nbytes: int) -> Block | None:
        """The live block holding ``[ptr, ptr+nbytes)`` in this process's address space, or ``None``."""
        with self._cond:
            return self._find_locked(ptr, nbytes)

    def _find_locked(self, ptr: int, nbytes: int) -> Block | None:
        for chunk in self._chunks:
            if chunk.ptr <= ptr and ptr + nbytes <= chunk.ptr + chunk.size:
                i = bisect.bisect_right(chunk.offsets, ptr - chunk.ptr) - 1
                if i >= 0:
                    b = chunk.blocks[chunk.offsets[i]]
                    if ptr + nbytes <= b.ptr + b.size:
                        return b
                return None
        return None

    def _find_ref(self, ptr: int, nbytes: int) -> Block | None:
        """:meth:`find` and :meth:`_ref` under one hold of the lock, so the block cannot go in between."""
        with self._cond:
            b = self._find_locked(ptr, nbytes)
            if b is not None:
                b.refs += 1
            return b

    # --- arrays --------------------------------------------------------------------

    def empty(self, shape: Sequence[int] | int, dtype: Any = "float32", *, timeout: float | None = 10.0) -> Any:
        """An uninitialised C-contiguous array in a pool block, for zero-copy :meth:`Channel.send`.

        Args:
            shape: elements per dimension (an int, a NumPy integer or a sequence of them).
            dtype: a NumPy dtype or a name from :data:`.protocol.DTYPES` (on a host pool, the dtypes
                NumPy lacks, such as ``"bfloat16"`` or ``"float8_e4m3fn"``, need ``ml_dtypes``; a device
                pool's view holds them as the unsigned int of their size).
            timeout: seconds to wait for room when the pool is full.

        Returns:
            host pool: a writable NumPy array over the shared pages; device pool: a
            ``cuda.core.utils.StridedMemoryView`` (DLPack producer: ``torch.from_dlpack``,
            ``cupy.from_dlpack``). The block stays allocated while the array (or any view
            of it) lives, and while leases on it are outstanding.

        Raises:
            InvalidArgumentError: a bad shape, or a dtype that is not one or cannot travel.
            PoolExhaustedError: see :meth:`alloc`.
        """
        import numpy as np

        try:
            shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        except TypeError:  # None, a float: not iterable
            raise InvalidArgumentError(f"shape must be non-negative ints, got {shape!r}") from None
        if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in shape):
            raise InvalidArgumentError(f"shape must be non-negative ints, got {shape!r}")
        shape = tuple(int(s) for s in shape)
        if isinstance(dtype, str) and dtype in DTYPES:
            name = dtype
        else:
            try:
                np_dtype = np.dtype(dtype)
            except TypeError:  # NumPy's "data type 'float33' not understood"
                raise InvalidArgumentError(f"dtype {dtype!r} is neither a NumPy dtype nor one of the names "
                                           f"{', '.join(DTYPES)}") from None
            name = wire_dtype(np_dtype)
            if name is None:
                raise InvalidArgumentError(f"dtype {shown_dtype(np_dtype)} cannot travel; accepted: "
                                           f"{', '.join(DTYPES)}")
        itemsize = DTYPES[name]
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        dt = numpy_dtype(name) if self.is_host else None  # before a block is taken: it may need ml_dtypes
        block = self.alloc(nbytes, timeout=timeout)
        holder = _BlockHolder(block)
        strides = c_strides(shape, itemsize)
        if self.is_host:
            view = HostView(block.ptr, shape, strides, storage_dtype(name).str,
                            (holder, block.chunk.host_keepalive(block.offset, block.size)))
            arr = np.asarray(view)
            return arr.view(dt) if name in STORAGE else arr
        from cuda.core.utils import StridedMemoryView

        from ..buffers import mapped_buffer

        buf = mapped_buffer(block.ptr, max(nbytes, 1), self.device, holder)
        return StridedMemoryView.from_buffer(buf, shape, tuple(s // itemsize for s in strides),
                                             dtype=storage_dtype(name))

    # --- channels and retirement ------------------------------------------------------

    def _register_channel(self, channel: Any) -> None:
        with self._cond:
            self._channels.add(channel)

    def trim(self) -> int:
        """Retire every chunk with no block in use: tell each channel (``retire``), then unexport it.

        Returns:
            how many chunks were retired.

        Raises:
            ForkedResourceError: this process inherited the pool through ``fork()``.
        """
        _forks.check_owner(self._owner, "this pool")
        with self._cond:
            idle = [c for c in self._chunks if not c.blocks]
            for c in idle:
                self._chunks.remove(c)
            channels = list(self._channels)
        for c in idle:
            for ch in channels:
                ch._retire_chunk(c.id)
            c.export.close()
        return len(idle)

    @staticmethod
    def _close_chunks(chunks: list[_Chunk], events: list[Any], device: int | None) -> None:
        for c in chunks:
            try:
                c.export.close()
            except Exception:  # noqa: BLE001 - closing everything matters more than the first error
                pass
        chunks.clear()
        EventPool.destroy(events, device)

    def close(self) -> None:
        """Retire every chunk on every channel and release the exports (fds, mappings, VMM memory, events).

        Arrays from :meth:`empty` on a host pool stay readable until collected
        (the mapping outlives them); leases still outstanding are abandoned.

        In a process that inherited the pool through ``fork()`` it only drops this process's copies
        (a host pool's fds and idle mappings); the parent's channels and chunks are left alone.
        """
        if self._owner != _forks.pid:
            with self._cond:
                if self._closed:
                    return
                self._closed = True
            if self.is_host:
                self._finalizer()
            else:  # no CUDA call after fork (ForkedAfterInitError): the process's exit drops them
                self._finalizer.detach()
            return
        with self._cond:
            if self._closed:
                return
            self._closed = True
            ids = [c.id for c in self._chunks]
            channels = list(self._channels)
            self._cond.notify_all()
        for ch in channels:
            for cid in ids:
                ch._retire_chunk(cid)
        self._finalizer()

    def __enter__(self) -> "SharedPool":
        if self._closed:
            raise InvalidArgumentError("the pool is closed")
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "host" if self.is_host else f"device {self.device}"
        return f"<SharedPool {where} chunks={len(self._chunks)} max_bytes={self.max_bytes}>"


class _BlockHolder:
    """The caller's hold on a block from :meth:`SharedPool.empty`; dropped when its last array goes."""

    __slots__ = ("block", "_fin", "__weakref__")

    def __init__(self, block: Block) -> None:
        self.block = block
        block.pool._ref(block)
        self._fin = weakref.finalize(self, block.pool._unref, block)
