"""What this machine can share, and how: capability attributes, active probes, GPU pairs.

Attributes (``cuDeviceGetAttribute``) are what the driver claims; probes are
what a one-page call actually answers, and the two can disagree (an attribute
can say yes while the call says ``CUDA_ERROR_NOT_SUPPORTED``). Both are kept.
An attribute the driver does not know reads as ``None`` (unknown), never as 0.

No CUDA driver on the machine is an answer too: :func:`driver_status` says
so instead of raising.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

from . import driver
from .errors import CudaError, DmaBufError, NoDriverError

__all__ = [
    "ATTRIBUTES",
    "Probe",
    "driver_status",
    "device_attributes",
    "attribute",
    "probe_device",
    "find_cross_gpu_pair",
    "PROBES",
]

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
    """``(True, "")`` when ``cuInit`` works and a device exists, else ``(False, reason)``."""
    try:
        driver.init()
        n = driver.device_count()
    except DmaBufError as exc:
        return False, f"no CUDA driver: {exc}"
    if n == 0:
        return False, "no CUDA device"
    return True, ""


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


@dataclass(frozen=True)
class Probe:
    """The answer of one active probe.

    Attributes:
        status: ``"ok"``, ``"unsupported"`` or ``"unknown"`` (could not be tried).
        result: the ``CUresult`` name (``"CUDA_SUCCESS"`` when ok).
        call: the driver call that answered.
        detail: a short human reason.
    """

    status: str
    result: str = "CUDA_SUCCESS"
    call: str = ""
    detail: str = ""

    def __str__(self) -> str:
        if self.status == "ok":
            return "ok"
        if self.status == "unsupported":
            return f"unsupported ({self.result})"
        return f"unknown ({self.detail})" if self.detail else "unknown"

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def _attempt(fn: Callable[[], Any]) -> tuple[Probe, Any]:
    """Run one probe call: its answer and, when it worked, what it returned (the caller closes it)."""
    try:
        return Probe("ok"), fn()
    except CudaError as exc:
        return Probe("unsupported", exc.result, exc.call, exc.detail), None
    except DmaBufError as exc:
        return Probe("unknown", "", "", str(exc)), None


def _try(fn: Callable[[], Any]) -> Probe:
    """Run one probe call and close what it returned."""
    probe, out = _attempt(fn)
    if out is not None:
        out.close()
    return probe


def probe_device(ordinal: int, peer: int | None = None) -> dict[str, Probe]:
    """Try each path with one small buffer on ``ordinal`` and keep each answer.

    Keys: ``host_dmabuf_export``, ``device_dmabuf_export``,
    ``vmm_dmabuf_export``, ``dmabuf_import``, ``posix_fd_export``,
    ``posix_fd_import`` and, when ``peer`` is given, ``posix_fd_import_peer``
    (memory on ``ordinal`` mapped on ``peer``). Runs in this process; use
    ``dmabuf-interop info`` (which runs it in a child with a timeout) to
    protect a caller from a crashing driver.
    """
    from .exporter import export_device, export_host, export_range, page_size
    from .importer import import_dmabuf
    from .vmm import export_posix_fd, import_posix_fd

    page = page_size()
    out: dict[str, Probe] = {
        "host_dmabuf_export": _try(lambda: export_host(page, ordinal)),
    }
    out["device_dmabuf_export"], exp = _attempt(lambda: export_device(page, ordinal))
    if exp is not None:
        out["dmabuf_import"] = _try(lambda: import_dmabuf(exp.handle, exp.size, ordinal, exp.offset))
        exp.close()
    else:
        out["dmabuf_import"] = Probe("unknown", "", "", "no dma-buf could be exported to import")

    out["posix_fd_export"], v = _attempt(lambda: export_posix_fd(page, ordinal))
    if v is not None:
        out["vmm_dmabuf_export"] = _try(lambda: export_range(v.ptr, v.size))
        out["posix_fd_import"] = _try(lambda: import_posix_fd(v.fd, v.size, ordinal, 0, v.export_size))
        if peer is not None and peer != ordinal:
            out["posix_fd_import_peer"] = _try(lambda: import_posix_fd(v.fd, v.size, peer, 0, v.export_size))
        v.close()
    else:
        reason = "no POSIX-fd allocation could be created"
        out["vmm_dmabuf_export"] = Probe("unknown", "", "", reason)
        out["posix_fd_import"] = Probe("unknown", "", "", reason)
    return out


#: Probe keys in report order.
PROBES = ("host_dmabuf_export", "device_dmabuf_export", "vmm_dmabuf_export", "dmabuf_import",
          "posix_fd_export", "posix_fd_import")


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
