"""The pattern kernels: a writer (``p[i] = base + i``) and a verifier (mismatch count).

Compiled from CUDA C++ with NVRTC through cuda.core's ``Program`` to a cubin
for the device's architecture, once per process and device, and cached on disk
with cuda.core's ``FileStreamProgramCache`` (keyed by source, options,
architecture and NVRTC version) under ``$XDG_CACHE_HOME/dmabuf-interop/nvrtc``
(``~/.cache/...`` by default; ``DMABUF_INTEROP_CACHE_DIR`` overrides), so a
second run does not compile again. Launches go through ``cuda.core.launch``.

Both kernels take a ``CUdeviceptr`` to 32-bit integers and an element count;
the buffer must be at least ``4 * n`` bytes and 4-byte aligned.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from . import _driver as driver
from .errors import CudaNotSupportedError, InvalidArgumentError

__all__ = ["SOURCE", "PATTERN_BASE", "NVRTC_PACKAGE", "cache_dir", "compile_source", "require_nvrtc",
           "write_pattern", "count_mismatches"]

#: The pip requirement that provides NVRTC for CUDA 13 (a dependency of this package).
NVRTC_PACKAGE = "cuda-toolkit[nvrtc]==13.*"

#: The sample's pattern: element ``i`` holds ``0x1000 + i``.
PATTERN_BASE = 0x1000

SOURCE = r"""
extern "C" __global__ void write_pattern(int* p, unsigned long long n, int base) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        p[i] = base + (int)i;
    }
}

