"""`Channel`: one connection over which arrays travel as descriptors into a shared pool.

Either end may send (with a :class:`.pool.SharedPool`) and receive. Incoming
messages are chunk announcements (imported, i.e. mapped, once and kept until
retired or the connection ends), arrays (queued for :meth:`Channel.recv`), and
release batches (which complete :class:`Lease` objects and return blocks to the
pool). Who reads them: a channel that has only received reads its socket in the
caller's thread, inside :meth:`Channel.recv`, so an array reaches the caller
without a hand-over between threads. Once a channel has lent a block (its first
``send``) a background reader thread takes over the socket for good, so that
releases and the peer's death are seen while the caller does something else:
when the peer goes (EOF, even by SIGKILL) it completes every lease at once and
the blocks return to the pool.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import copy
import dataclasses
import gc
import itertools
import math
import numbers
import operator
import os
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

from .._time import check_timeout, deadline_after, remaining
from ..errors import (DmaBufError, InvalidArgumentError, NotSupportedError, PeerClosedError, PeerRefusedError,
                      ProtocolError, WaitTimeoutError)
from ..fd import OwnedFd
from ..fdpass import _broken_recv, _broken_send, close_fds, send_message
from .pool import LIVE_POOLS, Block, DeviceView, HostView, SharedPool, c_strides, numpy_dtype
from .protocol import (DTYPES, MAX_ITEMS, MAX_LAYOUTS, MAX_META_BYTES, MAX_SINGLE_LAYOUTS, ArrayDescriptor,
                       parse_message)
from .wire import frame_reader, send_frame, shut_down

__all__ = ["Channel", "Lease", "Received", "PeerInfo", "as_tensors", "mechanism_for", "release_all"]

#: Most chunks a peer may have mapped in this process at once (a bound on what a peer can make us map).
MAX_CHUNKS = 4096
#: Most placements a channel remembers for arrays sent again (:class:`_Memo`).
MAX_MEMOS = 256
#: How long a released block may wait to be batched with others before its ``release`` message goes out, seconds.
RELEASE_DELAY = 0.002
#: A release this long after the last ``release`` message goes out at once, in the caller's thread, seconds.
RELEASE_GAP = 0.0002
#: This many releases waiting go out at once, in the caller's thread (a busy consumer's batch).
RELEASE_BATCH = 16
#: Seconds a message may wait for the peer to take it (a full socket buffer) before the send fails; one cut
#: off part-way ends the connection.
SEND_TIMEOUT = 60.0

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

    def __init__(self, lease_id: int, blocks: list[Block], event: tuple[Any, bytes] | None,
                 events: Any = None) -> None:
        self.id = lease_id
        self._blocks = blocks
        self._event = event
        self._events = events  # the EventPool that ``event`` goes back to
        # Held while the lease is out; released once on completion. A bare lock, not a
        # threading.Event: a lease is made per send, and an Event costs a Condition and two locks.
        self._out = threading.Lock()
        self._out.acquire()
        self._completing = threading.Lock()
        self.reason: str | None = None

    @property
    def done(self) -> bool:
        return not self._out.locked()

    def wait(self, timeout: float | None = 60.0) -> None:
        """Wait until the peer has released the block(s).

        Args:
            timeout: seconds (``None`` or ``math.inf``: forever).

        Raises:
            WaitTimeoutError: still lent out after ``timeout`` seconds.
            InvalidArgumentError: ``timeout`` is not a number >= 0 or ``None``.
        """
        limit = check_timeout(timeout)
        if not self._out.locked():
            return
        if not self._out.acquire(timeout=-1 if limit is None else limit):
            raise WaitTimeoutError(f"lease {self.id} still held by the peer after {timeout} s")
        self._out.release()

    def _complete(self, reason: str) -> None:
        with self._completing:
            if self.reason is not None:
                return
            self.reason = reason
        try:
            blocks = self._blocks
            pool = blocks[0].pool if blocks else None
            if blocks and all(b.pool is pool for b in blocks):
                pool._unref_many(blocks)  # one hold of the pool's lock for a whole state dict
            else:
                for b in blocks:
                    b.pool._unref(b)
            if self._event is not None:
                self._events.give(self._event)
        finally:  # whatever giving back raised, the lease is over
            self._blocks = []
            self._out.release()

    def __repr__(self) -> str:
        return f"<Lease {self.id} {'done: ' + str(self.reason) if self.done else 'out'}>"


class _ImportedChunk:
    """An importer's mapping of one peer chunk; unmapped when retired and no Received uses it."""

    def __init__(self, chunk_id: int, size: int, buf: Any) -> None:
        self.id = chunk_id
        self.size = size
        self.buf = buf  # ImportedBuffer
        self.device: int = buf.device  # -1: host
        self.refs = 0
        self.retired = False
        self.lock = threading.Lock()

    @property
    def is_host(self) -> bool:
        return self.device < 0

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


class _ChunkRef:
    """One reference on an imported chunk, held by a view (a NumPy array, a DLPack buffer) for as long as
    the view lives: the mapping outlives an early ``release()`` or the end of the connection, so a view
    read after them shows stale bytes instead of unmapped memory."""

    __slots__ = ("chunk",)

    def __init__(self, chunk: Any) -> None:
        chunk.retain()
        self.chunk = chunk

    def __del__(self) -> None:
        self.chunk.release()


def _finalize_hold(channel_ref: Any, lease_id: int, chunks: list[_ImportedChunk], inline: bool = False) -> None:
    ch = channel_ref()
    if ch is not None:
        ch._release_lease(lease_id, inline=inline)
    for chunk in chunks:
        chunk.release()


class _Hold:
    """What the items of one array message hold together: the peer's lease, released once every
    item is released (or, as a safety net, when the last of them is collected: ``__del__``), and
    one reference on each chunk they lie in. One per message, so a batch of thousands pays one
    safety net; ``__del__`` rather than ``weakref.finalize``, which costs a registration per message."""

    __slots__ = ("left", "lock", "alive", "channel", "chunks", "lease_id", "stream", "ordering", "__weakref__")

    def __init__(self, channel: "Channel", lease_id: int, chunks: list[_ImportedChunk], items: int,
                 stream: int = 0, ordering: str | None = None) -> None:
        self.alive = False  # until the chunk references are taken: __del__ gives back nothing before
        self.lease_id = lease_id
        self.stream = stream  # the stream given to recv: made to wait on the event; synchronised by release
        self.ordering = ordering  # a repeated layout's: its descriptors keep their first ordering
        self.left = items
        self.lock = threading.Lock()
        # The channel's own weakref object: one the hold made would be cleared before __del__ runs
        # when the hold dies in a reference cycle, and the release would be lost.
        self.channel = channel._weak
        self.chunks = chunks
        for chunk in chunks:
            chunk.retain()
        self.alive = True

    def release(self, items: "Iterable[Received]") -> None:
        with self.lock:
            for r in items:
                if not r._done:
                    r._done = True
                    self.left -= 1
            last = self.left <= 0 and self.alive
            if last:
                self.alive = False
        if last:  # released by the caller: the release may go out in its thread
            _finalize_hold(self.channel, self.lease_id, self.chunks, inline=True)

    def __del__(self) -> None:
        # Collected with items unreleased (possibly inside the garbage collector): the flusher
        # thread sends the release, nothing blocks here.
        if self.alive:
            self.alive = False
            _finalize_hold(self.channel, self.lease_id, self.chunks)


class _Keep:
    """The DLPack owner of a batch's chunk tensors: it keeps alive every Received whose tensor
    is a view of them, so that no safety-net release happens while such a view lives."""

    __slots__ = ("members", "__weakref__")

    def __init__(self) -> None:
        self.members: list[Received] = []


