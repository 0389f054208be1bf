"""Host shared memory through ``memfd_create`` + ``mmap``: the mechanism with no GPU.

It runs the same demos on any Linux machine (CI included), so the fork,
``SCM_RIGHTS`` and ownership logic is exercised where no CUDA driver exists.
The exporter creates an anonymous file with ``memfd_create(2)`` (close-on-exec,
sealable), sizes it with ``ftruncate``, seals its size
(``F_SEAL_SHRINK | F_SEAL_GROW``, so a peer cannot shrink it under a mapping
and cause ``SIGBUS``) and maps it ``MAP_SHARED``. The importer checks the fd is a
memfd and large enough (``fstat``) before mapping it.

Pattern writing and checking use NumPy over the mapping (the host-side twin of
the CUDA kernels in :mod:`.kernels`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import Any

from .buffers import ExportedBuffer, ImportedBuffer
from .errors import InvalidArgumentError, SyscallError
from .fd import OwnedFd, fd_is_open

__all__ = ["export_memfd", "import_memfd", "is_memfd", "host_array", "write_pattern_host", "count_mismatches_host"]


def is_memfd(fd: int) -> bool:
    """True when ``fd`` is an open memfd (its ``/proc/self/fd`` link reads ``/memfd:...``)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    except (OSError, TypeError):
        return False


class _Mapping:
    """Keeps an ``mmap`` and exposes its address without copying."""

    def __init__(self, fd: int, length: int) -> None:
        import ctypes

        self.map = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a NumPy view still uses it; the GC closes it later
            pass


def export_memfd(size: int, name: str = "dmabuf-interop") -> ExportedBuffer:
    """Create, size, seal and map a memfd of ``size`` bytes (> 0).

    Returns:
        ExportedBuffer(mechanism="memfd", memory="memfd", device=-1), ``ptr``
        the host address of the mapping. Use :func:`host_array` for a NumPy view.

    Raises:
        InvalidArgumentError: size <= 0.
        SyscallError: ``memfd_create``, ``ftruncate``, ``fcntl(F_ADD_SEALS)`` or
            ``mmap`` failed (e.g. ``ENOMEM``, or a size the kernel cannot take).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise InvalidArgumentError(f"size must be > 0 bytes, got {size!r}")
    try:
        fd = OwnedFd(os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
    except OSError as exc:
        raise SyscallError("memfd_create", exc) from exc
    step = "ftruncate"
    try:
        os.ftruncate(fd.fd, size)
        step = "fcntl(F_ADD_SEALS)"
        fcntl.fcntl(fd.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        step = "mmap"
        mapping = _Mapping(fd.fd, size)
    except (OSError, OverflowError, ValueError) as exc:
        fd.close()
        raise SyscallError(step, exc) from exc
    except BaseException:
        fd.close()
        raise
    buf = ExportedBuffer(mechanism="memfd", memory="memfd", handle=fd, ptr=mapping.address, size=size,
                         offset=0, export_size=size, device=-1)
    buf._mapping = mapping  # type: ignore[attr-defined]
    buf._push(mapping.close)
    buf._push(fd.close)
    return buf


def import_memfd(fd: int | OwnedFd, size: int, offset: int = 0) -> ImportedBuffer:
    """Map ``[offset, offset+size)`` of a received memfd, ``MAP_SHARED``.

    The fd is not consumed: the mapping stays valid after the caller closes it.

    Raises:
        InvalidArgumentError: not an open memfd, a memfd not sealed against
            shrinking (``F_SEAL_SHRINK``), size <= 0, offset < 0, or the range
            exceeds the file's size (``fstat``).
    """
    raw = fd.fd if isinstance(fd, OwnedFd) else fd
    if not fd_is_open(raw):
        raise InvalidArgumentError(f"fd {raw!r} is not an open file descriptor")
    if not is_memfd(raw):
        raise InvalidArgumentError(f"fd {raw} is not a memfd: {os.readlink(f'/proc/self/fd/{raw}')!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise InvalidArgumentError(f"size must be > 0 bytes, got {size!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise InvalidArgumentError(f"offset must be >= 0 bytes, got {offset!r}")
    if not fcntl.fcntl(raw, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
        # Without the seal the sender could ftruncate() the file under our mapping,
        # and the next read would kill this process with SIGBUS.
        raise InvalidArgumentError(f"memfd fd {raw} is not sealed with F_SEAL_SHRINK: its sender could shrink "
                                   f"it under the mapping (SIGBUS); export it with export_memfd")
    file_size = os.fstat(raw).st_size
    if offset + size > file_size:
        raise InvalidArgumentError(f"offset {offset} + size {size} exceeds the memfd's {file_size} bytes")
    try:
        mapping = _Mapping(raw, offset + size)
    except (OSError, OverflowError, ValueError) as exc:
        raise SyscallError("mmap", exc) from exc
    buf = ImportedBuffer(mechanism="memfd", ptr=mapping.address + offset, size=size, device=-1)
    buf._mapping = mapping  # type: ignore[attr-defined]
    buf._offset = offset  # type: ignore[attr-defined]
    buf._push(mapping.close)
    return buf


def host_array(buf: ExportedBuffer | ImportedBuffer, dtype: Any = "int32") -> Any:
    """A NumPy array over a memfd buffer's bytes (no copy; valid until close)."""
    import numpy as np

    mapping: _Mapping = buf._mapping  # type: ignore[attr-defined]
    offset = getattr(buf, "_offset", getattr(buf, "offset", 0))
    dt = np.dtype(dtype)
    return np.frombuffer(mapping.map, dtype=dt, count=buf.size // dt.itemsize, offset=offset)


#: Elements handled at a time by the host pattern functions (16 MiB of int32), so
#: their temporary arrays stay small whatever the buffer's size.
_CHUNK = 1 << 22


def _expected(base: int, start: int, stop: int) -> Any:
    import numpy as np

    # int32 wrap-around, as the CUDA kernels compute base + (int)i
    return (np.arange(start, stop, dtype=np.int64) + base).astype(np.int32)


def write_pattern_host(buf: ExportedBuffer | ImportedBuffer, base: int = 0x1000) -> None:
    """``a[i] = base + i`` (int32) over the buffer, in chunks of 4M elements."""
    a = host_array(buf)
    for start in range(0, a.size, _CHUNK):
        stop = min(start + _CHUNK, a.size)
        a[start:stop] = _expected(base, start, stop)
    del a


def count_mismatches_host(buf: ExportedBuffer | ImportedBuffer, base: int = 0x1000) -> int:
    """How many int32 elements differ from ``base + i`` (checked in chunks of 4M elements)."""
    import numpy as np

    a = host_array(buf)
    n = 0
    for start in range(0, a.size, _CHUNK):
        stop = min(start + _CHUNK, a.size)
        n += int(np.count_nonzero(a[start:stop] != _expected(base, start, stop)))
    del a
    return n
