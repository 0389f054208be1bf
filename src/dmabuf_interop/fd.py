"""`OwnedFd`: a file descriptor with exactly one owner that closes it.

The owner closes the fd with :meth:`OwnedFd.close`, by leaving a ``with``
block, or, as a safety net, when it is garbage collected
(``weakref.finalize``, as Python's ``socket`` and cuda.core's ``Buffer`` do).
:meth:`OwnedFd.detach` hands the fd off (for example to ``send_fd``'s caller
or to a driver that takes ownership) and stops the owner from closing it.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import stat
import weakref
from typing import TypeVar

from ._checks import fd_number
from .errors import InvalidArgumentError

__all__ = ["OwnedFd", "fd_is_open", "open_fds", "is_memfd", "fd_kind", "fs_magic"]

T = TypeVar("T", bound="OwnedFd")


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def fd_is_open(fd: int) -> bool:
    """True when ``fd`` is an open descriptor of this process (``fcntl(F_GETFD)``)."""
    if not isinstance(fd, int) or fd < 0:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


# Filesystem magic numbers (include/uapi/linux/magic.h), as fstatfs(2) reports them in f_type.
DMA_BUF_MAGIC = 0x444D4142
TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
_libc = ctypes.CDLL(None, use_errno=True)


def fs_magic(fd: int) -> int | None:
    """``fstatfs(fd).f_type``, the magic number of the filesystem ``fd`` lives on; ``None`` when
    ``fstatfs`` fails. Needs no ``/proc``."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _libc.fstatfs(ctypes.c_int(fd), buf) != 0:
        return None
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF  # __fsword_t f_type comes first


def fd_kind(fd: int) -> str:
    """What ``fd`` is, from ``fstat``, ``fstatfs`` and ``F_GET_SEALS`` alone (no ``/proc``):
    ``"closed"``, ``"dma-buf"``, ``"memfd"``, ``"socket"``, ``"pipe"``, ``"file"``,
    ``"directory"``, ``"character device"``, ``"block device"`` or ``"other"``. Never raises.

    A memfd is a regular file on tmpfs or hugetlbfs that answers ``F_GET_SEALS``
    (a file under ``/dev/shm`` is one too, and maps the same way).
    """
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        return "closed"
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return "closed"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISFIFO(mode):
        return "pipe"
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    magic = fs_magic(fd)
    if magic == DMA_BUF_MAGIC:
        return "dma-buf"
    if stat.S_ISREG(mode):
        if magic in (TMPFS_MAGIC, HUGETLBFS_MAGIC):
            try:
                fcntl.fcntl(fd, fcntl.F_GET_SEALS)
                return "memfd"
            except OSError:
                pass
        return "file"
    return "other"


def is_memfd(fd: int) -> bool:
    """True when ``fd`` is an open memfd (see :func:`fd_kind`). Never raises."""
    return fd_kind(fd) == "memfd"


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
