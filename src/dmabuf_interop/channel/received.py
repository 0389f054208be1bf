"""What arrives: :class:`Received` (one array held until released), the :class:`Hold` of one message
(the peer's lease and the chunks its items lie in), :func:`release_all` and :func:`as_tensors`."""

from __future__ import annotations

import itertools
import operator
import sys
import threading
from typing import Any, Iterable, Mapping, Sequence

from .. import _driver as driver  # (at module level: an import in a function costs a send ~1.5 us)
from ..errors import InvalidArgumentError, NotSupportedError
from ._torch_views import BatchViews
from .arrays import (_DEVICE_DTYPES, STORAGE, ChunkRef, DeviceView, HostView, device_dtype, numpy_dtype, storage_dtype,
                     torch_dtype)
from .protocol import DTYPES, ArrayDescriptor

__all__ = ["Received", "Hold", "release_all", "as_tensors"]

_NAME = operator.attrgetter("name")
_DONE = operator.attrgetter("_done")
_HOLD = operator.attrgetter("_hold")
_BATCH = operator.attrgetter("_batch")
#: itemsize -> the signed int torch imports a dtype NumPy lacks as, before viewing it as torch's dtype.
_SIGNED = {1: "int8", 2: "int16", 4: "int32"}


try:
    from .._atomic import span as _span  # a buffer that holds a host array's owners (below, in as_array)
except ImportError:  # not built (no C compiler at install): numpy.asarray of a HostView instead
    _span = None

#: ``numpy.asarray`` and ``numpy.ndarray``, bound on first use (``import numpy`` in a function costs each call; at
#: module level, the package's import a tenth of a second).
_asarray: Any = None
_ndarray: Any = None


def _load_asarray() -> Any:
    global _asarray, _ndarray
    import numpy

    _asarray, _ndarray = numpy.asarray, numpy.ndarray
    return _asarray


#: Guards every Hold's count of items left: held for a few lines, and one lock per message would cost a receive
#: its allocation (1-2 us in a process idle between messages).
_COUNTS = threading.Lock()


def _NOBODY() -> None:
    """A dead channel reference: a hold that owes the peer no release."""
    return None


def _finalize_hold(channel_ref: Any, lease_id: int, chunks: list[Any], inline: bool = False) -> None:
    ch = channel_ref()
    if ch is not None:
        ch._release_lease(lease_id, inline=inline)
    for chunk in chunks:
        chunk.release()


