"""The one module that calls the CUDA driver API (through ``cuda.bindings.driver``, and for the few calls of a
hand-off's steady state through its compiled helper :mod:`._driver_hot`, on ``cuda.bindings.cydriver``, where built).

Every other module goes through the thin, checked wrappers here, so that:

* importing :mod:`dmabuf_interop` never loads ``libcuda`` or initialises CUDA
  (``cuda.bindings.driver`` is imported on first use);
* every ``CUresult`` is checked and a failure raises :class:`~.errors.CudaError`
  naming the call and the result (``NOT_SUPPORTED`` raises
  :class:`~.errors.CudaNotSupportedError`);
* one documented hook, :func:`set_observer`, sees every checked call with its
  duration, so tools can time and count driver calls without patching the
  module;
* a machine without ``libcuda.so.1`` gives :class:`~.errors.NoDriverError`, not
  an ``ImportError`` or ``RuntimeError`` traceback;
* a process forked after CUDA was initialised gets
  :class:`~.errors.ForkedAfterInitError` with the advice to use spawn, instead
  of a bare ``CUDA_ERROR_NOT_INITIALIZED``.

Reference: CUDA Driver API, sections "Error Handling", "Device Management",
"Memory Management", "Virtual Memory Management" and "External Resource
Interoperability" (https://docs.nvidia.com/cuda/cuda-driver-api/).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable

from . import _forks
from .errors import CudaError, CudaNotSupportedError, ForkedAfterInitError, InvalidArgumentError, NoDriverError

#: :mod:`._driver_hot` once :func:`bindings` has run, where it is built and loads; else ``None``.
_hot: Any = None

_lock = threading.Lock()
_drv: Any = None
_init_pid: int | None = None  # pid that ran cuInit successfully
_forked_after_init = False

_NOT_SUPPORTED = {"CUDA_ERROR_NOT_SUPPORTED"}

#: ``observer(call_name, nanoseconds)`` after every checked call, or ``None``.
_observer: Callable[[str, int], None] | None = None


def set_observer(observer: Callable[[str, int], None] | None) -> Callable[[str, int], None] | None:
    """Install ``observer(call, ns)``, called after every checked driver call with the call's
    name (``"cuMemCreate"``) and its duration in nanoseconds (``time.perf_counter_ns``), failed
    calls included; ``None`` removes it. Returns the observer it replaces.

    For measurement tools (``dmabuf-interop bench``): with no observer a call
    costs one global read more.
    """
    global _observer
    previous, _observer = _observer, observer
    return previous


def _mark_forked() -> None:
    global _forked_after_init
    if _init_pid is not None:
        _forked_after_init = True


os.register_at_fork(after_in_child=_mark_forked)


def bindings() -> Any:
    """Return ``cuda.bindings.driver``, imported on first use."""
    global _drv
    if _drv is None:
        try:
            from cuda.bindings import driver as drv
        except ImportError as exc:  # a dependency, but an interpreter may lack it
            raise NoDriverError("import cuda.bindings.driver", "ImportError", -1,
                                f"cuda-bindings is not installed for {sys.executable} ({exc}); "
                                f"pip install cuda-bindings", reason="no-bindings") from exc
        global _cuda_success, _hot
        _cuda_success = drv.CUresult.CUDA_SUCCESS
        try:  # load-bearing for a hand-off: its driver calls without cuda.bindings.driver's objects (3-5 us each)
            from . import _driver_hot as hot
        except ImportError:  # optional: not built (no Cython or cuda.h at build time), or against other bindings
            hot = None
        _hot = hot
        _drv = drv  # (last: a thread that sees it set sees _hot set)
    return _drv


#: ``CUresult.CUDA_SUCCESS`` once :func:`bindings` imported the driver (enum members are singletons: compared by
#: identity on the hot paths).
_cuda_success: Any = None
_get_ident = threading.get_ident
#: ``CUstream`` objects by handle, made once each: the hand-off's stream calls pass the same few handles, and
#: making the object costs 0.4 us a call on one H200 (a plain wrapper of the pointer value: keeping it is safe).
_streams: dict[int, Any] = {}


def _stream_object(handle: int) -> Any:
    obj = _streams.get(handle)
    if obj is None:
        if len(_streams) >= 64:  # (streams come and go: the table stays small)
            _streams.clear()
        obj = _streams[handle] = bindings().CUstream(handle)
    return obj


def _raise_hot(exc: Exception) -> None:
    """Raise the typed error for a failed :mod:`._driver_hot` call (``exc.args``: the call, its ``CUresult`` as an int)."""
    name, code = exc.args
    try:
        err = bindings().CUresult(code)
    except ValueError:  # a result this cuda.bindings does not name: raise_for shows the number
        err = code
    raise_for(name, err)


def result_name(err: Any) -> str:
    """The enum name of a ``CUresult`` (``"CUDA_ERROR_INVALID_VALUE"``)."""
    name = getattr(err, "name", None)
    return name if name else f"CUresult({int(err)})"


def raise_for(call: str, err: Any, detail: str = "") -> None:
    """Raise the typed error for a failed ``call`` that returned ``err``."""
    name = result_name(err)
    if _forked_after_init and name in ("CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_INVALID_CONTEXT"):
        raise ForkedAfterInitError(
            call, name, int(err),
            "this process was forked after CUDA was initialised in its parent; "
            "the CUDA driver does not survive fork(): use multiprocessing's 'spawn' "
            "start method or fork before the first CUDA call",
        )
    cls = CudaNotSupportedError if name in _NOT_SUPPORTED else CudaError
    raise cls(call, name, int(err), detail)


def call(fn: Callable[..., Any], *args: Any, detail: str = "") -> Any:
    """Call a ``cuda.bindings.driver`` function and check its ``CUresult``.

    Returns ``None`` for calls with no outputs, the value for one output, and
    a tuple for several.
    """
    if _forked_after_init:
        raise ForkedAfterInitError(
            fn.__name__, "CUDA_ERROR_NOT_INITIALIZED", 3,
            "this process was forked after CUDA was initialised in its parent; "
            "the CUDA driver does not survive fork(): use multiprocessing's 'spawn' "
            "start method or fork before the first CUDA call",
        )
    if _observer is None:
        out = fn(*args)
    else:
        t0 = time.perf_counter_ns()
        try:
            out = fn(*args)
        finally:
            _observer(fn.__name__, time.perf_counter_ns() - t0)
    err, rest = out[0], out[1:]
    if int(err) != 0:
        raise_for(fn.__name__, err, detail)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def init() -> None:
    """``cuInit(0)`` once per process.

    Raises:
        NoDriverError: ``libcuda.so.1`` cannot be loaded or no CUDA device exists.
        ForkedAfterInitError: the parent initialised CUDA before forking us.
    """
    global _init_pid
    if _init_pid == os.getpid():
        return
    if _forked_after_init:
        call(bindings().cuInit, 0)  # raises ForkedAfterInitError
    with _lock:
        if _init_pid == os.getpid():
            return
        drv = bindings()
        try:
            err, = drv.cuInit(0)
        except RuntimeError as exc:  # cuda-pathfinder's "Failed to dlopen libcuda.so.1" (kept as __cause__)
            raise NoDriverError("cuInit", "libcuda.so.1 not loadable", -1,
                                "no NVIDIA driver on this machine: libcuda.so.1 cannot be loaded") from exc
        name = result_name(err)
        if name == "CUDA_ERROR_NO_DEVICE":
            raise NoDriverError("cuInit", name, int(err), _no_device_text(), reason="no-device")
        if name == "CUDA_ERROR_STUB_LIBRARY":
            raise NoDriverError("cuInit", name, int(err), "no NVIDIA driver on this machine: only the CUDA "
                                "toolkit's stub libcuda.so was found", reason="no-driver")
        if name == "CUDA_ERROR_INSUFFICIENT_DRIVER":
            raise NoDriverError("cuInit", name, int(err), _old_driver_text(None), reason="old-driver")
        if int(err) != 0:
            raise_for("cuInit", err)
        err, version = drv.cuDriverGetVersion()
        if int(err) == 0 and int(version) < required_driver_version():
            raise NoDriverError("cuDriverGetVersion", str(int(version)), -1, _old_driver_text(int(version)),
                                reason="old-driver")
        _init_pid = os.getpid()


def required_driver_version() -> int:
    """The oldest driver API version these cuda-bindings run on, as ``cuDriverGetVersion`` counts
    (``1000 * major``: CUDA's minor-version compatibility lets bindings for 13.x run on any 13.x
    driver)."""
    return int(bindings().CUDA_VERSION) // 1000 * 1000


def _cuda(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def _old_driver_text(version: int | None) -> str:
    have = f"supports CUDA {_cuda(version)}" if version is not None else "is too old"
    return (f"the NVIDIA driver {have}; cuda-bindings for CUDA {_cuda(int(bindings().CUDA_VERSION))} needs a "
            f"driver for CUDA {_cuda(required_driver_version())} or newer")


def _no_device_text() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return "the CUDA driver is loaded but finds no GPU (CUDA_VISIBLE_DEVICES is not set)"
    return (f"the CUDA driver is loaded but this process sees no GPU: CUDA_VISIBLE_DEVICES={visible!r} "
            f"names none of this machine's GPUs")


def is_initialized() -> bool:
    """True when this process ran ``cuInit`` (without initialising anything)."""
    return _init_pid == os.getpid()


# --- versions and devices -------------------------------------------------------

def driver_version() -> int:
    """``cuDriverGetVersion``: e.g. 13000 for CUDA 13.0."""
    init()
    return int(call(bindings().cuDriverGetVersion))


_cache_pid = -1
_cache: dict[Any, Any] = {}


def _per_process() -> dict[Any, Any]:
    """Facts that cannot change within a process (device count, handles, UUIDs,
    granularities), forgotten in a forked child."""
    global _cache_pid
    if _cache_pid != _forks.pid:  # (no getpid() system call: this runs in every hand-off's set_current)
        _cache.clear()
        _cache_pid = _forks.pid
    return _cache


def device_count() -> int:
    """``cuDeviceGetCount`` (asked once per process)."""
    cache = _per_process()
    if "count" not in cache:
        init()
        cache["count"] = int(call(bindings().cuDeviceGetCount))
    return cache["count"]


def device(ordinal: int) -> Any:
    """``cuDeviceGet``: the ``CUdevice`` for an ordinal; checks the range first.

    Raises:
        InvalidArgumentError: ordinal outside ``0 .. device_count()-1``.
    """
    cache = _per_process()
    key = ("device", ordinal)
    if key not in cache:
        n = device_count()
        if isinstance(ordinal, bool) or not isinstance(ordinal, int) or not 0 <= ordinal < n:
            raise InvalidArgumentError(
                f"device ordinal {ordinal!r} out of range: this machine has {n} CUDA device(s)")
        cache[key] = call(bindings().cuDeviceGet, ordinal)
    return cache[key]


def device_name(ordinal: int) -> str:
    """``cuDeviceGetName``."""
    raw = call(bindings().cuDeviceGetName, 256, device(ordinal))
    return bytes(raw).split(b"\0", 1)[0].decode(errors="replace")


def device_uuid(ordinal: int) -> str:
    """``cuDeviceGetUuid`` as ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` (asked once per process)."""
    cache = _per_process()
    key = ("uuid", ordinal)
    if key not in cache:
        h = bytes(call(bindings().cuDeviceGetUuid, device(ordinal)).bytes).hex()
        cache[key] = f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    return cache[key]


def ordinal_for_uuid(uuid: str) -> int | None:
    """This process's ordinal of the GPU with ``uuid`` (``GPU-...``), or ``None`` when this process
    cannot see it (``CUDA_VISIBLE_DEVICES``)."""
    for i in range(device_count()):
        if device_uuid(i) == uuid:
            return i
    return None


def invisible_gpu_text(what: str) -> str:
    """Why memory on ``what`` (a GPU UUID, or a description) cannot be reached from this process."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"the exporter's GPU {what} is not visible to this process "
            f"(CUDA_VISIBLE_DEVICES={'unset' if visible is None else repr(visible)}; this process sees "
            f"{device_count()} GPU(s)): include that GPU in CUDA_VISIBLE_DEVICES to import its memory")


def device_pci_bus_id(ordinal: int) -> str:
    """``cuDeviceGetPCIBusId`` (``0000:3b:00.0``)."""
    raw = call(bindings().cuDeviceGetPCIBusId, 64, device(ordinal))
    return bytes(raw).split(b"\0", 1)[0].decode(errors="replace")


def attribute_enum(name: str) -> Any:
    """``CUdevice_attribute.CU_DEVICE_ATTRIBUTE_<name>``, or ``None`` if these bindings lack it."""
    return getattr(bindings().CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name, None)


def device_attribute(ordinal: int, name: str) -> int:
    """``cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_<name>)``.

    Raises:
        CudaNotSupportedError: the bindings or the driver do not know the attribute
            (a driver older than the bindings answers ``CUDA_ERROR_INVALID_VALUE``).
    """
    enum = attribute_enum(name)
    if enum is None:
        raise CudaNotSupportedError("cuDeviceGetAttribute", "unknown to cuda.bindings", -1, name)
    dev = device(ordinal)
    err, value = bindings().cuDeviceGetAttribute(enum, dev)
    if int(err) != 0:
        rn = result_name(err)
        if rn == "CUDA_ERROR_INVALID_VALUE":
            raise CudaNotSupportedError("cuDeviceGetAttribute", rn, int(err), f"{name} unknown to this driver")
        raise_for("cuDeviceGetAttribute", err, name)
    return int(value)


def can_access_peer(ordinal: int, peer: int) -> bool:
    """``cuDeviceCanAccessPeer``: can ``ordinal`` map memory that lives on ``peer``."""
    return bool(call(bindings().cuDeviceCanAccessPeer, device(ordinal), device(peer)))


def set_current(ordinal: int) -> Any:
    """Make the primary context of ``ordinal`` current on this thread (via cuda.core).

    Returns the ``cuda.core.Device``. The first call on a thread uses
    ``Device.set_current()``, which retains the primary context
    (``cuDevicePrimaryCtxRetain`` + ``cuCtxSetCurrent``); later calls only
    compare ``cuCtxGetCurrent`` with that context and switch with
    ``cuCtxSetCurrent`` when needed, which costs microseconds, not a retain.

    Raises:
        InvalidArgumentError: a bad ordinal. NoDriverError, ForkedAfterInitError: see :func:`init`.
    """
    # Load-bearing (a send and a release each call this): the context known, no observer, the check is one
    # cuCtxGetCurrent compared with it: through _driver_hot where built (1.9 us in a process woken for it, one
    # H200), else raw with an identity test of its result (2.8 us so; 1.9 us warm through call(), 0.6 us raw).
    if _cache_pid == _forks.pid and _observer is None:
        known = _cache.get(("ctx", _get_ident(), ordinal))
        if known is not None and _hot is not None:
            try:
                _hot.make_current(known[2])
            except _hot.DriverCallFailed as exc:
                _raise_hot(exc)
            return known[0]
        if known is not None:
            err, cur = _drv.cuCtxGetCurrent()
            if err is not _cuda_success and int(err) != 0:
                raise_for("cuCtxGetCurrent", err)
            if int(cur) != known[2]:
                call(_drv.cuCtxSetCurrent, known[1])
            return known[0]
    cache = _per_process()
    key = ("ctx", threading.get_ident(), ordinal)
    known = cache.get(key)
    if known is None:
        init()
        device(ordinal)  # range check with a clear error
        from cuda.core import Device

        dev = Device(ordinal)
        dev.set_current()
        ctx = dev.context.handle
        cache[key] = (dev, ctx, int(ctx))
        return dev
    dev, ctx, address = known
    drv = bindings()
    if int(call(drv.cuCtxGetCurrent)) != address:
        call(drv.cuCtxSetCurrent, ctx)
    return dev


def mem_get_info() -> tuple[int, int]:
    """``cuMemGetInfo`` in the current context: ``(free, total)`` bytes."""
    free, total = call(bindings().cuMemGetInfo)
    return int(free), int(total)


def synchronize() -> None:
    """``cuCtxSynchronize`` of the current context."""
    call(bindings().cuCtxSynchronize)


# --- allocations ----------------------------------------------------------------

def mem_alloc_host(size: int) -> int:
    """``cuMemAllocHost``: pinned host memory, also a valid device pointer (UVA)."""
    return int(call(bindings().cuMemAllocHost, size))


def mem_free_host(ptr: int) -> None:
    """``cuMemFreeHost``."""
    call(bindings().cuMemFreeHost, ptr)


def mem_alloc(size: int) -> int:
    """``cuMemAlloc``: device memory of the current context; returns the ``CUdeviceptr``."""
    return int(call(bindings().cuMemAlloc, size))


def mem_free(ptr: int) -> None:
    """``cuMemFree``."""
    call(bindings().cuMemFree, ptr)


def mem_address_range(ptr: int) -> tuple[int, int]:
    """``cuMemGetAddressRange``: ``(base, size)`` of the allocation holding ``ptr``."""
    base, size = call(bindings().cuMemGetAddressRange, ptr)
    return int(base), int(size)


_POINTER_ATTRIBUTES: Any = None


def pointer_facts(ptr: int) -> dict[str, int]:
    """One ``cuPointerGetAttributes`` call: ``memory_type`` (``CUmemorytype`` value; 0 when CUDA
    does not know ``ptr``), ``managed``, ``ordinal`` (``DEVICE_ORDINAL``, the context's device),
    ``context`` (0 for CUDA VMM mappings, which belong to no context), ``range_start`` and
    ``range_size`` (the allocation or ``cuMemCreate`` chunk holding ``ptr``), ``mapped`` and
    ``mempool`` (non-zero for stream-ordered pool memory), all as ints.

    Raises:
        CudaError: ``CUDA_ERROR_INVALID_VALUE`` for a pointer outside unified addressing.
        NoDriverError, ForkedAfterInitError: see :func:`init`.
    """
    global _POINTER_ATTRIBUTES
    init()
    drv = bindings()
    if _POINTER_ATTRIBUTES is None:
        a = drv.CUpointer_attribute
        _POINTER_ATTRIBUTES = [a.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, a.CU_POINTER_ATTRIBUTE_IS_MANAGED,
                               a.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, a.CU_POINTER_ATTRIBUTE_CONTEXT,
                               a.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, a.CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                               a.CU_POINTER_ATTRIBUTE_MAPPED, a.CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE]
    values = call(drv.cuPointerGetAttributes, len(_POINTER_ATTRIBUTES), _POINTER_ATTRIBUTES, ptr)
    keys = ("memory_type", "managed", "ordinal", "context", "range_start", "range_size", "mapped", "mempool")
    return {k: _as_int(v) for k, v in zip(keys, values)}


def _as_int(value: Any) -> int:
    if value is None:
        return 0
    try:
        return int(value)  # ints, bools, enums, CUdeviceptr
    except TypeError:
        return int(value.getPtr())  # handle types such as CUcontext and CUmemoryPool


def memory_type_host() -> int:
    """``CU_MEMORYTYPE_HOST`` as an int."""
    return int(bindings().CUmemorytype.CU_MEMORYTYPE_HOST)


def memset_d8(ptr: int, value: int, nbytes: int) -> None:
    """``cuMemsetD8``: set ``nbytes`` bytes at ``ptr`` to ``value``."""
    call(bindings().cuMemsetD8, ptr, value, nbytes)


def memcpy_dtoh(dst_host_addr: int, src: int, nbytes: int) -> None:
    """``cuMemcpyDtoH`` (synchronous) into host memory at ``dst_host_addr``."""
    call(bindings().cuMemcpyDtoH, dst_host_addr, src, nbytes)


def memcpy_peer(dst: int, dst_ordinal: int, src: int, src_ordinal: int, nbytes: int) -> None:
    """``cuMemcpyPeer`` between the primary contexts of two devices (synchronous)."""
    from cuda.core import Device

    drv = bindings()
    call(drv.cuMemcpyPeer, dst, Device(dst_ordinal).context.handle, src,
         Device(src_ordinal).context.handle, nbytes)
    synchronize()


# --- dma-buf export and import --------------------------------------------------

def get_dmabuf_fd(ptr: int, size: int, flags: int = 0) -> int:
    """``cuMemGetHandleForAddressRange(CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)``.

    ``ptr`` and ``size`` must be aligned to the host page size. Returns a new
    fd that the caller owns.
    """
    drv = bindings()
    fd = call(drv.cuMemGetHandleForAddressRange, ptr, size,
              drv.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, flags)
    return int(fd)


def import_external_memory_dmabuf(fd: int, size: int) -> Any:
    """``cuImportExternalMemory`` with ``CU_EXTERNAL_MEMORY_HANDLE_TYPE_DMABUF_FD``.

    The driver does not take ownership of a DMABUF_FD (only OPAQUE_FD is
    documented as transferred); the caller keeps ``fd`` open until after
    :func:`destroy_external_memory`, as the CUDA dmabufInterop sample does.
    """
    drv = bindings()
    desc = drv.CUDA_EXTERNAL_MEMORY_HANDLE_DESC()
    desc.type = drv.CUexternalMemoryHandleType.CU_EXTERNAL_MEMORY_HANDLE_TYPE_DMABUF_FD
    desc.handle.fd = fd
    desc.size = size
    desc.flags = 0
    return call(drv.cuImportExternalMemory, desc)


def external_memory_mapped_buffer(ext_mem: Any, offset: int, size: int) -> int:
    """``cuExternalMemoryGetMappedBuffer``: a ``CUdeviceptr`` for ``[offset, offset+size)``."""
    drv = bindings()
    desc = drv.CUDA_EXTERNAL_MEMORY_BUFFER_DESC()
    desc.offset = offset
    desc.size = size
    desc.flags = 0
    return int(call(drv.cuExternalMemoryGetMappedBuffer, ext_mem, desc))


def destroy_external_memory(ext_mem: Any) -> None:
    """``cuDestroyExternalMemory``."""
    call(bindings().cuDestroyExternalMemory, ext_mem)


# --- virtual memory management (POSIX-fd shareable handles) ---------------------

def _posix_fd_type() -> Any:
    return bindings().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


def _vmm_prop(ordinal: int) -> Any:
    drv = bindings()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = _posix_fd_type()
    return prop


def vmm_granularity(ordinal: int) -> int:
    """``cuMemGetAllocationGranularity`` (minimum) for a POSIX-fd-exportable allocation (asked once)."""
    cache = _per_process()
    key = ("granularity", ordinal)
    if key not in cache:
        drv = bindings()
        cache[key] = int(call(drv.cuMemGetAllocationGranularity, _vmm_prop(ordinal),
                              drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    return cache[key]


def vmm_create(ordinal: int, size: int) -> Any:
    """``cuMemCreate`` of ``size`` bytes (a multiple of the granularity) on ``ordinal``."""
    return call(bindings().cuMemCreate, size, _vmm_prop(ordinal), 0)


def vmm_release(handle: Any) -> None:
    """``cuMemRelease``."""
    call(bindings().cuMemRelease, handle)


def vmm_reserve(size: int, alignment: int) -> int:
    """``cuMemAddressReserve``: a virtual address range of ``size`` bytes."""
    return int(call(bindings().cuMemAddressReserve, size, alignment, 0, 0))


def vmm_address_free(ptr: int, size: int) -> None:
    """``cuMemAddressFree``."""
    call(bindings().cuMemAddressFree, ptr, size)


def vmm_map(ptr: int, size: int, handle: Any) -> None:
    """``cuMemMap`` of a whole physical allocation at ``ptr``."""
    call(bindings().cuMemMap, ptr, size, 0, handle, 0)


def vmm_unmap(ptr: int, size: int) -> None:
    """``cuMemUnmap``."""
    call(bindings().cuMemUnmap, ptr, size)


def vmm_set_access(ptr: int, size: int, ordinals: list[int]) -> None:
    """``cuMemSetAccess``: read/write access for each device in ``ordinals``."""
    drv = bindings()
    descs = []
    for o in ordinals:
        d = drv.CUmemAccessDesc()
        d.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        d.location.id = o
        d.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        descs.append(d)
    call(bindings().cuMemSetAccess, ptr, size, descs, len(descs))


def vmm_export_posix_fd(handle: Any) -> int:
    """``cuMemExportToShareableHandle(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)``: a new fd."""
    return int(call(bindings().cuMemExportToShareableHandle, handle, _posix_fd_type(), 0))


def vmm_import_posix_fd(fd: int) -> Any:
    """``cuMemImportFromShareableHandle(fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)``.

    The driver does not take ownership of ``fd``: the caller closes it.
    """
    return call(bindings().cuMemImportFromShareableHandle, fd, _posix_fd_type())


def vmm_allocation_device(handle: Any) -> int:
    """``cuMemGetAllocationPropertiesFromHandle``: the device that holds the memory."""
    return vmm_allocation_properties(handle)["device"]


def vmm_allocation_properties(handle: Any) -> dict[str, int]:
    """``cuMemGetAllocationPropertiesFromHandle``: ``device`` (the location's ordinal) and ``posix_fd``
    (whether ``requestedHandleTypes`` includes ``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``)."""
    prop = call(bindings().cuMemGetAllocationPropertiesFromHandle, handle)
    return {"device": int(prop.location.id),
            "posix_fd": int(bool(int(prop.requestedHandleTypes) & int(_posix_fd_type())))}


def vmm_retain_handle(ptr: int) -> Any:
    """``cuMemRetainAllocationHandle``: the physical allocation mapped at ``ptr``."""
    return call(bindings().cuMemRetainAllocationHandle, ptr)


def pointer_device(ptr: int) -> int:
    """The CUDA ordinal of the GPU that holds the memory at ``ptr``, or ``-1`` for host memory that
    CUDA knows (pinned or registered). One ``cuPointerGetAttributes``; for a CUDA VMM mapping, which
    belongs to no context, the allocation's own location (``cuMemRetainAllocationHandle`` +
    ``cuMemGetAllocationPropertiesFromHandle``).

    Raises:
        CudaError: ``ptr`` is not memory CUDA knows (``CUDA_ERROR_INVALID_VALUE``), or a call failed.
        NoDriverError, ForkedAfterInitError: see :func:`init`.
    """
    facts = pointer_facts(ptr)
    if facts["memory_type"] == 0:
        raise CudaError("cuPointerGetAttributes", "CUDA_ERROR_INVALID_VALUE", 1,
                        f"0x{ptr:x} is not memory that CUDA knows")
    if facts["memory_type"] == memory_type_host():
        return -1
    if facts["context"] == 0 and not facts["mempool"]:  # a cuMemMap mapping
        handle = vmm_retain_handle(ptr)
        try:
            return vmm_allocation_device(handle)
        finally:
            vmm_release(handle)
    return facts["ordinal"]


# --- channels: interprocess events and asynchronous copies ----------------------

def event_create_interprocess() -> Any:
    """``cuEventCreate(CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING)`` in the current context."""
    drv = bindings()
    flags = int(drv.CUevent_flags.CU_EVENT_INTERPROCESS) | int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    return call(drv.cuEventCreate, flags)


def event_destroy(event: Any) -> None:
    """``cuEventDestroy``."""
    call(bindings().cuEventDestroy, event)


def event_record(event: Any, stream: int) -> None:
    """``cuEventRecord`` of ``event`` on the stream handle ``stream`` (0: the legacy default stream)."""
    drv = bindings()
    call(drv.cuEventRecord, event, drv.CUstream(stream))


def event_synchronize(event: Any) -> None:
    """``cuEventSynchronize``: block the calling thread until ``event`` has completed."""
    call(bindings().cuEventSynchronize, event)


def ipc_get_event_handle(event: Any) -> bytes:
    """``cuIpcGetEventHandle``: the 64-byte handle another process opens with :func:`ipc_open_event_handle`."""
    import ctypes

    handle = call(bindings().cuIpcGetEventHandle, event)
    # The bindings expose the struct's 64 opaque bytes only through its address.
    return ctypes.string_at(handle.getPtr(), 64)


def ipc_open_event_handle(raw: bytes) -> Any:
    """``cuIpcOpenEventHandle`` of a 64-byte handle from :func:`ipc_get_event_handle` (current context)."""
    import ctypes

    if len(raw) != 64:
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"an IPC event handle is 64 bytes, got {len(raw)}")
    drv = bindings()
    handle = drv.CUipcEventHandle()
    ctypes.memmove(handle.getPtr(), raw, 64)
    return call(drv.cuIpcOpenEventHandle, handle)


def stream_wait_event(stream: int, event: Any) -> None:
    """``cuStreamWaitEvent``: later work on ``stream`` waits for ``event``."""
    drv = bindings()
    call(drv.cuStreamWaitEvent, drv.CUstream(stream), event, 0)


def stream_idle(stream: int) -> bool:
    """``cuStreamQuery``: True when all work queued on ``stream`` has completed
    (``CUDA_SUCCESS``), False while some is pending (``CUDA_ERROR_NOT_READY``).

    Raises:
        CudaError: any other result (a bad stream handle, a sticky error).
    """
    if _hot is not None and not _forked_after_init:
        try:
            return _hot.stream_idle(stream)
        except _hot.DriverCallFailed as exc:
            _raise_hot(exc)
    obj = _streams.get(stream)  # (a send calls this: the table inline, no two calls before the driver's)
    err = (_drv if _drv is not None else bindings()).cuStreamQuery(_stream_object(stream) if obj is None else obj)[0]
    if err is _cuda_success:
        return True
    if err == _drv.CUresult.CUDA_ERROR_NOT_READY:
        return False
    if int(err) != 0:
        raise_for("cuStreamQuery", err)
    return True


def stream_synchronize(stream: int) -> None:
    """``cuStreamSynchronize`` of the stream handle ``stream``."""
    if _hot is not None and _observer is None and not _forked_after_init:
        try:
            return _hot.stream_synchronize(stream)
        except _hot.DriverCallFailed as exc:
            _raise_hot(exc)
    call(bindings().cuStreamSynchronize, _stream_object(stream))


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``cuMemcpyAsync`` (unified addressing: device or host pointers) on ``stream``."""
    drv = bindings()
    call(drv.cuMemcpyAsync, dst, src, nbytes, drv.CUstream(stream))
