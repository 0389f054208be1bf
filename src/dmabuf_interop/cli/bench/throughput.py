"""Throughput: hand-offs per second, one producer and one consumer, sends pipelined (channels and iceoryx2).

The producer lends ``size``-byte blocks of a :class:`~dmabuf_interop.channel.SharedPool`
(zero-copy, ``pool.empty``) from a ring of :data:`IN_FLIGHT`, waiting for a block's lease only
when the ring comes round to it; the consumer receives and releases each. The rate is the
consumer's: hand-offs after :data:`WARMUP` divided by the time they took. Both ends run as
separate processes started here (:mod:`.child`).

Growth is reported beside the rate: each process's open fds, and for a device pool the free
device memory (``cuMemGetInfo``), after :data:`WARMUP` hand-offs and after the last; and the
producer's pool capacity against the bytes live (the blocks lent), whose difference is the pool's
overhead. Both ends pass ``ring=`` to ``listen`` / ``connect`` as the mechanism says
(:data:`~.catalog.CHANNELS`: ``channel-socket`` and ``channel-host-socket`` refuse the shared-memory
ring) and report whether their connection used it (``Channel.ring``).

iceoryx2 (:mod:`.iceoryx`) the same way: the publisher loans, sends and notifies ``size``-byte samples
with up to :data:`IN_FLIGHT` queued at the subscriber (a full queue holds the publisher back:
``RetryUntilDelivered``, no sample dropped); the subscriber receives each (waiting in its listener when
none is queued) and deletes it. Its producer starts sending when the parent relays that the
consumer has subscribed (a publisher drops what it sends before a subscriber is there).
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from typing import Any

from ...fdpass import recv_message
from .catalog import CHANNELS, CUDA_FREE
from .child import finish, report, serve, start

#: Blocks lent at once.
IN_FLIGHT = 32
#: Hand-offs received before the clock starts.
WARMUP = 1000


def measure(mechanism: str, devices: tuple[int, int], count: int = 100_000, size: int = 1 << 20,
            timeout: float = 120.0) -> dict[str, Any]:
    """Run one producer and one consumer of ``mechanism`` (one of :data:`~.catalog.CHANNELS`, or ``iceoryx2``);
    ``{"status", "per_second", "count", "size", ...}`` (a channel's with ``ring``: both ends' connections
    used the shared-memory ring), or ``{"status": "error", "reason"}``."""
    iceoryx = mechanism == "iceoryx2"
    role = "iceoryx2-" if iceoryx else ""
    with tempfile.TemporaryDirectory(prefix="dmabuf-interop-bench-") as tmp:
        cfg = {"address": os.path.join(tmp, "tput.sock"), "host": mechanism in CUDA_FREE, "devices": list(devices),
               "ring": CHANNELS.get(mechanism, False),
               "count": count, "size": size, "timeout": timeout,
               "service": f"dmabuf-interop-bench/{os.getpid()}/throughput"}
        producer = start("throughput", role + "producer", cfg)
        children, results = [producer], []
        try:
            ready = producer.result(timeout)
            if not ready.get("ready"):
                results = [ready]
                return {"status": "error", "reason": ready.get("reason") or "producer failed"}
            children.append(start("throughput", role + "consumer", cfg))
            if iceoryx:
                subscribed = children[1].result(timeout)
                if not subscribed.get("ready"):
                    results = [subscribed, {"status": "error"}]
                    return {"status": "error", "reason": subscribed.get("reason") or "consumer failed"}
                producer.send({"go": True})
            results = [children[1].result(timeout), producer.result(timeout)]
        finally:  # the children in the order of their results: the consumer's first
            finish(list(reversed(children)), timeout, results or [{"status": "error"}])
        consumed, produced = results
        if consumed.get("status") != "ok":
            return {"status": "error", "reason": consumed.get("reason") or "consumer failed"}
        if iceoryx and produced.get("status") != "ok":
            return {"status": "error", "reason": produced.get("reason") or "producer failed"}
        out = {"status": "ok", **consumed["result"]}
        if produced.get("status") == "ok":
            out["producer"] = produced["result"]
            producer_ring = out["producer"].pop("ring", None)
            if "ring" in out:  # the ring only if both ends' connections use it
                out["ring"] = bool(out["ring"] and producer_ring)
        return out


def _fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir used


def _free_device_memory(device: int | None) -> int | None:
    if device is None:
        return None
    from ... import _driver as driver

    driver.set_current(device)
    return driver.mem_get_info()[0]


def _producer(cfg: dict[str, Any], ctl: socket.socket, _socks: list[socket.socket]) -> dict[str, Any]:
    from ..._checks import round_up
    from ...channel import ALIGN, SharedPool, listen

    size, n = cfg["size"], cfg["count"]
    room = (IN_FLIGHT + 2) * size
    with SharedPool(None if cfg["host"] else cfg["devices"][0], chunk_bytes=min(64 << 20, room),
                    max_bytes=room + (64 << 20)) as pool, \
            listen(cfg["address"], pool=pool, ring=cfg["ring"]) as listener:
        report(ctl, {"ready": True})
        ch = listener.accept(timeout=cfg["timeout"])
        ring = [pool.empty(size, "uint8", timeout=cfg["timeout"]) for _ in range(IN_FLIGHT)]
        leases: list[Any] = [None] * IN_FLIGHT
        device = pool.device
        at = {}
        for i in range(n):
            if i == WARMUP:
                at = {"fds": _fds(), "free": _free_device_memory(device)}
            slot = i % IN_FLIGHT
            if leases[slot] is not None:
                leases[slot].wait(cfg["timeout"])
            leases[slot] = ch.send(ring[slot], timeout=cfg["timeout"])
        for lease in leases:
            if lease is not None:
                lease.wait(cfg["timeout"])
        free = _free_device_memory(device)
        result = {"fds_grew": _fds() - at["fds"],
                  "free_device_memory_fell": None if free is None else at["free"] - free,
                  "pool_capacity": pool.capacity, "live_bytes": IN_FLIGHT * round_up(size, ALIGN),
                  "chunk_bytes": pool.chunk_bytes, "ring": ch.ring}
        ch.close()
    return result


def _consumer(cfg: dict[str, Any], _ctl: socket.socket, _socks: list[socket.socket]) -> dict[str, Any]:
    from ...channel import connect

    n = cfg["count"]
    with connect(cfg["address"], timeout=cfg["timeout"], device=None if cfg["host"] else cfg["devices"][1],
                 ring=cfg["ring"]) as ch:
        t0 = 0.0
        fds0 = 0
        for i in range(n):
            if i == WARMUP:
                t0 = time.perf_counter()
                fds0 = _fds()
            ch.recv(cfg["timeout"]).release()
        elapsed = time.perf_counter() - t0
        fds_grew = _fds() - fds0
        ring = ch.ring
    return {"per_second": round((n - WARMUP) / elapsed), "count": n - WARMUP, "size": cfg["size"],
            "in_flight": IN_FLIGHT, "host": cfg["host"], "consumer_fds_grew": fds_grew, "ring": ring}


def _iceoryx2_producer(cfg: dict[str, Any], ctl: socket.socket, _socks: list[socket.socket]) -> dict[str, Any]:
    from .iceoryx import iceoryx2, node, services

    iox2 = iceoryx2()
    ps, ev = services(iox2, node(iox2), cfg["service"], IN_FLIGHT, create=True)
    publisher = (ps.publisher_builder().initial_max_slice_len(cfg["size"])
                 .allocation_strategy(iox2.AllocationStrategy.Static)
                 .backpressure_strategy(iox2.BackpressureStrategy.RetryUntilDelivered).create())
    notifier = ev.notifier_builder().create()
    report(ctl, {"ready": True})
    recv_message(ctl, cfg["timeout"], max_fds=0)  # the parent's go: the consumer has subscribed
    size = cfg["size"]
    for _ in range(cfg["count"]):
        publisher.loan_slice_uninit(size).assume_init().send()
        notifier.notify()
    publisher.delete()
    notifier.delete()
    return {}


def _iceoryx2_consumer(cfg: dict[str, Any], ctl: socket.socket, _socks: list[socket.socket]) -> dict[str, Any]:
    from ...errors import WaitTimeoutError
    from .iceoryx import iceoryx2, node, services, wait_sample

    iox2 = iceoryx2()
    ps, ev = services(iox2, node(iox2), cfg["service"], IN_FLIGHT, create=False)
    subscriber = ps.subscriber_builder().create()
    listener = ev.listener_builder().create()
    report(ctl, {"ready": True})
    n = cfg["count"]
    t0 = 0.0
    for i in range(n):
        if i == WARMUP:
            t0 = time.perf_counter()
        sample = wait_sample(iox2, subscriber, listener, cfg["timeout"], 0.0)
        if sample is None:
            raise WaitTimeoutError(f"no sample from the publisher within {cfg['timeout']:g} s")
        sample.delete()
    elapsed = time.perf_counter() - t0
    subscriber.delete()
    listener.delete()
    return {"per_second": round((n - WARMUP) / elapsed), "count": n - WARMUP, "size": cfg["size"],
            "in_flight": IN_FLIGHT, "host": True}


if __name__ == "__main__":
    sys.exit(serve({"producer": _producer, "consumer": _consumer, "iceoryx2-producer": _iceoryx2_producer,
                    "iceoryx2-consumer": _iceoryx2_consumer}))
