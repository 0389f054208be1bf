#!/usr/bin/env python3
"""How short a host hand-off can be from Python: the fewest steps that keep the channel's guarantees, between two
processes, paced as ``dmabuf-interop bench`` paces the channel.

    PYTHONPATH=src python3 scripts/handoff_floor.py [--count 3000] [--skip 200]

Not a channel: no handshake, no socket protocol, one fixed ring of 8 layouts known to both sides. It measures what
a steady-state hand-off costs when it is written as one straight run of calls, so that the channel's figure
(``dmabuf-interop bench --mechanisms channel-host``) can be read against it. Per hand-off, the producer looks its
array up by signature (address, shape, strides, dtype), references the block, makes a lease (a lock held while it
is out) and records it under a lock, and publishes a slot of the channel's ring format (``_ring_region.SLOT``:
``_atomic.publish``, then ``_atomic.store_load`` of the tail and the peer's ``asleep`` word) under a second lock.
The consumer spins on the tail (``_atomic.load``), copies the slot out and checks its ``seq``, lease and ordering,
looks the layout up, refuses a lease it already holds, makes a record with a ``weakref.finalize`` safety net,
builds a NumPy view (``HostView``, as ``Received.as_array``) and reads the first 4 bytes; then it releases (the
finalizer detached) and acks by a socketpair, which wakes the producer for the next hand-off as the bench's ack
does. Printed: the median and p90 from the producer's first step to the read, in µs (``time.monotonic_ns``, one
clock for both processes), over the hand-offs after the first ``--skip``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import statistics
import struct
import sys
import threading
import time
import weakref

_BLOCKS = 8
_BLOCK_BYTES = 4096
_MASK = 255  # 256 slots


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=3000, help="hand-offs (default 3000)")
    ap.add_argument("--skip", type=int, default=200, help="the first hand-offs left out of the figures (default 200)")
    args = ap.parse_args()
    if not 0 <= args.skip < args.count:
        ap.error("--skip must be at least 0 and below --count")

    import numpy as np

    from dmabuf_interop import _atomic
    from dmabuf_interop.channel._ring_region import SLOT, SLOT_BYTES, SLOTS_OFFSET

    ring = mmap.mmap(-1, SLOTS_OFFSET + 256 * SLOT_BYTES)  # shared with the child: MAP_SHARED | MAP_ANONYMOUS
    peer = mmap.mmap(-1, 4096)  # the consumer's header: its "asleep" word, never set here (it spins)
    chunk = mmap.mmap(-1, _BLOCKS * _BLOCK_BYTES)
    publish, store_load, address = _atomic.publish, _atomic.store_load, _atomic.address
    tail_at, asleep_at, mask = 0, 8, _MASK  # (the words' offsets in this sketch's header)
    mono = time.monotonic_ns
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        try:
            ours.close()
            _consume(args.count, theirs, ring, chunk)
        finally:
            os._exit(0)
    theirs.close()
    blocks = [np.frombuffer(chunk, np.uint8, _BLOCK_BYTES, i * _BLOCK_BYTES) for i in range(_BLOCKS)]
    memos = {(False, ((address(b), b.shape, b.strides, b.dtype),)): (i, [i]) for i, b in enumerate(blocks)}
    refs = [0] * _BLOCKS
    lent: dict[int, Lease] = {}
    state, link = threading.RLock(), threading.Lock()
    tail, started = 0, []
    for i in range(args.count):
        array = blocks[i % _BLOCKS]
        t0 = mono()
        layout, held = memos[(False, ((address(array), array.shape, array.strides, array.dtype),))]
        for b in held:
            refs[b] += 1
        lease = Lease(i + 1, held)
        with state:
            lent[lease.id] = lease
        with link:
            slot = SLOT.pack(tail + 1, 0, lease.id, layout, 0, 0, b"")
            publish(ring, SLOTS_OFFSET + (tail & mask) * SLOT_BYTES, slot)
            tail += 1
            store_load(ring, tail_at, tail, peer, asleep_at)
        started.append(t0)
        if ours.recv(1) != b"k":  # the consumer's ack: it has read and released
            raise SystemExit("handoff_floor: the consumer stopped")
        with state:
            lent.pop(lease.id)
        for b in held:
            refs[b] -= 1
        lease.out.release()
    data = b""
    while len(data) < 8 * args.count:
        more = ours.recv(1 << 20)
        if not more:
            raise SystemExit("handoff_floor: the consumer's stamps were cut short")
        data += more
    os.waitpid(pid, 0)
    read = struct.unpack(f"<{args.count}q", data)
    took = sorted((t1 - t0) / 1e3 for t0, t1 in zip(started[args.skip:], read[args.skip:]))
    print(f"floor: median {statistics.median(took):.2f} µs, p90 {took[int(len(took) * 0.9)]:.2f} µs, "
          f"{len(took)} hand-offs")
    return 0


class Lease:
    __slots__ = ("id", "blocks", "out")

    def __init__(self, lease_id: int, blocks: list[int]) -> None:
        self.id, self.blocks = lease_id, blocks
        self.out = threading.Lock()
        self.out.acquire()


class Record:
    __slots__ = ("lease", "desc", "fin", "__weakref__")


def _consume(count: int, sock: socket.socket, ring: mmap.mmap, chunk: mmap.mmap) -> None:
    import numpy as np

    from dmabuf_interop._atomic import address, load
    from dmabuf_interop.channel._ring_region import LEASE_LIMIT, SLOT, SLOT_BYTES, SLOTS_OFFSET
    from dmabuf_interop.channel.arrays import HostView

    mask, mono = _MASK, time.monotonic_ns
    base = address(np.frombuffer(chunk, np.uint8))
    layouts = {i: ((_BLOCK_BYTES,), (1,), "|u1", i * _BLOCK_BYTES) for i in range(_BLOCKS)}
    held: dict[int, Record] = {}
    head, stamps = 0, []
    for _ in range(count):
        while load(ring, 0) <= head:  # spin
            pass
        seq, _sock_seq, lease, layout, code, has_event, _event = SLOT.unpack_from(
            ring, SLOTS_OFFSET + (head & mask) * SLOT_BYTES)
        if seq != head + 1 or not 0 < lease < LEASE_LIMIT or code > 2 or has_event:
            raise SystemExit(f"handoff_floor: a bad slot at {head}")
        head += 1
        desc = layouts.get(layout)
        if desc is None or lease in held:
            raise SystemExit(f"handoff_floor: layout {layout} or lease {lease} refused")
        rec = Record()
        rec.lease, rec.desc = lease, desc
        held[lease] = rec
        rec.fin = weakref.finalize(rec, held.pop, lease, None)
        view = np.asarray(HostView(base + desc[3], desc[0], desc[1], desc[2], (rec, chunk)))
        int.from_bytes(view.data[:4], "little")
        stamps.append(mono())
        rec.fin.detach()
        held.pop(lease, None)
        del view, rec
        sock.send(b"k")
    sock.sendall(struct.pack(f"<{count}q", *stamps))


if __name__ == "__main__":
    sys.exit(main())
