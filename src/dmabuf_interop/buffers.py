"""The shapes every mechanism returns, and how they are built.

* :class:`Transaction` - multi-step construction: push each undo right after
  its resource is acquired, then :meth:`~Transaction.commit` hands the undo
  stack to the finished object; on failure the undos run in reverse and the
  original error is re-raised (cuda.core's ``Transaction`` is the model).
* :class:`Owner` - an object that owns resources released by a stack of
  cleanups: explicit :meth:`~Owner.close`, a context manager, and a
  ``weakref.finalize`` safety net.
* :class:`ExportedBuffer` - memory shared by an exporter, with the fd that
  names it and the :class:`~.descriptor.ShareDescriptor` that travels beside it.
* :class:`ImportedBuffer` - an importer's mapping, handed to other libraries
  through cuda.core's ``Buffer`` and DLPack (``torch.from_dlpack``,
  ``cupy.from_dlpack``).

Host (memfd) buffers subclass these in :mod:`.mechanisms.memfd` and own their
mapping.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Sequence

from ._checks import as_int
from .descriptor import ShareDescriptor
from .errors import InvalidArgumentError
from .fd import OwnedFd

__all__ = ["Transaction", "Owner", "ExportedBuffer", "ImportedBuffer", "array_shape", "mapped_buffer"]

Cleanup = Callable[[], None]


def _run_cleanups(cleanups: list[Cleanup], errors: list[BaseException] | None) -> None:
    while cleanups:
        fn = cleanups.pop()
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - collected and re-raised by close()
            if errors is not None:
                errors.append(exc)


class Transaction:
    """Undo steps for a construction of several steps.

    ::

        with Transaction() as tx:
            handle = driver.vmm_create(device, size)
            tx.push(driver.vmm_release, handle)
            ...
            return ExportedBuffer(..., cleanups=tx.commit())

    Leaving the block by an exception runs every pushed undo in reverse order
    (their own errors are dropped: the original error matters more) and lets
    the exception propagate. After :meth:`commit` the block undoes nothing.
    """

    def __init__(self) -> None:
        self._undo: list[Cleanup] = []

    def push(self, fn: Callable[..., Any], *args: Any) -> None:
        """Register ``fn(*args)`` to undo the step just taken."""
        self._undo.append(functools.partial(fn, *args) if args else fn)

    def commit(self) -> list[Cleanup]:
        """The undo stack, for the object that now owns the resources; the transaction is left empty."""
        undo, self._undo = self._undo, []
        return undo

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._undo:  # an exception, or a construction that never committed
            _run_cleanups(self._undo, None)


class Owner:
    """Base for objects that own resources released by a stack of cleanups.

    Cleanups run last-in first-out on :meth:`close` or, as a safety net, when
    the object is collected. Any use after :meth:`close` raises
    :class:`~.errors.InvalidArgumentError`.
    """

    def __init__(self, cleanups: Sequence[Cleanup] = ()) -> None:
        self._cleanups: list[Cleanup] = list(cleanups)
        self._finalizer = weakref.finalize(self, _run_cleanups, self._cleanups, None)

    def _push(self, fn: Cleanup) -> None:
        self._cleanups.append(fn)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or the safety net did)."""
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise InvalidArgumentError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Release everything this object owns, in reverse order of acquisition. Idempotent.

        Raises:
            CudaError: a driver call in the cleanup failed (all cleanups still ran).
        """
        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        errors: list[BaseException] = []
        _run_cleanups(self._cleanups, errors)
        if errors:
            raise errors[0]

    def __enter__(self) -> Any:
        self._check_open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def array_shape(nbytes: int, dtype: Any, shape: Sequence[int] | None) -> tuple[Any, tuple[int, ...], int]:
    """``(numpy dtype, shape, bytes needed)`` of a C-contiguous view over ``nbytes`` bytes.

    Raises:
        InvalidArgumentError: not a NumPy dtype, one of Python objects or of no bytes (``"S0"``); a shape
            that is not an int or a sequence of them, a negative extent, or a shape needing more than ``nbytes``.
    """
    import numpy as np

    try:
        dt = np.dtype(dtype)
    except TypeError:  # NumPy's "data type 'float33' not understood"
        raise InvalidArgumentError(f"dtype {dtype!r} is not a NumPy dtype") from None
    if dt.hasobject or dt.itemsize == 0:  # no view over raw memory: Python objects, or nothing per element
        raise InvalidArgumentError(f"dtype {dt} cannot view raw memory (it holds Python objects or no bytes)")
    if shape is None:
        shape = (nbytes // dt.itemsize,)
    elif isinstance(shape, (int, np.integer)):  # one dimension
        shape = (shape,)
    dims = tuple(as_int(s, "shape extent") for s in shape)
    if any(s < 0 for s in dims):
        raise InvalidArgumentError(f"shape {dims} has a negative extent")
    need = dt.itemsize
    for s in dims:
        need *= s
    if need > nbytes:
        raise InvalidArgumentError(f"shape {dims} of {dt} needs {need} bytes; the buffer has {nbytes}")
    return dt, dims, need


_MAPPED_RESOURCE: Any = None


def _mapped_resource_class() -> Any:
    """A ``cuda.core.MemoryResource`` that owns nothing: it names the device a mapping is
    accessible from and keeps the mapping's owner alive; ``deallocate`` does nothing."""
    global _MAPPED_RESOURCE
    if _MAPPED_RESOURCE is None:
        from cuda.core import MemoryResource

        class MappedResource(MemoryResource):
            def __init__(self, device: int, owner: Any) -> None:
                self._device = device
                self._owner = owner

            def allocate(self, size: int, *, stream: Any = None) -> Any:
                raise InvalidArgumentError("a mapping of shared memory allocates nothing")

            def deallocate(self, ptr: Any, size: int, *, stream: Any = None) -> None:
                pass  # the owner unmaps when it is closed

            @property
            def is_device_accessible(self) -> bool:
                return True

            @property
            def is_host_accessible(self) -> bool:
                return False

            @property
            def is_managed(self) -> bool:
                return False

            @property
            def device_id(self) -> int:
                return self._device

        _MAPPED_RESOURCE = MappedResource
    return _MAPPED_RESOURCE


