"""The error hierarchy of dmabuf-interop.

Callers branch on meaning, not on strings::

    DmaBufError                      anything this library raises on purpose
    ├── CudaError                    a driver call failed (names the call and the CUresult)
    │   ├── NotSupportedError        the capability is absent: skip, do not crash
    │   │   └── NoDriverError        no CUDA driver (libcuda.so.1) on this machine
    │   └── ForkedAfterInitError     CUDA was initialised before this process was forked
    ├── InvalidArgumentError         bad input caught in user space before any driver call
    │   ├── NotADmaBufError          the fd is not a dma-buf (or not an open fd at all)
    │   └── AlignmentError           a base or size breaks the page-alignment rule
    ├── SyscallError                 a system call failed (names the call and the errno)
    ├── FdPassError                  SCM_RIGHTS transport went wrong
    │   ├── PeerClosedError          the peer closed its end (EOF)
    │   ├── ProtocolError            a malformed message: no fd, too many fds, bad framing
    │   └── FdLimitError             fds dropped by the kernel at RLIMIT_NOFILE (MSG_CTRUNC)
    └── TimeoutError                 a wait ran past its deadline (also a builtin TimeoutError)
"""

from __future__ import annotations

import builtins

__all__ = [
    "DmaBufError",
    "CudaError",
    "NotSupportedError",
    "NoDriverError",
    "ForkedAfterInitError",
    "InvalidArgumentError",
    "NotADmaBufError",
    "AlignmentError",
    "SyscallError",
    "FdPassError",
    "PeerClosedError",
    "ProtocolError",
    "FdLimitError",
    "TimeoutError",
]


class DmaBufError(Exception):
    """Base class of every error this library raises on purpose."""


class CudaError(DmaBufError):
    """A CUDA driver call returned something other than ``CUDA_SUCCESS``.

    Attributes:
        call: the driver function, e.g. ``"cuImportExternalMemory"``.
        result: the ``CUresult`` name, e.g. ``"CUDA_ERROR_NOT_SUPPORTED"``.
        code: the numeric ``CUresult`` (``-1`` where there is none, e.g. no driver).
    """

    def __init__(self, call: str, result: str, code: int = -1, detail: str = "") -> None:
        self.call = call
        self.result = result
        self.code = code
        self.detail = detail
        text = f"{call} -> {result}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)


class NotSupportedError(CudaError):
    """The driver, device or kernel does not offer this capability.

    Raised for ``CUDA_ERROR_NOT_SUPPORTED`` and for a capability attribute
    that reads 0. Treat it as a clean skip with ``str(error)`` as the reason.
    """


class NoDriverError(NotSupportedError):
    """No usable CUDA driver: ``libcuda.so.1`` cannot be loaded, or no device."""


class ForkedAfterInitError(CudaError):
    """This process was forked from a parent that had already initialised CUDA.

    The CUDA driver does not survive ``fork()`` after ``cuInit``: start the
    worker with ``multiprocessing.get_context("spawn")`` or fork before any
    CUDA call.
    """


class InvalidArgumentError(DmaBufError, ValueError):
    """An argument was rejected in user space, before any driver call."""


class NotADmaBufError(InvalidArgumentError):
    """The file descriptor is closed, or is not a dma-buf (pipe, file, memfd, ...)."""


class AlignmentError(InvalidArgumentError):
    """A base address, offset or size breaks the page-alignment rule."""


class SyscallError(DmaBufError, OSError):
    """A system call failed; ``str()`` names the call and the errno name.

    Attributes:
        call: e.g. ``"ftruncate"``. errno: the ``errno`` value (``None`` if none).
    """

    def __init__(self, call: str, exc: BaseException) -> None:
        import errno as _errno

        code = getattr(exc, "errno", None)
        name = _errno.errorcode.get(code, type(exc).__name__) if code is not None else type(exc).__name__
        self.call = call
        super().__init__(code, f"{call} -> {name} ({getattr(exc, 'strerror', None) or exc})")

    def __str__(self) -> str:
        return str(self.args[1])


class FdPassError(DmaBufError):
    """Passing a file descriptor over an AF_UNIX socket failed."""


class PeerClosedError(FdPassError, ConnectionError):
    """The peer closed its end of the socket (EOF) before the expected message."""


class ProtocolError(FdPassError):
    """A message broke the framing: no fd, too many fds, truncated or malformed."""


class FdLimitError(ProtocolError):
    """The kernel dropped passed fds because the receiver hit ``RLIMIT_NOFILE``."""


class TimeoutError(DmaBufError, builtins.TimeoutError):  # noqa: A001 - deliberate
    """A wait (socket receive, child exit, probe) ran past its deadline."""
