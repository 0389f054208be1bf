"""CUDA VMM POSIX-fd shareable handles: the mechanism that works where dma-buf import does not.

Exporter (:func:`export_posix_fd`): ``cuMemCreate`` with
``requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`` of the size
rounded up to the allocation granularity (``cuMemGetAllocationGranularity``,
2 MiB on H200), ``cuMemAddressReserve``, ``cuMemMap``, ``cuMemSetAccess``, then
``cuMemExportToShareableHandle`` for the fd.

Importer (:func:`import_posix_fd`): ``cuMemImportFromShareableHandle``,
``cuMemAddressReserve``, ``cuMemMap``, ``cuMemSetAccess`` for the importing
device. When that device is not the one holding the memory, it needs peer
access (``cuDeviceCanAccessPeer``); the access descriptor grants it.

fd ownership: ``cuMemImportFromShareableHandle`` does not take the fd (CUDA
Driver API, "Virtual Memory Management"); the imported allocation handle
keeps the memory alive, so the caller may close its fd right after import.

Reference: CUDA Driver API "Virtual Memory Management" and the CUDA
Programming Guide, "Virtual Memory Management".
"""

from __future__ import annotations

from typing import Sequence

from .. import _driver as driver
from .._checks import byte_count, byte_offset
from .._checks import round_up as _round_up
from ..buffers import ExportedBuffer, ImportedBuffer, Transaction
from ..descriptor import ShareDescriptor
from ..errors import CudaError, InvalidArgumentError, NotSupportedError
from ..fd import OwnedFd, fd_is_open, fd_kind
from ._base import Mechanism

__all__ = ["export_posix_fd", "import_posix_fd", "import_posix_fd_parts", "granularity", "vmm_pages",
           "PosixFdMechanism"]


def _unmap(device: int, ptr: int, size: int) -> None:
    driver.set_current(device)
    driver.vmm_unmap(ptr, size)


def _not_a_handle(fd: int) -> str | None:
    """What ``fd`` is when it can be told in user space that it is no CUDA POSIX-fd handle
    (a pipe, socket, dma-buf, memfd or file); ``None`` when only the driver can tell.

    The driver's own answer for such fds is an unhelpful ``CUDA_ERROR_UNKNOWN``
    (H200, driver 580). Its handles are character-device or anonymous-inode
    files, never FIFOs, sockets or regular files.
    """
    kind = fd_kind(fd)
    return {"pipe": "a pipe", "socket": "a socket", "dma-buf": "a dma-buf (import it with import_dmabuf)",
            "memfd": "a memfd (map it with import_memfd)", "file": "a file", "directory": "a directory",
            "block device": "a block device"}.get(kind)


def vmm_pages(ptr: int, end: int) -> list[tuple[int, int]] | None:
    """The ``cuMemCreate`` allocations ``(address, size)`` mapped back to back over ``[ptr, end)``, in
    address order, or ``None`` when ``ptr`` is not in such a mapping (``cudaMalloc`` memory, say).

    For memory mapped with ``cuMemMap``, ``cuMemGetAddressRange`` reports only the allocation that
    holds the address, not the reservation, and ``cuMemRetainAllocationHandle`` succeeds only on
    such mappings (CUDA Driver API, "Virtual Memory Management"): the walk goes allocation by
    allocation until ``end`` is covered.

    Raises:
        InvalidArgumentError: a hole (nothing mapped) inside the range.
        CudaError: ``cuMemRelease`` failed.
    """
    try:
        handle = driver.vmm_retain_handle(ptr)
    except CudaError:
        return None
    driver.vmm_release(handle)
    base, size = driver.mem_address_range(ptr)
    pages = [(base, size)]
    at = base + size
    while at < end:
        try:
            base, size = driver.mem_address_range(at)
        except CudaError as exc:
            raise InvalidArgumentError(
                f"[0x{ptr:x}, 0x{end:x}) is not mapped all through: nothing is mapped at 0x{at:x}, "
                f"after the cuMemCreate chunk that ends there") from exc
        if base != at or size <= 0:  # pragma: no cover - a chunk always starts where it is mapped
            raise InvalidArgumentError(f"unexpected VMM layout at 0x{at:x}: [0x{base:x}, +{size})")
        pages.append((base, size))
        at = base + size
    return pages


def granularity(device: int = 0) -> int:
    """Minimum ``cuMemCreate`` granularity, in bytes, for a POSIX-fd-exportable allocation."""
    driver.set_current(device)
    return driver.vmm_granularity(device)


