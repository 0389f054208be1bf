"""``bench remote``: a tcp:// channel on loopback against a bare NIXL READ loop and a local channel.

    python -m dmabuf_interop.cli.bench.remote [--sizes 1M,64M,1G] [--iters N] [--json]

Three measurements per size, in one run, host memory, one peer process each:
``channel`` (``recv`` + release over a tcp:// channel: control message, one
NIXL READ into the receiver's pool, release message), ``nixl`` (the same READ
with two bare agents: ``initialize_xfer`` once, ``transfer`` +
``check_xfer_state`` per iteration) and ``local`` (``recv`` + release over an
AF_UNIX channel: zero-copy, no bytes move). GB/s is 1e9 bytes per second.
UCX is pinned to ``UCX_TLS=tcp UCX_NET_DEVICES=lo`` unless the caller set them.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["main", "run"]

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    return int(text[:-1]) * _UNITS[text[-1].upper()] if text[-1].upper() in _UNITS else int(text)


def _iters(size: int, iters: int | None) -> int:
    return iters or max(3, min(50, (512 << 20) // size))


def _pool(sizes: list[int]) -> Any:
    from ...channel import SharedPool

    top = max(sizes)
    return SharedPool(None, chunk_bytes=top + (1 << 20), max_bytes=2 * (top + (1 << 20)))


def _producer(address: str, sizes: list[int], iters: int | None) -> None:
    from ...channel import listen

    pool = _pool(sizes)
    with listen(address, pool=pool) as listener:
        print(f"listening {listener.address}", flush=True)
        ch = listener.accept(120)
        for size in sizes:
            a = pool.empty(size, "uint8")
            a[:] = 7
            leases = [ch.send(a, timeout=120) for _ in range(_iters(size, iters))]
            for lease in leases:
                lease.wait(300)
            del a
        ch.close()
    pool.close()


def _bare_producer(sizes: list[int]) -> None:
    import numpy as np

    from ...channel.remote import nixl_module

    nixl = nixl_module()
    agent = nixl.nixl_agent(f"bench-bare-{os.getpid()}", nixl.nixl_agent_config(backends=["UCX"]))
    buf = np.full(max(sizes), 7, np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    print(json.dumps({"addr": buf.ctypes.data, "md": base64.b64encode(agent.get_agent_metadata()).decode()}),
          flush=True)
    sys.stdin.read()  # until the consumer is done
    agent.deregister_memory(reg)


def _spawn(*args: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "dmabuf_interop.cli.bench.remote", *args], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    return p, p.stdout.readline().strip()


def _channel_rate(address: str, sizes: list[int], iters: int | None, token_env: bool) -> dict[int, float]:
    from ...channel import connect

    pool = _pool(sizes) if token_env else None
    out = {}
    with connect(address, timeout=60, pool=pool) as ch:
        for size in sizes:
            n = _iters(size, iters)
            ch.recv(120).release()  # the first READ of a size also registers the receiving chunk
            t = time.perf_counter()
            for _ in range(n - 1):
                ch.recv(120).release()
            out[size] = size * (n - 1) / (time.perf_counter() - t) / 1e9
    if pool is not None:
        pool.close()
    return out


def _bare_rate(info: dict[str, Any], sizes: list[int], iters: int | None) -> dict[int, float]:
    import numpy as np

    from ...channel.remote import nixl_module

    nixl = nixl_module()
    agent = nixl.nixl_agent(f"bench-bare-reader-{os.getpid()}", nixl.nixl_agent_config(backends=["UCX"]))
    remote = agent.add_remote_agent(base64.b64decode(info["md"]))
    dst = np.zeros(max(sizes), np.uint8)
    reg = agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    out = {}
    for size in sizes:
        n = _iters(size, iters)
        h = agent.initialize_xfer("READ", agent.get_xfer_descs([(dst.ctypes.data, size, 0)], "DRAM"),
                                  agent.get_xfer_descs([(info["addr"], size, 0)], "DRAM"), remote)
        t = None
        for i in range(n):
            if i == 1:
                t = time.perf_counter()
            state = agent.transfer(h)
            spins = 0
            while state == "PROC":
                spins += 1
                if spins > 50:
                    time.sleep(0.0002)
                state = agent.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"bare NIXL READ ended in state {state}")
        out[size] = size * (n - 1) / (time.perf_counter() - t) / 1e9
        h.release()
    agent.deregister_memory(reg)
    return out


def run(sizes: list[int], iters: int | None = None) -> list[dict[str, Any]]:
    """Rows ``{"bytes", "iters", "channel_gbs", "nixl_gbs", "overhead_pct", "local_gbs"}``."""
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("DMABUF_INTEROP_TOKEN", secrets.token_hex(32))
    spec = ",".join(str(s) for s in sizes)
    extra = ["--iters", str(iters)] if iters else []
    p, line = _spawn("--role", "producer", "--address", "tcp://127.0.0.1:0", "--sizes", spec, *extra)
    channel = _channel_rate(line.split()[1], sizes, iters, True)
    p.communicate(timeout=300)
    p, line = _spawn("--role", "bare", "--sizes", spec)
    bare = _bare_rate(json.loads(line), sizes, iters)
    p.communicate("", timeout=60)
    with tempfile.TemporaryDirectory() as d:
        p, line = _spawn("--role", "producer", "--address", os.path.join(d, "s"), "--sizes", spec, *extra)
        local = _channel_rate(line.split()[1], sizes, iters, False)
        p.communicate(timeout=300)
    return [{"bytes": s, "iters": _iters(s, iters), "channel_gbs": channel[s], "nixl_gbs": bare[s],
             "overhead_pct": 100.0 * (bare[s] - channel[s]) / bare[s], "local_gbs": local[s]} for s in sizes]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dmabuf-interop bench remote", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,64M,1G", help="comma-separated sizes (K/M/G suffixes, powers of 2)")
    ap.add_argument("--iters", type=int, default=None, help="iterations per size (default: 3..50 by size)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--role", choices=["producer", "bare"], help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [_size(s) for s in args.sizes.split(",")]
    if args.role == "producer":
        _producer(args.address, sizes, args.iters)
        return 0
    if args.role == "bare":
        _bare_producer(sizes)
        return 0
    rows = run(sizes, args.iters)
    if args.json:
        print(json.dumps({"ucx_tls": os.environ["UCX_TLS"], "ucx_net_devices": os.environ["UCX_NET_DEVICES"],
                          "rows": rows}, indent=2))
        return 0
    print(f"tcp:// channel vs bare NIXL READ vs local channel (host memory, UCX_TLS={os.environ['UCX_TLS']} "
          f"UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']})")
    print(f"{'size':>10} {'iters':>5} {'channel GB/s':>13} {'NIXL GB/s':>10} {'overhead':>9} {'local GB/s':>11}")
    for r in rows:
        print(f"{r['bytes']:>10} {r['iters']:>5} {r['channel_gbs']:>13.2f} {r['nixl_gbs']:>10.2f} "
              f"{r['overhead_pct']:>8.1f}% {r['local_gbs']:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
