"""Switch sharing mechanism by name: ``dmabuf``, ``posix-fd`` or ``memfd``.

Each :class:`Mechanism` composes the library's exporter, importer and pattern
calls behind one interface, so the demos, the benchmark and user code can run
the same steps over any of them:

=========  ===================================================  ==================================
name       exporter                                             importer
=========  ===================================================  ==================================
dmabuf     :func:`~.exporter.export_host` / ``export_device``   :func:`~.importer.import_dmabuf`
posix-fd   :func:`~.vmm.export_posix_fd`                        :func:`~.vmm.import_posix_fd`
memfd      :func:`~.memfd.export_memfd`                         :func:`~.memfd.import_memfd`
=========  ===================================================  ==================================
"""

from __future__ import annotations

from typing import Any

from . import capabilities
from .buffers import MECHANISM_NAMES, ExportedBuffer, ImportedBuffer
from .errors import InvalidArgumentError

__all__ = ["Mechanism", "DmaBufMechanism", "PosixFdMechanism", "MemfdMechanism", "get_mechanism", "export_shareable",
           "import_shared"]


class Mechanism:
    """One way to share memory through an fd.

    Attributes:
        name: the ``--mechanism`` name.
        label: what is shared (``"dma-buf"``, ``"POSIX-fd handle"``...).
        fd_label: how output names its fds (``"dma-buf fd"``, ``"POSIX fd"``...).
        uses_cuda: whether the CUDA driver is needed.
        gate_attribute: the device attribute that must be 1 (``None``: no gate).
        pair_attributes: ``(producer, consumer)`` attributes for a cross-GPU pair.
    """

    name = ""
    label = ""
    fd_label = ""
    uses_cuda = True
    gate_attribute: str | None = None
    pair_attributes: tuple[str, str] | None = None
    need_peer_access = False

    @property
    def import_line(self) -> str:
        """What the importer prints once the memory is mapped."""
        return f"imported {self.label} as device pointer"

    def export(self, size: int, device: int) -> ExportedBuffer:
        raise NotImplementedError

    def import_(self, fd: int, meta: dict[str, Any], device: int) -> ImportedBuffer:
        raise NotImplementedError

    def write_pattern(self, exported: ExportedBuffer) -> None:
        """Write ``0x1000 + i`` and finish before returning (safe to send the fd)."""
        from .kernels import write_pattern

        write_pattern(exported.ptr, exported.size, exported.device)  # synchronises its stream

    def count_mismatches(self, imported: ImportedBuffer) -> int:
        from .kernels import count_mismatches

        return count_mismatches(imported.ptr, imported.size, imported.device)

    def gate(self, device: int) -> str | None:
        """``None`` when ``device`` may run the demos, else the skip line."""
        if self.gate_attribute is None:
            return None
        if capabilities.attribute(device, self.gate_attribute) != 1:
            return f"Device {device} does not report CU_DEVICE_ATTRIBUTE_{self.gate_attribute}. Skipping sample."
        return None

    def pair(self) -> tuple[int, int] | None:
        """The cross-GPU ``(producer, consumer)`` pair, deterministic across processes."""
        if self.pair_attributes is None:
            return None
        producer, consumer = self.pair_attributes
        return capabilities.find_cross_gpu_pair(producer, consumer, need_peer_access=self.need_peer_access)

    def no_pair_reason(self) -> str:
        return "no GPU pair satisfies the capability attributes. Skipping."


class DmaBufMechanism(Mechanism):
    """dma-buf: the CUDA sample's path. ``memory`` is ``"host"`` (``cuMemAllocHost``) or ``"device"``."""

    name = "dmabuf"
    label = "dma-buf"
    fd_label = "dma-buf fd"

    def __init__(self, memory: str = "host") -> None:
        if memory not in ("host", "device"):
            raise InvalidArgumentError(f"memory must be 'host' or 'device', got {memory!r}")
        self.memory = memory
        self.gate_attribute = "HOST_ALLOC_DMA_BUF_SUPPORTED" if memory == "host" else "DMA_BUF_SUPPORTED"
        self.pair_attributes = (self.gate_attribute, "DMA_BUF_SUPPORTED")

    def export(self, size: int, device: int) -> ExportedBuffer:
        from .exporter import export_device, export_host

        return (export_host if self.memory == "host" else export_device)(size, device)

    def import_(self, fd: int, meta: dict[str, Any], device: int) -> ImportedBuffer:
        from .importer import import_dmabuf

        return import_dmabuf(fd, int(meta["size"]), device, int(meta.get("offset", 0)))

    def no_pair_reason(self) -> str:
        return "no GPU pair satisfies the dma-buf capability attributes. Skipping."


class PosixFdMechanism(Mechanism):
    """CUDA VMM allocations shared as POSIX-fd shareable handles."""

    name = "posix-fd"
    label = "POSIX-fd handle"
    fd_label = "POSIX fd"
    gate_attribute = "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED"
    pair_attributes = ("HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED")
    need_peer_access = True

    def export(self, size: int, device: int) -> ExportedBuffer:
        from .vmm import export_posix_fd

        return export_posix_fd(size, device)

    def import_(self, fd: int, meta: dict[str, Any], device: int) -> ImportedBuffer:
        from .vmm import import_posix_fd

        return import_posix_fd(fd, int(meta["size"]), device, int(meta.get("offset", 0)),
                               meta.get("export_size"))

    def no_pair_reason(self) -> str:
        return "no GPU pair supports POSIX-fd handles with peer access. Skipping."


