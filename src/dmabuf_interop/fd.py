"""`OwnedFd`: a file descriptor with exactly one owner that closes it.

The owner closes the fd with :meth:`OwnedFd.close`, by leaving a ``with``
block, or, as a safety net, when it is garbage collected
(``weakref.finalize``, as Python's ``socket`` and cuda.core's ``Buffer`` do).
:meth:`OwnedFd.detach` hands the fd off (for example to ``send_fd``'s caller
or to a driver that takes ownership) and stops the owner from closing it.
"""

from __future__ import annotations

import os
import weakref
from typing import TypeVar

from ._checks import fd_number
from .errors import InvalidArgumentError

__all__ = ["OwnedFd", "fd_is_open", "open_fds", "is_memfd"]

T = TypeVar("T", bound="OwnedFd")


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def fd_is_open(fd: int) -> bool:
    """True when ``fd`` is an open descriptor of this process (``fcntl(F_GETFD)``)."""
    import fcntl

    if not isinstance(fd, int) or fd < 0:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


def is_memfd(fd: int) -> bool:
    """True when ``fd`` is an open memfd (its ``/proc/self/fd`` link reads ``/memfd:...``). Never raises."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except (OSError, TypeError):
        return False


def open_fds() -> list[int]:
    """The open fds of this process, from ``/proc/self/fd`` (for leak checks)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd_is_open(fd):  # drops the fd listdir itself used
            out.append(fd)
    return sorted(out)


class OwnedFd:
    """Owns one open file descriptor.

    Args:
        fd: an open descriptor; ownership moves to this object.

    Raises:
        InvalidArgumentError: ``fd`` is negative or not open.
    """

    def __init__(self, fd: int) -> None:
        fd_number(fd)
        if not fd_is_open(fd):
            raise InvalidArgumentError(f"fd {fd} is not open in this process")
        self._fd = fd
        self._finalizer = weakref.finalize(self, _close, fd)

    @property
    def fd(self) -> int:
        """The descriptor number. Raises ``ValueError`` once closed or detached."""
        if self._fd < 0:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._fd

    def fileno(self) -> int:
        """Same as :attr:`fd`, so the object works with ``select`` and friends."""
        return self.fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        """Close the fd. Idempotent."""
        if self._fd >= 0:
            self._fd = -1
            self._finalizer()

    def detach(self) -> int:
        """Give up ownership and return the fd; the caller must close it."""
        fd = self.fd
        self._finalizer.detach()
        self._fd = -1
        return fd

    def dup(self: T) -> T:
        """A new owner of a duplicate (``os.dup``, close-on-exec) of the same open file."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._fd = os.dup(self.fd)
        new._finalizer = weakref.finalize(new, _close, new._fd)
        return new

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"<{type(self).__name__} {state}>"