def export_posix_fd(size: int, device: int = 0) -> ExportedBuffer:
    """Allocate VMM device memory and export it as a POSIX-fd shareable handle.

    Args:
        size: bytes the caller needs (> 0); the allocation is rounded up to the
            granularity (``export_size``).
        device: CUDA ordinal that holds the memory.

    Returns:
        ExportedBuffer(mechanism="posix-fd", memory="vmm", offset=0), mapped and
        accessible on ``device``; it owns the mapping, the reservation, the
        physical allocation and the fd.

    Raises:
        NotSupportedError: the device does not support POSIX-fd handles.
        CudaError: any driver failure (e.g. ``CUDA_ERROR_OUT_OF_MEMORY``).
        InvalidArgumentError: size <= 0 or a bad ordinal.
    """
    size = byte_count(size)
    driver.set_current(device)
    gran = driver.vmm_granularity(device)
    export_size = _round_up(size, gran)
    uuid = driver.device_uuid(device)
    with Transaction() as tx:
        handle = driver.vmm_create(device, export_size)
        tx.push(driver.vmm_release, handle)
        ptr = driver.vmm_reserve(export_size, gran)
        tx.push(driver.vmm_address_free, ptr, export_size)
        driver.vmm_map(ptr, export_size, handle)
        tx.push(_unmap, device, ptr, export_size)
        driver.vmm_set_access(ptr, export_size, [device])
        fd = OwnedFd(driver.vmm_export_posix_fd(handle))
        tx.push(fd.close)
        return ExportedBuffer(mechanism="posix-fd", memory="vmm", handle=fd, ptr=ptr, size=size, offset=0,
                              export_size=export_size, device=device, device_uuid=uuid, cleanups=tx.commit())


def import_posix_fd(fd: int | OwnedFd, size: int, device: int = 0, offset: int = 0,
                    export_size: int | None = None, *, device_uuid: str | None = None) -> ImportedBuffer:
    """Import a POSIX-fd shareable handle and map it on ``device``.

    Args:
        fd: the received fd (or its :class:`~.fd.OwnedFd`); not consumed.
        size: the caller's bytes (> 0).
        device: CUDA ordinal of the importing device.
        offset: where the caller's bytes start in the allocation.
        export_size: the exporter's allocation size; default
            ``round_up(offset + size, granularity)``.
        device_uuid: the exporter's GPU UUID (``ShareDescriptor.device_uuid``); when given, a GPU
            this process cannot see is refused before the driver is asked.

    Returns:
        ImportedBuffer(mechanism="posix-fd") with ``ptr`` = mapping base + offset.

    Raises:
        InvalidArgumentError: a closed fd, an fd that is visibly no CUDA handle
            (pipe, socket, dma-buf, memfd, file), size <= 0, offset < 0, a bad
            ordinal, or ``offset + size`` beyond ``export_size``.
        NotSupportedError: the importing device cannot reach the memory's device
            (no peer access), this process cannot see the exporter's GPU (the message names
            its UUID and ``CUDA_VISIBLE_DEVICES``), or the driver refuses the handle type.
        CudaError: any other driver failure (e.g. the fd is not a CUDA handle:
            ``CUDA_ERROR_INVALID_VALUE``).
    """
    raw = _handle_fd(fd)
    size = byte_count(size)
    offset = byte_offset(offset)
    if export_size is not None:
        export_size = byte_count(export_size, "export_size")
        if offset + size > export_size:  # known before the driver is asked
            raise InvalidArgumentError(f"offset {offset} + size {size} exceeds the allocation's {export_size} bytes")
    driver.set_current(device)
    if device_uuid and driver.ordinal_for_uuid(device_uuid) is None:
        raise NotSupportedError(driver.invisible_gpu_text(device_uuid))
    with Transaction() as tx:
        handle = driver.vmm_import_posix_fd(raw)
        tx.push(driver.vmm_release, handle)
        owner = driver.vmm_allocation_device(handle)
        _check_reachable(owner, device, device_uuid or "holding this memory")
        gran = driver.vmm_granularity(owner)
        map_size = export_size if export_size is not None else _round_up(offset + size, gran)
        ptr = driver.vmm_reserve(map_size, gran)
        tx.push(driver.vmm_address_free, ptr, map_size)
        driver.vmm_map(ptr, map_size, handle)
        tx.push(_unmap, device, ptr, map_size)
        driver.vmm_set_access(ptr, map_size, [device])
        return ImportedBuffer(mechanism="posix-fd", ptr=ptr + offset, size=size, device=device,
                              cleanups=tx.commit())


