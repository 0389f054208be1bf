"""Array views over shared memory, the wire dtype mapping, and the one normaliser of a device argument.

:class:`HostView` hands host bytes to NumPy (``__array_interface__``),
:class:`DeviceView` hands device bytes to DLPack consumers; both keep the
memory's owners alive for as long as any view lives. :func:`device_index` is
how every public call reads a ``device`` argument.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import InvalidArgumentError

__all__ = ["HOST", "ChunkRef", "HostView", "DeviceView", "numpy_dtype", "device_dtype", "c_strides", "device_index"]

#: The device index of host memory, as :attr:`Received.device <.received.Received.device>` reports it.
HOST = -1


def device_index(device: Any, *, default: str = "host") -> int | None:
    """The one reading of a ``device`` argument: a CUDA ordinal, or what ``None`` means for the caller.

    ``"host"`` is host memory. ``None`` means ``default``: ``"host"`` (a :class:`~.pool.SharedPool`)
    or ``"own"`` (where a received chunk is mapped: the GPU that holds it, found by its UUID among
    the GPUs this process sees, :func:`~.protocol.visible_gpu_uuids`). A bool is not an ordinal.

    Returns:
        the ordinal (>= 0), or ``None`` for host memory (``default="host"``) or the chunk's own GPU
        (``default="own"``).

    Raises:
        InvalidArgumentError: anything else (a negative ordinal, a bool, a float, another string).
    """
    if device is None or (isinstance(device, str) and device == "host" and default == "host"):
        return None
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    accepted = "None, 'host' or a CUDA ordinal" if default == "host" else "None (the chunk's own GPU) or a CUDA ordinal"
    raise InvalidArgumentError(f"device must be {accepted}, got {device!r}")


class HostView:
    """A NumPy-consumable object (``__array_interface__``) over host bytes that keeps their owners alive.

    ``np.asarray(view)`` and every view of that array hold this object as their
    ``base``, so the owners in ``keep`` (a mapping's memoryview, a Block's
    holder, a Received) live exactly as long as some array uses the bytes.
    """

    def __init__(self, ptr: int, shape: Sequence[int], strides: Sequence[int], typestr: str, keep: tuple) -> None:
        self.__array_interface__ = {"version": 3, "data": (ptr, False), "shape": tuple(shape),
                                    "strides": tuple(strides), "typestr": typestr}
        self.keep = keep


class DeviceView:
    """A device array over mapped memory, zero-copy: its address, shape, strides and dtype, and a
    DLPack producer (``torch.from_dlpack``, ``cupy.from_dlpack``). It keeps the owners in ``keep``
    alive (for a :class:`~.channel.Received`: the Received, so its lease, and the chunk's mapping),
    and so does anything made from it. Its contents are valid until the Received is released.

    cuda.core's ``Buffer`` and ``StridedMemoryView`` behind the DLPack export are built on first use
    (:meth:`memory_view`), not here: in a process that has just woken up they cost tens of µs, and
    a consumer that only needs :attr:`ptr` (a kernel argument) never pays for them. Making the view
    calls no driver function. It has no ``__cuda_array_interface__``: that names no device, and a
    consumer would ask the driver, which answers with the GPU that holds the memory, not the one
    the mapping is accessible from.

    Attributes:
        ptr: ``CUdeviceptr`` of the first element: a 256-byte aligned block plus the array's byte
            offset, so aligned to the itemsize.
        shape: elements per dimension.
        strides: strides in elements, as ``StridedMemoryView.strides`` (not bytes).
        dtype: the ``numpy.dtype`` of the elements (bfloat16, which NumPy lacks, as uint16).
        device_id: the CUDA ordinal the mapping is accessible from (``__dlpack_device__``).
        is_device_accessible: True. readonly: False.
    """

    __slots__ = ("ptr", "shape", "strides", "dtype", "device_id", "_nbytes", "_keep", "_view", "_wire_dtype")

    is_device_accessible = True
    readonly = False

    def __init__(self, ptr: int, shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any, device: int,
                 nbytes: int, keep: tuple, wire_dtype: str) -> None:
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.dtype = dtype
        self.device_id = device
        self._nbytes = nbytes  # from ptr to one past the last byte the layout touches (>= 1)
        self._keep = keep
        self._view: Any = None
        self._wire_dtype = wire_dtype  # the sender's dtype name (bfloat16 stays bfloat16 when sent on)

    def memory_view(self) -> Any:
        """The ``cuda.core.utils.StridedMemoryView`` of this array, made once; it keeps the same owners.

        Makes the primary context of :attr:`device_id` current (``cuCtxGetCurrent``, and on a thread's
        first use ``cuDevicePrimaryCtxRetain`` + ``cuCtxSetCurrent``) for its default stream.

        Raises:
            CudaError: no context could be made current on :attr:`device_id`.
            NoDriverError: no CUDA driver in this process.
            ForkedAfterInitError: this process was forked after CUDA was initialised.
        """
        view = self._view
        if view is None:
            from cuda.core.utils import StridedMemoryView

            from ..buffers import mapped_buffer

            # Its owner is the keep tuple, not this object: no reference cycle to delay a release.
            buf = mapped_buffer(self.ptr, self._nbytes, self.device_id, self._keep)
            view = self._view = StridedMemoryView.from_buffer(buf, self.shape, self.strides, dtype=self.dtype)
        return view

    def __dlpack__(self, **kwargs: Any) -> Any:
        """A DLPack capsule (``StridedMemoryView.__dlpack__``, given the caller's keyword arguments:
        ``stream``, ``max_version``, ``dl_device``, ``copy``). Raises what it raises: ``BufferError``,
        ``CudaError``, and those of :meth:`memory_view`."""
        return self.memory_view().__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(kDLCUDA, device_id)``: DLPack's device type 2 and the GPU the mapping is accessible from."""
        return (2, self.device_id)

    def __repr__(self) -> str:
        return f"<DeviceView {self.dtype}{list(self.shape)} at {self.ptr:#x} on GPU {self.device_id}>"


def numpy_dtype(name: str) -> Any:
    """The NumPy dtype for a wire dtype name; ``bfloat16`` needs ``ml_dtypes``.

    Raises:
        InvalidArgumentError: bfloat16 without ``ml_dtypes`` (use ``as_tensor`` instead).
    """
    import numpy as np

    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as exc:
            raise InvalidArgumentError("NumPy has no bfloat16: install ml_dtypes, or use as_tensor()") from exc
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


#: wire dtype name -> the NumPy dtype of a device view (bfloat16, which NumPy lacks, read as uint16).
_DEVICE_DTYPES: dict[str, Any] = {}


def device_dtype(name: str) -> Any:
    """The NumPy dtype a :class:`DeviceView` of wire dtype ``name`` reports (bfloat16 as uint16)."""
    dt = _DEVICE_DTYPES.get(name)
    if dt is None:
        import numpy as np

        dt = _DEVICE_DTYPES[name] = np.dtype("uint16" if name == "bfloat16" else name)
    return dt


class ChunkRef:
    """One reference on an imported chunk, held by a view (a NumPy array, a DLPack buffer) for as long as
    the view lives: the mapping outlives an early ``release()`` or the end of the connection, so a view
    read after them shows stale bytes instead of unmapped memory."""

    __slots__ = ("chunk",)

    def __init__(self, chunk: Any) -> None:
        chunk.retain()
        self.chunk = chunk

    def __del__(self) -> None:
        self.chunk.release()
