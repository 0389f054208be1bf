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

The peers are this module run as ``python -m dmabuf_interop.cli.bench.remote --role ...``.
"""

from __future__ import annotations

import argparse
import base64
import glob
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["run", "main", "OVERHEAD_TARGET_PCT"]

#: The channel may cost at most this much throughput against the bare READ loop, percent.
OVERHEAD_TARGET_PCT = 10.0


def _pool(sizes: list[int]) -> Any:
    from ...channel import SharedPool

    top = max(sizes)
    return SharedPool(None, chunk_bytes=top + (1 << 20), max_bytes=2 * (top + (1 << 20)))


def _producer(address: str, sizes: list[int], count: int) -> None:
    """Lend one filled array ``count`` times per size over a channel at ``address``."""
    from ...channel import listen

    pool = _pool(sizes)
    with listen(address, pool=pool) as listener:
        print(f"listening {listener.address}", flush=True)
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


def _bare_producer(sizes: list[int]) -> None:
    """Register one host buffer, print its address and the agent's metadata, serve READs until stdin closes."""
    import numpy as np

    agent = _nixl_agent("bare")
    buf = np.full(max(sizes), 7, np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    print(json.dumps({"addr": buf.ctypes.data, "md": base64.b64encode(agent.get_agent_metadata()).decode()}),
          flush=True)
    sys.stdin.read()  # until the reader is done
    agent.deregister_memory(reg)


def _spawn(*args: str) -> tuple[subprocess.Popen[str], str]:
    from .runner import _child_env

    p = subprocess.Popen([sys.executable, "-m", "dmabuf_interop.cli.bench.remote", *args], env=_child_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    if not line:
        p.kill()
        p.wait(30)
        raise RuntimeError(f"the {args[1]} process exited without starting (its stderr is above)")
    return p, line


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
    spec = ["--sizes", ",".join(map(str, sizes)), "--count", str(warmup + reps)]
    p, line = _spawn("--role", "producer", "--address", "tcp://127.0.0.1:0", *spec)
    channel = _channel_rate(line.split()[1], sizes, warmup, reps, True)
    p.communicate(timeout=timeout)
    p, line = _spawn("--role", "bare", *spec)
    try:
        bare = _bare_rate(json.loads(line), sizes, warmup, reps, timeout)
    finally:
        p.communicate("", timeout=60)
    with tempfile.TemporaryDirectory(prefix="dmabuf-interop-bench-") as d:
        p, line = _spawn("--role", "producer", "--address", os.path.join(d, "s"), *spec)
        local = _channel_rate(line.split()[1], sizes, warmup, reps, False)
        p.communicate(timeout=timeout)
    return [{"bytes": s, "reps": reps, "channel_gbs": channel[s], "nixl_gbs": bare[s],
             "overhead_pct": 100.0 * (bare[s] - channel[s]) / bare[s], "local_gbs": local[s]} for s in sizes]


def bench(args: argparse.Namespace) -> int:
    """``dmabuf-interop bench --remote``: measure, print the table, write ``--json``; the exit status."""
    import shlex

    from ...errors import NotSupportedError
    from .report import size_label, write_json

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
        met = "met" if r["overhead_pct"] <= OVERHEAD_TARGET_PCT else "not met"
        print(f"{size_label(r['bytes']):>9} {r['channel_gbs']:>13.2f} {r['nixl_gbs']:>10.2f} "
              f"{r['overhead_pct']:>8.1f}% {r['local_gbs']:>11.1f}  {met}")
    if args.json:
        write_json({"schema": 1, "command": "dmabuf-interop " + shlex.join(sys.argv[1:]),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "ucx_tls": tls, "ucx_net_devices": devices,
                    "overhead_target_pct": OVERHEAD_TARGET_PCT, "rows": rows}, args.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The peer processes of :func:`run` (``--role producer|bare``)."""
    from .._units import parse_size

    ap = argparse.ArgumentParser(prog="python -m dmabuf_interop.cli.bench.remote")
    ap.add_argument("--role", choices=["producer", "bare"], required=True)
    ap.add_argument("--address")
    ap.add_argument("--sizes", required=True)
    ap.add_argument("--count", type=int, required=True)
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.role == "producer":
        _producer(args.address, sizes, args.count)
    else:
        _bare_producer(sizes)
    return 0


if __name__ == "__main__":
    from ...procs import leave_interrupts_to_parent

    leave_interrupts_to_parent()
    sys.exit(main())
