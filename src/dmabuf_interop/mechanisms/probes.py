"""Active probes: what a one-page export and import actually answer on a device.

Each probe makes the real calls of one path with the smallest buffer and
keeps the driver's answer (:class:`Probe`). ``dmabuf-interop info`` runs
them in a child process with a timeout; :func:`~dmabuf_interop.mechanisms.export_shareable`
runs them once per process and device to choose a mechanism.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

from .._checks import page_size
from ..errors import CudaError, DmaBufError, NotSupportedError
from .dmabuf import export_device, export_host, export_range, import_dmabuf
from .posix_fd import export_posix_fd, import_posix_fd

__all__ = ["Probe", "probe_device"]


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
    except NotSupportedError as exc:  # absent without a CUresult (e.g. no peer access)
        return Probe("unsupported", "", "", str(exc)), None
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
    protect a caller from a crashing driver. Each probe uses one page
    (``page_size()`` bytes) and frees it before returning.

    Returns:
        a dict from those keys (:class:`~dmabuf_interop.kinds.ProbeKey` values) to
        :class:`Probe`: ``status`` ``"ok"``, ``"unsupported"`` (the driver refused:
        ``call`` and ``result`` name the call and its ``CUresult``; without a driver
        ``cuInit``) or ``"unknown"`` (could not be tried; ``detail`` says why).
        A refusal or a missing driver is an answer kept in the dict, never raised.
    """
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
