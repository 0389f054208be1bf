"""What the benchmark measures: each mechanism's name, kind and one hand-off in words."""

from __future__ import annotations

from .iceoryx import INSTALL_HINT as ICEORYX_INSTALL, MECHANISMS as ICEORYX
from .torch_sharing import MECHANISMS as TORCH_SHARING

__all__ = ["MECHANISMS", "CUDA_FREE", "GPU_HANDOFF_OURS", "CACHED_RING", "SPINNING", "INSTALL", "CHANNELS",
           "THROUGHPUT"]

#: Buffers per size in the producer's ring for ``posix-fd-cached``.
CACHED_RING = 2

#: name -> (kind, module that must be importable or None, what one hand-off does)
MECHANISMS: dict[str, tuple[str, str | None, str]] = {
    "posix-fd": ("ours", None,
                 "naive: every hand-off exports a fresh cuMemCreate allocation (export_posix_fd: create, "
                 "reserve, map, set access, export the fd; the allocation is part of the export) and the "
                 "consumer imports it (import_posix_fd: import, reserve, map, set access), reads, unmaps"),
    "posix-fd-cached": ("ours", None,
                        f"cached: the producer hands off buffers from a ring of {CACHED_RING} exported POSIX-fd "
                        "allocations per size; the fd crosses once per allocation and the consumer keeps its "
                        "import (handle, reservation, mapping, access) keyed by the producer's allocation id, so "
                        "a hand-off is a JSON message naming the allocation; the first share of each allocation "
                        "(in the warm-ups) costs what posix-fd costs"),
    "dmabuf": ("ours", None,
               "dma-buf of an existing cuMemAlloc buffer (export_range) sent over SCM_RIGHTS; the consumer "
               "imports it (import_dmabuf) where the driver supports it, otherwise only export and transport "
               "are timed"),
    "memfd": ("ours", None,
              "host shared memory, no GPU: a fresh memfd per hand-off (export_memfd), mmap in the consumer "
              "(import_memfd), first access is a CPU read"),
    "channel": ("ours", None,
                "channels: the producer exports a device SharedPool once (POSIX-fd VMM chunks; each chunk's fd "
                f"crosses when first used, in the warm-ups) and per hand-off sends a block from a ring of "
                f"{CACHED_RING} pool.empty arrays per size, allocated before t0: Channel.send (an interprocess "
                "event recorded; a repeat of a known layout goes through the shared-memory ring beside the "
                "socket where both ends have it, anything else as a JSON message on the socket); the consumer's "
                "Channel.recv validates it and makes its stream wait on the event, as_array is the import, read4 "
                "the first access, then release()"),
    "channel-host": ("ours", None,
                     "channels over a host SharedPool (memfd chunks), no GPU: as channel, with NumPy arrays; "
                     "the first access is a CPU read"),
    "channel-socket": ("ours", None,
                       "as channel, with the shared-memory ring refused (listen and connect with ring=False): "
                       "every hand-off and release is a message on the socket"),
    "channel-host-socket": ("ours", None,
                            "as channel-host, with the shared-memory ring refused (listen and connect with "
                            "ring=False): every hand-off and release is a message on the socket"),
    "torch-ipc": ("peer", "torch",
                  "torch.multiprocessing CUDA tensor sharing as Queue.put/get do it: ForkingPickler.dumps of a "
                  "tensor allocated before t0 (cudaIpcGetMemHandle, IPC event, ref counter), "
                  "Connection.send_bytes, ForkingPickler.loads in the consumer (cudaIpcOpenMemHandle)"),
    "cuda-core-ipc": ("peer", "cuda.core",
                      "cuda.core IPC-enabled DeviceMemoryResource, pool shared once before timing; per hand-off "
                      "Buffer.ipc_descriptor of a buffer allocated before t0, sent as JSON, "
                      "Buffer.from_ipc_descriptor in the consumer"),
    "cupy-ipc": ("peer", "cupy",
                 "cupy.cuda.runtime.ipcGetMemHandle of a CuPy array allocated before t0, the 64-byte handle sent "
                 "as JSON, ipcOpenMemHandle / ipcCloseMemHandle in the consumer"),
}
MECHANISMS.update(TORCH_SHARING)
MECHANISMS.update(ICEORYX)
#: Mechanisms that need no CUDA driver.
CUDA_FREE = frozenset({"memfd", "channel-host", "channel-host-socket", *ICEORYX})
#: The channel mechanisms: name -> whether it asks for the shared-memory ring (``listen``/``connect`` ``ring=``).
CHANNELS = {"channel": True, "channel-host": True, "channel-socket": False, "channel-host-socket": False}
#: Mechanisms whose consumer can poll before it sleeps, measured a second time with ``--consumer-spin`` (a channel's
#: spin polls the ring, so the socket-only channels are not among them).
SPINNING = ("channel", "channel-host", *ICEORYX)
#: Mechanisms whose pipelined throughput is measured after the latency runs (:mod:`.throughput`).
THROUGHPUT = (*CHANNELS, *ICEORYX)
#: module -> how to install it, for a peer library reported as not installed.
INSTALL = {"iceoryx2": ICEORYX_INSTALL}
#: Ours whose consumer ends up with a usable CUDA device pointer (candidates for "our fastest").
GPU_HANDOFF_OURS = ("posix-fd", "posix-fd-cached", "dmabuf")