class _BatchViews:
    """Tensors for the items of one ``recv_many`` batch on a device: one DLPack import
    (``torch.from_dlpack``) per chunk and dtype, and each item an ``as_strided`` view of it,
    instead of one DLPack import per item; for a batch of a layout taken outside grad mode, runs of
    like items (:func:`_stack_runs`) are cut from one view each (``unbind``). Held by each Received of the
    batch; it refers to the :class:`_Keep` and the chunk tensors only weakly, so no reference cycle
    delays a release."""

    __slots__ = ("keep", "bases", "layout")

    def __init__(self, layout: "_LayoutViews | None" = None) -> None:
        self.keep: Any = None  # weakref.ref to the live _Keep, if any
        self.bases: dict[tuple[int, Any], Any] = {}  # (chunk id, torch dtype) -> weakref.ref to the chunk tensor
        self.layout = layout  # the batch's layout, when it has one: its runs are worked out once

    def _keep(self) -> _Keep:
        keep = self.keep() if self.keep is not None else None
        if keep is None:  # every earlier chunk tensor is gone (they held it)
            keep = _Keep()
            self.keep = weakref.ref(keep)
        return keep

    def _base(self, chunk: _ImportedChunk, torch: Any, dtype: Any, keep: _Keep) -> Any:
        """The whole chunk as one tensor of ``dtype`` (one ``torch.from_dlpack`` per chunk and dtype)."""
        ref = self.bases.get((chunk.id, dtype))
        base = ref() if ref is not None else None
        if base is None:
            import numpy as np
            from cuda.core.utils import StridedMemoryView

            from ..buffers import mapped_buffer

            owner = (keep, _ChunkRef(chunk))
            raw = StridedMemoryView.from_buffer(mapped_buffer(chunk.buf.ptr, chunk.size, chunk.device, owner),
                                                (chunk.size,), (1,), dtype=np.dtype("uint8"))
            base = torch.from_dlpack(raw).view(dtype)
            self.bases[(chunk.id, dtype)] = weakref.ref(base)
        return base

    def tensor(self, r: "Received", torch: Any, dtype: Any) -> Any:
        keep = self._keep()
        keep.members.append(r)
        return self._base(r._chunk, torch, dtype, keep).as_strided(*r.descriptor.elements)

    def tensors(self, items: "list[Received]", torch: Any) -> list[Any]:
        """:meth:`tensor` of each of ``items`` (unreleased items of this batch), the lookups done once."""
        keep = self._keep()
        keep.members.extend(items)
        bases: dict[tuple[int, str], Any] = {}
        with _bulk(len(items)):
            plans = list(map(_VIEW_PLAN, items))  # each ((chunk id, dtype), (shape, strides, offset)), in elements
            found = None
            # Not in grad mode: unbind's outputs (a multi-output view) may not then be written in place
            # with an operand that requires grad, where as_strided's may.
            if self.layout is not None and len(items) >= STACK_MIN and not torch.is_grad_enabled():
                found = self.layout.runs(plans)
            runs, singles = found if found is not None else ((), range(len(items)))  # no runs: every item alone
            out: list[Any] = [None] * len(items)
            for key, shape, strides, first, delta, idx in runs:
                base = bases.get(key)
                if base is None:
                    base = bases[key] = self._base(items[idx[0]]._chunk, torch, getattr(torch, key[1]), keep)
                # One view over the whole run, cut into its items: the same tensors as one as_strided each.
                for i, t in zip(idx, base.as_strided((len(idx), *shape), (delta, *strides), first).unbind(0)):
                    out[i] = t
            for i in singles:
                key, args = plans[i]
                base = bases.get(key)
                if base is None:
                    base = bases[key] = self._base(items[i]._chunk, torch, getattr(torch, key[1]), keep)
                out[i] = base.as_strided(*args)
        return out


#: Items of one batch that :func:`_stack_runs` joins into one view (then ``unbind``) when this many or more.
STACK_MIN = 8


def _stack_runs(plans: list[Any], min_run: int = STACK_MIN) -> tuple[list[Any], list[int]]:
    """Runs of a batch's items that one strided view of their chunk tensor holds, one item per index of
    its first dimension: items of the same chunk, dtype, shape and strides whose element offsets step by
    the same positive ``delta``, taken in batch order, every ``p``-th of them, for the ``p`` in 1..4 that
    puts the most items in runs (a state dict of experts lays out a few shapes in turn).

    Args:
        plans: each item's ``view_plan``: ``((chunk id, dtype), (shape, strides, offset))``, in elements.
        min_run: the fewest items in a run (at least 2).

    Returns:
        ``(runs, singles)``: each run ``(key, shape, strides, first offset, delta, indices)``, and the
        indices of the items in no run.
    """
    min_run = max(min_run, 2)
    by_sig: dict[Any, list[int]] = {}
    for i, (key, (shape, strides, _)) in enumerate(plans):
        by_sig.setdefault((key, shape, strides), []).append(i)
    runs: list[Any] = []
    singles: list[int] = []
    for (key, shape, strides), idx in by_sig.items():
        best: tuple[int, list[Any], list[int]] = (0, [], idx)
        for p in range(1, 5):
            if len(idx) < p * min_run:
                break
            found: list[Any] = []
            left: list[int] = []
            covered = 0
            for j in range(p):
                sub = idx[j::p]
                offs = [plans[i][1][2] for i in sub]
                s = 0
                while s < len(sub):
                    e = s + 1
                    delta = offs[e] - offs[s] if e < len(sub) else 0
                    if delta > 0:
                        while e < len(sub) and offs[e] - offs[e - 1] == delta:
                            e += 1
                    if e - s >= min_run:
                        found.append((key, shape, strides, offs[s], delta, sub[s:e]))
                        covered += e - s
                        s = e
                    else:
                        left.append(sub[s])
                        s += 1
            if covered > best[0]:
                best = (covered, found, left)
        runs += best[1]
        singles += best[2]
    return runs, singles


class _LayoutViews:
    """What the tensors of a layout's batches share across messages: its :func:`_stack_runs`, worked
    out the second time the same items are taken together (a layout sent once pays nothing for it),
    and kept for later batches that take the same."""

    __slots__ = ("cached",)

    def __init__(self) -> None:
        self.cached: tuple[list[Any], tuple[list[Any], list[int]] | None] | None = None

    def runs(self, plans: list[Any]) -> tuple[list[Any], list[int]] | None:
        """The runs of ``plans`` (:func:`_stack_runs`), or ``None`` (one ``as_strided`` per item): on their
        first sight, and for items other than the first seen (a part of the batch, another order)."""
        cached = self.cached  # one read and at most one write of the pair: threads may share a layout
        if cached is None:
            self.cached = (plans, None)
            return None
        if cached[0] != plans:
            return None
        if cached[1] is None:
            cached = self.cached = (plans, _stack_runs(plans))
        return cached[1]


class Received:
    """One array from the peer, held until :meth:`release`, or as a safety net until it and the other
    items of its ``recv_many`` batch have all been collected (the lease covers the whole batch).

    Attributes:
        shape: elements per dimension. dtype: the wire dtype name. strides: bytes per dimension.
        meta: the sender's JSON object or ``None``. name: the key in a ``send_many`` batch or ``None``.
        ordering: how the producer's writes were ordered: ``"none"`` (host), ``"event"`` or ``"sync"``.
        device: the importing CUDA ordinal, or ``-1`` for host memory.
    """

    # Slots, and the other fields read through the descriptor, chunk and hold: a state dict
    # makes thousands per step.
    __slots__ = ("descriptor", "_chunk", "_batch", "_hold", "_done", "__weakref__")

    def __init__(self, hold: _Hold, desc: ArrayDescriptor, chunk: _ImportedChunk) -> None:
        self.descriptor = desc
        self._chunk = chunk
        self._batch: _BatchViews | None = None
        self._hold = hold  # the chunk stays mapped, and the lease held, while this lives
        self._done = False

    @property
    def lease_id(self) -> int:
        return self._hold.lease_id

    @property
    def ordering(self) -> str:
        return self._hold.ordering or self.descriptor.ordering

    @property
    def device(self) -> int:
        return self._chunk.device

    @property
    def _stream(self) -> int:
        return self._hold.stream

    @property
    def shape(self) -> tuple[int, ...]:
        return self.descriptor.shape

    @property
    def dtype(self) -> str:
        return self.descriptor.dtype

    @property
    def strides(self) -> tuple[int, ...]:
        return self.descriptor.strides

    @property
    def meta(self) -> dict[str, Any] | None:
        return self.descriptor.meta

    @property
    def name(self) -> str | None:
        return self.descriptor.name

    @property
    def _ptr(self) -> int:
        d = self.descriptor
        return self._chunk.buf.ptr + d.block_offset + d.byte_offset

    @property
    def released(self) -> bool:
        return self._done or not self._hold.alive

    def _check(self) -> None:
        if self._done or not self._hold.alive:
            raise InvalidArgumentError("this Received was released; its block may already hold other data")

    def as_array(self) -> Any:
        """The array, zero-copy.

        Returns:
            host: a writable NumPy array over the shared pages (bfloat16 needs ``ml_dtypes``);
            device: a :class:`.pool.DeviceView`: ``ptr``, ``shape``, ``strides`` (elements),
            ``dtype`` (bfloat16 as uint16), a DLPack producer; ``memory_view()`` gives cuda.core's
            ``StridedMemoryView``. Making it calls no driver function. Either keeps this Received
            alive while it lives; its contents are valid until :meth:`release`.

        Raises:
            InvalidArgumentError: already released; bfloat16 on the host without ``ml_dtypes``.
        """
        self._check()
        d = self.descriptor
        if self.device < 0:
            return self._host_view(numpy_dtype(d.dtype).str)
        return self._device_view(_device_dtype(d.dtype))

    def _host_view(self, typestr: str) -> Any:
        import numpy as np

        d = self.descriptor
        keep = (self, _ChunkRef(self._chunk), self._chunk.buf._mapping.map)
        return np.asarray(HostView(self._ptr, d.shape, d.strides, typestr, keep))

    def _device_view(self, dt: Any) -> DeviceView:
        d = self.descriptor
        return DeviceView(self._ptr, d.shape, d.elements[1], dt, self.device, d.span, (self, _ChunkRef(self._chunk)),
                          d.dtype)

    def as_tensor(self) -> Any:
        """A ``torch.Tensor`` over the block (``torch.from_dlpack`` / ``torch.from_numpy``; torch imported here).

        bfloat16 arrives as ``torch.bfloat16`` (read as int16 and re-viewed). For the items of a
        device ``recv_many`` batch, each chunk is imported into torch once (``torch.from_dlpack``)
        and every item's tensor is a ``torch.as_strided`` view of it: while any such tensor lives,
        every item of the batch whose tensor was taken stays held (its safety-net release waits).

        Raises:
            InvalidArgumentError: already released.
            NotSupportedError: torch is not installed.
        """
        self._check()
        torch = _require("torch")
        d = self.descriptor
        if self._batch is not None and self.device >= 0:
            return self._batch.tensor(self, torch, getattr(torch, d.dtype))
        if d.dtype == "bfloat16":
            if self.device < 0:
                return torch.from_numpy(self._host_view("<i2")).view(torch.bfloat16)
            return torch.from_dlpack(self._device_view(_device_dtype("int16")).memory_view()).view(torch.bfloat16)
        if self.device < 0:
            return torch.from_numpy(self.as_array())
        return torch.from_dlpack(self.as_array().memory_view())

    def as_cupy(self) -> Any:
        """A ``cupy.ndarray`` over the block (``cupy.from_dlpack``; device pools only).

        Raises:
            InvalidArgumentError: the array is in host memory.
            NotSupportedError: CuPy is not installed.
        """
        if self.device < 0:
            raise InvalidArgumentError("this array is in host memory: use as_array() (NumPy)")
        cupy = _require("cupy")

        return cupy.from_dlpack(self.as_array().memory_view())

    def release(self, *, synchronize: bool = True) -> None:
        """Give the block back to the producer (idempotent). The lease is released when every item
        of its message was; the ``release`` message goes out at once, or with its burst within
        :data:`RELEASE_DELAY`.

        For device memory the stream given to ``recv`` is synchronised first
        (``cuStreamSynchronize``), so work queued on it that reads the block is done;
        ``synchronize=False`` skips that, for a caller that has synchronised already
        (:func:`release_all` does it once for many).
        """
        if self.released:
            return
        if synchronize and self.device >= 0 and self._stream is not None:
            from .. import _driver as driver

            driver.set_current(self.device)
            driver.stream_synchronize(self._stream)
        self._hold.release((self,))

    def __enter__(self) -> "Received":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Received {self.dtype}{list(self.shape)} lease={self.lease_id} {state}>"


