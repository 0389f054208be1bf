"""What the driver claims this machine can share: capability attributes and GPU pairs.

Attributes (``cuDeviceGetAttribute``) are what the driver claims; the active
probes of :mod:`.mechanisms.probes` are what a one-page call actually answers,
and the two can disagree (an attribute can say yes while the call says
``CUDA_ERROR_NOT_SUPPORTED``). Both are kept. An attribute the driver does
not know reads as ``None`` (unknown), never as 0.

No CUDA driver on the machine is an answer too: :func:`driver_status` says
so instead of raising.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _driver as driver
from .errors import CudaError, DmaBufError, NoDriverError

__all__ = ["ATTRIBUTES", "DeviceFacts", "driver_status", "driver_problem", "device_count", "device_facts", "device_attributes",
           "attribute", "can_access_peer", "driver_version", "bindings_version", "find_cross_gpu_pair"]

#: The capability attributes reported per device (``CU_DEVICE_ATTRIBUTE_`` prefix dropped).
ATTRIBUTES = (
    "DMA_BUF_SUPPORTED",
    "HOST_ALLOC_DMA_BUF_SUPPORTED",
    "DMA_BUF_MMAP_SUPPORTED",
    "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
    "GPU_DIRECT_RDMA_SUPPORTED",
    "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED",
)


def driver_status() -> tuple[bool, str]:
    """``(True, "")`` when ``cuInit`` works and a device exists, else ``(False, reason)``;
    :func:`driver_problem` gives the reason's code too."""
    problem = driver_problem()
    return (True, "") if problem is None else (False, problem[1])


def driver_problem() -> tuple[str, str] | None:
    """``None`` when CUDA is usable, else ``(code, text)``; ``code`` is one of ``"no-driver"`` (no
    NVIDIA driver), ``"no-bindings"`` (cuda-bindings missing), ``"no-device"`` (a driver but no
    visible GPU; the text names ``CUDA_VISIBLE_DEVICES``), ``"old-driver"`` (``cuDriverGetVersion``
    below what cuda-bindings needs) or ``"error"`` (another failure, named)."""
    try:
        driver.init()
        n = driver.device_count()
    except NoDriverError as exc:
        return exc.reason, exc.detail or str(exc)
    except DmaBufError as exc:
        return "error", str(exc)
    if n == 0:
        return "no-device", "the CUDA driver is loaded but finds no GPU"
    return None


def device_count() -> int:
    """``cuDeviceGetCount``.

    Raises:
        NoDriverError: no usable CUDA driver.
    """
    return driver.device_count()


@dataclass(frozen=True)
class DeviceFacts:
    """What identifies one GPU.

    Attributes:
        ordinal: the CUDA ordinal in this process.
        name: ``cuDeviceGetName``. pci_bus_id: ``cuDeviceGetPCIBusId``.
        uuid: ``cuDeviceGetUuid`` as ``GPU-xxxxxxxx-...``; the same in every process.
        compute_capability: ``"9.0"``.
    """

    ordinal: int
    name: str
    pci_bus_id: str
    uuid: str
    compute_capability: str


def device_facts(ordinal: int) -> DeviceFacts:
    """Name, PCI bus id, UUID and compute capability of ``ordinal``.

    Raises:
        InvalidArgumentError: a bad ordinal. NoDriverError: no usable driver. CudaError: a query failed.
    """
    major = driver.device_attribute(ordinal, "COMPUTE_CAPABILITY_MAJOR")
    minor = driver.device_attribute(ordinal, "COMPUTE_CAPABILITY_MINOR")
    return DeviceFacts(ordinal, driver.device_name(ordinal), driver.device_pci_bus_id(ordinal),
                       driver.device_uuid(ordinal), f"{major}.{minor}")


def can_access_peer(ordinal: int, peer: int) -> bool:
    """``cuDeviceCanAccessPeer``: can ``ordinal`` map memory that lives on ``peer``."""
    return driver.can_access_peer(ordinal, peer)


def driver_version() -> int:
    """``cuDriverGetVersion``: e.g. 13000 for CUDA 13.0."""
    return driver.driver_version()


def bindings_version() -> int:
    """The CUDA version cuda.bindings was built for (``cuda.bindings.driver.CUDA_VERSION``, e.g. 13000)."""
    return int(driver.bindings().CUDA_VERSION)


def attribute(ordinal: int, name: str) -> int | None:
    """One attribute's value; ``None`` when the bindings or the driver do not know it."""
    try:
        return driver.device_attribute(ordinal, name)
    except NoDriverError:
        raise
    except CudaError:
        return None


def device_attributes(ordinal: int) -> dict[str, int | None]:
    """Every attribute in :data:`ATTRIBUTES` for ``ordinal`` (``None`` = unknown)."""
    return {name: attribute(ordinal, name) for name in ATTRIBUTES}


def find_cross_gpu_pair(producer_attribute: str = "HOST_ALLOC_DMA_BUF_SUPPORTED",
                        consumer_attribute: str = "DMA_BUF_SUPPORTED",
                        need_peer_access: bool = False) -> tuple[int, int] | None:
    """The GPU pair for cross-GPU sharing, or ``None``.

    The producer is the first device in ordinal order whose
    ``producer_attribute`` is 1; the consumer is the first *other* device
    whose ``consumer_attribute`` is 1 (and, with ``need_peer_access``, that
    can access the producer's memory, ``cuDeviceCanAccessPeer``). Deterministic,
    so two processes that ask independently agree. No driver: ``None``.
    """
    try:
        n = driver.device_count()
    except DmaBufError:
        return None
    producers = [d for d in range(n) if attribute(d, producer_attribute) == 1]
    for p in producers:
        for c in range(n):
            if c == p or attribute(c, consumer_attribute) != 1:
                continue
            if need_peer_access and not driver.can_access_peer(c, p):
                continue
            return p, c
        break  # the first producer decides, as in the CUDA sample
    return None
