"""``dmabuf-interop bench --remote``: a tcp:// channel on loopback against a bare NIXL READ loop and a local channel.

Three measurements per size, in one run, host memory, one peer process each:
``channel`` (``recv`` + release over a tcp:// channel: control message, one
NIXL READ into the receiver's pool, release message), ``nixl`` (the same READ
with two bare agents: ``initialize_xfer`` once, ``transfer`` +
``check_xfer_state`` per iteration) and ``local`` (``recv`` + release over an
AF_UNIX channel: zero-copy, no bytes move). Each size runs ``--warmup``
untimed reads (at least one: the first READ registers the receiving chunk),
then ``--reps`` timed ones. GB/s is 1e9 bytes per second. UCX is pinned to
``UCX_TLS=tcp UCX_NET_DEVICES=lo`` unless the caller set them (``UCX_TLS=tcp,cuda_copy``
where NVIDIA GPUs are present, since NIXL's UCX backend refuses ``tcp`` alone there).

The peers are this module run as children (:mod:`.child`), roles ``producer`` and ``bare``.
"""

from __future__ import annotations

import argparse
import base64
import glob
import os
import secrets
import socket
import sys
import tempfile
import time
from typing import Any

from .._units import MiB
from .child import Child, finish, report, serve, start

__all__ = ["run", "bench"]


def _pool(sizes: list[int]) -> Any:
    from ...channel import SharedPool

    chunk = max(sizes) + MiB
    return SharedPool(None, chunk_bytes=chunk, max_bytes=2 * chunk)


def _producer(cfg: dict[str, Any], ctl: socket.socket, _socks: list[socket.socket]) -> None:
    """Lend one filled array ``count`` times per size over a channel at ``address``."""
    from ...channel import listen

    sizes, count = cfg["sizes"], cfg["count"]
    pool = _pool(sizes)
    with listen(cfg["address"], pool=pool) as listener:
        report(ctl, {"ready": True, "address": listener.address})
        ch = listener.accept(120)
        for size in sizes:
            a = pool.empty(size, "uint8")
            a[:] = 7
            leases = [ch.send(a, timeout=120) for _ in range(count)]
            for lease in leases:
                lease.wait(300)
            del a
        ch.close()
    pool.close()


def _nixl_agent(role: str) -> Any:
    from ...channel.remote import nixl_module

    nixl = nixl_module()
    return nixl.nixl_agent(f"bench-{role}-{os.getpid()}", nixl.nixl_agent_config(backends=["UCX"]))


