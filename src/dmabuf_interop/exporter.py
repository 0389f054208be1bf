"""dma-buf exporters: turn CUDA memory into a dma-buf fd.

All three use ``cuMemGetHandleForAddressRange(...,
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
"""

from __future__ import annotations

import os
from typing import Any, Callable

from . import driver
from .buffers import ExportedBuffer
from .dmabuf import DmaBuf
from .errors import AlignmentError, CudaError, InvalidArgumentError, NotSupportedError

__all__ = ["page_size", "export_host", "export_device", "export_range", "pointer_and_size"]


def page_size() -> int:
    """The host page size in bytes (the alignment ``cuMemGetHandleForAddressRange`` needs)."""
    return os.sysconf("SC_PAGE_SIZE")


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _check_size(size: int) -> int:
    if isinstance(size, bool) or not isinstance(size, int):
        raise InvalidArgumentError(f"size must be an int number of bytes, got {type(size).__name__}")
    if size <= 0:
        raise InvalidArgumentError(f"size must be > 0 bytes, got {size}")
    return size


def _dmabuf_for(ptr: int, size: int, device: int, attribute: str | None) -> DmaBuf:
    """Export ``[ptr, ptr+size)``; explain a failure with the capability attribute
    (``None``: decided from the pointer's memory type, only when the export failed)."""
    try:
        fd = driver.get_dmabuf_fd(ptr, size)
    except CudaError as exc:
        if attribute is None:
            attribute = "HOST_ALLOC_DMA_BUF_SUPPORTED" if driver.pointer_is_host(ptr) else "DMA_BUF_SUPPORTED"
        try:
            supported = driver.device_attribute(device, attribute)
        except CudaError:
            supported = None
        if supported == 0 or isinstance(exc, NotSupportedError):
            raise NotSupportedError(
                exc.call, exc.result, exc.code,
                f"device {device} reports CU_DEVICE_ATTRIBUTE_{attribute}={supported}",
            ) from exc
        raise
    return DmaBuf(fd, size)


def _export_allocation(size: int, device: int, memory: str, attribute: str,
                       alloc: Callable[[int], int], free: Callable[[int], None]) -> ExportedBuffer:
    """Allocate ``round_up(size, page) + page`` bytes, round the base up to a page and
    export ``round_up(size, page)`` bytes from there as a dma-buf."""
    _check_size(size)
    driver.set_current(device)
    uuid = driver.device_uuid(device)
    page = page_size()
    export_size = _round_up(size, page)
    raw = alloc(export_size + page)
    base = _round_up(raw, page)
    try:
        dmabuf = _dmabuf_for(base, export_size, device, attribute)
    except BaseException:
        free(raw)
        raise
    buf = ExportedBuffer(mechanism="dmabuf", memory=memory, handle=dmabuf, ptr=base, size=size, offset=0,
                         export_size=export_size, device=device, device_uuid=uuid)
    buf._push(lambda: (driver.set_current(device), free(raw)))
    buf._push(dmabuf.close)  # closes first
    return buf


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
        CudaError, InvalidArgumentError: as :func:`export_host`.
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
        return obj, _check_size(size), None
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
        nbytes = _check_size(size)
    return int(view.ptr), _check_size(nbytes), (obj, view)


def _vmm_chunks_after(ptr: int, chunk_end: int, end: int) -> tuple[list[int], int] | None:
    """``(boundaries, extent_end)``: the chunk boundaries crossed by ``[ptr, end)`` in CUDA
    VMM memory and where the last chunk ends, or ``None`` when ``ptr`` is not VMM memory.

    For memory mapped with ``cuMemMap``, ``cuMemGetAddressRange`` reports only
    the ``cuMemCreate`` chunk that holds the address, not the reservation
    (``cuMemRetainAllocationHandle`` succeeds only on such mappings). Walk the
    chunks mapped after ``chunk_end`` until ``end`` is covered.

    Raises:
        InvalidArgumentError: a hole (nothing mapped) inside the range.
    """
    try:
        handle = driver.vmm_retain_handle(ptr)
    except CudaError:
        return None
    driver.vmm_release(handle)
    boundaries = []
    while chunk_end < end:
        try:
            base, size = driver.mem_address_range(chunk_end)
        except CudaError as exc:
            raise InvalidArgumentError(
                f"[0x{ptr:x}, 0x{end:x}) is not mapped all through: nothing is mapped at 0x{chunk_end:x}, "
                f"after the cuMemCreate chunk that ends there") from exc
        if base != chunk_end or size <= 0:  # pragma: no cover - a chunk always starts where it is mapped
            raise InvalidArgumentError(f"unexpected VMM layout at 0x{chunk_end:x}: [0x{base:x}, +{size})")
        boundaries.append(chunk_end)
        chunk_end = base + size
    return boundaries, chunk_end


