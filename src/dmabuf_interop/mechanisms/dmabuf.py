"""dma-buf: export CUDA memory as a Linux dma-buf fd, and import a dma-buf into CUDA.

Exporters. All three use ``cuMemGetHandleForAddressRange(...,
CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)`` (CUDA Driver API, "Memory
Management"), which requires the base address and the size to be aligned to
the host page size (``os.sysconf("SC_PAGE_SIZE")``, 4096 bytes on x86-64):

* :func:`export_host` - the CUDA sample's producer: pinned host memory from
  ``cuMemAllocHost``, over-allocated by one page so the base can be rounded up
  to a page. Needs ``CU_DEVICE_ATTRIBUTE_HOST_ALLOC_DMA_BUF_SUPPORTED``.
* :func:`export_device` - the same with device memory from ``cuMemAlloc``.
  Needs ``CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED``.
* :func:`export_range` - part of an allocation someone else made (a torch or
  CuPy tensor, a ``cuMemCreate`` mapping): the enclosing page-aligned range,
  with the caller's offset inside it.

Ordering: the exporters do not write. A caller that wrote the memory with a
kernel must synchronise that stream (or the device) before sending the fd;
the demos call ``cuCtxSynchronize`` first, as the sample calls
``cudaDeviceSynchronize``.

Importer (:func:`import_dmabuf`): ``cuImportExternalMemory`` with
``CU_EXTERNAL_MEMORY_HANDLE_TYPE_DMABUF_FD``, then
``cuExternalMemoryGetMappedBuffer`` (CUDA Driver API, "External Resource
Interoperability"). Closing unmaps with ``cuMemFree`` on the mapped pointer,
then ``cuDestroyExternalMemory``, as the driver API documents for mapped
buffers.

fd ownership on import: the Driver API documents a transfer of ownership to
the driver only for ``CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD``; it states no
such transfer for ``DMABUF_FD``, and NVIDIA's dmabufInterop sample closes its
fd itself, after ``cuDestroyExternalMemory``. So :func:`import_dmabuf` never
takes the caller's fd: it imports a ``dup()`` that the
:class:`~dmabuf_interop.buffers.ImportedBuffer` owns and closes after
``cuDestroyExternalMemory``. Everything that can be checked in user space is
checked before the driver is called: the fd is a dma-buf, ``size`` > 0,
``offset`` >= 0, and ``offset + size`` fits inside the dma-buf's size from
``/proc/self/fdinfo``.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from .. import _driver as driver
from .._checks import byte_count, byte_offset, page_size
from .._checks import round_up as _round_up
from ..buffers import ExportedBuffer, ImportedBuffer, Transaction
from ..descriptor import ShareDescriptor
from ..errors import AlignmentError, CudaError, CudaNotSupportedError, InvalidArgumentError, NotSupportedError
from ..fd import OwnedFd
from ..linux_dmabuf import DmaBuf, dmabuf_info
from ..procs import host_mapping
from ._base import Mechanism
from .posix_fd import vmm_pages

__all__ = ["export_host", "export_device", "export_range", "import_dmabuf", "pointer_and_size",
           "DmaBufMechanism"]



def _dmabuf_for(ptr: int, size: int, device: int, attribute: str) -> DmaBuf:
    """Export ``[ptr, ptr+size)``; explain a failure with the capability ``attribute`` that governs it."""
    try:
        fd = driver.get_dmabuf_fd(ptr, size)
    except CudaError as exc:
        try:
            supported = driver.device_attribute(device, attribute)
        except CudaError:
            supported = None
        if supported == 0 or isinstance(exc, NotSupportedError):
            raise CudaNotSupportedError(
                exc.call, exc.result, exc.code,
                f"device {device} reports CU_DEVICE_ATTRIBUTE_{attribute}={supported}",
            ) from exc
        raise
    return DmaBuf._from_driver(fd, size)


def _export_allocation(size: int, device: int, memory: str, attribute: str,
                       alloc: Callable[[int], int], free: Callable[[int], None]) -> ExportedBuffer:
    """Allocate ``round_up(size, page) + page`` bytes, round the base up to a page and
    export ``round_up(size, page)`` bytes from there as a dma-buf."""
    size = byte_count(size)
    driver.set_current(device)
    uuid = driver.device_uuid(device)
    page = page_size()
    export_size = _round_up(size, page)
    with Transaction() as tx:
        raw = alloc(export_size + page)
        tx.push(_free_on, device, free, raw)
        base = _round_up(raw, page)
        dmabuf = _dmabuf_for(base, export_size, device, attribute)
        tx.push(dmabuf.close)  # closes before the memory is freed
        return ExportedBuffer(mechanism="dmabuf", memory=memory, handle=dmabuf, ptr=base, size=size, offset=0,
                              export_size=export_size, device=device, device_uuid=uuid, cleanups=tx.commit())


def _free_on(device: int, free: Callable[[int], None], ptr: int) -> None:
    driver.set_current(device)
    free(ptr)


def export_host(size: int, device: int = 0) -> ExportedBuffer:
    """Export pinned host memory as a dma-buf (the CUDA dmabufInterop sample's producer).

    ``cuMemAllocHost(round_up(size, page) + page)``, base rounded up to a page,
    then ``cuMemGetHandleForAddressRange(DMA_BUF_FD)`` over
    ``round_up(size, page)`` bytes. The host pointer is also the device
    pointer (unified addressing).

    Args:
        size: bytes the caller needs (> 0).
        device: CUDA ordinal whose primary context is made current.

    Returns:
        ExportedBuffer(mechanism="dmabuf", memory="host", offset=0); it owns the
        allocation and the :class:`~.dmabuf.DmaBuf`.

    Raises:
        NotSupportedError: the device cannot export host allocations
            (``CU_DEVICE_ATTRIBUTE_HOST_ALLOC_DMA_BUF_SUPPORTED`` = 0; the call
            answers ``CUDA_ERROR_INVALID_VALUE`` on discrete GPUs with driver 580).
        CudaError: any other driver failure. InvalidArgumentError: size <= 0.
    """
    return _export_allocation(size, device, "host", "HOST_ALLOC_DMA_BUF_SUPPORTED",
                              driver.mem_alloc_host, driver.mem_free_host)


def export_device(size: int, device: int = 0) -> ExportedBuffer:
    """Export device memory from ``cuMemAlloc`` as a dma-buf.

    Same layout as :func:`export_host` (one page of headroom, page-aligned base).

    Raises:
        NotSupportedError: ``CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`` = 0 or the
            driver answered ``CUDA_ERROR_NOT_SUPPORTED``.
        CudaError: as :func:`export_host`.
        InvalidArgumentError: as :func:`export_host`.
    """
    return _export_allocation(size, device, "device", "DMA_BUF_SUPPORTED", driver.mem_alloc, driver.mem_free)


def pointer_and_size(obj: Any, size: int | None = None) -> tuple[int, int, Any]:
    """``(ptr, nbytes, keepalive)`` of an int pointer, or of an object with DLPack or
    ``__cuda_array_interface__`` (through cuda.core's ``StridedMemoryView``).

    Raises:
        InvalidArgumentError: a non-contiguous view, or an int pointer with no size.
    """
    if isinstance(obj, int) and not isinstance(obj, bool):
        if size is None:
            raise InvalidArgumentError("export_range(ptr, size): size in bytes is required with an int pointer")
        return obj, byte_count(size), None
    from cuda.core.utils import StridedMemoryView

    try:
        view = StridedMemoryView.from_any_interface(obj, stream_ptr=-1)
    except (BufferError, TypeError, ValueError, AttributeError) as exc:
        raise InvalidArgumentError(f"cannot export a {type(obj).__name__}: it exposes neither DLPack nor "
                                   f"__cuda_array_interface__ for CUDA memory ({exc})") from exc
    itemsize = view.dtype.itemsize if view.dtype is not None else 1
    nbytes = itemsize
    for s in view.shape:
        nbytes *= s
    if view.strides is not None:  # None means C-contiguous; otherwise element strides
        expected, want = 1, []
        for dim in reversed(view.shape):
            want.append(expected)
            expected *= dim
        if any(d > 1 and s != w for d, s, w in zip(view.shape, view.strides, reversed(want))):
            raise InvalidArgumentError("export_range needs a C-contiguous view; call .contiguous() first")
    if size is not None:
        nbytes = byte_count(size)
    return int(view.ptr), byte_count(nbytes), (obj, view)


def _is_registered_host_memory(ptr: int) -> bool:
    """Whether host memory at ``ptr`` was registered with ``cuMemHostRegister`` rather than
    allocated by the driver (``cuMemAllocHost``/``cuMemHostAlloc``). The driver answers both
    alike (``cuPointerGetAttributes``, ``cuMemHostGetFlags``); what differs is the mapping:
    the driver allocates pinned memory as a shared anonymous mapping (``/dev/zero (deleted)``
    in ``/proc/self/maps``) or a mapping of an ``/dev/nvidia*`` device, while registered memory
    is the caller's own (heap, private anonymous, a file). Without ``/proc`` it answers False,
    so the message falls back to the device attribute."""
    mapping = host_mapping(ptr)
    if mapping is None:
        return False
    perms, path = mapping
    driver_made = perms[3:4] == "s" and (path == "/dev/zero (deleted)" or path.startswith("/dev/nvidia"))
    return not driver_made


def _classify(ptr: int) -> tuple[int, int, int, str, bool]:
    """``(device, base, size, attribute, pool)`` of the memory at ``ptr`` from one
    ``cuPointerGetAttributes`` call; ``attribute`` is the capability that governs its export and
    ``pool`` says it is stream-ordered pool memory. Memory the driver will not export is refused
    here, by kind. A CUDA VMM mapping (no context) takes its device from its allocation
    (``cuMemRetainAllocationHandle``), the only case that costs more calls.

    Raises:
        CudaError: ``ptr`` is not memory CUDA knows. NotSupportedError: managed or host-registered memory.
    """
    try:
        facts = driver.pointer_facts(ptr)
    except CudaError as exc:
        if exc.result != "CUDA_ERROR_INVALID_VALUE":
            raise
        facts = {"memory_type": 0}
    if facts["memory_type"] == 0:
        raise CudaError("cuPointerGetAttributes", "CUDA_ERROR_INVALID_VALUE", 1,
                        f"0x{ptr:x} is not memory that CUDA knows: a host pointer CUDA did not allocate, "
                        f"or memory already freed")
    if facts["managed"]:
        raise NotSupportedError(
            f"0x{ptr:x} is managed memory (cuMemAllocManaged), which the driver does not export as a dma-buf: "
            f"copy it into device memory (cuMemAlloc) and export that")
    if facts["memory_type"] == driver.memory_type_host():
        if _is_registered_host_memory(ptr):
            raise NotSupportedError(
                f"0x{ptr:x} is host memory registered with cuMemHostRegister, which the driver does not export "
                f"as a dma-buf: copy it into device memory (cuMemAlloc), or allocate it with cuMemAllocHost "
                f"where CU_DEVICE_ATTRIBUTE_HOST_ALLOC_DMA_BUF_SUPPORTED is 1")
        attribute = "HOST_ALLOC_DMA_BUF_SUPPORTED"
    else:
        attribute = "DMA_BUF_SUPPORTED"
    device, start, size = facts["ordinal"], facts["range_start"], facts["range_size"]
    if facts["context"] == 0 and not facts["mempool"]:  # a cuMemMap mapping belongs to no context
        try:
            handle = driver.vmm_retain_handle(ptr)
        except CudaError:
            pass
        else:
            try:
                device = driver.vmm_allocation_device(handle)
            finally:
                driver.vmm_release(handle)
            # The cuMemCreate chunk holding ptr, so that a range across chunks is walked chunk by chunk.
            # cuMemGetAddressRange finds a mapping only from a context of the device that holds it
            # (CUDA_ERROR_NOT_FOUND from another device's context).
            driver.set_current(device)
            start, size = driver.mem_address_range(ptr)
    return device, start, size, attribute, bool(facts["mempool"])


def export_range(obj: Any, size: int | None = None) -> ExportedBuffer:
    """Export the page-aligned range that encloses a caller's bytes as a dma-buf.

    A tensor from a caching allocator rarely starts on a page. The exported
    range is ``[round_down(ptr, page), round_up(ptr + size, page))``; the
    returned :attr:`~.ExportedBuffer.offset` is ``ptr - round_down(ptr, page)``,
    so an importer that maps at that offset reads exactly the caller's bytes.
    The pointer is classified first with one ``cuPointerGetAttributes`` call
    (device, pinned host, managed, host-registered, stream-ordered pool, CUDA
    VMM); the range must stay inside the allocation that holds ``ptr``
    (its ``RANGE_START_ADDR`` and ``RANGE_SIZE``). The buffer keeps ``obj`` alive but does not
    own or free the memory.

    CUDA VMM ranges mapped from several separately created ``cuMemCreate``
    chunks are exported as one dma-buf when the driver exports all of it; the
    dma-buf's size (``/proc/self/fdinfo``) is checked against the range, so a
    driver that exported only part of it, or refused, raises an error naming
    the chunk boundary instead of handing out half the bytes.

    Args:
        obj: an int ``CUdeviceptr`` (then ``size`` is required), or an object
            exposing DLPack or ``__cuda_array_interface__`` (torch, CuPy, cuda.core).
        size: bytes to share; default: the whole view.

    Raises:
        AlignmentError: the enclosing page-aligned range leaves the allocation;
            the message states the page size and the misalignment.
        NotSupportedError: managed memory (``cuMemAllocManaged``) or host memory registered
            with ``cuMemHostRegister``: the message names the kind and what does work.
        InvalidArgumentError: the range runs past its allocation, or through
            unmapped VMM addresses.
        NotSupportedError: the device cannot export this memory as a dma-buf,
            or the driver exported only part of a multi-chunk VMM range.
        CudaError: ``cuMemGetAddressRange`` or the export failed (for a
            multi-chunk range the detail names the chunk boundaries).
    """
    ptr, nbytes, keep = pointer_and_size(obj, size)
    driver.init()
    device, base, alloc_size, attribute, pool = _classify(ptr)
    driver.set_current(device)
    page = page_size()
    start = ptr // page * page
    end = _round_up(ptr + nbytes, page)
    limit = base + alloc_size
    boundaries: list[int] = []
    if ptr + nbytes > limit:  # CUDA VMM memory mapped chunk by chunk: walk the chunks it crosses
        pages = vmm_pages(ptr, ptr + nbytes)
        if pages is None:
            raise InvalidArgumentError(
                f"[0x{ptr:x}, +{nbytes}) runs past its allocation [0x{base:x}, +{alloc_size})")
        boundaries = [at for at, _ in pages[1:]]
        limit = pages[-1][0] + pages[-1][1]
    if start < base or end > limit:
        raise AlignmentError(
            f"cuMemGetHandleForAddressRange needs a {page}-byte page-aligned range; the pages enclosing "
            f"[0x{ptr:x}, +{nbytes}) are [0x{start:x}, 0x{end:x}), which leave the allocation "
            f"[0x{base:x}, 0x{limit:x}) (base misaligned by {ptr % page} bytes, "
            f"end by {(ptr + nbytes) % page} bytes)")
    crossing = ", ".join(f"0x{b:x}" for b in boundaries)
    try:
        dmabuf = _dmabuf_for(start, end - start, device, attribute)
    except CudaError as exc:
        if pool:
            raise type(exc)(exc.call, exc.result, exc.code,
                            f"0x{ptr:x} is stream-ordered pool memory (cuMemAllocAsync), which the driver did "
                            f"not export as a dma-buf: copy it into device memory (cuMemAlloc), or share the "
                            f"pool as a POSIX fd (cuMemPoolExportToShareableHandle)") from exc
        if not boundaries:
            raise
        raise type(exc)(exc.call, exc.result, exc.code,
                        f"[0x{start:x}, 0x{end:x}) crosses the boundary between separately created cuMemCreate "
                        f"chunks at {crossing}; export each chunk on its own") from exc
    # Only a range across chunks can come back short: check its size in fdinfo.
    got = dmabuf.info().size if boundaries else end - start
    if got != end - start:
        dmabuf.close()
        where = (f"; the range crosses the boundary between separately created cuMemCreate chunks at {crossing}"
                 if boundaries else "")
        raise CudaNotSupportedError("cuMemGetHandleForAddressRange", "partial export", -1,
                                f"the driver exported {got} of the {end - start} bytes of [0x{start:x}, 0x{end:x})"
                                f"{where}")
    return RangeExportedBuffer(handle=dmabuf, ptr=ptr, size=nbytes, offset=ptr - start, export_size=end - start,
                               device=device, device_uuid=driver.device_uuid(device), keepalive=keep,
                               chunk_boundaries=boundaries)


class RangeExportedBuffer(ExportedBuffer):
    """An :func:`export_range` export: part of an allocation this library did not make.

    It keeps the caller's object alive but never frees its memory; closing it
    closes the dma-buf only.

    Attributes:
        chunk_boundaries: addresses where the range crosses from one ``cuMemCreate``
            chunk into the next (empty for an ordinary allocation).
    """

    def __init__(self, *, handle: DmaBuf, ptr: int, size: int, offset: int, export_size: int, device: int,
                 device_uuid: str, keepalive: Any, chunk_boundaries: list[int]) -> None:
        super().__init__(mechanism="dmabuf", memory="range", handle=handle, ptr=ptr, size=size, offset=offset,
                         export_size=export_size, device=device, device_uuid=device_uuid, cleanups=[handle.close])
        self._keepalive = keepalive
        self.chunk_boundaries = chunk_boundaries


def import_dmabuf(fd_or_dmabuf: int | OwnedFd, size: int, device: int = 0, offset: int = 0) -> ImportedBuffer:
    """Import a dma-buf into ``device``'s primary context and map ``[offset, offset+size)``.

    Args:
        fd_or_dmabuf: a dma-buf fd, its :class:`~.dmabuf.DmaBuf`, or the
            :class:`~.fd.OwnedFd` it was received in; not consumed.
        size: bytes to map (> 0).
        device: CUDA ordinal of the importing device.
        offset: byte offset of the mapping inside the dma-buf (for an
            :class:`~.buffers.ExportedBuffer`, its ``offset``).

    Returns:
        ImportedBuffer(mechanism="dmabuf") with ``ptr`` = the mapped ``CUdeviceptr``.

    Raises:
        NotADmaBufError: the fd is closed or not a dma-buf (pipe, file, memfd...).
        InvalidArgumentError: size <= 0, offset < 0, ``offset + size`` beyond
            the dma-buf, or a bad device ordinal.
        NotSupportedError: the driver cannot import dma-bufs
            (``CUDA_ERROR_NOT_SUPPORTED`` from ``cuImportExternalMemory``, as
            on driver 580 with H200).
        CudaError: any other driver failure.
    """
    fd = fd_or_dmabuf.fd if isinstance(fd_or_dmabuf, OwnedFd) else fd_or_dmabuf  # DmaBuf is an OwnedFd
    info = dmabuf_info(fd)  # NotADmaBufError for anything else
    size = byte_count(size)
    offset = byte_offset(offset)
    if offset + size > info.size:
        raise InvalidArgumentError(
            f"offset {offset} + size {size} = {offset + size} bytes exceeds the dma-buf's {info.size} bytes")
    driver.set_current(device)
    with Transaction() as tx:
        own = DmaBuf(os.dup(fd), info.size)
        tx.push(own.close)  # runs last
        ext = driver.import_external_memory_dmabuf(own.fd, info.size)
        tx.push(driver.destroy_external_memory, ext)
        ptr = driver.external_memory_mapped_buffer(ext, offset, size)
        tx.push(_free_on, device, driver.mem_free, ptr)  # runs first
        return ImportedBuffer(mechanism="dmabuf", ptr=ptr, size=size, device=device, cleanups=tx.commit())


class DmaBufMechanism(Mechanism):
    """dma-buf: the CUDA sample's path. ``memory`` is ``"host"`` (``cuMemAllocHost``) or ``"device"``."""

    name = "dmabuf"

    def __init__(self, memory: str = "host") -> None:
        if memory not in ("host", "device"):
            raise InvalidArgumentError(f"memory must be 'host' or 'device', got {memory!r}")
        self.memory = memory
        self.gate_attribute = "HOST_ALLOC_DMA_BUF_SUPPORTED" if memory == "host" else "DMA_BUF_SUPPORTED"
        self.pair_attributes = (self.gate_attribute, "DMA_BUF_SUPPORTED")

    def export(self, size: int, device: int) -> ExportedBuffer:
        return (export_host if self.memory == "host" else export_device)(size, device)

    def import_(self, fd: int, descriptor: ShareDescriptor, device: int) -> ImportedBuffer:
        return import_dmabuf(fd, descriptor.size, device, descriptor.offset)
