"""The two shapes every mechanism returns: `ExportedBuffer` and `ImportedBuffer`.

An export is never a bare fd: :class:`ExportedBuffer` carries the fd's owner,
the caller's pointer and its offset inside the exported range, the sizes in
bytes, the device (ordinal and UUID), the mechanism actually used and, when a
faster one was not, why. :meth:`ExportedBuffer.describe` is the JSON-safe
dict that travels next to the fd (:func:`~.fdpass.send_message`), and
importers take that dict back.

An import is a mapping an importer can touch: :class:`ImportedBuffer` has the
``CUdeviceptr`` (or host address for memfd), the size, and hands the memory to
other libraries through cuda.core's ``Buffer`` and DLPack
(``StridedMemoryView.__dlpack__``), so ``torch.from_dlpack`` and
``cupy.from_dlpack`` accept it.

Both own their resources: explicit :meth:`close`, context managers, and a
``weakref.finalize`` safety net. Cleanups run in order; :meth:`close`
raises the first failure after running all of them.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

from .errors import InvalidArgumentError
from .fd import OwnedFd

__all__ = ["Owner", "ExportedBuffer", "ImportedBuffer", "MECHANISM_NAMES"]

#: Names of the sharing mechanisms this library implements.
MECHANISM_NAMES = ("dmabuf", "posix-fd", "memfd")

Cleanup = Callable[[], None]


def _run_cleanups(cleanups: list[Cleanup], errors: list[BaseException] | None) -> None:
    while cleanups:
        fn = cleanups.pop()
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - collected and re-raised by close()
            if errors is not None:
                errors.append(exc)


class Owner:
    """Base for objects that own resources released by a stack of cleanups.

    Cleanups registered with :meth:`_push` run last-in first-out on
    :meth:`close` or, as a safety net, when the object is collected.
    """

    def __init__(self) -> None:
        self._cleanups: list[Cleanup] = []
        self._finalizer = weakref.finalize(self, _run_cleanups, self._cleanups, None)

    def _push(self, fn: Cleanup) -> None:
        self._cleanups.append(fn)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Release everything this object owns, in reverse order of acquisition.

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

    def __enter__(self) -> "Owner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ExportedBuffer(Owner):
    """Memory shared by an exporter, with the fd that names it.

    Attributes:
        mechanism: ``"dmabuf"``, ``"posix-fd"`` or ``"memfd"``.
        memory: what backs it: ``"host"`` (``cuMemAllocHost``), ``"device"``
            (``cuMemAlloc``), ``"vmm"`` (``cuMemCreate``), ``"range"`` (part of
            a caller's allocation) or ``"memfd"``.
        ptr: address of the caller's first byte (``CUdeviceptr``, or host address).
        size: the caller's bytes.
        offset: where ``ptr`` lies inside the exported range (bytes).
        export_size: bytes the fd covers (page or granularity aligned).
        device: CUDA ordinal of the memory's device (``-1`` for memfd).
        device_uuid: that device's UUID (``""`` for memfd).
        fallback: why a faster or preferred mechanism was not used, or ``None``.
    """

    def __init__(self, *, mechanism: str, memory: str, handle: OwnedFd, ptr: int, size: int, offset: int,
                 export_size: int, device: int, device_uuid: str = "", fallback: str | None = None) -> None:
        super().__init__()
        self.mechanism = mechanism
        self.memory = memory
        self.handle = handle
        self.ptr = ptr
        self.size = size
        self.offset = offset
        self.export_size = export_size
        self.device = device
        self.device_uuid = device_uuid
        self.fallback = fallback

    @property
    def fd(self) -> int:
        """The shareable fd (owned by :attr:`handle`; do not close it yourself)."""
        return self.handle.fd

    def describe(self) -> dict[str, Any]:
        """JSON-safe metadata an importer needs next to the fd."""
        return {
            "mechanism": self.mechanism,
            "memory": self.memory,
            "size": self.size,
            "offset": self.offset,
            "export_size": self.export_size,
            "device": self.device,
            "device_uuid": self.device_uuid,
            "fallback": self.fallback,
        }

    def send(self, sock: Any, stream: Any = None) -> None:
        """Make the producer's writes complete, then send the fd and :meth:`describe` to a peer.

        Synchronises first: ``stream.sync()`` when a ``cuda.core.Stream`` is
        given, else ``cuCtxSynchronize`` on :attr:`device` (nothing for memfd),
        so the consumer never reads stale bytes. Then
        :func:`~.fdpass.send_message` with ``SCM_RIGHTS``; this object keeps
        its fd and memory, so wait for the peer's ack before closing it.

        Raises:
            PeerClosedError: the peer has gone. CudaError: the synchronisation failed.
        """
        from . import driver
        from .fdpass import send_message

        if stream is not None:
            stream.sync()
        elif self.device >= 0:
            driver.set_current(self.device)
            driver.synchronize()
        send_message(sock, self.describe(), self.fd)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self.handle._fd}"
        return (f"<ExportedBuffer {self.mechanism}/{self.memory} {state} size={self.size} "
                f"offset={self.offset} device={self.device}>")


class ImportedBuffer(Owner):
    """An importer's mapping of shared memory.

    Attributes:
        mechanism: as in :class:`ExportedBuffer`.
        ptr: ``CUdeviceptr`` of the caller's first byte (host address for memfd).
        size: bytes usable from ``ptr``.
        device: the importing device's ordinal (``-1`` for memfd).
    """

    def __init__(self, *, mechanism: str, ptr: int, size: int, device: int) -> None:
        super().__init__()
        self.mechanism = mechanism
        self.ptr = ptr
        self.size = size
        self.device = device

    def as_buffer(self) -> Any:
        """A non-owning ``cuda.core.Buffer`` over the mapping; it keeps ``self`` alive."""
        if self.closed:
            raise ValueError("ImportedBuffer is closed")
        if self.device < 0:
            raise InvalidArgumentError("host shared memory (memfd) is not CUDA memory: use as_array() "
                                       "for a NumPy view")
        from cuda.core import Buffer

        return Buffer.from_handle(self.ptr, self.size, owner=self)

    def as_array(self, dtype: Any = "uint8", shape: Sequence[int] | None = None) -> Any:
        """A typed, C-contiguous view that ``torch.from_dlpack`` and ``cupy.from_dlpack`` take.

        Args:
            dtype: a NumPy dtype (``"int32"``, ``numpy.float32``...).
            shape: element counts; default: as many elements as fit in :attr:`size`.

        Returns:
            a ``cuda.core.utils.StridedMemoryView`` (DLPack producer) over the
            mapping; for memfd (host memory), a NumPy array over it (also a
            DLPack producer, on the CPU).

        Raises:
            InvalidArgumentError: the shape needs more than :attr:`size` bytes.
        """
        import numpy as np

        dt = np.dtype(dtype)
        if shape is None:
            shape = (self.size // dt.itemsize,)
        shape = tuple(int(s) for s in shape)
        need = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if need > self.size or any(s < 0 for s in shape):
            raise InvalidArgumentError(f"shape {shape} of {dt} needs {need} bytes; the mapping has {self.size}")
        if self.device < 0:
            from .memfd import host_array

            return host_array(self, dt)[: need // dt.itemsize].reshape(shape)
        from cuda.core.utils import StridedMemoryView

        return StridedMemoryView.from_buffer(self.as_buffer(), shape, dtype=dt)

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"ptr=0x{self.ptr:x}"
        return f"<ImportedBuffer {self.mechanism} {state} size={self.size} device={self.device}>"
