"""The producer and consumer processes of ``dmabuf-interop bench``.

Started by :mod:`.bench` as ``python -m dmabuf_interop.bench_peers ROLE CTL PC AUX``
(fresh interpreters, never forked from a process that touched CUDA). ``CTL``
is the socket to the parent, ``PC`` the producer-consumer socket, ``AUX`` a
second producer-consumer socket that only torch uses (as a
``multiprocessing.connection.Connection``). Every message on ``CTL`` and
``PC`` is JSON through :func:`~.fdpass.send_message` /
:func:`~.fdpass.recv_message`; nothing received from a peer is unpickled,
except by torch itself in the ``torch-ipc`` peer measurement.

Protocol of one latency cell (one mechanism, one size)::

    consumer -> producer   {"ready"}                        after both set up
    repeat warm-up + reps times:
      producer: t0, export, t_exp, t_send, send the hand-off (fd or JSON)
      consumer: receive, t_recv, import + map, t_imp, read 4 bytes, t_read
      consumer: release its import, then {"ack"}
      producer: release its buffer after the ack
    each side -> parent    its per-rep timestamps ({"rec"}), then {"cell"}

Timestamps are ``time.monotonic_ns()``, which is ``clock_gettime(CLOCK_MONOTONIC)``
on Linux, one clock for both processes. The parent turns them into phases.

Besides the latency cells, a ``_bandwidth`` pair measures a read kernel over a
POSIX-fd import against a native ``cuMemAlloc`` allocation, the same import
read from another GPU against ``cuMemcpyPeer``, and the Python overhead of the
library against the same driver calls made directly in a tight loop.
"""

from __future__ import annotations

import ctypes
import os
import socket
import statistics
import sys
import time
from collections import Counter
from typing import Any

from ... import _driver as driver
from ...errors import CudaError, NotSupportedError
from ...fd import OwnedFd
from ...fdpass import close_fds as _close_fds
from ...fdpass import recv_message, send_message

__all__ = ["main", "READ_SOURCE", "CACHED_RING"]

now = time.monotonic_ns  # CLOCK_MONOTONIC on Linux (time.get_clock_info("monotonic"))

#: Buffers per size in the producer's ring for ``posix-fd-cached``.
CACHED_RING = 2

READ_SOURCE = r"""
struct alignas(16) u4 { unsigned int x, y, z, w; };

extern "C" __global__ void read4(const unsigned int* p, unsigned int* out) {
    out[0] = p[0];
}

extern "C" __global__ void read_all(const u4* p, unsigned long long n, unsigned int* out) {
    /* Four independent 16-byte loads in flight per thread and iteration. */
    unsigned int acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        u4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        u4 a = p[i];
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    if (acc == 0x9e3779b9u) out[1] = acc;  /* never true in practice; keeps the loads */
}
"""


class NotInstalled(Exception):
    """A peer library is missing in this interpreter."""




# --- kernels -----------------------------------------------------------------------------