def mapped_buffer(ptr: int, size: int, device: int, owner: Any) -> Any:
    """A non-owning ``cuda.core.Buffer`` over ``size`` bytes mapped at ``ptr``, reported (DLPack
    ``__dlpack_device__``) on ``device``, the GPU the mapping is accessible from; it keeps ``owner`` alive.

    ``Buffer.from_handle(ptr, size, owner=...)`` would ask the driver for the pointer's
    device, which for a VMM mapping is the GPU that holds the memory, not the importer's:
    torch and CuPy would then use a GPU the mapping grants no access to.

    Raises:
        CudaError: no context could be made current on ``device``.
    """
    from cuda.core import Buffer

    from . import _driver

    stream = _driver.set_current(device).default_stream
    return Buffer.from_handle(ptr, size, mr=_mapped_resource_class()(device, owner), stream=stream)


class ExportedBuffer(Owner):
    """Memory shared by an exporter, with the fd that names it.

    Attributes:
        mechanism: ``"dmabuf"``, ``"posix-fd"`` or ``"memfd"``.
        memory: what backs it (see :class:`~.kinds.MemoryKind`).
        handle: the :class:`~.fd.OwnedFd` (a :class:`~.linux_dmabuf.DmaBuf` for dma-buf).
        ptr: address of the caller's first byte (``CUdeviceptr``, or host address).
        size: the caller's bytes.
        offset: where ``ptr`` lies inside the exported range (bytes).
        export_size: bytes the fd covers (page or granularity aligned).
        device: CUDA ordinal of the memory's device (``-1`` for memfd).
        device_uuid: that device's UUID (``""`` for memfd).
        fallback: why a faster or preferred mechanism was not used, or ``None``.
    """

    def __init__(self, *, mechanism: str, memory: str, handle: OwnedFd, ptr: int, size: int, offset: int,
                 export_size: int, device: int, device_uuid: str = "", fallback: str | None = None,
                 cleanups: Sequence[Cleanup] = ()) -> None:
        super().__init__(cleanups)
        self.mechanism = mechanism
        self.memory = memory
        self.handle = handle
        self._ptr = ptr
        self.size = size
        self.offset = offset
        self.export_size = export_size
        self.device = device
        self.device_uuid = device_uuid
        self.fallback = fallback

    @property
    def ptr(self) -> int:
        """Address of the caller's first byte. Raises InvalidArgumentError once closed."""
        self._check_open()
        return self._ptr

    @property
    def fd(self) -> int:
        """The shareable fd (owned by :attr:`handle`; do not close it yourself)."""
        self._check_open()
        return self.handle.fd

    def describe(self) -> ShareDescriptor:
        """The :class:`~.descriptor.ShareDescriptor` an importer needs next to the fd.

        ``describe().to_json()`` has the keys ``mechanism``, ``memory``,
        ``size``, ``offset``, ``export_size`` (bytes), ``exporter_device``
        (this process's ordinal), ``device_uuid`` and ``fallback``.
        """
        return ShareDescriptor(mechanism=self.mechanism, memory=self.memory, size=self.size, offset=self.offset,
                               export_size=self.export_size, exporter_device=self.device,
                               device_uuid=self.device_uuid, fallback=self.fallback)

    def send(self, sock: Any, stream: Any = None, timeout: float | None = None) -> None:
        """Make the producer's writes complete, then send the fd and :meth:`describe` to a peer.

        Synchronises first: ``stream.sync()`` when a ``cuda.core.Stream`` is
        given, else ``cuCtxSynchronize`` on :attr:`device` (nothing for memfd),
        so the consumer never reads stale bytes. Then
        :func:`~.fdpass.send_message` with ``SCM_RIGHTS``; this object keeps
        its fd and memory, so wait for the peer's ack before closing it.

        Raises:
            PeerClosedError: the peer has gone.
            WaitTimeoutError: the socket stayed full past ``timeout``.
            CudaError: the synchronisation failed.
        """
        from . import _driver as driver
        from .fdpass import send_message

        fd = self.fd
        if stream is not None:
            stream.sync()
        elif self.device >= 0:
            driver.set_current(self.device)
            driver.synchronize()
        send_message(sock, self.describe().to_json(), fd, timeout=timeout)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self.handle._fd}"
        return (f"<{type(self).__name__} {self.mechanism}/{self.memory} {state} size={self.size} "
                f"offset={self.offset} device={self.device}>")


