"""The error hierarchy of dmabuf-interop.

Callers branch on meaning, not on strings::

    DmaBufError                        anything this library raises on purpose
    ├── NotSupportedError              a capability is absent: skip with str(error) as the reason
    ├── CudaError                      a driver call failed (names the call and the CUresult)
    │   ├── CudaNotSupportedError      ... and the failure means "not supported here"
    │   │   │                          (also a NotSupportedError)
    │   │   └── NoDriverError          no usable CUDA driver, bindings or visible GPU
    │   └── ForkedAfterInitError       CUDA was initialised before this process was forked
    ├── InvalidArgumentError           bad input caught in user space before any driver call
    │   ├── NotADmaBufError            the fd is not a dma-buf (or not an open fd at all)
    │   ├── AlignmentError             a base or size breaks the page-alignment rule
    │   ├── ForkedResourceError        a listener, channel or pool used by a process that inherited it through fork()
    │   ├── ClosedError                this end closed the channel (not the peer: see PeerClosedError)
    │   └── AddressInUseError          listen() on an address another listener holds
    ├── SyscallError                   a system call failed (names the call and the errno)
    ├── FdPassError                    SCM_RIGHTS transport went wrong
    │   ├── PeerClosedError            the peer closed its end (EOF)
    │   ├── FdsInFlightError           sendmsg -> ETOOMANYREFS: too many fds queued unread at the peer
    │   ├── ProtocolError              a malformed message: no fd, too many fds, bad framing, bad field
    │   │   └── FdLimitError           fds dropped by the kernel at RLIMIT_NOFILE (MSG_CTRUNC)
    │   ├── PeerRefusedError           a channel peer failed the other side's checks (uid, version, host)
    │   └── StaleHandleError           a shared-tensor handle names memory its producer no longer lends
    ├── PoolExhaustedError             a shared pool had no free block within the timeout
    ├── TransferError                  a transfer-engine call (NIXL) failed
    ├── LocalError                     this process failed on a message the protocol allows (never the peer's fault)
    ├── IncompleteVersionError         a weight-sync version stopped part-way (says how much was applied)
    └── WaitTimeoutError               a wait ran past its deadline (also a builtins.TimeoutError)

The peer's faults and ours are apart: a :class:`ProtocolError` (or :class:`PeerRefusedError`) says the peer
broke the protocol or refused us; a :class:`LocalError`, :class:`SyscallError` or :class:`CudaError` says
this process failed.

Every error pickles with its class, message and attributes, so it crosses a
``multiprocessing`` or ``concurrent.futures`` process boundary intact.
"""

from __future__ import annotations

import builtins
import errno as _errno
import os
from typing import Any

__all__ = [
    "DmaBufError",
    "NotSupportedError",
    "CudaError",
    "CudaNotSupportedError",
    "NoDriverError",
    "ForkedAfterInitError",
    "InvalidArgumentError",
    "NotADmaBufError",
    "AlignmentError",
    "ForkedResourceError",
    "ClosedError",
    "AddressInUseError",
    "SyscallError",
    "FdPassError",
    "PeerClosedError",
    "ProtocolError",
    "FdLimitError",
    "FdsInFlightError",
    "WaitTimeoutError",
    "PeerRefusedError",
    "PoolExhaustedError",
    "StaleHandleError",
    "TransferError",
    "LocalError",
    "IncompleteVersionError",
]


class DmaBufError(Exception):
    """Base class of every error this library raises on purpose."""


class NotSupportedError(DmaBufError):
    """The driver, device, kernel or peer does not offer this capability.

    Treat it as a clean skip with ``str(error)`` as the reason. Raised on its
    own for absent capabilities that no ``CUresult`` names (no peer access, no
    usable mechanism, an ioctl the kernel lacks); a driver's refusal is a
    :class:`CudaNotSupportedError`, which is both this and a :class:`CudaError`.
    """