def export_range(obj: Any, size: int | None = None) -> ExportedBuffer:
    """Export the page-aligned range that encloses a caller's bytes as a dma-buf.

    A tensor from a caching allocator rarely starts on a page. The exported
    range is ``[round_down(ptr, page), round_up(ptr + size, page))``; the
    returned :attr:`~.ExportedBuffer.offset` is ``ptr - round_down(ptr, page)``,
    so an importer that maps at that offset reads exactly the caller's bytes.
    The range must stay inside the allocation that holds ``ptr``
    (``cuMemGetAddressRange``). The buffer keeps ``obj`` alive but does not
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
        InvalidArgumentError: the range runs past its allocation, or through
            unmapped VMM addresses.
        NotSupportedError: the device cannot export this memory as a dma-buf,
            or the driver exported only part of a multi-chunk VMM range.
        CudaError: ``cuMemGetAddressRange`` or the export failed (for a
            multi-chunk range the detail names the chunk boundaries).
    """
    ptr, nbytes, keep = pointer_and_size(obj, size)
    driver.init()
    try:
        device = driver.pointer_device_ordinal(ptr)
    except CudaError as exc:
        if exc.result != "CUDA_ERROR_INVALID_VALUE":
            raise
        raise CudaError(exc.call, exc.result, exc.code,
                        f"0x{ptr:x} is not memory that CUDA knows: a host pointer CUDA did not allocate, "
                        f"or memory already freed") from exc
    driver.set_current(device)
    base, alloc_size = driver.mem_address_range(ptr)
    page = page_size()
    start = ptr // page * page
    end = _round_up(ptr + nbytes, page)
    limit = base + alloc_size
    boundaries: list[int] = []
    if ptr + nbytes > limit:
        chunks = _vmm_chunks_after(ptr, limit, ptr + nbytes)
        if chunks is None:
            raise InvalidArgumentError(
                f"[0x{ptr:x}, +{nbytes}) runs past its allocation [0x{base:x}, +{alloc_size})")
        boundaries, limit = chunks
    if start < base or end > limit:
        raise AlignmentError(
            f"cuMemGetHandleForAddressRange needs a {page}-byte page-aligned range; the pages enclosing "
            f"[0x{ptr:x}, +{nbytes}) are [0x{start:x}, 0x{end:x}), which leave the allocation "
            f"[0x{base:x}, 0x{limit:x}) (base misaligned by {ptr % page} bytes, "
            f"end by {(ptr + nbytes) % page} bytes)")
    crossing = ", ".join(f"0x{b:x}" for b in boundaries)
    try:
        dmabuf = _dmabuf_for(start, end - start, device, None)
    except CudaError as exc:
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
        raise NotSupportedError("cuMemGetHandleForAddressRange", "partial export", -1,
                                f"the driver exported {got} of the {end - start} bytes of [0x{start:x}, 0x{end:x})"
                                f"{where}")
    buf = ExportedBuffer(mechanism="dmabuf", memory="range", handle=dmabuf, ptr=ptr, size=nbytes,
                         offset=ptr - start, export_size=end - start, device=device,
                         device_uuid=driver.device_uuid(device))
    buf._keepalive = keep  # type: ignore[attr-defined]
    buf.chunk_boundaries = boundaries  # type: ignore[attr-defined]
    buf._push(dmabuf.close)
    return buf