class ImportedBuffer(Owner):
    """An importer's mapping of shared memory.

    Attributes:
        mechanism: as in :class:`ExportedBuffer`.
        ptr: ``CUdeviceptr`` of the caller's first byte (host address for memfd).
        size: bytes usable from ``ptr``.
        device: the importing device's ordinal (``-1`` for memfd).
    """

    def __init__(self, *, mechanism: str, ptr: int, size: int, device: int,
                 cleanups: Sequence[Cleanup] = ()) -> None:
        super().__init__(cleanups)
        self.mechanism = mechanism
        self._ptr = ptr
        self.size = size
        self.device = device

    @property
    def ptr(self) -> int:
        """Address of the caller's first byte. Raises InvalidArgumentError once closed."""
        self._check_open()
        return self._ptr

    def as_buffer(self) -> Any:
        """A non-owning ``cuda.core.Buffer`` over the mapping; it keeps ``self`` alive.

        Raises:
            InvalidArgumentError: the buffer is closed.
        """
        return mapped_buffer(self.ptr, self.size, self.device, self)

    def as_array(self, dtype: Any = "uint8", shape: Sequence[int] | None = None) -> Any:
        """A typed, C-contiguous view that ``torch.from_dlpack`` and ``cupy.from_dlpack`` take.

        Args:
            dtype: a NumPy dtype (``"int32"``, ``numpy.float32``...).
            shape: element counts (an int for one dimension); default: as many elements as fit in
                :attr:`size`.

        Returns:
            a ``cuda.core.utils.StridedMemoryView`` (DLPack producer) over the mapping.

        Raises:
            InvalidArgumentError: the buffer is closed, a dtype that is not NumPy's or cannot view raw
                memory (``object``, ``"S0"``), a negative extent, or the shape needs more than :attr:`size` bytes.
        """
        from cuda.core.utils import StridedMemoryView

        self._check_open()
        dt, dims, _need = array_shape(self.size, dtype, shape)
        return StridedMemoryView.from_buffer(self.as_buffer(), dims, dtype=dt)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"ptr=0x{self._ptr:x}"
        return f"<{type(self).__name__} {self.mechanism} {state} size={self.size} device={self.device}>"