def _check_reachable(owner: int, device: int, gpu: str) -> None:
    """Refuse memory on ``owner`` that ``device`` cannot map: a GPU this process cannot see (the
    driver's location for one it hides; ``gpu`` names it in the message) or one without peer access.

    Raises:
        NotSupportedError: either case.
    """
    if not 0 <= owner < driver.device_count():
        raise NotSupportedError(driver.invisible_gpu_text(gpu))
    if owner != device and not driver.can_access_peer(device, owner):
        raise NotSupportedError(f"cuDeviceCanAccessPeer -> 0: device {device} cannot access memory on "
                                f"device {owner}")


def _handle_fd(fd: int | OwnedFd) -> int:
    raw = fd.fd if isinstance(fd, OwnedFd) else fd
    if not fd_is_open(raw):
        raise InvalidArgumentError(f"fd {raw!r} is not an open file descriptor")
    kind = _not_a_handle(raw)
    if kind is not None:
        raise InvalidArgumentError(f"fd {raw} is not a CUDA POSIX-fd handle: it is {kind}")
    return raw


def import_posix_fd_parts(fds: Sequence[int | OwnedFd], sizes: Sequence[int], device: int = 0) -> ImportedBuffer:
    """Import several POSIX-fd shareable handles and map them side by side in one reservation.

    The exporter's memory was several ``cuMemCreate`` allocations mapped back to
    back (torch's expandable segments map one per 2 or 20 MiB page); this gives
    the importer the same contiguous bytes: ``cuMemImportFromShareableHandle``
    per fd, one ``cuMemAddressReserve`` of ``sum(sizes)``, ``cuMemMap`` of each
    part at its offset, one ``cuMemSetAccess`` (CUDA Driver API, "Virtual
    Memory Management").

    Args:
        fds: the received fds, in address order (not consumed).
        sizes: each part's size in bytes, a multiple of the granularity (2 MiB on H200).
        device: CUDA ordinal of the importing device.

    Returns:
        ImportedBuffer(mechanism="posix-fd") of ``sum(sizes)`` bytes at the reservation's start.

    Raises:
        InvalidArgumentError: no fds, ``len(fds) != len(sizes)``, an fd that is closed or visibly no
            CUDA handle, a size that is not a positive multiple of the granularity, or parts on
            different devices.
        NotSupportedError: the importing device cannot reach the memory's device (no peer access).
        CudaError: any other driver failure (e.g. a size larger than the allocation:
            ``CUDA_ERROR_INVALID_VALUE`` from ``cuMemMap``).
    """
    if not fds or len(fds) != len(sizes):
        raise InvalidArgumentError(f"{len(fds)} fds for {len(sizes)} sizes: one fd per part, at least one")
    raws = [_handle_fd(fd) for fd in fds]
    sizes = [byte_count(n) for n in sizes]
    total = sum(sizes)
    driver.set_current(device)
    with Transaction() as tx:
        handles = []
        for raw in raws:
            handle = driver.vmm_import_posix_fd(raw)
            tx.push(driver.vmm_release, handle)
            handles.append(handle)
        owners = {driver.vmm_allocation_device(h) for h in handles}
        if len(owners) != 1:
            raise InvalidArgumentError(f"the parts lie on devices {sorted(owners)}, not one")
        owner = owners.pop()
        _check_reachable(owner, device, "holding this memory")
        gran = driver.vmm_granularity(owner)
        if any(n % gran for n in sizes):
            raise InvalidArgumentError(f"part sizes {sizes[:8]} are not multiples of the {gran}-byte granularity")
        ptr = driver.vmm_reserve(total, gran)
        tx.push(driver.vmm_address_free, ptr, total)
        off = 0
        for handle, n in zip(handles, sizes):
            driver.vmm_map(ptr + off, n, handle)
            tx.push(_unmap, device, ptr + off, n)
            off += n
        driver.vmm_set_access(ptr, total, [device])
        return ImportedBuffer(mechanism="posix-fd", ptr=ptr, size=total, device=device, cleanups=tx.commit())


class PosixFdMechanism(Mechanism):
    """CUDA VMM allocations shared as POSIX-fd shareable handles."""

    name = "posix-fd"
    gate_attribute = "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"
    pair_attributes = ("HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED")
    need_peer_access = True

    def export(self, size: int, device: int) -> ExportedBuffer:
        return export_posix_fd(size, device)

    def import_(self, fd: int, descriptor: ShareDescriptor, device: int) -> ImportedBuffer:
        return import_posix_fd(fd, descriptor.size, device, descriptor.offset, descriptor.export_size,
                               device_uuid=descriptor.device_uuid or None)
