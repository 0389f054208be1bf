"""Channel throughput: hand-offs per second, one producer and one consumer, sends pipelined.

The producer lends ``size``-byte blocks of a :class:`~dmabuf_interop.channel.SharedPool`
(zero-copy, ``pool.empty``) from a ring of :data:`IN_FLIGHT`, waiting for a block's lease only
when the ring comes round to it; the consumer receives and releases each. The rate is the
consumer's: hand-offs after :data:`WARMUP` divided by the time they took. Both ends run as
separate processes started here (``python -m dmabuf_interop.cli.bench.throughput``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

#: Blocks lent at once.
IN_FLIGHT = 32
#: Hand-offs received before the clock starts.
WARMUP = 1000


def measure(host: bool, devices: tuple[int, int], count: int = 20000, size: int = 1 << 20,
            timeout: float = 120.0) -> dict[str, Any]:
    """Run one producer and one consumer; ``{"status", "per_second", "count", "size", ...}``."""
    with tempfile.TemporaryDirectory(prefix="dmabuf-interop-bench-") as tmp:
        address = os.path.join(tmp, "tput.sock")
        args = [json.dumps({"address": address, "host": host, "devices": list(devices), "count": count,
                            "size": size, "timeout": timeout})]
        cmd = [sys.executable, "-m", "dmabuf_interop.cli.bench.throughput"]
        producer = subprocess.Popen(cmd + ["producer"] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        try:
            line = producer.stdout.readline() if producer.stdout else ""  # "listening"
            if line.strip() != "listening":
                _, err = producer.communicate(timeout=timeout)
                return {"status": "error", "reason": (err.strip().splitlines() or ["producer failed"])[-1]}
            consumer = subprocess.run(cmd + ["consumer"] + args, capture_output=True, text=True, timeout=timeout)
            producer.communicate(timeout=timeout)
        finally:
            if producer.poll() is None:
                producer.kill()
                producer.wait()
        if consumer.returncode != 0:
            return {"status": "error", "reason": (consumer.stderr.strip().splitlines() or ["consumer failed"])[-1]}
        return {"status": "ok", **json.loads(consumer.stdout.strip().splitlines()[-1])}


def _producer(cfg: dict[str, Any]) -> None:
    from ...channel import SharedPool, listen

    size, n = cfg["size"], cfg["count"]
    room = (IN_FLIGHT + 2) * size
    with SharedPool(None if cfg["host"] else cfg["devices"][0], chunk_bytes=min(64 << 20, room),
                    max_bytes=room + (64 << 20)) as pool, listen(cfg["address"], pool=pool) as listener:
        print("listening", flush=True)
        ch = listener.accept(timeout=cfg["timeout"])
        ring = [pool.empty(size, "uint8", timeout=cfg["timeout"]) for _ in range(IN_FLIGHT)]
        leases: list[Any] = [None] * IN_FLIGHT
        for i in range(n):
            slot = i % IN_FLIGHT
            if leases[slot] is not None:
                leases[slot].wait(cfg["timeout"])
            leases[slot] = ch.send(ring[slot], timeout=cfg["timeout"])
        for lease in leases:
            if lease is not None:
                lease.wait(cfg["timeout"])
        ch.close()


def _consumer(cfg: dict[str, Any]) -> None:
    from ...channel import connect

    n = cfg["count"]
    with connect(cfg["address"], timeout=cfg["timeout"], device=None if cfg["host"] else cfg["devices"][1]) as ch:
        t0 = 0.0
        for i in range(n):
            if i == WARMUP:
                t0 = time.perf_counter()
            ch.recv(cfg["timeout"]).release()
        elapsed = time.perf_counter() - t0
    print(json.dumps({"per_second": round((n - WARMUP) / elapsed), "count": n - WARMUP, "size": cfg["size"],
                      "in_flight": IN_FLIGHT, "host": cfg["host"]}))


if __name__ == "__main__":
    from ...procs import leave_interrupts_to_parent

    leave_interrupts_to_parent()
    role, raw = sys.argv[1], json.loads(sys.argv[2])
    {"producer": _producer, "consumer": _consumer}[role](raw)
