"""The library's Python overhead: its calls against the same driver calls in a tight loop.

Where the library's time goes is read through the documented hook
:func:`dmabuf_interop._driver.set_observer` (each checked driver call's name
and duration), never by replacing library functions. What the hook cannot
see (``close(fd)`` inside ``ExportedBuffer.close``, cuda.core's
``Device.set_current``) counts as Python in the library's split; the raw loop
is this module's own code, so it times its ``close(fd)`` directly.

The raw loops are the one place the tool calls ``cuda.bindings`` itself: they
are the baseline the library is measured against.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any, Callable

from ... import _driver as driver
from ..._checks import page_size
from ...errors import CudaError, NotSupportedError
from .stats import Stats, percentile

__all__ = ["CallTimer", "measure", "compare", "CONTEXT_CALLS"]

now = time.perf_counter_ns  # the clock the observer reports in
#: The driver calls behind ``_driver.set_current`` once a context is known.
CONTEXT_CALLS = frozenset({"cuCtxGetCurrent", "cuCtxSetCurrent"})


class CallTimer:
    """Nanoseconds and counts of checked driver calls, by call name, while installed.

    A context manager around :func:`~dmabuf_interop._driver.set_observer`
    (restores the observer it replaced). Costs two clock reads and a dict
    update per driver call while installed.
    """

    def __init__(self) -> None:
        self.ns: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._previous: Any = None

    def __call__(self, name: str, ns: int) -> None:
        self.ns[name] += ns
        self.calls[name] += 1

    def __enter__(self) -> "CallTimer":
        self._previous = driver.set_observer(self)
        return self

    def __exit__(self, *exc: object) -> None:
        driver.set_observer(self._previous)

    def take(self) -> dict[str, int]:
        """The ns per call name since the last take, then start again."""
        out = dict(self.ns)
        self.ns.clear()
        self.calls.clear()
        return out


def compare(lib: Callable[[], None], raw: Callable[[], None], n: int) -> dict[str, Any]:
    """``lib`` and ``raw`` alternately ``n`` times after 5 warm-ups: medians (µs), overhead, pairwise spread."""
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
    ml, mr = percentile(t_lib, 50) / 1e3, percentile(t_raw, 50) / 1e3
    pairs = Stats.of(a / b - 1.0 for a, b in zip(t_lib, t_raw))
    assert pairs is not None  # n >= 1
    return {"library_median_us": ml, "raw_median_us": mr, "overhead": ml / mr - 1.0,
            "pairwise_overhead": {"p10": pairs.p10, "median": pairs.median, "p90": pairs.p90}}


def _library_split(fn: Callable[[], None], n: int) -> tuple[dict[str, float], dict[str, int]]:
    """Medians over ``n`` observed runs (µs): ``driver_calls`` (checked calls other than the
    context switch), ``context_calls`` (``cuCtxGetCurrent`` / ``cuCtxSetCurrent``), ``python``
    (the rest: argument checks, objects, cleanups, ``close(fd)``); and one run's call counts."""
    rows: dict[str, list[float]] = {k: [] for k in ("total", "driver_calls", "context_calls", "python")}
    with CallTimer() as timer:
        for _ in range(n):
            timer.take()
            t = now()
            fn()
            total = now() - t
            counts = dict(sorted(timer.calls.items()))
            ns = timer.take()
            ctx = sum(v for k, v in ns.items() if k in CONTEXT_CALLS)
            calls = sum(ns.values()) - ctx
            for key, value in (("total", total), ("driver_calls", calls), ("context_calls", ctx),
                               ("python", total - calls - ctx)):
                rows[key].append(value / 1e3)
    return {k: round(percentile(v, 50), 3) for k, v in rows.items()}, counts


def _raw_split(cycle: Callable[[Callable[[int], None]], None], n: int) -> dict[str, float]:
    """Medians over ``n`` runs of a raw loop (µs): ``fd_close`` timed around its ``close(fd)``,
    ``python`` the rest (its driver calls included)."""
    closed = [0]

    def timed_close(fd: int) -> None:
        t = now()
        try:
            os.close(fd)
        finally:
            closed[0] += now() - t

    rows: dict[str, list[float]] = {"total": [], "fd_close": [], "python": []}
    for _ in range(n):
        closed[0] = 0
        t = now()
        cycle(timed_close)
        total = now() - t
        rows["total"].append(total / 1e3)
        rows["fd_close"].append(closed[0] / 1e3)
        rows["python"].append((total - closed[0]) / 1e3)
    return {k: round(percentile(v, 50), 3) for k, v in rows.items()}


def _entry(lib: Callable[[], None], raw: Callable[[Callable[[int], None]], None], n: int,
           raw_calls: int) -> dict[str, Any]:
    out = compare(lib, lambda: raw(os.close), n)
    out["library_split_us"], out["library_driver_calls"] = _library_split(lib, min(n, 50))
    out["raw_driver_calls"] = raw_calls
    out["raw_split_us"] = _raw_split(raw, min(n, 50))
    return out


def measure(device: int, n: int) -> dict[str, Any]:
    """The POSIX-fd cycle and the dma-buf export, library against raw loop, ``n`` pairs each.

    POSIX-fd raw loop (structs built once, each ``CUresult`` checked):
    cuMemCreate, cuMemAddressReserve, cuMemMap, cuMemSetAccess,
    cuMemExportToShareableHandle, cuMemImportFromShareableHandle,
    cuMemAddressReserve, cuMemMap, cuMemSetAccess, then cuMemUnmap,
    cuMemAddressFree, cuMemRelease for both and ``close(fd)``; library:
    ``export_posix_fd``, ``import_posix_fd``, ``close()`` of both. One
    granule. dma-buf: ``cuMemGetHandleForAddressRange`` + ``close(fd)``
    against ``export_range(ptr, size).close()`` over a ``cuMemAlloc`` buffer.

    Raises:
        CudaError: a driver call failed (the dma-buf part reports an unsupported export instead).
    """
    from ...mechanisms.dmabuf import export_range
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

    def raw_cycle(close: Callable[[int], None]) -> None:
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
        close(fd)
        ok(drv.cuMemUnmap(p, size))
        ok(drv.cuMemAddressFree(p, size))
        ok(drv.cuMemRelease(h))

    def lib_cycle() -> None:
        exported = export_posix_fd(size, device)
        imported = import_posix_fd(exported.fd, size, device, 0, exported.export_size)
        imported.close()
        exported.close()

    out: dict[str, Any] = {"device": device, "bytes": size, "iterations": n,
                           "posix_fd_cycle": _entry(lib_cycle, raw_cycle, n, 15)}

    page = page_size()
    dma = drv.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    driver.set_current(device)
    raw_alloc = driver.mem_alloc(size + page)
    ptr = (raw_alloc + page - 1) // page * page
    try:
        def raw_dmabuf(close: Callable[[int], None]) -> None:
            close(int(ok(drv.cuMemGetHandleForAddressRange(ptr, size, dma, 0))))

        def lib_dmabuf() -> None:
            export_range(ptr, size).close()

        try:
            lib_dmabuf()
        except NotSupportedError as exc:
            out["dmabuf_export"] = {"status": f"unsupported ({exc})"}
        else:
            out["dmabuf_export"] = _entry(lib_dmabuf, raw_dmabuf, n, 1)
    finally:
        driver.set_current(device)
        driver.mem_free(raw_alloc)
    return out
