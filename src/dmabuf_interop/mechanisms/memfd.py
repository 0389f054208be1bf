"""Host shared memory through ``memfd_create`` + ``mmap``: the mechanism with no GPU.

It runs the same demos on any Linux machine (CI included), so the fork,
``SCM_RIGHTS`` and ownership logic is exercised where no CUDA driver exists.
The exporter creates an anonymous file with ``memfd_create(2)`` (close-on-exec,
sealable), sizes it with ``ftruncate``, seals its size
(``F_SEAL_SHRINK | F_SEAL_GROW``, so a peer cannot shrink it under a mapping
and cause ``SIGBUS``) and maps it ``MAP_SHARED``. The importer checks the fd is a
memfd and large enough (``fstat``) before mapping it. A memfd sealed against
writing (``F_SEAL_WRITE``, ``F_SEAL_FUTURE_WRITE``, see
:meth:`HostExportedBuffer.seal_read_only`) or an fd opened ``O_RDONLY`` is
mapped read-only, and its ``as_array()`` refuses writes. Nothing here reads
``/proc``: it works in a chroot or sandbox without it.

Pattern writing and checking use NumPy over the mapping (the host-side twin of
the CUDA kernels in :mod:`.kernels`).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import sys
from typing import Any, Sequence

from .._checks import byte_count, byte_offset
from ..buffers import ExportedBuffer, ImportedBuffer, Transaction, array_shape
from ..descriptor import ShareDescriptor
from ..errors import InvalidArgumentError, SyscallError
from ..fd import OwnedFd, fd_kind
from ._base import Mechanism

__all__ = ["export_memfd", "import_memfd", "host_array", "write_pattern_host", "count_mismatches_host",
           "HostExportedBuffer", "HostImportedBuffer", "MemfdMechanism"]


# Linux 5.1+; Python's fcntl module names it from 3.12 only.
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)


#: ``mmap.mmap`` keeps a duplicate of the fd for as long as it lives (for ``size()`` and ``resize()``,
#: unused here) unless told not to, which Python 3.13 added: without it, a mapping costs one more fd.
_MMAP_KW = {"trackfd": False} if sys.version_info >= (3, 13) else {}


class _Mapping:
    """Keeps an ``mmap`` and exposes its address without copying. From Python 3.13 it holds no fd
    (``trackfd=False``); before, Python's ``mmap`` holds a duplicate of ``fd`` while it is mapped."""

    def __init__(self, fd: int, length: int, writable: bool = True) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self.map = mmap.mmap(fd, length, mmap.MAP_SHARED, prot, **_MMAP_KW)
        self.writable = writable
        # ctypes cannot take the address of a read-only buffer: ask NumPy, which can.
        import numpy as np

        self.address = np.frombuffer(self.map, dtype=np.uint8).__array_interface__["data"][0]

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a NumPy view still uses it; the GC closes it later
            pass