class Hold:
    """What the items of one array message hold together: the peer's lease, released once every
    item is released (or, as a safety net, when the last of them is collected: ``__del__``), and
    one reference on each chunk they lie in. One per message, so a batch of thousands pays one
    safety net; ``__del__`` rather than ``weakref.finalize``, which costs a registration per message."""

    __slots__ = ("left", "alive", "channel", "chunks", "lease_id", "stream", "ordering", "__weakref__")

    def __init__(self, channel: Any, lease_id: int, chunks: list[Any], items: int,
                 stream: int = 0, ordering: str | None = None, *, owes: bool = True, adopt: bool = False) -> None:
        self.alive = False  # until the chunk references are taken: __del__ gives back nothing before
        self.lease_id = lease_id
        self.stream = stream  # the stream given to recv: made to wait on the event; synchronised by release
        self.ordering = ordering  # a repeated layout's: its descriptors keep their first ordering
        self.left = items
        # The channel's own weakref object: one the hold made would be cleared before __del__ runs
        # when the hold dies in a reference cycle, and the release would be lost.
        # ``owes``: the peer's lease is released when the items are (not so for items read into local
        # blocks over tcp://, whose lease was released right after the READ).
        self.channel = channel._weak if owes else _NOBODY
        self.chunks = chunks
        # ``adopt``: the caller hands over a reference it holds on each chunk (the queue's: no retain here
        # and release there, two holds of a chunk's lock per message saved); else each is retained.
        if not adopt:
            for chunk in chunks:
                chunk.retain()
        self.alive = True

    def release(self, items: "Iterable[Received]") -> None:
        with _COUNTS:
            for r in items:
                if not r._done:
                    r._done = True
                    self.left -= 1
            last = self.left <= 0 and self.alive
            if last:
                self.alive = False
        if last:  # released by the caller: the release may go out in its thread
            _finalize_hold(self.channel, self.lease_id, self.chunks, inline=True)

    def abandon(self) -> None:
        """Give the peer's lease back now, items unreleased or not, as the safety net does (no stream
        synchronisation; the flusher thread sends the release, nothing blocks here): for an owner that
        is collected while views of the items outlive it. As ``__del__``: collected with items unreleased
        (possibly inside the garbage collector)."""
        try:
            alive = self.alive
        except AttributeError:  # __init__ cut short before its first line (a KeyboardInterrupt): nothing was taken
            return
        if alive:
            self.alive = False
            if sys.is_finalizing():
                # Interpreter exit (a Received held by an uncaught exception's traceback, say): the channel's
                # rings were unmapped by their finalizer at exit, and the kernel closes the socket, which
                # completes the peer's leases; a release now would write to released memory.
                return
            _finalize_hold(self.channel, self.lease_id, self.chunks)

    __del__ = abandon



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

    def __init__(self, hold: Hold, desc: ArrayDescriptor, chunk: Any) -> None:
        self.descriptor = desc
        self._chunk = chunk
        self._batch: BatchViews | None = None
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
            host: a NumPy array over the shared pages, of the sender's dtype, writable unless the peer sealed its
            chunk against writing (then mapped read-only: a write raises ``ValueError``) (the dtypes NumPy
            lacks, bfloat16, the float8 kinds and complex32, are ``ml_dtypes``' and need it);
            device: a :class:`.pool.DeviceView`: ``ptr``, ``shape``, ``strides`` (elements),
            ``dtype`` (a dtype NumPy lacks as the unsigned int of its size: bfloat16 as uint16, float8 as
            uint8), a DLPack producer; ``memory_view()`` gives cuda.core's
            ``StridedMemoryView``. Making it calls no driver function. Either keeps this Received
            alive while it lives; its contents are valid until :meth:`release`.

        Raises:
            InvalidArgumentError: already released; on the host, a dtype NumPy lacks without ``ml_dtypes``
                (the message names it), or one no NumPy dtype holds (``float4_e2m1fn_x2``: use :meth:`as_tensor`).
        """
        if self._done or not self._hold.alive:
            self._check()  # raises
        d = self.descriptor
        chunk = self._chunk
        if chunk.device < 0:
            typestr, dt, storage = _HOST_DTYPES.get(d.dtype) or _host_dtype(d.dtype)
            # (_host_view, inline: a consumer woken for the array pays about a microsecond a call)
            ptr = chunk.ptr + d.block_offset + d.byte_offset
            if _span is not None:
                # Load-bearing: an ndarray over a span that holds the owners is the same array as numpy.asarray of a
                # HostView (its base holds them), made in a fifth of the time (why: _atomic.c's header); the span
                # holds the chunk's reference itself (as an arrays.ChunkRef would: taken here, its release() called
                # once as the span goes), one object and one Python frame fewer a call.
                if _ndarray is None:
                    _load_asarray()
                chunk.retain()
                arr = _ndarray(d.shape, storage, _span(ptr, d.span, (self, chunk.mapping), chunk.read_only, chunk), 0,
                               d.strides)
            else:
                keep = (self, ChunkRef(chunk), chunk.mapping)
                arr = (_asarray or _load_asarray())(HostView(ptr, d.shape, d.strides, typestr, keep, chunk.read_only))
            # (ml_dtypes: the typestr would say only 'V2'; the storage int's view gets the dtype)
            return arr if dt is None else arr.view(dt)
        # (_device_view, inline: a consumer woken for the array pays about a microsecond a call)
        dt = _DEVICE_DTYPES.get(d.dtype) or device_dtype(d.dtype)
        return DeviceView(chunk.buf.ptr + d.block_offset + d.byte_offset, d.shape, d.elements[1], dt, chunk.device,
                          d.span, (self, ChunkRef(chunk)), d.dtype)

    def _host_view(self, typestr: str) -> Any:
        d = self.descriptor
        keep = (self, ChunkRef(self._chunk), self._chunk.mapping)
        return (_asarray or _load_asarray())(HostView(self._ptr, d.shape, d.strides, typestr, keep,
                                                      self._chunk.read_only))

    def _device_view(self, dt: Any) -> DeviceView:
        d = self.descriptor
        return DeviceView(self._ptr, d.shape, d.elements[1], dt, self.device, d.span, (self, ChunkRef(self._chunk)),
                          d.dtype)

    def as_tensor(self) -> Any:
        """A ``torch.Tensor`` over the block (``torch.from_dlpack`` / ``torch.from_numpy``; torch imported here).

        Every dtype arrives as torch's (the ones NumPy lacks, bfloat16, the float8 kinds, complex32,
        float4_e2m1fn_x2, read as an int of their size and re-viewed; ml_dtypes is not needed). For the items of a
        device ``recv_many`` batch, each chunk is imported into torch once (``torch.from_dlpack``)
        and every item's tensor is a ``torch.as_strided`` view of it: while any such tensor lives,
        every item of the batch whose tensor was taken stays held (its safety-net release waits).

        Raises:
            InvalidArgumentError: already released; a dtype this torch lacks (``float8_e3m4``,
                ``float8_e4m3``, ``float8_e4m3b11fnuz``: ml_dtypes' alone; use :meth:`as_array`).
            NotSupportedError: torch is not installed.
        """
        self._check()
        torch = _require("torch")
        d = self.descriptor
        if self._batch is not None and self.device >= 0:
            return self._batch.tensor(self, torch, torch_dtype(torch, d.dtype))
        if d.dtype in STORAGE:  # a dtype NumPy lacks: imported as an int of its size, then viewed as torch's
            dt = torch_dtype(torch, d.dtype)
            signed = storage_dtype(_SIGNED[DTYPES[d.dtype]])  # (torch reads every signed int from NumPy and DLPack)
            if self.device < 0:
                return torch.from_numpy(self._host_view(signed.str)).view(dt)
            return torch.from_dlpack(self._device_view(signed).memory_view()).view(dt)
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
        :data:`~dmabuf_interop.channel.channel.RELEASE_DELAY`.

        For device memory the stream given to ``recv`` is synchronised first
        (``cuStreamSynchronize``), so work queued on it that reads the block is done;
        ``synchronize=False`` skips that, for a caller that has synchronised already
        (:func:`release_all` does it once for many).
        """
        hold = self._hold
        if self._done or not hold.alive:  # (released: the property's test, without the property's call)
            return
        device = self._chunk.device
        if synchronize and device >= 0 and hold.stream is not None:
            driver.set_current(device)
            driver.stream_synchronize(hold.stream)
        hold.release((self,))

    def __enter__(self) -> "Received":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Received {self.dtype}{list(self.shape)} lease={self.lease_id} {state}>"



#: Wire dtype -> (the typestr a host view is made with, the NumPy dtype it is then viewed as for a dtype
#: NumPy lacks, else None, the NumPy dtype of that typestr): ``numpy.dtype(name)`` and the STORAGE lookups cost
#: 0.4 us an ``as_array`` (measured, 2-core CI machine).
_HOST_DTYPES: dict[str, tuple[str, Any, Any]] = {}


def _host_dtype(name: str) -> tuple[str, Any, Any]:
    """:data:`_HOST_DTYPES`'s entry for ``name``, made and kept: ``(typestr, dt, storage)``, the typestr and the NumPy
    dtype (``storage``) a host view is made of, and the dtype it is then viewed as (``dt``; ``None``: none), raising
    as :func:`.arrays.numpy_dtype`."""
    dt = numpy_dtype(name)
    stored = storage_dtype(name) if name in STORAGE else dt
    entry = _HOST_DTYPES[name] = (stored.str, dt if name in STORAGE else None, stored)
    return entry


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
        InvalidArgumentError: not a mapping or an iterable, or an item is not a Received.
    """
    if isinstance(items, Mapping):
        items = list(items.values())
    else:
        try:
            items = list(items)
        except TypeError:  # None, a single Received: nothing to iterate
            raise InvalidArgumentError(f"release_all takes a batch (a dict or an iterable of Received), "
                                       f"got {type(items).__name__}") from None
    if items and set(map(type, items)) != {Received}:
        bad = next((r for r in items if not isinstance(r, Received)), None)
        if bad is not None:  # (a subclass passes)
            raise InvalidArgumentError(f"release_all takes Received objects, got {type(bad).__name__}")
    # Items of one message share its hold (its stream; its chunks lie on one device) and come in runs:
    # the checks below are per run, not per item (a state dict of thousands, every step).
    runs = [(hold, list(members)) for hold, members in itertools.groupby(items, key=_HOLD)]
    synced: set[tuple[int, int]] = set()
    for hold, members in runs:
        if hold.stream is None or not hold.alive or all(map(_DONE, members)):
            continue
        for device in {r._chunk.device for r in members}:
            if device >= 0 and (device, hold.stream) not in synced:
                driver.set_current(device)
                driver.stream_synchronize(hold.stream)
                synced.add((device, hold.stream))
    for hold, members in runs:
        hold.release(members)


def as_tensors(items: Mapping[str, Received] | Sequence[Received]) -> dict[str, Any] | list[Any]:
    """torch tensors for many :class:`Received` (a ``recv_many`` batch: its dict, or its list), in the
    same form: what :meth:`Received.as_tensor` gives for each, and with the same lifetime rules, but
    with the per-batch work done once (a state dict of thousands of tensors, every step). A device
    batch: one ``torch.from_dlpack`` per chunk and dtype, then one ``Tensor.as_strided`` per item, or,
    outside grad mode (``torch.no_grad()``, ``torch.inference_mode()``, as engines load weights) and
    from the second batch of a layout on (a state dict sent every step), one per run of at least
    :data:`._torch_views.STACK_MIN` items of the same chunk, dtype, shape and strides whose offsets step evenly
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