extern "C" __global__ void verify_pattern(const int* p, unsigned long long n, int base,
                                          unsigned long long* mismatches) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        if (p[i] != base + (int)i) atomicAdd(mismatches, 1ULL);
    }
}
"""

_lock = threading.Lock()
_loaded: dict[tuple[int, int], tuple[Any, Any]] = {}


def cache_dir() -> Path:
    """Where compiled cubins are kept between runs."""
    override = os.environ.get("DMABUF_INTEROP_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dmabuf-interop" / "nvrtc"


def require_nvrtc() -> None:
    """Load NVRTC (``libnvrtc.so``) the way cuda.core will, through ``cuda.pathfinder``.

    Raises:
        CudaNotSupportedError: NVRTC cannot be loaded; the one-line message names
            :data:`NVRTC_PACKAGE`, the pip requirement that provides it.
    """
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        load_nvidia_dynamic_lib("nvrtc")
    except (ImportError, RuntimeError, OSError) as exc:  # pathfinder's errors are RuntimeErrors
        raise CudaNotSupportedError(
            'load_nvidia_dynamic_lib("nvrtc")', "NVRTC not loadable",
            detail=f"it compiles the pattern kernels; pip install '{NVRTC_PACKAGE}' ({type(exc).__name__})",
        ) from exc


def compile_source(source: str, name: str, device: int) -> Any:
    """Compile CUDA C++ ``source`` with NVRTC to a cubin for ``device``'s architecture.

    Through cuda.core's ``Program`` (``ProgramOptions(arch="sm_XY", name=name)``),
    cached on disk in :func:`cache_dir` with ``FileStreamProgramCache``; an
    unwritable cache directory means compiling every time.

    Returns:
        the ``cuda.core.ObjectCode``; ``.get_kernel(name)`` gives a launchable kernel.

    Raises:
        NoDriverError: no CUDA driver.
        CudaNotSupportedError: NVRTC cannot be loaded (the message names the package).
        CudaError: NVRTC or the module load failed.
    """
    from cuda.core import Program, ProgramOptions

    dev = driver.set_current(device)
    require_nvrtc()
    program = Program(source, code_type="c++", options=ProgramOptions(arch=f"sm_{dev.arch}", name=name))
    try:
        from cuda.core.utils import FileStreamProgramCache

        cache_dir().mkdir(parents=True, exist_ok=True)
        cache = FileStreamProgramCache(cache_dir())
    except OSError:  # unwritable home: compile every time
        return program.compile("cubin")
    return program.compile("cubin", cache=cache)


def _kernels(device: int) -> tuple[Any, Any]:
    key = (os.getpid(), device)
    with _lock:
        if key not in _loaded:
            code = compile_source(SOURCE, "dmabuf_interop_pattern", device)
            _loaded[key] = (code.get_kernel("write_pattern"), code.get_kernel("verify_pattern"))
        return _loaded[key]


def _launch(device: int, kernel: Any, n: int, *args: Any, stream: Any = None) -> Any:
    from cuda.core import LaunchConfig, launch

    dev = driver.set_current(device)
    s = stream if stream is not None else dev.default_stream
    block = 256
    grid = max(1, min((n + block - 1) // block, 65535))
    launch(s, LaunchConfig(grid=grid, block=block), kernel, *args)
    return s


def _count(nbytes: int) -> int:
    if nbytes <= 0 or nbytes % 4:
        raise InvalidArgumentError(f"pattern buffers hold int32: size must be a positive multiple of 4, got {nbytes}")
    return nbytes // 4


def write_pattern(ptr: int, nbytes: int, device: int = 0, base: int = PATTERN_BASE, stream: Any = None,
                  sync: bool = True) -> None:
    """Launch ``write_pattern``: element ``i`` of the ``nbytes // 4`` int32 at ``ptr`` becomes ``base + i``.

    Args:
        ptr: ``CUdeviceptr`` of the first element, 4-byte aligned, mapped on ``device``.
        nbytes: bytes to write: a positive multiple of 4.
        device: CUDA ordinal whose primary context launches the kernel.
        base: the pattern's first value (the sample's ``0x1000``).
        stream: a ``cuda.core.Stream``; default the device's default stream.
        sync: synchronise the stream before returning (so an fd may be sent
            right away); with ``sync=False`` the caller must order later work.

    Raises:
        InvalidArgumentError: ``nbytes`` is not a positive multiple of 4.
        NoDriverError: no CUDA driver.
        CudaNotSupportedError: NVRTC cannot be loaded (the message names the package).
        CudaError: compiling (NVRTC), loading or launching failed.
    """
    import numpy as np

    n = _count(nbytes)
    writer, _ = _kernels(device)
    s = _launch(device, writer, n, np.uint64(ptr), np.uint64(n), np.int32(base), stream=stream)
    if sync:
        s.sync()


def count_mismatches(ptr: int, nbytes: int, device: int = 0, base: int = PATTERN_BASE, stream: Any = None) -> int:
    """Launch ``verify_pattern`` and return how many of the ``nbytes // 4`` int32 at ``ptr`` differ
    from ``base + i``.

    Synchronous: waits for the kernel and copies the 8-byte counter back
    (``cuMemAlloc``, ``cuMemsetD8``, ``cuMemcpyDtoH``).

    Args:
        ptr: ``CUdeviceptr`` of the first element, 4-byte aligned, mapped on ``device``.
        nbytes: bytes to check: a positive multiple of 4.
        device: CUDA ordinal that runs the kernel.
        base: the expected pattern's first value.
        stream: a ``cuda.core.Stream``; default the device's default stream.

    Returns:
        the number of mismatching elements (0 when the pattern is intact).

    Raises:
        InvalidArgumentError: ``nbytes`` is not a positive multiple of 4.
        NoDriverError: no CUDA driver.
        CudaNotSupportedError: NVRTC cannot be loaded (the message names the package).
        CudaError: compiling, launching or the copy failed.
    """
    import numpy as np

    n = _count(nbytes)
    _, verifier = _kernels(device)
    driver.set_current(device)
    counter = driver.mem_alloc(8)
    try:
        driver.memset_d8(counter, 0, 8)
        s = _launch(device, verifier, n, np.uint64(ptr), np.uint64(n), np.int32(base), np.uint64(counter),
                    stream=stream)
        s.sync()
        host = np.zeros(1, dtype=np.uint64)
        driver.memcpy_dtoh(host.ctypes.data, counter, 8)
    finally:
        driver.mem_free(counter)
    return int(host[0])