class _HostView:
    """What host buffers add: a NumPy view of their own mapping at their own offset."""

    _mapping: _Mapping
    _view_offset: int
    size: int

    def as_array(self, dtype: Any = "uint8", shape: Sequence[int] | None = None) -> Any:
        """A NumPy array over the shared pages (no copy; valid until close), C-contiguous.

        NumPy arrays are DLPack producers too (on the CPU).

        Raises:
            InvalidArgumentError: the buffer is closed, a dtype that is not NumPy's or cannot view raw
                memory (``object``, ``"S0"``), a negative extent, or the shape needs more than ``size`` bytes.
        """
        import numpy as np

        self._check_open()  # type: ignore[attr-defined]
        dt, dims, need = array_shape(self.size, dtype, shape)
        flat = np.frombuffer(self._mapping.map, dtype=dt, count=need // dt.itemsize, offset=self._view_offset)
        return flat.reshape(dims)


class HostExportedBuffer(_HostView, ExportedBuffer):
    """An exported memfd: owns the fd and the exporter's ``MAP_SHARED`` mapping."""

    def __init__(self, *, handle: OwnedFd, mapping: _Mapping, size: int, cleanups: Sequence[Any]) -> None:
        super().__init__(mechanism="memfd", memory="memfd", handle=handle, ptr=mapping.address, size=size,
                         offset=0, export_size=size, device=-1, cleanups=cleanups)
        self._mapping = mapping
        self._view_offset = 0

    def seal_read_only(self) -> None:
        """Seal the memfd against writes by anyone who maps it from now on
        (``fcntl(F_ADD_SEALS, F_SEAL_FUTURE_WRITE)``, Linux 5.1+): consumers that import it
        afterwards get a read-only mapping. This buffer's own mapping stays writable; call it
        once the contents are written, before sending.

        Raises:
            InvalidArgumentError: the buffer is closed.
            SyscallError: ``fcntl(F_ADD_SEALS)`` failed (``EINVAL`` on kernels before 5.1).
        """
        try:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
        except OSError as exc:
            raise SyscallError("fcntl(F_ADD_SEALS, F_SEAL_FUTURE_WRITE)", exc) from exc


class HostImportedBuffer(_HostView, ImportedBuffer):
    """An imported memfd: owns the importer's ``MAP_SHARED`` mapping of ``[offset, offset + size)``."""

    def __init__(self, *, mapping: _Mapping, offset: int, size: int, cleanups: Sequence[Any]) -> None:
        super().__init__(mechanism="memfd", ptr=mapping.address + offset, size=size, device=-1, cleanups=cleanups)
        self._mapping = mapping
        self._view_offset = offset

    @property
    def read_only(self) -> bool:
        """True when the memfd was sealed against writing or the fd was opened ``O_RDONLY``:
        the mapping is ``PROT_READ`` and ``as_array()`` refuses writes."""
        return not self._mapping.writable

    def as_buffer(self) -> Any:
        raise InvalidArgumentError("host shared memory (memfd) is not CUDA memory: use as_array() for a NumPy view")


def export_memfd(size: int, name: str = "dmabuf-interop") -> HostExportedBuffer:
    """Create, size, seal and map a memfd of ``size`` bytes (> 0).

    ``memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING)``, ``ftruncate``,
    ``fcntl(F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW)``, ``mmap(MAP_SHARED)``
    (memfd_create(2), fcntl(2) "File Sealing").

    Returns:
        HostExportedBuffer(mechanism="memfd", memory="memfd", device=-1), ``ptr``
        the host address of the mapping; ``as_array()`` gives a NumPy view.

    Raises:
        InvalidArgumentError: size <= 0 or not an integer.
        SyscallError: ``memfd_create``, ``ftruncate``, ``fcntl(F_ADD_SEALS)`` or
            ``mmap`` failed (e.g. ``ENOMEM``, or a size the kernel cannot take).
    """
    size = byte_count(size)
    try:
        fd = OwnedFd(os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
    except OSError as exc:
        raise SyscallError("memfd_create", exc) from exc
    with Transaction() as tx:
        tx.push(fd.close)
        step = "ftruncate"
        try:
            os.ftruncate(fd.fd, size)
            step = "fcntl(F_ADD_SEALS)"
            fcntl.fcntl(fd.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            step = "mmap"
            mapping = _Mapping(fd.fd, size)
        except (OSError, OverflowError, ValueError) as exc:
            raise SyscallError(step, exc) from exc
        tx.push(mapping.close)
        return HostExportedBuffer(handle=fd, mapping=mapping, size=size, cleanups=tx.commit())


def import_memfd(fd: int | OwnedFd, size: int, offset: int = 0) -> HostImportedBuffer:
    """Map ``[offset, offset+size)`` of a received memfd, ``MAP_SHARED``.

    The mapping is read-only (``PROT_READ``, :attr:`HostImportedBuffer.read_only`) when the memfd
    is sealed with ``F_SEAL_WRITE`` or ``F_SEAL_FUTURE_WRITE``, or the fd was opened ``O_RDONLY``
    (``fcntl(F_GET_SEALS)``, ``fcntl(F_GETFL)``); writable otherwise. The fd is not consumed:
    the mapping stays valid after the caller closes it.

    Raises:
        InvalidArgumentError: not an open memfd (``fstat``, ``fstatfs``), a memfd not sealed
            against shrinking (``F_SEAL_SHRINK``), size <= 0, offset < 0, or the range
            exceeds the file's size (``fstat``).
        SyscallError: ``fcntl`` or ``mmap`` failed.
    """
    raw = fd.fd if isinstance(fd, OwnedFd) else fd
    kind = fd_kind(raw)
    if kind == "closed":
        raise InvalidArgumentError(f"fd {raw!r} is not an open file descriptor")
    if kind != "memfd":
        raise InvalidArgumentError(f"fd {raw} is not a memfd: it is a {kind}")
    size = byte_count(size)
    offset = byte_offset(offset)
    try:
        seals = fcntl.fcntl(raw, fcntl.F_GET_SEALS)
        access = fcntl.fcntl(raw, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError as exc:
        raise SyscallError("fcntl(F_GET_SEALS)", exc) from exc
    if not seals & fcntl.F_SEAL_SHRINK:
        # Without the seal the sender could ftruncate() the file under our mapping,
        # and the next read would kill this process with SIGBUS.
        raise InvalidArgumentError(f"memfd fd {raw} is not sealed with F_SEAL_SHRINK: its sender could shrink "
                                   f"it under the mapping (SIGBUS); export it with export_memfd")
    file_size = os.fstat(raw).st_size
    if offset + size > file_size:
        raise InvalidArgumentError(f"offset {offset} + size {size} exceeds the memfd's {file_size} bytes")
    writable = access != os.O_RDONLY and not seals & (fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)
    try:
        mapping = _Mapping(raw, offset + size, writable)
    except (OSError, OverflowError, ValueError) as exc:
        raise SyscallError("mmap", exc) from exc
    return HostImportedBuffer(mapping=mapping, offset=offset, size=size, cleanups=[mapping.close])


def host_array(buf: HostExportedBuffer | HostImportedBuffer, dtype: Any = "int32") -> Any:
    """A flat NumPy array over a memfd buffer's bytes (no copy; valid until close)."""
    import numpy as np

    dt = np.dtype(dtype)
    return buf.as_array(dt, (buf.size // dt.itemsize,))


#: Elements handled at a time by the host pattern functions (16 MiB of int32), so
#: their temporary arrays stay small whatever the buffer's size.
_CHUNK = 1 << 22


def _expected(base: int, start: int, stop: int) -> Any:
    import numpy as np

    # int32 wrap-around, as the CUDA kernels compute base + (int)i
    return (np.arange(start, stop, dtype=np.int64) + base).astype(np.int32)


def write_pattern_host(buf: HostExportedBuffer | HostImportedBuffer, base: int = 0x1000) -> None:
    """``a[i] = base + i`` (int32) over the buffer, in chunks of 4M elements."""
    a = host_array(buf)
    for start in range(0, a.size, _CHUNK):
        stop = min(start + _CHUNK, a.size)
        a[start:stop] = _expected(base, start, stop)
    del a


def count_mismatches_host(buf: HostExportedBuffer | HostImportedBuffer, base: int = 0x1000) -> int:
    """How many int32 elements differ from ``base + i`` (checked in chunks of 4M elements)."""
    import numpy as np

    a = host_array(buf)
    n = 0
    for start in range(0, a.size, _CHUNK):
        stop = min(start + _CHUNK, a.size)
        n += int(np.count_nonzero(a[start:stop] != _expected(base, start, stop)))
    del a
    return n


class MemfdMechanism(Mechanism):
    """Host shared memory (``memfd_create`` + ``mmap``), NumPy write and verify; no GPU."""

    name = "memfd"
    uses_cuda = False

    def export(self, size: int, device: int) -> ExportedBuffer:
        """:func:`export_memfd`, after checking that the pattern (every byte is written) fits in
        ``MemAvailable`` from ``/proc/meminfo``.

        Raises:
            InvalidArgumentError: more bytes than the machine has available.
            SyscallError: as :func:`export_memfd`.
        """
        avail = _mem_available()
        if avail is not None and size > avail:
            raise InvalidArgumentError(
                f"{size} bytes of host shared memory is more than this machine has available "
                f"({avail} bytes, MemAvailable in /proc/meminfo); the demo writes every byte")
        return export_memfd(size)

    def import_(self, fd: int, descriptor: ShareDescriptor, device: int) -> ImportedBuffer:
        return import_memfd(fd, descriptor.size, descriptor.offset)

    def write_pattern(self, exported: ExportedBuffer) -> None:
        write_pattern_host(exported)  # type: ignore[arg-type]

    def count_mismatches(self, imported: ImportedBuffer) -> int:
        return count_mismatches_host(imported)  # type: ignore[arg-type]


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
