"""The consumer's read kernels: ``read4`` (the first access) and ``read_all`` (bandwidth)."""

from __future__ import annotations

import ctypes
from typing import Any

from ... import _driver as driver
from ...kernels import compile_source
from .stats import percentile

__all__ = ["READ_SOURCE", "Reader"]

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


class Reader:
    """Both kernels, compiled and warmed on one device.

    ``read4`` copies the first 4 bytes of a mapping into pinned host memory
    (``cuMemAllocHost``, visible to the kernel through unified addressing),
    then the stream is synchronised: one launch, one sync.

    Raises:
        CudaError: compiling (NVRTC), loading, allocating or launching failed.
        NoDriverError: no CUDA driver.
    """

    def __init__(self, device: int) -> None:
        import numpy as np
        from cuda.core import LaunchConfig

        self.device = device
        dev = driver.set_current(device)
        self.stream = dev.default_stream
        code = compile_source(READ_SOURCE, "dmabuf_interop_bench", device)
        self.k_read4 = code.get_kernel("read4")
        self.k_read_all = code.get_kernel("read_all")
        self.sms = int(dev.properties.multiprocessor_count)
        self.host = driver.mem_alloc_host(4096)
        self.slot = ctypes.c_uint32.from_address(self.host)
        self.one = LaunchConfig(grid=1, block=1)
        self._u64 = np.uint64
        scratch = driver.mem_alloc(4096)  # warm: module load, first launch
        try:
            self.read4(scratch)
        finally:
            driver.mem_free(scratch)

    def read4(self, ptr: int) -> int:
        """The 32-bit word at ``ptr`` (a ``CUdeviceptr`` mapped on this device), read by a kernel."""
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
            med = percentile(secs, 50)
            out.append({"gbps": n * 16 / med / 1e9, "median_us": med * 1e6, "bytes": n * 16})
        return out