#: Batches of at least this many items pause the garbage collector while they make their objects (:func:`_bulk`).
BULK_ITEMS = 1024


class _GcPause:
    """The cyclic garbage collector paused while any thread is inside a large batch (:func:`_bulk`):
    off when the first enters, on again when the last leaves, and only if it was on before."""

    lock = threading.Lock()
    depth = 0
    was_on = False


def _bulk(items: int) -> contextlib.AbstractContextManager[None]:
    """Pause the cyclic garbage collector (``gc.disable``) while a batch of ``items`` makes an object or
    more per item, all of which it keeps: a collection in between would only walk them (measured on a
    19,000-item batch: a fifth to a third of its time). Collections resume with the next allocations.
    Below :data:`BULK_ITEMS`, a shared no-op context: a single array pays no generator per message."""
    return _NO_PAUSE if items < BULK_ITEMS else _gc_paused()


_NO_PAUSE = contextlib.nullcontext()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    with _GcPause.lock:
        if _GcPause.depth == 0:
            _GcPause.was_on = gc.isenabled()
            gc.disable()
        _GcPause.depth += 1
    try:
        yield
    finally:
        with _GcPause.lock:
            _GcPause.depth -= 1
            if _GcPause.depth == 0 and _GcPause.was_on:
                gc.enable()


def _require(module: str) -> Any:
    """Import ``module`` (torch, CuPy) for a view, or say it is missing.

    Raises:
        NotSupportedError: it is not installed.
    """
    found = sys.modules.get(module)
    if found is not None:
        return found
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise NotSupportedError(f"{module} is not installed ({exc}): use as_array() (DLPack / NumPy)") from exc


def release_all(items: Mapping[str, Received] | Iterable[Received]) -> None:
    """Release many :class:`Received` (a ``recv_many`` batch: its dict, or its list, or any iterable
    of them): each distinct (device, stream) is synchronised once (``cuStreamSynchronize``), not once
    per item.

    Raises:
        InvalidArgumentError: an item is not a Received.
    """
    items = list(items.values() if isinstance(items, Mapping) else items)
    bad = next((r for r in items if not isinstance(r, Received)), None)
    if bad is not None:
        raise InvalidArgumentError(f"release_all takes Received objects, got {type(bad).__name__}")
    synced: set[tuple[int, int]] = set()
    for r in items:
        if r.device >= 0 and r._stream is not None and not r.released and (r.device, r._stream) not in synced:
            from .. import _driver as driver

            driver.set_current(r.device)
            driver.stream_synchronize(r._stream)
            synced.add((r.device, r._stream))
    holds: dict[int, tuple[_Hold, list[Received]]] = {}
    for r in items:
        holds.setdefault(id(r._hold), (r._hold, []))[1].append(r)
    for hold, members in holds.values():
        hold.release(members)


def as_tensors(items: Mapping[str, Received] | Sequence[Received]) -> dict[str, Any] | list[Any]:
    """torch tensors for many :class:`Received` (a ``recv_many`` batch: its dict, or its list), in the
    same form: what :meth:`Received.as_tensor` gives for each, and with the same lifetime rules, but
    with the per-batch work done once (a state dict of thousands of tensors, every step). A device
    batch: one ``torch.from_dlpack`` per chunk and dtype, then one ``Tensor.as_strided`` per item, or,
    outside grad mode (``torch.no_grad()``, ``torch.inference_mode()``, as engines load weights) and
    from the second batch of a layout on (a state dict sent every step), one per run of at least
    :data:`STACK_MIN` items of the same chunk, dtype, shape and strides whose offsets step evenly
    (``unbind`` cuts it into the items' tensors, the same tensors; the runs are found once per layout).
    In grad mode each item has its own ``as_strided``, whose output, unlike ``unbind``'s, may be written
    in place with an operand that requires grad. Host items: ``as_tensor()`` each.

    Raises:
        InvalidArgumentError: not a dict, list or tuple; an item is not a Received, or was released.
        NotSupportedError: torch is not installed.
    """
    if not isinstance(items, (Mapping, list, tuple)):
        raise InvalidArgumentError(f"as_tensors takes a recv_many batch (a dict or a list of Received), got "
                                   f"{type(items).__name__}: use as_tensor() for one")
    names = list(items.keys()) if isinstance(items, Mapping) else None
    rs = list(items.values()) if isinstance(items, Mapping) else list(items)
    # Checked with C-level maps: a state dict has thousands of items, every step.
    if rs and set(map(type, rs)) != {Received}:
        bad = next((r for r in rs if not isinstance(r, Received)), None)
        if bad is not None:  # (a subclass passes)
            raise InvalidArgumentError(f"as_tensors takes Received objects, got {type(bad).__name__}")
    if any(map(_DONE, rs)) or not all(h.alive for h in set(map(_HOLD, rs))):
        raise InvalidArgumentError("a Received was released; its block may already hold other data")
    torch = _require("torch")
    batches = set(map(_BATCH, rs))
    if len(batches) == 1 and None not in batches:  # one device batch: one pass
        out = batches.pop().tensors(rs, torch)
    else:
        out = [r.as_tensor() for r in rs]
    return dict(zip(names, out)) if names is not None else out


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
    known_device: int | None  # -1: host; None: ask the driver only if a copy needs it
    obj: Any
    whole_items: bool = False  # strides known to be multiples of the itemsize (torch's are in elements)

    @property
    def device(self) -> int:
        if self.known_device is None:  # a StridedMemoryView: device memory, or host memory CUDA knows
            view = self.obj
            self.known_device = view.device_id if view.is_device_accessible and not _is_host_ptr(view) else -1
        return self.known_device


