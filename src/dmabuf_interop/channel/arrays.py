"""Array views over shared memory, the wire dtype mapping, and the one normaliser of a device argument.

:class:`HostView` hands host bytes to NumPy (``__array_interface__``),
:class:`DeviceView` hands device bytes to DLPack consumers; both keep the
memory's owners alive for as long as any view lives. :func:`device_index` is
how every public call reads a ``device`` argument.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import InvalidArgumentError
from .protocol import DTYPES

__all__ = ["HOST", "STORAGE", "ML_DTYPES", "ChunkRef", "HostView", "DeviceView", "numpy_dtype", "storage_dtype",
           "wire_dtype", "torch_dtype", "shown_dtype", "device_dtype", "c_strides", "device_index"]

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

    def __init__(self, ptr: int, shape: Sequence[int], strides: Sequence[int], typestr: str, keep: tuple,
                 readonly: bool = False) -> None:
        # (a descriptor's shape and strides are tuples already: no copies on a receiver's hot path)
        self.__array_interface__ = {"version": 3, "data": (ptr, readonly),
                                    "shape": shape if type(shape) is tuple else tuple(shape),
                                    "strides": strides if type(strides) is tuple else tuple(strides),
                                    "typestr": typestr}
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
        dtype: the ``numpy.dtype`` of the elements; a dtype NumPy lacks as the unsigned int of its size
            (bfloat16 as uint16, the float8 kinds as uint8, complex32 as uint32): ``as_tensor()`` gives torch's.
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


#: Wire dtypes NumPy lacks -> the unsigned int of their size whose bytes stand in for them where no
#: library names the dtype (a :class:`DeviceView`, the copies into a pool, ``pool.empty`` on a device).
STORAGE: dict[str, str] = {name: {1: "uint8", 2: "uint16", 4: "uint32"}[DTYPES[name]] for name in (
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float4_e2m1fn_x2", "complex32")}
#: Of those, the ones ml_dtypes defines for NumPy (``ml_dtypes.<name>``; complex32 from ml_dtypes 0.7).
ML_DTYPES = frozenset(n for n in STORAGE if n != "float4_e2m1fn_x2")


def numpy_dtype(name: str) -> Any:
    """The NumPy dtype of a wire dtype name; the names NumPy lacks come from ``ml_dtypes`` (an optional
    dependency: ``pip install ml_dtypes``).

    Raises:
        InvalidArgumentError: ``ml_dtypes`` is not installed (or has no such dtype), or no NumPy dtype
            holds it (``float4_e2m1fn_x2``, two FP4 values per byte): use ``as_tensor()``.
    """
    import numpy as np

    if name not in STORAGE:
        return np.dtype(name)
    if name not in ML_DTYPES:
        raise InvalidArgumentError(f"NumPy has no {name} (torch's dtype): use as_tensor()")
    try:
        import ml_dtypes
    except ImportError as exc:
        raise InvalidArgumentError(f"NumPy has no {name}: install ml_dtypes (pip install ml_dtypes), or use "
                                   f"as_tensor()") from exc
    found = getattr(ml_dtypes, name, None)
    if found is None:
        raise InvalidArgumentError(f"ml_dtypes {getattr(ml_dtypes, '__version__', '?')} has no {name}: upgrade "
                                   f"ml_dtypes, or use as_tensor()")
    return np.dtype(found)


def storage_dtype(name: str) -> Any:
    """The NumPy dtype whose bytes a wire dtype moves as: itself, or for a dtype NumPy lacks the unsigned
    int of its size (:data:`STORAGE`)."""
    import numpy as np

    return np.dtype(STORAGE.get(name, name))


def wire_dtype(dtype: Any) -> str | None:
    """The wire name of a NumPy dtype (``ml_dtypes``' by their names), or ``None`` if it cannot travel."""
    name = dtype.name
    size = DTYPES.get(name)
    if size is None or size != dtype.itemsize or dtype.fields is not None:
        return None
    if name in STORAGE:  # an ml_dtypes type: of kind 'V', 'f' or 'c' as its version says
        return name if dtype.kind in "Vfc" else None
    return name if dtype.kind in "biufc" else None


def torch_dtype(torch: Any, name: str) -> Any:
    """torch's dtype of a wire dtype name.

    Raises:
        InvalidArgumentError: this torch has no such dtype (``float8_e3m4``, ``float8_e4m3`` and
            ``float8_e4m3b11fnuz`` are ml_dtypes' alone): use ``as_array()``.
    """
    found = getattr(torch, name, None)
    if found is None:
        raise InvalidArgumentError(f"torch {torch.__version__} has no {name}: use as_array() (ml_dtypes)")
    return found


def shown_dtype(dtype: Any) -> str:
    """A dtype as the caller spelled it (``str``: ``"<U5"``, ``"[('a', '<i4')]"``, ``"torch.qint8"``), for
    messages: NumPy's ``dtype.name`` (``"str160"``, ``"void96"``) names something the caller never wrote."""
    return str(dtype)


def c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


#: wire dtype name -> the NumPy dtype of a device view (:func:`storage_dtype`).
_DEVICE_DTYPES: dict[str, Any] = {}


def device_dtype(name: str) -> Any:
    """The NumPy dtype a :class:`DeviceView` of wire dtype ``name`` reports: :func:`storage_dtype`
    (a dtype NumPy lacks as the unsigned int of its size: bfloat16 as uint16, float8 as uint8)."""
    dt = _DEVICE_DTYPES.get(name)
    if dt is None:
        dt = _DEVICE_DTYPES[name] = storage_dtype(name)
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
        try:
            chunk = self.chunk
        except AttributeError:  # __init__ cut short by an interrupt: the reference, if taken, stays taken (the
            return  # mapping stays): Note [interrupted handling], in ._reader
        chunk.release()
