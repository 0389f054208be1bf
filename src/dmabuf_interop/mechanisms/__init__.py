"""The sharing mechanisms, side by side behind one interface, and the one registry of them.

=========  =========================  ==========================================================
name       module                     exporter / importer
=========  =========================  ==========================================================
dmabuf     :mod:`.dmabuf`             ``export_host`` / ``export_device`` / ``export_range`` / ``import_dmabuf``
posix-fd   :mod:`.posix_fd`           ``export_posix_fd`` / ``import_posix_fd``
memfd      :mod:`.memfd`              ``export_memfd`` / ``import_memfd``
=========  =========================  ==========================================================

Each module also defines its :class:`~._base.Mechanism` (export, import,
gate), so the demos, the benchmark and user code run the same steps over any
of them. :func:`choose` names the first in :data:`PREFERENCE` that works end
to end here (decided by :mod:`.probes`, the probes ``dmabuf-interop info``
shows) and why each before it was passed over; :func:`export_shareable`
exports with it, and :func:`import_shared` dispatches on the
received :class:`~dmabuf_interop.descriptor.ShareDescriptor`.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ..buffers import ExportedBuffer, ImportedBuffer
from ..descriptor import ShareDescriptor
from ..errors import InvalidArgumentError, NotSupportedError
from ..kinds import MECHANISM_NAMES, MechanismName, MemoryKind, ProbeKey
from ._base import Mechanism
from .dmabuf import DmaBufMechanism
from .memfd import MemfdMechanism
from .posix_fd import PosixFdMechanism
from .probes import Probe, probe_device

__all__ = ["Mechanism", "DmaBufMechanism", "PosixFdMechanism", "MemfdMechanism", "get_mechanism",
           "export_shareable", "import_shared", "why_not", "choose", "NEEDS", "PREFERENCE"]

_REGISTRY: dict[str, type[Mechanism]] = {
    MechanismName.DMABUF: DmaBufMechanism,
    MechanismName.POSIX_FD: PosixFdMechanism,
    MechanismName.MEMFD: MemfdMechanism,
}

#: The probes that must pass for a mechanism to work end to end on one device.
NEEDS: dict[str, tuple[ProbeKey, ...]] = {
    MechanismName.DMABUF: (ProbeKey.DEVICE_DMABUF_EXPORT, ProbeKey.DMABUF_IMPORT),
    MechanismName.POSIX_FD: (ProbeKey.POSIX_FD_EXPORT, ProbeKey.POSIX_FD_IMPORT),
    MechanismName.MEMFD: (),
}

#: The order :func:`choose` tries: dma-buf of device memory, CUDA POSIX-fd handles, host memfd (no GPU).
PREFERENCE: tuple[str, ...] = (MechanismName.DMABUF, MechanismName.POSIX_FD, MechanismName.MEMFD)


def get_mechanism(name: str, memory: str = "host") -> Mechanism:
    """The :class:`Mechanism` called ``name`` (one of :data:`~dmabuf_interop.kinds.MECHANISM_NAMES`).

    Args:
        memory: for ``dmabuf``, the producer's memory: ``"host"`` (``cuMemAllocHost``) or ``"device"``.

    Raises:
        InvalidArgumentError: an unknown name or memory kind.
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise InvalidArgumentError(f"unknown mechanism {name!r}; choose from {', '.join(MECHANISM_NAMES)}")
    return DmaBufMechanism(memory) if cls is DmaBufMechanism else cls()


_probe_cache: dict[tuple[int, int], dict[str, Probe]] = {}