def _inspect(array: Any) -> _Source:
    import numpy as np

    mod = type(array).__module__
    if mod.startswith("torch"):
        if array.is_conj() or array.is_neg():  # lazy views: the memory holds the values before the conjugation
            raise InvalidArgumentError("a torch tensor with its conjugate or negative bit set cannot travel as "
                                       "it lies in memory: send tensor.resolve_conj().resolve_neg()")
        known = _TORCH_DTYPES.get(array.dtype)
        if known is None:
            known = _TORCH_DTYPES[array.dtype] = (str(array.dtype).replace("torch.", ""), array.element_size())
        dtype, es = known
        _SIG_KINDS.setdefault(type(array), 1)
        dev = array.get_device()  # -1 for CPU tensors
        return _Source(array.data_ptr(), tuple(array.shape), tuple(s * es for s in array.stride()), dtype,
                       dev, array, True)
    if type(array) is DeviceView:  # a received array sent on, as it is mapped here (no memory view made)
        size = array.dtype.itemsize
        return _Source(array.ptr, array.shape, tuple(st * size for st in array.strides), array._wire_dtype,
                       array.device_id, array, True)
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is not None:
        from .. import _driver as driver

        dt = np.dtype(cai["typestr"])
        shape = tuple(cai["shape"])
        ptr = int(cai["data"][0])
        strides = tuple(cai["strides"]) if cai.get("strides") else c_strides(shape, dt.itemsize)
        dev = driver.pointer_device(ptr) if ptr else 0
        return _Source(ptr, shape, strides, dt.name, dev, array)
    if isinstance(array, np.ndarray):
        _SIG_KINDS.setdefault(type(array), 2)
    else:
        from cuda.core.utils import StridedMemoryView

        if isinstance(array, StridedMemoryView):
            _SIG_KINDS.setdefault(type(array), 3)
            dt = np.dtype(array.dtype)
            shape = tuple(array.shape)
            strides = (tuple(s * dt.itemsize for s in array.strides) if array.strides is not None
                       else c_strides(shape, dt.itemsize))
            return _Source(int(array.ptr), shape, strides, dt.name, None, array)
        try:
            array = np.asarray(array)
        except ValueError as exc:  # a ragged list, for one
            raise InvalidArgumentError(f"cannot send {type(array).__name__}: numpy.asarray refused it ({exc})") from exc
    name = _NUMPY_NAMES.get(array.dtype)
    if name is None:
        if array.dtype.byteorder == ">":
            raise InvalidArgumentError("big-endian arrays cannot travel: convert with "
                                       "astype(dtype.newbyteorder('='))")
        name = array.dtype.name
        if name == "bfloat16" or (array.dtype.kind == "V" and "bfloat16" in str(array.dtype)):
            name = "bfloat16"
        _NUMPY_NAMES[array.dtype] = name
    return _Source(array.ctypes.data, array.shape, array.strides, name, -1, array)


#: wire dtype name -> the NumPy dtype of a device view (bfloat16, which NumPy lacks, read as uint16).
_DEVICE_DTYPES: dict[str, Any] = {}


def _device_dtype(name: str) -> Any:
    dt = _DEVICE_DTYPES.get(name)
    if dt is None:
        import numpy as np

        dt = _DEVICE_DTYPES[name] = np.dtype("uint16" if name == "bfloat16" else name)
    return dt


#: NumPy dtype -> wire dtype name (``dtype.name`` builds a new string on every read).
_NUMPY_NAMES: dict[Any, str] = {}
#: torch dtype -> (wire dtype name, itemsize).
_TORCH_DTYPES: dict[Any, tuple[str, int]] = {}
_NAME = operator.attrgetter("name")
_DONE = operator.attrgetter("_done")
_HOLD = operator.attrgetter("_hold")
_BATCH = operator.attrgetter("_batch")
_VIEW_PLAN = operator.attrgetter("descriptor.view_plan")
#: Array types :func:`_signatures` reads: 1 torch tensors, 2 NumPy arrays, 3 cuda.core StridedMemoryViews.
_SIG_KINDS: dict[type, int] = {}


def _is_host_ptr(view: Any) -> bool:
    """True for host memory CUDA knows (pinned or registered): ``CU_MEMORYTYPE_HOST`` from ``cuPointerGetAttributes``."""
    try:
        from .. import _driver as driver

        host = int(driver.bindings().CUmemorytype.CU_MEMORYTYPE_HOST)
        return driver.pointer_facts(int(view.ptr))["memory_type"] == host
    except DmaBufError:
        return False


