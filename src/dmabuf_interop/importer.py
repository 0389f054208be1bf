"""dma-buf importer: map a dma-buf fd into a CUDA context.

``cuImportExternalMemory`` with ``CU_EXTERNAL_MEMORY_HANDLE_TYPE_DMABUF_FD``,
then ``cuExternalMemoryGetMappedBuffer`` (CUDA Driver API, "External Resource
Interoperability"). Closing unmaps with ``cuMemFree`` on the mapped pointer,
then ``cuDestroyExternalMemory``, as the driver API documents for mapped
buffers.

fd ownership: the Driver API documents a transfer of ownership to the driver
only for ``CU_EXTERNAL_MEMORY_HANDLE_TYPE_OPAQUE_FD`` ("Ownership of the file
descriptor is transferred to the CUDA driver when the handle is imported
successfully"); it states no such transfer for ``DMABUF_FD``, and NVIDIA's
dmabufInterop sample closes its fd itself, after ``cuDestroyExternalMemory``.
So :func:`import_dmabuf` never takes the caller's fd: it imports a
``dup()`` that the :class:`~.buffers.ImportedBuffer` owns and closes after
``cuDestroyExternalMemory``. The caller closes its own fd whenever it likes.

Everything that can be checked in user space is checked before the driver is
called: the fd is a dma-buf, ``size`` > 0, ``offset`` >= 0, and ``offset +
size`` fits inside the dma-buf's size from ``/proc/self/fdinfo``.
"""

from __future__ import annotations

import os

from . import driver
from .buffers import ImportedBuffer
from .dmabuf import DmaBuf, dmabuf_info
from .errors import InvalidArgumentError
from .fd import OwnedFd

__all__ = ["import_dmabuf"]


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
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise InvalidArgumentError(f"size must be > 0 bytes, got {size!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidArgumentError(f"offset must be >= 0 bytes, got {offset!r}")
    if offset + size > info.size:
        raise InvalidArgumentError(
            f"offset {offset} + size {size} = {offset + size} bytes exceeds the dma-buf's {info.size} bytes")
    driver.set_current(device)
    own = DmaBuf(os.dup(fd), info.size)
    try:
        ext = driver.import_external_memory_dmabuf(own.fd, info.size)
    except BaseException:
        own.close()
        raise
    try:
        ptr = driver.external_memory_mapped_buffer(ext, offset, size)
    except BaseException:
        driver.destroy_external_memory(ext)
        own.close()
        raise
    buf = ImportedBuffer(mechanism="dmabuf", ptr=ptr, size=size, device=device)
    buf._push(own.close)  # runs last
    buf._push(lambda: driver.destroy_external_memory(ext))
    buf._push(lambda: (driver.set_current(device), driver.mem_free(ptr)))  # runs first
    return buf