def why_not(name: str, device: int, memory: str = "device") -> str | None:
    """Why ``name`` does not work end to end on ``device`` (``None``: it does).

    Decided by :func:`~.probes.probe_device` (a one-page export and import per
    path), run once per process and device. ``memory="host"`` asks about the
    CUDA sample's dma-buf of pinned host memory (``cuMemAllocHost``) instead of
    device memory; it matters for ``dmabuf`` only.

    Returns:
        ``None``, or one line naming the mechanism, the failing probe, the driver call
        and its ``CUresult``, e.g. ``"dmabuf: dmabuf import: cuImportExternalMemory ->
        CUDA_ERROR_NOT_SUPPORTED"`` (H200, driver 580) or ``"dmabuf: device dmabuf export:
        cuInit -> libcuda.so.1 not loadable"`` (no driver).

    Raises:
        InvalidArgumentError: an unknown mechanism name.
    """
    if name not in NEEDS:
        raise InvalidArgumentError(f"unknown mechanism {name!r}; choose from {', '.join(MECHANISM_NAMES)}")
    needs = NEEDS[name]
    if not needs:
        return None
    if name == MechanismName.DMABUF and memory == MemoryKind.HOST:
        needs = (ProbeKey.HOST_DMABUF_EXPORT, ProbeKey.DMABUF_IMPORT)
    key = (os.getpid(), device)
    if key not in _probe_cache:
        _probe_cache[key] = probe_device(device)
    probes = _probe_cache[key]
    for need in needs:
        p = probes[need]
        if p.status != "ok":
            return f"{name}: {need.replace('_', ' ')}: {p.call + ' -> ' if p.call else ''}{p.result or p.detail}"
    return None


def export_shareable(size: int, device: int = 0, prefer: tuple[str, ...] = ("dmabuf", "posix-fd")
                     ) -> ExportedBuffer:
    """Export ``size`` bytes with the first mechanism in ``prefer`` that works end to end here.

    "Works" is decided by :func:`~.probes.probe_device` (a one-page export and
    import, run once per process and device). The returned buffer's
    :attr:`~dmabuf_interop.buffers.ExportedBuffer.fallback` says why each
    earlier mechanism was passed over, e.g. ``"dmabuf: dmabuf import:
    cuImportExternalMemory -> CUDA_ERROR_NOT_SUPPORTED"`` on H200 with driver
    580; ``dmabuf`` exports device memory (``cuMemAlloc``).

    Raises:
        NotSupportedError: no mechanism in ``prefer`` works; the message lists why.
        InvalidArgumentError: an unknown mechanism name.
    """
    mech, reasons = choose(device, prefer)
    exported = mech.export(size, device)
    exported.fallback = "; ".join(reasons) or None
    return exported


def choose(device: int = 0, prefer: tuple[str, ...] = PREFERENCE) -> tuple[Mechanism, list[str]]:
    """The first mechanism in ``prefer`` that works end to end on ``device``, and why each
    earlier one was passed over (one :func:`why_not` line each, in order).

    ``dmabuf`` is tried with device memory (``cuMemAlloc``); ``memfd`` needs no GPU
    and always qualifies where ``memfd_create(2)`` exists. Probes run once per
    process and device, so this initialises CUDA in the caller (fork first).

    Raises:
        NotSupportedError: no mechanism in ``prefer`` works; the message lists why.
        InvalidArgumentError: an unknown mechanism name.
    """
    reasons: list[str] = []
    for name in prefer:
        why = why_not(name, device)
        if why is None:
            return get_mechanism(name, MemoryKind.DEVICE), reasons
        reasons.append(why)
    raise NotSupportedError("no usable mechanism: " + "; ".join(reasons))


def import_shared(fd: int, descriptor: ShareDescriptor | Mapping[str, Any], device: int = 0) -> ImportedBuffer:
    """Import what an exporter sent: dispatch on the descriptor's mechanism.

    Args:
        fd: the received fd; not consumed.
        descriptor: a :class:`~dmabuf_interop.descriptor.ShareDescriptor`, or the JSON
            object received beside the fd (validated with ``ShareDescriptor.from_json``).
        device: the importing CUDA ordinal in this process (ignored for memfd). The exporter's
            GPU is matched by ``device_uuid``, never by its ordinal (``exporter_device`` is the
            exporter's own).

    Raises:
        ProtocolError: the descriptor is malformed; the message names the field.
        NotSupportedError: the mechanism cannot import here (from its importer), or this process
            cannot see the exporter's GPU (posix-fd: the message names its UUID and ``CUDA_VISIBLE_DEVICES``).
        CudaError: a driver call of the import failed.
        SyscallError: a syscall of the import failed (memfd).
    """
    desc = ShareDescriptor.from_json(descriptor)
    return get_mechanism(desc.mechanism, "device").import_(fd, desc, device)