class CudaError(DmaBufError):
    """A CUDA driver call returned something other than ``CUDA_SUCCESS``.

    Attributes:
        call: the driver function, e.g. ``"cuImportExternalMemory"``.
        result: the ``CUresult`` name, e.g. ``"CUDA_ERROR_NOT_SUPPORTED"``.
        code: the numeric ``CUresult`` (``-1`` where there is none, e.g. no driver).
        detail: a short explanation, or ``""``.
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

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.call, self.result, self.code, self.detail)


class CudaNotSupportedError(CudaError, NotSupportedError):
    """A driver call answered that the capability is absent (``CUDA_ERROR_NOT_SUPPORTED``,
    or an attribute that reads 0 for the call that needs it)."""


class NoDriverError(CudaNotSupportedError):
    """No usable CUDA: no driver, no bindings, no visible GPU, or a driver too old.

    Attributes:
        reason: one of ``"no-driver"``, ``"no-bindings"``, ``"no-device"``,
            ``"old-driver"`` (what :func:`~dmabuf_interop.capabilities.driver_status` reports).
    """

    def __init__(self, call: str, result: str, code: int = -1, detail: str = "", reason: str = "no-driver") -> None:
        self.reason = reason
        super().__init__(call, result, code, detail)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.call, self.result, self.code, self.detail, self.reason)


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


class ForkedResourceError(InvalidArgumentError):
    """A channel, listener or pool was used in a process that inherited it through ``fork()``.

    Only the process that created it may use it, shut it down or unlink it; in a forked child it is inert
    (its ``close()`` only drops this process's copies of the fds). Open a new one after the fork.

    Attributes:
        owner_pid: the pid of the process that created it.
    """

    def __init__(self, what: str, owner_pid: int) -> None:
        self.what = what
        self.owner_pid = owner_pid
        super().__init__(f"{what} belongs to process {owner_pid}; this process inherited it through fork() "
                         f"and may not use it")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.what, self.owner_pid)


class ClosedError(InvalidArgumentError):
    """This end closed the channel (its own ``close()``), and then a call used it; not the peer's doing,
    which is a :class:`PeerClosedError`."""


class AddressInUseError(InvalidArgumentError):
    """``listen()`` on an address another listener holds: a live socket answered the liveness probe, or
    ``bind`` failed with ``EADDRINUSE`` (a race lost to another listener)."""


class SyscallError(DmaBufError, OSError):
    """A system call failed; ``str()`` names the call and the errno name.

    Args:
        call: the system call, e.g. ``"ftruncate"``.
        exc: the ``OSError`` it raised, or the bare ``errno`` number.
        filename: the path the call acted on, if any (named in the message).

    Attributes:
        call: as given. errno: the ``errno`` value (``None`` if none).
        strerror: the C library's text for it. filename: as given.
    """

    def __init__(self, call: str, exc: BaseException | int | None, filename: str | None = None) -> None:
        if isinstance(exc, int) or exc is None:
            code, text, kind = exc, (os.strerror(exc) if exc is not None else ""), ""
        else:
            code = getattr(exc, "errno", None)
            text, kind = getattr(exc, "strerror", None) or str(exc), type(exc).__name__
        name = (_errno.errorcode.get(code, "") if code is not None else "") or kind
        super().__init__(code, text)
        self.call = call
        self.filename = filename
        self._message = f"{call} -> {name} ({text})" if name else f"{call} ({text})"
        if filename is not None:
            self._message += f": {filename!r}"

    def __str__(self) -> str:
        return self._message

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_syscall_error, (type(self), self.call, self.errno, self.strerror, self._message,
                                        self.filename)


def _rebuild_syscall_error(cls: type[SyscallError], call: str, code: int | None, text: str,
                           message: str, filename: str | None = None) -> SyscallError:
    err = cls(call, code, filename)
    err.strerror, err._message = text, message
    return err


class FdPassError(DmaBufError):
    """Passing a file descriptor over an AF_UNIX socket failed."""


class PeerClosedError(FdPassError, ConnectionError):
    """The peer closed its end of the socket (EOF) before the expected message."""


class FdsInFlightError(FdPassError):
    """``sendmsg`` failed with ``ETOOMANYREFS``: the sending user has more fds in flight (sent over
    AF_UNIX sockets, not yet received) than its ``RLIMIT_NOFILE``; the peer is not reading.
    The caller still owns the fd it tried to send."""


class ProtocolError(FdPassError):
    """A message broke the protocol: no fd, too many fds, bad framing, a field of the wrong type or range."""


class FdLimitError(ProtocolError):
    """The kernel dropped passed fds because the receiver hit ``RLIMIT_NOFILE``."""


class WaitTimeoutError(DmaBufError, builtins.TimeoutError):
    """A wait (socket receive or send, child exit, probe, lease) ran past its deadline."""


class PeerRefusedError(FdPassError):
    """A channel peer was refused: its credentials (``SO_PEERCRED``), protocol
    version or host did not pass the other side's checks. ``str()`` says why."""


class StaleHandleError(FdPassError):
    """A shared tensor's handle could not be served: its producer is gone, it never made that share
    or has released it (a stale handle), or the handle's secret does not match (a forged one).

    Attributes:
        producer: who was asked, in words (``"pid 4242 (broker /tmp/...sock)"``).
        reason: why, in words.
    """

    def __init__(self, producer: str, reason: str) -> None:
        self.producer = producer
        self.reason = reason
        super().__init__(f"producer {producer}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.producer, self.reason)


class PoolExhaustedError(DmaBufError):
    """A shared pool had no free block of the requested size within the timeout."""


class TransferError(DmaBufError):
    """A transfer-engine call (NIXL: register, metadata, READ) failed; ``str()`` names the call and NIXL's status."""


class LocalError(DmaBufError):
    """This process failed, not the peer: a channel could not handle a message the protocol allows (a bug
    here). The connection ends, and the peer is not blamed: a peer's fault is a :class:`ProtocolError`."""
class IncompleteVersionError(DmaBufError):
    """A weight-sync version stopped part-way (:mod:`dmabuf_interop.weight_sync`).

    Attributes:
        version: the version that was being sent or received.
        applied: batches of it handed to the engine's loader (received) or sent to every engine (sent);
            ``0`` means none, so the engine's weights are still the previous version's.
        batches: batches the version has.
        reason: why it stopped (the trainer aborted, the peer went, a batch broke the protocol, the
            loader raised).
    """

    def __init__(self, version: int, applied: int, batches: int, reason: str) -> None:
        self.version = version
        self.applied = applied
        self.batches = batches
        self.reason = reason
        state = "nothing of it applied" if applied == 0 else f"{applied} of {batches} batches applied"
        super().__init__(f"weight version {version} incomplete ({state}): {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.version, self.applied, self.batches, self.reason)