def _wire_descs(placed: list[Any], order: str, ev64: str | None, meta: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The wire form of :meth:`ArrayDescriptor.to_json` for each placed array, built directly (a batch
    has thousands of items); ``meta`` rides on the first."""
    descs = [{"chunk": block.chunk.id, "block_offset": block.offset, "block_bytes": block.size,
              "byte_offset": off, "shape": list(shape), "strides": list(strides), "dtype": dtype,
              "ordering": order, "event": ev64, "name": name, "meta": None}
             for name, block, off, shape, strides, dtype in placed]
    if descs:
        descs[0]["meta"] = meta
    return descs


class _Memo:
    """A batch, or one array, lent whose every array lay in a :class:`.pool.SharedPool` block:
    sending the same names over the same addresses and layouts again (a model's state dict, every
    step, whole or in buckets; a ring of blocks) reuses its placement, referencing its blocks again,
    without inspecting and finding each array, and sends a ``repeat`` of its layout."""

    __slots__ = ("names", "key", "sigs", "placed", "blocks", "dev_pool", "by_pool", "heads", "layout", "batch")

    @staticmethod
    def key_of(batch: bool, names: list[str | None], sigs: tuple[Any, ...]) -> tuple[Any, ...]:
        """Where a memo is kept, cheap to make (the full names and signatures are compared on use):
        a named batch by its length and end names; arrays without names by their signatures."""
        return (batch, len(names), names[0], names[-1]) if names[0] is not None else (batch, sigs)

    def __init__(self, names: list[str | None], sigs: tuple[Any, ...], placed: list[Any], dev_pool: Any,
                 batch: bool) -> None:
        self.names = names
        self.key = self.key_of(batch, names, sigs)
        self.batch = batch  # a send_many batch, else one send (each sent as a layout)
        self.sigs = sigs
        self.placed = placed
        self.blocks = [p[1] for p in placed]  # a lease's list, shared: a Lease never changes it
        self.dev_pool = dev_pool
        by_pool: dict[Any, list[Block]] = {}
        heads: dict[int, Block] = {}  # one block per chunk, to check that the peer has it
        for p in placed:
            by_pool.setdefault(p[1].pool, []).append(p[1])
            heads.setdefault(p[1].chunk.id, p[1])
        self.by_pool = list(by_pool.items())
        self.heads = list(heads.values())
        self.layout: int | None = None  # set once the peer has its layout


def _signatures(arrays: list[Any]) -> tuple[Any, ...] | None:
    """Each array's (address, shape, strides, dtype), read as cheaply as its type allows (torch
    tensors and NumPy arrays that :func:`_inspect` has met); ``None`` if some array has no such form."""
    out = []
    append = out.append
    kinds = _SIG_KINDS
    with _bulk(len(arrays)):
        for a in arrays:
            kind = kinds.get(type(a))
            if kind == 1:  # (a lazy conjugate or negative view of the same memory is another array)
                append((a.data_ptr(), a.shape, a.stride(), a.dtype, a.is_conj(), a.is_neg()))
            elif kind == 2:
                append((a.ctypes.data, a.shape, a.strides, a.dtype))
            elif kind == 3:
                append((3, a.ptr, a.shape, a.strides, a.dtype))  # strides in items: never equal to NumPy's
            else:
                return None
    return tuple(out)


class Channel:
    """A connected channel (from :func:`.connect` or :meth:`.Listener.accept`).

    Attributes:
        share_segments: lend device memory that is already shareable (torch's expandable
            segments: :mod:`.segments`) in place instead of copying it into the pool
            (default ``True``; set it ``False`` to always copy).

    The rendezvous makes it and gives these arguments; callers do not.

    Args:
        sock: the connected AF_UNIX stream socket (owned from now on).
        peer: who is on the other end.
        pool: the pool that :meth:`send` copies into (``None``: this end only
            receives, or sends arrays that already live in some pool).
        device: the CUDA ordinal that device chunks are mapped on when
            receiving (``None``: the chunk's own GPU, found by UUID).
        ordering: ``"event"`` (default) or ``"sync"`` for device pools.
    """

    share_segments = True
    # The Received of a batch lie where its layout says (runs of like items are cut from one view each);
    # not so where each item is first copied into a block of its own (RemoteChannel).
    _views_follow_layout = True

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
        self._weak = weakref.ref(self)  # shared by every _Hold (see there)
        self._state = threading.Condition()
        self._queue: collections.deque[Any] = collections.deque()
        self._error: BaseException | None = None
        self._closed = False  # this end closed
        self._eof = False  # the connection is over (either end)
        self._announced: set[int] = set()  # our chunk ids the peer has
        self._leases: dict[int, Lease] = {}
        self._imports: dict[int, _ImportedChunk] = {}
        self._held: set[int] = set()  # peer lease ids held here
        self._pending: list[int] = []
        self._last_flush = 0.0  # time.monotonic() of the last release message
        self._opened_events: dict[bytes, Any] = {}
        # Layouts (_send_batch): sent, key -> id; received, id -> (descs, mapping, their chunks).
        self._layouts_sent: dict[Any, int] = {}  # batches' (MAX_LAYOUTS)
        self._single_layouts_sent: dict[Any, int] = {}  # single arrays' (MAX_SINGLE_LAYOUTS)
        self._layout_ids = itertools.count(1)
        # As the peer defined them: (descriptors, mapping, chunks, what their tensors share); mapping None
        # for one array.
        self._layouts: dict[int, tuple[list[ArrayDescriptor], bool | None, dict[int, Any], _LayoutViews]] = {}
        self._single_layouts: dict[int, tuple[list[ArrayDescriptor], bool | None, dict[int, Any], _LayoutViews]] = {}
        # Batches lent whose arrays all lay in pool blocks, by (length, first name, last name).
        self._memos: dict[tuple[Any, ...], _Memo] = {}
        self._flusher: threading.Thread | None = None
        # The flusher has its own wake-up, so that it never competes with recv() for the GIL
        # when an array arrives; and _state is notified only when a recv() waits on it.
        self._flush_wake = threading.Event()
        self._waiters = 0
        # Held by whoever reads the socket: recv() in the caller's thread, or the background
        # reader, which keeps it from its start to the end of the connection.
        self._read_lock = threading.Lock()
        self._frames = frame_reader(sock)  # buffered: a burst of messages costs one recvmsg
        self._reader: threading.Thread | None = None
        if pool is not None:
            pool._register_channel(self)

    def _start_reader(self) -> None:
        """Start the background reader (idempotent): from now on it alone reads the socket."""
        with self._state:
            if self._reader is not None:
                return
            self._reader = threading.Thread(target=self._read_loop, name="dmabuf-interop-channel-reader",
                                            daemon=True)
        self._reader.start()

    # --- sending --------------------------------------------------------------------

    def _send(self, obj: dict[str, Any], fd: int | Sequence[int] | None = None, *, essential: bool = False) -> None:
        with self._send_lock:
            self._send_locked(obj, fd, essential=essential)

    def _send_locked(self, obj: dict[str, Any], fd: int | Sequence[int] | None = None,
                     timeout: float | None = None, *, essential: bool = False) -> None:
        """Send one message (the caller holds the send lock), waiting at most ``timeout`` seconds
        (default :data:`SEND_TIMEOUT`) for the peer to take it. ``essential``: a ``release`` or
        ``retire``, which the peer must not miss while the connection lasts (its blocks would stay
        lent, or its mapping kept): one the peer took none of ends the connection too."""
        if self._eof or self._closed or self._sock in _broken_send:
            raise self._ended()
        wait = SEND_TIMEOUT if timeout is None else timeout
        try:
            if fd is None:
                send_frame(self._sock, obj, wait)
            else:
                send_message(self._sock, obj, fd, timeout=wait)
        except BaseException as exc:
            cut = self._sock in _broken_send
            if not (cut or (essential and isinstance(exc, WaitTimeoutError))):
                raise  # nothing of the message went out: the connection is as it was
            # Cut off after its first byte (a peer that stopped reading, or an interrupt), the stream
            # is out of step for good; or an essential message could not go. End it: the peer sees the
            # end at once, our reader ends the channel.
            self._abort(exc)
            if not isinstance(exc, DmaBufError):
                raise  # (KeyboardInterrupt and the like stay what they are)
            what = "was cut off" if cut else "could not go"
            raise PeerClosedError(f"the {obj.get('kind')!r} message to the peer {what} ({exc}): the connection is "
                                  f"ended") from exc

    def _set_error(self, exc: BaseException) -> None:
        """Record why the connection ends; the first cause is kept (our own shutdown after it
        makes the reader see an end of file, which says less)."""
        if self._error is None:
            self._error = exc

    def _abort(self, exc: BaseException) -> None:
        """End the connection now because of ``exc`` (shut the socket down: the peer sees the end
        at once, and our reader, or the next read, ends the channel). The caller holds the send lock.
        Kept without its traceback (a copy): that would hold the sender's frames, and with them its
        arrays and their pool chunks, for as long as the channel lives."""
        self._set_error(copy.copy(exc))
        shut_down(self._sock)  # (the caller holds the send lock, under which _end closes the socket)

    def _ended(self) -> PeerClosedError:
        """The error for a call on a channel that has ended, saying how it ended, chained to the cause."""
        err = self._error
        if self._closed:
            why = "the channel is closed"
        elif err is None or isinstance(err, PeerClosedError):
            why = "the peer closed the channel"
        else:  # a failure here (no fd left to map a chunk, a message cut off), not the peer's doing
            why = f"the connection ended on an error: {type(err).__name__}: {err}"
        exc = PeerClosedError(why)
        exc.__cause__ = err
        return exc

    def _announce(self, block: Block) -> None:
        chunk = block.chunk
        if chunk.id in self._announced:
            return
        with self._send_lock:  # checked again: two threads may lend blocks of a new chunk at once
            if chunk.id not in self._announced:
                self._send_chunk_locked(block)
                self._announced.add(chunk.id)
        block.pool._register_channel(self)

    def _send_chunk_locked(self, block: Block) -> None:
        """Tell the peer about ``block``'s chunk (the caller holds the send lock): its fds (``SCM_RIGHTS``),
        one per part."""
        with block.chunk.fds() as fds:
            self._send_locked(block.chunk.describe(), fds)

    def _retire_chunk(self, chunk_id: int) -> None:
        with self._send_lock:  # placements in the chunk are gone
            for m in [m for m in self._memos.values() if any(b.chunk.id == chunk_id for b in m.heads)]:
                self._forget(m)
        if chunk_id in self._announced:
            self._announced.discard(chunk_id)
            try:
                self._send({"kind": "retire", "chunk": chunk_id}, essential=True)
            except (DmaBufError, OSError):
                pass  # the connection has ended (or broke, or was ended here): the peer unmaps everything anyway

    def _find(self, array: Any) -> list[Any]:
        """``[source, itemsize, span, block]`` for a caller's array: ``block`` is the pool block that
        already holds it (referenced), else ``None``; ``span`` is the bytes from its first element to
        one past its last (0: empty, or negative strides: nothing to find)."""
        src = _inspect(array)
        itemsize = DTYPES.get(src.dtype)
        if itemsize is None:
            raise InvalidArgumentError(f"dtype {src.dtype!r} cannot travel; accepted: {', '.join(DTYPES)}")
        span = itemsize
        for n, st in zip(src.shape, src.strides):
            if n == 0 or st < 0:
                span = 0
                break
            span += (n - 1) * st
        block = None
        if span:
            block = self.pool._find_ref(src.ptr, span) if self.pool is not None else None
            if block is None and len(LIVE_POOLS) > (self.pool is not None):  # another pool of this process
                for p in list(LIVE_POOLS):
                    if p is not self.pool:
                        block = p._find_ref(src.ptr, span)
                        if block is not None:
                            break
        return [src, itemsize, span, block]

    def _lend_in_place(self, found: list[list[Any]]) -> None:
        """Fill in the block of each device array in no pool whose memory torch's expandable segments
        hold, lent in place (:mod:`.segments`), one batch per device."""
        if self.pool is not None and self.pool.is_host:
            return  # a host-pool channel: its peer may have no GPU; device arrays are copied to the host
        by_device: dict[int, list[list[Any]]] = {}
        for f in found:
            src, _, span, block = f
            if block is None and span and src.device >= 0:
                by_device.setdefault(src.device, []).append(f)
        if not by_device:
            return
        from .segments import segments_for

        for dev, fs in by_device.items():
            blocks = segments_for(dev).find_many([(f[0].ptr, f[2], f[0].obj) for f in fs])
            for f, b in zip(fs, blocks):
                f[3] = b

    def _place(self, src: _Source, itemsize: int, block: Any, stream: int,
               timeout: float | None) -> tuple[Block, int, tuple[int, ...], tuple[int, ...], str, bool]:
        """The block to lend for an array :meth:`_find` inspected: ``block`` itself (zero-copy), or a new
        block of this channel's pool it is copied into: (block, byte_offset, shape, strides, dtype,
        copied_from_device). On failure ``block`` is released."""
        shape, strides = src.shape, tuple(src.strides)
        if block is not None:
            off = src.ptr - block.ptr
            if itemsize == 1 or (off % itemsize == 0 and (src.whole_items or not any(st % itemsize for st in strides))):
                return block, off, shape, strides, src.dtype, False
            # A view DLPack cannot describe (a stride or its start not a whole number of items): copied instead.
            block.pool._unref(block)
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
                obj = obj.detach()  # a parameter that requires grad: its values, not its graph
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
        goes zero-copy, and so does a device array in torch's expandable
        segments on a channel without a host pool (its pages are lent in place:
        :mod:`.segments`, unless :attr:`share_segments` is false); any other
        array is first copied, C-contiguous, into a new block of this channel's
        pool (host: ``numpy.copyto``; device: ``cuMemcpyAsync`` on ``stream``).
        The first use of a chunk sends its fds (``SCM_RIGHTS``) once.

        Args:
            array: NumPy, torch, CuPy (or any ``__cuda_array_interface__`` exporter), ``StridedMemoryView``,
                a received :class:`.pool.DeviceView`, or anything ``numpy.asarray`` takes. (Send a received
                array on as its DeviceView, not as a CuPy view of it: the CUDA array interface names no
                device, and the driver answers with the GPU that holds the memory, not the one it is mapped for.)
            stream: device pools: the stream the writes were queued on (cuda.core / torch / CuPy
                stream or a raw handle; ``None``: the legacy default stream).
            meta: a JSON object (at most 64 KiB) delivered with the array.
            timeout: seconds to wait for pool room when copying. (A peer that takes nothing of the
                message for :data:`SEND_TIMEOUT` seconds fails the send, whatever ``timeout``.)
            ordering: device pools: ``"event"`` (record an interprocess event on
                ``stream``, ``cuEventRecord``; skipped, and sent as ``"sync"``, when
                ``cuStreamQuery`` finds nothing pending on ``stream``) or ``"sync"``
                (``cuStreamSynchronize``); default: the channel's.

        Returns:
            a :class:`Lease`, done when the peer has released the block.

        Raises:
            InvalidArgumentError: an unsupported dtype, meta too large or not JSON, a negative
                timeout, no pool to copy into, a torch tensor with its conjugate or negative bit set.
            PoolExhaustedError: no room within ``timeout``.
            PeerClosedError: the peer has gone, or the message was cut off part-way by a peer that
                stopped reading (the connection is then ended, and the peer sees its end).
            WaitTimeoutError: the peer took nothing of the message for :data:`SEND_TIMEOUT`
                seconds (none of it went out: the channel is as it was).
        """
        return self._send_items([None], [array], stream, meta, timeout, ordering, batch=None)

    def send_many(self, arrays: Mapping[str, Any] | Sequence[Any], *, stream: Any = None,
                  meta: dict[str, Any] | None = None, timeout: float | None = 10.0,
                  ordering: str | None = None) -> Lease:
        """Lend many arrays (a state dict, or a list) in ONE ``arrays`` message under one lease.

        ``meta`` rides on the first item. Arguments, result and errors as :meth:`send`;
        the lease is done when the peer has released every item.

        Raises:
            InvalidArgumentError: as :meth:`send`; also not a mapping, list or tuple, an empty batch, more than
                :data:`~.protocol.MAX_ITEMS` arrays, or a mapping key that is not a str (of at
                most 4096 characters): the peer would refuse the message and end the channel.
        """
        names: list[str | None]
        if not isinstance(arrays, (Mapping, list, tuple)):  # an array would go as a batch of its rows
            raise InvalidArgumentError(f"send_many takes a mapping of name -> array, or a list or tuple of arrays, "
                                       f"got {type(arrays).__name__}: use send() for one array")
        if isinstance(arrays, Mapping):
            names, arrs, kind = list(arrays.keys()), list(arrays.values()), "mapping"
            # Checked with C-level maps: a state dict has thousands of keys, sent every step.
            if names and (set(map(type, names)) != {str} or max(map(len, names)) > 4096):
                bad = next((k for k in names if not isinstance(k, str) or len(k) > 4096), None)
                if bad is not None:  # (a str subclass passes)
                    shown = repr(bad) if len(repr(bad)) <= 80 else repr(bad)[:77] + "..."
                    raise InvalidArgumentError(f"a send_many mapping needs str keys of at most 4096 characters, "
                                               f"got {shown} ({type(bad).__name__})")
        else:
            arrs, kind = list(arrays), "list"
            names = [None] * len(arrs)
        if not arrs:
            raise InvalidArgumentError("an empty batch: send_many needs at least one array")
        if len(arrs) > MAX_ITEMS:
            raise InvalidArgumentError(f"a batch holds at most {MAX_ITEMS} arrays, got {len(arrs)}: "
                                       f"send it as several batches")
        return self._send_items(names, arrs, stream, meta, timeout, ordering, batch=kind)

    def _send_items(self, names: list[str | None], arrays: list[Any], stream: Any, meta: dict[str, Any] | None,
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
        deadline_after(timeout)  # checks it: a number of seconds >= 0, or None
        if self._eof or self._closed:
            raise self._ended()
        h = _stream_handle(stream)
        placed: list[tuple[str | None, Block, int, tuple[int, ...], tuple[int, ...], str]] = []
        found: list[list[Any]] = []
        memo = None
        try:
            again, sigs, memo = self._lend_again(names, arrays, batch is not None)
            if again is not None:
                placed = again  # referenced again by _lend_again; the except below gives them back
                dev_pool = memo.dev_pool
            else:
                zero_copy = True
                for arr in arrays:
                    found.append(self._find(arr))
                if self.share_segments:
                    self._lend_in_place(found)
                for name, f in zip(names, found):
                    src, itemsize, _, block = f
                    f[3] = None  # from here on _place owns it
                    lent, off, shape, strides, dtype, _ = self._place(src, itemsize, block, h, timeout)
                    placed.append((name, lent, off, shape, strides, dtype))
                    # Remembered: arrays lent from this channel's own pool, which the channel holds anyway.
                    zero_copy = zero_copy and lent is block and type(lent) is Block and lent.pool is self.pool
                dev_pool = next((p[1].pool for p in placed if not p[1].pool.is_host), None)
                if zero_copy and sigs is None:  # the arrays' types are known now (_inspect met them)
                    sigs = _signatures(arrays)
                if zero_copy and sigs is not None:
                    memo = _Memo(names, sigs, placed, dev_pool, batch is not None)
            event = events = None
            order = "none"
            if dev_pool is not None:
                from .. import _driver as driver

                driver.set_current(dev_pool.device)
                if ordering == "sync":
                    driver.stream_synchronize(h)
                    order = "sync"
                elif driver.stream_idle(h):
                    order = "sync"  # nothing pending on the stream: the writes are complete, no event to wait on
                else:
                    events = dev_pool.events
                    event = events.take()
                    driver.event_record(event[0], h)
                    order = "event"
            for block in (memo.heads if memo is not None else (p[1] for p in placed)):
                self._announce(block)
        except BaseException:
            for _, block, *_ in placed:
                block.pool._unref(block)
            for f in found:  # found but not placed
                if f[3] is not None:
                    f[3].pool._unref(f[3])
            raise
        if self._reader is None:
            self._start_reader()  # the release of this lease must be read even if recv() is never called
        lease = Lease(next(_lease_ids), memo.blocks if again is not None else [p[1] for p in placed], event, events)
        ev64 = base64.b64encode(event[1]).decode() if event is not None else None
        with self._state:
            self._leases[lease.id] = lease
        try:
            if batch is None and memo is None:  # copied into a new block: nothing to repeat, no layout
                self._send({"kind": "array", "lease": lease.id, "desc": _wire_descs(placed, order, ev64, meta)[0]})
            else:
                self._send_batch(lease.id, placed, None if batch is None else batch == "mapping", order, ev64,
                                 meta, memo)
        except BaseException:
            with self._state:
                self._leases.pop(lease.id, None)
            lease._complete("closed")
            raise
        return lease

    def _lend_again(self, names: list[str | None], arrays: list[Any],
                    batch: bool) -> tuple[list[Any] | None, tuple[Any, ...] | None, "_Memo | None"]:
        """A remembered batch's placement (:class:`_Memo`), its blocks referenced again, when ``names``
        and ``arrays`` are its names over arrays at the same addresses with the same shapes, strides
        and dtypes, and every block is still allocated: ``(placement, signatures, memo)``. Otherwise
        ``(None, signatures, None)``; the signatures are ``None`` when some array has no cheap one."""
        sigs = _signatures(arrays)
        memo = self._memos.get(_Memo.key_of(batch, names, sigs)) if sigs is not None else None
        if memo is None or sigs != memo.sigs or names != memo.names:
            return None, sigs, None
        done: list[tuple[Any, list[Block]]] = []
        for pool, blocks in memo.by_pool:
            if not pool._ref_live(blocks):  # a block was freed (its array dropped) since
                for p, bl in done:
                    p._unref_many(bl)
                with self._send_lock:  # _memos changes only under the send lock
                    self._forget(memo)
                return None, sigs, None
            done.append((pool, blocks))
        return memo.placed, sigs, memo

    def _remember(self, memo: "_Memo", layout: int | None) -> None:
        """``memo`` was sent; a batch's ``layout`` is known to the peer now. The caller holds the send
        lock, as for every change of ``_memos``."""
        memo.layout = layout
        self._memos[memo.key] = memo
        if len(self._memos) > MAX_MEMOS:
            del self._memos[next(iter(self._memos))]

    def _forget(self, memo: "_Memo") -> None:
        if self._memos.get(memo.key) is memo:
            del self._memos[memo.key]

    def _send_batch(self, lease_id: int, placed: list[Any], mapping: bool | None, order: str, ev64: str | None,
                    meta: dict[str, Any] | None, memo: "_Memo | None" = None) -> None:
        """Send an ``arrays`` message (``mapping`` true or false), or an ``array`` message (``mapping``
        None: one remembered array), defining a layout, or a ``repeat`` of one the peer already has: the
        same names in the same blocks with the same shapes, strides and dtypes (a model's state dict
        sent every step, a ring of blocks), so the peer validates and rebuilds nothing. ``memo``: the
        placement came from it (a repeat of its layout) or is to be remembered in it."""
        with self._send_lock:
            if memo is not None and memo.layout is not None and self._memos.get(memo.key) is memo:
                self._send_locked({"kind": "repeat", "lease": lease_id, "layout": memo.layout, "ordering": order,
                                   "event": ev64, "meta": meta})
                return
        key = (mapping, tuple((name, block.chunk.id, block.offset, block.size, off, shape, strides, dtype)
                              for name, block, off, shape, strides, dtype in placed))
        sent, limit = ((self._single_layouts_sent, MAX_SINGLE_LAYOUTS) if mapping is None
                       else (self._layouts_sent, MAX_LAYOUTS))
        # Chosen, sent and remembered under one hold of the send lock: layouts reach the peer in the
        # order they are defined, and one counts as known only once its definition has gone out.
        with self._send_lock:
            layout = sent.get(key)
            if memo is not None and layout is not None:
                self._remember(memo, layout)
            if layout is not None:
                self._send_locked({"kind": "repeat", "lease": lease_id, "layout": layout, "ordering": order,
                                   "event": ev64, "meta": meta})
                return
            layout = next(self._layout_ids)
            descs = _wire_descs(placed, order, ev64, meta)
            try:
                if mapping is None:
                    self._send_locked({"kind": "array", "lease": lease_id, "desc": descs[0], "layout": layout})
                else:
                    self._send_locked({"kind": "arrays", "lease": lease_id, "items": descs, "mapping": mapping,
                                       "layout": layout})
            except InvalidArgumentError as exc:  # over MAX_FRAME: nothing was sent
                raise InvalidArgumentError(f"{exc}: send the batch as several send_many calls") from exc
            sent[key] = layout
            if memo is not None:
                self._remember(memo, layout)
            if len(sent) > limit:  # first in, first out: the peer forgets the same one
                gone = sent.pop(next(iter(sent)))
                for m in [m for m in self._memos.values() if m.layout == gone]:
                    self._forget(m)

    @property
    def outstanding(self) -> int:
        """Leases lent on this channel and not yet released."""
        with self._state:
            return len(self._leases)

    # --- receiving ------------------------------------------------------------------

    def _next(self, timeout: float | None, want_batch: bool) -> Any:
        deadline = deadline_after(timeout)  # checks it (math.inf: no deadline)
        drained = False  # past the deadline, reading goes on until a read finds nothing: timeout=0 takes what has arrived
        while True:
            if self._pending and not self._queue:
                # About to wait: send the releases now rather than after RELEASE_DELAY, unless a
                # message has arrived already (a busy consumer lets its releases gather).
                if not (self._reader is None and self._read_arrived()):
                    self._flush()
            with self._state:
                if self._queue:
                    if self._queue[0][0] == "arrays" and not want_batch:
                        raise InvalidArgumentError("the next message is a send_many batch: use recv_many()")
                    return self._queue.popleft()
                if self._eof or self._closed:
                    err = self._error
                    if isinstance(err, (ProtocolError, PeerRefusedError)):
                        raise type(err)(str(err)) from err
                    raise self._ended()
                left = remaining(deadline)
                expired = left is not None and left <= 0
                if expired and (drained or self._reader is not None):
                    raise WaitTimeoutError(f"no array from the peer within {timeout} s")
                if self._reader is not None or not self._read_lock.acquire(blocking=False):
                    # Another thread reads the socket: it queues what arrives and notifies.
                    if expired:
                        raise WaitTimeoutError(f"no array from the peer within {timeout} s")
                    self._waiters += 1
                    try:
                        self._state.wait(left)
                    finally:
                        self._waiters -= 1
                    continue
            try:
                drained = not self._read_one(deadline)  # in this thread: no hand-over between threads
            finally:
                self._read_lock.release()
                if self._waiters:
                    with self._state:
                        self._state.notify_all()  # a thread waiting above may now read

    def _read_arrived(self) -> bool:
        """Read one message if one has arrived, without waiting (no other thread reads the socket)."""
        if not self._read_lock.acquire(blocking=False):
            return False
        try:
            return self._read_one(time.monotonic())
        finally:
            self._read_lock.release()
            if self._waiters:
                with self._state:
                    self._state.notify_all()

    def _make_received(self, lease_id: int, descs: list[ArrayDescriptor], stream: int,
                       ordering: str | None, chunks: dict[int, Any]) -> list[Received]:
        """``chunks``: the chunks the descriptors name, by id, retained while the message waited in the
        queue (so a ``retire``, or the end of the connection, that came after it leaves them mapped);
        the hold takes them over."""
        hold = _Hold(self, lease_id, list(chunks.values()), len(descs), stream, ordering)
        for chunk in chunks.values():
            chunk.release()  # the queue's reference: the hold has its own now
        with _bulk(len(descs)):
            out = [Received(hold, d, chunks[d.chunk]) for d in descs]
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
            ProtocolError: the peer broke the protocol, or stopped in the middle of a message for
                :data:`.wire.REST_TIMEOUT` seconds (the connection was closed).
            InvalidArgumentError: the next message is a batch (use :meth:`recv_many`).
        """
        h = _stream_handle(stream)  # before the message is taken: a bad stream must not lose it
        _, lease_id, descs, _, ordering, chunks, _ = self._next(timeout, want_batch=False)
        return self._make_received(lease_id, descs, h, ordering, chunks)[0]

    def recv_many(self, timeout: float | None = 60.0, *, stream: Any = None) -> dict[str, Received] | list[Received]:
        """The next ``send_many`` batch: a dict by name (for a mapping) or a list; a single array as a list of one.

        Raises: as :meth:`recv`.
        """
        h = _stream_handle(stream)  # before the message is taken: a bad stream must not lose it
        kind, lease_id, descs, mapping, ordering, chunks, layout = self._next(timeout, want_batch=True)
        out = self._make_received(lease_id, descs, h, ordering, chunks)
        if len(out) > 1 and out[0].device >= 0:
            views = _BatchViews(layout if self._views_follow_layout else None)
            for r in out:
                r._batch = views
        if mapping:
            return dict(zip(map(_NAME, descs), out))
        return out

    # --- releases (importer side) -----------------------------------------------------

    def _release_lease(self, lease_id: int, *, inline: bool = False) -> None:
        """Every item of the peer's lease ``lease_id`` was released here (:class:`_Hold`); ``inline``:
        by the caller's ``release()``, so the message may go out in its thread."""
        with self._state:
            self._held.discard(lease_id)
        self._queue_release(lease_id, inline=inline)

    def _queue_release(self, lease_id: int, *, inline: bool = False) -> None:
        """Send the release of ``lease_id``: with ``inline``, now, in the caller's thread, when no
        release went out within :data:`RELEASE_GAP` (so the exporter reads it before its next send,
        not during it) or :data:`RELEASE_BATCH` are waiting; otherwise the flusher thread sends it
        with the others of its burst, within :data:`RELEASE_DELAY`, or :meth:`recv` does when it is
        about to wait and nothing has arrived."""
        with self._state:
            if self._eof or self._closed:
                return
            self._pending.append(lease_id)
            n = len(self._pending)
            inline = inline and (n >= RELEASE_BATCH or (n == 1 and time.monotonic() - self._last_flush >= RELEASE_GAP))
        # Non-blocking: while another thread sends, the flusher takes this one.
        if inline and self._send_lock.acquire(blocking=False):
            try:
                self._flush(send_lock_held=True)
            finally:
                self._send_lock.release()
            return
        with self._state:
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_loop, name="dmabuf-interop-channel-release",
                                                 daemon=True)
                self._flusher.start()
        self._flush_wake.set()

    def _flush(self, *, send_lock_held: bool = False, timeout: float | None = None) -> None:
        with self._state:
            ids, self._pending = self._pending, []
            if ids:
                self._last_flush = time.monotonic()
        if ids:
            msg = {"kind": "release", "leases": ids}
            try:
                if send_lock_held:
                    self._send_locked(msg, timeout=timeout, essential=True)
                else:
                    self._send(msg, essential=True)
            except (DmaBufError, OSError):
                pass  # the connection has ended (or broke, or was ended here): the exporter releases everything

    def _flush_loop(self) -> None:
        while True:
            self._flush_wake.wait()
            self._flush_wake.clear()  # a release after this is flushed below or wakes us again
            if self._eof or self._closed:
                return
            time.sleep(RELEASE_DELAY)  # let a burst of releases share one message
            self._flush()

    # --- the reader thread ---------------------------------------------------------------

    def _read_loop(self) -> None:
        with self._read_lock:  # waits for a recv() reading in its caller's thread to finish
            while not self._eof:
                self._read_one(None)

    def _read_one(self, deadline: float | None) -> bool:
        """Read and handle one message (the caller holds ``_read_lock``); a message that ends the
        connection, or breaks the protocol, ends it here (:meth:`_end`). Returns False when
        nothing arrived by ``deadline`` (the caller's own deadline check raises), else True."""
        if self._eof:
            return True
        try:
            msg, fds = self._frames.read(remaining(deadline))
        except WaitTimeoutError as exc:
            if self._sock not in _broken_recv:
                return False  # nothing began to arrive
            # A message began and its rest did not come within REST_TIMEOUT: out of step for good.
            self._set_error(ProtocolError(f"the peer stopped in the middle of a message: {exc}"))
            self._end()
            return True
        except (DmaBufError, OSError, ValueError) as exc:
            self._set_error(exc)
            self._end()
            return True
        try:
            self._handle(msg, fds)
        except (DmaBufError, OSError, ValueError) as exc:
            self._set_error(exc)
            self._end()
        except Exception as exc:  # noqa: BLE001 - a message no check foresaw must still end the channel
            self._set_error(ProtocolError(f"the peer's {msg.get('kind')!r} message could not be handled: "
                                          f"{type(exc).__name__}: {exc}"))
            self._end()
        finally:
            close_fds(fds)
        return True

    def _handle(self, msg: dict[str, Any], fds: list[int]) -> None:
        kind, descs = parse_message(msg)
        if fds and kind != "chunk":
            raise ProtocolError(f"the peer's {kind!r} message carried an fd")
        if kind == "chunk":
            if len(fds) != len(msg["parts"]):
                raise ProtocolError(f"a chunk message of {len(msg['parts'])} part(s) carried {len(fds)} fd(s)")
            self._import_chunk(msg, fds)
        elif kind == "retire":
            chunk = self._imports.pop(msg["chunk"], None)
            if chunk is None:
                raise ProtocolError(f"retire of unknown chunk {msg['chunk']}")
            chunk.retire()
        elif kind in ("array", "arrays", "repeat"):
            lease_id = msg["lease"]
            ordering = None
            layout = None
            if kind == "repeat":
                descs, mapping, chunks, layout = self._repeat(msg)
                ordering = msg["ordering"]
                kind = "array" if mapping is None else "arrays"  # a single array's layout arrives as one
                mapping = bool(mapping)
            else:
                chunks = {}
                for d in descs:
                    chunk = chunks[d.chunk] = self._imports.get(d.chunk)
                    if chunk is None:
                        raise ProtocolError(f"descriptor names unknown chunk {d.chunk}")
                    if d.block_offset + d.block_bytes > chunk.size:
                        raise ProtocolError(f"block [{d.block_offset}, {d.block_offset + d.block_bytes}) lies "
                                            f"outside chunk {d.chunk} of {chunk.size} bytes")
                    if d.ordering == "event" and chunk.is_host:
                        raise ProtocolError(f"ordering 'event' for host chunk {d.chunk}")
                mapping = kind == "arrays" and msg["mapping"]
                if "layout" in msg:
                    layout = self._define_layout(msg["layout"], descs, mapping if kind == "arrays" else None,
                                                 chunks)
            with self._state:
                if lease_id in self._held:
                    raise ProtocolError(f"lease {lease_id} is already held")
                if descs and not self._closed:  # (closed: the queue was dropped; the peer releases at the end)
                    self._held.add(lease_id)
                    for chunk in chunks.values():
                        chunk.retain()  # mapped until received, whatever comes after (_make_received)
                    self._queue.append((kind, lease_id, descs, mapping, ordering, chunks, layout))
                    if self._waiters:
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

    def _define_layout(self, layout: int, descs: list[ArrayDescriptor], mapping: bool | None,
                       chunks: dict[int, _ImportedChunk]) -> _LayoutViews:
        """Keep a layout the peer defined: a batch's (``mapping`` true or false) among the last
        :data:`MAX_LAYOUTS`, one array's (``mapping`` None) among the last :data:`MAX_SINGLE_LAYOUTS`,
        first in, first out, as the exporter forgets them. Returns what its tensors share."""
        if layout in self._layouts or layout in self._single_layouts:
            raise ProtocolError(f"layout {layout} defined twice")
        kept, limit = ((self._single_layouts, MAX_SINGLE_LAYOUTS) if mapping is None
                       else (self._layouts, MAX_LAYOUTS))
        # The imports themselves, not their ids: a repeat must find these very chunks (an id retired
        # and announced again is another chunk, of another size).
        views = _LayoutViews()
        kept[layout] = (descs, mapping, chunks, views)
        if len(kept) > limit:
            del kept[next(iter(kept))]
        return views

    def _repeat(self, msg: dict[str, Any]) -> tuple[list[ArrayDescriptor], bool | None, dict[int, Any], _LayoutViews]:
        """The descriptors of a ``repeat`` message: its layout's, validated when it was defined, with
        this message's ordering, event and meta on the first (the others take ``ordering`` from the
        Received); ``mapping`` None for one array's layout; and what the layout's tensors share."""
        found = self._layouts.get(msg["layout"]) or self._single_layouts.get(msg["layout"])
        if found is None:
            raise ProtocolError(f"repeat of unknown layout {msg['layout']}")
        descs, mapping, chunks, views = found
        for cid, chunk in chunks.items():
            if self._imports.get(cid) is not chunk:
                raise ProtocolError(f"repeat of layout {msg['layout']} names chunk {cid}, retired since")
            if msg["ordering"] == "event" and chunk.is_host:
                raise ProtocolError(f"ordering 'event' for host chunk {cid}")
        d = descs[0]
        if msg["meta"] is None and d.meta is None and (msg["ordering"], msg["event"]) == (d.ordering, d.event):
            # As defined (a ring of blocks sent again and again): the frozen descriptors are shared,
            # never a meta object (whose == would also equate 1, 1.0 and True).
            return descs, mapping, chunks, views
        first = dataclasses.replace(d, ordering=msg["ordering"], event=msg["event"], meta=msg["meta"])
        return [first, *descs[1:]], mapping, chunks, views

    def _import_chunk(self, msg: dict[str, Any], fds: list[int]) -> None:
        cid, size = msg["chunk"], msg["size"]
        if cid in self._imports:
            raise ProtocolError(f"chunk {cid} announced twice")
        if len(self._imports) >= MAX_CHUNKS:
            raise ProtocolError(f"the peer announced more than {MAX_CHUNKS} chunks")
        owned = [OwnedFd(fd) for fd in fds]
        fds.clear()
        try:
            if msg["mechanism"] == "memfd":
                if msg["device_uuid"]:
                    raise ProtocolError("a memfd chunk names a GPU")
                from ..mechanisms.memfd import import_memfd

                buf = import_memfd(owned[0], size)
            else:  # one part (a pool chunk) or pages mapped back to back (torch's expandable segments)
                from ..mechanisms.posix_fd import import_posix_fd_parts

                buf = import_posix_fd_parts(owned, msg["parts"], self._import_device(msg["device_uuid"]))
        except InvalidArgumentError as exc:  # not a memfd, unsealed, smaller than announced, ...
            raise ProtocolError(f"chunk {cid} rejected: {exc}") from exc
        finally:
            for fd in owned:
                fd.close()
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
        """The connection is over: complete every lease, unmap idle chunks, wake waiters, close the socket
        and the fds of messages read into the buffer and not handled. The caller holds ``_read_lock``."""
        with self._send_lock:
            self._memos.clear()
            with self._state:
                self._eof = True
                leases = list(self._leases.values())
                self._leases.clear()
                self._state.notify_all()
            self._flush_wake.set()  # the flusher sees the end and exits
            try:
                self._sock.close()
            except OSError:
                pass
        self._frames.discard()
        for lease in leases:
            lease._complete("closed" if self._closed else "disconnected")
        for chunk in list(self._imports.values()):
            chunk.retire()  # stays mapped while a Received still uses it
        self._imports.clear()

    # --- closing ------------------------------------------------------------------

    def close(self, timeout: float | None = 5.0) -> None:
        """Flush pending releases, say ``bye``, and end the connection (idempotent).

        Leases still out complete with reason ``"closed"``; arrays still held
        here stay readable until released; arrays that arrived and were not
        received are dropped. Opened IPC events are destroyed
        (``cuEventDestroy``). A send in progress in another thread (a peer
        that stopped reading) is waited for at most ``timeout`` seconds; then
        the connection is ended under it, and that send raises
        ``PeerClosedError``.
        """
        if self._closed:
            return
        # Another thread may be stuck sending to a peer that stopped reading: wait for it at most
        # ``timeout``, then end the connection under it (its send fails, and the peer sees the end).
        # (A negative one: none left; math.inf or one past what a lock takes: no limit.)
        if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) and timeout < 0:
            timeout = 0.0
        wait = check_timeout(timeout)
        deadline = deadline_after(wait)
        locked = self._send_lock.acquire(timeout=-1 if deadline is None else remaining(deadline))
        try:
            if locked:  # the releases and the bye wait for the peer within the same timeout
                self._flush(send_lock_held=True, timeout=remaining(deadline))
                try:
                    self._send_locked({"kind": "bye"}, timeout=remaining(deadline))
                except (DmaBufError, OSError):
                    pass  # the peer is gone, or not reading, or the connection broke: ended below all the same
            self._closed = True
            if not self._eof:
                shut_down(self._sock)  # wakes the reader (and a stuck sender); the reader closes the socket
        finally:
            if locked:
                self._send_lock.release()
        self._flush_wake.set()
        with self._state:
            self._state.notify_all()
            reader = self._reader
        if reader is None:
            # No background reader: end the connection here, once no recv() is reading.
            if self._read_lock.acquire(timeout=-1 if wait is None else wait):
                try:
                    if not self._eof:
                        self._end()
                finally:
                    self._read_lock.release()
        elif threading.current_thread() is not reader:
            # Its own wait: the sends above may have used up the first; after the shutdown it ends at once.
            reader.join(wait)
        with self._state:  # arrays never received: this end will not take them now
            dropped = list(self._queue)
            self._queue.clear()
        for entry in dropped:
            for chunk in entry[5].values():
                chunk.release()  # the queue's reference (_handle)
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
        """True once this end has closed the channel, or has seen the connection end. (A channel
        that has only received reads the socket in :meth:`recv`, so it sees the peer's end there.)"""
        return self._closed or self._eof

    def __enter__(self) -> "Channel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Channel peer pid={self.peer.pid} {'closed' if self.closed else 'open'}>"