class Reader:
    """The consumer's kernels on one device: ``read4`` (first access) and ``read_all`` (bandwidth).

    ``read4`` copies the first 4 bytes of the mapping into pinned host memory
    (``cuMemAllocHost``, visible to the kernel through unified addressing),
    then the stream is synchronised: one launch, one sync.
    """

    def __init__(self, device: int) -> None:
        from cuda.core import LaunchConfig, Program, ProgramOptions

        from ...kernels import cache_dir

        self.device = device
        dev = driver.set_current(device)
        self.stream = dev.default_stream
        program = Program(READ_SOURCE, code_type="c++",
                          options=ProgramOptions(arch=f"sm_{dev.arch}", name="dmabuf_interop_bench"))
        try:
            from cuda.core.utils import FileStreamProgramCache

            cache_dir().mkdir(parents=True, exist_ok=True)
            code = program.compile("cubin", cache=FileStreamProgramCache(cache_dir()))
        except OSError:
            code = program.compile("cubin")
        self.k_read4 = code.get_kernel("read4")
        self.k_read_all = code.get_kernel("read_all")
        self.sms = int(dev.properties.multiprocessor_count)
        self.host = driver.mem_alloc_host(4096)
        self.slot = ctypes.c_uint32.from_address(self.host)
        self.one = LaunchConfig(grid=1, block=1)
        import numpy as np

        self._u64 = np.uint64
        scratch = driver.mem_alloc(4096)  # warm: module load, first launch
        self.read4(scratch)
        driver.mem_free(scratch)

    def read4(self, ptr: int) -> int:
        from cuda.core import launch

        launch(self.stream, self.one, self.k_read4, self._u64(ptr), self._u64(self.host))
        self.stream.sync()
        return self.slot.value

    def bandwidth(self, ptrs: list[int], nbytes: int, reps: int) -> list[dict[str, Any]]:
        """Median GB/s (1e9 bytes/s) of ``read_all`` over ``nbytes`` at each of ``ptrs``.

        CUDA events around each launch; the pointers take turns, repetition by
        repetition, so drift and clock changes hit them alike.
        """
        from cuda.core import EventOptions, LaunchConfig, launch

        driver.set_current(self.device)
        n = nbytes // 16
        if n == 0:
            return [{"gbps": None, "reason": "fewer than 16 bytes"} for _ in ptrs]
        block = 256
        config = LaunchConfig(grid=max(1, min((n + block - 1) // block, self.sms * 8)), block=block)
        opts = EventOptions(timing_enabled=True)
        args = [(self._u64(p), self._u64(n), self._u64(self.host)) for p in ptrs]
        for a in args:
            launch(self.stream, config, self.k_read_all, *a)
        self.stream.sync()
        seconds: list[list[float]] = [[] for _ in ptrs]
        for _ in range(reps):
            for k, a in enumerate(args):
                e0 = self.stream.record(options=opts)
                launch(self.stream, config, self.k_read_all, *a)
                e1 = self.stream.record(options=opts)
                e1.sync()
                seconds[k].append((e1 - e0) * 1e-3)
        out = []
        for secs in seconds:
            med = statistics.median(secs)
            out.append({"gbps": n * 16 / med / 1e9, "median_us": med * 1e6, "bytes": n * 16})
        return out


class Steps:
    """Times named :mod:`.driver` functions while installed, to show where the time goes.

    The library calls ``driver.<name>`` through the module, so replacing the
    module attributes catches every call; each wrapper adds about 0.2 µs.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.acc = dict.fromkeys(names, 0)
        self._orig: dict[str, Any] = {}

    def install(self) -> "Steps":
        for name in self.names:
            fn = getattr(driver, name)
            self._orig[name] = fn
            setattr(driver, name, self._wrap(name, fn))
        return self

    def _wrap(self, name: str, fn: Any) -> Any:
        acc = self.acc

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = now()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] += now() - t
        return timed

    def take(self) -> dict[str, int]:
        out = {k: v for k, v in self.acc.items() if v}
        for k in self.acc:
            self.acc[k] = 0
        return out

    def uninstall(self) -> None:
        for name, fn in self._orig.items():
            setattr(driver, name, fn)
        self._orig.clear()


EXPORT_STEPS = ("set_current", "vmm_granularity", "vmm_create", "vmm_reserve", "vmm_map", "vmm_set_access",
                "vmm_export_posix_fd", "device_uuid")
IMPORT_STEPS = ("set_current", "vmm_import_posix_fd", "vmm_allocation_device", "can_access_peer",
                "vmm_granularity", "vmm_reserve", "vmm_map", "vmm_set_access")


# --- mechanisms --------------------------------------------------------------------------

class IO:
    """What a role needs: its sockets, devices and limits."""

    def __init__(self, role: str, ctl: socket.socket, pc: socket.socket, aux: socket.socket,
                 cfg: dict[str, Any]) -> None:
        self.role = role
        self.ctl = ctl
        self.pc = pc
        self.aux = aux
        self.cfg = cfg
        self.producer_device = int(cfg["devices"][0])
        self.consumer_device = int(cfg["devices"][1])
        self.device = self.producer_device if role == "producer" else self.consumer_device
        self.timeout = float(cfg["timeout"])


class Bench:
    """One mechanism, both roles. Subclasses fill in the hooks."""

    uses_cuda = True

    def __init__(self, io: IO) -> None:
        self.io = io
        self.readers: dict[int, Reader] = {}
        self.import_status = "ok"

    # set-up and per-cell hooks
    def setup(self) -> dict[str, Any]:
        """Import what is needed, create the CUDA context, warm the kernels. Returns versions."""
        if self.uses_cuda:
            driver.set_current(self.io.device)
            if self.io.role == "consumer":
                self.reader(self.io.device)
        return {}

    def reader(self, device: int) -> Reader:
        r = self.readers.get(device)
        if r is None:
            r = self.readers[device] = Reader(device)
        return r

    def cell(self, size: int) -> None:
        self.size = size

    def cell_end(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass

    # per repetition
    def produce(self, rep: int) -> dict[str, Any]:
        raise NotImplementedError

    def release_producer(self) -> None:
        pass

    def consume(self, rep: int) -> dict[str, Any]:
        raise NotImplementedError

    def release_consumer(self) -> None:
        pass

    # helpers
    def recv(self, max_fds: int = 1) -> tuple[dict[str, Any], list[int]]:
        return recv_message(self.io.pc, self.io.timeout, max_fds=max_fds)

    def share(self, rep: int, export: Any) -> list[int]:
        """Time ``export()``, keep the ExportedBuffer for :meth:`release_exported`, send its fd
        and metadata: ``[t0, t_exp, t_send]``."""
        t0 = now()
        self.exported = export()
        t_exp = now()
        t_send = now()
        send_message(self.io.pc, {"rep": rep, **self.exported.describe().to_json()}, self.exported.fd)
        return [t0, t_exp, t_send]

    def release_exported(self) -> None:
        self.exported.close()


class PosixFd(Bench):
    """Naive: a fresh exportable allocation and a fresh import for every hand-off."""

    def setup(self) -> dict[str, Any]:
        out = super().setup()
        self.steps = Steps(EXPORT_STEPS if self.io.role == "producer" else IMPORT_STEPS).install()
        return out

    def produce(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.posix_fd import export_posix_fd

        self.steps.take()
        t = self.share(rep, lambda: export_posix_fd(self.size, self.io.producer_device))
        return {"t": t, "steps": self.steps.take()}

    release_producer = Bench.release_exported

    def consume(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.posix_fd import import_posix_fd

        msg, fds = self.recv()
        t_recv = now()
        self.fds = fds
        self.steps.take()
        imported = import_posix_fd(fds[0], self.size, self.io.consumer_device, int(msg["offset"]),
                                   int(msg["export_size"]))
        t_imp = now()
        steps = self.steps.take()
        self.imported = imported
        self.reader(self.io.consumer_device).read4(imported.ptr)
        t_read = now()
        return {"t": [t_recv, t_imp, t_read], "steps": steps}

    def release_consumer(self) -> None:
        self.imported.close()
        _close_fds(self.fds)

    def close(self) -> None:
        if hasattr(self, "steps"):
            self.steps.uninstall()


class PosixFdCached(Bench):
    """Cached: a ring of exported allocations; the fd crosses once, the consumer keeps its imports.

    Producer: :data:`CACHED_RING` ``export_posix_fd`` allocations per size,
    made on first use and reused round-robin. A hand-off of an allocation the
    consumer has already received is a JSON message naming it
    (``{"alloc": id, "offset": 0, "size": n}``), no fd.
    Consumer: a dict ``alloc id -> ImportedBuffer`` (``import_posix_fd``:
    handle, reservation, mapping, access), filled on first sight, so a hand-off
    costs a lookup. Warm-ups cover the first share of each ring slot; a rep
    that still pays it is flagged ``first_share``.
    """

    def cell(self, size: int) -> None:
        super().cell(size)
        self.ring: list[Any] = [None] * CACHED_RING
        self.sent: set[int] = set()
        self.cache: dict[str, Any] = {}

    def produce(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.posix_fd import export_posix_fd

        slot = rep % CACHED_RING
        t0 = now()
        exported = self.ring[slot]
        if exported is None:
            exported = self.ring[slot] = export_posix_fd(self.size, self.io.producer_device)
        t_exp = now()
        msg = {"rep": rep, "alloc": f"{os.getpid()}:{self.size}:{slot}", "offset": 0, "size": self.size}
        t_send = now()
        if slot in self.sent:
            send_message(self.io.pc, msg)
        else:
            send_message(self.io.pc, {**msg, "export_size": exported.export_size}, exported.fd)
            self.sent.add(slot)
        return {"t": [t0, t_exp, t_send]}

    def consume(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.posix_fd import import_posix_fd

        msg, fds = self.recv()
        t_recv = now()
        first = False
        try:
            imported = self.cache.get(msg["alloc"])
            if imported is None:
                first = True
                imported = import_posix_fd(fds[0], self.size, self.io.consumer_device, 0, int(msg["export_size"]))
                self.cache[msg["alloc"]] = imported
        finally:
            _close_fds(fds)
        t_imp = now()
        self.reader(self.io.consumer_device).read4(imported.ptr + int(msg["offset"]))
        t_read = now()
        return {"t": [t_recv, t_imp, t_read], "first_share": first}

    def cell_end(self) -> dict[str, Any]:
        for imported in self.cache.values():
            imported.close()
        for exported in self.ring:
            if exported is not None:
                exported.close()
        self.cache.clear()
        return {}


class DmaBufBench(Bench):
    """dma-buf of an existing ``cuMemAlloc`` buffer; import where the driver supports it."""

    def cell(self, size: int) -> None:
        super().cell(size)
        if self.io.role == "producer":
            from ...mechanisms.dmabuf import page_size

            driver.set_current(self.io.producer_device)
            page = page_size()
            self.raw = driver.mem_alloc(size + 2 * page)
            self.ptr = (self.raw + page - 1) // page * page

    def cell_end(self) -> dict[str, Any]:
        if self.io.role == "producer":
            driver.set_current(self.io.producer_device)
            driver.mem_free(self.raw)
        return {"import": self.import_status}

    def produce(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.dmabuf import export_range

        return {"t": self.share(rep, lambda: export_range(self.ptr, self.size))}

    release_producer = Bench.release_exported

    def consume(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.dmabuf import import_dmabuf

        msg, fds = self.recv()
        t_recv = now()
        self.fds = fds
        self.imported = None
        if self.import_status != "ok":
            return {"t": [t_recv, None, None]}
        try:
            self.imported = import_dmabuf(fds[0], self.size, self.io.consumer_device, int(msg["offset"]))
        except NotSupportedError as exc:
            self.import_status = f"unsupported ({exc.result})"
            return {"t": [t_recv, None, None]}
        except CudaError as exc:
            self.import_status = f"failed ({exc})"
            return {"t": [t_recv, None, None]}
        t_imp = now()
        self.reader(self.io.consumer_device).read4(self.imported.ptr)
        t_read = now()
        return {"t": [t_recv, t_imp, t_read]}

    def release_consumer(self) -> None:
        if self.imported is not None:
            self.imported.close()
        _close_fds(self.fds)


class MemfdBench(Bench):
    """Host shared memory: a fresh memfd per hand-off; the first access is a CPU read."""

    uses_cuda = False

    def produce(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.memfd import export_memfd

        return {"t": self.share(rep, lambda: export_memfd(self.size))}

    release_producer = Bench.release_exported

    def consume(self, rep: int) -> dict[str, Any]:
        from ...mechanisms.memfd import import_memfd

        msg, fds = self.recv()
        t_recv = now()
        self.fds = fds
        imported = import_memfd(fds[0], self.size, int(msg["offset"]))
        t_imp = now()
        ctypes.c_uint32.from_address(imported.ptr).value  # noqa: B018 - the first access
        t_read = now()
        self.imported = imported
        return {"t": [t_recv, t_imp, t_read]}

    def release_consumer(self) -> None:
        self.imported.close()
        _close_fds(self.fds)


class TorchIpc(Bench):
    """torch.multiprocessing sharing of a CUDA tensor, as ``Queue.put`` / ``Queue.get`` do it.

    ``Connection.send(obj)`` is ``send_bytes(ForkingPickler.dumps(obj))`` and
    ``recv()`` is ``ForkingPickler.loads(recv_bytes())``; the two halves are
    timed separately: ``dumps`` (torch's ``reduce_tensor``:
    ``cudaIpcGetMemHandle``, an IPC event, the ref counter) is the export,
    ``loads`` (``rebuild_cuda_tensor``: ``cudaIpcOpenMemHandle``, event wait)
    the import. The tensor is allocated (caching allocator) before t0.
    """

    def setup(self) -> dict[str, Any]:
        try:
            import torch
            import torch.multiprocessing  # noqa: F401 - registers the CUDA tensor reductions
        except ImportError as exc:
            raise NotInstalled(f"torch is not installed ({exc})") from exc
        from multiprocessing.connection import Connection
        from multiprocessing.reduction import ForkingPickler

        self.torch = torch
        self.pickler = ForkingPickler
        self.conn = Connection(os.dup(self.io.aux.fileno()))
        torch.cuda.set_device(self.io.device)
        torch.empty(1, device=f"cuda:{self.io.device}")
        torch.cuda.synchronize()
        out = super().setup()
        return {**out, "torch": torch.__version__}

    def produce(self, rep: int) -> dict[str, Any]:
        torch = self.torch
        tensor = torch.empty(self.size, dtype=torch.uint8, device=f"cuda:{self.io.producer_device}")
        torch.cuda.synchronize()
        t0 = now()
        payload = self.pickler.dumps(tensor)
        t_exp = now()
        self.tensor = tensor
        t_send = now()
        self.conn.send_bytes(payload)
        return {"t": [t0, t_exp, t_send]}

    def release_producer(self) -> None:
        del self.tensor
        self.torch.cuda.ipc_collect()

    def consume(self, rep: int) -> dict[str, Any]:
        if not self.conn.poll(self.io.timeout):
            from .errors import TimeoutError as DmaTimeoutError

            raise DmaTimeoutError(f"no tensor from the producer within {self.io.timeout:g} s")
        data = self.conn.recv_bytes()
        t_recv = now()
        tensor = self.pickler.loads(data)
        t_imp = now()
        self.reader(tensor.device.index).read4(tensor.data_ptr())
        t_read = now()
        self.tensor = tensor
        return {"t": [t_recv, t_imp, t_read]}

    def release_consumer(self) -> None:
        del self.tensor

    def close(self) -> None:
        if hasattr(self, "conn"):
            self.conn.close()


class CupyIpc(Bench):
    """CuPy: ``cupy.cuda.runtime.ipcGetMemHandle`` / ``ipcOpenMemHandle`` of an array's allocation."""

    def setup(self) -> dict[str, Any]:
        try:
            import cupy
        except ImportError as exc:
            raise NotInstalled(f"cupy is not installed ({exc})") from exc
        self.cupy = cupy
        cupy.cuda.Device(self.io.device).use()
        cupy.empty(1, dtype=cupy.uint8)
        cupy.cuda.runtime.deviceSynchronize()
        out = super().setup()
        return {**out, "cupy": cupy.__version__}

    def produce(self, rep: int) -> dict[str, Any]:
        cupy = self.cupy
        array = cupy.empty(self.size, dtype=cupy.uint8)
        cupy.cuda.runtime.deviceSynchronize()
        ptr = int(array.data.ptr)
        t0 = now()
        handle = cupy.cuda.runtime.ipcGetMemHandle(ptr)
        base, _ = driver.mem_address_range(ptr)  # the handle names the allocation, not the array
        t_exp = now()
        self.array = array
        t_send = now()
        send_message(self.io.pc, {"rep": rep, "handle": bytes(handle).hex(), "offset": ptr - base})
        return {"t": [t0, t_exp, t_send]}

    def release_producer(self) -> None:
        del self.array

    def consume(self, rep: int) -> dict[str, Any]:
        msg, fds = self.recv(max_fds=0)
        t_recv = now()
        runtime = self.cupy.cuda.runtime
        base = runtime.ipcOpenMemHandle(bytes.fromhex(msg["handle"]))
        t_imp = now()
        self.base = base
        self.reader(self.io.consumer_device).read4(int(base) + int(msg["offset"]))
        t_read = now()
        return {"t": [t_recv, t_imp, t_read]}

    def release_consumer(self) -> None:
        self.cupy.cuda.runtime.ipcCloseMemHandle(self.base)


class CudaCoreIpc(Bench):
    """cuda.core: an IPC-enabled ``DeviceMemoryResource`` shared once, buffers by descriptor.

    Before timing, the producer sends the pool's allocation handle (an fd) and
    the consumer maps the pool (``from_allocation_handle``). Per hand-off:
    ``Buffer.ipc_descriptor`` (``cuMemPoolExportPointer``), sent as JSON (its
    64 payload bytes in hex, from ``IPCBufferDescriptor.__reduce__``), and
    ``Buffer.from_ipc_descriptor`` (``cuMemPoolImportPointer``). The buffer is
    allocated from the pool before t0.
    """

    def setup(self) -> dict[str, Any]:
        try:
            from cuda.core import Buffer, DeviceMemoryResource, DeviceMemoryResourceOptions
            from cuda.core._memory._ipc import IPCBufferDescriptor
        except ImportError as exc:
            raise NotInstalled(f"cuda.core lacks IPC memory resources ({exc})") from exc
        import cuda.core

        self.Buffer = Buffer
        self.Descriptor = IPCBufferDescriptor
        out = super().setup()
        dev = driver.set_current(self.io.device)
        self.stream = dev.default_stream
        if self.io.role == "producer":
            largest = max(self.io.cfg["sizes"])
            gran = 2 << 20
            pool = (2 * largest + 64 * gran + gran - 1) // gran * gran
            self.mr = DeviceMemoryResource(self.io.device,
                                           DeviceMemoryResourceOptions(ipc_enabled=True, max_size=pool))
            if self.io.consumer_device != self.io.producer_device:
                self.mr.peer_accessible_by = {self.io.consumer_device}
            send_message(self.io.pc, {"pool": str(self.mr.uuid)}, int(self.mr.allocation_handle.handle))
        else:
            _msg, fds = self.recv()
            try:  # the pool lives on the producer's device; access for ours is set in this process
                self.mr = DeviceMemoryResource.from_allocation_handle(self.io.producer_device, fds[0])
            finally:
                _close_fds(fds)
            if self.io.consumer_device != self.io.producer_device:
                self.mr.peer_accessible_by = {self.io.consumer_device}
        return {**out, "cuda-core": cuda.core.__version__}

    def produce(self, rep: int) -> dict[str, Any]:
        buf = self.mr.allocate(self.size, stream=self.stream)
        self.stream.sync()
        t0 = now()
        desc = buf.ipc_descriptor
        t_exp = now()
        self.buf = buf
        t_send = now()
        _fn, (payload, size) = desc.__reduce__()
        send_message(self.io.pc, {"rep": rep, "descriptor": bytes(payload).hex(), "size": int(size)})
        return {"t": [t0, t_exp, t_send]}

    def release_producer(self) -> None:
        self.buf.close(self.stream)
        self.stream.sync()
        del self.buf

    def consume(self, rep: int) -> dict[str, Any]:
        msg, fds = self.recv(max_fds=0)
        t_recv = now()
        desc = self.Descriptor._init(bytes.fromhex(msg["descriptor"]), int(msg["size"]))
        buf = self.Buffer.from_ipc_descriptor(self.mr, desc, stream=self.stream)
        t_imp = now()
        self.reader(self.io.consumer_device).read4(int(buf.handle))
        t_read = now()
        self.buf = buf
        return {"t": [t_recv, t_imp, t_read]}

    def release_consumer(self) -> None:
        self.buf.close(self.stream)
        self.stream.sync()
        del self.buf

    def close(self) -> None:
        mr = getattr(self, "mr", None)
        if mr is not None:
            mr.close()


MECHANISMS: dict[str, type[Bench]] = {
    "posix-fd": PosixFd,
    "posix-fd-cached": PosixFdCached,
    "dmabuf": DmaBufBench,
    "memfd": MemfdBench,
    "torch-ipc": TorchIpc,
    "cuda-core-ipc": CudaCoreIpc,
    "cupy-ipc": CupyIpc,
}


def _latency(bench: Bench, io: IO) -> None:
    cfg = io.cfg
    warm, reps = int(cfg["warmup"]), int(cfg["reps"])
    for size in cfg["sizes"]:
        bench.cell(size)
        records = []
        if io.role == "producer":
            _msg, fds = bench.recv(max_fds=0)  # consumer ready
            for rep in range(warm + reps):
                rec = bench.produce(rep)
                _ack, fds = bench.recv(max_fds=0)
                bench.release_producer()
                if rep >= warm:
                    records.append(rec)
        else:
            send_message(io.pc, {"ready": size})
            for rep in range(warm + reps):
                rec = bench.consume(rep)
                bench.release_consumer()
                send_message(io.pc, {"ack": rep})
                if rep >= warm:
                    records.append(rec)
        info = bench.cell_end()
        for rec in records:
            send_message(io.ctl, {"rec": rec})
        send_message(io.ctl, {"cell": size, **info})


# --- bandwidth and Python overhead -------------------------------------------------------

def _other_device(io: IO) -> int | None:
    if io.consumer_device != io.producer_device:
        return io.consumer_device
    n = driver.device_count()
    for d in range(n):
        if d != io.producer_device and driver.can_access_peer(d, io.producer_device):
            return d
    return None


def _bandwidth(io: IO) -> None:
    from ...kernels import count_mismatches, write_pattern
    from ...mechanisms.posix_fd import export_posix_fd, import_posix_fd

    reps = max(3, int(io.cfg["reps"]))
    P = io.producer_device
    if io.role == "producer":
        for size in io.cfg["sizes"]:
            exported = export_posix_fd(size, P)
            with exported:
                write_pattern(exported.ptr, size, P)
                send_message(io.pc, {"size": size, **exported.describe().to_json()}, exported.fd)
                recv_message(io.pc, io.timeout, max_fds=0)  # done
        send_message(io.ctl, {"bw_done": True})
        return
    X = _other_device(io)
    readers = {P: Reader(P)}
    if X is not None:
        readers[X] = Reader(X)
    results, keep = [], []
    try:
        # Pass 1: reads through the import (same GPU, other GPU), native reads, the staged copy.
        for size in io.cfg["sizes"]:
            msg, fds = recv_message(io.pc, io.timeout)
            res: dict[str, Any] = {"size": size, "device": P, "peer_device": X}
            with OwnedFd(fds[0]) as fd:
                imp = import_posix_fd(fd.fd, size, P, 0, int(msg["export_size"]))
                keep.append(imp)
                imp_x = import_posix_fd(fd.fd, size, X, 0, int(msg["export_size"])) if X is not None else None
            send_message(io.pc, {"done": size})  # our imports keep the memory alive
            res["verified"] = count_mismatches(imp.ptr, size, P) == 0
            driver.set_current(P)
            native = driver.mem_alloc(size)
            try:
                res["import"], res["native"] = readers[P].bandwidth([imp.ptr, native], size, reps)
            finally:
                driver.set_current(P)
                driver.mem_free(native)
            if imp_x is not None and X is not None:
                try:
                    res["cross_import"], = readers[X].bandwidth([imp_x.ptr], size, reps)
                finally:
                    imp_x.close()
                res["memcpy_peer_no_peer_access"] = _memcpy_peer(X, P, imp.ptr, size, reps)
            results.append((res, imp))
        # Pass 2: cuMemcpyPeer once the contexts have peer access (it cannot be undone per size).
        if X is not None:
            peer = _enable_peer_access(X, P)
            for res, imp in results:
                size = res["size"]
                res["peer_access"] = peer
                copies = []
                try:
                    copies.append(_memcpy_peer(X, P, imp.ptr, size, reps))
                except CudaError as exc:
                    copies.append({"source": f"GPU-{P} import", "error": str(exc)})
                driver.set_current(P)
                src = driver.mem_alloc(size)
                try:
                    copies.append(_memcpy_peer(X, P, src, size, reps, f"a cuMemAlloc buffer on GPU {P}"))
                except CudaError as exc:
                    copies.append({"source": f"cuMemAlloc on GPU {P}", "error": str(exc)})
                finally:
                    driver.set_current(P)
                    driver.mem_free(src)
                res["memcpy_peer_variants"] = copies
                ok = [c for c in copies if c.get("gbps")]
                if ok:
                    res["memcpy_peer"] = max(ok, key=lambda c: c["gbps"])
    finally:
        for imp in keep:
            imp.close()
    for res, _imp in results:
        send_message(io.ctl, {"bw": res})
    send_message(io.ctl, {"overhead": _overhead(P, max(200, int(io.cfg["reps"])))})


def _enable_peer_access(a: int, b: int) -> str:
    """``cuCtxEnablePeerAccess`` both ways between the primary contexts of ``a`` and ``b``."""
    from cuda.core import Device

    drv = driver.bindings()
    for x, y in ((a, b), (b, a)):
        driver.set_current(x)
        try:
            driver.call(drv.cuCtxEnablePeerAccess, Device(y).context.handle, 0)
        except CudaError as exc:
            if exc.result != "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED":
                return f"not enabled: {exc}"
    return "enabled both ways (cuCtxEnablePeerAccess)"


def _memcpy_peer(dst_dev: int, src_dev: int, src: int, size: int, reps: int,
                 source: str | None = None) -> dict[str, Any]:
    """``cuMemcpyPeer`` of ``size`` bytes from ``src`` (GPU ``src_dev``) to a fresh buffer on ``dst_dev``."""
    driver.set_current(dst_dev)
    dst = driver.mem_alloc(size)
    try:
        driver.memcpy_peer(dst, dst_dev, src, src_dev, size)
        seconds = []
        for _ in range(reps):
            t = now()
            driver.memcpy_peer(dst, dst_dev, src, src_dev, size)  # synchronous, then cuCtxSynchronize
            seconds.append((now() - t) * 1e-9)
    finally:
        driver.set_current(dst_dev)
        driver.mem_free(dst)
    med = statistics.median(seconds)
    return {"gbps": size / med / 1e9, "median_us": med * 1e6, "bytes": size,
            "source": source or f"the same allocation, through its GPU-{src_dev} import"}


def _overhead(device: int, n: int) -> dict[str, Any]:
    """The library's export+import cycle against the same driver calls in a tight loop.

    Raw loop (cuda.bindings directly, structs built once, each CUresult
    checked): cuMemCreate, cuMemAddressReserve, cuMemMap, cuMemSetAccess,
    cuMemExportToShareableHandle, cuMemImportFromShareableHandle,
    cuMemAddressReserve, cuMemMap, cuMemSetAccess, then cuMemUnmap,
    cuMemAddressFree, cuMemRelease for both and ``close(fd)``. Library loop:
    ``export_posix_fd``, ``import_posix_fd``, ``close()`` of both. One
    granule (the smallest allocation), interleaved, medians.
    """
    from ...mechanisms.dmabuf import export_range
    from ..._checks import page_size
    from ...mechanisms.posix_fd import export_posix_fd, import_posix_fd

    drv = driver.bindings()
    driver.set_current(device)
    size = driver.vmm_granularity(device)
    posix = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = posix
    acc = drv.CUmemAccessDesc()
    acc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = device
    acc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    access = [acc]

    def ok(out: Any) -> Any:
        if int(out[0]) != 0:
            raise CudaError("raw loop", driver.result_name(out[0]), int(out[0]))
        return out[1] if len(out) > 1 else None

    def raw_cycle() -> None:
        h = ok(drv.cuMemCreate(size, prop, 0))
        p = ok(drv.cuMemAddressReserve(size, size, 0, 0))
        ok(drv.cuMemMap(p, size, 0, h, 0))
        ok(drv.cuMemSetAccess(p, size, access, 1))
        fd = int(ok(drv.cuMemExportToShareableHandle(h, posix, 0)))
        h2 = ok(drv.cuMemImportFromShareableHandle(fd, posix))
        p2 = ok(drv.cuMemAddressReserve(size, size, 0, 0))
        ok(drv.cuMemMap(p2, size, 0, h2, 0))
        ok(drv.cuMemSetAccess(p2, size, access, 1))
        ok(drv.cuMemUnmap(p2, size))
        ok(drv.cuMemAddressFree(p2, size))
        ok(drv.cuMemRelease(h2))
        os.close(fd)
        ok(drv.cuMemUnmap(p, size))
        ok(drv.cuMemAddressFree(p, size))
        ok(drv.cuMemRelease(h))

    def lib_cycle() -> None:
        exported = export_posix_fd(size, device)
        imported = import_posix_fd(exported.fd, size, device, 0, exported.export_size)
        imported.close()
        exported.close()

    out: dict[str, Any] = {"device": device, "bytes": size, "iterations": n}
    out["posix_fd_cycle"] = _compare(lib_cycle, raw_cycle, n)
    out["posix_fd_cycle"]["library_driver_calls"] = _count_calls(lib_cycle)
    out["posix_fd_cycle"]["raw_driver_calls"] = 15
    out["posix_fd_cycle"]["library_split_us"] = _split(lib_cycle, min(n, 50))
    out["posix_fd_cycle"]["raw_split_us"] = _split(raw_cycle, min(n, 50))

    page = page_size()
    dma = drv.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    driver.set_current(device)
    raw_alloc = driver.mem_alloc(size + page)
    ptr = (raw_alloc + page - 1) // page * page
    try:
        def raw_dmabuf() -> None:
            fd = ok(drv.cuMemGetHandleForAddressRange(ptr, size, dma, 0))
            os.close(int(fd))

        def lib_dmabuf() -> None:
            export_range(ptr, size).close()

        try:
            lib_dmabuf()
        except NotSupportedError as exc:
            out["dmabuf_export"] = {"status": f"unsupported ({exc.result})"}
        else:
            out["dmabuf_export"] = _compare(lib_dmabuf, raw_dmabuf, n)
            out["dmabuf_export"]["library_driver_calls"] = _count_calls(lib_dmabuf)
            out["dmabuf_export"]["raw_driver_calls"] = 1
            out["dmabuf_export"]["library_split_us"] = _split(lib_dmabuf, min(n, 50))
            out["dmabuf_export"]["raw_split_us"] = _split(raw_dmabuf, min(n, 50))
    finally:
        driver.set_current(device)
        driver.mem_free(raw_alloc)
    return out


def _compare(lib: Any, raw: Any, n: int) -> dict[str, Any]:
    for _ in range(5):
        lib()
        raw()
    t_lib, t_raw = [], []
    for _ in range(n):
        t = now()
        lib()
        t_lib.append(now() - t)
        t = now()
        raw()
        t_raw.append(now() - t)
    ml, mr = statistics.median(t_lib) / 1e3, statistics.median(t_raw) / 1e3
    pairs = sorted(a / b - 1.0 for a, b in zip(t_lib, t_raw))
    q = statistics.quantiles(pairs, n=10) if len(pairs) >= 10 else [pairs[0]] * 8 + [pairs[-1]]
    return {"library_median_us": ml, "raw_median_us": mr, "overhead": ml / mr - 1.0,
            "pairwise_overhead": {"p10": q[0], "median": statistics.median(pairs), "p90": q[-1]}}


def _split(fn: Any, n: int) -> dict[str, float]:
    """Where one cycle's time goes (medians over ``n`` instrumented runs, µs).

    ``driver_calls``: inside the library's checked driver calls
    (``driver.call``); ``set_current``: ``driver.set_current`` (cuda.core
    ``Device.set_current`` and its range check); ``fd_close``: ``os.close``
    (closing a CUDA export fd is work in the kernel driver); ``python``: the
    rest (argument checks, objects, cleanup stacks, ``/proc`` reads; for the
    raw loop, its driver calls too). Instrumented, so the parts add up to a
    little more than the uninstrumented median.
    """
    orig_call, orig_sc, orig_close = driver.call, driver.set_current, os.close
    acc = {"driver_calls": 0, "set_current": 0, "fd_close": 0}
    depth = [0]

    def timed_call(f: Any, *args: Any, detail: str = "") -> Any:
        if depth[0]:
            return orig_call(f, *args, detail=detail)
        t = now()
        try:
            return orig_call(f, *args, detail=detail)
        finally:
            acc["driver_calls"] += now() - t

    def timed_sc(ordinal: int) -> Any:
        depth[0] += 1
        t = now()
        try:
            return orig_sc(ordinal)
        finally:
            depth[0] -= 1
            acc["set_current"] += now() - t

    def timed_close(fd: int) -> None:
        t = now()
        try:
            orig_close(fd)
        finally:
            acc["fd_close"] += now() - t

    rows: dict[str, list[float]] = {k: [] for k in ("total", "driver_calls", "set_current", "fd_close", "python")}
    driver.call, driver.set_current, os.close = timed_call, timed_sc, timed_close  # type: ignore[assignment]
    try:
        for _ in range(n):
            for k in acc:
                acc[k] = 0
            t = now()
            fn()
            total = now() - t
            rows["total"].append(total / 1e3)
            for k in acc:
                rows[k].append(acc[k] / 1e3)
            rows["python"].append((total - sum(acc.values())) / 1e3)
    finally:
        driver.call, driver.set_current, os.close = orig_call, orig_sc, orig_close  # type: ignore[assignment]
    return {k: round(statistics.median(v), 3) for k, v in rows.items()}


def _count_calls(fn: Any) -> dict[str, int]:
    """The checked driver calls (``driver.call``) one run of ``fn`` makes, by name."""
    counts: Counter[str] = Counter()
    orig = driver.call

    def counting(f: Any, *args: Any, detail: str = "") -> Any:
        counts[getattr(f, "__name__", "?")] += 1
        return orig(f, *args, detail=detail)

    driver.call = counting  # type: ignore[assignment]
    try:
        fn()
    finally:
        driver.call = orig  # type: ignore[assignment]
    return dict(sorted(counts.items()))


# --- entry point -------------------------------------------------------------------------

def run(role: str, ctl: socket.socket, pc: socket.socket, aux: socket.socket) -> int:
    cfg, _ = recv_message(ctl, 120)
    io = IO(role, ctl, pc, aux, cfg)
    name = cfg["mechanism"]
    bench: Bench | None = None
    try:
        versions: dict[str, Any] = {}
        if name == "_bandwidth":
            driver.set_current(io.device)
        else:
            bench = MECHANISMS[name](io)
            versions = bench.setup()
    except NotInstalled as exc:
        send_message(ctl, {"hello": role, "status": "not installed", "reason": str(exc)})
        return 0
    except NotSupportedError as exc:
        send_message(ctl, {"hello": role, "status": "unsupported", "reason": str(exc)})
        return 0
    except Exception as exc:  # noqa: BLE001 - reported to the parent, one line
        send_message(ctl, {"hello": role, "status": "error", "reason": f"set-up: {type(exc).__name__}: {exc}"})
        return 1
    send_message(ctl, {"hello": role, "status": "ok", "versions": versions, "pid": os.getpid()})
    try:
        if bench is None:
            _bandwidth(io)
        else:
            _latency(bench, io)
        send_message(ctl, {"done": role})
        return 0
    except Exception as exc:  # noqa: BLE001
        prefix = "unsupported: " if isinstance(exc, NotSupportedError) else ""
        try:
            send_message(ctl, {"error": f"{prefix}{role}: {type(exc).__name__}: {exc}"})
        except Exception:  # noqa: BLE001 - the parent is gone
            pass
        return 1
    finally:
        if bench is not None:
            try:
                bench.close()
            except Exception:  # noqa: BLE001
                pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    role, ctl_fd, pc_fd, aux_fd = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    if role not in ("producer", "consumer"):
        print(f"bench_peers: unknown role {role!r}", file=sys.stderr)
        return 2
    ctl = socket.socket(fileno=ctl_fd)
    pc = socket.socket(fileno=pc_fd)
    aux = socket.socket(fileno=aux_fd)
    try:
        return run(role, ctl, pc, aux)
    finally:
        pc.close()
        aux.close()
        ctl.close()


if __name__ == "__main__":
    sys.exit(main())
