"""dmabuf-interop: share CUDA buffers between contexts, processes and GPUs through Linux fds.

Importing this package never loads ``libcuda`` or initialises CUDA: the
driver is reached only when a function that needs it is called.

The library, one job per module (``docs/architecture.md`` walks through it):

* :mod:`.errors` - the error hierarchy callers branch on.
* :mod:`._driver` - the one module that calls the CUDA driver API, checked.
* :mod:`._checks`, :mod:`._time` - argument checks and deadlines shared by all.
* :mod:`.fd`, :mod:`.fdpass`, :mod:`.procs` - fd ownership; ``SCM_RIGHTS`` framing; child processes.
* :mod:`.linux_dmabuf` - ``DmaBuf`` and the kernel's dma-buf uAPI.
* :mod:`.kinds`, :mod:`.descriptor`, :mod:`.buffers` - names, the typed share descriptor,
  the buffers every mechanism returns.
* :mod:`.mechanisms` - dma-buf, POSIX fd and memfd side by side behind one interface.
* :mod:`.capabilities`, :mod:`.kernels` - what the driver claims; the pattern kernels.

The tools (``dmabuf-interop`` demos, ``info``, ``bench``) live in :mod:`.cli`
and only compose library calls.
"""

from __future__ import annotations

from .buffers import ExportedBuffer, ImportedBuffer, Transaction
from .descriptor import ShareDescriptor
from .errors import (
    AlignmentError,
    CudaError,
    CudaNotSupportedError,
    DmaBufError,
    FdLimitError,
    FdPassError,
    FdsInFlightError,
    ForkedAfterInitError,
    InvalidArgumentError,
    NoDriverError,
    NotADmaBufError,
    NotSupportedError,
    PeerClosedError,
    ProtocolError,
    SyscallError,
    WaitTimeoutError,
)
from .fd import OwnedFd
from .fdpass import recv_fd, recv_message, send_fd, send_message
from .kinds import MechanismName, MemoryKind
from .linux_dmabuf import DmaBuf, DmaBufInfo, is_dmabuf
from .mechanisms import export_shareable, get_mechanism, import_shared
from .mechanisms.dmabuf import export_device, export_host, export_range, import_dmabuf
from .mechanisms.memfd import export_memfd, import_memfd
from .mechanisms.posix_fd import export_posix_fd, import_posix_fd
from .procs import reap_child, wait_child

__version__ = "0.2.0"

__all__ = [
    "AlignmentError", "CudaError", "CudaNotSupportedError", "DmaBuf", "DmaBufError", "DmaBufInfo",
    "ExportedBuffer", "FdLimitError", "FdPassError", "FdsInFlightError", "ForkedAfterInitError", "ImportedBuffer",
    "InvalidArgumentError", "MechanismName", "MemoryKind", "NoDriverError", "NotADmaBufError",
    "NotSupportedError", "OwnedFd", "PeerClosedError", "ProtocolError", "ShareDescriptor", "SyscallError",
    "Transaction", "WaitTimeoutError",
    "export_device", "export_host", "export_memfd", "export_posix_fd", "export_range", "export_shareable",
    "get_mechanism", "import_dmabuf", "import_memfd", "import_posix_fd", "import_shared", "is_dmabuf",
    "reap_child", "recv_fd", "recv_message", "send_fd", "send_message", "wait_child",
]
