"""The one registry of names: sharing mechanisms, memory kinds and probe keys.

The CLI's choices, the descriptor's validation, the benchmark's lists and the
``info`` report all derive from these enums. Each member is also a ``str``,
so it compares equal to its name and serialises to JSON as one.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["MechanismName", "MemoryKind", "ProbeKey", "MECHANISM_NAMES", "MEMORY_KINDS", "PROBE_KEYS"]


class _Name(str, Enum):
    def __str__(self) -> str:
        return self.value


class MechanismName(_Name):
    """How memory is shared through an fd."""

    DMABUF = "dmabuf"        #: Linux dma-buf (``cuMemGetHandleForAddressRange`` / ``cuImportExternalMemory``)
    POSIX_FD = "posix-fd"    #: CUDA VMM POSIX-fd shareable handle (``cuMemExportToShareableHandle``)
    MEMFD = "memfd"          #: host shared memory (``memfd_create`` + ``mmap``), no GPU


class MemoryKind(_Name):
    """What backs an exported buffer."""

    HOST = "host"      #: pinned host memory, ``cuMemAllocHost``
    DEVICE = "device"  #: device memory, ``cuMemAlloc``
    VMM = "vmm"        #: a ``cuMemCreate`` allocation
    RANGE = "range"    #: part of an allocation someone else made (``export_range``)
    MEMFD = "memfd"    #: a memfd


class ProbeKey(_Name):
    """The active probes of :func:`~dmabuf_interop.capabilities.probe_device`, in report order."""

    HOST_DMABUF_EXPORT = "host_dmabuf_export"
    DEVICE_DMABUF_EXPORT = "device_dmabuf_export"
    VMM_DMABUF_EXPORT = "vmm_dmabuf_export"
    DMABUF_IMPORT = "dmabuf_import"
    POSIX_FD_EXPORT = "posix_fd_export"
    POSIX_FD_IMPORT = "posix_fd_import"
    POSIX_FD_IMPORT_PEER = "posix_fd_import_peer"


#: Mechanism names as plain strings, in order of preference.
MECHANISM_NAMES: tuple[str, ...] = tuple(m.value for m in MechanismName)
#: Memory kinds as plain strings.
MEMORY_KINDS: tuple[str, ...] = tuple(m.value for m in MemoryKind)
#: Probe keys as plain strings, in report order.
PROBE_KEYS: tuple[str, ...] = tuple(p.value for p in ProbeKey)