def _bare_producer(cfg: dict[str, Any], ctl: socket.socket, _socks: list[socket.socket]) -> None:
    """Register one host buffer, report its address and the agent's metadata, serve READs until told to stop."""
    import numpy as np

    from ...fdpass import recv_message

    agent = _nixl_agent("bare")
    buf = np.full(max(cfg["sizes"]), 7, np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    report(ctl, {"ready": True, "addr": buf.ctypes.data, "md": base64.b64encode(agent.get_agent_metadata()).decode()})
    recv_message(ctl, cfg["timeout"], max_fds=0)  # "stop": the reader is done
    agent.deregister_memory(reg)


def _start(role: str, cfg: dict[str, Any], timeout: float) -> tuple[Child, dict[str, Any]]:
    """A started peer and its ``ready`` report.

    Raises:
        RuntimeError: the peer failed before it was ready (its reason).
    """
    child = start("remote", role, cfg)
    ready = child.result(timeout)
    if not ready.get("ready"):
        finish([child], timeout, [ready])
        raise RuntimeError(f"the {role} process did not start: {ready.get('reason')}")
    return child, ready


def _stop(child: Child, timeout: float, stop: bool = False) -> None:
    """Tell a peer to stop (``stop``), then take its result and reap it.

    Raises:
        RuntimeError: the peer reported a failure.
    """
    res: dict[str, Any] = {}
    try:
        if stop:
            child.send({"stop": True})
        res = child.result(timeout)
    finally:
        finish([child], timeout, [res])
    if res.get("status") != "ok":
        raise RuntimeError(f"the {child.role} process failed: {res.get('reason')}")


def _timed(size: int, warmup: int, reps: int, once: Any) -> float:
    """GB/s of ``reps`` calls of ``once`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        once()
    t = time.perf_counter()
    for _ in range(reps):
        once()
    return size * reps / (time.perf_counter() - t) / 1e9


def _channel_rate(address: str, sizes: list[int], warmup: int, reps: int, pool_needed: bool) -> dict[int, float]:
    from ...channel import connect

    pool = _pool(sizes) if pool_needed else None
    try:
        with connect(address, timeout=60, pool=pool) as ch:
            return {size: _timed(size, warmup, reps, lambda: ch.recv(120).release()) for size in sizes}
    finally:
        if pool is not None:
            pool.close()


def _bare_rate(info: dict[str, Any], sizes: list[int], warmup: int, reps: int, timeout: float) -> dict[int, float]:
    import numpy as np

    agent = _nixl_agent("bare-reader")
    remote = agent.add_remote_agent(base64.b64decode(info["md"]))
    dst = np.zeros(max(sizes), np.uint8)
    reg = agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    out = {}
    for size in sizes:
        h = agent.initialize_xfer("READ", agent.get_xfer_descs([(dst.ctypes.data, size, 0)], "DRAM"),
                                  agent.get_xfer_descs([(info["addr"], size, 0)], "DRAM"), remote)

        def once() -> None:
            # The same wait as RemoteChannel's: spin, then yield the core to the serving side.
            deadline = time.monotonic() + timeout
            state, spins = agent.transfer(h), 0
            while state == "PROC" and time.monotonic() < deadline:
                spins += 1
                if spins > 50:
                    time.sleep(0.0002)
                state = agent.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"bare NIXL READ of {size} bytes ended in state {state}")

        out[size] = _timed(size, warmup, reps, once)
        h.release()
    agent.deregister_memory(reg)
    return out


def run(sizes: list[int], warmup: int = 1, reps: int = 20, timeout: float = 300.0) -> list[dict[str, Any]]:
    """Rows ``{"bytes", "reps", "channel_gbs", "nixl_gbs", "overhead_pct", "local_gbs"}``, one per size.

    ``UCX_TLS`` / ``UCX_NET_DEVICES`` default to ``tcp`` / ``lo`` in this process and its peers
    (``tcp,cuda_copy`` where NVIDIA GPUs are present: NIXL refuses ``tcp`` alone there).

    Raises:
        RuntimeError: a peer process failed to start, or a bare READ failed.
        NotSupportedError: NIXL is not installed.
        DmaBufError: a channel call failed (its subclass names what).
    """
    # NIXL's UCX backend refuses a UCX_TLS without a CUDA transport where NVIDIA GPUs are present.
    os.environ.setdefault("UCX_TLS", "tcp,cuda_copy" if glob.glob("/dev/nvidia[0-9]*") else "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("DMABUF_INTEROP_TOKEN", secrets.token_hex(32))
    warmup = max(1, warmup)
    spec = {"sizes": sizes, "count": warmup + reps, "timeout": timeout}
    p, ready = _start("producer", {**spec, "address": "tcp://127.0.0.1:0"}, timeout)
    try:
        channel = _channel_rate(ready["address"], sizes, warmup, reps, True)
    finally:
        _stop(p, timeout)
    p, ready = _start("bare", spec, timeout)
    try:
        bare = _bare_rate(ready, sizes, warmup, reps, timeout)
    finally:
        _stop(p, 60, stop=True)
    with tempfile.TemporaryDirectory(prefix="dmabuf-interop-bench-") as d:
        p, ready = _start("producer", {**spec, "address": os.path.join(d, "s")}, timeout)
        try:
            local = _channel_rate(ready["address"], sizes, warmup, reps, False)
        finally:
            _stop(p, timeout)
    return [{"bytes": s, "reps": reps, "channel_gbs": channel[s], "nixl_gbs": bare[s],
             "overhead_pct": 100.0 * (bare[s] - channel[s]) / bare[s], "local_gbs": local[s]} for s in sizes]


def bench(args: argparse.Namespace) -> int:
    """``dmabuf-interop bench --remote``: measure, print the table, write ``--json``; the exit status."""
    import shlex

    from ...errors import NotSupportedError
    from .._units import size_label
    from .report import write_json
    from .targets import OVERHEAD_TARGET_PCT, remote_met

    try:
        rows = run(args.sizes, args.warmup, args.reps, args.timeout)
    except NotSupportedError as exc:
        print(f"bench --remote skipped: {exc}", file=sys.stderr)
        return 0
    tls, devices = os.environ["UCX_TLS"], os.environ["UCX_NET_DEVICES"]
    print(f"tcp:// channel vs bare NIXL READ vs local channel (host memory, UCX_TLS={tls} UCX_NET_DEVICES={devices}, "
          f"{args.reps} reps after {max(1, args.warmup)} warm-up(s); GB/s = 1e9 B/s)")
    print(f"{'size':>9} {'channel GB/s':>13} {'NIXL GB/s':>10} {'overhead':>9} {'local GB/s':>11}  "
          f"target (overhead <= {OVERHEAD_TARGET_PCT:g}%)")
    for r in rows:
        met = "met" if remote_met(r) else "not met"
        print(f"{size_label(r['bytes']):>9} {r['channel_gbs']:>13.2f} {r['nixl_gbs']:>10.2f} "
              f"{r['overhead_pct']:>8.1f}% {r['local_gbs']:>11.1f}  {met}")
    if args.json:
        write_json({"schema": 1, "command": "dmabuf-interop " + shlex.join(sys.argv[1:]),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ucx_tls": tls, "ucx_net_devices": devices,
                    "overhead_target_pct": OVERHEAD_TARGET_PCT, "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(serve({"producer": _producer, "bare": _bare_producer}))
