"""dmabuf-interop: share CUDA buffers between contexts, processes and GPUs through Linux fds.

Importing this package never loads ``libcuda`` or initialises CUDA: the
driver is reached only when a function that needs it is called (see
:mod:`dmabuf_interop.driver`).

Modules, one concept each:

* :mod:`.errors` - the error hierarchy (``DmaBufError`` and friends).
* :mod:`.driver` - the one module that calls the CUDA driver API, checked.
* :mod:`.fd`, :mod:`.dmabuf` - fd ownership; the kernel's dma-buf uAPI.
* :mod:`.exporter`, :mod:`.importer` - dma-buf export from and import into CUDA.
* :mod:`.vmm` - CUDA VMM POSIX-fd shareable handles.
* :mod:`.memfd` - host shared memory, no GPU needed.
* :mod:`.buffers` - ``ExportedBuffer`` / ``ImportedBuffer``, the shapes all mechanisms return.
* :mod:`.mechanisms` - pick a mechanism by name.
* :mod:`.fdpass` - ``SCM_RIGHTS`` fd passing with timeouts.
* :mod:`.capabilities` - attributes, probes, cross-GPU pairs.
* :mod:`.kernels` - the NVRTC-compiled pattern writer and verifier.
* :mod:`.demos`, :mod:`.info`, :mod:`.bench`, :mod:`.cli` - the command line.
"""

from __future__ import annotations

from .buffers import ExportedBuffer, ImportedBuffer
from .dmabuf import DmaBuf, DmaBufInfo, is_dmabuf
from .errors import (
    AlignmentError,
    CudaError,
    DmaBufError,
    FdLimitError,
    FdPassError,
    ForkedAfterInitError,
    InvalidArgumentError,
    NoDriverError,
    NotADmaBufError,
    NotSupportedError,
    PeerClosedError,
    ProtocolError,
    TimeoutError,
)
from .exporter import export_device, export_host, export_range
from .fd import OwnedFd
from .fdpass import recv_fd, recv_message, reap_child, send_fd, send_message
from .importer import import_dmabuf
from .mechanisms import export_shareable, get_mechanism, import_shared
from .memfd import export_memfd, import_memfd
from .vmm import export_posix_fd, import_posix_fd

__version__ = "0.1.0"

__all__ = [
    "AlignmentError", "CudaError", "DmaBuf", "DmaBufError", "DmaBufInfo", "ExportedBuffer", "FdLimitError",
    "FdPassError", "ForkedAfterInitError", "ImportedBuffer", "InvalidArgumentError", "NoDriverError",
    "NotADmaBufError", "NotSupportedError", "OwnedFd", "PeerClosedError", "ProtocolError", "TimeoutError",
    "export_device", "export_host", "export_memfd", "export_posix_fd", "export_range", "export_shareable",
    "get_mechanism", "import_dmabuf", "import_shared", "import_memfd", "import_posix_fd", "is_dmabuf", "reap_child", "recv_fd", "recv_message",
    "send_fd", "send_message",
]