class MemfdMechanism(Mechanism):
    """Host shared memory (``memfd_create`` + ``mmap``), NumPy write and verify; no GPU."""

    name = "memfd"
    label = "host shared memory (memfd)"
    fd_label = "host shared memory (memfd) fd"
    uses_cuda = False
    import_line = "mapped host shared memory (memfd) into this process"  # type: ignore[assignment]

    def export(self, size: int, device: int) -> ExportedBuffer:
        """:func:`~.memfd.export_memfd`, after checking that the pattern (every byte is
        written) fits in ``MemAvailable`` from ``/proc/meminfo``."""
        from .memfd import export_memfd

        avail = _mem_available()
        if avail is not None and size > avail:
            raise InvalidArgumentError(
                f"{size} bytes of host shared memory is more than this machine has available "
                f"({avail} bytes, MemAvailable in /proc/meminfo); the demo writes every byte")
        return export_memfd(size)

    def import_(self, fd: int, meta: dict[str, Any], device: int) -> ImportedBuffer:
        from .memfd import import_memfd

        return import_memfd(fd, int(meta["size"]), int(meta.get("offset", 0)))

    def write_pattern(self, exported: ExportedBuffer) -> None:
        from .memfd import write_pattern_host

        write_pattern_host(exported)

    def count_mismatches(self, imported: ImportedBuffer) -> int:
        from .memfd import count_mismatches_host

        return count_mismatches_host(imported)

    def no_pair_reason(self) -> str:
        return "host shared memory involves no GPU. Skipping."


def _mem_available() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes, or ``None`` when unreadable."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def get_mechanism(name: str, memory: str = "host") -> Mechanism:
    """The :class:`Mechanism` called ``name`` (one of ``MECHANISM_NAMES``).

    Raises:
        InvalidArgumentError: an unknown name or memory kind.
    """
    if name == "dmabuf":
        return DmaBufMechanism(memory)
    if name == "posix-fd":
        return PosixFdMechanism()
    if name == "memfd":
        return MemfdMechanism()
    raise InvalidArgumentError(f"unknown mechanism {name!r}; choose from {', '.join(MECHANISM_NAMES)}")


_probe_cache: dict[tuple[int, int], dict[str, Any]] = {}

# The probes that must pass for a mechanism to work end to end on one device.
_NEEDS = {
    "dmabuf": ("device_dmabuf_export", "dmabuf_import"),
    "posix-fd": ("posix_fd_export", "posix_fd_import"),
    "memfd": (),
}


def _why_not(name: str, device: int) -> str | None:
    import os

    key = (os.getpid(), device)
    if key not in _probe_cache:
        _probe_cache[key] = capabilities.probe_device(device)
    probes = _probe_cache[key]
    for need in _NEEDS[name]:
        p = probes[need]
        if p.status != "ok":
            return f"{name}: {need.replace('_', ' ')}: {p.call + ' -> ' if p.call else ''}{p.result or p.detail}"
    return None


def export_shareable(size: int, device: int = 0, prefer: tuple[str, ...] = ("dmabuf", "posix-fd")
                     ) -> ExportedBuffer:
    """Export ``size`` bytes with the first mechanism in ``prefer`` that works end to end here.

    "Works" is decided by :func:`~.capabilities.probe_device` (a one-page
    export and import, run once per process and device). The returned
    buffer's :attr:`~.buffers.ExportedBuffer.fallback` says why each earlier
    mechanism was passed over, e.g. ``"dmabuf: dmabuf import:
    cuImportExternalMemory -> CUDA_ERROR_NOT_SUPPORTED"`` on H200 with driver
    580; ``dmabuf`` exports device memory (``cuMemAlloc``).

    Raises:
        NotSupportedError: no mechanism in ``prefer`` works; the message lists why.
        InvalidArgumentError: an unknown mechanism name.
    """
    from .errors import NotSupportedError

    reasons: list[str] = []
    for name in prefer:
        mech = get_mechanism(name, "device")
        why = _why_not(name, device) if mech.uses_cuda else None
        if why is None:
            exported = mech.export(size, device)
            exported.fallback = "; ".join(reasons) or None
            return exported
        reasons.append(why)
    raise NotSupportedError("export_shareable", "no usable mechanism", -1, "; ".join(reasons))


def import_shared(fd: int, meta: dict[str, Any], device: int = 0) -> ImportedBuffer:
    """Import what an exporter sent: dispatch on ``meta["mechanism"]`` (its ``describe()``).

    Raises:
        InvalidArgumentError: the metadata names no known mechanism.
        NotSupportedError, CudaError: from the mechanism's importer.
    """
    name = meta.get("mechanism")
    if name not in MECHANISM_NAMES:
        raise InvalidArgumentError(f"metadata names no known mechanism: {name!r}")
    return get_mechanism(name, "device").import_(fd, meta, device)
