"""The bandwidth pass: a read kernel over a POSIX-fd import against native memory and ``cuMemcpyPeer``.

The producer exports one allocation per size with the pattern written; the
consumer imports it on the producer's GPU (and on another GPU when there is
one), reads it with :class:`~.reader.Reader` against a native ``cuMemAlloc``
buffer, verifies the pattern, and compares the other GPU's read with
``cuMemcpyPeer`` of the same bytes. The consumer then measures the Python
overhead (:mod:`.overhead`) on the producer's GPU.
"""

from __future__ import annotations

import time
from typing import Any

from ... import _driver as driver
from ...descriptor import ShareDescriptor
from ...errors import CudaError
from ...fdpass import recv_message, send_message
from . import overhead
from .protocol import check, make, take_fd
from .reader import Reader
from .stats import percentile

__all__ = ["run"]


def run(role: str, ctl: Any, pc: Any, cfg: dict[str, Any]) -> None:
    """One side of the bandwidth pass (``role`` is ``producer`` or ``consumer``)."""
    from ...kernels import count_mismatches, write_pattern
    from ...mechanisms.posix_fd import export_posix_fd, import_posix_fd

    timeout = float(cfg["timeout"])
    reps = max(3, int(cfg["reps"]))
    P, C = cfg["devices"]
    if role == "producer":
        for size in cfg["sizes"]:
            with export_posix_fd(size, P) as exported:
                write_pattern(exported.ptr, size, P)
                send_message(pc, make("handoff", rep=0, descriptor=exported.describe().to_json()), exported.fd)
                check(recv_message(pc, timeout, max_fds=0)[0], "ack")
        return
    X = _other_device(P, C)
    readers = {P: Reader(P)}
    if X is not None:
        readers[X] = Reader(X)
    results, keep = [], []
    try:
        # Pass 1: reads through the import (same GPU, other GPU), native reads, the staged copy.
        for size in cfg["sizes"]:
            msg, fds = recv_message(pc, timeout)
            with take_fd(fds) as fd:
                desc = ShareDescriptor.from_json(check(msg, "handoff").get("descriptor", {}))
                imp = import_posix_fd(fd.fd, size, P, 0, desc.export_size)
                keep.append(imp)
                imp_x = import_posix_fd(fd.fd, size, X, 0, desc.export_size) if X is not None else None
            send_message(pc, make("ack", rep=0))  # our imports keep the memory alive
            res: dict[str, Any] = {"size": size, "device": P, "peer_device": X,
                                   "verified": count_mismatches(imp.ptr, size, P) == 0}
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
        if X is not None:  # Pass 2: peer access cannot be undone per size, so it comes last
            _copies_with_peer_access(results, X, P, reps)
    finally:
        for imp in keep:
            imp.close()
    for res, _imp in results:
        send_message(ctl, make("bw", result=res))
    send_message(ctl, make("overhead", result=overhead.measure(P, max(200, int(cfg["reps"])))))


def _other_device(producer: int, consumer: int) -> int | None:
    """The consumer's GPU when it differs, else any GPU that can access the producer's."""
    if consumer != producer:
        return consumer
    for d in range(driver.device_count()):
        if d != producer and driver.can_access_peer(d, producer):
            return d
    return None


def _copies_with_peer_access(results: list[tuple[dict[str, Any], Any]], x: int, p: int, reps: int) -> None:
    peer = _enable_peer_access(x, p)
    for res, imp in results:
        size = res["size"]
        res["peer_access"] = peer
        copies = []
        try:
            copies.append(_memcpy_peer(x, p, imp.ptr, size, reps))
        except CudaError as exc:
            copies.append({"source": f"GPU-{p} import", "error": str(exc)})
        driver.set_current(p)
        src = driver.mem_alloc(size)
        try:
            copies.append(_memcpy_peer(x, p, src, size, reps, f"a cuMemAlloc buffer on GPU {p}"))
        except CudaError as exc:
            copies.append({"source": f"cuMemAlloc on GPU {p}", "error": str(exc)})
        finally:
            driver.set_current(p)
            driver.mem_free(src)
        res["memcpy_peer_variants"] = copies
        ok = [c for c in copies if c.get("gbps")]
        if ok:
            res["memcpy_peer"] = max(ok, key=lambda c: c["gbps"])


def _enable_peer_access(a: int, b: int) -> str:
    """``cuCtxEnablePeerAccess`` both ways between the primary contexts of ``a`` and ``b``."""
    drv = driver.bindings()
    for x, y in ((a, b), (b, a)):
        other = driver.set_current(y).context.handle
        driver.set_current(x)
        try:
            driver.call(drv.cuCtxEnablePeerAccess, other, 0)
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
            t = time.perf_counter_ns()
            driver.memcpy_peer(dst, dst_dev, src, src_dev, size)  # synchronous, then cuCtxSynchronize
            seconds.append((time.perf_counter_ns() - t) * 1e-9)
    finally:
        driver.set_current(dst_dev)
        driver.mem_free(dst)
    med = percentile(seconds, 50)
    return {"gbps": size / med / 1e9, "median_us": med * 1e6, "bytes": size,
            "source": source or f"the same allocation, through its GPU-{src_dev} import"}
