"""`DmaBuf`: one Linux dma-buf file descriptor and the kernel's dma-buf uAPI on it.

A dma-buf is the kernel's shareable buffer object, represented as a file
descriptor (https://docs.kernel.org/driver-api/dma-buf.html). This module
works on the fd alone, with no CUDA call:

* :func:`is_dmabuf` tells a dma-buf from any other fd by its filesystem's
  magic number (``fstatfs``: ``DMA_BUF_MAGIC``), with no ``/proc`` needed;
* :meth:`DmaBuf.info` gives its size (``lseek(fd, 0, SEEK_END)``) and inode
  (``fstat``), and from ``/proc/self/fdinfo/<fd>``, where ``/proc`` is
  mounted, the exporter's name, the buffer's name and its reference count;
* :meth:`DmaBuf.set_name`, :meth:`DmaBuf.export_sync_file` and
  :meth:`DmaBuf.sync` wrap ``DMA_BUF_SET_NAME``,
  ``DMA_BUF_IOCTL_EXPORT_SYNC_FILE`` and ``DMA_BUF_IOCTL_SYNC`` from
  ``include/uapi/linux/dma-buf.h``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import weakref
from dataclasses import dataclass

from .errors import InvalidArgumentError, NotADmaBufError, NotSupportedError, SyscallError
from .fd import OwnedFd, _close, fd_kind

__all__ = ["DmaBuf", "DmaBufInfo", "is_dmabuf", "dmabuf_info", "DMA_BUF_NAME_LEN"]

# include/uapi/linux/dma-buf.h: _IOW/_IOWR('b', nr, type) with 8-byte arguments.
_IOC_WRITE, _IOC_READ = 1, 2


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (ord("b") << 8) | nr


DMA_BUF_IOCTL_SYNC = _ioc(_IOC_WRITE, 0, 8)  # struct dma_buf_sync { __u64 flags; }
DMA_BUF_SET_NAME = _ioc(_IOC_WRITE, 1, 8)  # _IOW(DMA_BUF_BASE, 1, const char *)
DMA_BUF_IOCTL_EXPORT_SYNC_FILE = _ioc(_IOC_WRITE | _IOC_READ, 2, 8)  # { __u32 flags; __s32 fd; }
DMA_BUF_SYNC_READ, DMA_BUF_SYNC_WRITE = 1, 2
DMA_BUF_SYNC_START, DMA_BUF_SYNC_END = 0, 4
#: Kernel limit for a dma-buf name, terminating NUL included.
DMA_BUF_NAME_LEN = 32


@dataclass(frozen=True)
class DmaBufInfo:
    """What the kernel says about a dma-buf.

    Attributes:
        size: buffer size in bytes (``lseek(fd, 0, SEEK_END)``).
        exp_name: the exporter, e.g. ``"nv_dmabuf"`` for the NVIDIA driver
            (fdinfo; ``"unknown"`` without ``/proc``).
        name: the name set with ``DMA_BUF_SET_NAME`` (``""`` when unset or unknown).
        inode: the dma-buf's inode number (``fstat``; same on every fd of one buffer).
        count: the file's reference count as fdinfo reports it (0 without ``/proc``).
    """

    size: int
    exp_name: str
    name: str
    inode: int
    count: int


def is_dmabuf(fd: int) -> bool:
    """True when ``fd`` is an open dma-buf of this process.

    ``fstatfs`` reports ``DMA_BUF_MAGIC`` for a dma-buf; no ``/proc`` is read
    (kernels before 5.x, where dma-bufs were anonymous inodes, are recognised by
    their ``/proc/self/fd`` link ``anon_inode:dmabuf``). Never raises.
    """
    kind = fd_kind(fd)
    if kind == "dma-buf":
        return True
    if kind != "other":
        return False
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:dmabuf"
    except OSError:
        return False


def _describe(fd: int) -> str:
    if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
        return f"fd {fd!r} is not a valid file descriptor"
    kind = fd_kind(fd)
    if kind == "closed":
        return f"fd {fd} is not open"
    article = "an" if kind[0] in "aeiou" else "a"
    where = ""
    if kind in ("file", "character device", "block device", "other"):
        try:  # the path helps where /proc is mounted; the kind alone does elsewhere
            where = f" ({os.readlink(f'/proc/self/fd/{fd}')!r})"
        except OSError:
            pass
    return f"fd {fd} is not a dma-buf: it is {article} {kind}{where}"


def dmabuf_info(fd: int) -> DmaBufInfo:
    """Size (``lseek(fd, 0, SEEK_END)``) and inode (``fstat``) of a dma-buf, with the exporter name,
    buffer name and reference count from ``/proc/self/fdinfo/<fd>`` where ``/proc`` is mounted.

    Raises:
        NotADmaBufError: ``fd`` is closed or not a dma-buf.
        SyscallError: ``lseek`` failed.
    """
    if not is_dmabuf(fd):
        raise NotADmaBufError(_describe(fd))
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
    except OSError as exc:
        raise SyscallError("lseek(SEEK_END)", exc) from exc
    fields: dict[str, str] = {}
    try:
        with open(f"/proc/self/fdinfo/{fd}") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:  # no /proc (a chroot or sandbox): only fdinfo's extras are unknown
        pass
    return DmaBufInfo(
        size=size,
        exp_name=fields.get("exp_name", "unknown"),
        name=fields.get("name", ""),
        inode=os.fstat(fd).st_ino,
        count=int(fields.get("count", "0")),
    )


class DmaBuf(OwnedFd):
    """Owns one dma-buf fd.

    Args:
        fd: an open dma-buf fd; ownership moves to this object.
        size: its size in bytes; asked of the kernel (``lseek``) when omitted.

    Raises:
        NotADmaBufError: ``fd`` is closed or is not a dma-buf (checked before
            anything else touches it).
    """

    def __init__(self, fd: int, size: int | None = None) -> None:
        if not is_dmabuf(fd):
            raise NotADmaBufError(_describe(fd))
        super().__init__(fd)
        self._size = dmabuf_info(fd).size if size is None else int(size)

    @classmethod
    def _from_driver(cls, fd: int, size: int) -> "DmaBuf":
        """Own an fd that ``cuMemGetHandleForAddressRange`` has just returned: it is a dma-buf of
        ``size`` bytes by the driver's contract, so the ``/proc`` checks are skipped (they cost
        more than the rest of the export's Python)."""
        self = object.__new__(cls)
        self._fd = fd
        self._finalizer = weakref.finalize(self, _close, fd)
        self._size = size
        return self

    @property
    def size(self) -> int:
        """Size in bytes."""
        return self._size

    def info(self) -> DmaBufInfo:
        """The kernel's view of the buffer (see :func:`dmabuf_info`)."""
        return dmabuf_info(self.fd)

    def set_name(self, name: str) -> None:
        """Name the buffer (``DMA_BUF_SET_NAME``); shows in fdinfo and debugfs.

        Args:
            name: at most ``DMA_BUF_NAME_LEN - 1`` = 31 bytes of UTF-8 (the
                kernel's 32 bytes include the terminating NUL).

        Raises:
            InvalidArgumentError: the name is too long or contains NUL.
            SyscallError: the ioctl failed (errno from the kernel).
        """
        raw = name.encode()
        if b"\0" in raw or len(raw) >= DMA_BUF_NAME_LEN:
            raise InvalidArgumentError(
                f"dma-buf name must be at most {DMA_BUF_NAME_LEN - 1} bytes without NUL, got {len(raw)}")
        try:
            fcntl.ioctl(self.fd, DMA_BUF_SET_NAME, raw + b"\0")
        except OSError as exc:
            raise SyscallError("ioctl(DMA_BUF_SET_NAME)", exc) from exc

    def export_sync_file(self, write: bool = False) -> OwnedFd:
        """``DMA_BUF_IOCTL_EXPORT_SYNC_FILE``: a sync_file fd for the buffer's fences.

        Args:
            write: ``True`` to wait for all fences (before writing), ``False``
                for the write fences only (before reading).

        Returns:
            An :class:`OwnedFd` owning the sync_file.

        Raises:
            NotSupportedError: the kernel lacks the ioctl (before Linux 6.0).
            SyscallError: any other ioctl failure.
        """
        flags = DMA_BUF_SYNC_WRITE if write else DMA_BUF_SYNC_READ
        arg = bytearray(struct.pack("Ii", flags, -1))
        try:
            fcntl.ioctl(self.fd, DMA_BUF_IOCTL_EXPORT_SYNC_FILE, arg, True)
        except OSError as exc:
            if exc.errno in (errno.ENOTTY, errno.EINVAL):
                raise NotSupportedError(f"ioctl(DMA_BUF_IOCTL_EXPORT_SYNC_FILE) -> {errno.errorcode[exc.errno]}: "
                                        f"this kernel cannot export a dma-buf's fences (needs Linux 6.0)") from exc
            raise SyscallError("ioctl(DMA_BUF_IOCTL_EXPORT_SYNC_FILE)", exc) from exc
        _, sync_fd = struct.unpack("Ii", bytes(arg))
        return OwnedFd(sync_fd)

    def sync(self, start: bool, read: bool = True, write: bool = True) -> None:
        """``DMA_BUF_IOCTL_SYNC`` around CPU access to an mmap of the buffer.

        Call with ``start=True`` before and ``start=False`` after the access.

        Raises:
            SyscallError: the ioctl failed (errno from the kernel).
        """
        flags = (DMA_BUF_SYNC_START if start else DMA_BUF_SYNC_END)
        flags |= (DMA_BUF_SYNC_READ if read else 0) | (DMA_BUF_SYNC_WRITE if write else 0)
        try:
            fcntl.ioctl(self.fd, DMA_BUF_IOCTL_SYNC, struct.pack("Q", flags))
        except OSError as exc:
            raise SyscallError("ioctl(DMA_BUF_IOCTL_SYNC)", exc) from exc

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self._fd}"
        return f"<DmaBuf {state} size={self._size}>"
